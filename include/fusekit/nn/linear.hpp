// The dense layers models are built from:
//
//   Linear  y = act(x Wᵀ + b)          x [B, in], W [out, in], b [out], y [B, out]
//   MLP     Linear layers of given sizes, act after each (after the last one too, or not)
//
// Forward is one GEMM with the bias and the activation in its epilogue (ops/gemm: cuBLASLt on
// the GPU), act ∈ identity, relu, gelu_tanh. Backward takes dy and overwrites it (=) with
// dz = dy ⊙ act'(z) while summing db (one pointwise pass, bias_act_backward: deterministic), then
// dW = dzᵀ x and, when asked, dx = dz W. relu's derivative comes from y; gelu's from the
// pre-activation, which the forward then keeps (the gelu_aux_bias epilogue writes it).
//
// Parameters and gradients are tensors of the layer's dtype and device (f32 everywhere; bf16 and
// f16 on the GPU); gradients are overwritten by each backward. Initialisation is the DLRM
// reference's: W ~ N(0, sqrt(2 / (in + out))), b ~ N(0, sqrt(1 / out)), drawn on the host from
// Philox (seed, subsequence) and (seed, subsequence + 2^32), so every device starts equal.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "fusekit/core/random.hpp"
#include "fusekit/core/tensor.hpp"
#include "fusekit/ops/pointwise.hpp"

namespace fk::nn {

struct LinearOptions {
  Activation act = Activation::identity;  // identity, relu or gelu_tanh
  bool allow_tf32 = false;                // f32 GEMMs on TF32 tensor cores (GPU)
};

class Linear {
 public:
  Linear(std::int64_t in, std::int64_t out, LinearOptions options, DType dtype, Device device, RandomParams init);
  std::int64_t in() const noexcept { return weight.size(1); }
  std::int64_t out() const noexcept { return weight.size(0); }
  const LinearOptions& options() const noexcept { return options_; }

  // y [B, out] = act(x [B, in] Wᵀ + b).
  void forward(const TensorView& x, const TensorView& y, const Stream* stream = nullptr);
  // x and y as given to the last forward; dy [B, out] is overwritten with dz. Writes weight_grad,
  // bias_grad, and dx [B, in] when given (dx may not overlap dy).
  void backward(const TensorView& x, const TensorView& y, const TensorView& dy, const std::optional<TensorView>& dx,
                const Stream* stream = nullptr);

  Tensor weight, bias, weight_grad, bias_grad;

 private:
  LinearOptions options_;
  Tensor preact_;  // gelu: z of the last forward
};

class MLP {
 public:
  // sizes = {in, h1, ..., out}; act after every layer, after the last one only when act_last.
  MLP(const std::vector<std::int64_t>& sizes, Activation act, bool act_last, bool allow_tf32, DType dtype,
      Device device, RandomParams init);

  // x [B, sizes.front()] -> y [B, sizes.back()]. Keeps the hidden activations, and x by
  // reference: x must stay unchanged until backward.
  void forward(const TensorView& x, const TensorView& y, const Stream* stream = nullptr);
  // From dy [B, out] (overwritten): every layer's gradients, and dx [B, in] when given. y is the
  // last forward's output.
  void backward(const TensorView& y, const TensorView& dy, const std::optional<TensorView>& dx,
                const Stream* stream = nullptr);

  std::vector<Linear> layers;

 private:
  TensorView input_;
  std::vector<Tensor> hidden_;  // hidden_[l] = output of layer l, l < layers - 1
  std::vector<Tensor> grad_;    // gradient of each hidden output
};

}  // namespace fk::nn
