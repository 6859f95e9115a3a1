// attention_forward, the simple CUDA kernel: one warp per query row, for every dtype (f32, bf16,
// f16), head_dim 1..256 and GPU. It is the path for what the sm_90 tensor-core kernel does not
// take (puzzle 9's head_dim 1, f32, other head dims, GPUs before sm_90), written to be checked
// at a glance rather than to be fast.
//
// The warp streams the visible keys in chunks of 32, one key a lane: each lane computes its score
// scale * q·k_j in fp32 (q staged once in shared memory), the warp takes the chunk maximum, folds
// it into the running maximum m and sum l (online softmax: l = l e^(m_old - m) + sum_j e^(s_j - m))
// and rescales its output accumulator, then adds p_j v_j, lane c owning columns c, c + 32, ... of
// the output row. Nothing of size Sk is stored. Rows without keys (Sk = 0) get 0 and lse = -inf.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "attention_cuda.hpp"
#include "fusekit/core/cuda_check.hpp"
#include "ops/common/cuda_common.cuh"
#include "ops/common/activations.cuh"

namespace fk::cuda {
namespace {

constexpr int kMaxD = 256, kWarps = 4, kColsPerLane = kMaxD / 32;

template <class T>
__global__ void __launch_bounds__(kWarps * 32)
    attention_rowwise_kernel(const T* __restrict__ q,  // (BH, Sq, D)
                             const T* __restrict__ k,  // (BH, Sk, D)
                             const T* __restrict__ v,  // (BH, Sk, D)
                             T* __restrict__ out,      // (BH, Sq, D)
                             float* __restrict__ lse,  // (BH, Sq)
                             std::int64_t rows, std::int64_t sq, std::int64_t sk, int d, bool causal, float scale) {
  __shared__ float q_row[kWarps][kMaxD];
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kWarps + warp;  // h * Sq + i
  if (row >= rows) return;
  const std::int64_t h = row / sq, i = row % sq;
  const T* qr = q + row * d;
  const T* kh = k + h * sk * d;
  const T* vh = v + h * sk * d;
  for (int c = lane; c < d; c += 32) q_row[warp][c] = device::to_float(qr[c]);
  __syncwarp();

  const std::int64_t visible = causal ? std::min(sk, i + 1) : sk;
  float m = -INFINITY, l = 0.0f, o[kColsPerLane];
#pragma unroll
  for (int t = 0; t < kColsPerLane; ++t) o[t] = 0.0f;
  for (std::int64_t j0 = 0; j0 < visible; j0 += 32) {
    const std::int64_t j = j0 + lane;
    float s = -INFINITY;
    if (j < visible) {
      float dot = 0.0f;
      for (int c = 0; c < d; ++c) dot = fmaf(q_row[warp][c], device::to_float(kh[j * d + c]), dot);
      s = scale * dot;
    }
    float chunk_max = s;
    for (int off = 16; off > 0; off /= 2) chunk_max = fmaxf(chunk_max, __shfl_xor_sync(0xffffffffu, chunk_max, off));
    const float m_new = fmaxf(m, chunk_max);  // finite: key j0 is visible
    const float alpha = expf(m - m_new);      // 0 on the first chunk (m = -inf)
    const float p = expf(s - m_new);          // 0 for keys past the visible ones
    float p_sum = p;
    for (int off = 16; off > 0; off /= 2) p_sum += __shfl_xor_sync(0xffffffffu, p_sum, off);
    l = l * alpha + p_sum;
    m = m_new;
#pragma unroll
    for (int t = 0; t < kColsPerLane; ++t) o[t] *= alpha;
    const int n = static_cast<int>(std::min<std::int64_t>(32, visible - j0));
    for (int jj = 0; jj < n; ++jj) {
      const float pj = __shfl_sync(0xffffffffu, p, jj);
      const T* vr = vh + (j0 + jj) * d;
#pragma unroll
      for (int t = 0; t < kColsPerLane; ++t) {
        const int c = lane + 32 * t;
        if (c < d) o[t] = fmaf(pj, device::to_float(vr[c]), o[t]);
      }
    }
  }
  const float inv = visible > 0 ? 1.0f / l : 0.0f;
#pragma unroll
  for (int t = 0; t < kColsPerLane; ++t) {
    const int c = lane + 32 * t;
    if (c < d) out[row * d + c] = device::from_float<T>(o[t] * inv);
  }
  if (lane == 0) lse[row] = visible > 0 ? m + logf(l) : -INFINITY;
}

}  // namespace

void attention_forward_rowwise(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                               const TensorView& lse, bool causal, float scale, const Stream* stream) {
  fk::detail::DeviceScope on_device(q.device().index);
  const std::int64_t sq = q.size(2), sk = k.size(2), rows = q.size(0) * q.size(1) * sq;
  const int d = static_cast<int>(q.size(3));
  const cudaStream_t s = fk::detail::cuda_stream(stream);
  const auto blocks = static_cast<unsigned>((rows + kWarps - 1) / kWarps);
  with_float_type(q.dtype(), [&](auto zero) {
    using T = decltype(zero);
    attention_rowwise_kernel<T><<<blocks, kWarps * 32, 0, s>>>(q.data_as<T>(), k.data_as<T>(), v.data_as<T>(),
                                                                out.data_as<T>(), lse.data_as<float>(), rows, sq, sk,
                                                                d, causal, scale);
  });
  FK_CUDA_CHECK_LAUNCH("attention_rowwise_kernel");
}

}  // namespace fk::cuda
