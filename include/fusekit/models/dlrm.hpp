// DLRM (Naumov et al. 2019), as dlrm_s_pytorch.py defines it:
//
//   x  = bottom_mlp(dense)                       dense [B, 13] -> x [B, D], ReLU after every layer
//   e_t = sum of table_t rows over bag (t, b)    one table per categorical feature, [rows_t, D]
//   Z  = [x, e_1, ..., e_T]                      [B, F, D], F = T + 1
//   R  = interaction(Z)
//        dot:   [x, <Z_i, Z_j> for i in 0..F-1, j < i]    D + F(F-1)/2 features (367 for Kaggle)
//        cat:   Z flattened                                F*D
//        outer: flatten(c cᵀ), c = Z flattened  (F*D)^2 (186,624 for Kaggle)
//        dcn:   x_L of DCNv2's low-rank cross network on x0 = Z flattened: F*D (3456 for MLPerf)
//               x_{l+1} = x0 ⊙ (U_l (V_l x_l) + b_l) + x_l, U_l [F*D, r], V_l [r, F*D] (nn::CrossNet,
//               TorchRec's LowRankCrossNet as the MLPerf DLRM-DCNv2 reference runs it)
//   p  = sigmoid(top_mlp(R))                     ReLU after every top layer but the last
//   loss = BCE(p, label), mean over the batch (computed from the logit, stably)
//
// Initialisation as the reference: a Linear(n -> m) has W ~ N(0, sqrt(2 / (m + n))),
// b ~ N(0, sqrt(1 / m)); table t has rows ~ U(-sqrt(1 / rows_t), sqrt(1 / rows_t)); all from the
// Philox stream of `seed` (one subsequence per parameter), so a model is reproducible. The cross
// network's U and V are Xavier normal (std sqrt(2 / (F*D + r))), its biases zero (TorchRec's).
//
// Training: forward() keeps what backward() needs; backward() overwrites (=) the dense gradients
// and the sparse embedding gradients (per table: the distinct rows touched and their summed
// gradients, as PyTorch's sparse EmbeddingBag gradient coalesced); step() applies SGD or Adagrad
// (PyTorch's update: state += g^2, p -= lr g / (sqrt(state) + eps); rows not touched by the
// batch are not updated, as with sparse gradients).
//
// One code path for every device: the model wires nn layers (nn::MLP, nn::EmbeddingBagCollection,
// nn::Interaction, nn::BCEWithLogits, one nn::ParameterArena for the MLP parameters) and the ops
// under them dispatch on the device (the CPU running their specs). The implementation is a choice
// of ops, not a second model:
//   fused      GEMMs with the bias + ReLU epilogue, the ReLU derivative and the bias gradient in one
//              pass; all tables in one embedding launch with the hash fused in; the embedding
//              backward fused with the optimizer (no table gradient exists); the one-kernel dot
//              interaction (its backward applying the bottom MLP's last ReLU derivative); sigmoid +
//              BCE + gradient in one kernel; one optimizer launch for every MLP parameter; on a GPU
//              the whole training step replayed as a CUDA graph.
//   reference  what a plain framework port runs: GEMM, then bias and ReLU as separate passes; one
//              embedding launch per table; a dense table gradient then a dense optimizer pass; the
//              dot interaction as a batched GEMM + gather; sigmoid, BCE and its gradient as three
//              kernels; one optimizer launch per parameter; no graph.
// Both keep fp32 parameters; on a GPU the MLP GEMMs run on TF32 tensor cores when
// DlrmConfig::allow_tf32, with rows padded to 4 floats (16 bytes). See docs/dlrm.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <iosfwd>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "fusekit/core/random.hpp"
#include "fusekit/core/tensor.hpp"
#include "fusekit/nn/linear.hpp"
#include "fusekit/nn/parameters.hpp"
#include "fusekit/ops/recsys.hpp"

namespace fk {
class Stream;
class TraceRecorder;
}

namespace fk::models {

enum class InteractionOp { dot, cat, outer, dcn };
InteractionOp parse_interaction_op(std::string_view name);  // "dot" | "cat" | "outer" | "dcn"
std::string_view interaction_op_name(InteractionOp op);

enum class DlrmImpl { reference, fused };
DlrmImpl parse_impl(std::string_view name);  // "reference" | "fused"
std::string_view impl_name(DlrmImpl impl);

using nn::OptimizerConfig;
using nn::OptimizerKind;
using nn::optimizer_name;
using nn::parse_optimizer;

struct DlrmConfig {
  std::vector<std::int64_t> bottom_mlp = {13, 512, 256, 64, 16};  // input first, last == embedding_dim
  std::vector<std::int64_t> top_mlp = {512, 256, 1};               // the input (interaction) size is derived
  std::int64_t embedding_dim = 16;
  std::vector<std::int64_t> table_rows;  // one table per categorical feature
  InteractionOp interaction = InteractionOp::dot;
  bool interaction_itself = false;  // dot: include the diagonal <Z_i, Z_i>
  std::int64_t dcn_num_layers = 3;     // dcn: cross layers L (the reference's --dcn-num-layers)
  std::int64_t dcn_low_rank_dim = 512; // dcn: rank r of U and V (--dcn-low-rank-dim)
  // With Adagrad: the tables keep one accumulator per row, FBGEMM's row-wise Adagrad (state +=
  // mean_d g^2; the MLPerf DLRM-DCNv2 recipe's sparse optimizer), applied in the sparse backward;
  // the MLPs (and the cross network) keep element-wise Adagrad. The saved state follows it.
  bool rowwise_adagrad = false;
  std::uint64_t seed = 1;
  RowHash raw_hash = RowHash::seed;  // how DlrmInput::raw_sparse becomes rows (fused)
  bool allow_tf32 = true;            // GPU: MLP GEMMs on TF32 tensor cores (CPU: ignored)
  bool cuda_graph = true;            // GPU fused: replay the training step as a CUDA graph
  // GPU fused: an MLP whose widths fit fusekit's fused_mlp (input and output <= 128, every hidden
  // layer one width of 16, 32, 64 or 128) runs as one fused_mlp kernel each way, in bf16 with the
  // fp32 parameters and gradients kept as master copies (the others keep cuBLASLt in TF32).
  bool fused_mlp = false;
  // 8, 4 or 2: both MLPs keep what their backward needs compressed (nn::MLP's compress): each
  // layer's input packed at this many bits with stochastic rounding (Philox from `seed` and the
  // step, so a run is reproducible, CUDA graph or not), each hidden ReLU's mask at one bit, dW
  // from the packed bits; their f32 activations and gradients in one scratch the two MLPs share.
  // 0: off (the f32 activations are kept). Not with fused_mlp.
  int compress_activations_bits = 0;
  // The tables' dtype: f32, or bf16 / f16 (half the tables' memory; impl fused only): pooled in
  // f32, each update stored with stochastic rounding (nn::EmbeddingBagCollectionOptions::dtype;
  // Philox from `seed` and the update's number, so a run is reproducible). Checkpoints hold the
  // tables as f32 values whatever this is.
  DType embedding_dtype = DType::f32;

  std::int64_t num_features() const { return static_cast<std::int64_t>(table_rows.size()) + 1; }
  std::int64_t interaction_size() const;
  // Throws fk::Error naming the field that is inconsistent.
  void validate() const;
  std::int64_t parameter_count() const;
};

// One batch of model input (host tensors for the CPU backend):
//   dense   f32 [B, bottom_mlp[0]]
//   indices i64 [nnz]        all tables' rows, table-major
//   offsets i64 [T * B + 1]  bag (t, b) is indices[offsets[t*B + b], offsets[t*B + b + 1])
//   raw_sparse i32 [T * B]   optional: the unhashed values of one-hot bags, table-major; the
//                            fused implementation then hashes them in its lookup (config
//                            raw_hash) and ignores indices/offsets
// On CUDA the tensors may be host (page-locked for asynchronous copies) or device tensors.
//   pooled  f32 [B, T, D]   a model with DlrmTables::external only, instead of ids: the bags
//                            pooled elsewhere (model-parallel tables, models::DistributedDlrm),
//                            contiguous, on the model's device (a GPU's: written before the call,
//                            the writer's stream synchronised)
struct DlrmInput {
  TensorView dense;
  TensorView indices;
  TensorView offsets;
  TensorView raw_sparse;
  TensorView pooled;
};

// Where the embedding tables live. local: in the model. external: elsewhere (on the ranks of a
// model-parallel model, models::DistributedDlrm); the model is then the dense part (MLPs and the
// interaction), its input carries the pooled bags (DlrmInput::pooled), its backward gives their
// gradient, and step() updates the dense parameters only.
enum class DlrmTables { local, external };

// The Philox stream the tables start from (table t: subsequence + t), for a model-parallel shard
// that must hold the values the whole model would.
RandomParams dlrm_table_init(const DlrmConfig& config);
// The Philox key of 16-bit tables' stochastic rounding (nn::EmbeddingBagCollectionOptions::rounding_seed).
std::uint64_t dlrm_table_rounding_seed(const DlrmConfig& config);

namespace detail {
struct DlrmState;
}

class Dlrm {
 public:
  // Throws fk::Error for an inconsistent config or a device that does not exist.
  Dlrm(DlrmConfig config, Device device, DlrmImpl impl = DlrmImpl::reference, DlrmTables tables = DlrmTables::local);
  ~Dlrm();
  Dlrm(Dlrm&&) noexcept;
  Dlrm& operator=(Dlrm&&) noexcept;

  const DlrmConfig& config() const noexcept;
  Device device() const noexcept;
  DlrmImpl impl() const noexcept;

  // logits f32 [B] (the sigmoid is applied by the loss and by predict()). input.dense must stay
  // valid and unchanged until backward() (the bottom MLP reads it there).
  void forward(const DlrmInput& input, const TensorView& logits);
  // From dlogits f32 [B] (dL/dlogit): every gradient, for the last forward(). External tables:
  // dpooled f32 [B, T, D] (=) dL/dpooled, the gradient the tables' owners apply, contiguous on the
  // model's device (written when backward() returns).
  void backward(const TensorView& dlogits, const TensorView& dpooled = {});
  // The same, calling unit_done(u) for each unit u of gradient_units() (in that order) as soon as
  // its gradients are final: done on the CPU; on a GPU, queued on stream() (a data-parallel caller
  // starts reducing them there while the rest of the backward runs).
  void backward(const TensorView& dlogits, const TensorView& dpooled, const std::function<void(std::size_t)>& unit_done);
  void step(const OptimizerConfig& opt);

  // forward + BCE loss + backward + step; returns the mean loss of the batch.
  double train_step(const DlrmInput& input, const TensorView& labels, const OptimizerConfig& opt);
  // The same step without waiting for its loss: on CUDA it returns once the batch has been copied
  // to the device (the caller may then reuse its buffers) while the step runs. drain_loss()
  // waits and returns the mean of the losses of the steps enqueued since the last drain (0 when none).
  void enqueue_train_step(const DlrmInput& input, const TensorView& labels, const OptimizerConfig& opt);
  double drain_loss();
  // Click probabilities f32 [B].
  void predict(const DlrmInput& input, const TensorView& probabilities);

  // Records each phase of forward / backward / step (bottom_mlp.fwd, embeddings.fwd, ...) on
  // `trace` until set back to null.
  void set_trace(TraceRecorder* trace) noexcept;

  // Parameters and gradients, for tests and checkpoints: the MLP layers in order (bottom, then
  // top), each weight [out, in] (on a GPU its rows may be padded: row stride >= in) and bias
  // [out]; the tables [rows_t, D].
  struct LinearParams {
    Tensor* weight;
    Tensor* bias;
    Tensor* weight_grad;
    Tensor* bias_grad;
  };
  std::vector<LinearParams> linear_layers();
  // dcn: the cross network's parameters and gradients, layer by layer U [N, r], V [r, N], b [N]
  // (empty for the other interactions).
  struct ParamAndGrad {
    Tensor* value;
    Tensor* grad;
  };
  std::vector<ParamAndGrad> cross_parameters();
  std::vector<Tensor*> tables();  // empty with external tables
  // The dense parameters' gradients (MLPs, cross network) of the last backward as one contiguous
  // f32 buffer on the model's device: what data-parallel ranks all-reduce (in place) before step().
  TensorView dense_gradients();
  // dense_gradients() cut into the units backward() completes one after the other, in that order:
  // the top MLP's layers from the last to the first, the cross network (dcn, all its layers as one
  // unit), the bottom MLP's layers from the last to the first. Unit u is the floats
  // [offset, offset + floats) of dense_gradients() (a layer's weight, bias and alignment gaps); the
  // units tile it.
  struct GradientUnit {
    std::string name;  // "top.2", "cross", "bottom.0", ...
    std::int64_t offset = 0, floats = 0;
  };
  std::vector<GradientUnit> gradient_units();
  // The stream the model's work is queued on (a GPU); null on the CPU.
  const Stream* stream() const noexcept;
  // The tables' gradients of the last backward, [total_rows, D] on the model's device (zero for
  // untouched rows), formed on demand (the fused implementation never needs them).
  Tensor table_gradient();
  // Peak bytes of device memory allocated through fusekit's allocator (0 on the CPU).
  std::size_t peak_device_bytes() const;
  // The MLPs' activations for a training step of `batch` samples (nn::MLP::saved_activation_bytes,
  // both MLPs): whole, what their backward needs as f32; kept, what is kept for it (packed with
  // compress_activations_bits); scratch, the buffers that hold activations only during a call.
  nn::MLP::SavedActivationBytes mlp_activation_bytes(std::int64_t batch) const;

  // The training state (every parameter and the optimizer state; with compress_activations_bits
  // the MLPs' rounding steps, as one more array) as a binary stream, so that a run resumed from it
  // computes exactly what the uninterrupted run would have. load_state throws fk::Error when the
  // stream's shapes do not match this model's configuration; a state without the rounding steps
  // (saved uncompressed) starts them at 0, and a model without compression ignores them.
  void save_state(std::ostream& out) const;
  void load_state(std::istream& in);

 private:
  std::unique_ptr<detail::DlrmState> s_;
};

// Mean binary cross-entropy of sigmoid(logits) against labels (0/1), computed stably from the
// logits; writes dL/dlogit = (sigmoid(logit) - label) / B when dlogits is given.
double bce_with_logits(const TensorView& logits, const TensorView& labels, const TensorView* dlogits);


}  // namespace fk::models
