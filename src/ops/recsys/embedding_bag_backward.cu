// The embedding-bag backward fused with the optimizer, and the dense optimizer (contracts in
// recsys_cuda.hpp).
//
// The forward left one (key = global row, bag) pair per looked-up entry. They are sorted by key
// (CUB radix sort, stable, over the key bits the table rows need), and the sorted array is cut
// into chunks of 32 entries, one warp each, one entry per lane. A segment (one distinct row) is
// cut by the chunk borders into pieces. Phase 1 sums each piece with a segmented warp scan (every
// lane reads its bag's gradient row once) and: applies the update when the segment lies inside
// the chunk; otherwise stores the piece's sum as the chunk's `tail` (the segment goes on into the
// next chunk) or `head` (a segment from an earlier chunk ends here), and the chunk where a
// crossing segment starts registers itself as its owner. Phase 2: one warp per owner adds
// tail[c0], tail[c0 + 1], ..., head[c1] in a fixed order and applies the update. Dims are handled
// 16 at a time. Each touched table row (and its optimizer state) is read and written once; no
// dense or coalesced gradient exists; every sum has a fixed order, so the result is the same bits
// on every run. Updates: SGD, Adagrad (per element), row-wise Adagrad (one state float per row:
// the row's sum of g^2 is formed in a first pass over the slices, the update in a second, which
// reads the gradient rows again, L2-hot), or, for the unfused reference path, the summed
// gradient stored (=) into a dense gradient buffer. Tables of bf16 or f16: each new value is
// computed in f32 from the stored one and written back stochastically rounded
// (ops/common/stochastic_round.hpp), a lane drawing one Philox block for 8 consecutive elements.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cub/device/device_radix_sort.cuh>

#include <cstdint>
#include <type_traits>

#include "fusekit/core/cuda_check.hpp"
#include "ops/common/cuda_common.cuh"
#include "ops/common/grid_stride.cuh"
#include "ops/common/stochastic_round.hpp"
#include "recsys_cuda.hpp"

namespace fk::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kSlice = 16;

__device__ __forceinline__ void apply_update(float* w, float* state, float g, float lr, float eps) {
  if (state == nullptr) {
    *w -= lr * g;
  } else {
    const float s = *state + g * g;
    *state = s;
    *w -= lr * g / (sqrtf(s) + eps);
  }
}

// The elements of a table of T (float, __nv_bfloat16, __half) that one lane updates, in
// increasing order: values read as floats, new values stored (16-bit: stochastically rounded,
// element at = row * D + c drawing as element at + shift from Philox block (at + shift) / 8 of
// (seed, offset), the block kept for the lane's next elements; shift: set_row's, the row's place
// at the layout's draw bases).
// (Fields copied from the TableSet: a reference to the kernel's parameter would copy the whole
// struct to the stack.)
template <class T>
struct TableElements {
  void* weights;
  std::uint64_t seed = 0, offset = 0;
  std::uint64_t index = ~std::uint64_t{0};
  std::int64_t shift = 0;
  philox::U32x4 block{};

  __device__ __forceinline__ explicit TableElements(const TableSet& ts) : weights(ts.weights) {
    if constexpr (!std::is_same_v<T, float>) {
      seed = ts.seed;
      offset = ts.offset + (ts.offset_counter ? *ts.offset_counter : 0);
    }
  }
  // The draws of the rows of table t (16-bit tables of a layout with draw bases).
  __device__ __forceinline__ void set_table(const TableSet& ts, std::int64_t t) {
    if constexpr (!std::is_same_v<T, float>)
      if (ts.draw_base != nullptr) shift = (ts.draw_base[t] - ts.base[t]) * ts.dim;
  }
  __device__ __forceinline__ float get(std::int64_t at) const {
    if constexpr (std::is_same_v<T, float>) {
      return static_cast<const float*>(weights)[at];
    } else {
      const std::uint32_t b = static_cast<const unsigned short*>(weights)[at];
      if constexpr (std::is_same_v<T, __nv_bfloat16>) return __uint_as_float(b << 16);
      else return __half2float(__ushort_as_half(static_cast<unsigned short>(b)));
    }
  }
  __device__ __forceinline__ void put(std::int64_t at, float v) {
    if constexpr (std::is_same_v<T, float>) {
      static_cast<float*>(weights)[at] = v;
    } else {
      const auto flat = static_cast<std::uint64_t>(at + shift);
      if ((flat >> 3) != index) {
        index = flat >> 3;
        block = philox::random_block(seed, offset, index);
      }
      const std::uint32_t h = sround::draw_bits(block, flat);
      static_cast<unsigned short*>(weights)[at] =
          std::is_same_v<T, __nv_bfloat16> ? sround::to_bf16(v, h) : sround::to_f16(v, h);
    }
  }
  // Stores v[0, n) at elements [at, at + n), n <= kSlice: the (at most three) Philox blocks the
  // elements span drawn first, then an unrolled loop (v indexed by constants stays in registers).
  __device__ __forceinline__ void put_slice(std::int64_t at, const float (&v)[kSlice], int n) {
    const auto first = static_cast<std::uint64_t>(at + shift) >> 3;
    const int lead = static_cast<int>((at + shift) & 7);
    const philox::U32x4 b0 = philox::random_block(seed, offset, first);
    philox::U32x4 b1{}, b2{};
    if (lead + n > 8) b1 = philox::random_block(seed, offset, first + 1);
    if (lead + n > 16) b2 = philox::random_block(seed, offset, first + 2);
#pragma unroll
    for (int i = 0; i < kSlice; ++i) {
      if (i >= n) break;
      const auto flat = static_cast<std::uint64_t>(at + shift + i);
      const auto j = static_cast<unsigned>((flat >> 3) - first);
      const auto pick = [&](int w) { return j == 0 ? b0.v[w] : j == 1 ? b1.v[w] : b2.v[w]; };
      const philox::U32x4 b{{pick(0), pick(1), pick(2), pick(3)}};
      const std::uint32_t h = sround::draw_bits(b, flat);
      static_cast<unsigned short*>(weights)[at + i] =
          std::is_same_v<T, __nv_bfloat16> ? sround::to_bf16(v[i], h) : sround::to_f16(v[i], h);
    }
  }
  // SGD (state null) or element-wise Adagrad on element `at`.
  __device__ __forceinline__ void update(std::int64_t at, float* state, float g, float lr, float eps) {
    if constexpr (std::is_same_v<T, float>) {
      apply_update(static_cast<float*>(weights) + at, state, g, lr, eps);
    } else {
      float w = get(at);
      apply_update(&w, state, g, lr, eps);
      put(at, w);
    }
  }
};

__global__ void optimizer_kernel(float* param, const float* grad, float* state, std::int64_t n, float lr, float eps) {
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n; i += std::int64_t{gridDim.x} * blockDim.x)
    apply_update(param + i, state ? state + i : nullptr, grad[i], lr, eps);
}

// The gradient row of bag q = t * B + b.
__device__ __forceinline__ const float* bag_row(const float* dout, std::uint32_t q, std::int64_t batch,
                                                std::int64_t out_stride, int dim) {
  const std::int64_t t = q / batch, b = q % batch;
  return dout + b * out_stride + t * dim;
}

// v = the slice [s0, s0 + 16) of this lane's gradient row (scaled by 1 / bag size for mean
// pooling), then the inclusive segmented scan over the lanes of this lane's piece (from `start`).
template <bool kMean>
__device__ __forceinline__ void load_scanned(float (&v)[kSlice], const float* src, bool valid, int s0, int dim,
                                             float scale, int lane, int start) {
#pragma unroll
  for (int i = 0; i < kSlice; ++i) {
    v[i] = valid && s0 + i < dim ? src[s0 + i] : 0.0f;
    if constexpr (kMean) v[i] *= scale;
  }
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
#pragma unroll
    for (int i = 0; i < kSlice; ++i) {
      const float u = __shfl_up_sync(0xffffffffu, v[i], off);
      if (lane - off >= start) v[i] += u;
    }
  }
}

template <class T, bool kMean, bool kRowwise>
__global__ void sparse_phase1_kernel(TableSet ts, const std::uint32_t* key, const std::uint32_t* bag, std::int64_t nnz,
                                     std::int64_t chunks, std::int64_t batch, const float* dout,
                                     std::int64_t out_stride, const std::int64_t* mean_offsets, float lr, float eps,
                                     float* head, float* tail, std::uint8_t* ends, int* owners) {
  const int lane = threadIdx.x & 31;
  const std::int64_t c = (blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x) >> 5;
  if (c >= chunks) return;
  const std::int64_t e = c * 32 + lane;
  const bool valid = e < nnz;
  const std::uint32_t row = valid ? key[e] : 0xffffffffu;
  const bool is_head = valid && (e == 0 || key[e - 1] != row);
  const bool next_same = valid && e + 1 < nnz && key[e + 1] == row;
  const unsigned heads = __ballot_sync(0xffffffffu, is_head);
  const unsigned upto = lane == 31 ? 0xffffffffu : ((2u << lane) - 1u);
  const unsigned mine = heads & upto;
  const int start = mine ? 31 - __clz(mine) : 0;  // first lane of this lane's piece
  const bool has_head = mine != 0;
  const bool continues = lane == 31 && next_same;
  const bool piece_end = valid && (lane == 31 || !next_same);
  const float* src = valid ? bag_row(dout, bag[e], batch, out_stride, ts.dim) : nullptr;
  float scale = 1.0f;
  if constexpr (kMean) {
    if (valid) {
      const std::uint32_t q = bag[e];
      scale = 1.0f / static_cast<float>(mean_offsets[q + 1] - mean_offsets[q]);
    }
  }

  if (lane == 0 && has_head) ends[c] = 0;
  if (piece_end && !has_head) ends[c] = continues ? 0 : 1;
  if (continues && has_head) owners[1 + atomicAdd(owners, 1)] = static_cast<int>(c);
  TableElements<T> table(ts);
  if (valid) table.set_table(ts, bag[e] / batch);

  // A lane whose piece is a whole segment (it starts and ends inside the chunk) updates the row.
  if constexpr (!kRowwise) {
    for (int s0 = 0; s0 < ts.dim; s0 += kSlice) {
      float v[kSlice];
      load_scanned<kMean>(v, src, valid, s0, ts.dim, scale, lane, start);
      if (!piece_end) continue;
      if (has_head && !continues) {
        const std::int64_t at = std::int64_t{row} * ts.dim + s0;
        float* st = ts.adagrad_state ? ts.adagrad_state + at : nullptr;
        if constexpr (std::is_same_v<T, float>) {
          for (int i = 0; i < kSlice && s0 + i < ts.dim; ++i) {
            if (ts.store_gradient) table.put(at + i, v[i]);
            else table.update(at + i, st ? st + i : nullptr, v[i], lr, eps);
          }
        } else {  // 16-bit tables take SGD and Adagrad only (the host refuses the gradient stores)
          const int n = min(kSlice, ts.dim - s0);
          float w[kSlice];
#pragma unroll
          for (int i = 0; i < kSlice; ++i) {
            w[i] = 0.0f;
            if (i < n) {
              w[i] = table.get(at + i);
              apply_update(&w[i], st ? st + i : nullptr, v[i], lr, eps);
            }
          }
          table.put_slice(at, w, n);
        }
      } else {
        float* dst = (continues ? tail : head) + c * ts.dim + s0;
        for (int i = 0; i < kSlice && s0 + i < ts.dim; ++i) dst[i] = v[i];
      }
    }
  } else {
    // Row-wise: the row's sum of g^2 first (the pieces of crossing segments stored on the way),
    // then the update, from the gradient rows read again (L2-hot: this warp just read them).
    const bool direct = piece_end && has_head && !continues;
    float sumsq = 0.0f;
    for (int s0 = 0; s0 < ts.dim; s0 += kSlice) {
      float v[kSlice];
      load_scanned<kMean>(v, src, valid, s0, ts.dim, scale, lane, start);
      if (!piece_end) continue;
      if (direct) {
        for (int i = 0; i < kSlice && s0 + i < ts.dim; ++i) sumsq += v[i] * v[i];
      } else {
        float* dst = (continues ? tail : head) + c * ts.dim + s0;
        for (int i = 0; i < kSlice && s0 + i < ts.dim; ++i) dst[i] = v[i];
      }
    }
    float step = 0.0f;
    if (direct) {
      const float s = ts.adagrad_state[row] + sumsq / static_cast<float>(ts.dim);
      ts.adagrad_state[row] = s;
      step = lr / (sqrtf(s) + eps);
    }
    for (int s0 = 0; s0 < ts.dim; s0 += kSlice) {
      float v[kSlice];
      load_scanned<kMean>(v, src, valid, s0, ts.dim, scale, lane, start);
      if (direct) {
        const std::int64_t at = std::int64_t{row} * ts.dim + s0;
        if constexpr (std::is_same_v<T, float>) {
          for (int i = 0; i < kSlice && s0 + i < ts.dim; ++i) table.put(at + i, table.get(at + i) - step * v[i]);
        } else {
          const int n = min(kSlice, ts.dim - s0);
          float w[kSlice];
#pragma unroll
          for (int i = 0; i < kSlice; ++i) w[i] = i < n ? table.get(at + i) - step * v[i] : 0.0f;
          table.put_slice(at, w, n);
        }
      }
    }
  }
}

// One warp per owner: lane l < 16 ends with g = the row's gradient at column s0 + l, summed over
// the pieces tail[c0], ..., tail[c1 - 1], head[c1] in a fixed order (then a fixed butterfly).
__device__ __forceinline__ float owner_slice_sum(const float* head, const float* tail, std::int64_t c0,
                                                 std::int64_t c1, int s0, int dim, int lane) {
  float acc[kSlice] = {};
  for (std::int64_t c = c0 + lane; c <= c1; c += 32) {
    const float* p = (c == c1 ? head : tail) + c * dim + s0;
#pragma unroll
    for (int i = 0; i < kSlice; ++i)
      if (s0 + i < dim) acc[i] += p[i];
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1)
#pragma unroll
    for (int i = 0; i < kSlice; ++i) acc[i] += __shfl_xor_sync(0xffffffffu, acc[i], off);
  float g = 0.0f;
#pragma unroll
  for (int i = 0; i < kSlice; ++i)
    if (i == lane) g = acc[i];
  return g;
}

template <class T, bool kRowwise>
__global__ void sparse_phase2_kernel(TableSet ts, const std::uint32_t* key, std::int64_t chunks, float lr, float eps,
                                     const float* head, const float* tail, const std::uint8_t* ends,
                                     const int* owners) {
  const int lane = threadIdx.x & 31;
  const std::int64_t w = (blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x) >> 5;
  if (w >= owners[0]) return;
  const std::int64_t c0 = owners[1 + w];
  const std::uint32_t row = key[c0 * 32 + 31];
  std::int64_t c1 = -1;
  for (std::int64_t base = c0 + 1; c1 < 0; base += 32) {
    const std::int64_t c = base + lane;
    const unsigned found = __ballot_sync(0xffffffffu, c < chunks && ends[c] != 0);
    if (found) c1 = base + __ffs(found) - 1;
    if (base >= chunks) break;  // unreachable for a consistent phase 1; never loop forever
  }
  if (c1 < 0) return;
  TableElements<T> table(ts);
  if constexpr (!std::is_same_v<T, float>) {
    if (ts.draw_base != nullptr) {  // the row's table: the last whose base is at most the row
      int lo = 0, hi = ts.tables - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (ts.base[mid] <= row) lo = mid;
        else hi = mid - 1;
      }
      table.set_table(ts, lo);
    }
  }
  if constexpr (!kRowwise) {
    for (int s0 = 0; s0 < ts.dim; s0 += kSlice) {
      const float g = owner_slice_sum(head, tail, c0, c1, s0, ts.dim, lane);
      if (lane < kSlice && s0 + lane < ts.dim) {
        const std::int64_t at = std::int64_t{row} * ts.dim + s0 + lane;
        if (ts.store_gradient) table.put(at, g);
        else table.update(at, ts.adagrad_state ? ts.adagrad_state + at : nullptr, g, lr, eps);
      }
    }
  } else {
    // Row-wise: the row's sum of g^2 over every slice first, then the update (sums formed again).
    float sumsq = 0.0f;
    for (int s0 = 0; s0 < ts.dim; s0 += kSlice) {
      const float g = owner_slice_sum(head, tail, c0, c1, s0, ts.dim, lane);
      if (lane < kSlice && s0 + lane < ts.dim) sumsq += g * g;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) sumsq += __shfl_xor_sync(0xffffffffu, sumsq, off);
    const float s = ts.adagrad_state[row] + sumsq / static_cast<float>(ts.dim);
    __syncwarp();  // every lane has read the old state before lane 0 replaces it
    if (lane == 0) ts.adagrad_state[row] = s;
    const float step = lr / (sqrtf(s) + eps);
    for (int s0 = 0; s0 < ts.dim; s0 += kSlice) {
      const float g = owner_slice_sum(head, tail, c0, c1, s0, ts.dim, lane);
      if (lane < kSlice && s0 + lane < ts.dim) {
        const std::int64_t at = std::int64_t{row} * ts.dim + s0 + lane;
        table.put(at, table.get(at) - step * g);
      }
    }
  }
}

template <class T, bool kMean, bool kRowwise>
void launch_sparse_phases(const TableSet& ts, std::int64_t nnz, std::int64_t batch, const float* dout,
                          std::int64_t out_stride, const std::int64_t* mean_offsets, float lr, float eps,
                          const SparseBackwardWorkspace& ws, cudaStream_t s) {
  const std::int64_t chunks = sparse_backward_chunks(nnz);
  const unsigned grid = static_cast<unsigned>((chunks * 32 + kThreads - 1) / kThreads);
  sparse_phase1_kernel<T, kMean, kRowwise><<<grid, kThreads, 0, s>>>(ts, ws.key_sorted, ws.bag_sorted, nnz, chunks,
                                                                     batch, dout, out_stride, mean_offsets, lr, eps,
                                                                     ws.head, ws.tail, ws.ends, ws.owners);
  FK_CUDA_CHECK_LAUNCH("embedding_backward_fused");
  sparse_phase2_kernel<T, kRowwise><<<grid, kThreads, 0, s>>>(ts, ws.key_sorted, chunks, lr, eps, ws.head, ws.tail,
                                                           ws.ends, ws.owners);
  FK_CUDA_CHECK_LAUNCH("embedding_backward_fused");
}

}  // namespace

void optimizer_update(float* param, const float* grad, float* state, std::int64_t n, float lr, float eps,
                      cudaStream_t s) {
  if (n == 0) return;
  optimizer_kernel<<<grid_stride_blocks(n), kThreads, 0, s>>>(param, grad, state, n, lr, eps);
  FK_CUDA_CHECK_LAUNCH("optimizer_update");
}

std::size_t sparse_backward_sort_bytes(std::int64_t nnz) {
  std::size_t bytes = 0;
  FK_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const std::uint32_t*>(nullptr),
                                                static_cast<std::uint32_t*>(nullptr),
                                                static_cast<const std::uint32_t*>(nullptr),
                                                static_cast<std::uint32_t*>(nullptr), static_cast<int>(nnz)));
  return bytes;
}

std::int64_t sparse_backward_chunks(std::int64_t nnz) { return (nnz + 31) / 32; }

void embedding_backward_fused(const TableSet& tables, int key_bits, const std::uint32_t* key,
                              const std::uint32_t* bag, std::int64_t nnz, std::int64_t batch, const float* dout,
                              std::int64_t out_stride, const std::int64_t* mean_offsets, float lr, float eps,
                              const SparseBackwardWorkspace& ws, cudaStream_t s) {
  if (nnz == 0) return;
  std::size_t bytes = ws.sort_temp_bytes;
  FK_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(ws.sort_temp, bytes, key, ws.key_sorted, bag, ws.bag_sorted,
                                                static_cast<int>(nnz), 0, key_bits, s));
  FK_CUDA_CHECK(cudaMemsetAsync(ws.owners, 0, sizeof(int), s));
  const bool mean = mean_offsets != nullptr;
  const auto typed = [&](auto t) {
    using T = decltype(t);
    if (!mean && !tables.rowwise)
      launch_sparse_phases<T, false, false>(tables, nnz, batch, dout, out_stride, mean_offsets, lr, eps, ws, s);
    else if (!mean)
      launch_sparse_phases<T, false, true>(tables, nnz, batch, dout, out_stride, mean_offsets, lr, eps, ws, s);
    else if (!tables.rowwise)
      launch_sparse_phases<T, true, false>(tables, nnz, batch, dout, out_stride, mean_offsets, lr, eps, ws, s);
    else
      launch_sparse_phases<T, true, true>(tables, nnz, batch, dout, out_stride, mean_offsets, lr, eps, ws, s);
  };
  if (tables.dtype == DType::bf16) typed(__nv_bfloat16{});
  else if (tables.dtype == DType::f16) typed(__half{});
  else typed(float{});
}

}  // namespace fk::cuda
