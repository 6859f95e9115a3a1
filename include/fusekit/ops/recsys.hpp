// Family `recsys`: the sparse and interaction ops of DLRM-style recommendation models.
//
//   embedding_bag_forward          out[b, t, :] = pool over the bag (t, b) of tables[t][row, :]
//   embedding_bag_backward_update  the gradient of every touched row, summed in a fixed order and
//                                  applied at once by SGD / Adagrad / row-wise Adagrad (no dense
//                                  table gradient), or stored into a dense gradient buffer
//   dense_optimizer_update         SGD / Adagrad over a whole parameter buffer from its gradient
//   interaction_forward/backward   Z [B, F, D] -> R [B, I]: dot (pairwise dot products), cat, outer
//   cross_layer_forward/backward   one layer of DCNv2's low-rank cross network:
//                                  x_{l+1} = x0 ⊙ (U (V x_l) + b) + x_l
//   sigmoid_bce_forward_backward   mean BCE of sigmoid(logits) and dlogits in one pass
//   permute_bags                   CSR bags put in another order (the ids a model-parallel
//                                  all-to-all delivered rank by rank, regrouped table by table)
//
// Each op also offers the unfused path a plain PyTorch port runs (the baseline the fused kernels
// are measured against): the embedding bag one launch per table, the embedding backward as a
// dense gradient then dense_optimizer_update, the dot interaction as a batched GEMM between a
// gather and a scatter, the loss as three kernels. Both paths compute the same spec (the unfused
// loss clamps its logs as PyTorch's BCELoss does; see SigmoidBceParams).
//
// Tables: the T tables of one model share the embedding dim D and live in one buffer
// [total_rows, D], table t at rows [base[t], base[t] + rows[t]); a TableLayout says where (made
// once, it holds the small device copy of the bases and row counts the kernels read). The buffer
// is f32, or bf16 / f16 to halve the tables' memory: a 16-bit table is read into f32 sums, and the
// optimizer computes each updated value in f32 and stores it with stochastic rounding (unbiased:
// an update smaller than half a 16-bit step still moves the value on average), its draws from
// Philox (EmbeddingOptimizerParams::seed, the update's offset, the element's place in the buffer,
// or in a larger buffer the layout's tables are rows of: TableLayout's draw bases).
// The optimizer state and every other tensor stay f32.
//
// Input of the embedding bags, bag q = t * B + b (table-major):
//   CSR (multi-hot)   indices i64 [nnz]: row within table t; offsets i64 [T * B + 1], offsets[0] = 0,
//                     non-decreasing, offsets[T * B] = nnz; bag q = indices[offsets[q], offsets[q + 1]).
//                     On the CPU they are validated; on a GPU they are trusted (validate them on the
//                     host with check_embedding_input before copying them, as a loader does).
//   raw (one-hot)     i32 [T * B], read as u32: bag q holds the single row hash(raw[q]) of table t,
//                     the hash computed in the kernel.
// Pooled output: out [B, T, D] f32, innermost stride 1, stride D between tables and any row stride
// >= T * D, so that DLRM's bags land straight in Z[:, 1:, :] ([B, F, D] with F = T + 1).
//
// Every other op is f32; all arithmetic is fp32 on the GPU (the loss accumulates in double); the CPU
// backend is the spec (reference::), written with double accumulation. The GPU results are fp32
// sums of the same terms (bounds held by the tests in docs/recsys.md); every result is
// deterministic: the same bits on every run of a given input.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "fusekit/core/hash.hpp"
#include "fusekit/core/tensor.hpp"

namespace fk {

class Stream;

enum class Pooling { sum, mean };  // mean: the sum over the bag's size; an empty bag gives zeros

// Where T tables of one dim live in the shared [total_rows, D] buffer. Fewer than 2^32 rows in all
// (the backward sorts 32-bit keys).
//
// Draw bases: 16-bit tables' stochastic rounding draws for row r of table t as for row
// draw_base(t) + r of the buffer (EmbeddingOptimizerParams::seed). draw_base(t) = base(t) unless
// given: a layout holding pieces of a larger layout's tables (a rank's shards of a model-parallel
// model) gives each piece its rows' place there, and so rounds as the larger layout would.
class TableLayout {
 public:
  TableLayout() = default;
  // When `device` is a GPU, copies the bases, row counts and draw bases there (synchronously: the
  // layout is ready for every stream on return). draw_bases: none, or one per table, >= 0 and
  // below 2^56 rows with the table's rows.
  explicit TableLayout(std::vector<std::int64_t> rows, Device device = Device::cpu(),
                       std::vector<std::int64_t> draw_bases = {});

  int num_tables() const noexcept { return static_cast<int>(rows_.size()); }
  std::int64_t rows(int t) const { return rows_.at(static_cast<std::size_t>(t)); }
  std::int64_t base(int t) const { return base_.at(static_cast<std::size_t>(t)); }
  std::int64_t draw_base(int t) const { return draw_base_.at(static_cast<std::size_t>(t)); }
  // Whether some table's draw base is not its base.
  bool draws_elsewhere() const noexcept { return draw_base_ != base_; }
  std::int64_t total_rows() const noexcept { return total_rows_; }
  // Bits of the largest global row index: what the backward's radix sort sorts.
  int key_bits() const noexcept { return key_bits_; }
  Device device() const noexcept { return device_; }
  // i64 [3, T] on device(): row 0 the bases, row 1 the row counts, row 2 the draw bases (empty
  // on the CPU).
  const TensorView& device_meta() const noexcept { return meta_.view(); }

 private:
  std::vector<std::int64_t> rows_, base_, draw_base_;
  std::int64_t total_rows_ = 0;
  int key_bits_ = 1;
  Device device_ = Device::cpu();
  Tensor meta_;
};

// Checks host CSR input against `layout` for a batch of B samples: offsets as described above,
// every index in [0, rows[t]). Throws fk::Error (op `op`, argument "indices" or "offsets").
void check_embedding_input(const TableLayout& layout, const TensorView& indices, const TensorView& offsets,
                           std::int64_t batch, const char* op = "check_embedding_input");

struct EmbeddingBagParams {
  Pooling pooling = Pooling::sum;
  RowHash hash = RowHash::seed;  // raw input only
  // The unfused baseline: one launch per table (as one nn.EmbeddingBag per table runs), CSR input
  // only; keys and bags, when given, are written by one more launch after the lookups. Same
  // result as the table-batched launch.
  bool per_table_launch = false;
};

struct EmbeddingBagForwardArgs {
  TensorView weights;                // f32, bf16 or f16 [total_rows, D]: the tables of the layout, stacked
  std::optional<TensorView> indices; // i64 [nnz]      CSR input (with offsets)
  std::optional<TensorView> offsets; // i64 [T*B + 1]
  std::optional<TensorView> raw;     // i32 [T*B]      or one raw value per bag (instead of CSR)
  TensorView out;                    // f32 [B, T, D], strides (>= T*D, D, 1): written (=)
  // When present, the backward's input: i32 [nnz] (nnz = T*B for raw input), read as u32:
  // keys[k] = global row of entry k (base[t] + row), bags[k] = its bag q.
  std::optional<TensorView> keys;
  std::optional<TensorView> bags;
};

void embedding_bag_forward(const TableLayout& layout, const EmbeddingBagForwardArgs& a, const EmbeddingBagParams& p,
                           const Stream* stream = nullptr);

enum class EmbeddingUpdate {
  sgd,              // w -= lr g
  adagrad,          // state [total_rows, D]: state += g^2; w -= lr g / (sqrt(state) + eps)
  rowwise_adagrad,  // state [total_rows]: state += mean_d g^2; w -= lr / (sqrt(state) + eps) g
  store_gradient,   // weights is a dense gradient buffer [total_rows, D]: touched rows = g (others untouched)
  dense_gradient,   // weights is a dense gradient buffer [total_rows, D], written whole (=): touched rows g,
                    // every other row 0 (what a dense embedding backward produces)
};

struct EmbeddingOptimizerParams {
  EmbeddingUpdate update = EmbeddingUpdate::sgd;
  float lr = 0.01f;
  float eps = 1e-8f;
  Pooling pooling = Pooling::sum;  // as in the forward; mean needs the forward's offsets
  // 16-bit weights: the stochastic rounding's Philox key and subsequence. Element (row, c) of the
  // buffer, flat = row' * D + c (row' = the row's place at the layout's draw bases: the row itself
  // unless they are given), draws 16 bits from block flat / 8 of (seed, offset) (see
  // ops/common/stochastic_round.hpp), so (seed, offset) reproduce an update; give each update its
  // own offset. Ignored for f32 weights.
  std::uint64_t seed = 0;
  std::uint64_t offset = 0;
  // Optional, 16-bit weights: an i64 [1] on the weights' device whose value is added to `offset`
  // when the update runs, not when it is queued, so that a CUDA graph replaying the update draws
  // anew each time the counter is advanced (advance_offset, core/random.hpp). Null data: none.
  TensorView offset_counter;
};

struct EmbeddingBagBackwardArgs {
  TensorView keys;                   // i32 [nnz]: the forward's keys
  TensorView bags;                   // i32 [nnz]: the forward's bags
  TensorView dout;                   // f32 [B, T, D], strides (>= T*D, D, 1): the pooled rows' gradient
  std::optional<TensorView> offsets; // i64 [T*B + 1]: the forward's CSR offsets (mean pooling only)
  // f32, bf16 or f16 [total_rows, D]: updated in place; f32 only for the gradient stores (the
  // dense gradient buffer)
  TensorView weights;
  std::optional<TensorView> state;   // f32, see EmbeddingUpdate: updated in place
  // u8 [embedding_bag_backward_workspace_bytes(nnz, D)] on the weights' device (GPU only; the
  // CPU ignores it). Its contents need no initialisation and are garbage afterwards.
  std::optional<TensorView> workspace;
};

// Bytes of workspace the GPU backward needs for nnz entries of dim D (0 for nnz = 0). Call with a
// CUDA device current; it asks CUB for its sort storage.
std::size_t embedding_bag_backward_workspace_bytes(std::int64_t nnz, std::int64_t dim);

void embedding_bag_backward_update(const TableLayout& layout, const EmbeddingBagBackwardArgs& a,
                                   const EmbeddingOptimizerParams& p, const Stream* stream = nullptr);

// ---- Bag permutation ---------------------------------------------------------------------------
// CSR bags in another order: output bag k is input bag permutation[k] (FBGEMM's
// permute_1D_sparse_data, with which TorchRec regroups the ids an all-to-all delivered rank by
// rank). Integers are moved, nothing is computed: every device gives the same bits.
//   GPU: the input offsets and the output's are CUB exclusive / inclusive sums of the lengths (the
//   output's taken in output order), then one thread per output bag copies its entries.
struct PermuteBagsArgs {
  TensorView lengths;      // i64 [n]: the input bags' sizes, >= 0, in input order
  TensorView indices;      // i64 [nnz]: the input bags' entries, bag after bag (nnz = sum of lengths)
  TensorView permutation;  // i64 [n]: a permutation of [0, n)
  TensorView out_offsets;  // i64 [n + 1]: written (=), the output's CSR offsets (out_offsets[0] = 0)
  TensorView out_indices;  // i64 [nnz]: written (=), apart from indices
  // u8 [permute_bags_workspace_bytes(n)] on the device (GPU only; the CPU ignores it).
  std::optional<TensorView> workspace;
};

// Bytes of workspace the GPU permutation needs for n bags. Call with a CUDA device current (it
// asks CUB for its scan storage); 0 in a build without CUDA.
std::size_t permute_bags_workspace_bytes(std::int64_t n);

// The CPU checks that lengths sum to nnz and that permutation is one; a GPU trusts both (they are
// made on the host, or sent by ranks that made them there), as it trusts CSR input.
void permute_bags(const PermuteBagsArgs& a, const Stream* stream = nullptr);

// ---- Dense optimizer ---------------------------------------------------------------------------
// One optimizer step over a whole parameter buffer, element by element in f32:
//   SGD      param -= lr * grad
//   Adagrad  state += grad * grad;  param -= lr * grad / (sqrt(state) + eps)
struct DenseOptimizerArgs {
  TensorView param;                 // f32, contiguous, any rank: updated in place
  TensorView grad;                  // f32, param's shape and device
  std::optional<TensorView> state;  // f32, param's shape: Adagrad only (required then), updated in place
};

struct DenseOptimizerParams {
  bool adagrad = false;  // false: SGD
  float lr = 0.01f;
  float eps = 1e-10f;
};

void dense_optimizer_update(const DenseOptimizerArgs& a, const DenseOptimizerParams& p,
                            const Stream* stream = nullptr);

// ---- Interaction ------------------------------------------------------------------------------
enum class InteractionKind {
  dot,    // R[b] = [Z[b, 0, :], <Z[b, i], Z[b, j]> for i in [0, F), j in [0, i) (j <= i with self)]
  cat,    // R[b] = Z[b] flattened (F * D)
  outer,  // R[b, i * n + j] = c_i c_j, c = Z[b] flattened, n = F * D
};

// How the GPU computes the dot interaction (cat and outer have one implementation; the CPU spec
// has one for every kind).
enum class InteractionImpl {
  fused,  // one pass per sample, Z[b] in shared memory, no [F, F] matrix in memory
  bmm,    // unfused: ZZ[b] = Z[b] Z[b]ᵀ by one batched fp32 GEMM into the workspace, then a gather
          // into R; backward: a scatter of dR into S [B, F, F] (the workspace), dZ[b] = S[b] Z[b]
          // by one batched GEMM, then dZ[b, 0] += dR[b, :D]
};

struct InteractionParams {
  InteractionKind kind = InteractionKind::dot;
  bool self_interaction = false;  // dot: include the pairs (i, i) (DlrmConfig::interaction_itself)
  InteractionImpl impl = InteractionImpl::fused;
};

// Whether the GPU's fused dot interaction takes Z [B, F, D] both ways (each stages a sample in
// shared memory, 8 samples a block); otherwise impl bmm, with its workspace, runs it.
bool interaction_dot_fused_fits(std::int64_t features, std::int64_t dim) noexcept;

// I: the columns of R. dot: D + F (F - 1) / 2 (+ F with self_interaction); cat: F D; outer: (F D)^2.
std::int64_t interaction_size(const InteractionParams& p, std::int64_t features, std::int64_t dim);

// The dot interaction's pair order, made once per (F, self, device): k -> (i << 16 | j).
class DotPairs {
 public:
  DotPairs() = default;
  // When `device` is a GPU, copies the pairs there (synchronously).
  DotPairs(std::int64_t features, bool self_interaction, Device device = Device::cpu());
  std::int64_t features() const noexcept { return features_; }
  bool self_interaction() const noexcept { return self_; }
  const std::vector<std::uint32_t>& host() const noexcept { return host_; }
  const TensorView& device_pairs() const noexcept { return device_.view(); }  // i32 [P] (empty on the CPU)

 private:
  std::int64_t features_ = 0;
  bool self_ = false;
  std::vector<std::uint32_t> host_;
  Tensor device_;
};

struct InteractionForwardArgs {
  TensorView z;  // f32 [B, F, D], contiguous
  TensorView r;  // f32 [B, I] with row stride ldr >= I, inner stride 1: written (=), padding columns zeroed
  const DotPairs* pairs = nullptr;  // dot: required, for z's F and device
  // f32 [B, F, F], contiguous, on z's device: ZZ (dot with impl bmm on a GPU: required; its
  // contents need no initialisation and are overwritten). Ignored otherwise.
  std::optional<TensorView> workspace = std::nullopt;
};

struct InteractionBackwardArgs {
  TensorView z;   // f32 [B, F, D], contiguous: the forward's input
  TensorView dr;  // f32 [B, I] with row stride ldr >= I
  TensorView dz;  // f32 [B, F, D], contiguous: written (=)
  const DotPairs* pairs = nullptr;
  // dot only: Z[b, 0] is the output of a ReLU (DLRM's bottom MLP): dZ[b, 0] is multiplied by
  // (Z[b, 0] > 0) in the same pass, the ReLU's backward fused (impl fused only).
  bool relu_x = false;
  // f32 [B, F, F], contiguous, on z's device: S (dot with impl bmm on a GPU: required; its
  // contents need no initialisation and are overwritten). Ignored otherwise.
  std::optional<TensorView> workspace = std::nullopt;
};

void interaction_forward(const InteractionForwardArgs& a, const InteractionParams& p, const Stream* stream = nullptr);
void interaction_backward(const InteractionBackwardArgs& a, const InteractionParams& p,
                          const Stream* stream = nullptr);

// ---- DCNv2 cross layer (low rank) -------------------------------------------------------------
// One layer of the low-rank cross network of DCNv2 (Wang et al. 2021), the interaction of the
// MLPerf DLRM-DCNv2 model. N = F * D inputs (x0 = Z flattened: the bottom MLP's output, then the
// pooled embeddings), rank r:
//   h       = V x_l                  h [B, r]
//   x_{l+1} = x0 ⊙ (U h + b) + x_l   x [B, N]
// with U [N, r], V [r, N], b [N]: TorchRec's LowRankCrossNet (torchrec/modules/crossnet.py, which
// the MLPerf recommendation_v2 reference runs), its W_kernels[l] our U, its V_kernels[l] our V.
// The backward, from dy = dL/dx_{l+1} (p = U h recomputed from the kept h: one GEMM, instead of
// keeping a [B, N] activation per layer):
//   dp = dy ⊙ x0;  db = Σ_b dp;  dU = dpᵀ h;  dh = dp U;  dV = dhᵀ x_l
//   dx0 += dy ⊙ (p + b);  dx_l = dy + dh V
// The GPU runs the GEMMs through fk::gemm (cuBLAS / cuBLASLt, dU and db in one call) and the
// elementwise parts as one pass each way: forward out = x0 ⊙ (out + b) + x_l in place over the
// second GEMM's output; backward dp and dx0 from (dy, x0, p, b) in one pass over p.
struct CrossLayerForwardArgs {
  TensorView x0;    // f32 [B, N], unit column stride, row stride >= N
  TensorView xl;    // f32 [B, N], likewise; may be x0 itself (the first layer)
  TensorView u;     // f32 [N, r], unit column stride, row stride >= r
  TensorView v;     // f32 [r, N], likewise
  TensorView bias;  // f32 [N]
  TensorView h;     // f32 [B, r]: written (=) with V x_l (the backward's input)
  TensorView out;   // f32 [B, N]: written (=) with x_{l+1}; overlaps no input
};

struct CrossLayerBackwardArgs {
  TensorView x0, xl, u, v, bias, h;  // the forward's (h as it wrote it)
  // f32 [B, N]: on entry dL/dx_{l+1}; on return (=) dL/dx_l, the layer below's dy, except with
  // first_layer, where it is left as it was (its gradient goes to dx0).
  TensorView dy;
  // f32 [B, N]: += dy ⊙ (U h + b); with first_layer (x_l is x0) also += dL/dx_l.
  TensorView dx0;
  TensorView du;     // f32 [N, r]: written (=)
  TensorView dv;     // f32 [r, N]: written (=)
  TensorView dbias;  // f32 [N]: written (=)
  bool first_layer = false;
  // GPU: f32 [cross_layer_workspace_floats(B, N, r)], contiguous, on x0's device (p and dh). Its
  // contents need no initialisation and are garbage afterwards. The CPU ignores it.
  std::optional<TensorView> workspace = std::nullopt;
};

struct CrossLayerParams {
  bool allow_tf32 = false;  // GPU: the GEMMs on TF32 tensor cores
};

std::int64_t cross_layer_workspace_floats(std::int64_t batch, std::int64_t n, std::int64_t rank);

void cross_layer_forward(const CrossLayerForwardArgs& a, const CrossLayerParams& p = {}, const Stream* stream = nullptr);
void cross_layer_backward(const CrossLayerBackwardArgs& a, const CrossLayerParams& p = {},
                          const Stream* stream = nullptr);

// ---- Loss -------------------------------------------------------------------------------------
// Doubles of the accumulator sigmoid_bce_forward_backward adds to: [0] the sum of the mean losses,
// [1] the number of calls, then scratch (the per-block partials of the fixed-order reduction).
inline constexpr int kSigmoidBceAccumulatorDoubles = 2 + 64;

struct SigmoidBceArgs {
  TensorView logits;   // f32 [B], B >= 1
  TensorView labels;   // f32 [B], 0 or 1 (any value in [0, 1] is accepted)
  TensorView dlogits;  // f32 [B]: written (=) with (sigmoid(x) - y) / B
  // u8 [8 * kSigmoidBceAccumulatorDoubles], 8-byte aligned, on the logits' device, read as doubles:
  // [0] += the mean loss (max(x, 0) - x y + log1p(exp(-|x|)), summed in double in a fixed order),
  // [1] += 1. Zero it once; read it when the loss is wanted (no host synchronisation per call).
  TensorView accumulator;
  // f32 [B]: written (=) with p = sigmoid(x) (unfused only: required there, refused by the fused loss).
  std::optional<TensorView> probabilities = std::nullopt;
};

struct SigmoidBceParams {
  // false: the fused loss above (one pass). true: the unfused baseline PyTorch's
  // BCELoss(sigmoid(x)) runs, three kernels: p = sigmoid(x) (into probabilities); the loss
  // -mean(y max(log p, -100) + (1 - y) max(log(1 - p), -100)) from the f32 p, added to the
  // accumulator as above; dlogits = (p - y) / B. It departs from the fused loss by the rounding
  // of p, which grows as p nears 0 or 1; where p rounds to 1 (x above about 17) or to 0 (x below
  // about -88), the clamp caps a mislabelled sample's term at 100.
  bool unfused = false;
};

// The fused loss.
void sigmoid_bce_forward_backward(const SigmoidBceArgs& a, const Stream* stream = nullptr);
void sigmoid_bce_forward_backward(const SigmoidBceArgs& a, const SigmoidBceParams& p, const Stream* stream = nullptr);

// The spec: plain loops over host tensors, double accumulation. Same arguments as above.
namespace reference {
void embedding_bag_forward(const TableLayout& layout, const EmbeddingBagForwardArgs& a, const EmbeddingBagParams& p);
void embedding_bag_backward_update(const TableLayout& layout, const EmbeddingBagBackwardArgs& a,
                                   const EmbeddingOptimizerParams& p);
void interaction_forward(const InteractionForwardArgs& a, const InteractionParams& p);
void interaction_backward(const InteractionBackwardArgs& a, const InteractionParams& p);
void dense_optimizer_update(const DenseOptimizerArgs& a, const DenseOptimizerParams& p);
void cross_layer_forward(const CrossLayerForwardArgs& a);
void cross_layer_backward(const CrossLayerBackwardArgs& a);
void sigmoid_bce_forward_backward(const SigmoidBceArgs& a);  // the fused loss
void sigmoid_bce_forward_backward(const SigmoidBceArgs& a, const SigmoidBceParams& p);
void permute_bags(const PermuteBagsArgs& a);
// The row a raw value selects.
std::int64_t hash_row(std::uint32_t v, std::int64_t rows, RowHash hash);
}  // namespace reference

}  // namespace fk
