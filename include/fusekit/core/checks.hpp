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

// Whether two views of one dtype provably share no element, though their spans may interleave:
// column blocks of one row-major matrix, say (q's and k's heads side by side in each row of a
// [tokens, (Hq + Hk) D] matrix). For some pitch R among their strides, every dimension whose
// stride is not a multiple of R spans less than R elements (the view's "columns": offsets
// [0, extent) modulo R from its first element), and the two views' columns modulo R, their first
// elements apart, do not meet. False where this does not prove it (then they may overlap).
inline bool disjoint_elements(const TensorView& x, const TensorView& y) {
  if (x.numel() == 0 || y.numel() == 0) return true;
  const std::int64_t esize = static_cast<std::int64_t>(dtype_size(x.dtype()));
  if (y.dtype() != x.dtype()) return false;
  const auto gap_bytes = reinterpret_cast<std::intptr_t>(y.data()) - reinterpret_cast<std::intptr_t>(x.data());
  if (gap_bytes % esize != 0) return false;
  const std::int64_t gap = static_cast<std::int64_t>(gap_bytes) / esize;
  // The extent modulo r of a view's columns (dimensions of stride not a multiple of r), or -1
  // when they reach r or a stride is negative.
  const auto columns = [](const TensorView& t, std::int64_t r) -> std::int64_t {
    std::int64_t last = 0;
    for (int i = 0; i < t.rank(); ++i) {
      const std::int64_t n = t.size(i), s = t.strides()[i];
      if (s < 0) return -1;
      if (n > 1 && s % r != 0) last += (n - 1) * s;
    }
    return last + 1 <= r ? last + 1 : -1;
  };
  for (const TensorView* v : {&x, &y})
    for (int i = 0; i < v->rank(); ++i) {
      const std::int64_t r = v->strides()[i];
      if (v->size(i) <= 1 || r <= 1) continue;
      const std::int64_t cx = columns(x, r), cy = columns(y, r);
      if (cx < 0 || cy < 0) continue;
      const std::int64_t b = ((gap % r) + r) % r;  // y's first column, x's being 0
      if (cx <= b && b + cy <= r) return true;
    }
  return false;
}

}  // namespace fk::checks
