// The CUDA kernels of the GPU DLRM (models/dlrm_gpu.cpp wires them). Everything is fp32,
// row-major, on one stream; every launcher returns after enqueueing (no synchronisation), so the
// fused step can be captured in a CUDA graph. The CPU layers of models/layers.hpp are the spec;
// tests/models/dlrm_gpu_test.cpp compares both GPU implementations with them.
//
// Layouts (B = batch, T = tables, F = T + 1, D = embedding dim, I = interaction size):
//   Z  [B, F, D]   Z[b, 0] = bottom-MLP output, Z[b, 1 + t] = bag (t, b) of table t
//   R  [B, I]      interaction output (dot: [Z[b, 0], <Z_i, Z_j> for (i, j) in pair order])
//   one-hot raw input: raw [T * B] u32, table-major (entry e = t * B + b)
//   CSR input: indices [nnz] i64, offsets [T * B + 1] i64 (bag (t, b) = t * B + b)
//   Tables live in one buffer [total_rows, D]; table t starts at row table_base[t].
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace fk::models::gpu {

// ---- MLP pieces -------------------------------------------------------------------------------
// y[b, j] += bias[j] (y has leading dimension ld).                                 reference
void bias_add(float* y, const float* bias, std::int64_t rows, std::int64_t cols, std::int64_t ld, cudaStream_t s);
// y = max(y, 0) in place.                                                            reference
void relu_inplace(float* y, std::int64_t rows, std::int64_t cols, std::int64_t ld, cudaStream_t s);
// dy[b, j] = y[b, j] > 0 ? dy[b, j] : 0 in place.                                    reference
void relu_backward_inplace(float* dy, const float* y, std::int64_t rows, std::int64_t cols, std::int64_t ld_dy,
                           std::int64_t ld_y, cudaStream_t s);
// db[j] = sum_b dz[b, j], in a fixed order (deterministic). When y is not null the ReLU derivative
// is applied first and written back: dz = dz * (y > 0) (the fused bias-gradient pass).
// `partial` holds ceil(rows / 256) * cols floats.
void column_sum(float* dz, const float* y, float* db, std::int64_t rows, std::int64_t cols, std::int64_t ld_dz,
                std::int64_t ld_y, float* partial, cudaStream_t s);
std::size_t column_sum_partial_floats(std::int64_t rows, std::int64_t cols);

// ---- Embeddings -------------------------------------------------------------------------------
enum class RawHash : int { seed = 0, reference = 1 };  // (v + 1) % rows  |  v % rows

struct TableSet {
  float* weights = nullptr;               // [total_rows, D]
  float* adagrad_state = nullptr;         // [total_rows, D] or null (SGD)
  const std::int64_t* base = nullptr;     // device [T] first row of each table
  const std::int64_t* rows = nullptr;     // device [T]
  int tables = 0;
  int dim = 0;
  // embedding_backward_fused: write each touched row's summed gradient into `weights` (a dense
  // gradient buffer, zeroed beforehand) instead of updating it (the reference's dense gradient,
  // made deterministic the way PyTorch's embedding backward is: by sorting).
  bool store_gradient = false;
};

// fused: every (table, sample) bag in one launch. With `raw` (one value per bag) the row is
// hash(raw) computed here; otherwise CSR indices/offsets (rows already hashed, validated on the
// host). Writes Z[b, 1 + t] and, per nnz entry k, key[k] = global row, bag[k] = t * B + b (the
// backward's sort input).
void embedding_forward_fused(const TableSet& tables, const std::uint32_t* raw, RawHash hash,
                             const std::int64_t* indices, const std::int64_t* offsets, std::int64_t batch, float* z,
                             std::uint32_t* key, std::uint32_t* bag, cudaStream_t s);
// reference: table t alone (launched once per table), CSR input, writes Z[b, 1 + t].
void embedding_forward_table(const float* table, int dim, int t, int tables, const std::int64_t* indices,
                             const std::int64_t* offsets, std::int64_t batch, float* z, cudaStream_t s);
// The sort keys of CSR input without a lookup: key[k] = table_base[t] + indices[k], bag[k] = t * B + b.
void embedding_keys(const TableSet& tables, const std::int64_t* indices, const std::int64_t* offsets,
                    std::int64_t batch, std::uint32_t* key, std::uint32_t* bag, cudaStream_t s);

// SGD (lr) or Adagrad (state != null: state += g^2; p -= lr g / (sqrt(state) + eps)) on n floats.
void optimizer_update(float* param, const float* grad, float* state, std::int64_t n, float lr, float eps,
                      cudaStream_t s);

// The fused embedding backward + optimizer: sorts the nnz (key, bag) pairs by key (CUB radix
// sort, stable), sums each distinct row's gradients in a fixed order (a segmented warp scan over
// chunks of 32 sorted entries, then one warp per row that spans chunks) and applies the update to
// that row straight away. No dense (or coalesced) gradient is ever stored; the result does not
// depend on timing (deterministic).
struct SparseBackwardWorkspace {
  std::uint32_t* key_sorted = nullptr;
  std::uint32_t* bag_sorted = nullptr;
  void* sort_temp = nullptr;
  std::size_t sort_temp_bytes = 0;
  float* head = nullptr;      // [chunks, D]
  float* tail = nullptr;      // [chunks, D]
  std::uint8_t* ends = nullptr;  // [chunks] 1 when the chunk's first piece ends in it
  int* owners = nullptr;      // [chunks + 1]: count, then chunk ids
};
// Bytes of CUB temp storage, and chunks (ceil(nnz / 32)), for nnz entries.
std::size_t sparse_backward_sort_bytes(std::int64_t nnz);
std::int64_t sparse_backward_chunks(std::int64_t nnz);
void embedding_backward_fused(const TableSet& tables, int key_bits, const std::uint32_t* key,
                              const std::uint32_t* bag, std::int64_t nnz, std::int64_t batch, const float* dz,
                              float lr, float eps, const SparseBackwardWorkspace& ws, cudaStream_t s);

// ---- Interaction --------------------------------------------------------------------------------
// pairs: device [P] of (i << 16 | j), the dot interaction's output order. R has leading
// dimension ldr >= D + P; its padding columns are written as zeros.
// fused dot: one warp per sample (Z in shared memory).
void interaction_dot_forward(const float* z, const std::uint32_t* pairs, int num_pairs, int features, int dim,
                             std::int64_t batch, float* r, std::int64_t ldr, cudaStream_t s);
// dZ[b, i] = sum_j S_ij Z[b, j] (+ dR[b, :D] for i = 0), S the symmetric gradient of the dot
// matrix. relu_x: Z[b, 0] is a ReLU output (the bottom MLP's), so dZ[b, 0] is masked by Z[b, 0] > 0
// here (the bottom MLP's last ReLU derivative, fused).
void interaction_dot_backward(const float* z, const float* dr, std::int64_t ldr, const std::uint32_t* pairs,
                              int num_pairs, int features, int dim, std::int64_t batch, float* dz, bool relu_x,
                              cudaStream_t s);
// reference dot pieces (around cuBLAS bmm): R[b] = [Z[b, 0], ZZ[b, i, j] for the pairs];
// S[b] = symmetric scatter of dR (S_ij = S_ji = g, S_ii = 2 g); dZ[b, 0, :] += dR[b, :D].
void interaction_gather(const float* z, const float* zz, const std::uint32_t* pairs, int num_pairs, int features,
                        int dim, std::int64_t batch, float* r, std::int64_t ldr, cudaStream_t s);
void interaction_scatter(const float* dr, std::int64_t ldr, const std::uint32_t* pairs, int num_pairs, int features,
                         int dim, std::int64_t batch, float* sym, cudaStream_t s);
void add_dense_grad(const float* dr, int ld_dr, int dim, int ld_dz, std::int64_t batch, float* dz, cudaStream_t s);
// outer: R[b, i * n + j] = c_i c_j, n = F * D (c = Z[b] flattened).
void interaction_outer_forward(const float* z, std::int64_t n, std::int64_t batch, float* r, cudaStream_t s);
// Copies rows of `cols` floats between strided buffers (x into Z[:, 0], Z[:, 0] out of dZ, ...).
void copy_rows(const float* src, std::int64_t ld_src, float* dst, std::int64_t ld_dst, std::int64_t rows,
               std::int64_t cols, cudaStream_t s);

// ---- bf16 conversions (for MLPs run through fused_mlp) ------------------------------------------
// dst [rows, cols] bf16 (contiguous) = src [rows, cols] f32 (leading dimension ld_src), rounded to nearest.
void to_bf16_rows(const float* src, std::int64_t ld_src, std::uint16_t* dst, std::int64_t rows, std::int64_t cols,
                  cudaStream_t s);
// dst [rows, cols] f32 (leading dimension ld_dst) = src [rows, cols] bf16 (contiguous).
void from_bf16_rows(const std::uint16_t* src, float* dst, std::int64_t ld_dst, std::int64_t rows, std::int64_t cols,
                    cudaStream_t s);

// ---- Loss ---------------------------------------------------------------------------------------
// fused: one pass: loss from the logits (stable), dlogit = (sigmoid(x) - y) / B, and
// loss_acc[0] += mean loss, loss_acc[1] += 1 (doubles; fixed-order reductions). loss_acc holds
// kLossAccDoubles doubles (the per-block partials after the two accumulators).
inline constexpr int kLossAccDoubles = 2 + 64;
void sigmoid_bce_fused(const float* logits, const float* labels, std::int64_t batch, float* dlogits,
                       double* loss_acc, cudaStream_t s);
// reference: p = sigmoid(x); loss = mean of PyTorch's BCELoss on p (log clamped at -100), added to
// loss_acc; dlogit = (p - y) / B. Three kernels.
void sigmoid_bce_reference(const float* logits, const float* labels, std::int64_t batch, float* p, float* dlogits,
                           double* loss_acc, cudaStream_t s);
void sigmoid(const float* x, float* p, std::int64_t n, cudaStream_t s);

}  // namespace fk::models::gpu
