// Pointwise pieces over strided rows (a leading dimension per matrix), fp32: bias add, ReLU and its
// backward in place, the deterministic column sum (the bias gradient, with the ReLU derivative
// optionally fused into the same pass), and f32 <-> bf16 row conversion. They are the unfused
// building blocks of the reference DLRM (models/dlrm_gpu.cpp); contracts in rows_cuda.hpp.
//
// Elementwise kernels are grid-stride loops of 256 threads, one element each. The column sum
// reads every element once: block (32, 8) sums a chunk of 256 rows of 32 (or 128, four floats a
// thread) columns in a fixed order into partial[chunk, :], and one warp per column adds the
// chunks' partials in a fixed order: the result is the same bits on every run.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include "fusekit/core/cuda_check.hpp"
#include "ops/cuda_common.cuh"
#include "ops/grid_stride.cuh"
#include "rows_cuda.hpp"

namespace fk::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void bias_add_kernel(float* y, const float* bias, std::int64_t rows, std::int64_t cols, std::int64_t ld) {
  const std::int64_t n = rows * cols;
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n; i += std::int64_t{gridDim.x} * blockDim.x) {
    const std::int64_t r = i / cols, c = i % cols;
    y[r * ld + c] += bias[c];
  }
}

__global__ void relu_kernel(float* y, std::int64_t rows, std::int64_t cols, std::int64_t ld) {
  const std::int64_t n = rows * cols;
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n; i += std::int64_t{gridDim.x} * blockDim.x) {
    const std::int64_t r = i / cols, c = i % cols;
    y[r * ld + c] = fmaxf(y[r * ld + c], 0.0f);
  }
}

__global__ void relu_backward_kernel(float* dy, const float* y, std::int64_t rows, std::int64_t cols,
                                     std::int64_t ld_dy, std::int64_t ld_y) {
  const std::int64_t n = rows * cols;
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n; i += std::int64_t{gridDim.x} * blockDim.x) {
    const std::int64_t r = i / cols, c = i % cols;
    if (!(y[r * ld_y + c] > 0.0f)) dy[r * ld_dy + c] = 0.0f;
  }
}

// Block (32, 8): thread (x, y) sums Vec adjacent columns starting at Vec * (32 bx + x) over rows
// y, y + 8, ... of the chunk [kSumRows by, +kSumRows), in that order, then the block adds its 8 row
// groups in order: a fixed summation order (deterministic), every load independent of the sums.
constexpr int kSumRows = 256;

template <int Vec>
__global__ void column_partial_kernel(float* dz, const float* y, float* partial, std::int64_t rows, std::int64_t cols,
                                      std::int64_t ld_dz, std::int64_t ld_y) {
  __shared__ float sums[8][32 * Vec + 1];
  const std::int64_t col = (blockIdx.x * std::int64_t{32} + threadIdx.x) * Vec;
  const std::int64_t row0 = blockIdx.y * std::int64_t{kSumRows};
  const std::int64_t row_end = row0 + kSumRows < rows ? row0 + kSumRows : rows;
  float acc[Vec] = {};
  if (col < cols) {
#pragma unroll 8
    for (std::int64_t r = row0 + threadIdx.y; r < row_end; r += 8) {
      float g[Vec];
      if constexpr (Vec == 4) {
        const float4 v = *reinterpret_cast<const float4*>(dz + r * ld_dz + col);
        g[0] = v.x, g[1] = v.y, g[2] = v.z, g[3] = v.w;
      } else {
        g[0] = dz[r * ld_dz + col];
      }
      if (y != nullptr) {
        float m[Vec];
        if constexpr (Vec == 4) {
          const float4 v = *reinterpret_cast<const float4*>(y + r * ld_y + col);
          m[0] = v.x, m[1] = v.y, m[2] = v.z, m[3] = v.w;
        } else {
          m[0] = y[r * ld_y + col];
        }
#pragma unroll
        for (int k = 0; k < Vec; ++k) g[k] = m[k] > 0.0f ? g[k] : 0.0f;
        if constexpr (Vec == 4) {
          *reinterpret_cast<float4*>(dz + r * ld_dz + col) = make_float4(g[0], g[1], g[2], g[3]);
        } else {
          dz[r * ld_dz + col] = g[0];
        }
      }
#pragma unroll
      for (int k = 0; k < Vec; ++k) acc[k] += g[k];
    }
  }
#pragma unroll
  for (int k = 0; k < Vec; ++k) sums[threadIdx.y][threadIdx.x * Vec + k] = acc[k];
  __syncthreads();
  const int flat = threadIdx.y * 32 + threadIdx.x;
  const std::int64_t c = blockIdx.x * std::int64_t{32} * Vec + flat;
  if (flat < 32 * Vec && c < cols) {
    float total = 0.0f;
    for (int k = 0; k < 8; ++k) total += sums[k][flat];
    partial[blockIdx.y * cols + c] = total;
  }
}

// One warp per column: lanes take chunks lane, lane + 32, ... in order, then a fixed butterfly.
__global__ void column_final_kernel(const float* partial, float* db, std::int64_t chunks, std::int64_t cols) {
  const std::int64_t col = (blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (col >= cols) return;
  float s = 0.0f;
  for (std::int64_t k = lane; k < chunks; k += 32) s += partial[k * cols + col];
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
  if (lane == 0) db[col] = s;
}

__global__ void to_bf16_kernel(const float* src, std::int64_t ld_src, std::uint16_t* dst, std::int64_t rows,
                               std::int64_t cols) {
  const std::int64_t n = rows * cols;
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n; i += std::int64_t{gridDim.x} * blockDim.x) {
    const __nv_bfloat16 v = __float2bfloat16_rn(src[(i / cols) * ld_src + i % cols]);
    dst[i] = *reinterpret_cast<const std::uint16_t*>(&v);
  }
}

__global__ void from_bf16_kernel(const std::uint16_t* src, float* dst, std::int64_t ld_dst, std::int64_t rows,
                                 std::int64_t cols) {
  const std::int64_t n = rows * cols;
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n; i += std::int64_t{gridDim.x} * blockDim.x) {
    const std::uint16_t u = src[i];
    dst[(i / cols) * ld_dst + i % cols] = __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(&u));
  }
}

}  // namespace

void bias_add(float* y, const float* bias, std::int64_t rows, std::int64_t cols, std::int64_t ld, cudaStream_t s) {
  bias_add_kernel<<<grid_stride_blocks(rows * cols), kThreads, 0, s>>>(y, bias, rows, cols, ld);
  FK_CUDA_CHECK_LAUNCH("bias_add");
}

void relu_inplace(float* y, std::int64_t rows, std::int64_t cols, std::int64_t ld, cudaStream_t s) {
  relu_kernel<<<grid_stride_blocks(rows * cols), kThreads, 0, s>>>(y, rows, cols, ld);
  FK_CUDA_CHECK_LAUNCH("relu_inplace");
}

void relu_backward_inplace(float* dy, const float* y, std::int64_t rows, std::int64_t cols, std::int64_t ld_dy,
                           std::int64_t ld_y, cudaStream_t s) {
  relu_backward_kernel<<<grid_stride_blocks(rows * cols), kThreads, 0, s>>>(dy, y, rows, cols, ld_dy, ld_y);
  FK_CUDA_CHECK_LAUNCH("relu_backward_inplace");
}

std::size_t column_sum_partial_floats(std::int64_t rows, std::int64_t cols) {
  return static_cast<std::size_t>(std::max<std::int64_t>(1, (rows + kSumRows - 1) / kSumRows) * cols);
}

void column_sum(float* dz, const float* y, float* db, std::int64_t rows, std::int64_t cols, std::int64_t ld_dz,
                std::int64_t ld_y, float* partial, cudaStream_t s) {
  const std::int64_t chunks = std::max<std::int64_t>(1, (rows + kSumRows - 1) / kSumRows);
  const auto aligned = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; };
  const bool vec = cols % 4 == 0 && ld_dz % 4 == 0 && aligned(dz) && (y == nullptr || (ld_y % 4 == 0 && aligned(y)));
  if (vec) {
    const dim3 grid(static_cast<unsigned>((cols + 127) / 128), static_cast<unsigned>(chunks));
    column_partial_kernel<4><<<grid, dim3(32, 8), 0, s>>>(dz, y, partial, rows, cols, ld_dz, ld_y);
  } else {
    const dim3 grid(static_cast<unsigned>((cols + 31) / 32), static_cast<unsigned>(chunks));
    column_partial_kernel<1><<<grid, dim3(32, 8), 0, s>>>(dz, y, partial, rows, cols, ld_dz, ld_y);
  }
  FK_CUDA_CHECK_LAUNCH("column_sum");
  column_final_kernel<<<grid_stride_blocks(cols * 32), kThreads, 0, s>>>(partial, db, chunks, cols);
  FK_CUDA_CHECK_LAUNCH("column_sum");
}

void to_bf16_rows(const float* src, std::int64_t ld_src, std::uint16_t* dst, std::int64_t rows, std::int64_t cols,
                  cudaStream_t s) {
  if (rows * cols == 0) return;
  to_bf16_kernel<<<grid_stride_blocks(rows * cols), kThreads, 0, s>>>(src, ld_src, dst, rows, cols);
  FK_CUDA_CHECK_LAUNCH("to_bf16_rows");
}

void from_bf16_rows(const std::uint16_t* src, float* dst, std::int64_t ld_dst, std::int64_t rows, std::int64_t cols,
                    cudaStream_t s) {
  if (rows * cols == 0) return;
  from_bf16_kernel<<<grid_stride_blocks(rows * cols), kThreads, 0, s>>>(src, dst, ld_dst, rows, cols);
  FK_CUDA_CHECK_LAUNCH("from_bf16_rows");
}

}  // namespace fk::cuda
