// Argument checks for functions over TensorViews (the ops and the nn layers): each throws
// fk::Error naming the function and the argument, with what was expected and what came.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <string>

#include "fusekit/core/error.hpp"
#include "fusekit/core/tensor.hpp"

namespace fk::checks {

inline std::string dtype_list(std::initializer_list<DType> ok) {
  std::string s;
  for (DType d : ok) s += (s.empty() ? "" : " or ") + std::string(dtype_name(d));
  return s;
}

// A tensor an op reads or writes: rank, contiguity, non-null data unless empty.
inline void tensor(const char* op, const char* arg, const TensorView& t, int rank) {
  FK_CHECK_ARG(t.rank() == rank, op, arg, "a rank-" + std::to_string(rank) + " tensor", t.str());
  FK_CHECK_ARG(t.is_contiguous(), op, arg, "a contiguous (row-major) tensor", t.str());
  FK_CHECK_ARG(t.data() != nullptr || t.numel() == 0, op, arg, "non-null data", "a null pointer");
}

inline void dtype_in(const char* op, const char* arg, const TensorView& t, std::initializer_list<DType> ok) {
  for (DType d : ok)
    if (t.dtype() == d) return;
  throw Error(op, arg, "dtype " + dtype_list(ok), std::string(dtype_name(t.dtype())));
}

inline void same_dtype(const char* op, const char* arg, const TensorView& t, const TensorView& ref) {
  FK_CHECK_ARG(t.dtype() == ref.dtype(), op, arg, "dtype " + std::string(dtype_name(ref.dtype())),
               std::string(dtype_name(t.dtype())));
}

inline void shape_is(const char* op, const char* arg, const TensorView& t, const Dims& shape) {
  FK_CHECK_ARG(t.shape() == shape, op, arg, "shape " + shape.str(), t.shape().str());
}

inline void same_device(const char* op, const char* arg, const TensorView& t, Device device) {
  FK_CHECK_ARG(t.device() == device, op, arg, "a tensor on " + device.str(), t.device().str());
}

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

}  // namespace fk::checks
