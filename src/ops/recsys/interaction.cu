// Feature interactions over Z [B, F, D] (contracts in recsys_cuda.hpp).
//
// Dot, fused: one warp per sample with Z[b] staged in shared memory once; the forward writes
// R[b] = [Z[b, 0], <Z_i, Z_j> for the pairs, zero padding] in one pass (no [F, F] Gram matrix in
// memory), the backward builds the symmetric pair gradient S in shared memory and forms
// dZ[b] = S Z[b] (+ dR[b, :D] for row 0) in the same pass, with the bottom MLP's ReLU mask of
// Z[b, 0] optionally fused. For F <= 32 and D in {8, 16, 32} the backward keeps a column of Z[b]
// in registers. The unfused pieces (gather after a cuBLAS bmm, scatter before one, the dense-row
// add) are what a plain PyTorch port runs. Outer: R[b] = c cᵀ (c = Z[b] flattened) and its
// backward, one thread per output element. Every sum has a fixed order (deterministic).
#include <algorithm>
#include <cstdint>
#include <string>

#include "fusekit/core/cuda_check.hpp"
#include "fusekit/core/error.hpp"
#include "ops/common/cuda_common.cuh"
#include "ops/common/grid_stride.cuh"
#include "recsys_cuda.hpp"

namespace fk::cuda {

namespace {

constexpr int kThreads = 256;

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
    throw Error("interaction", "z", std::string("a smaller ") + what + " for the GPU dot interaction",
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

// dc_i = sum_j (G_ij + G_ji) c_j for G = dR[b] as [n, n]: one thread per (b, i), j in order.
__global__ void outer_backward_kernel(const float* z, const float* dr, std::int64_t n, std::int64_t batch, float* dz) {
  const std::int64_t total = batch * n;
  for (std::int64_t o = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; o < total; o += std::int64_t{gridDim.x} * blockDim.x) {
    const std::int64_t b = o / n, i = o % n;
    const float* g = dr + b * n * n;
    const float* c = z + b * n;
    float s = 0.0f;
    for (std::int64_t j = 0; j < n; ++j) s = fmaf(g[i * n + j] + g[j * n + i], c[j], s);
    dz[o] = s;
  }
}

}  // namespace

void interaction_dot_forward(const float* z, const std::uint32_t* pairs, int num_pairs, int features, int dim,
                             std::int64_t batch, float* r, std::int64_t ldr, cudaStream_t s) {
  const std::size_t per = static_cast<std::size_t>(features) * dot_row_floats(dim);
  check_interaction_smem(per, "features * (embedding_dim + 4)");
  const unsigned grid = static_cast<unsigned>((batch + kInteractionWarps - 1) / kInteractionWarps);
  dot_forward_kernel<<<grid, 32 * kInteractionWarps, per * kInteractionWarps * sizeof(float), s>>>(
      z, pairs, num_pairs, features, dim, batch, r, ldr);
  FK_CUDA_CHECK_LAUNCH("interaction_dot_forward");
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
  FK_CUDA_CHECK_LAUNCH("interaction_dot_backward");
}

void interaction_gather(const float* z, const float* zz, const std::uint32_t* pairs, int num_pairs, int features,
                        int dim, std::int64_t batch, float* r, std::int64_t ldr, cudaStream_t s) {
  gather_kernel<<<grid_stride_blocks(batch * ldr), kThreads, 0, s>>>(z, zz, pairs, num_pairs, features, dim, batch, r, ldr);
  FK_CUDA_CHECK_LAUNCH("interaction_gather");
}

void interaction_scatter(const float* dr, std::int64_t ldr, const std::uint32_t* pairs, int num_pairs, int features,
                         int dim, std::int64_t batch, float* sym, cudaStream_t s) {
  FK_CUDA_CHECK(cudaMemsetAsync(sym, 0, static_cast<std::size_t>(batch) * features * features * sizeof(float), s));
  scatter_kernel<<<grid_stride_blocks(batch * num_pairs), kThreads, 0, s>>>(dr, ldr, pairs, num_pairs, features, dim, batch,
                                                                    sym);
  FK_CUDA_CHECK_LAUNCH("interaction_scatter");
}

void add_dense_grad(const float* dr, int ld_dr, int dim, int ld_dz, std::int64_t batch, float* dz, cudaStream_t s) {
  add_dense_grad_kernel<<<grid_stride_blocks(batch * dim), kThreads, 0, s>>>(dr, ld_dr, dim, ld_dz, batch, dz);
  FK_CUDA_CHECK_LAUNCH("add_dense_grad");
}

void interaction_outer_forward(const float* z, std::int64_t n, std::int64_t batch, float* r, cudaStream_t s) {
  outer_kernel<<<grid_stride_blocks(batch * n * n), kThreads, 0, s>>>(z, n, batch, r);
  FK_CUDA_CHECK_LAUNCH("interaction_outer_forward");
}

void interaction_cat_forward(const float* z, std::int64_t n, std::int64_t batch, float* r, std::int64_t ldr,
                             cudaStream_t s) {
  const auto row = static_cast<std::size_t>(n) * sizeof(float), pitch = static_cast<std::size_t>(ldr) * sizeof(float);
  FK_CUDA_CHECK(cudaMemcpy2DAsync(r, pitch, z, row, row, static_cast<std::size_t>(batch), cudaMemcpyDeviceToDevice, s));
  if (ldr > n)
    FK_CUDA_CHECK(cudaMemset2DAsync(r + n, pitch, 0, pitch - row, static_cast<std::size_t>(batch), s));
}

void interaction_cat_backward(const float* dr, std::int64_t ldr, std::int64_t n, std::int64_t batch, float* dz,
                              cudaStream_t s) {
  const auto row = static_cast<std::size_t>(n) * sizeof(float), pitch = static_cast<std::size_t>(ldr) * sizeof(float);
  FK_CUDA_CHECK(cudaMemcpy2DAsync(dz, row, dr, pitch, row, static_cast<std::size_t>(batch), cudaMemcpyDeviceToDevice, s));
}

void interaction_outer_backward(const float* z, const float* dr, std::int64_t n, std::int64_t batch, float* dz,
                                cudaStream_t s) {
  outer_backward_kernel<<<grid_stride_blocks(batch * n), kThreads, 0, s>>>(z, dr, n, batch, dz);
  FK_CUDA_CHECK_LAUNCH("interaction_outer_backward");
}

}  // namespace fk::cuda
