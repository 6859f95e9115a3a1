// softmax over the last dimension of x [rows, cols] (puzzle 8), numerically stable, with the
// statistics gathered online: one pass keeps a running max m and the sum s of exp(x - m),
// rescaling s by exp(m_old - m_new) whenever the max grows, and (m, s) pairs of different
// threads / CTAs merge the same way (rows.cuh: combine).
//
// Rows of up to kRegisterCapacity (32768) elements: one group of blockDim.x threads per row holds
// the whole row in registers (32 registers of raw data a thread), so x is read once and y
// written once, the floor being those bytes over HBM bandwidth. Each thread takes the max and
// the sum of exp(x - m_local) of its values, the row's threads merge their (m, s) pairs in one
// reduction, and each thread writes exp(x - M) / S from the values it still holds.
//
// Longer rows: the row is split into chunks, one CTA per (row, chunk). A first kernel writes each
// chunk's (m, s); a second merges the row's pairs and re-reads its chunk to write y: x is read
// twice, y written once.
//
// Accesses are 16 bytes when cols % (16 / sizeof(T)) == 0 and x, y are 16-byte aligned, else
// one element (same kernels). y may be x: every element is read before it is written, by the
// thread that writes it.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>

#include "fusekit/core/cuda_check.hpp"
#include "fusekit/core/tensor.hpp"
#include "ops/common/cuda_common.cuh"
#include "primitives_cuda.hpp"
#include "rows.cuh"

namespace fk::cuda {
namespace {

using device::combine;
using device::exp_of_difference;
using device::load_vec;
using device::MaxSum;
using device::MaxSumOp;
using device::row_reduce;
using device::store_vec;
using device::Vec;

constexpr std::int64_t kRegisterCapacity = 32768;  // longest row held in registers by one CTA
constexpr int kSplitThreads = 256;

// Vectors of V elements a thread holds in the register kernel: 32 registers of raw data either
// way (64 16-bit values or 32 fp32 ones), so that a row of kRegisterCapacity takes 512 threads
// (16-bit types) or 1024 (f32), and two CTAs of 512 fit an SM: one loads while the other
// reduces or stores.
template <class T, int V>
inline constexpr int kVectorsPerThread = V == 1 ? 32 : 32 * 4 / (V * static_cast<int>(sizeof(T)));

// blockDim = (threads per row, rows per block). Thread t of a row holds elements
// [(k * blockDim.x + t) * V, + V) for k < K as raw bits (no fp32 copy: the register budget goes
// to holding more of the row), and evaluates the exponential twice: once for its local sum,
// once for the output.
template <class T, int V>
__global__ void __launch_bounds__(1024) softmax_register_kernel(const T* x, T* y, std::int64_t rows, std::int64_t cols) {
  constexpr int K = kVectorsPerThread<T, V>;
  __shared__ MaxSum smem[32];
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool active = row < rows;  // no early return: every thread takes part in the reduction
  const T* xr = x + (active ? row : 0) * cols;
  auto col = [&](int k) { return (static_cast<std::int64_t>(k) * blockDim.x + threadIdx.x) * V; };

  Vec<T, V> raw[K];
  for (int k = 0; k < K; ++k)
    if (active && col(k) < cols) raw[k] = load_vec<T, V>(xr + col(k));
  float m_local = -INFINITY;
  for (int k = 0; k < K; ++k)
    if (active && col(k) < cols)
      for (int j = 0; j < V; ++j) m_local = fmaxf(m_local, raw[k].get(j));
  float s_local = 0.0f;
  if (m_local != -INFINITY)
    for (int k = 0; k < K; ++k)
      if (col(k) < cols)
        for (int j = 0; j < V; ++j) s_local += exp_of_difference(raw[k].get(j) - m_local);
  const MaxSum stats = row_reduce(MaxSum{m_local, s_local}, MaxSumOp{}, MaxSum{-INFINITY, 0.0f}, smem);
  if (!active) return;
  // A row with no finite max (all -inf) gives NaN, as the spec does.
  const bool no_max = stats.m == -INFINITY;
  const float inv = 1.0f / stats.s;
  T* yr = y + row * cols;
  for (int k = 0; k < K; ++k) {
    if (col(k) >= cols) break;
    Vec<T, V> o;
    for (int j = 0; j < V; ++j)
      o.set(j, no_max ? __int_as_float(0x7fffffff) : exp_of_difference(raw[k].get(j) - stats.m) * inv);
    store_vec<T, V>(yr + col(k), o);
  }
}

// Long rows, pass 1: the (max, sum) of chunk blockIdx.y of row blockIdx.x, into
// stats[row * gridDim.y + chunk]. kUnroll vectors are loaded before they are folded in, so that
// several loads of a thread are in flight; the running sum is rescaled once per group.
constexpr int kUnroll = 4;

template <class T, int V>
__global__ void __launch_bounds__(kSplitThreads) softmax_chunk_stats_kernel(const T* x, MaxSum* stats, std::int64_t cols,
                                                                            std::int64_t chunk) {
  __shared__ MaxSum smem[32];
  const std::int64_t row = blockIdx.x;
  const std::int64_t c0 = static_cast<std::int64_t>(blockIdx.y) * chunk, c1 = std::min(cols, c0 + chunk);
  const T* xr = x + row * cols;
  MaxSum run{-INFINITY, 0.0f};
  constexpr std::int64_t kStep = std::int64_t{kSplitThreads} * V;
  for (std::int64_t c = c0 + threadIdx.x * V; c < c1; c += kStep * kUnroll) {
    Vec<T, V> raw[kUnroll];
    for (int u = 0; u < kUnroll; ++u)
      if (c + u * kStep < c1) raw[u] = load_vec<T, V>(xr + c + u * kStep);
    float g = -INFINITY;
    for (int u = 0; u < kUnroll; ++u)
      if (c + u * kStep < c1)
        for (int j = 0; j < V; ++j) g = fmaxf(g, raw[u].get(j));
    if (g == -INFINITY) continue;  // nothing but -inf here: adds nothing
    if (g > run.m) {
      run.s = run.m == -INFINITY ? 0.0f : run.s * exp_of_difference(run.m - g);
      run.m = g;
    }
    for (int u = 0; u < kUnroll; ++u)
      if (c + u * kStep < c1)
        for (int j = 0; j < V; ++j) run.s += exp_of_difference(raw[u].get(j) - run.m);
  }
  const MaxSum total = row_reduce(run, MaxSumOp{}, MaxSum{-INFINITY, 0.0f}, smem);
  if (threadIdx.x == 0) stats[row * gridDim.y + blockIdx.y] = total;
}

// Long rows, pass 2: merge the row's chunk statistics (every CTA of the row merges them in the
// same order, so all agree), then y = exp(x - M) / S over this CTA's chunk.
template <class T, int V>
__global__ void __launch_bounds__(kSplitThreads) softmax_chunk_normalize_kernel(const T* x, T* y, const MaxSum* stats,
                                                                                std::int64_t cols, std::int64_t chunk) {
  __shared__ MaxSum smem[32];
  const std::int64_t row = blockIdx.x;
  MaxSum part{-INFINITY, 0.0f};
  for (unsigned i = threadIdx.x; i < gridDim.y; i += blockDim.x) part = combine(part, stats[row * gridDim.y + i]);
  const MaxSum total = row_reduce(part, MaxSumOp{}, MaxSum{-INFINITY, 0.0f}, smem);
  const bool no_max = total.m == -INFINITY;
  const float inv = 1.0f / total.s;

  const std::int64_t c0 = static_cast<std::int64_t>(blockIdx.y) * chunk, c1 = std::min(cols, c0 + chunk);
  const T* xr = x + row * cols;
  T* yr = y + row * cols;
  constexpr std::int64_t kStep = std::int64_t{kSplitThreads} * V;
  for (std::int64_t c = c0 + threadIdx.x * V; c < c1; c += kStep * kUnroll) {
    Vec<T, V> raw[kUnroll];
    for (int u = 0; u < kUnroll; ++u)
      if (c + u * kStep < c1) raw[u] = load_vec<T, V>(xr + c + u * kStep);
    for (int u = 0; u < kUnroll; ++u) {
      if (c + u * kStep >= c1) break;
      Vec<T, V> o;
      for (int j = 0; j < V; ++j)
        o.set(j, no_max ? __int_as_float(0x7fffffff) : exp_of_difference(raw[u].get(j) - total.m) * inv);
      store_vec<T, V>(yr + c + u * kStep, o);
    }
  }
}

template <class T, int V>
void launch(const T* x, T* y, std::int64_t rows, std::int64_t cols, const Stream* stream, Device dev) {
  const cudaStream_t s = detail::cuda_stream(stream);
  if (cols <= kRegisterCapacity) {
    constexpr int kItems = kVectorsPerThread<T, V> * V;
    int tpr = 32;
    while (std::int64_t{tpr} * kItems < cols) tpr *= 2;
    const int rpb = std::max(1, 256 / tpr);
    const std::int64_t blocks = (rows + rpb - 1) / rpb;
    FK_CHECK_ARG(blocks <= 0x7fffffff, "softmax", "x", "fewer than 2^31 row blocks", std::to_string(rows) + " rows");
    softmax_register_kernel<T, V><<<static_cast<unsigned>(blocks), dim3(tpr, rpb), 0, s>>>(x, y, rows, cols);
    FK_CUDA_CHECK_LAUNCH("softmax_register_kernel");
    return;
  }
  // Enough CTAs to fill the GPU a few times over, each with at least kMinChunk elements.
  constexpr std::int64_t kMinChunk = 8192;
  const std::int64_t want = 4 * static_cast<std::int64_t>(multiprocessor_count());
  const std::int64_t splits =
      std::clamp<std::int64_t>((want + rows - 1) / rows, 1, std::min<std::int64_t>((cols + kMinChunk - 1) / kMinChunk, 65535));
  std::int64_t chunk = (cols + splits - 1) / splits;
  chunk = (chunk + V - 1) / V * V;
  const std::int64_t used = (cols + chunk - 1) / chunk;  // rounding the chunk up may leave the last one empty
  FK_CHECK_ARG(rows <= 0x7fffffff, "softmax", "x", "fewer than 2^31 rows of more than 32768", std::to_string(rows));
  Tensor stats = Tensor::empty({rows * used * 2}, DType::f32, dev, stream);  // (rows, used) MaxSum pairs
  auto* st = reinterpret_cast<MaxSum*>(stats.data_as<float>());
  const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(used));
  softmax_chunk_stats_kernel<T, V><<<grid, kSplitThreads, 0, s>>>(x, st, cols, chunk);
  FK_CUDA_CHECK_LAUNCH("softmax_chunk_stats_kernel");
  softmax_chunk_normalize_kernel<T, V><<<grid, kSplitThreads, 0, s>>>(x, y, st, cols, chunk);
  FK_CUDA_CHECK_LAUNCH("softmax_chunk_normalize_kernel");
}


}  // namespace

void softmax(const TensorView& x, const TensorView& y, const Stream* stream) {
  detail::DeviceScope on_device(x.device().index);
  const std::int64_t rows = x.size(0), cols = x.size(1);
  with_float_type(x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    constexpr int kVec = 16 / sizeof(T);
    const T* xp = x.data_as<T>();
    T* yp = y.data_as<T>();
    if (cols % kVec == 0 && aligned16(xp) && aligned16(yp))
      launch<T, kVec>(xp, yp, rows, cols, stream, x.device());
    else
      launch<T, 1>(xp, yp, rows, cols, stream, x.device());
  });
}

}  // namespace fk::cuda
