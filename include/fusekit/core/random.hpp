// Filling tensors with reproducible random numbers from the Philox stream (seed, subsequence).
// The CPU and CUDA paths give bit-identical results for uniform fills; normal fills agree to the
// last bit of the float math libraries (log, sqrt, cos), which differ by at most an ulp or two.
#pragma once

#include <cstdint>

#include "fusekit/core/tensor.hpp"

namespace fk {

struct RandomParams {
  std::uint64_t seed = 0;
  std::uint64_t subsequence = 0;  // independent streams under one seed
};

// x[i] = lo + (hi - lo) * u_i, u_i uniform in [0, 1). Floating dtypes only; contiguous.
void fill_uniform(const TensorView& t, float lo, float hi, RandomParams p, const Stream* stream = nullptr);
// x[i] = mean + std * n_i, n_i standard normal (Box-Muller on consecutive uniform pairs).
void fill_normal(const TensorView& t, float mean, float std, RandomParams p, const Stream* stream = nullptr);

// A Philox offset kept in memory, for random draws in work replayed as a CUDA graph: a kernel given
// it (PackParams::offset_counter) reads it when it runs, so each replay draws what the counter
// holds then, where an offset passed by value would repeat the captured one. advance_offset adds
// `by` to it (wrapping) in stream order, a launch a graph captures like any other. counter: i64 [1]
// holding the offset's bits, on the host (updated at once) or a GPU.
void advance_offset(const TensorView& counter, std::uint64_t by, const Stream* stream = nullptr);

}  // namespace fk
