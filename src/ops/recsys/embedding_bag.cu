// Table-batched embedding-bag forward (contracts in recsys_cuda.hpp).
//
// Fused: every (table, sample) bag of every table in one launch, the raw value's hash computed in
// the kernel (one-hot input) or the CSR bag walked (multi-hot), sum or mean pooling, the pooled
// row written straight into its strided destination (DLRM's Z), and the (key, bag) pairs the fused
// backward sorts written in the same pass: each table row a bag touches is read once, each pooled
// row written once. Mapping: D / Vec threads per bag (Vec = 4 floats when D, the output stride and
// the pointers allow 16-byte accesses), consecutive threads on consecutive columns of a bag, so a
// row read is one coalesced segment. The baseline (`embedding_forward_table`) is the same lookup
// for one table per launch, one thread per output element, as a per-table EmbeddingBag runs.
// Tables of bf16 or f16 are read into the same f32 sums (Vec = 4 values, an 8-byte access).
// Assumes rows in range (CSR input is validated on the host by the caller) and < 2^32 rows in all.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "fusekit/core/cuda_check.hpp"
#include "ops/common/cuda_common.cuh"
#include "ops/common/grid_stride.cuh"
#include "recsys_cuda.hpp"

namespace fk::cuda {

namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ std::int64_t hash_row(std::uint32_t v, std::int64_t rows, RowHash hash) {
  const std::uint64_t x = hash == RowHash::seed ? std::uint64_t{v} + 1 : std::uint64_t{v};
  return static_cast<std::int64_t>(x % static_cast<std::uint64_t>(rows));
}

__device__ __forceinline__ float from_bits(std::uint32_t b, __nv_bfloat16) { return __uint_as_float(b << 16); }
__device__ __forceinline__ float from_bits(std::uint32_t b, __half) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(b)));
}

// Vec consecutive values of a table row as floats (Vec = 4: one 16- or 8-byte access).
template <class T, int Vec>
__device__ __forceinline__ void load_row(const T* src, float (&v)[Vec]) {
  if constexpr (std::is_same_v<T, float>) {
    if constexpr (Vec == 4) {
      const float4 x = __ldg(reinterpret_cast<const float4*>(src));
      v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w;
    } else {
      v[0] = __ldg(src);
    }
  } else if constexpr (Vec == 4) {
    const uint2 x = __ldg(reinterpret_cast<const uint2*>(src));
    v[0] = from_bits(x.x & 0xffffu, T{}), v[1] = from_bits(x.x >> 16, T{});
    v[2] = from_bits(x.y & 0xffffu, T{}), v[3] = from_bits(x.y >> 16, T{});
  } else {
    v[0] = from_bits(__ldg(reinterpret_cast<const unsigned short*>(src)), T{});
  }
}

template <class T, int Vec, bool kMean>
__global__ void embedding_fused_kernel(TableSet ts, const std::uint32_t* raw, RowHash hash,
                                       const std::int64_t* indices, const std::int64_t* offsets, std::int64_t batch,
                                       float* out, std::int64_t out_stride, std::uint32_t* key, std::uint32_t* bag) {
  const int lanes = ts.dim / Vec;
  const std::int64_t bags = batch * ts.tables;
  const std::int64_t gid = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
  const std::int64_t q = gid / lanes;
  const int part = static_cast<int>(gid % lanes);
  if (q >= bags) return;
  const int t = static_cast<int>(q / batch);
  const std::int64_t b = q % batch;
  float* dst = out + b * out_stride + std::int64_t{t} * ts.dim + part * Vec;
  const std::int64_t base = ts.base[t];
  if (raw != nullptr) {
    const std::int64_t row = base + hash_row(raw[q], ts.rows[t], hash);
    if (part == 0 && key != nullptr) {
      key[q] = static_cast<std::uint32_t>(row);
      bag[q] = static_cast<std::uint32_t>(q);
    }
    float v[Vec];
    load_row<T, Vec>(static_cast<const T*>(ts.weights) + row * ts.dim + part * Vec, v);
    if constexpr (Vec == 4) *reinterpret_cast<float4*>(dst) = make_float4(v[0], v[1], v[2], v[3]);
    else *dst = v[0];
    return;
  }
  float acc[Vec] = {};
  for (std::int64_t k = offsets[q]; k < offsets[q + 1]; ++k) {
    const std::int64_t row = base + indices[k];
    if (part == 0 && key != nullptr) {
      key[k] = static_cast<std::uint32_t>(row);
      bag[k] = static_cast<std::uint32_t>(q);
    }
    float v[Vec];
    load_row<T, Vec>(static_cast<const T*>(ts.weights) + row * ts.dim + part * Vec, v);
#pragma unroll
    for (int i = 0; i < Vec; ++i) acc[i] += v[i];
  }
  if constexpr (kMean) {
    const std::int64_t n = offsets[q + 1] - offsets[q];
    if (n > 0)
#pragma unroll
      for (int i = 0; i < Vec; ++i) acc[i] /= static_cast<float>(n);
  }
#pragma unroll
  for (int i = 0; i < Vec; ++i) dst[i] = acc[i];
}

__global__ void embedding_table_kernel(const float* table, int dim, int t, const std::int64_t* indices,
                                       const std::int64_t* offsets, std::int64_t batch, float* out,
                                       std::int64_t out_stride, bool mean) {
  const std::int64_t gid = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
  const std::int64_t b = gid / dim;
  const int d = static_cast<int>(gid % dim);
  if (b >= batch) return;
  const std::int64_t q = t * batch + b;
  float acc = 0.0f;
  const std::int64_t begin = offsets[q], end = offsets[q + 1];
  for (std::int64_t k = begin; k < end; ++k) acc += table[indices[k] * dim + d];
  if (mean && end > begin) acc /= static_cast<float>(end - begin);
  out[b * out_stride + std::int64_t{t} * dim + d] = acc;
}

__global__ void embedding_keys_kernel(TableSet ts, const std::int64_t* indices, const std::int64_t* offsets,
                                      std::int64_t batch, std::uint32_t* key, std::uint32_t* bag) {
  const std::int64_t q = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
  if (q >= batch * ts.tables) return;
  const std::int64_t base = ts.base[q / batch];
  for (std::int64_t k = offsets[q]; k < offsets[q + 1]; ++k) {
    key[k] = static_cast<std::uint32_t>(base + indices[k]);
    bag[k] = static_cast<std::uint32_t>(q);
  }
}

}  // namespace

void embedding_forward_fused(const TableSet& tables, const std::uint32_t* raw, RowHash hash,
                             const std::int64_t* indices, const std::int64_t* offsets, std::int64_t batch, float* out,
                             std::int64_t out_stride, bool mean, std::uint32_t* key, std::uint32_t* bag,
                             cudaStream_t s) {
  const bool vec = tables.dim % 4 == 0 && out_stride % 4 == 0 && aligned16(out) && aligned16(tables.weights);
  const std::int64_t threads = batch * tables.tables * (vec ? tables.dim / 4 : tables.dim);
  if (threads == 0) return;
  const auto launch = [&](auto kernel) {
    kernel<<<grid_stride_blocks(threads), kThreads, 0, s>>>(tables, raw, hash, indices, offsets, batch, out, out_stride,
                                                            key, bag);
  };
  // Mean pooling divides by the bag size, which raw input (one row a bag) never needs.
  const bool divide = mean && raw == nullptr;
  const auto typed = [&](auto t) {
    using T = decltype(t);
    if (vec) divide ? launch(embedding_fused_kernel<T, 4, true>) : launch(embedding_fused_kernel<T, 4, false>);
    else divide ? launch(embedding_fused_kernel<T, 1, true>) : launch(embedding_fused_kernel<T, 1, false>);
  };
  if (tables.dtype == DType::bf16) typed(__nv_bfloat16{});
  else if (tables.dtype == DType::f16) typed(__half{});
  else typed(float{});
  FK_CUDA_CHECK_LAUNCH("embedding_forward_fused");
}

void embedding_forward_table(const float* table, int dim, int t, const std::int64_t* indices,
                             const std::int64_t* offsets, std::int64_t batch, float* out, std::int64_t out_stride,
                             bool mean, cudaStream_t s) {
  if (batch * dim == 0) return;
  embedding_table_kernel<<<grid_stride_blocks(batch * dim), kThreads, 0, s>>>(table, dim, t, indices, offsets, batch,
                                                                              out, out_stride, mean);
  FK_CUDA_CHECK_LAUNCH("embedding_forward_table");
}

void embedding_keys(const TableSet& tables, const std::int64_t* indices, const std::int64_t* offsets,
                    std::int64_t batch, std::uint32_t* key, std::uint32_t* bag, cudaStream_t s) {
  if (batch * tables.tables == 0) return;
  embedding_keys_kernel<<<grid_stride_blocks(batch * tables.tables), kThreads, 0, s>>>(tables, indices, offsets,
                                                                                       batch, key, bag);
  FK_CUDA_CHECK_LAUNCH("embedding_keys");
}

}  // namespace fk::cuda
