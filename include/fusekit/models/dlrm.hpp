// DLRM (Naumov et al. 2019), as dlrm_s_pytorch.py defines it:
//
//   x  = bottom_mlp(dense)                       dense [B, 13] -> x [B, D], ReLU after every layer
//   e_t = sum of table_t rows over bag (t, b)    one table per categorical feature, [rows_t, D]
//   Z  = [x, e_1, ..., e_T]                      [B, F, D], F = T + 1
//   R  = interaction(Z)
//        dot:   [x, <Z_i, Z_j> for i in 0..F-1, j < i]    D + F(F-1)/2 features (367 for Kaggle)
//        cat:   Z flattened                                F*D
//        outer: the seed's flatten(c cᵀ), c = Z flattened  (F*D)^2 (186,624 for Kaggle)
//   p  = sigmoid(top_mlp(R))                     ReLU after every top layer but the last
//   loss = BCE(p, label), mean over the batch (computed from the logit, stably)
//
// Initialisation as the reference: a Linear(n -> m) has W ~ N(0, sqrt(2 / (m + n))),
// b ~ N(0, sqrt(1 / m)); table t has rows ~ U(-sqrt(1 / rows_t), sqrt(1 / rows_t)); all from the
// Philox stream of `seed` (one subsequence per parameter), so a model is reproducible.
//
// Training: forward() keeps what backward() needs; backward() overwrites (=) the dense gradients
// and the sparse embedding gradients (per table: the distinct rows touched and their summed
// gradients, as PyTorch's sparse EmbeddingBag gradient coalesced); step() applies SGD or Adagrad
// (PyTorch's update: state += g^2, p -= lr g / (sqrt(state) + eps); rows not touched by the
// batch are not updated, as with sparse gradients).
//
// Backends: on the CPU, `--impl reference` only: plain float32 loops and a blocked CPU GEMM (the
// spec the GPU implementations are tested against). On CUDA, `reference` (unfused kernels, dense
// table gradients) and `fused` (fused kernels, sparse in-place table updates, CUDA graph); see
// src/models/dlrm_gpu.hpp and docs/dlrm.md. All take the same config and the same Batch layout
// (see data/criteo.hpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <iosfwd>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "fusekit/core/tensor.hpp"

namespace fk {
class TraceRecorder;
}

namespace fk::models {

enum class InteractionOp { dot, cat, outer };
InteractionOp parse_interaction_op(std::string_view name);  // "dot" | "cat" | "outer"
std::string_view interaction_op_name(InteractionOp op);

enum class DlrmImpl { reference, fused };
DlrmImpl parse_impl(std::string_view name);  // "reference" | "fused"
std::string_view impl_name(DlrmImpl impl);

// How the fused GPU embedding lookup hashes raw categorical values (DlrmInput::raw_sparse):
// seed: (v + 1) % rows_t, reference: v % rows_t (data::HashMode's two modes).
enum class RawHash { seed, reference };

enum class OptimizerKind { sgd, adagrad };
OptimizerKind parse_optimizer(std::string_view name);  // "sgd" | "adagrad"
std::string_view optimizer_name(OptimizerKind k);

struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::sgd;
  float learning_rate = 0.1f;
  float eps = 1e-10f;                // Adagrad (PyTorch's default)
  float initial_accumulator = 0.0f;  // Adagrad
};

struct DlrmConfig {
  std::vector<std::int64_t> bottom_mlp = {13, 512, 256, 64, 16};  // input first, last == embedding_dim
  std::vector<std::int64_t> top_mlp = {512, 256, 1};               // the input (interaction) size is derived
  std::int64_t embedding_dim = 16;
  std::vector<std::int64_t> table_rows;  // one table per categorical feature
  InteractionOp interaction = InteractionOp::dot;
  bool interaction_itself = false;  // dot: include the diagonal <Z_i, Z_i>
  std::uint64_t seed = 1;
  RawHash raw_hash = RawHash::seed;  // for DlrmInput::raw_sparse (GPU fused)
  bool allow_tf32 = true;            // GPU: MLP GEMMs on TF32 tensor cores (CPU: ignored)
  bool cuda_graph = true;            // GPU fused: replay the training step as a CUDA graph
  // GPU fused: an MLP whose widths fit fusekit's fused_mlp (input and output <= 128, every hidden
  // layer one width of 16, 32, 64 or 128) runs as one fused_mlp kernel each way, in bf16 with the
  // fp32 parameters and gradients kept as master copies (the others keep cuBLASLt in TF32).
  bool fused_mlp = false;

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
//   raw_sparse i32 [T * B]   optional: the unhashed values of one-hot bags, table-major; the GPU
//                            fused implementation then hashes them in its lookup (config
//                            raw_hash) and ignores indices/offsets
// On CUDA the tensors may be host (page-locked for asynchronous copies) or device tensors.
struct DlrmInput {
  TensorView dense;
  TensorView indices;
  TensorView offsets;
  TensorView raw_sparse;
};

// Sparse gradient of one table: `rows` distinct (ascending), `values` [rows.size(), D].
struct SparseGrad {
  std::vector<std::int64_t> rows;
  std::vector<float> values;
};

namespace detail {
struct DlrmState;
}
namespace gpu {
class GpuDlrm;
}

class Dlrm {
 public:
  // Throws fk::Error for an inconsistent config, and for impl fused on the CPU.
  Dlrm(DlrmConfig config, Device device, DlrmImpl impl = DlrmImpl::reference);
  ~Dlrm();
  Dlrm(Dlrm&&) noexcept;
  Dlrm& operator=(Dlrm&&) noexcept;

  const DlrmConfig& config() const noexcept;
  Device device() const noexcept;
  DlrmImpl impl() const noexcept;

  // logits f32 [B] (the sigmoid is applied by the loss and by predict()). input.dense must stay
  // valid and unchanged until backward() (the bottom MLP reads it there).
  void forward(const DlrmInput& input, const TensorView& logits);
  // From dlogits f32 [B] (dL/dlogit): every gradient, for the last forward().
  void backward(const TensorView& dlogits);
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
  // top), each weight [out, in] and bias [out]; the tables [rows_t, D].
  struct LinearParams {
    Tensor* weight;
    Tensor* bias;
    Tensor* weight_grad;
    Tensor* bias_grad;
  };
  std::vector<LinearParams> linear_layers();
  std::vector<Tensor*> tables();
  // CPU only: the sparse gradients of the last backward (CUDA: empty; the fused implementation
  // never forms them, the reference one keeps dense table gradients).
  const std::vector<SparseGrad>& table_grads() const;
  // Peak bytes of device memory allocated through fusekit's allocator (0 on the CPU).
  std::size_t peak_device_bytes() const;

  // The training state (every parameter and the optimizer state) as a binary stream, so that a
  // run resumed from it computes exactly what the uninterrupted run would have. load_state
  // throws fk::Error when the stream's shapes do not match this model's configuration.
  void save_state(std::ostream& out) const;
  void load_state(std::istream& in);

 private:
  std::unique_ptr<detail::DlrmState> s_;  // the CPU backend
  std::unique_ptr<gpu::GpuDlrm> g_;       // or the CUDA one
  DlrmConfig config_;
  Device device_;
  DlrmImpl impl_;
  double pending_loss_ = 0;  // CPU enqueue_train_step
  std::int64_t pending_steps_ = 0;
};

// Mean binary cross-entropy of sigmoid(logits) against labels (0/1), computed stably from the
// logits; writes dL/dlogit = (sigmoid(logit) - label) / B when dlogits is given.
double bce_with_logits(const TensorView& logits, const TensorView& labels, const TensorView* dlogits);

namespace detail {
// The state stream shared by both backends: magic, Adagrad flag, then (length, floats) per array
// in the order of the backend's state arrays. `on_device` arrays are copied through host memory.
struct StateArray {
  float* data;
  std::int64_t size;
  bool on_device;
};
void write_state(std::ostream& out, bool adagrad, const std::vector<StateArray>& arrays);
// Reads the header; returns the Adagrad flag (the caller then allocates the optimizer state).
bool read_state_header(std::istream& in, std::uint64_t& count);
void read_state_arrays(std::istream& in, std::uint64_t count, const std::vector<StateArray>& arrays);
}  // namespace detail

}  // namespace fk::models
