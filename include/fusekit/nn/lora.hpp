// LoRALinear (family `lora`): a frozen linear layer with a trainable low-rank adapter,
//
//   y = act(x Wᵀ + b + s (x Aᵀ) Bᵀ),   x [T, d_in], W [d_out, d_in], A [r, d_in], B [d_out, r]
//
// forward is lora_forward (one tensor-core GEMM with the rank-r term in its epilogue on Hopper);
// backward is lora_backward: gradients of A, B and (when `train_bias`) b, and dx; W is frozen and
// gets none. The layer keeps x, t = s x Aᵀ [T, r] and the pre-activation z [T, d_out] (written by
// the forward's epilogue) for the backward. Initialisation as in the LoRA paper: W, b and A
// uniform in [-1/sqrt(d_in), 1/sqrt(d_in)), B zero (the adapter starts as a no-op). Gradients are
// overwritten by each backward. Any float dtype on any device.
#pragma once

#include <cstdint>
#include <optional>

#include "fusekit/ops/lora.hpp"

namespace fk::nn {

class LoRALinear {
 public:
  LoRALinear(std::int64_t d_in, std::int64_t d_out, std::int64_t rank, LoraParams params, bool train_bias,
             DType dtype, Device device, std::uint64_t seed);

  void forward(const TensorView& x, const TensorView& y, const Stream* stream = nullptr);
  void backward(const TensorView& dy, const std::optional<TensorView>& dx, const Stream* stream = nullptr);

  Tensor weight, bias;            // frozen: W [d_out, d_in], b [d_out]
  Tensor lora_a, lora_b;          // A [r, d_in], B [d_out, r]
  Tensor lora_a_grad, lora_b_grad;
  Tensor bias_grad;               // [d_out] when train_bias, else empty

  // Bytes kept between forward and backward: x, t, and y when the activation's derivative comes
  // from its output (identity, relu, sigmoid, tanh: the forward then needs no z, and at r <= 16 on
  // sm_90 computes t inside its GEMM), else z.
  std::size_t saved_bytes() const noexcept { return saved_x_.nbytes() + saved_t_.nbytes() + saved_.nbytes(); }

 private:
  std::int64_t d_in_, d_out_, rank_;
  LoraParams params_;
  bool train_bias_;
  Tensor saved_x_, saved_t_, saved_;  // saved_: y or z, as saved_kind_ says
  SavedForBackward saved_kind_ = SavedForBackward::preactivation;
};

}  // namespace fk::nn
