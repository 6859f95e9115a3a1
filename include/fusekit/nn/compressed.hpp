// Layers that keep their activations for the backward pass compressed (family `quant`):
//
//   CompressedLinear  y = x Wᵀ + b. Keeps x packed (pack(), 1-8 bits) instead of x itself; the
//                     backward computes dx = dy W (cuBLAS on the GPU), dW = dyᵀ unpack(x)
//                     straight from the packed bits (weight_grad_from_packed), db = column sums
//                     of dy. Without a PackParams it keeps x as is: the uncompressed baseline.
//   CompressedReLU    y = relu(x), keeping its mask at one bit per element.
//
// Gradients are overwritten (=) by each backward, not accumulated. Every tensor of a layer has
// the layer's dtype: f32 on the CPU (the spec path), bf16 on the GPU (the packed weight
// gradient reads bf16 dy). There is no autograd: a model calls backward in reverse order.
#pragma once

#include <cstdint>
#include <optional>

#include "fusekit/ops/quant.hpp"

namespace fk::nn {

class CompressedLinear {
 public:
  // W and b uniform in [-1/sqrt(in), 1/sqrt(in)) from the Philox stream `seed`, as PyTorch's
  // Linear initialises them.
  CompressedLinear(std::int64_t in, std::int64_t out, std::optional<PackParams> compress, DType dtype, Device device,
                   std::uint64_t seed);

  // y [N, out] = x [N, in] Wᵀ + b; keeps x (packed, or whole) for backward.
  void forward(const TensorView& x, const TensorView& y, const Stream* stream = nullptr);
  // From dy [N, out]: weight_grad, bias_grad, and dx [N, in] when dx is given.
  void backward(const TensorView& dy, const std::optional<TensorView>& dx, const Stream* stream = nullptr);

  Tensor weight;       // [out, in]
  Tensor bias;         // [out]
  Tensor weight_grad;  // [out, in]
  Tensor bias_grad;    // [out]

  // Bytes kept for backward after the last forward, and what keeping x itself would take.
  std::size_t saved_bytes() const noexcept;
  std::size_t uncompressed_bytes() const noexcept { return saved_uncompressed_; }

 private:
  std::int64_t in_, out_;
  std::optional<PackParams> compress_;
  PackedTensor packed_;  // when compressing
  Tensor saved_;         // when not
  std::size_t saved_uncompressed_ = 0;
};

class CompressedReLU {
 public:
  void forward(const TensorView& x, const TensorView& y, const Stream* stream = nullptr);
  void backward(const TensorView& dy, const TensorView& dx, const Stream* stream = nullptr);
  std::size_t saved_bytes() const noexcept { return mask_.nbytes(); }
  std::size_t uncompressed_bytes() const noexcept { return saved_uncompressed_; }

 private:
  Tensor mask_;
  std::size_t saved_uncompressed_ = 0;
};

// param -= lr * grad (same dtype and shape).
void sgd_step(const TensorView& param, const TensorView& grad, float lr, const Stream* stream = nullptr);

}  // namespace fk::nn
