// The unfused GLU epilogue as one memory-bound pass: the path for shapes and GPUs the fused GEMM
// does not take, and the separate activation kernel of the bench baseline ("cuBLAS writes
// C [M, 2N], then one kernel"). C is in the prepared layout, so the flat pair p = m N + j is
// elements (2p, 2p + 1) of C and element p of out and dy: the pass is flat, each thread moving
// 16 bytes of C at a time.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "fusekit/core/cuda_check.hpp"
#include "glu_cuda.hpp"
#include "glu_math.cuh"
#include "ops/common/cuda_common.cuh"

namespace fk::cuda {
namespace {

using fk::device::load_vec;
using fk::device::store_vec;
using fk::device::Vec;

// V elements of C (V / 2 pairs) per step; pairs [0, pairs) in all; n2 = 2N for the bias index.
// c and out are not __restrict__: the backward may write dC over C (glu_backward_from_preact).
// Act (backward only): also act[p] = glu(C's pair p), from the same registers.
template <class T, int V, GluKind K, bool Backward, bool Act = false>
__global__ void glu_pairs_kernel(const T* c, const T* __restrict__ bias, const T* __restrict__ dy, T* out,
                                 std::int64_t pairs, std::int64_t n2, T* __restrict__ act = nullptr) {
  constexpr int P = V / 2;
  const std::int64_t steps = pairs / P;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t s = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; s < steps + (pairs % P);
       s += stride) {
    // Full steps first, then the last pairs % P pairs one at a time.
    const bool full = s < steps;
    const std::int64_t p0 = full ? s * P : steps * P + (s - steps);
    const int np = full ? P : 1;
    Vec<T, V> cv;
    if (full) {
      cv = load_vec<T, V>(c + 2 * p0);
    } else {
      const Vec<T, 2> t2 = load_vec<T, 2>(c + 2 * p0);
      cv.v[0] = t2.v[0];
      cv.v[1] = t2.v[1];
    }
    Vec<T, P> dyv{}, ov{};
    Vec<T, V> dcv{};
    if constexpr (Backward) {
      if (full) dyv = load_vec<T, P>(dy + p0);
      else dyv.v[0] = reinterpret_cast<const typename fk::device::Bits<T>::type*>(dy)[p0];
    }
    std::int64_t col = bias != nullptr ? (2 * p0) % n2 : 0;  // the pair's column in C
#pragma unroll
    for (int q = 0; q < P; ++q) {
      if (q >= np) break;
      float l = cv.get(2 * q), r = cv.get(2 * q + 1);
      if (bias != nullptr) {
        l += fk::device::to_float(bias[col]);
        r += fk::device::to_float(bias[col + 1]);
        col = col + 2 == n2 ? 0 : col + 2;
      }
      if constexpr (Backward) {
        float dl, dr;
        fk::device::glu_grad<K>(l, r, dyv.get(q), dl, dr);
        dcv.set(2 * q, dl);
        dcv.set(2 * q + 1, dr);
        if constexpr (Act) ov.set(q, fk::device::glu<K>(l, r));
      } else {
        ov.set(q, fk::device::glu<K>(l, r));
      }
    }
    if constexpr (Backward) {
      if (full) {
        store_vec<T, V>(out + 2 * p0, dcv);
      } else {
        Vec<T, 2> t2;
        t2.v[0] = dcv.v[0];
        t2.v[1] = dcv.v[1];
        store_vec<T, 2>(out + 2 * p0, t2);
      }
      if constexpr (Act) {
        if (full) store_vec<T, P>(act + p0, ov);
        else reinterpret_cast<typename fk::device::Bits<T>::type*>(act)[p0] = ov.v[0];
      }
    } else {
      if (full) store_vec<T, P>(out + p0, ov);
      else reinterpret_cast<typename fk::device::Bits<T>::type*>(out)[p0] = ov.v[0];
    }
  }
}


}  // namespace

void glu_pairs(const TensorView& c, const TensorView* bias, const TensorView* dy, const TensorView& out,
               GluKind kind, const Stream* stream, const TensorView* act) {
  const std::int64_t pairs = c.numel() / 2, n2 = c.size(1);
  if (pairs == 0) return;
  const fk::detail::DeviceScope on_device(c.device().index);
  const cudaStream_t s = fk::detail::cuda_stream(stream);
  with_float_type(c.dtype(), [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = 16 / sizeof(T);
    const T* cp = static_cast<const T*>(c.data());
    const T* bp = bias ? static_cast<const T*>(bias->data()) : nullptr;
    const T* dp = dy ? static_cast<const T*>(dy->data()) : nullptr;
    T* op = static_cast<T*>(out.data());
    T* ap = dp && act ? static_cast<T*>(act->data()) : nullptr;
    // Vector steps need 16-byte C (and dC) and (V/2)-element-aligned out / dy / act.
    const bool vec = aligned16(cp) && aligned16(op) && (!dp || aligned16(dp)) && (!ap || aligned16(ap));
    const std::int64_t work = vec ? pairs / (V / 2) + pairs % (V / 2) : pairs;
    const int threads = 256;
    const int blocks = static_cast<int>(std::min<std::int64_t>((work + threads - 1) / threads,
                                                               std::int64_t{multiprocessor_count()} * 8));
    fk::device::with_glu_kind(kind, [&](auto k) {
      constexpr GluKind K = decltype(k)::value;
      if (dp && ap) {
        if (vec) glu_pairs_kernel<T, V, K, true, true><<<blocks, threads, 0, s>>>(cp, bp, dp, op, pairs, n2, ap);
        else glu_pairs_kernel<T, 2, K, true, true><<<blocks, threads, 0, s>>>(cp, bp, dp, op, pairs, n2, ap);
      } else if (dp) {
        if (vec) glu_pairs_kernel<T, V, K, true><<<blocks, threads, 0, s>>>(cp, bp, dp, op, pairs, n2);
        else glu_pairs_kernel<T, 2, K, true><<<blocks, threads, 0, s>>>(cp, bp, dp, op, pairs, n2);
      } else {
        if (vec) glu_pairs_kernel<T, V, K, false><<<blocks, threads, 0, s>>>(cp, bp, dp, op, pairs, n2);
        else glu_pairs_kernel<T, 2, K, false><<<blocks, threads, 0, s>>>(cp, bp, dp, op, pairs, n2);
      }
    });
  });
  FK_CUDA_CHECK_LAUNCH("glu_pairs");
}

}  // namespace fk::cuda

namespace fk::cuda {
namespace {

// Column sums of a [rows, cols] matrix, deterministic: block (x, y) sums rows [y R, (y + 1) R) of
// 64 columns into partial[y, :] (8 row lanes, combined in a fixed order), then column_sums_finish
// adds the partials in order.
constexpr int kSumCols = 64, kSumLanes = 8;

template <class T>
__global__ void column_sums_partial(const T* __restrict__ a, float* __restrict__ partial, std::int64_t rows,
                                    std::int64_t cols, std::int64_t rows_per_slab) {
  __shared__ float acc[kSumLanes][kSumCols];
  const int tx = threadIdx.x, ty = threadIdx.y;  // 32 x kSumLanes
  const std::int64_t c0 = static_cast<std::int64_t>(blockIdx.x) * kSumCols + 2 * tx;
  const std::int64_t r_begin = static_cast<std::int64_t>(blockIdx.y) * rows_per_slab;
  const std::int64_t r_end = r_begin + rows_per_slab < rows ? r_begin + rows_per_slab : rows;
  float s0 = 0.f, s1 = 0.f;
  for (std::int64_t r = r_begin + ty; r < r_end; r += kSumLanes) {
    const T* row = a + r * cols;
    if (c0 < cols) s0 += fk::device::to_float(row[c0]);
    if (c0 + 1 < cols) s1 += fk::device::to_float(row[c0 + 1]);
  }
  acc[ty][2 * tx] = s0;
  acc[ty][2 * tx + 1] = s1;
  __syncthreads();
  if (ty == 0) {
    for (int h = 0; h < 2; ++h) {
      const int c = 2 * tx + h;
      float s = 0.f;
#pragma unroll
      for (int l = 0; l < kSumLanes; ++l) s += acc[l][c];
      if (blockIdx.x * kSumCols + c < cols) partial[blockIdx.y * cols + blockIdx.x * kSumCols + c] = s;
    }
  }
}

template <class T>
__global__ void column_sums_finish(const float* __restrict__ partial, T* __restrict__ out, int slabs,
                                   std::int64_t cols) {
  const std::int64_t c = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  float s = 0.f;
  for (int y = 0; y < slabs; ++y) s += partial[y * cols + c];
  out[c] = fk::device::from_float<T>(s);
}

}  // namespace

void column_sums(const TensorView& a, const TensorView& out, const Stream* stream) {
  const std::int64_t rows = a.size(0), cols = a.size(1);
  if (cols == 0) return;
  const fk::detail::DeviceScope on_device(a.device().index);
  const cudaStream_t s = fk::detail::cuda_stream(stream);
  const int col_blocks = static_cast<int>((cols + kSumCols - 1) / kSumCols);
  // Enough row slabs to give every SM a few blocks, none shorter than 64 rows.
  const std::int64_t want = std::max<std::int64_t>(1, 4 * multiprocessor_count() / col_blocks);
  const int slabs = static_cast<int>(std::min<std::int64_t>(want, std::max<std::int64_t>(1, rows / 64)));
  const std::int64_t rows_per_slab = (rows + slabs - 1) / slabs;
  Tensor partial = Tensor::empty({slabs, cols}, DType::f32, a.device(), stream);
  with_float_type(a.dtype(), [&](auto tag) {
    using T = decltype(tag);
    column_sums_partial<T><<<dim3(col_blocks, slabs), dim3(32, kSumLanes), 0, s>>>(
        static_cast<const T*>(a.data()), static_cast<float*>(partial.data()), rows, cols, rows_per_slab);
  });
  FK_CUDA_CHECK_LAUNCH("column_sums");
  with_float_type(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    column_sums_finish<T><<<static_cast<int>((cols + 255) / 256), 256, 0, s>>>(
        static_cast<const float*>(partial.data()), static_cast<T*>(out.data()), slabs, cols);
  });
  FK_CUDA_CHECK_LAUNCH("column_sums");
}

}  // namespace fk::cuda
