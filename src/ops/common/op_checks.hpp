// Argument checks private to the op families, over the public ones in fusekit/core/checks.hpp:
// each throws fk::Error naming the op and argument.
#pragma once

#include <fmt/format.h>

#include <initializer_list>
#include <iterator>
#include <string>
#include <utility>

#include "fusekit/core/checks.hpp"
#include "fusekit/core/error.hpp"
#include "fusekit/core/stream.hpp"
#include "fusekit/core/tensor.hpp"

namespace fk::checks {

// A tensor that goes with `ref`: the given shape, ref's dtype (an output, a bias, a gradient).
inline void companion(const char* op, const char* arg, const TensorView& t, const TensorView& ref, const Dims& shape) {
  tensor(op, arg, t, static_cast<int>(shape.size()));
  same_dtype(op, arg, t, ref);
  shape_is(op, arg, t, shape);
  same_device(op, arg, t, ref.device());
}

// The floating dtypes of the GEMM-shaped families (f32 through TF32 where they allow it).
inline constexpr std::initializer_list<DType> kFloatTypes = {DType::f32, DType::bf16, DType::f16};

// A named tensor for the aliasing checks (absent optionals are skipped).
struct Named {
  const char* name;
  const TensorView* t;
};

// Each output overlaps no input and no other output; throws naming the output and what it
// overlaps.
inline void outputs_disjoint(const char* op, std::initializer_list<Named> outputs, std::initializer_list<Named> inputs) {
  for (auto o = outputs.begin(); o != outputs.end(); ++o) {
    if (!o->t) continue;
    auto refuse = [&](const Named& other) {
      if (other.t && overlaps(*o->t, *other.t))
        throw Error(op, o->name, fmt::format("memory that does not overlap {}", other.name), "an overlapping tensor");
    };
    for (const Named& in : inputs) refuse(in);
    for (auto p = std::next(o); p != outputs.end(); ++p) refuse(*p);
  }
}

// Whether no two elements of t share memory (what an output needs): sorted by stride, each
// dimension's stride at least the extent of the dimensions before it.
inline bool distinct_elements(const TensorView& t) {
  if (t.numel() == 0) return true;
  std::int64_t stride[kMaxRank], size[kMaxRank];
  int n = 0;
  for (int i = 0; i < t.rank(); ++i)
    if (t.size(i) > 1) stride[n] = t.strides()[i], size[n++] = t.size(i);
  for (int i = 1; i < n; ++i)  // insertion sort by stride: at most kMaxRank dimensions
    for (int j = i; j > 0 && stride[j] < stride[j - 1]; --j) std::swap(stride[j], stride[j - 1]), std::swap(size[j], size[j - 1]);
  std::int64_t extent = 1;
  for (int i = 0; i < n; ++i) {
    if (stride[i] < extent) return false;
    extent = stride[i] * size[i];
  }
  return true;
}

// A tensor read (output: written) in place through its strides: rank `rank`, stride 1 on the last
// dimension, non-negative strides on the others, non-null data unless empty; an output's elements
// in distinct places.
inline void rows_tensor(const char* op, const char* arg, const TensorView& t, int rank, bool output) {
  FK_CHECK_ARG(t.rank() == rank, op, arg, "a rank-" + std::to_string(rank) + " tensor", t.str());
  bool ok = t.numel() == 0 || t.strides()[rank - 1] == 1 || t.size(rank - 1) == 1;
  for (int i = 0; i < rank; ++i) ok = ok && t.strides()[i] >= 0;
  FK_CHECK_ARG(ok, op, arg, "stride 1 on the last dimension and non-negative strides", t.str());
  if (output)
    FK_CHECK_ARG(distinct_elements(t), op, arg, "an output whose elements do not share memory", t.str());
  FK_CHECK_ARG(t.data() != nullptr || t.numel() == 0, op, arg, "non-null data", "a null pointer");
}

// The legacy default stream (null) belongs to whichever device is current; an owned stream to one.
inline void check_stream(const char* op, const Stream* stream, Device dev) {
  if (stream && stream->handle() && dev.is_cuda())
    FK_CHECK_ARG(stream->device() == dev, op, "stream", fmt::format("a stream on {}", dev.str()),
                 fmt::format("a stream on {}", stream->device().str()));
}

// Raises a clear error when a CUDA tensor reaches a build without CUDA.
inline void cuda_available(const char* op, Device device) {
  FK_CHECK_ARG(device.is_cpu() || FUSEKIT_WITH_CUDA, op, "device",
               "cpu (fusekit was built without CUDA)", device.str());
}

}  // namespace fk::checks
