// The CUDA layer of the recsys family: raw launchers over device pointers, called by recsys.cpp
// after every argument was checked. Everything is fp32 (the tables also bf16 or f16), row-major,
// on one stream; every launcher
// returns after enqueueing (no synchronisation), so a caller can capture them in a CUDA graph.
// The spec (reference.cpp) defines what each computes; tests/ops/recsys_test.cpp holds them to it.
//
// Layouts (B = batch, T = tables, D = embedding dim, F = features of the interaction, I = its size):
//   tables      one buffer [total_rows, D]; table t starts at row base[t] and holds rows[t] rows
//   pooled out  bag (t, b) at out + b * out_stride + t * D (DLRM: out = Z + D, out_stride = F * D,
//               so that bag (t, b) lands in Z[b, 1 + t])
//   one-hot raw input: raw [T * B] u32, table-major (bag q = t * B + b)
//   CSR input   indices [nnz] i64 (row within its table), offsets [T * B + 1] i64 (bag q = t * B + b)
//   Z [B, F, D] contiguous; R [B, ldr] with ldr >= I (the padding columns are written as zeros)
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "fusekit/ops/recsys.hpp"

namespace fk::cuda {

// ---- Embedding bags ---------------------------------------------------------------------------

struct TableSet {
  void* weights = nullptr;                // [total_rows, D] of dtype (store_gradient: the f32 dense gradient)
  DType dtype = DType::f32;               // f32, bf16 or f16
  float* adagrad_state = nullptr;         // [total_rows, D]; rowwise: [total_rows]; null: SGD
  const std::int64_t* base = nullptr;     // device [T] first row of each table
  const std::int64_t* rows = nullptr;     // device [T]
  // device [T], or null: 16-bit tables' draws for row r of table t as for row draw_base[t] + r
  // (TableLayout's draw bases; null: base[t] + r, the row itself).
  const std::int64_t* draw_base = nullptr;
  int tables = 0;
  int dim = 0;
  // embedding_backward_fused: write each touched row's summed gradient into `weights` (a dense
  // gradient buffer, zeroed beforehand) instead of updating it (the reference's dense gradient,
  // made deterministic the way PyTorch's embedding backward is: by sorting).
  bool store_gradient = false;
  // Row-wise Adagrad: adagrad_state holds one float per row (state += mean_d g^2).
  bool rowwise = false;
  // 16-bit weights: the stochastic rounding's stream (seed, offset + *offset_counter when not
  // null, read when the kernel runs); element flat = row' * D + c draws from block flat / 8, row'
  // the row's place at the draw bases.
  std::uint64_t seed = 0, offset = 0;
  const std::uint64_t* offset_counter = nullptr;
};

// Every (table, sample) bag in one launch. With `raw` (one value per bag) the row is hash(raw)
// computed here; otherwise CSR indices/offsets (rows already in range). mean: each bag's sum is
// divided by its size (an empty bag gives zeros). When key is not null, writes per nnz entry k
// key[k] = global row, bag[k] = t * B + b (the backward's sort input; for raw input k = q).
void embedding_forward_fused(const TableSet& tables, const std::uint32_t* raw, RowHash hash,
                             const std::int64_t* indices, const std::int64_t* offsets, std::int64_t batch, float* out,
                             std::int64_t out_stride, bool mean, std::uint32_t* key, std::uint32_t* bag,
                             cudaStream_t s);
// The unfused baseline: table t alone (launched once per table), CSR input, f32 tables.
void embedding_forward_table(const float* table, int dim, int t, const std::int64_t* indices,
                             const std::int64_t* offsets, std::int64_t batch, float* out, std::int64_t out_stride,
                             bool mean, cudaStream_t s);
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
// depend on timing (deterministic). The gradient of bag q = t * B + b is read at
// dout + b * out_stride + t * D; with mean_offsets (the forward's CSR offsets) it is divided by
// the bag's size (mean pooling).
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
                              const std::uint32_t* bag, std::int64_t nnz, std::int64_t batch, const float* dout,
                              std::int64_t out_stride, const std::int64_t* mean_offsets, float lr, float eps,
                              const SparseBackwardWorkspace& ws, cudaStream_t s);

// ---- Bag permutation (permute_bags.cu) -------------------------------------------------------------
// Output bag k = input bag perm[k]: in_start = exclusive sum of lengths, the output's lengths
// gathered in output order and summed (inclusive) into out_offsets[1..n] (out_offsets[0] = 0), then
// one thread per output bag copies its entries.
struct PermuteBagsWorkspace {
  std::int64_t* in_start = nullptr;     // [n]
  std::int64_t* out_lengths = nullptr;  // [n]
  void* scan_temp = nullptr;
  std::size_t scan_bytes = 0;
};
// Bytes of CUB temp storage for the scans over n bags.
std::size_t permute_bags_scan_bytes(std::int64_t n);
void permute_bags(const std::int64_t* lengths, const std::int64_t* indices, const std::int64_t* perm, std::int64_t n,
                  std::int64_t* out_offsets, std::int64_t* out_indices, const PermuteBagsWorkspace& ws,
                  cudaStream_t s);

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
// The unfused dot pieces (around a cuBLAS bmm ZZ[b] = Z[b] Z[b]ᵀ): R[b] = [Z[b, 0], ZZ[b, i, j] for
// the pairs]; S[b] = symmetric scatter of dR (S_ij = S_ji = g, S_ii = 2 g); dZ[b, 0, :] += dR[b, :D].
void interaction_gather(const float* z, const float* zz, const std::uint32_t* pairs, int num_pairs, int features,
                        int dim, std::int64_t batch, float* r, std::int64_t ldr, cudaStream_t s);
void interaction_scatter(const float* dr, std::int64_t ldr, const std::uint32_t* pairs, int num_pairs, int features,
                         int dim, std::int64_t batch, float* sym, cudaStream_t s);
void add_dense_grad(const float* dr, int ld_dr, int dim, int ld_dz, std::int64_t batch, float* dz, cudaStream_t s);
// cat: R[b, :n] = Z[b] flattened (n = F * D), padding columns [n, ldr) zeroed; backward dZ[b] = dR[b, :n].
void interaction_cat_forward(const float* z, std::int64_t n, std::int64_t batch, float* r, std::int64_t ldr,
                             cudaStream_t s);
void interaction_cat_backward(const float* dr, std::int64_t ldr, std::int64_t n, std::int64_t batch, float* dz,
                              cudaStream_t s);
// outer: R[b, i * n + j] = c_i c_j, n = F * D (c = Z[b] flattened); R contiguous [B, n * n].
void interaction_outer_forward(const float* z, std::int64_t n, std::int64_t batch, float* r, cudaStream_t s);
// outer backward: dc_i = sum_j (G_ij + G_ji) c_j, G = dR[b] as [n, n]; dZ contiguous [B, n].
void interaction_outer_backward(const float* z, const float* dr, std::int64_t n, std::int64_t batch, float* dz,
                                cudaStream_t s);

// ---- DCNv2 cross layer (cross_layer.cu) ------------------------------------------------------------
// The elementwise halves of cross_layer_forward / backward, each one pass over [B, N] (row strides
// ld_*, unit column stride). Forward, in place over out, which holds p = U h on entry:
//   out = x0 ⊙ (out + b) + xl
void cross_forward_epilogue(const float* x0, std::int64_t ld_x0, const float* xl, std::int64_t ld_xl,
                            const float* bias, float* out, std::int64_t ld_out, std::int64_t batch, std::int64_t n,
                            cudaStream_t s);
// Backward, in place over p [B, N] (contiguous), which holds U h on entry:
//   dx0 += dy ⊙ (p + b)  (+ dy with first_layer);  p = dy ⊙ x0  (dp, what the GEMMs read next)
void cross_backward_epilogue(const float* x0, std::int64_t ld_x0, const float* dy, std::int64_t ld_dy,
                             const float* bias, float* p, float* dx0, std::int64_t ld_dx0, std::int64_t batch,
                             std::int64_t n, bool first_layer, cudaStream_t s);

// ---- Loss ---------------------------------------------------------------------------------------
// fused: one pass: loss from the logits (stable), dlogit = (sigmoid(x) - y) / B, and
// loss_acc[0] += mean loss, loss_acc[1] += 1 (doubles; fixed-order reductions). loss_acc holds
// kLossAccDoubles doubles (the per-block partials after the two accumulators).
inline constexpr int kLossAccDoubles = kSigmoidBceAccumulatorDoubles;
void sigmoid_bce_fused(const float* logits, const float* labels, std::int64_t batch, float* dlogits,
                       double* loss_acc, cudaStream_t s);
// The unfused baseline: p = sigmoid(x); loss = mean of PyTorch's BCELoss on p (log clamped at
// -100), added to loss_acc; dlogit = (p - y) / B. Three kernels.
void sigmoid_bce_reference(const float* logits, const float* labels, std::int64_t batch, float* p, float* dlogits,
                           double* loss_acc, cudaStream_t s);
// p = 1 / (1 + exp(-x)) on n floats (probabilities for evaluation).
void sigmoid(const float* x, float* p, std::int64_t n, cudaStream_t s);

}  // namespace fk::cuda
