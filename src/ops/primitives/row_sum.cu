// row_sum (puzzle 7): out[r] = sum_c x[r, c], x [rows, cols], fp32 accumulation.
//
// Reads x once; the floor is its bytes over HBM bandwidth. A group of blockDim.x threads
// (32..256, as the row length asks) sums one row, or one chunk of it: with fewer rows than it
// takes to fill the GPU, each row is split into chunks (grid.y), the CTAs write fp32 partial sums
// [rows, chunks], and a second kernel adds each row's partials in order. Every sum is taken in a
// fixed order (per-thread running sums, then a fixed shuffle tree), so results are the same bits
// on every run of a given shape. Each thread loads kUnroll vectors (16 bytes when cols % V == 0
// and x is 16-byte aligned) before adding them, to keep enough bytes in flight.
#include <algorithm>
#include <cstdint>
#include <string>

#include "fusekit/core/cuda_check.hpp"
#include "fusekit/core/tensor.hpp"
#include "ops/common/cuda_common.cuh"
#include "primitives_cuda.hpp"
#include "rows.cuh"

namespace fk::cuda {
namespace {

using device::from_float;
using device::load_vec;
using device::row_reduce;
using device::SumOp;
using device::Vec;

constexpr int kUnroll = 8;
constexpr int kMaxThreadsPerRow = 256;

// blockDim = (threads per row, rows per block), grid = (row blocks, chunks). Writes the sum of
// chunk blockIdx.y of each row to out[row] when there is one chunk, else to
// partial[row * gridDim.y + chunk].
template <class T, int V, class To>
__global__ void __launch_bounds__(256) row_sum_kernel(const T* x, To* out, float* partial, std::int64_t rows,
                                                      std::int64_t cols, std::int64_t chunk) {
  __shared__ float smem[32];
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool active = row < rows;
  const std::int64_t c0 = static_cast<std::int64_t>(blockIdx.y) * chunk, c1 = std::min(cols, c0 + chunk);
  const T* xr = x + (active ? row : 0) * cols;
  const std::int64_t step = static_cast<std::int64_t>(blockDim.x) * V;
  float acc = 0.0f;
  if (active) {
    for (std::int64_t c = c0 + threadIdx.x * V; c < c1; c += step * kUnroll) {
      Vec<T, V> raw[kUnroll];
      for (int u = 0; u < kUnroll; ++u)
        if (c + u * step < c1) raw[u] = load_vec<T, V>(xr + c + u * step);
      for (int u = 0; u < kUnroll; ++u)
        if (c + u * step < c1)
          for (int j = 0; j < V; ++j) acc += raw[u].get(j);
    }
  }
  acc = row_reduce(acc, SumOp{}, 0.0f, smem);
  if (!active || threadIdx.x != 0) return;
  if (partial)
    partial[row * gridDim.y + blockIdx.y] = acc;
  else
    out[row] = from_float<To>(acc);
}

// out[r] = sum of partial[r, :] in order.
template <class To>
__global__ void row_sum_partials_kernel(const float* partial, int chunks, std::int64_t rows, To* out) {
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= rows) return;
  float acc = 0.0f;
  for (int i = 0; i < chunks; ++i) acc += partial[row * chunks + i];
  out[row] = from_float<To>(acc);
}

template <class T, int V, class To>
void launch(const T* x, To* out, std::int64_t rows, std::int64_t cols, const Stream* stream, Device dev) {
  const cudaStream_t s = detail::cuda_stream(stream);
  // Chunks: enough (row, chunk) groups to fill the GPU several times over, at least kMinChunk
  // elements each; a group of threads per row as wide as its chunk needs (kUnroll vectors a thread).
  constexpr std::int64_t kMinChunk = 8192;
  const std::int64_t want = 8 * static_cast<std::int64_t>(multiprocessor_count());
  const std::int64_t chunks =
      std::clamp<std::int64_t>((want + rows - 1) / rows, 1,
                               std::clamp<std::int64_t>((cols + kMinChunk - 1) / kMinChunk, 1, 65535));
  std::int64_t chunk = (cols + chunks - 1) / chunks;
  chunk = std::max<std::int64_t>((chunk + V - 1) / V * V, V);
  const std::int64_t used = std::max<std::int64_t>((cols + chunk - 1) / chunk, 1);
  int tpr = 32;
  while (tpr < kMaxThreadsPerRow && std::int64_t{tpr} * V * kUnroll < chunk) tpr *= 2;
  const int rpb = 256 / tpr;
  const std::int64_t blocks = (rows + rpb - 1) / rpb;
  FK_CHECK_ARG(blocks <= 0x7fffffff, "row_sum", "x", "fewer than 2^31 row blocks", std::to_string(rows) + " rows");
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(used)), block(tpr, rpb);
  if (used == 1) {
    row_sum_kernel<T, V, To><<<grid, block, 0, s>>>(x, out, nullptr, rows, cols, chunk);
    FK_CUDA_CHECK_LAUNCH("row_sum_kernel");
    return;
  }
  Tensor partial = Tensor::empty({rows, used}, DType::f32, dev, stream);
  row_sum_kernel<T, V, To><<<grid, block, 0, s>>>(x, out, partial.data_as<float>(), rows, cols, chunk);
  FK_CUDA_CHECK_LAUNCH("row_sum_kernel");
  row_sum_partials_kernel<To><<<static_cast<unsigned>((rows + 255) / 256), 256, 0, s>>>(
      partial.data_as<float>(), static_cast<int>(used), rows, out);
  FK_CUDA_CHECK_LAUNCH("row_sum_partials_kernel");
}

}  // namespace

void row_sum(const TensorView& x, const TensorView& out, const Stream* stream) {
  detail::DeviceScope on_device(x.device().index);
  const std::int64_t rows = x.size(0), cols = x.size(1);
  with_float_type(x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    constexpr int kVec = 16 / sizeof(T);
    const T* xp = x.data_as<T>();
    const bool vectorized = cols % kVec == 0 && (reinterpret_cast<std::uintptr_t>(xp) & 15u) == 0;
    auto go = [&](auto* o) {
      if (vectorized)
        launch<T, kVec>(xp, o, rows, cols, stream, x.device());
      else
        launch<T, 1>(xp, o, rows, cols, stream, x.device());
    };
    if (out.dtype() == DType::f32)
      go(out.data_as<float>());
    else
      go(out.data_as<T>());
  });
}

}  // namespace fk::cuda
