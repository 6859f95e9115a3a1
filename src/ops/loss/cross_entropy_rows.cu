// The kernels of linear_cross_entropy between its GEMMs (contracts in loss_cuda.hpp).
//
// cross_entropy_rows: one block per row of the chunk's logits, in the operands' dtype (the GEMM's
// f32 accumulators rounded once, as F.linear's output is). A row of at most 8 16-byte vectors a
// thread (V <= 65536 at 16 bits, 32768 in f32; 128 to 1024 threads) is read once into registers:
// its max, then its sum of exponentials and plain sum (f32, + bias) come from the registers, and
// each element is overwritten in place with the gradient g; the kernel moves the row's bytes once
// each way, the floor of this step. Longer rows take two reads: a running max and sum of
// exponentials, then g. The count of the mean comes from the device (loss_count_targets), so no
// launch waits on the host. The row losses are summed in double in a fixed order by loss_total:
// the loss is deterministic.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "fusekit/core/cuda_check.hpp"
#include "loss_cuda.hpp"
#include "ops/common/activations.cuh"
#include "ops/common/cuda_common.cuh"
#include "ops/common/grid_stride.cuh"

namespace fk::cuda {
namespace {

constexpr int kRowThreads = 256;
constexpr int kReduceThreads = 1024;
constexpr int kWarps = kRowThreads / 32;

// Running (max, Σ exp(x − max)) of two parts merged; an empty part has max −inf.
struct MaxSum {
  float m, s;
};

__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  if (a.m == -INFINITY) return b;
  if (b.m == -INFINITY) return a;
  const float m = fmaxf(a.m, b.m);
  return {m, a.s * __expf(a.m - m) + b.s * __expf(b.m - m)};
}

__device__ __forceinline__ void add(MaxSum& acc, float x) {
  if (x > acc.m) {
    acc.s = acc.s * __expf(acc.m - x) + 1.0f;  // acc.m = −inf: 0 · 0 + 1
    acc.m = x;
  } else {
    acc.s += __expf(x - acc.m);
  }
}

// 16-byte vectors of T: 4 f32 or 8 bf16 / f16 logits.
template <class T>
struct Vec {
  static constexpr int n = 16 / sizeof(T);
  union {
    uint4 raw;
    T e[n];
  };
};

// A row's loss from its statistics (thread 0), and the coefficients of g. zt: the target's logit.
struct RowCoefficients {
  float p, uniform, target;
};

__device__ __forceinline__ float row_loss_value(float lse, float zt, float plain_sum, std::int64_t v, float smoothing,
                                                float zeta) {
  return (1.0f - smoothing) * (lse - zt) + smoothing * (lse - plain_sum / static_cast<float>(v)) + zeta * lse * lse;
}

__device__ __forceinline__ RowCoefficients row_coefficients(float lse, const std::int64_t* status, std::int64_t v,
                                                            float smoothing, float zeta, bool mean) {
  const float scale = mean ? 1.0f / static_cast<float>(status[0]) : 1.0f;
  return {scale * (1.0f + 2.0f * zeta * lse), scale * smoothing / static_cast<float>(v), scale * (1.0f - smoothing)};
}

constexpr int kHeldVectors = 8;  // 16-byte vectors of the row each thread holds

// Σ over the block of one float a thread; every thread gets the total. `part` holds kThreads / 32
// floats and is not reused before the next __syncthreads of the caller.
template <int kThreads, class Op>
__device__ __forceinline__ float block_all_reduce(float x, float* part, Op op) {
  for (int off = 16; off > 0; off >>= 1) x = op(x, __shfl_xor_sync(0xffffffffu, x, off));
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = x;
  __syncthreads();
  float all = part[0];
#pragma unroll
  for (int w = 1; w < kThreads / 32; ++w) all = op(all, part[w]);
  return all;
}

template <class T, int kThreads>
__global__ void __launch_bounds__(kThreads, 1024 / kThreads)
    cross_entropy_rows_held_kernel(T* __restrict__ logits, std::int64_t v, std::int64_t ld, const T* __restrict__ bias,
                                   const std::int64_t* __restrict__ targets, const std::int64_t* __restrict__ status,
                                   float* __restrict__ row_loss, std::int64_t ignore_index, float smoothing, float zeta,
                                   bool mean) {
  constexpr int kVec = Vec<T>::n;
  __shared__ float part_max[kThreads / 32], part_exp[kThreads / 32], part_sum[kThreads / 32];
  __shared__ float target_logit;
  const std::int64_t row = blockIdx.x;
  uint4* z4 = reinterpret_cast<uint4*>(logits + row * ld);
  const std::int64_t t = targets[row];
  const bool ignored = t == ignore_index;
  const bool bad = !ignored && (t < 0 || t >= v);
  const int nvec = static_cast<int>((v + kVec - 1) / kVec);  // <= kThreads * kHeldVectors
  auto logit = [&](T raw, int j) {
    const float x = device::to_float(raw);
    return bias != nullptr ? x + device::to_float(bias[j]) : x;
  };
  Vec<T> x[kHeldVectors];
  float lse = 0.0f, inv_se = 0.0f;
  if (!ignored && !bad) {
#pragma unroll
    for (int i = 0; i < kHeldVectors; ++i) {
      const int q = static_cast<int>(threadIdx.x) + i * kThreads;
      if (q < nvec) x[i].raw = z4[q];
    }
    if (threadIdx.x == 0) target_logit = logit(reinterpret_cast<const T*>(z4)[t], static_cast<int>(t));
    float m = -INFINITY;
#pragma unroll
    for (int i = 0; i < kHeldVectors; ++i) {
      const int q = static_cast<int>(threadIdx.x) + i * kThreads;
#pragma unroll
      for (int e = 0; e < kVec; ++e)
        if (kVec * q + e < v) m = fmaxf(m, logit(x[i].e[e], kVec * q + e));
    }
    m = block_all_reduce<kThreads>(m, part_max, [](float a, float b) { return fmaxf(a, b); });
    // exp(z - m) replaces z in the registers (rounded to T): the gradient pass below scales it
    // by 1 / Σ exp(z - m), so each element costs one exponential (the SFU's throughput, not
    // memory, bounds this kernel at two).
    float se = 0.0f, sum = 0.0f;
#pragma unroll
    for (int i = 0; i < kHeldVectors; ++i) {
      const int q = static_cast<int>(threadIdx.x) + i * kThreads;
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        if (kVec * q + e < v) {
          const float xv = logit(x[i].e[e], kVec * q + e);
          const float ev = __expf(xv - m);
          se += ev;
          sum += xv;
          x[i].e[e] = device::from_float<T>(ev);
        }
      }
    }
    const auto plus = [](float a, float b) { return a + b; };
    se = block_all_reduce<kThreads>(se, part_exp, plus);
    sum = block_all_reduce<kThreads>(sum, part_sum, plus);
    lse = m + logf(se);
    inv_se = 1.0f / se;
    if (threadIdx.x == 0) row_loss[row] = row_loss_value(lse, target_logit, sum, v, smoothing, zeta);
  } else if (threadIdx.x == 0) {
    row_loss[row] = bad ? NAN : 0.0f;
  }
  const RowCoefficients c = row_coefficients(lse, status, v, smoothing, zeta, mean);
  const float p_scale = c.p * inv_se;  // softmax = exp(z - m) / Σ exp(z - m)
#pragma unroll
  for (int i = 0; i < kHeldVectors; ++i) {
    const int q = static_cast<int>(threadIdx.x) + i * kThreads;
    if (q >= nvec) break;
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const int j = kVec * q + e;
      float d = 0.0f;  // padding past v is written 0 (the GEMMs read only [0, v))
      if (j < v) {
        if (bad) {
          d = NAN;
        } else if (!ignored) {
          d = p_scale * device::to_float(x[i].e[e]) - c.uniform - (j == t ? c.target : 0.0f);
        }
      }
      x[i].e[e] = device::from_float<T>(d);
    }
    z4[q] = x[i].raw;
  }
}

template <class T>
__global__ void __launch_bounds__(kRowThreads)
    cross_entropy_rows_kernel(T* __restrict__ logits, std::int64_t v, std::int64_t ld, const T* __restrict__ bias,
                              const std::int64_t* __restrict__ targets, const std::int64_t* __restrict__ status,
                              float* __restrict__ row_loss, std::int64_t ignore_index, float smoothing, float zeta,
                              bool mean) {
  constexpr int kVec = Vec<T>::n;
  __shared__ MaxSum part_ms[kWarps];
  __shared__ float part_sum[kWarps];
  __shared__ float row_stats[2];  // lse, Σ z
  const std::int64_t row = blockIdx.x;
  T* z = logits + row * ld;  // [v]: z in, g out over the same elements
  uint4* z4 = reinterpret_cast<uint4*>(z);
  const std::int64_t t = targets[row];
  const bool ignored = t == ignore_index;
  const bool bad = !ignored && (t < 0 || t >= v);
  const std::int64_t nvec = (v + kVec - 1) / kVec;
  auto logit = [&](T raw, std::int64_t j) {
    const float x = device::to_float(raw);
    return bias != nullptr ? x + device::to_float(bias[j]) : x;
  };
  float lse = 0.0f;
  if (!ignored && !bad) {
    MaxSum ms{-INFINITY, 0.0f};
    float sum = 0.0f;
    for (std::int64_t q = threadIdx.x; q < nvec; q += kRowThreads) {
      Vec<T> x;
      x.raw = z4[q];
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const std::int64_t j = kVec * q + e;
        if (j < v) {
          const float xv = logit(x.e[e], j);
          add(ms, xv);
          sum += xv;
        }
      }
    }
    for (int off = 16; off > 0; off >>= 1) {
      const MaxSum other{__shfl_xor_sync(0xffffffffu, ms.m, off), __shfl_xor_sync(0xffffffffu, ms.s, off)};
      ms = merge(ms, other);
      sum += __shfl_xor_sync(0xffffffffu, sum, off);
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) {
      part_ms[warp] = ms;
      part_sum[warp] = sum;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      MaxSum all = part_ms[0];
      float total = part_sum[0];
      for (int w = 1; w < kWarps; ++w) {
        all = merge(all, part_ms[w]);
        total += part_sum[w];
      }
      row_stats[0] = all.m + logf(all.s);
      row_stats[1] = total;
    }
    __syncthreads();
    lse = row_stats[0];
  }
  if (threadIdx.x == 0) {
    float loss = 0.0f;
    if (bad) {
      loss = NAN;
    } else if (!ignored) {
      const float zt = logit(z[t], t);
      loss = row_loss_value(lse, zt, row_stats[1], v, smoothing, zeta);
    }
    row_loss[row] = loss;
  }
  // z[t] is read before any thread overwrites it.
  __syncthreads();
  const RowCoefficients c = row_coefficients(lse, status, v, smoothing, zeta, mean);
  for (std::int64_t q = threadIdx.x; q < nvec; q += kRowThreads) {
    Vec<T> x;
    x.raw = z4[q];
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const std::int64_t j = kVec * q + e;
      float d = 0.0f;  // padding past v is written 0 (the GEMMs read only [0, v))
      if (j < v) {
        if (bad) {
          d = NAN;
        } else if (!ignored) {
          d = c.p * __expf(logit(x.e[e], j) - lse) - c.uniform - (j == t ? c.target : 0.0f);
        }
      }
      x.e[e] = device::from_float<T>(d);
    }
    z4[q] = x.raw;
  }
}

__global__ void __launch_bounds__(kReduceThreads)
    count_targets_kernel(const std::int64_t* __restrict__ targets, std::int64_t n, std::int64_t v,
                         std::int64_t ignore_index, std::int64_t* __restrict__ status) {
  __shared__ long long counts[kReduceThreads];
  __shared__ long long first_bad[kReduceThreads];
  long long count = 0, bad = n;
  for (std::int64_t i = threadIdx.x; i < n; i += kReduceThreads) {
    const std::int64_t t = targets[i];
    if (t == ignore_index) continue;
    if (t < 0 || t >= v) {
      bad = bad < i ? bad : i;
    } else {
      ++count;
    }
  }
  counts[threadIdx.x] = count;
  first_bad[threadIdx.x] = bad;
  __syncthreads();
  for (int w = kReduceThreads / 2; w > 0; w >>= 1) {
    if (threadIdx.x < w) {
      counts[threadIdx.x] += counts[threadIdx.x + w];
      first_bad[threadIdx.x] = min(first_bad[threadIdx.x], first_bad[threadIdx.x + w]);
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    status[0] = counts[0];
    status[1] = first_bad[0];
  }
}

__global__ void __launch_bounds__(kReduceThreads)
    loss_total_kernel(const float* __restrict__ row_loss, std::int64_t n, const std::int64_t* __restrict__ status,
                      bool mean, float* __restrict__ loss) {
  __shared__ double part[kReduceThreads];
  double acc = 0.0;
  for (std::int64_t i = threadIdx.x; i < n; i += kReduceThreads) acc += static_cast<double>(row_loss[i]);
  part[threadIdx.x] = acc;
  __syncthreads();
  for (int w = kReduceThreads / 2; w > 0; w >>= 1) {
    if (threadIdx.x < w) part[threadIdx.x] += part[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) loss[0] = static_cast<float>(mean ? part[0] / static_cast<double>(status[0]) : part[0]);
}

template <class T>
__global__ void fill_ones_kernel(T* __restrict__ out, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * blockDim.x)
    out[i] = device::from_float<T>(1.0f);
}

}  // namespace

void loss_count_targets(const TensorView& targets, std::int64_t v, std::int64_t ignore_index, const TensorView& status,
                        const Stream* stream) {
  count_targets_kernel<<<1, kReduceThreads, 0, detail::cuda_stream(stream)>>>(
      targets.data_as<const std::int64_t>(), targets.numel(), v, ignore_index, status.data_as<std::int64_t>());
  FK_CUDA_CHECK_LAUNCH("loss_count_targets");
}

void cross_entropy_rows(const CrossEntropyRowsArgs& a, const LinearCrossEntropyParams& p, const Stream* stream) {
  if (a.rows == 0) return;
  const cudaStream_t s = detail::cuda_stream(stream);
  with_float_type(a.grad_dtype, [&](auto ti) {
    using T = decltype(ti);
    const auto launch = [&](auto kernel, int threads) {
      kernel<<<static_cast<unsigned>(a.rows), static_cast<unsigned>(threads), 0, s>>>(
          static_cast<T*>(a.logits), a.v, a.ld, static_cast<const T*>(a.bias), a.targets, a.status, a.row_loss,
          p.ignore_index, p.label_smoothing, p.z_loss, p.reduction == LossReduction::mean);
    };
    const std::int64_t nvec = (a.v + Vec<T>::n - 1) / Vec<T>::n;
    if (nvec <= 128 * kHeldVectors)
      launch(cross_entropy_rows_held_kernel<T, 128>, 128);
    else if (nvec <= 256 * kHeldVectors)
      launch(cross_entropy_rows_held_kernel<T, 256>, 256);
    else if (nvec <= 512 * kHeldVectors)
      launch(cross_entropy_rows_held_kernel<T, 512>, 512);
    else if (nvec <= 1024 * kHeldVectors)
      launch(cross_entropy_rows_held_kernel<T, 1024>, 1024);
    else
      launch(cross_entropy_rows_kernel<T>, kRowThreads);
  });
  FK_CUDA_CHECK_LAUNCH("cross_entropy_rows");
}

void loss_total(const TensorView& row_loss, const TensorView& status, LossReduction reduction, const TensorView& loss,
                const Stream* stream) {
  loss_total_kernel<<<1, kReduceThreads, 0, detail::cuda_stream(stream)>>>(
      row_loss.data_as<const float>(), row_loss.numel(), status.data_as<const std::int64_t>(),
      reduction == LossReduction::mean, loss.data_as<float>());
  FK_CUDA_CHECK_LAUNCH("loss_total");
}

void fill_ones(const TensorView& t, const Stream* stream) {
  if (t.numel() == 0) return;
  with_float_type(t.dtype(), [&](auto ti) {
    using T = decltype(ti);
    fill_ones_kernel<T><<<grid_stride_blocks(t.numel()), 256, 0, detail::cuda_stream(stream)>>>(
        static_cast<T*>(t.data()), t.numel());
  });
  FK_CUDA_CHECK_LAUNCH("fill_ones");
}

}  // namespace fk::cuda
