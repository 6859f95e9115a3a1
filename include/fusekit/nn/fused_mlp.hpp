// FusedMLP (family `mlp`): a narrow MLP evaluated by the fused kernels of ops/mlp.hpp,
//
//   h_0 = x,  h_{l+1} = act(h_l W_lᵀ + b_l) (hidden layers),  y = out_act(h W_{L-1}ᵀ + b_{L-1})
//   x [batch, in] -> hidden_layers x [batch, hidden] -> y [batch, out]
//
// forward runs fused_mlp_forward_train (one kernel) and keeps x (a copy), the hidden outputs
// [L-1, batch, hidden] and, when out_act is not the identity, y (a copy); backward runs
// fused_mlp_backward (one kernel for the gradients through the layers and db, cuBLAS for dW).
// Weights and biases in the layer's dtype (bf16 or f16; on the CPU the spec runs), gradients in
// f32, overwritten by each backward. Initialisation as torch.nn.Linear: uniform in
// [-1/sqrt(fan_in), 1/sqrt(fan_in)).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "fusekit/ops/mlp.hpp"

namespace fk::nn {

class FusedMLP {
 public:
  // hidden_layers >= 1 hidden layers of width `hidden` (16, 32, 64 or 128): hidden_layers + 1
  // weight matrices.
  FusedMLP(std::int64_t in, std::int64_t hidden, int hidden_layers, std::int64_t out, Activation act,
           Activation out_act, DType dtype, Device device, std::uint64_t seed);

  void forward(const TensorView& x, const TensorView& y, const Stream* stream = nullptr);
  void backward(const TensorView& dy, const std::optional<TensorView>& dx, const Stream* stream = nullptr);

  // The layers as the ops take them (views of weight / bias).
  std::vector<MlpLayer> layers() const;
  // [W_0, b_0, W_1, b_1, ...] and their gradients in the same order.
  std::vector<TensorView> params() const;
  std::vector<TensorView> grads() const;

  std::vector<Tensor> weight, bias;            // [out_l, in_l], [out_l]; the layer's dtype
  std::vector<Tensor> weight_grad, bias_grad;  // f32

  // Bytes kept between forward and backward.
  std::size_t saved_bytes() const noexcept {
    return saved_x_.nbytes() + saved_hidden_.nbytes() + saved_y_.nbytes();
  }

 private:
  std::int64_t in_, hidden_, out_;
  std::vector<Activation> act_;
  Tensor saved_x_, saved_hidden_, saved_y_;
};

}  // namespace fk::nn
