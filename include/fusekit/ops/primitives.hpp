// Family `primitives`: the Triton puzzles (seed 001) as real ops. So far: batched matmul
// (puzzle 11), whose tensor-core kernel is written with CuTe.
#pragma once

#include "fusekit/core/tensor.hpp"

namespace fk {

class Stream;

// How batched_matmul runs on a GPU: cuBLAS strided-batched (the production path), or fusekit's
// CuTe kernel (bf16/f16 operands only).
enum class BatchedMatmulImpl { cublas, cute };

// c[i] = a[i] @ b[i] for every batch i, fp32 accumulation (overwrites c).
//   a: [B, M, K], b: [B, K, N], c: [B, M, N], all row-major contiguous.
//   a and b share one dtype: f32, bf16 or f16; c is f32 or that dtype; c overlaps neither.
// Any sizes, zeros included (K = 0 gives c = 0). Against the spec (double sums), for operands
// of random sign: within K^1.5 * 2^-22 * max|a| * max|b| (fp32 summation) plus one ulp of c's
// dtype (final rounding); the tests hold both implementations to that.
// impl=cute with f32 operands throws fk::Error naming 'impl' on every device; otherwise the CPU
// path ignores `impl`.
void batched_matmul(const TensorView& a, const TensorView& b, const TensorView& c,
                    BatchedMatmulImpl impl = BatchedMatmulImpl::cublas, const Stream* stream = nullptr);

namespace reference {
void batched_matmul(const TensorView& a, const TensorView& b, const TensorView& c);
}  // namespace reference

}  // namespace fk
