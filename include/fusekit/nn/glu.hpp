// GLUFeedForward (family `glu`): the feed-forward block of LLMs,
//
//   y = glu(x W1ᵀ + b1) W2ᵀ + b2,   x [T, d_in], W1 [2H, d_in], W2 [d_out, H], y [T, d_out]
//
// The first GEMM and the gated activation are one fused kernel (glu_forward); the second is a
// cuBLAS GEMM with the bias added in one pointwise pass. Backward: dh = dy W2, dW2 = dyᵀ h,
// db2 = column sums of dy, then glu_backward gives dx, dW1 and db1 (recomputing the
// pre-activations; the layer keeps x and h = glu(...) for backward).
//
// W1 and b1 are held in glu's prepared layout (and so are their gradients): `weight1_torch()`
// gives them back in PyTorch's. Initialisation as torch.nn.Linear: uniform in
// [-1/sqrt(fan_in), 1/sqrt(fan_in)). Gradients are overwritten by each backward. Any float dtype
// on any device; f32 on a GPU goes through TF32 when `allow_tf32` is set.
#pragma once

#include <cstdint>
#include <optional>

#include "fusekit/ops/glu.hpp"

namespace fk::nn {

class GLUFeedForward {
 public:
  GLUFeedForward(std::int64_t d_in, std::int64_t hidden, std::int64_t d_out, GluOptions opt, DType dtype,
                 Device device, std::uint64_t seed);

  void forward(const TensorView& x, const TensorView& y, const Stream* stream = nullptr);
  void backward(const TensorView& dy, const std::optional<TensorView>& dx, const Stream* stream = nullptr);

  // W1 [2H, d_in] and b1 [2H] in PyTorch's layout (rows 0..H-1 the gate half).
  Tensor weight1_torch() const { return glu_unprepare_weight(weight1); }
  Tensor bias1_torch() const { return glu_unprepare_weight(bias1); }

  Tensor weight1, bias1, weight2, bias2;                  // W1, b1 prepared
  Tensor weight1_grad, bias1_grad, weight2_grad, bias2_grad;

  // Bytes kept between forward and backward (x and h).
  std::size_t saved_bytes() const noexcept { return saved_x_.nbytes() + saved_h_.nbytes(); }

 private:
  std::int64_t d_in_, hidden_, d_out_;
  GluOptions opt_;
  Tensor saved_x_, saved_h_;
};

}  // namespace fk::nn
