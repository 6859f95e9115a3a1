// The whole MLP in one kernel (see ops/mlp.hpp), in the manner of tiny-cuda-nn's FullyFusedMLP.
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
// Assumes: bf16 or f16; checks (shapes, widths, shared-memory budget) done by mlp.cpp.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "fusekit/core/cuda_check.hpp"
#include "mlp_cuda.hpp"
#include "ops/cuda_common.cuh"
#include "ops/pointwise/activations.cuh"

namespace fk::cuda {
namespace {

constexpr int kThreads = kMlpWarps * 32;
using u16 = unsigned short;

struct MlpParams {
  const u16* x;     // [batch, in]
  u16* y;           // [batch, out]
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

}  // namespace

std::size_t fused_mlp_smem_limit() {
  int dev = 0, bytes = 0;
  FK_CUDA_CHECK(cudaGetDevice(&dev));
  FK_CUDA_CHECK(cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  return static_cast<std::size_t>(bytes);
}

void fused_mlp_forward(const FusedMlpForwardArgs& a, const Stream* stream) {
  const fk::detail::DeviceScope on_device(a.x.device().index);
  MlpParams p{};
  p.x = a.x.data_as<const u16>();
  p.y = a.y.data_as<u16>();
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
  const std::size_t smem = fused_mlp_smem_bytes(p.in, hidden, p.out, p.layers);
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

}  // namespace fk::cuda
