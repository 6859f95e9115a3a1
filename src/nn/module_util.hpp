// Helpers shared by the nn modules' implementations.
#pragma once

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

}  // namespace fk::nn::detail
