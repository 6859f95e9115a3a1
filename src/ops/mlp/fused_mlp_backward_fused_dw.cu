// The fused MLP's backward kernel with dW and db accumulated on chip (the MLPs whose fp32 dW
// fits in shared memory), the fixed-order sum of the CTAs' dW, and their launchers. Design:
// docs/mlp.md.
#include <cstdint>

#include "fused_mlp.cuh"
#include "fusekit/core/cuda_check.hpp"

namespace fk::cuda::mlp {
namespace {

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

}  // namespace

template <class T, int H>
void launch_backward_fused_dw(const MlpFusedDwParams& fp, int blocks, std::size_t smem, cudaStream_t stream) {
  auto* kernel = fused_mlp_backward_fused_dw_kernel<T, H>;
  FK_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  kernel<<<blocks, kThreads, smem, stream>>>(fp);
  FK_CUDA_CHECK_LAUNCH("fused_mlp_backward_fused_dw_kernel");
}

template void launch_backward_fused_dw<__nv_bfloat16, 16>(const MlpFusedDwParams&, int, std::size_t, cudaStream_t);
template void launch_backward_fused_dw<__nv_bfloat16, 32>(const MlpFusedDwParams&, int, std::size_t, cudaStream_t);
template void launch_backward_fused_dw<__nv_bfloat16, 64>(const MlpFusedDwParams&, int, std::size_t, cudaStream_t);
template void launch_backward_fused_dw<__nv_bfloat16, 128>(const MlpFusedDwParams&, int, std::size_t, cudaStream_t);
template void launch_backward_fused_dw<__half, 16>(const MlpFusedDwParams&, int, std::size_t, cudaStream_t);
template void launch_backward_fused_dw<__half, 32>(const MlpFusedDwParams&, int, std::size_t, cudaStream_t);
template void launch_backward_fused_dw<__half, 64>(const MlpFusedDwParams&, int, std::size_t, cudaStream_t);
template void launch_backward_fused_dw<__half, 128>(const MlpFusedDwParams&, int, std::size_t, cudaStream_t);

void launch_weight_grad_sum(const float* part, int blocks, int total, int layers, const DwOut& d, cudaStream_t stream) {
  mlp_weight_grad_kernel<<<(total + 255) / 256, 256, 0, stream>>>(part, blocks, total, layers, d);
  FK_CUDA_CHECK_LAUNCH("mlp_weight_grad_kernel");
}

}  // namespace fk::cuda::mlp
