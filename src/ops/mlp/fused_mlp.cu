// The whole MLP in one kernel, forward and backward (see ops/mlp.hpp), in the manner of tiny-cuda-nn's
// FullyFusedMLP.
//
// What is fused: every layer's GEMM, bias and activation. x is read once and y written once; the
// hidden activations never leave the SM. Each CTA first copies every weight matrix (zero-padded
// to multiples of 16) and every bias (as fp32) into shared memory, then its warps walk the batch
// independently, 16 rows at a time (a persistent grid sized by occupancy):
//   1. the warp stages its 16 input rows in shared memory (16-byte loads when rows allow);
//   2. layer 0: A fragments by ldmatrix from the stage, B fragments by ldmatrix from W_0,
//      mma.sync m16n8k16 with fp32 accumulators [16, H];
//   3. epilogue: + bias, activation, rounded to the dtype and packed straight into the A
//      fragments of the next layer: the m16n8 accumulator layout of two adjacent n-tiles is the
//      m16k16 A-fragment layout, so the activations stay in registers;
//   4. hidden layers repeat 2-3 with A from registers; the output layer walks its (padded) width
//      16 columns at a time and stores y.
// The training forward is the same kernel, also storing each hidden layer's output (through a
// per-warp staging tile, in whole-row 16-byte pieces).
//
// Backward (training), two kernels, chosen by shared memory:
//   - fused_mlp_backward_fused_dw_kernel: per CTA 128 rows at a time, the gradients walk down the
//     layers in registers (g_l as mma A fragments, W_l by ldmatrix.trans), and dW_l (fp32) and db_l
//     are accumulated in shared memory from the chunk's g_l and h_{l-1} (streamed in by cp.async a
//     step ahead); reads dy, (y), the hidden layers and x once, writes dx once.
//   - fused_mlp_backward_kernel (MLPs whose dW does not fit): the same walk per warp, storing every
//     g_l for cuBLAS dW GEMMs, db kept per warp in shared memory.
//   Both end with fixed-order sums of per-CTA partials: dW and db are deterministic.
// Assumes: bf16 or f16; checks (shapes, widths, shared-memory budget) done by mlp.cpp.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <type_traits>

#include "fusekit/core/cuda_check.hpp"
#include "fusekit/ops/gemm.hpp"
#include "mlp_cuda.hpp"
#include "ops/common/cuda_common.cuh"
#include "ops/common/activations.cuh"

namespace fk::cuda {
namespace {

constexpr int kThreads = kMlpWarps * 32;
using u16 = unsigned short;

struct MlpParams {
  const u16* x;     // [batch, in]
  u16* y;           // [batch, out]
  u16* hidden;      // [L-1, batch, H]: the training forward's hidden outputs; nullptr for inference
  std::int64_t batch;
  int in, out, layers;
  const u16* w[kMlpMaxLayers];  // [out_l, in_l]
  const u16* b[kMlpMaxLayers];  // [out_l]
  Activation act[kMlpMaxLayers];
};

__device__ __forceinline__ int round16(int v) { return (v + 15) / 16 * 16; }

__device__ __forceinline__ void ldmatrix_x4(std::uint32_t (&r)[4], const u16* p) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

// c += a · b for one m16n8k16 tile, fp32 accumulation.
template <class T>
__device__ __forceinline__ void mma(float (&c)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two fp32 values rounded to the dtype, the first in the low half (the lower column).
template <class T>
__device__ __forceinline__ std::uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const std::uint32_t*>(&h);
  } else {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const std::uint32_t*>(&h);
  }
}

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

__device__ void copy_bias(const u16* __restrict__ b, int n, bool bf, float* s, int n_pad) {
  for (int i = threadIdx.x; i < n_pad; i += kThreads)
    s[i] = i < n ? (bf ? unpack<__nv_bfloat16>(b[i]) : unpack<__half>(b[i])) : 0.0f;
}

template <class T, int H>
__global__ void __launch_bounds__(kThreads) fused_mlp_kernel(const MlpParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int k0 = round16(p.in), ldk0 = k0 + 8, n_out = round16(p.out);
  constexpr int ldh = H + 8;
  u16* w0 = reinterpret_cast<u16*>(smem_raw);          // [H, ldk0]
  u16* wh = w0 + H * ldk0;                             // (layers-2) x [H, ldh]
  u16* wo = wh + (p.layers - 2) * H * ldh;             // [n_out, ldh]
  u16* stage_all = wo + n_out * ldh;                   // warps x [16, ldk0]
  float* bias = reinterpret_cast<float*>(stage_all + kMlpWarps * 16 * ldk0);  // (layers-1) x [H], [n_out]
  // warps x [16, H + 8]: the training forward's staging of the hidden outputs
  u16* hstage_all = reinterpret_cast<u16*>(bias + (p.layers - 1) * H + round16(p.out));

  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  copy_weight(p.w[0], H, p.in, w0, ldk0);
  for (int l = 1; l < p.layers - 1; ++l) copy_weight(p.w[l], H, H, wh + (l - 1) * H * ldh, ldh);
  copy_weight(p.w[p.layers - 1], p.out, H, wo, ldh);
  for (int l = 0; l < p.layers - 1; ++l) copy_bias(p.b[l], H, kBf16, bias + l * H, H);
  copy_bias(p.b[p.layers - 1], p.out, kBf16, bias + (p.layers - 1) * H, n_out);
  __syncthreads();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  u16* stage = stage_all + warp * 16 * ldk0;
  u16* hstage = hstage_all + warp * 16 * (H + 8);
  // 16-byte loads of x when every row starts 16-byte aligned.
  const bool vec_x = p.in % 8 == 0 && reinterpret_cast<std::uintptr_t>(p.x) % 16 == 0;
  const bool pair_y = p.out % 2 == 0 && reinterpret_cast<std::uintptr_t>(p.y) % 4 == 0;
  // ldmatrix addresses: A (16 rows x 16 k): lane -> row lane%16, k half lane/16. B (two n8 tiles
  // x 16 k from W [n, k]): lane -> row 8(lane/16) + lane%8, k half (lane/8)%2.
  const int a_row = lane % 16, a_col = (lane / 16) * 8;
  const int b_row = (lane / 16) * 8 + lane % 8, b_col = ((lane / 8) % 2) * 8;

  const std::int64_t tiles = (p.batch + 15) / 16;
  for (std::int64_t tile = static_cast<std::int64_t>(blockIdx.x) * kMlpWarps + warp; tile < tiles;
       tile += static_cast<std::int64_t>(gridDim.x) * kMlpWarps) {
    const std::int64_t row0 = tile * 16;
    const int rows = p.batch - row0 < 16 ? static_cast<int>(p.batch - row0) : 16;
    __syncwarp();  // the previous tile's ldmatrix reads of the stage are done
    if (vec_x) {
      const int chunks = k0 / 8, n = 16 * chunks;  // 16-byte chunks of the padded tile
      uint4 v[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int c = lane + 32 * i, r = c / chunks, col = (c % chunks) * 8;
        v[i] = make_uint4(0, 0, 0, 0);
        if (c < n && r < rows && col < p.in)
          v[i] = __ldg(reinterpret_cast<const uint4*>(p.x + (row0 + r) * p.in + col));
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int c = lane + 32 * i, r = c / chunks, col = (c % chunks) * 8;
        if (c < n) *reinterpret_cast<uint4*>(stage + r * ldk0 + col) = v[i];
      }
    } else {
      for (int e = lane; e < 16 * k0; e += 32) {
        const int r = e / k0, col = e % k0;
        stage[r * ldk0 + col] = (r < rows && col < p.in) ? p.x[(row0 + r) * p.in + col] : u16(0);
      }
    }
    __syncwarp();

    std::uint32_t a[H / 16][4];  // the current layer's input, [16, H] as m16k16 A fragments
    {
      float acc[H / 8][4] = {};
      for (int k = 0; k < k0; k += 16) {
        std::uint32_t af[4];
        ldmatrix_x4(af, stage + a_row * ldk0 + k + a_col);
#pragma unroll
        for (int np = 0; np < H / 16; ++np) {
          std::uint32_t bf[4];
          ldmatrix_x4(bf, w0 + (np * 16 + b_row) * ldk0 + k + b_col);
          mma<T>(acc[2 * np], af, bf[0], bf[1]);
          mma<T>(acc[2 * np + 1], af, bf[2], bf[3]);
        }
      }
      epilogue<T, H>(p.act[0], acc, bias, lane, a);
      if (p.hidden != nullptr) store_tile_staged<H>(a, hstage, p.hidden + row0 * H, rows, lane);
    }
    for (int l = 1; l < p.layers - 1; ++l) {
      const u16* w = wh + (l - 1) * H * ldh;
      float acc[H / 8][4] = {};
#pragma unroll
      for (int kk = 0; kk < H / 16; ++kk) {
#pragma unroll
        for (int np = 0; np < H / 16; ++np) {
          std::uint32_t bf[4];
          ldmatrix_x4(bf, w + (np * 16 + b_row) * ldh + kk * 16 + b_col);
          mma<T>(acc[2 * np], a[kk], bf[0], bf[1]);
          mma<T>(acc[2 * np + 1], a[kk], bf[2], bf[3]);
        }
      }
      epilogue<T, H>(p.act[l], acc, bias + l * H, lane, a);
      if (p.hidden != nullptr) store_tile_staged<H>(a, hstage, p.hidden + (l * p.batch + row0) * H, rows, lane);
    }
    // The output layer, 16 columns at a time.
    const Activation out_act = p.act[p.layers - 1];
    const float* out_bias = bias + (p.layers - 1) * H;
    for (int nb = 0; nb < n_out; nb += 16) {
      float acc[2][4] = {};
#pragma unroll
      for (int kk = 0; kk < H / 16; ++kk) {
        std::uint32_t bf[4];
        ldmatrix_x4(bf, wo + (nb + b_row) * ldh + kk * 16 + b_col);
        mma<T>(acc[0], a[kk], bf[0], bf[1]);
        mma<T>(acc[1], a[kk], bf[2], bf[3]);
      }
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int col = nb + 8 * j + 2 * t;
        float v[4] = {acc[j][0] + out_bias[col], acc[j][1] + out_bias[col + 1], acc[j][2] + out_bias[col],
                      acc[j][3] + out_bias[col + 1]};
        if (out_act == Activation::relu) act4<Activation::relu>(v);
        else if (out_act == Activation::sigmoid) act4<Activation::sigmoid>(v);
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // rows g, g + 8
          const int r = g + 8 * h;
          if (r >= rows || col >= p.out) continue;
          const std::uint32_t packed = pack2<T>(v[2 * h], v[2 * h + 1]);
          u16* dst = p.y + (row0 + r) * p.out + col;
          if (pair_y) {
            *reinterpret_cast<std::uint32_t*>(dst) = packed;
          } else {
            dst[0] = static_cast<u16>(packed & 0xffffu);
            if (col + 1 < p.out) dst[1] = static_cast<u16>(packed >> 16);
          }
        }
      }
    }
  }
}

template <class T, int H>
void launch(const MlpParams& p, std::size_t smem, cudaStream_t stream) {
  auto* kernel = fused_mlp_kernel<T, H>;
  FK_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  int per_sm = 0;
  FK_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem));
  const std::int64_t tiles = (p.batch + 15) / 16;
  const std::int64_t want = (tiles + kMlpWarps - 1) / kMlpWarps;
  const int blocks = static_cast<int>(std::min<std::int64_t>(want, std::int64_t{multiprocessor_count()} * std::max(per_sm, 1)));
  kernel<<<blocks, kThreads, smem, stream>>>(p);
  FK_CUDA_CHECK_LAUNCH("fused_mlp_kernel");
}

// ---------------------------------------------------------------------------------------------
// Backward
// ---------------------------------------------------------------------------------------------

struct MlpBackwardParams {
  const u16* dy;      // [batch, out]
  const u16* y;       // [batch, out], the forward's output (act' of the output layer)
  const u16* hidden;  // [L-1, batch, H], the forward's hidden outputs
  const u16* x;       // [batch, in], the forward's input (the fused-dW kernel's dW_0)
  u16* dx;            // [batch, in]; nullptr: not computed
  u16* g_hidden;      // [L-1, batch, H]: g_0 .. g_{L-2}, read by the dW GEMMs
  u16* g_out;         // [batch, out]: g_{L-1}
  float* db_part;     // [gridDim.x, n_bias]: each CTA's column sums of every g
  std::int64_t batch;
  int in, out, layers;
  const u16* w[kMlpMaxLayers];  // [out_l, in_l]
  Activation act[kMlpMaxLayers];
};

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

// The backward through every layer, 16 rows per warp at a time: the gradients g_l travel down
// the layers in registers (the A fragments of the product with the next weight matrix, held in
// shared memory in its natural [out_l, in_l] layout and read transposed by ldmatrix.trans); each
// g_l is stored once for the dW GEMMs and its column sums (db) kept per warp in shared memory.
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

template <class T, int H>
__global__ void __launch_bounds__(kThreads) fused_mlp_backward_kernel(const MlpBackwardParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int k0 = round16(p.in), ldk0 = k0 + 8, n_out = round16(p.out);
  constexpr int ldh = H + 8;
  u16* w0 = reinterpret_cast<u16*>(smem_raw);           // [H, ldk0]
  u16* wh = w0 + H * ldk0;                              // (layers-2) x [H, ldh]
  u16* wo = wh + (p.layers - 2) * H * ldh;              // [n_out, ldh]
  float* slots = reinterpret_cast<float*>(wo + n_out * ldh);  // warps x [n_bias]
  const int n_bias = (p.layers - 1) * H + n_out;

  copy_weight(p.w[0], H, p.in, w0, ldk0);
  for (int l = 1; l < p.layers - 1; ++l) copy_weight(p.w[l], H, H, wh + (l - 1) * H * ldh, ldh);
  copy_weight(p.w[p.layers - 1], p.out, H, wo, ldh);
  for (int i = threadIdx.x; i < kMlpWarps * n_bias; i += kThreads) slots[i] = 0.0f;
  __syncthreads();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  float* slot = slots + warp * n_bias;
  // ldmatrix.trans addresses of B (k16 x two n8 tiles) from W [k, n]: lane -> k row
  // 8((lane/8)%2) + lane%8, n half lane/16.
  const int bt_row = ((lane / 8) % 2) * 8 + lane % 8, bt_col = (lane / 16) * 8;
  const Activation out_act = p.act[p.layers - 1];
  const bool pair_dx = p.in % 2 == 0 && reinterpret_cast<std::uintptr_t>(p.dx) % 4 == 0;

  const std::int64_t tiles = (p.batch + 15) / 16;
  for (std::int64_t tile = static_cast<std::int64_t>(blockIdx.x) * kMlpWarps + warp; tile < tiles;
       tile += static_cast<std::int64_t>(gridDim.x) * kMlpWarps) {
    const std::int64_t row0 = tile * 16;
    const int rows = p.batch - row0 < 16 ? static_cast<int>(p.batch - row0) : 16;

    // Output layer, 16 of its (padded) columns at a time: g = dy ⊙ act'(y) rounded to the dtype,
    // dh = g · W_{L-1} (fp32, [16, H]).
    float dh[H / 8][4] = {};
    for (int kc = 0; kc < n_out; kc += 16) {
      std::uint32_t ga[4];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int col = kc + 8 * j + 2 * t;
        float v[4];  // (g, col), (g, col + 1), (g + 8, col), (g + 8, col + 1)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = g + 8 * (e / 2), c = col + e % 2;
          v[e] = 0.0f;
          if (r < rows && c < p.out) {
            const std::int64_t i = (row0 + r) * p.out + c;
            v[e] = unpack<T>(p.dy[i]);
            if (out_act != Activation::identity) v[e] *= grad_from_output(out_act, unpack<T>(p.y[i]));
          }
        }
        const std::uint32_t top = pack2<T>(v[0], v[1]), bot = pack2<T>(v[2], v[3]);
        ga[2 * j] = top;      // row g,     k = 8j + 2t
        ga[2 * j + 1] = bot;  // row g + 8
        const std::uint32_t q[4] = {top & 0xffffu, top >> 16, bot & 0xffffu, bot >> 16};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = g + 8 * (e / 2), c = col + e % 2;
          if (r < rows && c < p.out) p.g_out[(row0 + r) * p.out + c] = static_cast<u16>(q[e]);
        }
        add_column_sums(slot + (p.layers - 1) * H, col, lo<T>(top) + lo<T>(bot), hi<T>(top) + hi<T>(bot), lane);
      }
      back_through_output<T, H>(dh, ga, wo, ldh, kc, bt_row, bt_col);
    }

    // Hidden layers, top down: g_l = dh ⊙ act'_l(h_l) rounded; then dh = g_l · W_l, or dx at l = 0.
    for (int l = p.layers - 2; l >= 0; --l) {
      const std::int64_t base = (l * p.batch + row0) * H;
      const u16* hl = p.hidden + base;
      const Activation act = p.act[l];
      std::uint32_t ga[H / 16][4];
#pragma unroll
      for (int j = 0; j < H / 8; ++j) {
        const int col = 8 * j + 2 * t;
        const std::uint32_t h_top = g < rows ? __ldg(reinterpret_cast<const unsigned*>(hl + g * H + col)) : 0u;
        const std::uint32_t h_bot = g + 8 < rows ? __ldg(reinterpret_cast<const unsigned*>(hl + (g + 8) * H + col)) : 0u;
        const std::uint32_t top = pack2<T>(dh[j][0] * grad_from_output(act, lo<T>(h_top)),
                                           dh[j][1] * grad_from_output(act, hi<T>(h_top)));
        const std::uint32_t bot = pack2<T>(dh[j][2] * grad_from_output(act, lo<T>(h_bot)),
                                           dh[j][3] * grad_from_output(act, hi<T>(h_bot)));
        ga[j / 2][(j % 2) * 2] = top;
        ga[j / 2][(j % 2) * 2 + 1] = bot;
        add_column_sums(slot + l * H, col, lo<T>(top) + lo<T>(bot), hi<T>(top) + hi<T>(bot), lane);
      }
      store_tile<H>(ga, p.g_hidden + base, rows, lane);
      if (l > 0) {
        back_through_hidden<T, H>(dh, ga, wh + (l - 1) * H * ldh, ldh, bt_row, bt_col);
      } else if (p.dx != nullptr) {
        store_dx<T, H>(ga, w0, ldk0, k0, p.in, p.dx, row0, rows, pair_dx, bt_row, bt_col, g, t);
      }
    }
  }

  // This CTA's column sums: its warps' accumulators added in a fixed order.
  __syncthreads();
  for (int i = threadIdx.x; i < n_bias; i += kThreads) {
    float sum = 0.0f;
    for (int w = 0; w < kMlpWarps; ++w) sum += slots[w * n_bias + i];
    p.db_part[static_cast<std::int64_t>(blockIdx.x) * n_bias + i] = sum;
  }
}

struct DbOut {
  float* db[kMlpMaxLayers];  // [out_l]
};

// db_l = the CTAs' column sums added in a fixed order (deterministic), one thread per bias element.
__global__ void mlp_bias_grad_kernel(const float* __restrict__ part, int blocks, int n_bias, int hidden, int layers,
                                     int out, DbOut d) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n_bias) return;
  double sum = 0.0;
  for (int b = 0; b < blocks; ++b) sum += part[static_cast<std::int64_t>(b) * n_bias + i];
  const int layer = min(i / hidden, layers - 1), col = i - layer * hidden;
  if (layer == layers - 1 && col >= out) return;  // the output layer's padding
  d.db[layer][col] = static_cast<float>(sum);
}

// ---------------------------------------------------------------------------------------------
// Backward with dW fused (the MLPs whose fp32 dW accumulators fit in shared memory)
// ---------------------------------------------------------------------------------------------

// Rows of the batch one CTA takes at a time: 16 per warp.
constexpr int kChunkRows = 16 * kMlpWarps;

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait_group() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// One warp's 16 rows of src [*, cols] (row r0 onward, `rows` of them valid) into dst [16, ld],
// columns up to round16(cols); rows past `rows` and columns past `cols` are zero. 16-byte
// cp.async when `vec` (cols % 8 == 0 and src 16-byte aligned), element copies otherwise.
__device__ __forceinline__ void load_rows(const u16* __restrict__ src, int cols, int rows, bool vec, u16* dst, int ld,
                                          int lane) {
  const int cp = round16(cols);
  if (vec) {
    const int chunks = cp / 8;
    for (int c = lane; c < 16 * chunks; c += 32) {
      const int r = c / chunks, col = (c % chunks) * 8;
      u16* d = dst + r * ld + col;
      if (r < rows && col < cols) cp_async16(d, src + static_cast<std::int64_t>(r) * cols + col);
      else *reinterpret_cast<uint4*>(d) = make_uint4(0, 0, 0, 0);
    }
  } else {
    for (int e = lane; e < 16 * cp; e += 32) {
      const int r = e / cp, col = e % cp;
      dst[r * ld + col] = (r < rows && col < cols) ? src[static_cast<std::int64_t>(r) * cols + col] : u16(0);
    }
  }
}

struct MlpFusedDwParams {
  MlpBackwardParams b;
  float* dw_part;                 // [gridDim.x, dw_total]: each CTA's dW_l, row-major per layer
  int dw_total;
  int dw_offset[kMlpMaxLayers];   // where dW_l starts in a CTA's row of dw_part
  int acc_offset[kMlpMaxLayers];  // where layer l's accumulator starts in shared memory (floats)
};

// dW [m_pad, n_pad] (this CTA's fp32 accumulator: 16 x 16 blocks, each two m16n8 fragments) +=
// Gᵀ · X over the chunk's 128 rows: G [128, ldg] (m columns), X [128, ldx] (n columns). Warp w
// takes the 16 x 32 tiles w, w + 8, ... (two blocks side by side, one A fragment for both; a
// lone 16 x 16 block at an odd right edge); both operands by ldmatrix.trans. db [m_pad] += Gᵀ · 1
// rides along: the warp of the tile at n = 0 also multiplies its A fragments by an all-ones B
// fragment, into the m16n8 fragment db + 128 bm (every column the same sum).
template <class T>
__device__ __forceinline__ void accumulate_dw(float* acc, float* db, int m_pad, int n_pad, const u16* G, int ldg,
                                              const u16* X, int ldx, int warp, int lane) {
  const int q = lane / 8;
  const int a_m = (q % 2) * 8, a_k = (q / 2) * 8 + lane % 8;                  // A = Gᵀ: m half, k row
  const int bt_row = ((lane / 8) % 2) * 8 + lane % 8, bt_col = (lane / 16) * 8;  // B = X: k row, n half
  const int nb = n_pad / 16, pairs = (nb + 1) / 2, tiles = (m_pad / 16) * pairs;
  const std::uint32_t ones = pack2<T>(1.0f, 1.0f);
  for (int tile = warp; tile < tiles; tile += kMlpWarps) {
    const int bm = tile / pairs, bn = (tile % pairs) * 2;
    const bool two = bn + 1 < nb, with_db = bn == 0;
    float4* frag = reinterpret_cast<float4*>(acc) + (bm * nb + bn) * 64;  // [2 blocks][2 n8 tiles][32 lanes]
    float4* dfrag = reinterpret_cast<float4*>(db) + bm * 32;
    float c[5][4];
#pragma unroll
    for (int f = 0; f < 5; ++f) {
      float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
      if (f < 2 || (f < 4 && two)) v = frag[f * 32 + lane];
      else if (f == 4 && with_db) v = dfrag[lane];
      c[f][0] = v.x, c[f][1] = v.y, c[f][2] = v.z, c[f][3] = v.w;
    }
#pragma unroll
    for (int kk = 0; kk < kChunkRows / 16; ++kk) {
      std::uint32_t af[4], bf[4];
      ldmatrix_x4_trans(af, G + (kk * 16 + a_k) * ldg + bm * 16 + a_m);
      ldmatrix_x4_trans(bf, X + (kk * 16 + bt_row) * ldx + bn * 16 + bt_col);
      mma<T>(c[0], af, bf[0], bf[1]);
      mma<T>(c[1], af, bf[2], bf[3]);
      if (two) {
        ldmatrix_x4_trans(bf, X + (kk * 16 + bt_row) * ldx + (bn + 1) * 16 + bt_col);
        mma<T>(c[2], af, bf[0], bf[1]);
        mma<T>(c[3], af, bf[2], bf[3]);
      }
      if (with_db) mma<T>(c[4], af, ones, ones);
    }
#pragma unroll
    for (int f = 0; f < 5; ++f) {
      const float4 v = make_float4(c[f][0], c[f][1], c[f][2], c[f][3]);
      if (f < 2 || (f < 4 && two)) frag[f * 32 + lane] = v;
      else if (f == 4 && with_db) dfrag[lane] = v;
    }
  }
}

// The backward through every layer with dW and db accumulated on chip. A CTA takes 128 rows at a
// time and walks the layers top down; one (chunk, layer) pair is a step. In a step each warp
// computes its 16 rows of g_l (registers -> the chunk's G buffer, by step parity) and carries
// dh = g_l · W_l on in registers; after one barrier every warp adds its 16 x 16 blocks of
// g_lᵀ · h_{l-1} (K = 128 rows) to the CTA's fp32 dW_l in shared memory. The layer inputs h_{l-1}
// (x at l = 0) and, at the output layer, dy and y stream in by cp.async one step ahead, into a
// ring of three buffers (an input is written one step before its own, and read in its own step
// (dW) and the next (act')). At the end each CTA writes its dW and db once; a second kernel adds
// the CTAs' in a fixed order.
template <class T, int H>
__global__ void __launch_bounds__(kThreads, 1) fused_mlp_backward_fused_dw_kernel(const MlpFusedDwParams fp) {
  const MlpBackwardParams& p = fp.b;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int L = p.layers;
  const int k0 = round16(p.in), ldk0 = k0 + 8, n_out = round16(p.out);
  constexpr int ldh = H + 8;
  const int ldg = max(H, n_out) + 8, ldx = max(H, k0) + 8, ldo = n_out + 8;
  u16* w0 = reinterpret_cast<u16*>(smem_raw);  // [H, ldk0]
  u16* wh = w0 + H * ldk0;                     // (layers-2) x [H, ldh]
  u16* wo = wh + (L - 2) * H * ldh;            // [n_out, ldh]
  u16* gbuf = wo + n_out * ldh;                // 2 x [128, ldg]: g_l of the chunk, by step parity
  u16* ring = gbuf + 2 * kChunkRows * ldg;     // 3 x [128, ldx]: the steps' layer inputs
  u16* dybuf = ring + 3 * kChunkRows * ldx;    // [128, ldo]: dy of the chunk
  u16* ybuf = dybuf + kChunkRows * ldo;        // [128, ldo]: y of the chunk
  float* acc = reinterpret_cast<float*>(ybuf + kChunkRows * ldo);  // every dW_l, fragment order
  float* dbacc = acc + fp.acc_offset[L - 1] + n_out * H;           // db_l at 8 H l: [m_pad / 16] m16n8 fragments
  const int n_bias = (L - 1) * H + n_out;
  const int acc_total = fp.acc_offset[L - 1] + n_out * H + 8 * n_bias;

  copy_weight(p.w[0], H, p.in, w0, ldk0);
  for (int l = 1; l < L - 1; ++l) copy_weight(p.w[l], H, H, wh + (l - 1) * H * ldh, ldh);
  copy_weight(p.w[L - 1], p.out, H, wo, ldh);
  for (int i = threadIdx.x; i < acc_total; i += kThreads) acc[i] = 0.0f;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int bt_row = ((lane / 8) % 2) * 8 + lane % 8, bt_col = (lane / 16) * 8;
  const Activation out_act = p.act[L - 1];
  const bool pair_dx = p.in % 2 == 0 && reinterpret_cast<std::uintptr_t>(p.dx) % 4 == 0;
  const bool vec_x = p.in % 8 == 0 && reinterpret_cast<std::uintptr_t>(p.x) % 16 == 0;
  const bool vec_h = reinterpret_cast<std::uintptr_t>(p.hidden) % 16 == 0;
  const bool vec_o = p.out % 8 == 0 && reinterpret_cast<std::uintptr_t>(p.dy) % 16 == 0 &&
                     reinterpret_cast<std::uintptr_t>(p.y) % 16 == 0;
  u16* dy_w = dybuf + warp * 16 * ldo;  // this warp's rows
  u16* y_w = ybuf + warp * 16 * ldo;

  const std::int64_t chunks = (p.batch + kChunkRows - 1) / kChunkRows;
  const std::int64_t steps = (chunks - blockIdx.x + gridDim.x - 1) / gridDim.x * L;
  // Step s: chunk blockIdx.x + (s / L) * gridDim.x, layer L - 1 - s % L. This warp's rows.
  const auto step_rows = [&](std::int64_t s, std::int64_t& row0) {
    row0 = (blockIdx.x + (s / L) * gridDim.x) * kChunkRows + warp * 16;
    const std::int64_t left = p.batch - row0;
    return left <= 0 ? 0 : left < 16 ? static_cast<int>(left) : 16;
  };
  // The loads of step s: its layer input into ring slot s % 3 and, at the output layer, dy and y.
  const auto issue = [&](std::int64_t s) {
    std::int64_t row0;
    const int rows = step_rows(s, row0), l = L - 1 - static_cast<int>(s % L);
    u16* dst = ring + static_cast<int>(s % 3) * kChunkRows * ldx + warp * 16 * ldx;
    if (l > 0) load_rows(p.hidden + (static_cast<std::int64_t>(l - 1) * p.batch + row0) * H, H, rows, vec_h, dst, ldx, lane);
    else load_rows(p.x + row0 * p.in, p.in, rows, vec_x, dst, ldx, lane);
    if (l == L - 1) {
      load_rows(p.dy + row0 * p.out, p.out, rows, vec_o, dy_w, ldo, lane);
      if (out_act != Activation::identity) load_rows(p.y + row0 * p.out, p.out, rows, vec_o, y_w, ldo, lane);
    }
  };

  if (steps > 0) issue(0);
  cp_async_commit();
  __syncthreads();  // the weights and the zeroed accumulators
  float dh[H / 8][4] = {};
  for (std::int64_t s = 0; s < steps; ++s) {
    const int l = L - 1 - static_cast<int>(s % L);
    std::int64_t row0;
    const int rows = step_rows(s, row0);
    if (s + 1 < steps) issue(s + 1);
    cp_async_commit();
    u16* G = gbuf + static_cast<int>(s & 1) * kChunkRows * ldg + warp * 16 * ldg;  // this warp's rows
    if (l == L - 1) {
      // g = dy ⊙ act'(y), rounded; dh = g · W_{L-1}. Rows and columns past the data are zero.
      cp_async_wait_group<1>();
      __syncwarp();
#pragma unroll
      for (int j = 0; j < H / 8; ++j) dh[j][0] = dh[j][1] = dh[j][2] = dh[j][3] = 0.0f;
      for (int kc = 0; kc < n_out; kc += 16) {
        std::uint32_t ga[4];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int col = kc + 8 * j + 2 * t;
          const std::uint32_t d_top = *reinterpret_cast<const std::uint32_t*>(dy_w + g * ldo + col);
          const std::uint32_t d_bot = *reinterpret_cast<const std::uint32_t*>(dy_w + (g + 8) * ldo + col);
          float v[4] = {lo<T>(d_top), hi<T>(d_top), lo<T>(d_bot), hi<T>(d_bot)};
          if (out_act != Activation::identity) {
            const std::uint32_t y_top = *reinterpret_cast<const std::uint32_t*>(y_w + g * ldo + col);
            const std::uint32_t y_bot = *reinterpret_cast<const std::uint32_t*>(y_w + (g + 8) * ldo + col);
            v[0] *= grad_from_output(out_act, lo<T>(y_top));
            v[1] *= grad_from_output(out_act, hi<T>(y_top));
            v[2] *= grad_from_output(out_act, lo<T>(y_bot));
            v[3] *= grad_from_output(out_act, hi<T>(y_bot));
          }
          const std::uint32_t top = pack2<T>(v[0], v[1]), bot = pack2<T>(v[2], v[3]);
          ga[2 * j] = top;
          ga[2 * j + 1] = bot;
          *reinterpret_cast<std::uint32_t*>(G + g * ldg + col) = top;
          *reinterpret_cast<std::uint32_t*>(G + (g + 8) * ldg + col) = bot;
        }
        back_through_output<T, H>(dh, ga, wo, ldh, kc, bt_row, bt_col);
      }
    } else {
      // g_l = dh ⊙ act'_l(h_l) rounded, h_l being the previous step's input; then dh = g_l · W_l,
      // or dx at l = 0.
      const u16* Hl = ring + static_cast<int>((s - 1) % 3) * kChunkRows * ldx + warp * 16 * ldx;
      const Activation act = p.act[l];
      // Every h first: shared stores to G could alias them for all the compiler knows.
      std::uint32_t hv[H / 8][2];
#pragma unroll
      for (int j = 0; j < H / 8; ++j) {
        hv[j][0] = *reinterpret_cast<const std::uint32_t*>(Hl + g * ldx + 8 * j + 2 * t);
        hv[j][1] = *reinterpret_cast<const std::uint32_t*>(Hl + (g + 8) * ldx + 8 * j + 2 * t);
      }
      std::uint32_t ga[H / 16][4];
#pragma unroll
      for (int j = 0; j < H / 8; ++j) {
        const int col = 8 * j + 2 * t;
        const std::uint32_t top = pack2<T>(dh[j][0] * grad_from_output(act, lo<T>(hv[j][0])),
                                           dh[j][1] * grad_from_output(act, hi<T>(hv[j][0])));
        const std::uint32_t bot = pack2<T>(dh[j][2] * grad_from_output(act, lo<T>(hv[j][1])),
                                           dh[j][3] * grad_from_output(act, hi<T>(hv[j][1])));
        ga[j / 2][(j % 2) * 2] = top;
        ga[j / 2][(j % 2) * 2 + 1] = bot;
        *reinterpret_cast<std::uint32_t*>(G + g * ldg + col) = top;
        *reinterpret_cast<std::uint32_t*>(G + (g + 8) * ldg + col) = bot;
      }
      if (l > 0) {
        back_through_hidden<T, H>(dh, ga, wh + (l - 1) * H * ldh, ldh, bt_row, bt_col);
      } else if (p.dx != nullptr) {
        store_dx<T, H>(ga, w0, ldk0, k0, p.in, p.dx, row0, rows, pair_dx, bt_row, bt_col, g, t);
      }
    }
    cp_async_wait_group<1>();  // this step's input, issued one step earlier
    __syncthreads();
    accumulate_dw<T>(acc + fp.acc_offset[l], dbacc + 8 * H * l, l == L - 1 ? n_out : H, l == 0 ? k0 : H,
                     gbuf + static_cast<int>(s & 1) * kChunkRows * ldg, ldg,
                     ring + static_cast<int>(s % 3) * kChunkRows * ldx, ldx, warp, lane);
  }
  cp_async_wait_group<0>();

  // This CTA's dW (fragment order -> row-major, the valid part) and db, written once.
  __syncthreads();
  float* part = fp.dw_part + static_cast<std::int64_t>(blockIdx.x) * fp.dw_total;
  for (int l = 0; l < p.layers; ++l) {
    const int m = l == p.layers - 1 ? p.out : H, n = l == 0 ? p.in : H;
    const int m_pad = l == p.layers - 1 ? n_out : H, n_pad = l == 0 ? k0 : H, nb = n_pad / 16;
    for (int i = threadIdx.x; i < m_pad * n_pad; i += kThreads) {
      // i = ((blk * 2 + half) * 32 + lane) * 4 + v
      const int v = i % 4, ln = (i / 4) % 32, half = (i / 128) % 2, blk = i / 256;
      const int o = (blk / nb) * 16 + ln / 4 + 8 * (v / 2), c = (blk % nb) * 16 + half * 8 + 2 * (ln % 4) + v % 2;
      if (o < m && c < n) part[fp.dw_offset[l] + o * n + c] = acc[fp.acc_offset[l] + i];
    }
  }
  // db: column 0 of each m16n8 fragment (lanes with t = 0, values 0 and 2: rows g and g + 8).
  for (int i = threadIdx.x; i < 8 * n_bias; i += kThreads) {
    const int v = i % 4, ln = (i / 4) % 32, blk = i / 128;
    if (ln % 4 != 0 || v % 2 != 0) continue;
    p.db_part[static_cast<std::int64_t>(blockIdx.x) * n_bias + blk * 16 + ln / 4 + 8 * (v / 2)] = dbacc[i];
  }
}

struct DwOut {
  float* dw[kMlpMaxLayers];
  int offset[kMlpMaxLayers + 1];  // offset[layers] = the total
};

// dW_l = the CTAs' partial dW added in a fixed order (deterministic), one thread per element.
__global__ void mlp_weight_grad_kernel(const float* __restrict__ part, int blocks, int total, int layers, DwOut d) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= total) return;
  double sum = 0.0;
  for (int b = 0; b < blocks; ++b) sum += part[static_cast<std::int64_t>(b) * total + i];
  int l = 0;
  while (l + 1 < layers && i >= d.offset[l + 1]) ++l;
  d.dw[l][i - d.offset[l]] = static_cast<float>(sum);
}

template <class T, int H>
int launch_backward(MlpBackwardParams p, std::size_t smem, cudaStream_t stream, float** db_part_out,
                    const std::function<float*(std::int64_t)>& alloc_part) {
  auto* kernel = fused_mlp_backward_kernel<T, H>;
  FK_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  int per_sm = 0;
  FK_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem));
  const std::int64_t tiles = (p.batch + 15) / 16;
  const std::int64_t want = (tiles + kMlpWarps - 1) / kMlpWarps;
  const int blocks = static_cast<int>(std::min<std::int64_t>(want, std::int64_t{multiprocessor_count()} * std::max(per_sm, 1)));
  p.db_part = alloc_part(blocks);
  *db_part_out = p.db_part;
  kernel<<<blocks, kThreads, smem, stream>>>(p);
  FK_CUDA_CHECK_LAUNCH("fused_mlp_backward_kernel");
  return blocks;
}


}  // namespace

std::size_t fused_mlp_smem_limit() {
  int dev = 0, bytes = 0;
  FK_CUDA_CHECK(cudaGetDevice(&dev));
  FK_CUDA_CHECK(cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  return static_cast<std::size_t>(bytes);
}

void fused_mlp_forward(const FusedMlpForwardArgs& a, const TensorView* hidden_out, const Stream* stream) {
  const fk::detail::DeviceScope on_device(a.x.device().index);
  MlpParams p{};
  p.x = a.x.data_as<const u16>();
  p.y = a.y.data_as<u16>();
  p.hidden = hidden_out != nullptr ? hidden_out->data_as<u16>() : nullptr;
  p.batch = a.x.size(0);
  p.in = static_cast<int>(a.x.size(1));
  p.out = static_cast<int>(a.y.size(1));
  p.layers = static_cast<int>(a.layers.size());
  for (int l = 0; l < p.layers; ++l) {
    p.w[l] = a.layers[static_cast<std::size_t>(l)].weight.data_as<const u16>();
    p.b[l] = a.layers[static_cast<std::size_t>(l)].bias.data_as<const u16>();
    p.act[l] = a.layers[static_cast<std::size_t>(l)].act;
  }
  const int hidden = static_cast<int>(a.layers[0].weight.size(0));
  const std::size_t smem = fused_mlp_smem_bytes(p.in, hidden, p.out, p.layers, hidden_out != nullptr);
  const cudaStream_t s = fk::detail::cuda_stream(stream);
  with_float_type(a.x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, float>) {
      switch (hidden) {
        case 16: return launch<T, 16>(p, smem, s);
        case 32: return launch<T, 32>(p, smem, s);
        case 64: return launch<T, 64>(p, smem, s);
        case 128: return launch<T, 128>(p, smem, s);
        default: throw_internal("fused_mlp_forward: hidden width not checked by the caller");
      }
    }
  });
}


void fused_mlp_backward(const FusedMlpBackwardArgs& a, const Stream* stream) {
  const fk::detail::DeviceScope on_device(a.x.device().index);
  const cudaStream_t s = fk::detail::cuda_stream(stream);
  const int layers = static_cast<int>(a.layers.size());
  const std::int64_t batch = a.x.size(0);
  if (batch == 0) {  // the sums over no rows
    for (int l = 0; l < layers; ++l) {
      const TensorView& dw = a.dweight[static_cast<std::size_t>(l)];
      const TensorView& db = a.dbias[static_cast<std::size_t>(l)];
      FK_CUDA_CHECK(cudaMemsetAsync(dw.data(), 0, dw.nbytes(), s));
      FK_CUDA_CHECK(cudaMemsetAsync(db.data(), 0, db.nbytes(), s));
    }
    return;
  }
  const int hidden = static_cast<int>(a.layers[0].weight.size(0));
  const int in = static_cast<int>(a.x.size(1)), out = static_cast<int>(a.y.size(1));
  const Device dev = a.x.device();
  const DType dt = a.x.dtype();
  const int n_bias = static_cast<int>(fused_mlp_bias_elems(hidden, out, layers));

  MlpBackwardParams p{};
  p.dy = a.dy.data_as<const u16>();
  p.y = a.y.data_as<const u16>();
  p.hidden = a.hidden.data_as<const u16>();
  p.x = a.x.data_as<const u16>();
  p.dx = a.dx ? a.dx->data_as<u16>() : nullptr;
  p.batch = batch;
  p.in = in;
  p.out = out;
  p.layers = layers;
  for (int l = 0; l < layers; ++l) {
    p.w[l] = a.layers[static_cast<std::size_t>(l)].weight.data_as<const u16>();
    p.act[l] = a.layers[static_cast<std::size_t>(l)].act;
  }
  DbOut d{};
  for (int l = 0; l < layers; ++l) d.db[l] = a.dbias[static_cast<std::size_t>(l)].data_as<float>();

  if (fused_mlp_backward_fused_dw_smem_bytes(in, hidden, out, layers) <= fused_mlp_smem_limit()) {
    // dW on chip: one kernel, then the fixed-order sums of the CTAs' dW and db.
    MlpFusedDwParams fp{};
    fp.b = p;
    const std::int64_t k0 = round_up(in, 16), n_out = round_up(out, 16);
    int dw_off = 0, acc_off = 0;
    DwOut dwo{};
    for (int l = 0; l < layers; ++l) {
      const int m = l == layers - 1 ? out : hidden, n = l == 0 ? in : hidden;
      const int m_pad = static_cast<int>(l == layers - 1 ? n_out : hidden), n_pad = static_cast<int>(l == 0 ? k0 : hidden);
      fp.dw_offset[l] = dwo.offset[l] = dw_off;
      fp.acc_offset[l] = acc_off;
      dwo.dw[l] = a.dweight[static_cast<std::size_t>(l)].data_as<float>();
      dw_off += m * n;
      acc_off += m_pad * n_pad;
    }
    dwo.offset[layers] = dw_off;
    fp.dw_total = dw_off;
    const std::size_t smem = fused_mlp_backward_fused_dw_smem_bytes(in, hidden, out, layers);
    const std::int64_t chunks = (batch + kChunkRows - 1) / kChunkRows;
    const int blocks = static_cast<int>(std::min<std::int64_t>(chunks, multiprocessor_count()));
    const Tensor dw_part = Tensor::empty({blocks, std::int64_t{dw_off}}, DType::f32, dev, stream);
    const Tensor db_part = Tensor::empty({blocks, std::int64_t{n_bias}}, DType::f32, dev, stream);
    fp.dw_part = dw_part.data_as<float>();
    fp.b.db_part = db_part.data_as<float>();
    with_float_type(dt, [&](auto tag) {
      using T = decltype(tag);
      if constexpr (!std::is_same_v<T, float>) {
        auto launch_fused = [&](auto* kernel) {
          FK_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
          kernel<<<blocks, kThreads, smem, s>>>(fp);
          FK_CUDA_CHECK_LAUNCH("fused_mlp_backward_fused_dw_kernel");
        };
        switch (hidden) {
          case 16: return launch_fused(fused_mlp_backward_fused_dw_kernel<T, 16>);
          case 32: return launch_fused(fused_mlp_backward_fused_dw_kernel<T, 32>);
          case 64: return launch_fused(fused_mlp_backward_fused_dw_kernel<T, 64>);
          case 128: return launch_fused(fused_mlp_backward_fused_dw_kernel<T, 128>);
          default: throw_internal("fused_mlp_backward: hidden width not checked by the caller");
        }
      }
    });
    mlp_weight_grad_kernel<<<(dw_off + 255) / 256, 256, 0, s>>>(dw_part.data_as<float>(), blocks, dw_off, layers, dwo);
    FK_CUDA_CHECK_LAUNCH("mlp_weight_grad_kernel");
    mlp_bias_grad_kernel<<<(n_bias + 127) / 128, 128, 0, s>>>(db_part.data_as<float>(), blocks, n_bias, hidden, layers,
                                                             out, d);
    FK_CUDA_CHECK_LAUNCH("mlp_bias_grad_kernel");
    return;
  }

  // dW too large for shared memory: the kernel stores every g_l, cuBLAS forms the dW GEMMs.
  const Tensor g_hidden = Tensor::empty({std::int64_t{layers} - 1, batch, std::int64_t{hidden}}, dt, dev, stream);
  const Tensor g_out = Tensor::empty({batch, std::int64_t{out}}, dt, dev, stream);
  p.g_hidden = g_hidden.data_as<u16>();
  p.g_out = g_out.data_as<u16>();
  Tensor part;
  const std::size_t smem = fused_mlp_backward_smem_bytes(in, hidden, out, layers);
  const auto alloc_part = [&](std::int64_t blocks) {
    part = Tensor::empty({blocks, std::int64_t{n_bias}}, DType::f32, dev, stream);
    return part.data_as<float>();
  };
  float* db_part = nullptr;
  int blocks = 0;
  with_float_type(dt, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, float>) {
      switch (hidden) {
        case 16: blocks = launch_backward<T, 16>(p, smem, s, &db_part, alloc_part); return;
        case 32: blocks = launch_backward<T, 32>(p, smem, s, &db_part, alloc_part); return;
        case 64: blocks = launch_backward<T, 64>(p, smem, s, &db_part, alloc_part); return;
        case 128: blocks = launch_backward<T, 128>(p, smem, s, &db_part, alloc_part); return;
        default: throw_internal("fused_mlp_backward: hidden width not checked by the caller");
      }
    }
  });
  mlp_bias_grad_kernel<<<(n_bias + 127) / 128, 128, 0, s>>>(db_part, blocks, n_bias, hidden, layers, out, d);
  FK_CUDA_CHECK_LAUNCH("mlp_bias_grad_kernel");

  // dW_l = g_lᵀ · h_{l-1} (h_{-1} = x), fp32 output.
  const auto h_slice = [&](int l, std::int64_t width) {
    return TensorView(a.hidden.data_as<u16>() + static_cast<std::int64_t>(l) * batch * hidden, dt, {batch, width}, dev);
  };
  const auto g_slice = [&](int l) {
    return TensorView(g_hidden.data_as<u16>() + static_cast<std::int64_t>(l) * batch * hidden, dt, {batch, hidden}, dev);
  };
  matmul(g_slice(0), a.x, a.dweight[0], Trans::t, Trans::n, stream);
  for (int l = 1; l < layers - 1; ++l)
    matmul(g_slice(l), h_slice(l - 1, hidden), a.dweight[static_cast<std::size_t>(l)], Trans::t, Trans::n, stream);
  matmul(g_out, h_slice(layers - 2, hidden), a.dweight[static_cast<std::size_t>(layers - 1)], Trans::t, Trans::n, stream);
}

}  // namespace fk::cuda
