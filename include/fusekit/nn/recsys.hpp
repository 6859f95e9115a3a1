// The layers of DLRM-style recommendation models, over the recsys family (ops/recsys.hpp):
//
//   EmbeddingBagCollection  T tables of one dim in one buffer; pooled bags of all tables in one
//                           launch, the hash of raw one-hot values fused in; the backward fused
//                           with SGD / Adagrad (no table gradient ever stored)
//   Interaction             Z [B, F, D] -> R [B, I]: dot, cat or outer
//   CrossNet                DCNv2's low-rank cross network: x0 [B, N] -> x_L [B, N], N = F * D
//   BCEWithLogits           sigmoid + binary cross-entropy + its gradient in one pass, the loss
//                           summed on the device (read once per many steps)
//
// Each takes `fused = false` for the unfused baseline a plain framework port runs: one embedding
// launch per table, a dense [total_rows, D] table gradient then a dense optimizer pass; the dot
// interaction as a batched GEMM + gather (its backward: scatter + GEMM + add); sigmoid, BCE and
// its gradient as three kernels. Both give the same results up to fp32 rounding.
//
// All f32 (the tables also bf16 or f16), on one device, on the caller's stream; nothing
// synchronises unless it says so.
// Buffers that depend on the batch are allocated for the largest batch seen (reserve() does it up
// front), so that a later step allocates nothing and a CUDA graph can capture it.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "fusekit/core/random.hpp"
#include "fusekit/core/tensor.hpp"
#include "fusekit/nn/parameters.hpp"
#include "fusekit/ops/recsys.hpp"

namespace fk::nn {

struct EmbeddingBagCollectionOptions {
  Pooling pooling = Pooling::sum;
  RowHash hash = RowHash::seed;  // raw one-hot input
  bool fused = true;
  // Adagrad keeps one accumulator per row (FBGEMM's ROWWISE_ADAGRAD: state += mean_d g^2), state
  // [total_rows]; applied inside the sparse backward whether fused or not (there is no unfused
  // row-wise baseline).
  bool rowwise_adagrad = false;
  // The tables' dtype: f32, or bf16 / f16 (half the memory; fused only): read into f32 sums, each
  // update computed in f32 and stored with stochastic rounding, its draws from Philox
  // (rounding_seed, the update's number: see rounding_step()). The optimizer state stays f32.
  DType dtype = DType::f32;
  std::uint64_t rounding_seed = 0;
};

// A batch of bags on the tables' device (the GPU trusts CSR input: check it on the host first with
// check_embedding_input, as a loader does). Either CSR (indices + offsets) or raw.
struct EmbeddingBagInput {
  std::optional<TensorView> indices;  // i64 [nnz]
  std::optional<TensorView> offsets;  // i64 [T * B + 1]
  std::optional<TensorView> raw;      // i32 [T * B]: one raw value per bag, hashed in the lookup
};

class EmbeddingBagCollection {
 public:
  // Table t [rows[t], dim] ~ U(-sqrt(1 / rows[t]), sqrt(1 / rows[t])) from Philox
  // (init.seed, init.subsequence + id_t): the same values on every device. id_t = t, or
  // init_ids[t] when given (one per table): a collection holding some tables of a larger one (a
  // rank's shard of a model-parallel model) then holds the values the larger one has.
  // draw_bases (TableLayout's): none, or per table the row its rows' rounding draws as (16-bit
  // tables), so that such a collection also rounds as the larger one does.
  EmbeddingBagCollection(std::vector<std::int64_t> rows, std::int64_t dim, EmbeddingBagCollectionOptions options,
                         Device device, RandomParams init, const std::vector<std::int64_t>& init_ids = {},
                         std::vector<std::int64_t> draw_bases = {});

  int num_tables() const noexcept { return layout_.num_tables(); }
  std::int64_t dim() const noexcept { return dim_; }
  const TableLayout& layout() const noexcept { return layout_; }
  const EmbeddingBagCollectionOptions& options() const noexcept { return options_; }

  // Buffers for up to `nnz` looked-up rows per batch.
  void reserve(std::int64_t nnz, const Stream* stream = nullptr);
  // out [B, T, D] (strides (>= T * D, D, 1)) = the pooled bags. Keeps what backward needs.
  void forward(const EmbeddingBagInput& in, std::int64_t batch, const TensorView& out, const Stream* stream = nullptr);
  // dout: the gradient of the last forward's out, same layout. Fused: kept by reference, and used
  // by step() (it must stay unchanged until then); unfused: the dense table gradient is formed now.
  void backward(const TensorView& dout, const Stream* stream = nullptr);
  // Applies the optimizer to the rows the last backward touched (fused: straight from dout).
  void step(const OptimizerConfig& opt, const Stream* stream = nullptr);

  // The last backward's table gradient [total_rows, D] (zero for untouched rows), formed on demand
  // (for tests and inspection; the fused path never needs it). Synchronous.
  Tensor gradient(const Stream* stream = nullptr);

  // The number of updates made so far, the Philox offset of the next one's stochastic rounding
  // (16-bit tables; 0 for f32): saved with a checkpoint so that a resumed run draws what the
  // uninterrupted one would. Synchronous.
  std::uint64_t rounding_step() const;
  void set_rounding_step(std::uint64_t step);

  Tensor weights;              // [total_rows, D] of options().dtype: the tables, stacked
  std::vector<Tensor> tables;  // views [rows[t], D] of weights
  Tensor state;                // Adagrad [total_rows, D] (rowwise_adagrad: [total_rows]), allocated by the first Adagrad step
  // Allocates the Adagrad state at `initial_accumulator` when there is none.
  void ensure_state(float initial_accumulator, const Stream* stream = nullptr);

 private:
  std::int64_t nnz_of(const EmbeddingBagInput& in, std::int64_t batch) const;
  // The recsys backward of the last forward's bags from dout_, into `target` (weights or a gradient).
  void backward_update(const TensorView& target, const std::optional<TensorView>& state_view, EmbeddingUpdate update,
                       float lr, float eps, const Stream* stream);
  TableLayout layout_;
  std::vector<TableLayout> single_;  // unfused: one layout per table
  std::int64_t dim_;
  EmbeddingBagCollectionOptions options_;
  std::int64_t capacity_ = 0, batch_ = 0, nnz_ = 0;
  std::optional<TensorView> offsets_;  // the last forward's (mean pooling)
  TensorView dout_;
  Tensor keys_, bags_, workspace_, dense_grad_;
  Tensor step_;  // 16-bit tables: i64 [1] on the tables' device, the updates made (rounding_step)
};

struct InteractionOptions {
  InteractionKind kind = InteractionKind::dot;
  bool self_interaction = false;  // dot: include <Z_i, Z_i>
  bool fused = true;              // dot only: false runs the batched GEMM + gather baseline
};

class Interaction {
 public:
  Interaction(std::int64_t features, std::int64_t dim, InteractionOptions options, Device device);
  std::int64_t features() const noexcept { return features_; }
  std::int64_t dim() const noexcept { return dim_; }
  std::int64_t output_size() const noexcept { return size_; }  // I
  const InteractionOptions& options() const noexcept { return options_; }

  void reserve(std::int64_t batch, const Stream* stream = nullptr);
  // r [B, L] contiguous, L >= I (L == I for outer): written, its padding columns [I, L) zeroed;
  // backward reads dr [B, L] likewise (its padding columns ignored).
  void forward(const TensorView& z, const TensorView& r, const Stream* stream = nullptr);
  // dz [B, F, D] (=) from dr. relu_x (fused dot only): Z[:, 0] is a ReLU output and dZ[:, 0] comes
  // out multiplied by its derivative (the ReLU's backward fused).
  void backward(const TensorView& z, const TensorView& dr, const TensorView& dz, bool relu_x = false,
                const Stream* stream = nullptr);

 private:
  std::int64_t features_, dim_, size_;
  InteractionOptions options_;
  DotPairs pairs_;
  Device device_;
  std::int64_t capacity_ = 0;
  Tensor workspace_;  // unfused dot: [capacity, F, F]
};

struct CrossNetOptions {
  std::int64_t layers = 3;  // L >= 1
  std::int64_t rank = 512;  // r >= 1
  bool allow_tf32 = true;   // GPU GEMMs on TF32 tensor cores
};

// DCNv2's low-rank cross network (TorchRec's LowRankCrossNet, as the MLPerf DLRM-DCNv2 reference
// builds it): x_{l+1} = x0 ⊙ (U_l (V_l x_l) + b_l) + x_l for l < L, one ops/recsys cross_layer
// per layer. Parameters in a ParameterArena (so that one optimizer launch updates them with the
// MLPs), per layer U [N, r], V [r, N], b [N], initialised as TorchRec does: U and V Xavier normal
// (std sqrt(2 / (N + r))), b zero; U_l from Philox (init.seed, init.subsequence + 2l), V_l from
// + 2l + 1. Keeps x_1 .. x_{L-1} and each layer's h = V x_l [B, r] for the backward (the backward
// recomputes U h).
class CrossNet {
 public:
  CrossNet(std::int64_t n, CrossNetOptions options, RandomParams init, ParameterArena& arena);
  // The floats of the arena the parameters take (ParameterArena::floats_for of each).
  static std::int64_t arena_floats(std::int64_t n, const CrossNetOptions& options);
  std::int64_t size() const noexcept { return n_; }
  const CrossNetOptions& options() const noexcept { return options_; }

  struct Layer {
    const ParameterArena::Parameter* u;     // [N, r]
    const ParameterArena::Parameter* v;     // [r, N]
    const ParameterArena::Parameter* bias;  // [N]
  };
  const std::vector<Layer>& layers() const noexcept { return layers_; }

  void reserve(std::int64_t batch, const Stream* stream = nullptr);
  // x0 [B, N] (unit column stride, any row stride) must stay unchanged until backward(); out
  // [B, N] (=) x_L, apart from x0.
  void forward(const TensorView& x0, const TensorView& out, const Stream* stream = nullptr);
  // dout [B, N]: dL/dx_L on entry, overwritten (it carries dL/dx_l down the layers). dx0 [B, N],
  // contiguous: written (=) with dL/dx0. The parameters' gradients in the arena: written (=).
  void backward(const TensorView& x0, const TensorView& dout, const TensorView& dx0, const Stream* stream = nullptr);

 private:
  std::int64_t n_;
  CrossNetOptions options_;
  std::vector<Layer> layers_;
  Device device_;
  std::int64_t capacity_ = 0, batch_ = 0;
  Tensor xs_, hs_, workspace_;  // x_1 .. x_{L-1} [L - 1, cap, N]; h [L, cap, r]; the GPU backward's
  TensorView x_of(std::int64_t l, const TensorView& x0, const TensorView& out) const;
  TensorView h_of(std::int64_t l) const;
};

class BCEWithLogits {
 public:
  explicit BCEWithLogits(Device device, bool fused = true);
  void reserve(std::int64_t batch, const Stream* stream = nullptr);
  // dlogits [B] (=) = (sigmoid(logits) - labels) / B; the batch's mean loss is added to the
  // device-side sum.
  void forward_backward(const TensorView& logits, const TensorView& labels, const TensorView& dlogits,
                        const Stream* stream = nullptr);
  // The mean of the batch losses added since the last drain (0 when none), and a new sum. Waits
  // for `stream`.
  double drain(const Stream* stream = nullptr);

 private:
  Device device_;
  bool fused_;
  Tensor accumulator_, probabilities_;
  std::int64_t capacity_ = 0;
};

}  // namespace fk::nn
