// The fused MLP's backward kernel for MLPs whose dW does not fit in shared memory (every g_l
// stored for cuBLAS dW GEMMs, db per warp), the fixed-order sum of the CTAs' db, and their
// launchers. Design: docs/mlp.md.
#include <algorithm>
#include <cstdint>
#include <functional>

#include "fused_mlp.cuh"
#include "fusekit/core/cuda_check.hpp"
#include "ops/common/cuda_common.cuh"

namespace fk::cuda::mlp {
namespace {

// The backward through every layer, 16 rows per warp at a time: the gradients g_l travel down
// the layers in registers (the A fragments of the product with the next weight matrix, held in
// shared memory in its natural [out_l, in_l] layout and read transposed by ldmatrix.trans); each
// g_l is stored once for the dW GEMMs and its column sums (db) kept per warp in shared memory.
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

}  // namespace

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

template int launch_backward<__nv_bfloat16, 16>(MlpBackwardParams, std::size_t, cudaStream_t, float**, const std::function<float*(std::int64_t)>&);
template int launch_backward<__nv_bfloat16, 32>(MlpBackwardParams, std::size_t, cudaStream_t, float**, const std::function<float*(std::int64_t)>&);
template int launch_backward<__nv_bfloat16, 64>(MlpBackwardParams, std::size_t, cudaStream_t, float**, const std::function<float*(std::int64_t)>&);
template int launch_backward<__nv_bfloat16, 128>(MlpBackwardParams, std::size_t, cudaStream_t, float**, const std::function<float*(std::int64_t)>&);
template int launch_backward<__half, 16>(MlpBackwardParams, std::size_t, cudaStream_t, float**, const std::function<float*(std::int64_t)>&);
template int launch_backward<__half, 32>(MlpBackwardParams, std::size_t, cudaStream_t, float**, const std::function<float*(std::int64_t)>&);
template int launch_backward<__half, 64>(MlpBackwardParams, std::size_t, cudaStream_t, float**, const std::function<float*(std::int64_t)>&);
template int launch_backward<__half, 128>(MlpBackwardParams, std::size_t, cudaStream_t, float**, const std::function<float*(std::int64_t)>&);

void launch_bias_grad_sum(const float* part, int blocks, int n_bias, int hidden, int layers, int out, const DbOut& d,
                          cudaStream_t stream) {
  mlp_bias_grad_kernel<<<(n_bias + 127) / 128, 128, 0, stream>>>(part, blocks, n_bias, hidden, layers, out, d);
  FK_CUDA_CHECK_LAUNCH("mlp_bias_grad_kernel");
}

}  // namespace fk::cuda::mlp
