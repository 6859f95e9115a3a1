// RMSNorm forward and backward, the residual add optionally fused in front (norm.hpp gives the
// semantics). Memory-bound: the floor is the bytes each pass moves once over HBM bandwidth.
//
// Forward, rows of up to kForwardCapacity elements: a group of blockDim.x threads per row holds
// the row's s in registers (up to kForwardItems elements a thread, as raw 16-byte vectors), so
// that x (and residual) are read once, residual_out, out and rstd written once; a row's threads
// reduce on their own named barrier (rows.cuh), not the block's; x, residual and the outputs
// move as evict-first 16-byte accesses, the weights as normal ones (every row reads them).
// Backward, rows of up to kBackwardMaxThreads * kBackwardItems elements: one pass per row the
// same way, holding s and dout; each thread also keeps its columns' share of dweight over the
// rows its group visits (the grid is sized to the GPU and strides over the rows), the groups of a
// block sum theirs through shared memory in a fixed order, one partial row per block, and a second
// kernel sums the partials column by column in a fixed order: deterministic, with no atomics.
//
// Longer rows, or rows whose operands cannot be read as 16-byte vectors (cols or a row stride not
// a multiple of the vector, a pointer not 16-byte aligned), go to the "long" kernels: one row at
// a time per block, in two sweeps over the row (the second reads the row again, mostly from L2),
// with elementwise accesses where vectors cannot be used; the backward's partials are then
// accumulated in global memory by the one thread that owns each column of the block's partial row.
#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "fusekit/core/cuda_check.hpp"
#include "fusekit/core/tensor.hpp"
#include "norm_cuda.hpp"
#include "ops/common/activations.cuh"
#include "ops/common/cuda_common.cuh"
#include "ops/primitives/rows.cuh"

namespace fk::cuda {
namespace {

using device::from_float;
using device::load_vec;
using device::row_reduce;
using device::store_vec;
using device::SumOp;
using device::to_float;
using device::Vec;

// Elements of a row one thread holds in the register kernels: the forward holds s (32 registers of
// f32, 16 of a 16-bit type); the backward s, dout and its dweight share (f32), so it holds half as
// many. The backward of 16-bit types fits the 64 registers of 1024-thread blocks; with f32 operands
// it needs more, so its blocks stop at 512 threads and longer rows take the long kernel.
constexpr int kForwardItems = 32;
constexpr int kBackwardItems = 16;
constexpr int kForwardMinThreads = 256;
constexpr int kBackwardMinThreads = 512;
constexpr int kLongThreads = 512;
constexpr std::int64_t kForwardCapacity = std::int64_t{1024} * kForwardItems;
template <class T, class W>
inline constexpr int kBackwardMaxThreads = sizeof(T) == 2 && sizeof(W) == 2 ? 1024 : 512;

// Elements of T in one 16-byte access.
template <class T>
inline constexpr int kVec = 16 / static_cast<int>(sizeof(T));

struct ForwardParams {
  const void* x;         // [rows, cols] row stride ld_x
  const void* residual;  // [rows, cols] row stride ld_r, or null
  const void* weight;    // [cols]
  void* out;             // [rows, cols] row stride ld_out
  void* residual_out;    // [rows, cols] row stride ld_rout, or null
  float* rstd;           // [rows]
  std::int64_t rows, cols, ld_x, ld_r, ld_out, ld_rout;
  float eps, offset;
};

struct BackwardParams {
  const void* dout;           // [rows, cols] row stride ld_dout
  const void* dresidual_out;  // [rows, cols] row stride ld_dr, or null
  const void* s;              // [rows, cols] row stride ld_s
  const void* weight;         // [cols]
  const float* rstd;          // [rows]
  void* dx;                   // [rows, cols] row stride ld_dx
  float* partial;             // [gridDim.x, cols]: each block's share of dweight, or null
  std::int64_t rows, cols, ld_dout, ld_dr, ld_s, ld_dx;
  float offset;
  void* dx_low = nullptr;     // [rows, cols] in dout's dtype, row stride ld_dx_low, or null
  std::int64_t ld_dx_low = 0;
};

// V elements at p as floats: 16-byte accesses where V fills them, one narrower access where V
// divides 16 bytes (the 16-bit operands of f32 rows: 4 elements, 8 bytes), else one element at a
// time. p is aligned to the access (V-element offsets from 16-byte aligned rows).
template <class X, int V>
__device__ __forceinline__ void load_floats(const X* p, float (&f)[V]) {
  constexpr int E = kVec<X>;
  if constexpr (V % E == 0) {
#pragma unroll
    for (int i = 0; i < V / E; ++i) {
      const Vec<X, E> v = load_vec<X, E>(p + i * E);
#pragma unroll
      for (int j = 0; j < E; ++j) f[i * E + j] = v.get(j);
    }
  } else if constexpr (E % V == 0) {
    const Vec<X, V> v = load_vec<X, V>(p);
#pragma unroll
    for (int j = 0; j < V; ++j) f[j] = v.get(j);
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) f[j] = to_float(p[j]);
  }
}

template <class X, int V, bool kStream = false>
__device__ __forceinline__ void store_floats(X* p, const float (&f)[V]) {
  constexpr int E = kVec<X>;
  if constexpr (V % E == 0) {
#pragma unroll
    for (int i = 0; i < V / E; ++i) {
      Vec<X, E> v;
#pragma unroll
      for (int j = 0; j < E; ++j) v.set(j, f[i * E + j]);
      store_vec<X, E, kStream>(p + i * E, v);
    }
  } else if constexpr (E % V == 0) {
    Vec<X, V> v;
#pragma unroll
    for (int j = 0; j < V; ++j) v.set(j, f[j]);
    store_vec<X, V, kStream>(p, v);
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) p[j] = from_float<X>(f[j]);
  }
}

// V elements at p held as raw bits: whole 16-byte vectors, or one narrower access.
template <class X, int V>
__device__ __forceinline__ Vec<X, V> load_raw(const X* p) {
  constexpr int E = kVec<X>;
  static_assert(V % E == 0 || E % V == 0, "load_raw: V is a whole number of 16-byte vectors or divides one");
  if constexpr (E % V == 0) {
    return load_vec<X, V>(p);
  } else {
    Vec<X, V> v;
#pragma unroll
    for (int i = 0; i < V / E; ++i) {
      const Vec<X, E> part = load_vec<X, E>(p + i * E);
#pragma unroll
      for (int j = 0; j < E; ++j) v.v[i * E + j] = part.v[j];
    }
    return v;
  }
}

template <class T>
__device__ __forceinline__ float round_to(float v) { return to_float(from_float<T>(v)); }

// ---------------------------------------------------------------------------------------------
// forward
// ---------------------------------------------------------------------------------------------

// blockDim = (threads per row, rows per block); thread t of a row holds elements
// [(k * blockDim.x + t) * V, + V) for k < K (the launcher's K: as many as the row needs, at most
// kForwardItems / V). X is x's type: T's, or a 16-bit type added to an f32 residual (kAdd only); O
// is out's. Each thread issues all its loads of x (and residual) before using any; 16-bit weights
// are loaded with them, before the reduction, so that their latency (L1 or L2) is not added after
// it, where K <= 3; f32 weights (twice the registers) and K = 4 after it.
template <class X, class T, class W, class O, int V, int K, bool kAdd>
__global__ void __launch_bounds__(1024) rms_norm_forward_kernel(const ForwardParams p) {
  static_assert(kAdd || std::is_same_v<X, T>, "rms_norm_forward_kernel: x is s without a residual");
  static_assert(K >= 1 && K * V <= kForwardItems, "rms_norm_forward_kernel: K vectors of V within kForwardItems");
  constexpr bool kWeightFirst = sizeof(W) == 2 && K <= 3;  // K = 4: at 64 registers they would spill
  __shared__ float smem[32];
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool active = row < p.rows;  // no early return: every thread takes part in the reduction
  const std::int64_t r = active ? row : 0;
  const X* x = static_cast<const X*>(p.x) + r * p.ld_x;
  const W* w = static_cast<const W*>(p.weight);
  auto col = [&](int k) { return (static_cast<std::int64_t>(k) * blockDim.x + threadIdx.x) * V; };

  Vec<T, V> s[K];
  Vec<W, kWeightFirst ? V : 1> wv[kWeightFirst ? K : 1];
  float sum_sq = 0.0f;
  // Every load issued before the first use (zeros past the row), so that their latencies overlap
  // (a use between two loads would make each wait for the one before), where the registers allow
  // it: all but add_rms_norm with an f32 residual or K > 2 (at K = 3, 58 bytes of spills).
  constexpr bool kLoadsFirst = !kAdd || (sizeof(X) == 2 && sizeof(T) == 2 && K <= 2);
  if constexpr (kLoadsFirst) {
    Vec<X, V> xv[K];
    Vec<T, V> rv[kAdd ? K : 1];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const bool in_row = active && col(k) < p.cols;
      xv[k] = in_row ? load_vec<X, V, true>(x + col(k)) : Vec<X, V>{};
      if constexpr (kAdd)
        rv[k] = in_row ? load_vec<T, V, true>(static_cast<const T*>(p.residual) + r * p.ld_r + col(k)) : Vec<T, V>{};
      if constexpr (kWeightFirst) wv[k] = in_row ? load_raw<W, V>(w + col(k)) : Vec<W, V>{};
    }
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if constexpr (kAdd) {
#pragma unroll
        for (int j = 0; j < V; ++j) s[k].set(j, xv[k].get(j) + rv[k].get(j));  // rounded to T, as PyTorch's add
        if (active && col(k) < p.cols) store_vec<T, V, true>(static_cast<T*>(p.residual_out) + r * p.ld_rout + col(k), s[k]);
      } else {
        s[k] = xv[k];
      }
#pragma unroll
      for (int j = 0; j < V; ++j) sum_sq = fmaf(s[k].get(j), s[k].get(j), sum_sq);
    }
  } else {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (!active || col(k) >= p.cols) continue;
      const Vec<X, V> xv = load_vec<X, V, true>(x + col(k));
      const Vec<T, V> res = load_vec<T, V, true>(static_cast<const T*>(p.residual) + r * p.ld_r + col(k));
#pragma unroll
      for (int j = 0; j < V; ++j) s[k].set(j, xv.get(j) + res.get(j));  // rounded to T, as PyTorch's add
      store_vec<T, V, true>(static_cast<T*>(p.residual_out) + r * p.ld_rout + col(k), s[k]);
      if constexpr (kWeightFirst) wv[k] = load_raw<W, V>(w + col(k));
#pragma unroll
      for (int j = 0; j < V; ++j) sum_sq = fmaf(s[k].get(j), s[k].get(j), sum_sq);
    }
  }
  sum_sq = row_reduce(sum_sq, SumOp{}, 0.0f, smem);
  if (!active) return;
  const float rstd = rsqrtf(sum_sq / static_cast<float>(p.cols) + p.eps);
  if (threadIdx.x == 0) p.rstd[row] = rstd;
  O* out = static_cast<O*>(p.out) + row * p.ld_out;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    if (col(k) >= p.cols) break;
    float wk[V], o[V];
    if constexpr (kWeightFirst) {
#pragma unroll
      for (int j = 0; j < V; ++j) wk[j] = wv[k].get(j);
    } else {
      load_floats<W, V>(w + col(k), wk);
    }
#pragma unroll
    for (int j = 0; j < V; ++j) o[j] = (s[k].get(j) * rstd) * (wk[j] + p.offset);
    store_floats<O, V, true>(out + col(k), o);
  }
}

// One row per block, two sweeps: the sum of squares (writing residual_out), then out from s read
// again (from residual_out, which this thread wrote, for add_rms_norm).
template <class X, class T, class W, class O, int V, bool kAdd>
__global__ void __launch_bounds__(kLongThreads) rms_norm_forward_long_kernel(const ForwardParams p) {
  static_assert(kAdd || std::is_same_v<X, T>, "rms_norm_forward_long_kernel: x is s without a residual");
  __shared__ float smem[32];
  const std::int64_t row = blockIdx.x;
  const X* x = static_cast<const X*>(p.x) + row * p.ld_x;
  T* rout = kAdd ? static_cast<T*>(p.residual_out) + row * p.ld_rout : nullptr;
  const std::int64_t step = std::int64_t{blockDim.x} * V;
  float sum_sq = 0.0f;
  for (std::int64_t c = std::int64_t{threadIdx.x} * V; c < p.cols; c += step) {
    float v[V];
    load_floats<X, V>(x + c, v);
    if constexpr (kAdd) {
      float res[V];
      load_floats<T, V>(static_cast<const T*>(p.residual) + row * p.ld_r + c, res);
#pragma unroll
      for (int j = 0; j < V; ++j) v[j] = round_to<T>(v[j] + res[j]);
      store_floats<T, V>(rout + c, v);
    }
#pragma unroll
    for (int j = 0; j < V; ++j) sum_sq = fmaf(v[j], v[j], sum_sq);
  }
  sum_sq = row_reduce(sum_sq, SumOp{}, 0.0f, smem);
  const float rstd = rsqrtf(sum_sq / static_cast<float>(p.cols) + p.eps);
  if (threadIdx.x == 0) p.rstd[row] = rstd;
  const T* s = nullptr;
  if constexpr (kAdd) s = rout;
  else s = x;
  const W* w = static_cast<const W*>(p.weight);
  O* out = static_cast<O*>(p.out) + row * p.ld_out;
  for (std::int64_t c = std::int64_t{threadIdx.x} * V; c < p.cols; c += step) {
    float v[V], wk[V], o[V];
    load_floats<T, V>(s + c, v);
    load_floats<W, V>(w + c, wk);
#pragma unroll
    for (int j = 0; j < V; ++j) o[j] = (v[j] * rstd) * (wk[j] + p.offset);
    store_floats<O, V>(out + c, o);
  }
}

// ---------------------------------------------------------------------------------------------
// backward
// ---------------------------------------------------------------------------------------------

// blockDim = (threads per row, rows per block), the layout of the forward kernel; the grid strides
// over groups of blockDim.y rows. dw_smem holds one value per (thread, j) for the block's sum of
// its row groups' dweight shares.
template <class T, class W, class O, int V>
__global__ void __launch_bounds__(kBackwardMaxThreads<T, W>) rms_norm_backward_kernel(const BackwardParams p) {
  constexpr int K = kBackwardItems / V;
  __shared__ float smem[32];
  __shared__ float dw_smem[kBackwardMaxThreads<T, W> * V];
  auto col = [&](int k) { return (static_cast<std::int64_t>(k) * blockDim.x + threadIdx.x) * V; };
  const W* w = static_cast<const W*>(p.weight);
  float dw[K][V];
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int j = 0; j < V; ++j) dw[k][j] = 0.0f;

  const std::int64_t step = static_cast<std::int64_t>(gridDim.x) * blockDim.y;
  for (std::int64_t base = static_cast<std::int64_t>(blockIdx.x) * blockDim.y; base < p.rows; base += step) {
    const std::int64_t row = base + threadIdx.y;
    const bool active = row < p.rows;  // every thread takes part in the reduction
    const std::int64_t r = active ? row : 0;
    const float rstd = p.rstd[r];
    const T* sr = static_cast<const T*>(p.s) + r * p.ld_s;
    const O* dr = static_cast<const O*>(p.dout) + r * p.ld_dout;
    const T* rr = p.dresidual_out ? static_cast<const T*>(p.dresidual_out) + r * p.ld_dr : nullptr;
    Vec<T, V> s[K], dres[K];
    Vec<O, V> dout[K];
    float dot = 0.0f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (!active || col(k) >= p.cols) continue;
      s[k] = load_vec<T, V>(sr + col(k));
      dout[k] = load_raw<O, V>(dr + col(k));
      if (rr) dres[k] = load_vec<T, V>(rr + col(k));  // issued with the others, not after the reduction
      float wk[V];
      load_floats<W, V>(w + col(k), wk);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float xhat = s[k].get(j) * rstd, d = dout[k].get(j);
        dot = fmaf(d * (wk[j] + p.offset), xhat, dot);
        dw[k][j] = fmaf(d, xhat, dw[k][j]);
      }
    }
    dot = row_reduce(dot, SumOp{}, 0.0f, smem);
    if (!active) continue;
    const float mean = dot / static_cast<float>(p.cols);
    T* dx = static_cast<T*>(p.dx) + row * p.ld_dx;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (col(k) >= p.cols) break;
      float wk[V], ds[V];
      load_floats<W, V>(w + col(k), wk);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float xhat = s[k].get(j) * rstd, g = dout[k].get(j) * (wk[j] + p.offset);
        ds[j] = rstd * (g - xhat * mean);
      }
      if (rr) {
#pragma unroll
        for (int j = 0; j < V; ++j) ds[j] += dres[k].get(j);
      }
      store_floats<T, V>(dx + col(k), ds);
      if (p.dx_low) store_floats<O, V>(static_cast<O*>(p.dx_low) + row * p.ld_dx_low + col(k), ds);
    }
  }
  if (!p.partial) return;
  // The block's rows groups summed in the order of threadIdx.y, one k at a time.
  const int me = static_cast<int>(threadIdx.y * blockDim.x + threadIdx.x);
#pragma unroll
  for (int k = 0; k < K; ++k) {
    __syncthreads();
#pragma unroll
    for (int j = 0; j < V; ++j) dw_smem[me * V + j] = dw[k][j];
    __syncthreads();
    if (threadIdx.y == 0 && col(k) < p.cols) {
      float total[V];
#pragma unroll
      for (int j = 0; j < V; ++j) total[j] = 0.0f;
      for (unsigned y = 0; y < blockDim.y; ++y)
#pragma unroll
        for (int j = 0; j < V; ++j) total[j] += dw_smem[(y * blockDim.x + threadIdx.x) * V + j];
      store_floats<float, V>(p.partial + static_cast<std::int64_t>(blockIdx.x) * p.cols + col(k), total);
    }
  }
}

// One row at a time per block (the grid strides over the rows), two sweeps: mean_n(g * x^), then
// dx; the block's share of dweight accumulates in its partial row, each element owned by one
// thread.
template <class T, class W, class O, int V>
__global__ void __launch_bounds__(kLongThreads) rms_norm_backward_long_kernel(const BackwardParams p) {
  __shared__ float smem[32];
  const W* w = static_cast<const W*>(p.weight);
  const std::int64_t step = std::int64_t{blockDim.x} * V;
  float* partial = p.partial ? p.partial + static_cast<std::int64_t>(blockIdx.x) * p.cols : nullptr;
  for (std::int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const bool first = row == blockIdx.x;
    const float rstd = p.rstd[row];
    const T* sr = static_cast<const T*>(p.s) + row * p.ld_s;
    const O* dr = static_cast<const O*>(p.dout) + row * p.ld_dout;
    float dot = 0.0f;
    for (std::int64_t c = std::int64_t{threadIdx.x} * V; c < p.cols; c += step) {
      float s[V], d[V], wk[V];
      load_floats<T, V>(sr + c, s);
      load_floats<O, V>(dr + c, d);
      load_floats<W, V>(w + c, wk);
#pragma unroll
      for (int j = 0; j < V; ++j) dot = fmaf(d[j] * (wk[j] + p.offset), s[j] * rstd, dot);
    }
    dot = row_reduce(dot, SumOp{}, 0.0f, smem);
    const float mean = dot / static_cast<float>(p.cols);
    T* dx = static_cast<T*>(p.dx) + row * p.ld_dx;
    for (std::int64_t c = std::int64_t{threadIdx.x} * V; c < p.cols; c += step) {
      float s[V], d[V], wk[V], ds[V];
      load_floats<T, V>(sr + c, s);
      load_floats<O, V>(dr + c, d);
      load_floats<W, V>(w + c, wk);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float xhat = s[j] * rstd;
        ds[j] = rstd * (d[j] * (wk[j] + p.offset) - xhat * mean);
      }
      if (p.dresidual_out) {
        float add[V];
        load_floats<T, V>(static_cast<const T*>(p.dresidual_out) + row * p.ld_dr + c, add);
#pragma unroll
        for (int j = 0; j < V; ++j) ds[j] += add[j];
      }
      store_floats<T, V>(dx + c, ds);
      if (p.dx_low) store_floats<O, V>(static_cast<O*>(p.dx_low) + row * p.ld_dx_low + c, ds);
      if (partial) {
#pragma unroll
        for (int j = 0; j < V; ++j) partial[c + j] = (first ? 0.0f : partial[c + j]) + d[j] * (s[j] * rstd);
      }
    }
  }
}

// dweight[c] = sum over b of partial[b, c], in the order of b (blockDim = (32, 16)).
template <class W>
__global__ void __launch_bounds__(512) dweight_reduce_kernel(const float* partial, int parts, std::int64_t cols,
                                                             W* dweight) {
  __shared__ float sums[16][33];
  const std::int64_t c = static_cast<std::int64_t>(blockIdx.x) * 32 + threadIdx.x;
  float t = 0.0f;
  if (c < cols)
    for (int b = static_cast<int>(threadIdx.y); b < parts; b += static_cast<int>(blockDim.y))
      t += partial[static_cast<std::int64_t>(b) * cols + c];
  sums[threadIdx.y][threadIdx.x] = t;
  __syncthreads();
  if (threadIdx.y != 0 || c >= cols) return;
  float total = 0.0f;
  for (unsigned y = 0; y < blockDim.y; ++y) total += sums[y][threadIdx.x];
  dweight[c] = from_float<W>(total);
}

// ---------------------------------------------------------------------------------------------
// launchers
// ---------------------------------------------------------------------------------------------

// A [rows, cols] view's row stride (any value does for a single row).
std::int64_t row_stride(const TensorView& t) { return t.size(0) > 1 ? t.strides()[0] : t.size(1); }

// Whether every operand can be read and written as 16-byte vectors of V elements of x's type:
// cols and each row stride multiples of V, each pointer 16-byte aligned.
bool vectors_fit(int v, std::int64_t cols, std::initializer_list<const TensorView*> rows,
                 std::initializer_list<const TensorView*> vectors) {
  if (cols % v != 0) return false;
  for (const TensorView* t : rows)
    if (t && (!aligned16(t->data()) || row_stride(*t) % v != 0)) return false;
  for (const TensorView* t : vectors)
    if (t && !aligned16(t->data())) return false;
  return true;
}

void check_grid(const char* op, std::int64_t blocks, std::int64_t rows) {
  FK_CHECK_ARG(blocks <= 0x7fffffff, op, "x", "fewer than 2^31 row blocks", std::to_string(rows) + " rows");
}

// Calls f(T{}, W{}) for the supported pairs: W = T, or W = float for the 16-bit T.
template <class F>
void with_norm_types(DType x, DType weight, F&& f) {
  with_float_type(x, [&](auto t) {
    using T = decltype(t);
    if (weight == x) return f(T{}, T{});
    if constexpr (!std::is_same_v<T, float>) return f(T{}, float{});
    throw_internal("rms_norm: weight dtype not checked by the caller");
  });
}

// The register kernel with K vectors a thread, blockDim.x = tpr: 16-bit rows (V = 8) take 2 or 3
// vectors a thread (tpr the least power of two from 32 that covers the row so), 4 only for rows
// over 1024 * 24 elements; f32 rows 8 (tpr covering the row with kForwardItems a thread). H100,
// bf16 rows of 768 (65536 rows) and 2048 (16384): 3 and 2 vectors with the weights loaded first
// took 72.7 and 50.5 µs where 4 vectors with the weights after the reduction took 76.6 and 55.8.
template <class X, class T, class W, class O, bool kAdd>
void launch_forward_registers(const ForwardParams& p, cudaStream_t s, const char* op) {
  constexpr int V = kVec<T>, kMaxK = kForwardItems / V;
  int tpr = 32, k = kMaxK;
  if constexpr (kMaxK == 4) {
    while (tpr < 1024 && std::int64_t{tpr} * V * 3 < p.cols) tpr *= 2;
    k = static_cast<int>(std::clamp<std::int64_t>((p.cols + std::int64_t{tpr} * V - 1) / (std::int64_t{tpr} * V), 2, 4));
  } else {
    while (std::int64_t{tpr} * kForwardItems < p.cols) tpr *= 2;
  }
  const int rpb = std::max(1, kForwardMinThreads / tpr);
  const std::int64_t blocks = (p.rows + rpb - 1) / rpb;
  check_grid(op, blocks, p.rows);
  const dim3 block(tpr, rpb), grid(static_cast<unsigned>(blocks));
  if constexpr (kMaxK == 4) {
    if (k == 2) return rms_norm_forward_kernel<X, T, W, O, V, 2, kAdd><<<grid, block, 0, s>>>(p);
    if (k == 3) return rms_norm_forward_kernel<X, T, W, O, V, 3, kAdd><<<grid, block, 0, s>>>(p);
  }
  rms_norm_forward_kernel<X, T, W, O, V, kMaxK, kAdd><<<grid, block, 0, s>>>(p);
}

template <class X, class T, class W, class O, bool kAdd>
void launch_forward(const ForwardParams& p, bool vec, cudaStream_t s) {
  constexpr int V = kVec<T>;
  const char* op = kAdd ? "add_rms_norm_forward" : "rms_norm_forward";
  if (vec && p.cols <= kForwardCapacity) {
    launch_forward_registers<X, T, W, O, kAdd>(p, s, op);
    FK_CUDA_CHECK_LAUNCH("rms_norm_forward_kernel");
    return;
  }
  check_grid(op, p.rows, p.rows);
  if (vec)
    rms_norm_forward_long_kernel<X, T, W, O, V, kAdd><<<static_cast<unsigned>(p.rows), kLongThreads, 0, s>>>(p);
  else
    rms_norm_forward_long_kernel<X, T, W, O, 1, kAdd><<<static_cast<unsigned>(p.rows), kLongThreads, 0, s>>>(p);
  FK_CUDA_CHECK_LAUNCH("rms_norm_forward_long_kernel");
}

template <class T, class W, class O>
void launch_backward(BackwardParams p, bool vec, const TensorView* dweight, Device dev, const Stream* stream) {
  constexpr int V = kVec<T>;
  const cudaStream_t s = detail::cuda_stream(stream);
  void (*kernel)(BackwardParams) = nullptr;
  int tpr = kLongThreads, rpb = 1;
  const bool in_registers = vec && p.cols <= std::int64_t{kBackwardMaxThreads<T, W>} * kBackwardItems;
  if (in_registers) {
    kernel = rms_norm_backward_kernel<T, W, O, V>;
    tpr = 32;
    while (std::int64_t{tpr} * kBackwardItems < p.cols) tpr *= 2;
    rpb = std::max(1, std::min(kBackwardMinThreads, kBackwardMaxThreads<T, W>) / tpr);
  } else {
    kernel = vec ? rms_norm_backward_long_kernel<T, W, O, V> : rms_norm_backward_long_kernel<T, W, O, 1>;
  }
  int per_sm = 0;
  FK_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, tpr * rpb, 0));
  const std::int64_t groups = (p.rows + rpb - 1) / rpb;
  const std::int64_t grid =
      std::clamp<std::int64_t>(std::int64_t{multiprocessor_count()} * std::max(per_sm, 1), 1, groups);
  Tensor partial;
  if (dweight) {
    partial = Tensor::empty({grid, p.cols}, DType::f32, dev, stream);
    p.partial = partial.data_as<float>();
  }
  kernel<<<static_cast<unsigned>(grid), dim3(tpr, rpb), 0, s>>>(p);
  FK_CUDA_CHECK_LAUNCH(in_registers ? "rms_norm_backward_kernel" : "rms_norm_backward_long_kernel");
  if (!dweight) return;
  const std::int64_t col_blocks = (p.cols + 31) / 32;
  check_grid("rms_norm_backward", col_blocks, p.cols);
  dweight_reduce_kernel<W><<<static_cast<unsigned>(col_blocks), dim3(32, 16), 0, s>>>(
      p.partial, static_cast<int>(grid), p.cols, static_cast<W*>(dweight->data()));
  FK_CUDA_CHECK_LAUNCH("dweight_reduce_kernel");
}

}  // namespace

void rms_norm_forward(const RmsNormForwardArgs& a, const RmsNormParams& prm, const Stream* stream) {
  const bool add = a.residual.has_value();
  const ForwardParams p{a.x.data(),
                        add ? a.residual->data() : nullptr,
                        a.weight.data(),
                        a.out.data(),
                        add ? a.residual_out->data() : nullptr,
                        a.rstd.data_as<float>(),
                        a.x.size(0),
                        a.x.size(1),
                        row_stride(a.x),
                        add ? row_stride(*a.residual) : 0,
                        row_stride(a.out),
                        add ? row_stride(*a.residual_out) : 0,
                        prm.eps,
                        prm.offset};
  const TensorView* r = add ? &*a.residual : nullptr;
  const TensorView* rout = add ? &*a.residual_out : nullptr;
  const cudaStream_t s = detail::cuda_stream(stream);
  const DType s_dtype = add ? a.residual->dtype() : a.x.dtype();
  with_norm_types(s_dtype, a.weight.dtype(), [&](auto t, auto w) {
    using T = decltype(t);
    using W = decltype(w);
    const bool vec = vectors_fit(kVec<T>, p.cols, {&a.x, r, &a.out, rout}, {&a.weight});
    if constexpr (std::is_same_v<T, float>) {  // f32 rows: out of any float type, x too with a residual
      with_float_type(a.out.dtype(), [&](auto o) {
        using O = decltype(o);
        if (!add) return launch_forward<T, T, W, O, false>(p, vec, s);
        with_float_type(a.x.dtype(), [&](auto xt) { launch_forward<decltype(xt), T, W, O, true>(p, vec, s); });
      });
    } else if (add) {
      launch_forward<T, T, W, W, true>(p, vec, s);
    } else {
      launch_forward<T, T, W, W, false>(p, vec, s);
    }
  });
}

void rms_norm_backward(const RmsNormBackwardArgs& a, const RmsNormParams& prm, const Stream* stream) {
  const bool add = a.dresidual_out.has_value();
  const BackwardParams p{a.dout.data(),
                         add ? a.dresidual_out->data() : nullptr,
                         a.s.data(),
                         a.weight.data(),
                         a.rstd.data_as<float>(),
                         a.dx.data(),
                         nullptr,
                         a.s.size(0),
                         a.s.size(1),
                         row_stride(a.dout),
                         add ? row_stride(*a.dresidual_out) : 0,
                         row_stride(a.s),
                         row_stride(a.dx),
                         prm.offset,
                         a.dx_low ? a.dx_low->data() : nullptr,
                         a.dx_low ? row_stride(*a.dx_low) : 0};
  const TensorView* dr = add ? &*a.dresidual_out : nullptr;
  const TensorView* dw = a.dweight ? &*a.dweight : nullptr;
  const TensorView* low = a.dx_low ? &*a.dx_low : nullptr;
  with_norm_types(a.s.dtype(), a.weight.dtype(), [&](auto t, auto w) {
    using T = decltype(t);
    using W = decltype(w);
    const bool vec = vectors_fit(kVec<T>, p.cols, {&a.dout, dr, &a.s, &a.dx, low}, {&a.weight, dw});
    if constexpr (std::is_same_v<T, float>) {  // f32 rows: dout of any float type
      with_float_type(a.dout.dtype(), [&](auto o) { launch_backward<T, W, decltype(o)>(p, vec, dw, a.s.device(), stream); });
    } else {
      launch_backward<T, W, W>(p, vec, dw, a.s.device(), stream);
    }
  });
}

}  // namespace fk::cuda
