// What every binding shares: arrays (anything that speaks DLPack: torch, NumPy, CuPy, JAX) become
// fusekit TensorViews without a copy, the caller's stream becomes an adopted fk::Stream, and an
// argument fusekit cannot take is an fk::Error naming the op and the argument, as in C++.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <optional>
#include <string>

#include "fusekit/core/error.hpp"
#include "fusekit/core/stream.hpp"
#include "fusekit/core/tensor.hpp"

namespace fk::py {

namespace nb = nanobind;
using Array = nb::ndarray<nb::ro>;  // any dtype, shape, strides and device (writability is not asked of DLPack)

// The view of `a` (its dtype, shape and strides in elements, its device). Throws fk::Error(op,
// arg, ...) for a dtype fusekit has no kernels for or a device other than the CPU or a CUDA GPU.
TensorView view(const Array& a, const char* op, const char* arg);
std::optional<TensorView> view(const std::optional<Array>& a, const char* op, const char* arg);

// The stream an op runs on: the caller's CUDA stream (a cudaStream_t as an integer, 0 for the
// legacy default stream) on the device of `like`, adopted; none for host tensors.
class StreamArg {
 public:
  StreamArg(std::uintptr_t handle, const TensorView& like);
  const Stream* get() const noexcept { return stream_ ? &*stream_ : nullptr; }

 private:
  std::optional<Stream> stream_;
};

}  // namespace fk::py
