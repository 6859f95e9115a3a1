// Kernels of the GPU DLRM; contracts in dlrm_kernels.hpp.
#include <cuda_bf16.h>

#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <cmath>

#include "fusekit/core/cuda_check.hpp"
#include "models/dlrm_kernels.hpp"

namespace fk::models::gpu {

namespace {

constexpr int kThreads = 256;

unsigned blocks_for(std::int64_t n, int threads = kThreads) {
  return static_cast<unsigned>(std::max<std::int64_t>(1, std::min<std::int64_t>((n + threads - 1) / threads, 1 << 20)));
}

// ---- MLP pieces -------------------------------------------------------------------------------

__global__ void bias_add_kernel(float* y, const float* bias, std::int64_t rows, std::int64_t cols, std::int64_t ld) {
  const std::int64_t n = rows * cols;
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n; i += std::int64_t{gridDim.x} * blockDim.x) {
    const std::int64_t r = i / cols, c = i % cols;
    y[r * ld + c] += bias[c];
  }
}

__global__ void relu_kernel(float* y, std::int64_t rows, std::int64_t cols, std::int64_t ld) {
  const std::int64_t n = rows * cols;
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n; i += std::int64_t{gridDim.x} * blockDim.x) {
    const std::int64_t r = i / cols, c = i % cols;
    y[r * ld + c] = fmaxf(y[r * ld + c], 0.0f);
  }
}

__global__ void relu_backward_kernel(float* dy, const float* y, std::int64_t rows, std::int64_t cols,
                                     std::int64_t ld_dy, std::int64_t ld_y) {
  const std::int64_t n = rows * cols;
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n; i += std::int64_t{gridDim.x} * blockDim.x) {
    const std::int64_t r = i / cols, c = i % cols;
    if (!(y[r * ld_y + c] > 0.0f)) dy[r * ld_dy + c] = 0.0f;
  }
}

// Block (32, 8): thread (x, y) sums Vec adjacent columns starting at Vec * (32 bx + x) over rows
// y, y + 8, ... of the chunk [kSumRows by, +kSumRows), in that order, then the block adds its 8 row
// groups in order: a fixed summation order (deterministic), every load independent of the sums.
constexpr int kSumRows = 256;

template <int Vec>
__global__ void column_partial_kernel(float* dz, const float* y, float* partial, std::int64_t rows, std::int64_t cols,
                                      std::int64_t ld_dz, std::int64_t ld_y) {
  __shared__ float sums[8][32 * Vec + 1];
  const std::int64_t col = (blockIdx.x * std::int64_t{32} + threadIdx.x) * Vec;
  const std::int64_t row0 = blockIdx.y * std::int64_t{kSumRows};
  const std::int64_t row_end = row0 + kSumRows < rows ? row0 + kSumRows : rows;
  float acc[Vec] = {};
  if (col < cols) {
#pragma unroll 8
    for (std::int64_t r = row0 + threadIdx.y; r < row_end; r += 8) {
      float g[Vec];
      if constexpr (Vec == 4) {
        const float4 v = *reinterpret_cast<const float4*>(dz + r * ld_dz + col);
        g[0] = v.x, g[1] = v.y, g[2] = v.z, g[3] = v.w;
      } else {
        g[0] = dz[r * ld_dz + col];
      }
      if (y != nullptr) {
        float m[Vec];
        if constexpr (Vec == 4) {
          const float4 v = *reinterpret_cast<const float4*>(y + r * ld_y + col);
          m[0] = v.x, m[1] = v.y, m[2] = v.z, m[3] = v.w;
        } else {
          m[0] = y[r * ld_y + col];
        }
#pragma unroll
        for (int k = 0; k < Vec; ++k) g[k] = m[k] > 0.0f ? g[k] : 0.0f;
        if constexpr (Vec == 4) {
          *reinterpret_cast<float4*>(dz + r * ld_dz + col) = make_float4(g[0], g[1], g[2], g[3]);
        } else {
          dz[r * ld_dz + col] = g[0];
        }
      }
#pragma unroll
      for (int k = 0; k < Vec; ++k) acc[k] += g[k];
    }
  }
#pragma unroll
  for (int k = 0; k < Vec; ++k) sums[threadIdx.y][threadIdx.x * Vec + k] = acc[k];
  __syncthreads();
  const int flat = threadIdx.y * 32 + threadIdx.x;
  const std::int64_t c = blockIdx.x * std::int64_t{32} * Vec + flat;
  if (flat < 32 * Vec && c < cols) {
    float total = 0.0f;
    for (int k = 0; k < 8; ++k) total += sums[k][flat];
    partial[blockIdx.y * cols + c] = total;
  }
}

// One warp per column: lanes take chunks lane, lane + 32, ... in order, then a fixed butterfly.
__global__ void column_final_kernel(const float* partial, float* db, std::int64_t chunks, std::int64_t cols) {
  const std::int64_t col = (blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (col >= cols) return;
  float s = 0.0f;
  for (std::int64_t k = lane; k < chunks; k += 32) s += partial[k * cols + col];
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
  if (lane == 0) db[col] = s;
}

// ---- Embeddings -------------------------------------------------------------------------------

__device__ __forceinline__ std::int64_t hash_row(std::uint32_t v, std::int64_t rows, RawHash hash) {
  const std::uint64_t x = hash == RawHash::seed ? std::uint64_t{v} + 1 : std::uint64_t{v};
  return static_cast<std::int64_t>(x % static_cast<std::uint64_t>(rows));
}

template <int Vec>
__global__ void embedding_fused_kernel(TableSet ts, const std::uint32_t* raw, RawHash hash,
                                       const std::int64_t* indices, const std::int64_t* offsets, std::int64_t batch,
                                       float* z, std::uint32_t* key, std::uint32_t* bag) {
  const int lanes = ts.dim / Vec;
  const std::int64_t bags = batch * ts.tables;
  const std::int64_t gid = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
  const std::int64_t q = gid / lanes;
  const int part = static_cast<int>(gid % lanes);
  if (q >= bags) return;
  const int t = static_cast<int>(q / batch);
  const std::int64_t b = q % batch;
  const std::int64_t features = ts.tables + 1;
  float* dst = z + (b * features + 1 + t) * ts.dim + part * Vec;
  const std::int64_t base = ts.base[t];
  if (raw != nullptr) {
    const std::int64_t row = base + hash_row(raw[q], ts.rows[t], hash);
    if (part == 0) {
      key[q] = static_cast<std::uint32_t>(row);
      bag[q] = static_cast<std::uint32_t>(q);
    }
    const float* src = ts.weights + row * ts.dim + part * Vec;
    if constexpr (Vec == 4) {
      *reinterpret_cast<float4*>(dst) = __ldg(reinterpret_cast<const float4*>(src));
    } else {
      *dst = __ldg(src);
    }
    return;
  }
  float acc[Vec] = {};
  for (std::int64_t k = offsets[q]; k < offsets[q + 1]; ++k) {
    const std::int64_t row = base + indices[k];
    if (part == 0) {
      key[k] = static_cast<std::uint32_t>(row);
      bag[k] = static_cast<std::uint32_t>(q);
    }
    const float* src = ts.weights + row * ts.dim + part * Vec;
#pragma unroll
    for (int i = 0; i < Vec; ++i) acc[i] += __ldg(src + i);
  }
#pragma unroll
  for (int i = 0; i < Vec; ++i) dst[i] = acc[i];
}

__global__ void embedding_table_kernel(const float* table, int dim, int t, int tables, const std::int64_t* indices,
                                       const std::int64_t* offsets, std::int64_t batch, float* z) {
  const std::int64_t gid = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
  const std::int64_t b = gid / dim;
  const int d = static_cast<int>(gid % dim);
  if (b >= batch) return;
  const std::int64_t q = t * batch + b;
  float acc = 0.0f;
  for (std::int64_t k = offsets[q]; k < offsets[q + 1]; ++k) acc += table[indices[k] * dim + d];
  z[(b * (tables + 1) + 1 + t) * dim + d] = acc;
}

__global__ void embedding_keys_kernel(TableSet ts, const std::int64_t* indices, const std::int64_t* offsets,
                                      std::int64_t batch, std::uint32_t* key, std::uint32_t* bag) {
  const std::int64_t q = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
  if (q >= batch * ts.tables) return;
  const std::int64_t base = ts.base[q / batch];
  for (std::int64_t k = offsets[q]; k < offsets[q + 1]; ++k) {
    key[k] = static_cast<std::uint32_t>(base + indices[k]);
    bag[k] = static_cast<std::uint32_t>(q);
  }
}

__device__ __forceinline__ void apply_update(float* w, float* state, float g, float lr, float eps) {
  if (state == nullptr) {
    *w -= lr * g;
  } else {
    const float s = *state + g * g;
    *state = s;
    *w -= lr * g / (sqrtf(s) + eps);
  }
}

__global__ void optimizer_kernel(float* param, const float* grad, float* state, std::int64_t n, float lr, float eps) {
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n; i += std::int64_t{gridDim.x} * blockDim.x)
    apply_update(param + i, state ? state + i : nullptr, grad[i], lr, eps);
}

// ---- Fused sparse backward ----------------------------------------------------------------------
//
// The sorted (key, bag) array is cut into chunks of 32 entries, one warp each, one entry per lane.
// A segment (one distinct row) is cut by the chunk borders into pieces. Phase 1 sums each piece
// with a segmented warp scan and: applies the update when the segment lies inside the chunk;
// otherwise stores the piece's sum as the chunk's `tail` (the segment goes on into the next chunk)
// or `head` (a segment from an earlier chunk ends here), and the chunk where a crossing segment
// starts registers itself as its owner. Phase 2: one warp per owner adds tail[c0], tail[c0 + 1],
// ..., head[c1] in a fixed order and applies the update. Dims are handled 16 at a time.

constexpr int kSlice = 16;

__device__ __forceinline__ const float* dz_row(const float* dz, std::uint32_t bag, std::int64_t batch, int tables,
                                               int dim) {
  const std::int64_t t = bag / batch, b = bag % batch;
  return dz + (b * (tables + 1) + 1 + t) * dim;
}

__global__ void sparse_phase1_kernel(TableSet ts, const std::uint32_t* key, const std::uint32_t* bag, std::int64_t nnz,
                                     std::int64_t chunks, std::int64_t batch, const float* dz, float lr, float eps,
                                     float* head, float* tail, std::uint8_t* ends, int* owners) {
  const int lane = threadIdx.x & 31;
  const std::int64_t c = (blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x) >> 5;
  if (c >= chunks) return;
  const std::int64_t e = c * 32 + lane;
  const bool valid = e < nnz;
  const std::uint32_t row = valid ? key[e] : 0xffffffffu;
  const bool is_head = valid && (e == 0 || key[e - 1] != row);
  const bool next_same = valid && e + 1 < nnz && key[e + 1] == row;
  const unsigned heads = __ballot_sync(0xffffffffu, is_head);
  const unsigned upto = lane == 31 ? 0xffffffffu : ((2u << lane) - 1u);
  const unsigned mine = heads & upto;
  const int start = mine ? 31 - __clz(mine) : 0;  // first lane of this lane's piece
  const bool has_head = mine != 0;
  const bool continues = lane == 31 && next_same;
  const bool piece_end = valid && (lane == 31 || !next_same);
  const float* src = valid ? dz_row(dz, bag[e], batch, ts.tables, ts.dim) : nullptr;

  if (lane == 0 && has_head) ends[c] = 0;
  if (piece_end && !has_head) ends[c] = continues ? 0 : 1;
  if (continues && has_head) owners[1 + atomicAdd(owners, 1)] = static_cast<int>(c);

  for (int s0 = 0; s0 < ts.dim; s0 += kSlice) {
    float v[kSlice];
#pragma unroll
    for (int i = 0; i < kSlice; ++i) v[i] = valid && s0 + i < ts.dim ? src[s0 + i] : 0.0f;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
#pragma unroll
      for (int i = 0; i < kSlice; ++i) {
        const float u = __shfl_up_sync(0xffffffffu, v[i], off);
        if (lane - off >= start) v[i] += u;
      }
    }
    if (!piece_end) continue;
    if (has_head && !continues) {
      float* w = ts.weights + std::int64_t{row} * ts.dim + s0;
      float* st = ts.adagrad_state ? ts.adagrad_state + std::int64_t{row} * ts.dim + s0 : nullptr;
      for (int i = 0; i < kSlice && s0 + i < ts.dim; ++i) {
        if (ts.store_gradient) w[i] = v[i];
        else apply_update(w + i, st ? st + i : nullptr, v[i], lr, eps);
      }
    } else {
      float* dst = (continues ? tail : head) + c * ts.dim + s0;
      for (int i = 0; i < kSlice && s0 + i < ts.dim; ++i) dst[i] = v[i];
    }
  }
}

__global__ void sparse_phase2_kernel(TableSet ts, const std::uint32_t* key, std::int64_t chunks, float lr, float eps,
                                     const float* head, const float* tail, const std::uint8_t* ends,
                                     const int* owners) {
  const int lane = threadIdx.x & 31;
  const std::int64_t w = (blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x) >> 5;
  if (w >= owners[0]) return;
  const std::int64_t c0 = owners[1 + w];
  const std::uint32_t row = key[c0 * 32 + 31];
  std::int64_t c1 = -1;
  for (std::int64_t base = c0 + 1; c1 < 0; base += 32) {
    const std::int64_t c = base + lane;
    const unsigned found = __ballot_sync(0xffffffffu, c < chunks && ends[c] != 0);
    if (found) c1 = base + __ffs(found) - 1;
    if (base >= chunks) break;  // unreachable for a consistent phase 1; never loop forever
  }
  if (c1 < 0) return;
  for (int s0 = 0; s0 < ts.dim; s0 += kSlice) {
    float acc[kSlice] = {};
    for (std::int64_t c = c0 + lane; c <= c1; c += 32) {
      const float* p = (c == c1 ? head : tail) + c * ts.dim + s0;
#pragma unroll
      for (int i = 0; i < kSlice; ++i)
        if (s0 + i < ts.dim) acc[i] += p[i];
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1)
#pragma unroll
      for (int i = 0; i < kSlice; ++i) acc[i] += __shfl_xor_sync(0xffffffffu, acc[i], off);
    float g = 0.0f;
#pragma unroll
    for (int i = 0; i < kSlice; ++i)
      if (i == lane) g = acc[i];
    if (lane < kSlice && s0 + lane < ts.dim) {
      const std::int64_t at = std::int64_t{row} * ts.dim + s0 + lane;
      if (ts.store_gradient) ts.weights[at] = g;
      else apply_update(ts.weights + at, ts.adagrad_state ? ts.adagrad_state + at : nullptr, g, lr, eps);
    }
  }
}

// ---- Interaction --------------------------------------------------------------------------------

constexpr int kInteractionWarps = 8;

// One warp per sample, Z[b] staged in shared memory. With dim % 4 == 0 the rows are dim + 4 floats
// and read 4 at a time (LDS.128: the 8 lanes of a phase reading rows i = 0..7 start at banks
// (dim + 4) i mod 32, all different for dim = 8, 16, 32); otherwise rows of dim + 1 floats, read
// one at a time (rows of 16 floats would put every even row in the same banks).
__host__ __device__ constexpr int dot_row_floats(int dim) { return dim % 4 == 0 ? dim + 4 : dim + 1; }

__global__ void dot_forward_kernel(const float* z, const std::uint32_t* pairs, int num_pairs, int features, int dim,
                                   std::int64_t batch, float* r, std::int64_t ldr) {
  extern __shared__ __align__(16) float smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const std::int64_t b = blockIdx.x * std::int64_t{kInteractionWarps} + warp;
  if (b >= batch) return;
  const int n = features * dim, row = dot_row_floats(dim);
  float* zs = smem + warp * features * row;
  const float* zb = z + b * n;
  for (int i = lane; i < n; i += 32) zs[(i / dim) * row + i % dim] = zb[i];
  __syncwarp();
  float* rb = r + b * ldr;
  for (int c = lane; c < dim; c += 32) rb[c] = zs[c];
  const bool vec = dim % 4 == 0;
  for (int k = lane; k < num_pairs; k += 32) {
    const std::uint32_t p = __ldg(pairs + k);
    const float* zi = zs + (p >> 16) * row;
    const float* zj = zs + (p & 0xffffu) * row;
    float s = 0.0f;
    if (vec) {
      for (int c = 0; c < dim; c += 4) {
        const float4 a = *reinterpret_cast<const float4*>(zi + c);
        const float4 q = *reinterpret_cast<const float4*>(zj + c);
        s = fmaf(a.x, q.x, s);
        s = fmaf(a.y, q.y, s);
        s = fmaf(a.z, q.z, s);
        s = fmaf(a.w, q.w, s);
      }
    } else {
      for (int c = 0; c < dim; ++c) s = fmaf(zi[c], zj[c], s);
    }
    rb[dim + k] = s;
  }
  for (std::int64_t c = dim + num_pairs + lane; c < ldr; c += 32) rb[c] = 0.0f;  // padding columns
}

// Builds S (the symmetric gradient of the dot matrix: S_ij = S_ji = g_k, S_ii = 2 g_ii) in shared
// memory, rows of `ld` floats (columns past `features` zero); the caller then forms
// dZ[b, i] = sum_j S_ij Z[b, j] (+ dR[b, :D] for i = 0).
__device__ __forceinline__ void build_sym(float* sym, int ld, const float* gb, const std::uint32_t* pairs,
                                          int num_pairs, int features, int dim, int lane) {
  for (int i = lane; i < features * ld; i += 32) sym[i] = 0.0f;
  __syncwarp();
  for (int k = lane; k < num_pairs; k += 32) {
    const std::uint32_t p = __ldg(pairs + k);
    const int i = static_cast<int>(p >> 16), j = static_cast<int>(p & 0xffffu);
    const float g = gb[dim + k];
    if (i == j) {
      sym[i * ld + i] = 2.0f * g;
    } else {
      sym[i * ld + j] = g;
      sym[j * ld + i] = g;
    }
  }
  __syncwarp();
}

constexpr int kMaxRegFeatures = 32;

// dim divides 32 and features <= 32: lane (group h, column c) keeps column c of Z[b] in registers
// and forms dZ[b, i, c] for rows i = h, h + 32/dim, ...; S's rows (padded to 4 floats) are read 4 at
// a time as broadcasts. At most 64 registers, so that 4 blocks (32 warps) fit an SM.
constexpr int sym_row_floats(int features) { return (features + 3) / 4 * 4; }

template <int Dim>
__global__ void __launch_bounds__(32 * kInteractionWarps, 4)
    dot_backward_reg_kernel(const float* z, const float* dr, std::int64_t ldr, const std::uint32_t* pairs,
                            int num_pairs, int features, std::int64_t batch, float* dz, const float* relu_of) {
  extern __shared__ __align__(16) float smem[];
  constexpr int kGroups = 32 / Dim;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const std::int64_t b = blockIdx.x * std::int64_t{kInteractionWarps} + warp;
  if (b >= batch) return;
  const int n = features * Dim, ld = sym_row_floats(features);
  float* sym = smem + warp * features * ld;
  const float* zb = z + b * n;
  const float* gb = dr + b * ldr;
  build_sym(sym, ld, gb, pairs, num_pairs, features, Dim, lane);
  const int c = lane % Dim, h = lane / Dim;
  float zc[kMaxRegFeatures];
#pragma unroll
  for (int j = 0; j < kMaxRegFeatures; ++j) zc[j] = j < features ? zb[j * Dim + c] : 0.0f;
  float* db = dz + b * n;
  for (int i = h; i < features; i += kGroups) {
    float acc = i == 0 ? gb[c] : 0.0f;
    const float* srow = sym + i * ld;
#pragma unroll
    for (int j = 0; j < kMaxRegFeatures; j += 4) {
      if (j < ld) {
        const float4 sv = *reinterpret_cast<const float4*>(srow + j);
        acc = fmaf(sv.x, zc[j], acc);
        acc = fmaf(sv.y, zc[j + 1], acc);
        acc = fmaf(sv.z, zc[j + 2], acc);
        acc = fmaf(sv.w, zc[j + 3], acc);
      }
    }
    // The bottom MLP's output went through a ReLU: its gradient is masked here, in the same pass.
    if (i == 0 && relu_of != nullptr && !(zc[0] > 0.0f)) acc = 0.0f;
    db[i * Dim + c] = acc;
  }
}

__global__ void dot_backward_kernel(const float* z, const float* dr, std::int64_t ldr, const std::uint32_t* pairs,
                                    int num_pairs, int features, int dim, std::int64_t batch, float* dz,
                                    const float* relu_of) {
  extern __shared__ __align__(16) float smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const std::int64_t b = blockIdx.x * std::int64_t{kInteractionWarps} + warp;
  if (b >= batch) return;
  const int n = features * dim;
  float* zs = smem + warp * (n + features * features);
  float* sym = zs + n;
  const float* zb = z + b * n;
  const float* gb = dr + b * ldr;
  for (int i = lane; i < n; i += 32) zs[i] = zb[i];
  build_sym(sym, features, gb, pairs, num_pairs, features, dim, lane);
  float* db = dz + b * n;
  for (int o = lane; o < n; o += 32) {
    const int i = o / dim, c = o % dim;
    float acc = i == 0 ? gb[c] : 0.0f;
    for (int j = 0; j < features; ++j) acc = fmaf(sym[i * features + j], zs[j * dim + c], acc);
    if (i == 0 && relu_of != nullptr && !(zs[c] > 0.0f)) acc = 0.0f;
    db[o] = acc;
  }
}

void check_interaction_smem(std::size_t floats_per_warp, const char* what) {
  // 48 KB of dynamic shared memory without opting in.
  if (floats_per_warp * sizeof(float) * kInteractionWarps > 48 * 1024)
    throw Error("models::Dlrm", "config", std::string("a smaller ") + what + " for the GPU dot interaction",
                std::to_string(floats_per_warp) + " floats per sample");
}

__global__ void gather_kernel(const float* z, const float* zz, const std::uint32_t* pairs, int num_pairs, int features,
                              int dim, std::int64_t batch, float* r, std::int64_t ldr) {
  const std::int64_t n = batch * ldr;
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n; i += std::int64_t{gridDim.x} * blockDim.x) {
    const std::int64_t b = i / ldr;
    const int o = static_cast<int>(i % ldr);
    if (o < dim) {
      r[i] = z[b * features * dim + o];
    } else if (o < dim + num_pairs) {
      const std::uint32_t p = pairs[o - dim];
      r[i] = zz[b * features * features + (p >> 16) * features + (p & 0xffffu)];
    } else {
      r[i] = 0.0f;  // padding columns
    }
  }
}

__global__ void scatter_kernel(const float* dr, std::int64_t ldr, const std::uint32_t* pairs, int num_pairs,
                               int features, int dim, std::int64_t batch, float* sym) {
  const std::int64_t n = batch * num_pairs;
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n; i += std::int64_t{gridDim.x} * blockDim.x) {
    const std::int64_t b = i / num_pairs;
    const int k = static_cast<int>(i % num_pairs);
    const std::uint32_t p = pairs[k];
    const int pi = static_cast<int>(p >> 16), pj = static_cast<int>(p & 0xffffu);
    const float g = dr[b * ldr + dim + k];
    float* s = sym + b * features * features;
    if (pi == pj) {
      s[pi * features + pi] = 2.0f * g;
    } else {
      s[pi * features + pj] = g;
      s[pj * features + pi] = g;
    }
  }
}

__global__ void add_dense_grad_kernel(const float* dr, int ld_dr, int dim, int ld_dz, std::int64_t batch, float* dz) {
  const std::int64_t n = batch * dim;
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n; i += std::int64_t{gridDim.x} * blockDim.x) {
    const std::int64_t b = i / dim;
    const int c = static_cast<int>(i % dim);
    dz[b * ld_dz + c] += dr[b * ld_dr + c];
  }
}

__global__ void outer_kernel(const float* z, std::int64_t n, std::int64_t batch, float* r) {
  const std::int64_t total = batch * n * n;
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < total; i += std::int64_t{gridDim.x} * blockDim.x) {
    const std::int64_t b = i / (n * n), ij = i % (n * n);
    r[i] = z[b * n + ij / n] * z[b * n + ij % n];
  }
}

// ---- bf16 conversions ---------------------------------------------------------------------------

__global__ void to_bf16_kernel(const float* src, std::int64_t ld_src, std::uint16_t* dst, std::int64_t rows,
                               std::int64_t cols) {
  const std::int64_t n = rows * cols;
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n; i += std::int64_t{gridDim.x} * blockDim.x) {
    const __nv_bfloat16 v = __float2bfloat16_rn(src[(i / cols) * ld_src + i % cols]);
    dst[i] = *reinterpret_cast<const std::uint16_t*>(&v);
  }
}

__global__ void from_bf16_kernel(const std::uint16_t* src, float* dst, std::int64_t ld_dst, std::int64_t rows,
                                 std::int64_t cols) {
  const std::int64_t n = rows * cols;
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n; i += std::int64_t{gridDim.x} * blockDim.x) {
    const std::uint16_t u = src[i];
    dst[(i / cols) * ld_dst + i % cols] = __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(&u));
  }
}

// ---- Loss ---------------------------------------------------------------------------------------

constexpr int kLossThreads = 1024;

__device__ double block_sum(double v) {
  __shared__ double s[kLossThreads];
  s[threadIdx.x] = v;
  __syncthreads();
  for (int w = kLossThreads / 2; w > 0; w >>= 1) {
    if (threadIdx.x < w) s[threadIdx.x] += s[threadIdx.x + w];
    __syncthreads();
  }
  return s[0];
}

// Per block: the losses of its samples (fixed order) into partial[block]; the final kernel adds
// the partials in order. Deterministic.
constexpr int kLossBlocks = 64;

__global__ void bce_fused_kernel(const float* logits, const float* labels, std::int64_t batch, float* dlogits,
                                 double* partial) {
  double acc = 0.0;
  const float inv_b = 1.0f / static_cast<float>(batch);
  for (std::int64_t i = blockIdx.x * std::int64_t{kLossThreads} + threadIdx.x; i < batch;
       i += std::int64_t{kLossThreads} * gridDim.x) {
    const float x = logits[i], y = labels[i];
    acc += static_cast<double>(fmaxf(x, 0.0f) - x * y + log1pf(expf(-fabsf(x))));
    dlogits[i] = (1.0f / (1.0f + expf(-x)) - y) * inv_b;
  }
  const double total = block_sum(acc);
  if (threadIdx.x == 0) partial[blockIdx.x] = total;
}

__global__ void loss_final_kernel(const double* partial, int blocks, std::int64_t batch, double* loss_acc) {
  if (threadIdx.x != 0) return;
  double s = 0.0;
  for (int k = 0; k < blocks; ++k) s += partial[k];
  loss_acc[0] += s / static_cast<double>(batch);
  loss_acc[1] += 1.0;
}

__global__ void sigmoid_kernel(const float* x, float* p, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n; i += std::int64_t{gridDim.x} * blockDim.x)
    p[i] = 1.0f / (1.0f + expf(-x[i]));
}

__global__ void bce_reference_kernel(const float* p, const float* labels, std::int64_t batch, double* loss_acc) {
  double acc = 0.0;
  for (std::int64_t i = threadIdx.x; i < batch; i += kLossThreads) {
    const float y = labels[i];
    acc -= static_cast<double>(y * fmaxf(logf(p[i]), -100.0f) + (1.0f - y) * fmaxf(logf(1.0f - p[i]), -100.0f));
  }
  const double total = block_sum(acc);
  if (threadIdx.x == 0) {
    loss_acc[0] += total / static_cast<double>(batch);
    loss_acc[1] += 1.0;
  }
}

__global__ void dlogit_kernel(const float* p, const float* labels, std::int64_t batch, float* dlogits) {
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < batch; i += std::int64_t{gridDim.x} * blockDim.x)
    dlogits[i] = (p[i] - labels[i]) / static_cast<float>(batch);
}

}  // namespace

// ---- launchers ----------------------------------------------------------------------------------

void bias_add(float* y, const float* bias, std::int64_t rows, std::int64_t cols, std::int64_t ld, cudaStream_t s) {
  bias_add_kernel<<<blocks_for(rows * cols), kThreads, 0, s>>>(y, bias, rows, cols, ld);
  FK_CUDA_CHECK_LAUNCH("models::gpu::bias_add");
}

void relu_inplace(float* y, std::int64_t rows, std::int64_t cols, std::int64_t ld, cudaStream_t s) {
  relu_kernel<<<blocks_for(rows * cols), kThreads, 0, s>>>(y, rows, cols, ld);
  FK_CUDA_CHECK_LAUNCH("models::gpu::relu_inplace");
}

void relu_backward_inplace(float* dy, const float* y, std::int64_t rows, std::int64_t cols, std::int64_t ld_dy,
                           std::int64_t ld_y, cudaStream_t s) {
  relu_backward_kernel<<<blocks_for(rows * cols), kThreads, 0, s>>>(dy, y, rows, cols, ld_dy, ld_y);
  FK_CUDA_CHECK_LAUNCH("models::gpu::relu_backward_inplace");
}

std::size_t column_sum_partial_floats(std::int64_t rows, std::int64_t cols) {
  return static_cast<std::size_t>(std::max<std::int64_t>(1, (rows + kSumRows - 1) / kSumRows) * cols);
}

void column_sum(float* dz, const float* y, float* db, std::int64_t rows, std::int64_t cols, std::int64_t ld_dz,
                std::int64_t ld_y, float* partial, cudaStream_t s) {
  const std::int64_t chunks = std::max<std::int64_t>(1, (rows + kSumRows - 1) / kSumRows);
  const auto aligned = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; };
  const bool vec = cols % 4 == 0 && ld_dz % 4 == 0 && aligned(dz) && (y == nullptr || (ld_y % 4 == 0 && aligned(y)));
  if (vec) {
    const dim3 grid(static_cast<unsigned>((cols + 127) / 128), static_cast<unsigned>(chunks));
    column_partial_kernel<4><<<grid, dim3(32, 8), 0, s>>>(dz, y, partial, rows, cols, ld_dz, ld_y);
  } else {
    const dim3 grid(static_cast<unsigned>((cols + 31) / 32), static_cast<unsigned>(chunks));
    column_partial_kernel<1><<<grid, dim3(32, 8), 0, s>>>(dz, y, partial, rows, cols, ld_dz, ld_y);
  }
  FK_CUDA_CHECK_LAUNCH("models::gpu::column_sum");
  column_final_kernel<<<blocks_for(cols * 32), kThreads, 0, s>>>(partial, db, chunks, cols);
  FK_CUDA_CHECK_LAUNCH("models::gpu::column_sum");
}

void embedding_forward_fused(const TableSet& tables, const std::uint32_t* raw, RawHash hash,
                             const std::int64_t* indices, const std::int64_t* offsets, std::int64_t batch, float* z,
                             std::uint32_t* key, std::uint32_t* bag, cudaStream_t s) {
  const bool vec = tables.dim % 4 == 0;
  const std::int64_t threads = batch * tables.tables * (vec ? tables.dim / 4 : tables.dim);
  if (vec)
    embedding_fused_kernel<4><<<blocks_for(threads), kThreads, 0, s>>>(tables, raw, hash, indices, offsets, batch, z, key, bag);
  else
    embedding_fused_kernel<1><<<blocks_for(threads), kThreads, 0, s>>>(tables, raw, hash, indices, offsets, batch, z, key, bag);
  FK_CUDA_CHECK_LAUNCH("models::gpu::embedding_forward_fused");
}

void embedding_forward_table(const float* table, int dim, int t, int tables, const std::int64_t* indices,
                             const std::int64_t* offsets, std::int64_t batch, float* z, cudaStream_t s) {
  embedding_table_kernel<<<blocks_for(batch * dim), kThreads, 0, s>>>(table, dim, t, tables, indices, offsets, batch, z);
  FK_CUDA_CHECK_LAUNCH("models::gpu::embedding_forward_table");
}

void embedding_keys(const TableSet& tables, const std::int64_t* indices, const std::int64_t* offsets,
                    std::int64_t batch, std::uint32_t* key, std::uint32_t* bag, cudaStream_t s) {
  embedding_keys_kernel<<<blocks_for(batch * tables.tables), kThreads, 0, s>>>(tables, indices, offsets, batch, key, bag);
  FK_CUDA_CHECK_LAUNCH("models::gpu::embedding_keys");
}

void optimizer_update(float* param, const float* grad, float* state, std::int64_t n, float lr, float eps,
                      cudaStream_t s) {
  if (n == 0) return;
  optimizer_kernel<<<blocks_for(n), kThreads, 0, s>>>(param, grad, state, n, lr, eps);
  FK_CUDA_CHECK_LAUNCH("models::gpu::optimizer_update");
}

std::size_t sparse_backward_sort_bytes(std::int64_t nnz) {
  std::size_t bytes = 0;
  FK_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const std::uint32_t*>(nullptr),
                                                static_cast<std::uint32_t*>(nullptr),
                                                static_cast<const std::uint32_t*>(nullptr),
                                                static_cast<std::uint32_t*>(nullptr), static_cast<int>(nnz)));
  return bytes;
}

std::int64_t sparse_backward_chunks(std::int64_t nnz) { return (nnz + 31) / 32; }

void embedding_backward_fused(const TableSet& tables, int key_bits, const std::uint32_t* key,
                              const std::uint32_t* bag, std::int64_t nnz, std::int64_t batch, const float* dz,
                              float lr, float eps, const SparseBackwardWorkspace& ws, cudaStream_t s) {
  if (nnz == 0) return;
  std::size_t bytes = ws.sort_temp_bytes;
  FK_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(ws.sort_temp, bytes, key, ws.key_sorted, bag, ws.bag_sorted,
                                                static_cast<int>(nnz), 0, key_bits, s));
  const std::int64_t chunks = sparse_backward_chunks(nnz);
  FK_CUDA_CHECK(cudaMemsetAsync(ws.owners, 0, sizeof(int), s));
  const unsigned grid = static_cast<unsigned>((chunks * 32 + kThreads - 1) / kThreads);
  sparse_phase1_kernel<<<grid, kThreads, 0, s>>>(tables, ws.key_sorted, ws.bag_sorted, nnz, chunks, batch, dz, lr, eps,
                                                 ws.head, ws.tail, ws.ends, ws.owners);
  FK_CUDA_CHECK_LAUNCH("models::gpu::embedding_backward_fused");
  sparse_phase2_kernel<<<grid, kThreads, 0, s>>>(tables, ws.key_sorted, chunks, lr, eps, ws.head, ws.tail, ws.ends,
                                                 ws.owners);
  FK_CUDA_CHECK_LAUNCH("models::gpu::embedding_backward_fused");
}

void interaction_dot_forward(const float* z, const std::uint32_t* pairs, int num_pairs, int features, int dim,
                             std::int64_t batch, float* r, std::int64_t ldr, cudaStream_t s) {
  const std::size_t per = static_cast<std::size_t>(features) * dot_row_floats(dim);
  check_interaction_smem(per, "features * (embedding_dim + 4)");
  const unsigned grid = static_cast<unsigned>((batch + kInteractionWarps - 1) / kInteractionWarps);
  dot_forward_kernel<<<grid, 32 * kInteractionWarps, per * kInteractionWarps * sizeof(float), s>>>(
      z, pairs, num_pairs, features, dim, batch, r, ldr);
  FK_CUDA_CHECK_LAUNCH("models::gpu::interaction_dot_forward");
}

void interaction_dot_backward(const float* z, const float* dr, std::int64_t ldr, const std::uint32_t* pairs,
                              int num_pairs, int features, int dim, std::int64_t batch, float* dz, bool relu_x,
                              cudaStream_t s) {
  const unsigned grid = static_cast<unsigned>((batch + kInteractionWarps - 1) / kInteractionWarps);
  const float* relu_of = relu_x ? z : nullptr;
  const std::size_t sym = static_cast<std::size_t>(features) * features;
  auto reg = [&](auto kernel) {
    const std::size_t per = static_cast<std::size_t>(features) * sym_row_floats(features);
    check_interaction_smem(per, "features^2");
    kernel<<<grid, 32 * kInteractionWarps, per * kInteractionWarps * sizeof(float), s>>>(
        z, dr, ldr, pairs, num_pairs, features, batch, dz, relu_of);
  };
  if (features <= kMaxRegFeatures && dim == 16) {
    reg(dot_backward_reg_kernel<16>);
  } else if (features <= kMaxRegFeatures && dim == 8) {
    reg(dot_backward_reg_kernel<8>);
  } else if (features <= kMaxRegFeatures && dim == 32) {
    reg(dot_backward_reg_kernel<32>);
  } else {
    const std::size_t per = static_cast<std::size_t>(features) * dim + sym;
    check_interaction_smem(per, "features * (embedding_dim + features)");
    dot_backward_kernel<<<grid, 32 * kInteractionWarps, per * kInteractionWarps * sizeof(float), s>>>(
        z, dr, ldr, pairs, num_pairs, features, dim, batch, dz, relu_of);
  }
  FK_CUDA_CHECK_LAUNCH("models::gpu::interaction_dot_backward");
}

void interaction_gather(const float* z, const float* zz, const std::uint32_t* pairs, int num_pairs, int features,
                        int dim, std::int64_t batch, float* r, std::int64_t ldr, cudaStream_t s) {
  gather_kernel<<<blocks_for(batch * ldr), kThreads, 0, s>>>(z, zz, pairs, num_pairs, features, dim, batch, r, ldr);
  FK_CUDA_CHECK_LAUNCH("models::gpu::interaction_gather");
}

void interaction_scatter(const float* dr, std::int64_t ldr, const std::uint32_t* pairs, int num_pairs, int features,
                         int dim, std::int64_t batch, float* sym, cudaStream_t s) {
  FK_CUDA_CHECK(cudaMemsetAsync(sym, 0, static_cast<std::size_t>(batch) * features * features * sizeof(float), s));
  scatter_kernel<<<blocks_for(batch * num_pairs), kThreads, 0, s>>>(dr, ldr, pairs, num_pairs, features, dim, batch,
                                                                    sym);
  FK_CUDA_CHECK_LAUNCH("models::gpu::interaction_scatter");
}

void add_dense_grad(const float* dr, int ld_dr, int dim, int ld_dz, std::int64_t batch, float* dz, cudaStream_t s) {
  add_dense_grad_kernel<<<blocks_for(batch * dim), kThreads, 0, s>>>(dr, ld_dr, dim, ld_dz, batch, dz);
  FK_CUDA_CHECK_LAUNCH("models::gpu::add_dense_grad");
}

void interaction_outer_forward(const float* z, std::int64_t n, std::int64_t batch, float* r, cudaStream_t s) {
  outer_kernel<<<blocks_for(batch * n * n), kThreads, 0, s>>>(z, n, batch, r);
  FK_CUDA_CHECK_LAUNCH("models::gpu::interaction_outer_forward");
}

void copy_rows(const float* src, std::int64_t ld_src, float* dst, std::int64_t ld_dst, std::int64_t rows,
               std::int64_t cols, cudaStream_t s) {
  FK_CUDA_CHECK(cudaMemcpy2DAsync(dst, static_cast<std::size_t>(ld_dst) * sizeof(float), src,
                                  static_cast<std::size_t>(ld_src) * sizeof(float),
                                  static_cast<std::size_t>(cols) * sizeof(float), static_cast<std::size_t>(rows),
                                  cudaMemcpyDeviceToDevice, s));
}

void to_bf16_rows(const float* src, std::int64_t ld_src, std::uint16_t* dst, std::int64_t rows, std::int64_t cols,
                  cudaStream_t s) {
  if (rows * cols == 0) return;
  to_bf16_kernel<<<blocks_for(rows * cols), kThreads, 0, s>>>(src, ld_src, dst, rows, cols);
  FK_CUDA_CHECK_LAUNCH("models::gpu::to_bf16_rows");
}

void from_bf16_rows(const std::uint16_t* src, float* dst, std::int64_t ld_dst, std::int64_t rows, std::int64_t cols,
                    cudaStream_t s) {
  if (rows * cols == 0) return;
  from_bf16_kernel<<<blocks_for(rows * cols), kThreads, 0, s>>>(src, dst, ld_dst, rows, cols);
  FK_CUDA_CHECK_LAUNCH("models::gpu::from_bf16_rows");
}

void sigmoid_bce_fused(const float* logits, const float* labels, std::int64_t batch, float* dlogits,
                       double* loss_acc, cudaStream_t s) {
  // loss_acc has room for kLossBlocks partials after its two accumulators.
  const int blocks = static_cast<int>(std::min<std::int64_t>(kLossBlocks, (batch + kLossThreads - 1) / kLossThreads));
  bce_fused_kernel<<<blocks, kLossThreads, 0, s>>>(logits, labels, batch, dlogits, loss_acc + 2);
  FK_CUDA_CHECK_LAUNCH("models::gpu::sigmoid_bce_fused");
  loss_final_kernel<<<1, 32, 0, s>>>(loss_acc + 2, blocks, batch, loss_acc);
  FK_CUDA_CHECK_LAUNCH("models::gpu::sigmoid_bce_fused");
}

void sigmoid(const float* x, float* p, std::int64_t n, cudaStream_t s) {
  sigmoid_kernel<<<blocks_for(n), kThreads, 0, s>>>(x, p, n);
  FK_CUDA_CHECK_LAUNCH("models::gpu::sigmoid");
}

void sigmoid_bce_reference(const float* logits, const float* labels, std::int64_t batch, float* p, float* dlogits,
                           double* loss_acc, cudaStream_t s) {
  sigmoid(logits, p, batch, s);
  bce_reference_kernel<<<1, kLossThreads, 0, s>>>(p, labels, batch, loss_acc);
  FK_CUDA_CHECK_LAUNCH("models::gpu::sigmoid_bce_reference");
  dlogit_kernel<<<blocks_for(batch), kThreads, 0, s>>>(p, labels, batch, dlogits);
  FK_CUDA_CHECK_LAUNCH("models::gpu::sigmoid_bce_reference");
}

}  // namespace fk::models::gpu
