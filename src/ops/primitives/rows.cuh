// Device helpers of the row kernels (row_sum.cu, softmax.cu): a thread block holds
// blockDim.y rows of blockDim.x threads each (blockDim.x a power of two, 32..1024, and
// blockDim.x * blockDim.y <= 1024), and reduces a value over the threads of each row.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ops/common/activations.cuh"

namespace fk::device {

inline constexpr float kLog2e = 1.4426950408889634f;

// exp(d) for d <= 0 (or -inf) with the hardware's ex2: relative error about 2^-22. The difference
// d = x - max is formed first, exactly when x is near max, so that large |x| (1e4) costs nothing.
__device__ __forceinline__ float exp_of_difference(float d) { return exp2f(d * kLog2e); }

// The online softmax statistics of a set of values: its max m and sum of exp(v - m). An empty set
// (or one of -inf only) is {-inf, 0}.
struct MaxSum {
  float m, s;
};

__device__ __forceinline__ MaxSum combine(MaxSum a, MaxSum b) {
  if (a.m == -INFINITY) return b;
  if (b.m == -INFINITY) return a;
  const float m = fmaxf(a.m, b.m);
  return {m, a.s * exp_of_difference(a.m - m) + b.s * exp_of_difference(b.m - m)};
}

struct SumOp {
  __device__ float operator()(float a, float b) const { return a + b; }
};
struct MaxSumOp {
  __device__ MaxSum operator()(MaxSum a, MaxSum b) const { return combine(a, b); }
};

__device__ __forceinline__ float shfl_xor(float v, int lane_mask) { return __shfl_xor_sync(0xffffffffu, v, lane_mask); }
__device__ __forceinline__ MaxSum shfl_xor(MaxSum v, int lane_mask) {
  return {__shfl_xor_sync(0xffffffffu, v.m, lane_mask), __shfl_xor_sync(0xffffffffu, v.s, lane_mask)};
}

// Every lane of the warp gets op over the warp's 32 values (a fixed tree: deterministic).
template <class V, class Op>
__device__ __forceinline__ V warp_reduce(V v, Op op) {
  for (int mask = 16; mask >= 1; mask >>= 1) v = op(v, shfl_xor(v, mask));
  return v;
}

// The threads of this thread's row wait for each other: a named barrier per row (ids 1 to 15),
// so that the rows of a block do not wait for each other; the whole block where it has more rows.
__device__ __forceinline__ void row_sync() {
  if (blockDim.y == 1 || blockDim.y > 15) {
    __syncthreads();
  } else {
    asm volatile("bar.sync %0, %1;" ::"r"(1 + static_cast<int>(threadIdx.y)), "r"(static_cast<int>(blockDim.x))
                 : "memory");
  }
}

// Every thread of a row gets op over the row's blockDim.x values. `smem` holds 32 values; every
// thread of the row must call this (it synchronises the row's threads when it spans several warps).
template <class V, class Op>
__device__ __forceinline__ V row_reduce(V v, Op op, V identity, V* smem) {
  v = warp_reduce(v, op);
  if (blockDim.x <= 32) return v;  // uniform over the block
  const int warps = static_cast<int>(blockDim.x) / 32, warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  if (lane == 0) smem[threadIdx.y * warps + warp] = v;
  row_sync();
  v = lane < warps ? smem[threadIdx.y * warps + lane] : identity;
  v = warp_reduce(v, op);
  row_sync();  // smem may be reused by the caller's next reduction
  return v;
}

}  // namespace fk::device
