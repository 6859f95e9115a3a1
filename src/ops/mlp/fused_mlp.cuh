// Device code shared by the fused MLP's kernels: mma.sync m16n8k16 and ldmatrix, the epilogue
// that turns a layer's accumulators into the next layer's A fragments, tile stores, weight and
// bias staging, and the backward's steps through the layers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <type_traits>

#include "fused_mlp_launch.hpp"
#include "ops/common/activations.cuh"
#include "ops/common/mma_sm80.cuh"

namespace fk::cuda::mlp {
namespace {

__device__ __forceinline__ int round16(int v) { return (v + 15) / 16 * 16; }

__device__ __forceinline__ void ldmatrix_x4(std::uint32_t (&r)[4], const u16* p) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

using device::mma;  // ops/common/mma_sm80.cuh
using device::pack2;

template <class T>
__device__ __forceinline__ float unpack(u16 v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __uint_as_float(static_cast<unsigned>(v) << 16);
  else return __half2float(__ushort_as_half(v));
}

// acc [16, H] (H/8 m16n8 tiles; thread: rows g, g+8, columns 8j + 2t, +1) + bias, act, packed
// into the A fragments [16, H] of the next layer (H/16 m16k16 tiles).
template <class T, int H, Activation A>
__device__ __forceinline__ void to_next_layer(const float (&acc)[H / 8][4], const float* bias, int lane,
                                              std::uint32_t (&a)[H / 16][4]) {
  const int t = lane % 4;
#pragma unroll
  for (int j = 0; j < H / 8; ++j) {
    const float b0 = bias[8 * j + 2 * t], b1 = bias[8 * j + 2 * t + 1];
    const std::uint32_t top = pack2<T>(device::activation<A>(acc[j][0] + b0), device::activation<A>(acc[j][1] + b1));
    const std::uint32_t bot = pack2<T>(device::activation<A>(acc[j][2] + b0), device::activation<A>(acc[j][3] + b1));
    a[j / 2][(j % 2) * 2 + 0] = top;  // row g,     k = 16(j/2) + 8(j%2) + 2t
    a[j / 2][(j % 2) * 2 + 1] = bot;  // row g + 8
  }
}

template <class T, int H>
__device__ __forceinline__ void epilogue(Activation act, const float (&acc)[H / 8][4], const float* bias, int lane,
                                         std::uint32_t (&a)[H / 16][4]) {
  switch (act) {
    case Activation::relu: return to_next_layer<T, H, Activation::relu>(acc, bias, lane, a);
    case Activation::sigmoid: return to_next_layer<T, H, Activation::sigmoid>(acc, bias, lane, a);
    default: return to_next_layer<T, H, Activation::identity>(acc, bias, lane, a);
  }
}

// Rows g and g + 8 of a [16, H] tile held as A fragments, stored as 16-bit pairs to dst [rows, H]
// (rows beyond `rows` are not stored). Column 8j + 2t lives in a[j / 2][(j % 2) * 2 + half].
template <int H>
__device__ __forceinline__ void store_tile(const std::uint32_t (&a)[H / 16][4], u16* dst, int rows, int lane) {
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int j = 0; j < H / 8; ++j) {
    const int col = 8 * j + 2 * t;
    if (g < rows) *reinterpret_cast<std::uint32_t*>(dst + g * H + col) = a[j / 2][(j % 2) * 2];
    if (g + 8 < rows) *reinterpret_cast<std::uint32_t*>(dst + (g + 8) * H + col) = a[j / 2][(j % 2) * 2 + 1];
  }
}

// The same tile through this warp's staging buffer `st` [16, H + 8]: the fragments go to shared
// memory, then whole rows to dst in 16-byte stores (full sectors, where the fragment layout would
// write 8 rows x 16 bytes per instruction).
template <int H>
__device__ __forceinline__ void store_tile_staged(const std::uint32_t (&a)[H / 16][4], u16* st, u16* dst, int rows,
                                                  int lane) {
  constexpr int ld = H + 8, chunks = H / 8;
  const int g = lane / 4, t = lane % 4;
  __syncwarp();  // the previous tile's reads of st are done
#pragma unroll
  for (int j = 0; j < H / 8; ++j) {
    *reinterpret_cast<std::uint32_t*>(st + g * ld + 8 * j + 2 * t) = a[j / 2][(j % 2) * 2];
    *reinterpret_cast<std::uint32_t*>(st + (g + 8) * ld + 8 * j + 2 * t) = a[j / 2][(j % 2) * 2 + 1];
  }
  __syncwarp();
#pragma unroll
  for (int c = lane; c < 16 * chunks; c += 32) {
    const int r = c / chunks, col = (c % chunks) * 8;
    if (r < rows) *reinterpret_cast<uint4*>(dst + r * H + col) = *reinterpret_cast<const uint4*>(st + r * ld + col);
  }
}

template <Activation A>
__device__ __forceinline__ void act4(float (&v)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = device::activation<A>(v[i]);
}

// Copies W [rows, cols] into smem [round16(rows), ld], zero-padded.
__device__ void copy_weight(const u16* __restrict__ w, int rows, int cols, u16* s, int ld) {
  const int rp = round16(rows), cp = round16(cols);
  for (int i = threadIdx.x; i < rp * cp; i += kThreads) {
    const int r = i / cp, c = i % cp;
    s[r * ld + c] = (r < rows && c < cols) ? w[r * cols + c] : u16(0);
  }
}

__device__ __forceinline__ void ldmatrix_x4_trans(std::uint32_t (&r)[4], const u16* p) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

template <class T>
__device__ __forceinline__ float lo(std::uint32_t v) { return unpack<T>(static_cast<u16>(v & 0xffffu)); }
template <class T>
__device__ __forceinline__ float hi(std::uint32_t v) { return unpack<T>(static_cast<u16>(v >> 16)); }

// act'(z) from y = act(z) (identity, relu, sigmoid).
__device__ __forceinline__ float grad_from_output(Activation act, float y) {
  switch (act) {
    case Activation::relu: return device::activation_grad_from_output<Activation::relu>(y);
    case Activation::sigmoid: return device::activation_grad_from_output<Activation::sigmoid>(y);
    default: return 1.0f;
  }
}

// Adds the column sums of one m16n8 tile (s0, s1: this lane's two rows summed, columns col and
// col + 1) to the warp's accumulator: a butterfly over the 8 lanes that share the columns, then
// the lanes of row group 0 add. Plain adds by one lane per column: a fixed order.
__device__ __forceinline__ void add_column_sums(float* slot, int col, float s0, float s1, int lane) {
#pragma unroll
  for (int off = 4; off < 32; off *= 2) {
    s0 += __shfl_xor_sync(0xffffffffu, s0, off);
    s1 += __shfl_xor_sync(0xffffffffu, s1, off);
  }
  if (lane < 4) {
    slot[col] += s0;
    slot[col + 1] += s1;
  }
}

// Shared steps of the two backward kernels (16 rows of one warp; A fragments in registers).
// ldmatrix.trans addresses of B (k16 x two n8 tiles) from W [k, n]: lane -> k row
// 8((lane/8)%2) + lane%8, n half lane/16: bt_row, bt_col.

// dh += g · W_{L-1}[kc .. kc + 16) for one 16-column slice g (ga) of the output layer's gradient.
template <class T, int H>
__device__ __forceinline__ void back_through_output(float (&dh)[H / 8][4], const std::uint32_t (&ga)[4], const u16* wo,
                                                    int ldh, int kc, int bt_row, int bt_col) {
#pragma unroll
  for (int np = 0; np < H / 16; ++np) {
    std::uint32_t bf[4];
    ldmatrix_x4_trans(bf, wo + (kc + bt_row) * ldh + np * 16 + bt_col);
    mma<T>(dh[2 * np], ga, bf[0], bf[1]);
    mma<T>(dh[2 * np + 1], ga, bf[2], bf[3]);
  }
}

// dh = g_l · W_l for a hidden layer (W_l [H, H] in shared memory).
template <class T, int H>
__device__ __forceinline__ void back_through_hidden(float (&dh)[H / 8][4], const std::uint32_t (&ga)[H / 16][4],
                                                    const u16* w, int ldh, int bt_row, int bt_col) {
#pragma unroll
  for (int j = 0; j < H / 8; ++j) dh[j][0] = dh[j][1] = dh[j][2] = dh[j][3] = 0.0f;
#pragma unroll
  for (int kk = 0; kk < H / 16; ++kk) {
#pragma unroll
    for (int np = 0; np < H / 16; ++np) {
      std::uint32_t bf[4];
      ldmatrix_x4_trans(bf, w + (kk * 16 + bt_row) * ldh + np * 16 + bt_col);
      mma<T>(dh[2 * np], ga[kk], bf[0], bf[1]);
      mma<T>(dh[2 * np + 1], ga[kk], bf[2], bf[3]);
    }
  }
}

// dx = g_0 · W_0 ([16, in] rows row0.., `rows` of them valid), 16 of its (padded) columns at a
// time, rounded to the dtype; pair_dx: two columns per 32-bit store.
template <class T, int H>
__device__ __forceinline__ void store_dx(const std::uint32_t (&ga)[H / 16][4], const u16* w0, int ldk0, int k0, int in,
                                         u16* dx, std::int64_t row0, int rows, bool pair_dx, int bt_row, int bt_col,
                                         int g, int t) {
  for (int nb = 0; nb < k0; nb += 16) {
    float acc[2][4] = {};
#pragma unroll
    for (int kk = 0; kk < H / 16; ++kk) {
      std::uint32_t bf[4];
      ldmatrix_x4_trans(bf, w0 + (kk * 16 + bt_row) * ldk0 + nb + bt_col);
      mma<T>(acc[0], ga[kk], bf[0], bf[1]);
      mma<T>(acc[1], ga[kk], bf[2], bf[3]);
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int col = nb + 8 * j + 2 * t;
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // rows g, g + 8
        const int r = g + 8 * h;
        if (r >= rows || col >= in) continue;
        const std::uint32_t packed = pack2<T>(acc[j][2 * h], acc[j][2 * h + 1]);
        u16* dst = dx + (row0 + r) * in + col;
        if (pair_dx) {
          *reinterpret_cast<std::uint32_t*>(dst) = packed;
        } else {
          dst[0] = static_cast<u16>(packed & 0xffffu);
          if (col + 1 < in) dst[1] = static_cast<u16>(packed >> 16);
        }
      }
    }
  }
}

}  // namespace
}  // namespace fk::cuda::mlp
