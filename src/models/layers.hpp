// The CPU layers DLRM is built from (float32, host tensors, contiguous). Each has forward /
// backward; backward overwrites (=) its gradients. They are the reference the GPU layers will be
// tested against, so they are written plainly; the GEMMs go through the blocked CPU sgemm.
#pragma once

#include <cstdint>
#include <vector>

#include "fusekit/core/tensor.hpp"
#include "fusekit/models/dlrm.hpp"
#include "fusekit/ops/recsys.hpp"

namespace fk::models::cpu {

// y [B, out] = x [B, in] Wᵀ + b, with an optional ReLU.
class Linear {
 public:
  // W ~ N(0, sqrt(2 / (in + out))), b ~ N(0, sqrt(1 / out)) from Philox (seed, subsequence).
  Linear(std::int64_t in, std::int64_t out, bool relu, std::uint64_t seed, std::uint64_t subsequence);
  std::int64_t in() const noexcept { return weight.size(1); }
  std::int64_t out() const noexcept { return weight.size(0); }
  bool relu() const noexcept { return relu_; }

  // x [B, in] must stay unchanged until backward; y [B, out].
  void forward(const float* x, std::int64_t batch, float* y) const;
  // From dy [B, out] (modified in place: the ReLU mask from y is applied): weight_grad,
  // bias_grad, and dx [B, in] when dx is not null.
  void backward(const float* x, const float* y, float* dy, std::int64_t batch, float* dx);

  Tensor weight, bias, weight_grad, bias_grad;

 private:
  bool relu_;
};

// Linear layers of the given sizes; ReLU after each, except after the last when !relu_last.
class Mlp {
 public:
  Mlp(const std::vector<std::int64_t>& sizes, bool relu_last, std::uint64_t seed, std::uint64_t first_subsequence);
  // x [B, sizes[0]] -> y [B, sizes.back()]; keeps the activations for backward, and a pointer
  // to x, which must stay unchanged until backward (not copied: DLRM's top-MLP input can be
  // hundreds of MB with the outer interaction).
  void forward(const float* x, std::int64_t batch, float* y);
  // dy [B, out] -> gradients, and dx [B, in] when dx is not null.
  void backward(const float* dy, float* dx);
  std::vector<Linear> layers;

 private:
  std::int64_t batch_ = 0;
  const float* input_ = nullptr;
  std::vector<std::vector<float>> acts_;  // acts_[l] = output of layer l - 1 (acts_[0] unused)
  std::vector<float> grad_a_, grad_b_;
};

// One table per feature, sum pooling over CSR bags (the DlrmInput layout); writes bag (t, b) to
// out[b * out_stride + t * D + ...] so that the bags land straight in Z.
class EmbeddingBagCollection {
 public:
  EmbeddingBagCollection(const std::vector<std::int64_t>& rows, std::int64_t dim, std::uint64_t seed,
                         std::uint64_t first_subsequence);
  std::int64_t num_tables() const noexcept { return static_cast<std::int64_t>(tables.size()); }
  // Checks the indices against the table sizes (fk::Error on a bad one) and keeps them for backward.
  void forward(const TensorView& indices, const TensorView& offsets, std::int64_t batch, float* out,
               std::int64_t out_stride);
  // From the gradient of the pooled bags (same layout as forward's out): grads[t] per table.
  void backward(const float* dout, std::int64_t out_stride);
  void step(const OptimizerConfig& opt);

  std::int64_t dim;
  std::vector<Tensor> tables;        // [rows_t, D]
  std::vector<SparseGrad> grads;     // after backward
  std::vector<Tensor> adagrad_state; // [rows_t, D], allocated on the first Adagrad step

 private:
  std::int64_t batch_ = 0;
  std::vector<std::int64_t> indices_, offsets_;
};

// Z [B, F, D] -> R [B, interaction_size]; backward gives dZ (=). The recsys family's spec
// (ops/recsys.hpp) on host memory.
class Interaction {
 public:
  Interaction(InteractionOp op, std::int64_t features, std::int64_t dim, bool itself);
  std::int64_t output_size() const noexcept { return out_; }
  void forward(const float* z, std::int64_t batch, float* r) const;
  void backward(const float* z, const float* dr, std::int64_t batch, float* dz) const;

 private:
  InteractionParams params_;
  std::int64_t f_, d_, out_;
  DotPairs pairs_;  // dot: the output order
};

// PyTorch's update rules on one dense parameter: SGD, or Adagrad with its state tensor.
void optimizer_update(const OptimizerConfig& opt, float* param, const float* grad, float* state, std::int64_t n);

}  // namespace fk::models::cpu
