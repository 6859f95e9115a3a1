// What the two Hopper attention kernels (attention_sm90.cu forward, attention_sm90_bwd.cu
// backward) share beyond ops/common/sm90_async.cuh: the SFU's exp2, the rounding of fp32 pairs to
// a register of two bf16/f16, the named barriers of the consumer warpgroups, and the TMA map of a
// head tensor, dense [B, H, S, D] or packed [total, H, D], in any layout with stride 1 on D.
// Includes CuTe: only the CuTe translation units include this header.
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

// A map of a head tensor (bf16/f16, D a multiple of 64, a layout sm90_takes_layout takes) with
// boxes of {64, box_rows, 1, 1} and the 128-byte swizzle: a box is one 64-column slab of box_rows
// rows of one head, the layout of CuTe's GMMA K-major SW128 atoms stacked along the rows. Four
// dimensions, (D, rows, H, B), from the tensor's own strides, so that q, k and v are read where
// they are (Hugging Face's [B, S, H, D] memory seen as [B, H, S, D], say):
//   dense [B, H, S, D]: a box at (column, row, h, b); rows past S read as zeros (never the next
//   head's).
//   packed [total, H, D]: (D, total, H, 1), a box at (column, token, h, 0). Rows past a
//   sequence's end are the next sequence's tokens (only rows past total read as zeros): the kernels
//   mask them.
inline CUtensorMap head_map(const char* op, const char* what, const TensorView& t, int box_rows) {
  const bool packed = t.rank() == 3;
  const std::int64_t d = packed ? t.size(2) : t.size(3);
  const std::int64_t rows = packed ? t.size(0) : t.size(2), heads = t.size(1), batch = packed ? 1 : t.size(0);
  // A dimension of one entry is never stepped along: any stride TMA accepts (8 elements) does.
  auto stride = [](std::int64_t size, std::int64_t s) { return static_cast<cuuint64_t>(size == 1 ? 8 : s) * 2; };
  const CUtensorMapDataType type =
      t.dtype() == DType::bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  return tensor_map<4>(op, what, type, t.data(),
                       {static_cast<cuuint64_t>(d), static_cast<cuuint64_t>(rows), static_cast<cuuint64_t>(heads),
                        static_cast<cuuint64_t>(batch)},
                       {stride(rows, packed ? t.strides()[0] : t.strides()[2]), stride(heads, t.strides()[1]),
                        stride(batch, packed ? 8 : t.strides()[0])},
                       {64, static_cast<cuuint32_t>(box_rows), 1, 1}, CU_TENSOR_MAP_SWIZZLE_128B);
}

// Whether the sm_90 kernels can read or write t in place (head_map, and their 16-byte row accesses):
// a 16-byte aligned base, stride 1 on the last dimension, the others (of dimensions longer than 1)
// positive multiples of 8 elements (16 bytes) below 2^39 elements (TMA's limits on a global stride).
inline bool sm90_takes_layout(const TensorView& t) {
  const int last = t.rank() == 3 ? 2 : 3;  // packed or dense
  if (reinterpret_cast<std::uintptr_t>(t.data()) % 16 != 0 || t.strides()[last] != 1) return false;
  for (int i = 0; i < last; ++i) {
    const std::int64_t s = t.strides()[i];
    if (t.size(i) > 1 && (s <= 0 || s % 8 != 0 || s >= (std::int64_t{1} << 39))) return false;
  }
  return true;
}

}  // namespace fk::cuda::sm90
