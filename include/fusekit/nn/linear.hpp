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
#include "fusekit/ops/mlp.hpp"
#include "fusekit/ops/pointwise.hpp"

namespace fk::nn {

struct LinearOptions {
  Activation act = Activation::identity;  // identity, relu or gelu_tanh
  bool allow_tf32 = false;                // f32 GEMMs on TF32 tensor cores (GPU)
  // false: the unfused baseline (what a plain framework port runs): a GEMM, then the bias and the
  // activation as two pointwise passes; backward: the activation's derivative, then db, as two.
  bool fused = true;
  // The weight's row stride (0: in). Wider than `in`, W is stored [out, in] with zero padding
  // columns and every GEMM runs over K = in_stride: x and dx are then read and written as
  // [B, in_stride] through their row stride (>= in_stride), and x's padding columns must be zero.
  // This gives 16-byte aligned rows (in_stride a multiple of 4 floats) to TF32 tensor cores.
  std::int64_t in_stride = 0;
};

class ParameterArena;

class Linear {
 public:
  Linear(std::int64_t in, std::int64_t out, LinearOptions options, DType dtype, Device device, RandomParams init);
  // f32 parameters and gradients taken from `arena` (on its device), so that one launch updates them.
  Linear(std::int64_t in, std::int64_t out, LinearOptions options, RandomParams init, ParameterArena& arena);
  // The floats such a layer takes from an arena.
  static std::int64_t arena_floats(std::int64_t in, std::int64_t out, std::int64_t in_stride = 0);
  std::int64_t in() const noexcept { return weight.size(1); }
  // The K of the layer's GEMMs (options().in_stride, or in).
  std::int64_t k() const noexcept { return options_.in_stride == 0 ? in() : options_.in_stride; }
  std::int64_t out() const noexcept { return weight.size(0); }
  const LinearOptions& options() const noexcept { return options_; }

  // y [B, out] = act(x [B, in] Wᵀ + b). x, y (and backward's dy, dx) are rows: rank 2, inner
  // stride 1, any row stride >= their columns.
  void forward(const TensorView& x, const TensorView& y, const Stream* stream = nullptr);
  // x and y as given to the last forward; dy [B, out] is overwritten with dz. Writes weight_grad,
  // bias_grad, and dx [B, in] when given (dx may not overlap dy).
  void backward(const TensorView& x, const TensorView& y, const TensorView& dy, const std::optional<TensorView>& dx,
                const Stream* stream = nullptr);

  Tensor weight, bias, weight_grad, bias_grad;

 private:
  void check_options(const char* op, std::int64_t in, std::int64_t out, DType dtype) const;
  LinearOptions options_;
  Tensor preact_;  // gelu: z of the last forward
};

class MLP {
 public:
  // sizes = {in, h1, ..., out}; act after every layer, after the last one only when act_last.
  MLP(const std::vector<std::int64_t>& sizes, Activation act, bool act_last, bool allow_tf32, DType dtype,
      Device device, RandomParams init);
  // f32 layers in `arena`. Layer l uses options.in_stride = sizes[l] rounded up to `pad_to`
  // (1: no padding), and the hidden activations are kept with the same padded row stride (their
  // padding columns zero), so the first layer's x needs a row stride >= its padded size and zero
  // padding columns. fused as LinearOptions::fused.
  struct ArenaOptions {
    Activation act = Activation::relu;
    bool act_last = true;
    bool allow_tf32 = false;
    bool fused = true;
    std::int64_t pad_to = 1;
    // Run the whole MLP as one fused_mlp kernel each way (ops/mlp.hpp), in bf16: the arena's fp32
    // parameters are the master copies (converted to bf16 by every forward) and the fp32
    // gradients are written straight into the arena. The sizes must fit (fits_fused_kernel); the
    // layers are then not padded (pad_to is ignored).
    bool fused_kernel = false;
  };
  MLP(const std::vector<std::int64_t>& sizes, const ArenaOptions& options, RandomParams init, ParameterArena& arena);
  static std::int64_t arena_floats(const std::vector<std::int64_t>& sizes, std::int64_t pad_to = 1);
  // Whether fused_mlp takes these sizes: two layers or more, input and output <= 128, every hidden
  // layer one width of 16, 32, 64 or 128.
  static bool fits_fused_kernel(const std::vector<std::int64_t>& sizes);

  // Allocates the hidden activations and their gradients for batches up to `batch` (forward does
  // it when a batch is larger), so that later batches allocate nothing (a CUDA graph may capture them).
  void reserve(std::int64_t batch, const Stream* stream = nullptr);

  // x [B, sizes.front()] -> y [B, sizes.back()] (rows, as Linear). Keeps the hidden activations,
  // and x by reference: x must stay unchanged until backward.
  void forward(const TensorView& x, const TensorView& y, const Stream* stream = nullptr);
  // From dy [B, out] (overwritten): every layer's gradients, and dx [B, in] when given. y is the
  // last forward's output.
  void backward(const TensorView& y, const TensorView& dy, const std::optional<TensorView>& dx,
                const Stream* stream = nullptr);

  std::vector<Linear> layers;

 private:
  TensorView input_;
  std::int64_t batch_ = 0, capacity_ = 0;
  std::vector<Tensor> hidden_;  // hidden_[l] = output of layer l, l < layers - 1: [capacity, stride]
  std::vector<Tensor> grad_;    // gradient of each hidden output, same layout
  // Rows [0, batch) of hidden_[l] or grad_[l], the layer's out columns, the buffer's row stride.
  TensorView rows(const Tensor& t, std::size_t l) const;
  // fused_kernel: bf16 copies of the parameters (the arena range [first weight, last bias]) and of
  // the batch tensors the kernels read and write.
  bool fused_kernel_ = false;
  std::int64_t kernel_floats_ = 0;
  Tensor w16_, x16_, y16_, hidden16_, dy16_, dx16_;
  std::vector<MlpLayer> kernel_layers() const;
  TensorView bf16_rows(const Tensor& t, std::int64_t cols) const;
  void kernel_forward(const TensorView& x, const TensorView& y, const Stream* stream);
  void kernel_backward(const TensorView& dy, const std::optional<TensorView>& dx, const Stream* stream);
};

}  // namespace fk::nn
