// The fused MLP's forward kernel (inference, and training with the hidden layers stored) and its
// launcher. Design: docs/mlp.md.
#include <algorithm>
#include <cstdint>

#include "fused_mlp.cuh"
#include "fusekit/core/cuda_check.hpp"
#include "ops/common/cuda_common.cuh"

namespace fk::cuda::mlp {
namespace {

// The biases as fp32 into smem [n_pad], zero-padded.
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

}  // namespace

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

template void launch<__nv_bfloat16, 16>(const MlpParams&, std::size_t, cudaStream_t);
template void launch<__nv_bfloat16, 32>(const MlpParams&, std::size_t, cudaStream_t);
template void launch<__nv_bfloat16, 64>(const MlpParams&, std::size_t, cudaStream_t);
template void launch<__nv_bfloat16, 128>(const MlpParams&, std::size_t, cudaStream_t);
template void launch<__half, 16>(const MlpParams&, std::size_t, cudaStream_t);
template void launch<__half, 32>(const MlpParams&, std::size_t, cudaStream_t);
template void launch<__half, 64>(const MlpParams&, std::size_t, cudaStream_t);
template void launch<__half, 128>(const MlpParams&, std::size_t, cudaStream_t);

}  // namespace fk::cuda::mlp
