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
//
// Activation compression (MLP::ArenaOptions::compress, family quant): the MLP keeps each layer's
// input packed at 8, 4 or 2 bits (stochastic rounding) and each hidden ReLU's mask at one bit
// instead of the f32 activations; the backward takes dW straight from the packed input
// (weight_grad_from_packed) and the ReLU derivative from the mask. The full-precision activations
// and gradients then live only while forward or backward runs, in two [B, width] scratch buffers
// that every layer takes in turn, and that MLPs run one after the other can share (share_scratch).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "fusekit/core/random.hpp"
#include "fusekit/core/tensor.hpp"
#include "fusekit/ops/mlp.hpp"
#include "fusekit/ops/pointwise.hpp"
#include "fusekit/ops/quant.hpp"

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

  // Scratch of backward_packed: dz as weight_grad_from_packed reads it, a contiguous [B, out] of
  // packed_dz_dtype(device); with k() > in(), dw f32 [out, k()] (contiguous), from which only the
  // in() columns reach weight_grad (its padding columns stay zero). Otherwise dw is not read.
  struct PackedScratch {
    TensorView dz, dw;
  };
  // The dtype weight_grad_from_packed reads dz in: f32 on the CPU (the spec), bf16 on a GPU.
  static DType packed_dz_dtype(Device device) noexcept { return device.is_cpu() ? DType::f32 : DType::bf16; }
  // backward with x kept packed (pack() of x seen as [B, k()], its padding columns included): dW
  // from the packed bits (weight_grad_from_packed), never unpacked. dz = dy ⊙ act'(z) from y as
  // backward computes it; without y, dy holds dz already (the caller applied the activation's
  // derivative, e.g. from a ReLU mask) and only db is summed from it. f32 layers (an arena's).
  void backward_packed(const PackedView& x, const std::optional<TensorView>& y, const TensorView& dy,
                       const std::optional<TensorView>& dx, const PackedScratch& scratch, const Stream* stream = nullptr);

  Tensor weight, bias, weight_grad, bias_grad;

 private:
  void check_options(const char* op, std::int64_t in, std::int64_t out, DType dtype) const;
  // dy := dz = dy ⊙ act'(z) (act' from y, or gelu's kept z), bias_grad = column sums of dz.
  void activation_backward(const char* op, const TensorView& y, const TensorView& dy, const Stream* stream);
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
    // Activation compression: keep each layer's input packed at compress->bits (8, 4 or 2) and
    // each hidden ReLU's mask at one bit for the backward (see the header). act relu or identity;
    // not with fused_kernel. group (a multiple of 32) caps the group size: layer l's rows are
    // packed in groups of a power of two from 32 to `group`, the largest that stores no more
    // values (whole groups) than any other (a 368-wide row: 3 groups of 128).
    // Stochastic rounding draws from Philox (seed, offset + l * 2^40 + step), step the number of
    // backward passes so far, a counter on the device (offset_counter is the MLP's own), so that
    // a CUDA graph of the step draws anew at each replay. nullopt: keep the f32 activations.
    std::optional<PackParams> compress;
  };
  MLP(const std::vector<std::int64_t>& sizes, const ArenaOptions& options, RandomParams init, ParameterArena& arena);
  static std::int64_t arena_floats(const std::vector<std::int64_t>& sizes, std::int64_t pad_to = 1);
  // Whether fused_mlp takes these sizes: two layers or more, input and output <= 128, every hidden
  // layer one width of 16, 32, 64 or 128.
  static bool fits_fused_kernel(const std::vector<std::int64_t>& sizes);

  // Allocates the hidden activations and their gradients (compressed: the packed inputs, the
  // masks and the scratch) for batches up to `batch` (forward does it when a batch is larger), so
  // that later batches allocate nothing (a CUDA graph may capture them).
  void reserve(std::int64_t batch, const Stream* stream = nullptr);
  // Compressed: use one scratch (the buffers of the full-precision activations and gradients,
  // which hold nothing between calls) with `other`, a compressed MLP on the same device whose
  // forward and backward never run while this one's do (the same stream, say). Sized for both.
  void share_scratch(MLP& other);

  // x [B, sizes.front()] -> y [B, sizes.back()] (rows, as Linear). Keeps the hidden activations,
  // and x by reference: x must stay unchanged until backward. Compressed, it keeps x packed
  // instead, and x's rows must be contiguous at the first layer's padded width ([B, k] rows).
  void forward(const TensorView& x, const TensorView& y, const Stream* stream = nullptr);
  // From dy [B, out] (overwritten): every layer's gradients, and dx [B, in] when given. y is the
  // last forward's output. layer_done(l), when given, is called for each layer l from the last to
  // the first as soon as its weight and bias gradients are final (done on the CPU; queued on
  // `stream` on a GPU), so that a data-parallel caller can start reducing them while the layers
  // below run (the fused kernel makes every layer's at once: all calls come after it).
  void backward(const TensorView& y, const TensorView& dy, const std::optional<TensorView>& dx,
                const Stream* stream = nullptr, const std::function<void(std::size_t)>& layer_done = {});

  // Bytes for a forward and backward of `batch` rows. whole: every layer's input [B, k] in the
  // layers' dtype (x included, which an uncompressed MLP keeps by reference), what the backward
  // needs; kept: what is kept for it from the forward to the backward (whole uncompressed;
  // compressed, the packed inputs with their statistics and the ReLU masks); scratch: the
  // buffers that hold activations or gradients only while forward or backward runs (uncompressed:
  // the hidden gradients, fused_kernel's bf16 copies aside; compressed: the two f32 buffers and
  // the backward's dz and dW scratch, one set for the MLPs that share it).
  struct SavedActivationBytes {
    std::size_t whole = 0, kept = 0, scratch = 0;
  };
  SavedActivationBytes saved_activation_bytes(std::int64_t batch) const;
  // Compressed: the backward passes so far (the rounding's step), and setting it, so that a
  // resumed run continues the draws of the run it resumes. Synchronous copies of device memory:
  // the work queued on other streams must be done. 0 and a no-op without compression.
  std::uint64_t rounding_step() const;
  void set_rounding_step(std::uint64_t step);
  bool compressed() const noexcept { return compress_.has_value(); }

  std::vector<Linear> layers;

 private:
  TensorView input_;
  std::int64_t batch_ = 0, capacity_ = 0;
  std::vector<Tensor> hidden_;  // hidden_[l] = output of layer l, l < layers - 1: [capacity, stride]
  std::vector<Tensor> grad_;    // gradient of each hidden output, same layout
  // Rows [0, batch) of hidden_[l] or grad_[l], the layer's out columns, the buffer's row stride.
  TensorView rows(const Tensor& t, std::size_t l) const;
  // Compression (compress_ set): hidden_ and grad_ stay empty.
  std::optional<PackParams> compress_;
  Tensor step_;                       // i64 [1]: the backward passes so far (the packs' offset_counter)
  std::vector<PackParams> pack_;      // pack_[l]: how layer l's input [B, k_l] is packed
  std::vector<PackedTensor> packed_;  // packed_[l]: layer l's input, [capacity, k_l] packed
  std::vector<Tensor> mask_;          // mask_[l]: relu mask of layer l's output [capacity * k_{l+1}] (relu, l < n - 1)
  struct Scratch;
  std::shared_ptr<Scratch> scratch_;  // layer l's output, then its gradient, in scratch_->work[l % 2]
  bool relu_mask(std::size_t l) const;
  TensorView work(std::size_t l, std::int64_t cols) const;  // scratch work[l % 2] as [batch, cols] contiguous
  PackedView packed_rows(std::size_t l) const;              // rows [0, batch) of packed_[l]
  void compressed_forward(const TensorView& x, const TensorView& y, const Stream* stream);
  void compressed_backward(const TensorView& y, const TensorView& dy, const std::optional<TensorView>& dx,
                           const Stream* stream, const std::function<void(std::size_t)>& layer_done);
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
