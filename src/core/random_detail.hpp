// Shared between random.cpp (dispatch, CPU path) and random.cu (CUDA path).
#pragma once

#include <cstdint>

#include "fusekit/core/philox.hpp"
#include "fusekit/core/random.hpp"

namespace fk::detail {

enum class Distribution { uniform, normal };

// a + b*x with both operations rounded separately on host and device alike: nvcc would otherwise
// contract it into one fma and the two streams would differ in the last bit.
FK_HOST_DEVICE float add_mul(float a, float b, float x) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, __fmul_rn(b, x));
#else
  return a + b * x;
#endif
}

// Four values of the distribution from one Philox block: uniform a + b*u, or normal a + b*n
// with n from Box-Muller on the pairs (w0, w1) and (w2, w3).
template <class Log, class Sqrt, class SinCos>
FK_HOST_DEVICE void transform_block(const philox::U32x4& w, Distribution d, float a, float b, float out[4],
                                    Log log_f, Sqrt sqrt_f, SinCos sincos_f) {
  if (d == Distribution::uniform) {
    for (int j = 0; j < 4; ++j) out[j] = add_mul(a, b, philox::to_unit_float(w.v[j]));
    return;
  }
  for (int j = 0; j < 4; j += 2) {
    // u1 in (0, 1] so that log(u1) is finite.
    const float u1 = static_cast<float>((w.v[j] >> 8) + 1) * (1.0f / 16777216.0f);
    const float u2 = philox::to_unit_float(w.v[j + 1]);
    const float radius = sqrt_f(-2.0f * log_f(u1));
    float s, c;
    sincos_f(6.283185307179586f * u2, s, c);
    out[j] = add_mul(a, b, radius * c);
    out[j + 1] = add_mul(a, b, radius * s);
  }
}

void fill_random_cuda(const TensorView& t, Distribution d, float a, float b, RandomParams p, void* stream);
void advance_offset_cuda(std::uint64_t* counter, std::uint64_t by, void* stream);

}  // namespace fk::detail
