// Helpers shared by the nn modules' implementations.
#pragma once

#include <fmt/format.h>

#include "fusekit/core/checks.hpp"
#include "fusekit/core/random.hpp"
#include "fusekit/core/stream.hpp"
#include "fusekit/core/tensor.hpp"

namespace fk::nn::detail {

// A copy of x that outlives the caller's tensor, ordered after the work queued on `stream`.
inline Tensor keep(const TensorView& x, const Stream* stream) {
  if (stream != nullptr) stream->synchronize();  // copy() is ordered on the legacy stream only
  Tensor t = Tensor::empty(x.shape(), x.dtype(), x.device());
  copy(t, x);
  return t;
}

// U(-bound, bound) drawn on the host from Philox `key` (the same numbers on every device), then
// copied to `device`.
inline Tensor uniform(Dims shape, float bound, DType dtype, Device device, RandomParams key) {
  Tensor h = Tensor::empty(shape, dtype, Device::cpu());
  fill_uniform(h, -bound, bound, key);
  return h.copy_to(device);
}

// A layer's input x [rows, in]: rank 2, contiguous, the weight's dtype and device.
inline void check_layer_input(const char* op, const TensorView& x, const Tensor& weight, std::int64_t in) {
  checks::tensor(op, "x", x, 2);
  checks::same_dtype(op, "x", x, weight);
  checks::same_device(op, "x", x, weight.device());
  FK_CHECK_ARG(x.size(1) == in, op, "x", fmt::format("[rows, {}]", in), x.shape().str());
}

}  // namespace fk::nn::detail
