// Argument checks shared by the op families: each throws fk::Error naming the op and argument.
#pragma once

#include <fmt/format.h>

#include <functional>
#include <initializer_list>
#include <iterator>
#include <string>

#include "fusekit/core/error.hpp"
#include "fusekit/core/stream.hpp"
#include "fusekit/core/tensor.hpp"

namespace fk::checks {

inline std::string dtype_list(std::initializer_list<DType> ok) {
  std::string s;
  for (DType d : ok) s += (s.empty() ? "" : " or ") + std::string(dtype_name(d));
  return s;
}

// A tensor an op reads or writes: rank, contiguity, non-null data unless empty.
inline void tensor(const char* op, const char* arg, const TensorView& t, int rank) {
  FK_CHECK_ARG(t.rank() == rank, op, arg, fmt::format("a rank-{} tensor", rank), t.str());
  FK_CHECK_ARG(t.is_contiguous(), op, arg, "a contiguous (row-major) tensor", t.str());
  FK_CHECK_ARG(t.data() != nullptr || t.numel() == 0, op, arg, "non-null data", "a null pointer");
}

inline void dtype_in(const char* op, const char* arg, const TensorView& t, std::initializer_list<DType> ok) {
  for (DType d : ok)
    if (t.dtype() == d) return;
  throw Error(op, arg, fmt::format("dtype {}", dtype_list(ok)), std::string(dtype_name(t.dtype())));
}

inline void same_dtype(const char* op, const char* arg, const TensorView& t, const TensorView& ref) {
  FK_CHECK_ARG(t.dtype() == ref.dtype(), op, arg, fmt::format("dtype {}", dtype_name(ref.dtype())),
               std::string(dtype_name(t.dtype())));
}

inline void shape_is(const char* op, const char* arg, const TensorView& t, const Dims& shape) {
  FK_CHECK_ARG(t.shape() == shape, op, arg, fmt::format("shape {}", shape.str()), t.shape().str());
}

inline void same_device(const char* op, const char* arg, const TensorView& t, Device device) {
  FK_CHECK_ARG(t.device() == device, op, arg, fmt::format("a tensor on {}", device.str()), t.device().str());
}

// A tensor that goes with `ref`: the given shape, ref's dtype (an output, a bias, a gradient).
inline void companion(const char* op, const char* arg, const TensorView& t, const TensorView& ref, const Dims& shape) {
  tensor(op, arg, t, static_cast<int>(shape.size()));
  same_dtype(op, arg, t, ref);
  shape_is(op, arg, t, shape);
  same_device(op, arg, t, ref.device());
}

// The floating dtypes of the GEMM-shaped families (f32 through TF32 where they allow it).
inline constexpr std::initializer_list<DType> kFloatTypes = {DType::f32, DType::bf16, DType::f16};

// Bytes from a view's first element to just past its last (its span in memory; nbytes() for a
// contiguous view). Strides are non-negative in every view an op accepts.
inline std::int64_t span_bytes(const TensorView& t) {
  if (t.numel() == 0) return 0;
  std::int64_t last = 0;
  for (int i = 0; i < t.rank(); ++i) last += (t.size(i) - 1) * t.strides()[i];
  return (last + 1) * static_cast<std::int64_t>(dtype_size(t.dtype()));
}

// Whether two views' spans share a byte.
inline bool overlaps(const TensorView& x, const TensorView& y) {
  if (x.numel() == 0 || y.numel() == 0) return false;
  const auto* x0 = static_cast<const unsigned char*>(x.data());
  const auto* y0 = static_cast<const unsigned char*>(y.data());
  // std::less gives a total order on unrelated pointers, where < would be unspecified.
  return std::less<>{}(x0, y0 + span_bytes(y)) && std::less<>{}(y0, x0 + span_bytes(x));
}

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
