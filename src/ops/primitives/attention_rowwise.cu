// attention_forward and attention_backward, the simple CUDA kernels: one warp per query row (the
// forward and dq) or per key row (dk and dv), for every dtype (f32, bf16, f16), head_dim 1..256,
// every AttentionOptions (grouped-query heads, causal top-left or bottom-right, sliding window,
// softcap) and GPU. They are the path for what the sm_90 tensor-core kernel does not take (puzzle
// 9's head_dim 1, f32, other head dims, the options, GPUs before sm_90, packed batches) and for
// the backward where the tensor-core one does not apply (f32, other head dims), written to be
// checked at a glance rather than to be fast. Dense [B, H, S, D] batches and packed (varlen) ones
// alike (attention_layout.cuh): a warp per row of the grid's B x H x max_seqlen rows, the rows
// past a sequence's length leaving at once.
//
// Forward: the warp streams the visible keys of its row in chunks of 32, one key a lane: each lane
// computes its score in fp32 (q staged once in shared memory), the warp takes the chunk maximum,
// folds it into the running maximum m and sum l (online softmax: l = l e^(m_old - m) +
// sum_j e^(s_j - m)) and rescales its output accumulator, then adds p_j v_j, lane c owning columns
// c, c + 32, ... of the output row. Nothing of size Sk is stored. Rows without keys get 0 and
// lse = -inf.
// Backward, two passes, nothing of size [Sq, Sk] stored: (1) a warp per query row: delta =
// rowsum(dout ⊙ out), then over its visible keys, one a lane: p = exp(s - lse), dp = dout · v_j,
// dS = p (dp - delta) s' scale, and dq += dS k_j; (2) a warp per key row of a k/v head: over the
// q heads of its group and the queries that see the key, one a lane: p and dS again (delta from
// pass 1), dv += p dout_i, dk += dS q_i.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "attention_cuda.hpp"
#include "attention_layout.cuh"
#include "fusekit/core/cuda_check.hpp"
#include "ops/common/cuda_common.cuh"
#include "ops/common/activations.cuh"

namespace fk::cuda {
namespace {

constexpr int kWarps = 4, kMaxD = 256, kColsPerLane = kMaxD / 32;

// The head dim and options of one call, by value into the kernels.
struct Geometry {
  int d;
  bool causal, bottom_right;
  std::int64_t window_left, window_right;
  float scale, softcap;

  // The keys [lo, hi) query i of a sequence of sq queries and sk keys sees (AttentionOptions' rule).
  __device__ void keys(std::int64_t i, std::int64_t sq, std::int64_t sk, std::int64_t& lo, std::int64_t& hi) const {
    const std::int64_t offset = bottom_right ? sk - sq : 0;
    const std::int64_t right = causal ? 0 : window_right;
    lo = window_left >= 0 ? max(std::int64_t{0}, i + offset - window_left) : 0;
    hi = right >= 0 ? min(sk, i + offset + right + 1) : sk;
    if (hi < lo) hi = lo;
  }
  // The score from the raw scale * q·k, and its derivative with respect to the raw one.
  __device__ float capped(float raw) const { return softcap > 0.0f ? softcap * tanhf(raw / softcap) : raw; }
  __device__ float slope(float raw) const {
    if (softcap <= 0.0f) return 1.0f;
    const float t = tanhf(raw / softcap);
    return 1.0f - t * t;
  }
};

template <class T>
__device__ float dot_row(const float* a, const T* b, int d) {
  float s = 0.0f;
  for (int c = 0; c < d; ++c) s = fmaf(a[c], device::to_float(b[c]), s);
  return s;
}

template <class T>
__device__ float warp_dot(const T* a, const T* b, int d, int lane) {
  float s = 0.0f;
  for (int c = lane; c < d; c += 32) s = fmaf(device::to_float(a[c]), device::to_float(b[c]), s);
  for (int off = 16; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffffu, s, off);
  return s;
}

// A query row of the grid: grid row (b H + h) L.sq + i.
struct QueryRow {
  std::int64_t b, h, i;
};
// h = bh - b H and i = row - bh Sq (not remainders), so that the dense rows' (b H + h) Sq + i fold
// back to row.
__device__ QueryRow query_row(std::int64_t row, const Layout& L) {
  const std::int64_t bh = row / L.sq, b = bh / L.heads;
  return {b, bh - b * L.heads, row - bh * L.sq};
}

template <class T, bool kPacked>
__global__ void __launch_bounds__(kWarps * 32)
    attention_rowwise_kernel(const T* __restrict__ q,  // dense (B H, Sq, D); packed (total_q, H, D)
                             const T* __restrict__ k,  // dense (B Hk, Sk, D); packed (total_k, Hk, D)
                             const T* __restrict__ v,  // like k
                             T* __restrict__ out,      // like q
                             float* __restrict__ lse,  // dense (B H, Sq); packed (H, total_q)
                             std::int64_t rows, Layout L, Geometry g) {
  __shared__ float q_row[kWarps][kMaxD];
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kWarps + warp;
  if (row >= rows) return;
  const QueryRow r = query_row(row, L);
  const auto s = L.seq<kPacked>(r.b);
  if (r.i >= s.sq) return;  // packed: past this sequence's queries
  const std::int64_t kvh = r.h / (L.heads / L.kv_heads), qr = s.q_row(r.h, r.i);
  const int d = g.d;
  const T* kh = k + s.kv_row(kvh, 0) * d;  // key j at kh + j * kv_step
  const T* vh = v + s.kv_row(kvh, 0) * d;
  const std::int64_t kv_step = s.kv_tok() * d;
  for (int c = lane; c < d; c += 32) q_row[warp][c] = device::to_float(q[qr * d + c]);
  __syncwarp();

  std::int64_t lo, hi;
  g.keys(r.i, s.sq, s.sk, lo, hi);
  float m = -INFINITY, l = 0.0f, o[kColsPerLane];
#pragma unroll
  for (int t = 0; t < kColsPerLane; ++t) o[t] = 0.0f;
  for (std::int64_t j0 = lo; j0 < hi; j0 += 32) {
    const std::int64_t j = j0 + lane;
    const float sc = j < hi ? g.capped(g.scale * dot_row(q_row[warp], kh + j * kv_step, d)) : -INFINITY;
    float chunk_max = sc;
    for (int off = 16; off > 0; off /= 2) chunk_max = fmaxf(chunk_max, __shfl_xor_sync(0xffffffffu, chunk_max, off));
    const float m_new = fmaxf(m, chunk_max);  // finite: key j0 is visible
    const float alpha = expf(m - m_new);      // 0 on the first chunk (m = -inf)
    const float p = expf(sc - m_new);         // 0 for keys past the visible ones
    float p_sum = p;
    for (int off = 16; off > 0; off /= 2) p_sum += __shfl_xor_sync(0xffffffffu, p_sum, off);
    l = l * alpha + p_sum;
    m = m_new;
#pragma unroll
    for (int t = 0; t < kColsPerLane; ++t) o[t] *= alpha;
    const int n = static_cast<int>(min(std::int64_t{32}, hi - j0));
    for (int jj = 0; jj < n; ++jj) {
      const float pj = __shfl_sync(0xffffffffu, p, jj);
      const T* vr = vh + (j0 + jj) * kv_step;
#pragma unroll
      for (int t = 0; t < kColsPerLane; ++t) {
        const int c = lane + 32 * t;
        if (c < d) o[t] = fmaf(pj, device::to_float(vr[c]), o[t]);
      }
    }
  }
  const bool any = hi > lo;
  const float inv = any ? 1.0f / l : 0.0f;
#pragma unroll
  for (int t = 0; t < kColsPerLane; ++t) {
    const int c = lane + 32 * t;
    if (c < d) out[qr * d + c] = device::from_float<T>(o[t] * inv);
  }
  if (lane == 0) lse[s.stat(r.h, r.i)] = any ? m + logf(l) : -INFINITY;
}

// Pass 1: delta and dq, a warp per query row.
template <class T, bool kPacked>
__global__ void __launch_bounds__(kWarps * 32)
    attention_dq_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                        const T* __restrict__ out, const T* __restrict__ dout, const float* __restrict__ lse,
                        T* __restrict__ dq, float* __restrict__ delta, std::int64_t rows, Layout L, Geometry g) {
  __shared__ float q_row[kWarps][kMaxD], do_row[kWarps][kMaxD];
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kWarps + warp;
  if (row >= rows) return;
  const QueryRow r = query_row(row, L);
  const auto s = L.seq<kPacked>(r.b);
  if (r.i >= s.sq) return;
  const std::int64_t kvh = r.h / (L.heads / L.kv_heads), qr = s.q_row(r.h, r.i), st = s.stat(r.h, r.i);
  const int d = g.d;
  const T* kh = k + s.kv_row(kvh, 0) * d;
  const T* vh = v + s.kv_row(kvh, 0) * d;
  const std::int64_t kv_step = s.kv_tok() * d;
  for (int c = lane; c < d; c += 32) {
    q_row[warp][c] = device::to_float(q[qr * d + c]);
    do_row[warp][c] = device::to_float(dout[qr * d + c]);
  }
  __syncwarp();
  const float dl = warp_dot(dout + qr * d, out + qr * d, d, lane);
  if (lane == 0) delta[st] = dl;
  const float li = lse[st];
  std::int64_t lo, hi;
  g.keys(r.i, s.sq, s.sk, lo, hi);
  float acc[kColsPerLane];
#pragma unroll
  for (int t = 0; t < kColsPerLane; ++t) acc[t] = 0.0f;
  for (std::int64_t j0 = lo; j0 < hi; j0 += 32) {
    const std::int64_t j = j0 + lane;
    float ds = 0.0f;
    if (j < hi) {
      const float raw = g.scale * dot_row(q_row[warp], kh + j * kv_step, d);
      const float p = expf(g.capped(raw) - li);
      ds = p * (dot_row(do_row[warp], vh + j * kv_step, d) - dl) * g.slope(raw) * g.scale;
    }
    const int n = static_cast<int>(min(std::int64_t{32}, hi - j0));
    for (int jj = 0; jj < n; ++jj) {
      const float dsj = __shfl_sync(0xffffffffu, ds, jj);
      const T* kr = kh + (j0 + jj) * kv_step;
#pragma unroll
      for (int t = 0; t < kColsPerLane; ++t) {
        const int c = lane + 32 * t;
        if (c < d) acc[t] = fmaf(dsj, device::to_float(kr[c]), acc[t]);
      }
    }
  }
#pragma unroll
  for (int t = 0; t < kColsPerLane; ++t) {
    const int c = lane + 32 * t;
    if (c < d) dq[qr * d + c] = device::from_float<T>(acc[t]);
  }
}

// Pass 2: dk and dv, a warp per key row of a k/v head (grid row (b Hk + kh) L.sk + j), over the
// q heads of its group and every query of its sequence that sees the key.
template <class T, bool kPacked>
__global__ void __launch_bounds__(kWarps * 32)
    attention_dkdv_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                          const T* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,
                          T* __restrict__ dk, T* __restrict__ dv, std::int64_t kv_rows, Layout L, Geometry g) {
  __shared__ float k_row[kWarps][kMaxD], v_row[kWarps][kMaxD];
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kWarps + warp;
  if (row >= kv_rows) return;
  const std::int64_t bkh = row / L.sk, j = row % L.sk;
  const std::int64_t b = bkh / L.kv_heads, kh = bkh % L.kv_heads, group = L.heads / L.kv_heads;
  const auto s = L.seq<kPacked>(b);
  if (j >= s.sk) return;  // packed: past this sequence's keys
  const std::int64_t kr = s.kv_row(kh, j);
  const int d = g.d;
  for (int c = lane; c < d; c += 32) {
    k_row[warp][c] = device::to_float(k[kr * d + c]);
    v_row[warp][c] = device::to_float(v[kr * d + c]);
  }
  __syncwarp();
  float dk_acc[kColsPerLane], dv_acc[kColsPerLane];
#pragma unroll
  for (int t = 0; t < kColsPerLane; ++t) dk_acc[t] = dv_acc[t] = 0.0f;
  for (std::int64_t h = kh * group; h < (kh + 1) * group; ++h) {
    for (std::int64_t i0 = 0; i0 < s.sq; i0 += 32) {
      const std::int64_t i = i0 + lane;
      float p = 0.0f, ds = 0.0f;
      if (i < s.sq) {
        std::int64_t lo, hi;
        g.keys(i, s.sq, s.sk, lo, hi);
        if (lo <= j && j < hi) {
          const std::int64_t qi = s.q_row(h, i) * d;
          float dot = 0.0f, dp = 0.0f;
          for (int c = 0; c < d; ++c) {
            dot = fmaf(device::to_float(q[qi + c]), k_row[warp][c], dot);
            dp = fmaf(device::to_float(dout[qi + c]), v_row[warp][c], dp);
          }
          const float raw = g.scale * dot;
          p = expf(g.capped(raw) - lse[s.stat(h, i)]);
          ds = p * (dp - delta[s.stat(h, i)]) * g.slope(raw) * g.scale;
        }
      }
      const int n = static_cast<int>(min(std::int64_t{32}, s.sq - i0));
      for (int ii = 0; ii < n; ++ii) {
        const float pi = __shfl_sync(0xffffffffu, p, ii), dsi = __shfl_sync(0xffffffffu, ds, ii);
        if (pi == 0.0f && dsi == 0.0f) continue;  // not visible (or an underflowed weight): adds nothing
        const std::int64_t qi = s.q_row(h, i0 + ii) * d;
#pragma unroll
        for (int t = 0; t < kColsPerLane; ++t) {
          const int c = lane + 32 * t;
          if (c < d) {
            dv_acc[t] = fmaf(pi, device::to_float(dout[qi + c]), dv_acc[t]);
            dk_acc[t] = fmaf(dsi, device::to_float(q[qi + c]), dk_acc[t]);
          }
        }
      }
    }
  }
#pragma unroll
  for (int t = 0; t < kColsPerLane; ++t) {
    const int c = lane + 32 * t;
    if (c < d) {
      dk[kr * d + c] = device::from_float<T>(dk_acc[t]);
      dv[kr * d + c] = device::from_float<T>(dv_acc[t]);
    }
  }
}

Geometry geometry(const TensorView& q, const AttentionOptions& opt) {
  return {static_cast<int>(q.size(q.rank() - 1)), opt.causal, opt.bottom_right, opt.window_left, opt.window_right,
          opt.scale, opt.softcap};
}

unsigned blocks_for(std::int64_t rows) { return static_cast<unsigned>((rows + kWarps - 1) / kWarps); }

// f(std::bool_constant<packed>) for the layout's kind.
template <class F>
void with_layout_kind(const AttentionVarlen* varlen, F&& f) {
  if (varlen) f(std::true_type{});
  else f(std::false_type{});
}

}  // namespace

void attention_forward_rowwise(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                               const TensorView& lse, const AttentionVarlen* varlen, const AttentionOptions& opt,
                               const Stream* stream) {
  fk::detail::DeviceScope on_device(q.device().index);
  const Layout L = layout_of(q, k, varlen);
  const std::int64_t rows = L.batch * L.heads * L.sq;
  if (rows == 0) return;
  const cudaStream_t s = fk::detail::cuda_stream(stream);
  const Geometry g = geometry(q, opt);
  with_float_type(q.dtype(), [&](auto zero) {
    using T = decltype(zero);
    with_layout_kind(varlen, [&](auto packed) {
      attention_rowwise_kernel<T, decltype(packed)::value><<<blocks_for(rows), kWarps * 32, 0, s>>>(
          q.data_as<T>(), k.data_as<T>(), v.data_as<T>(), out.data_as<T>(), lse.data_as<float>(), rows, L, g);
    });
  });
  FK_CUDA_CHECK_LAUNCH("attention_rowwise_kernel");
}

void attention_backward_rowwise(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                                const TensorView& dout, const TensorView& lse, const TensorView& dq,
                                const TensorView& dk, const TensorView& dv, const TensorView& delta,
                                const AttentionVarlen* varlen, const AttentionOptions& opt, const Stream* stream) {
  fk::detail::DeviceScope on_device(q.device().index);
  const Layout L = layout_of(q, k, varlen);
  const std::int64_t rows = L.batch * L.heads * L.sq, kv_rows = L.batch * L.kv_heads * L.sk;
  const cudaStream_t s = fk::detail::cuda_stream(stream);
  const Geometry g = geometry(q, opt);
  with_float_type(q.dtype(), [&](auto zero) {
    using T = decltype(zero);
    with_layout_kind(varlen, [&](auto packed) {
      constexpr bool kPacked = decltype(packed)::value;
      if (rows > 0)
        attention_dq_kernel<T, kPacked><<<blocks_for(rows), kWarps * 32, 0, s>>>(
            q.data_as<T>(), k.data_as<T>(), v.data_as<T>(), out.data_as<T>(), dout.data_as<T>(),
            lse.data_as<float>(), dq.data_as<T>(), delta.data_as<float>(), rows, L, g);
      FK_CUDA_CHECK_LAUNCH("attention_dq_kernel");
      if (kv_rows > 0)
        attention_dkdv_kernel<T, kPacked><<<blocks_for(kv_rows), kWarps * 32, 0, s>>>(
            q.data_as<T>(), k.data_as<T>(), v.data_as<T>(), dout.data_as<T>(), lse.data_as<float>(),
            delta.data_as<float>(), dk.data_as<T>(), dv.data_as<T>(), kv_rows, L, g);
      FK_CUDA_CHECK_LAUNCH("attention_dkdv_kernel");
    });
  });
}

}  // namespace fk::cuda
