// What the two Hopper attention kernels (attention_sm90.cu forward, attention_sm90_bwd.cu
// backward) share beyond ops/common/sm90_async.cuh: the SFU's exp2, the rounding of fp32 pairs to
// a register of two bf16/f16, the named barriers of the consumer warpgroups, and the TMA map of a
// head tensor, dense [B, H, S, D] or packed [total, H, D]. Includes CuTe: only the CuTe
// translation units include this header.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>

#include "fusekit/core/tensor.hpp"
#include "ops/common/sm90_async.cuh"

namespace fk::cuda::sm90 {

// 2^x on the SFU (2 ulp; 2^-inf = +0), as exp2f compiles to more than one instruction.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// (a, b) rounded to nearest T (cute::bfloat16_t or cute::half_t), a in the low half.
template <class T>
__device__ __forceinline__ std::uint32_t pack2(float a, float b) {
  if constexpr (std::is_same_v<T, cute::bfloat16_t>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const std::uint32_t*>(&v);
  } else {
    static_assert(std::is_same_v<T, cute::half_t>);
    const __half2 v = __floats2half2_rn(a, b);
    return *reinterpret_cast<const std::uint32_t*>(&v);
  }
}

// bar.sync on named barrier `id` (1..15; 0 is __syncthreads) among `threads` threads.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// bar.arrive on named barrier `id` among `threads` threads: counts this thread without waiting
// (the producer side of a barrier other threads bar.sync on).
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// A map of a head tensor (bf16/f16, D a multiple of 64) with boxes of {64, box_rows, 1} and the
// 128-byte swizzle: a box is one 64-column slab of box_rows rows of one head, the layout of CuTe's
// GMMA K-major SW128 atoms stacked along the rows.
//   dense [B, H, S, D]: (D, S, B*H), a box at (column, row, b H + h); rows past S read as zeros
//   (never the next head's).
//   packed [total, H, D]: (D, total, H), row stride H D, head stride D; a box at (column, token,
//   h). Rows past a sequence's end are the next sequence's tokens (only rows past total read as
//   zeros): the kernels mask them.
inline CUtensorMap head_map(const char* op, const char* what, const TensorView& t, int box_rows) {
  const bool packed = t.rank() == 3;
  const std::int64_t d = packed ? t.size(2) : t.size(3);
  const std::int64_t rows = packed ? t.size(0) : t.size(2), heads = packed ? t.size(1) : t.size(0) * t.size(1);
  const std::int64_t row_stride = packed ? heads * d : d, head_stride = packed ? d : rows * d;  // elements
  const CUtensorMapDataType type =
      t.dtype() == DType::bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  return tensor_map<3>(op, what, type, t.data(),
                       {static_cast<cuuint64_t>(d), static_cast<cuuint64_t>(rows), static_cast<cuuint64_t>(heads)},
                       {static_cast<cuuint64_t>(row_stride) * 2, static_cast<cuuint64_t>(head_stride) * 2},
                       {64, static_cast<cuuint32_t>(box_rows), 1}, CU_TENSOR_MAP_SWIZZLE_128B);
}

}  // namespace fk::cuda::sm90
