// Row-major GEMM for the nn layers: C [M, N] = alpha op(A) op(B) + beta C, op = identity or
// transpose, fp32 (or double, on the CPU) accumulation; beta = 0 overwrites C (never read). The CPU path is the spec (plain loops, double
// accumulation); the CUDA path is cuBLAS (CUBLAS_COMPUTE_32F). All three share one dtype.
#pragma once

#include "fusekit/core/tensor.hpp"

namespace fk {
class Stream;
}

namespace fk::nn::detail {

enum class Op { n, t };

// A is [M, K] (Op::n) or [K, M] (Op::t); B is [K, N] or [N, K]. allow_tf32: f32 operands on the
// GPU go through TF32 tensor cores (CUBLAS_COMPUTE_32F_FAST_TF32).
void gemm(Op op_a, Op op_b, const TensorView& a, const TensorView& b, const TensorView& c, const Stream* stream,
          bool allow_tf32 = false, float alpha = 1.0f, float beta = 0.0f);

}  // namespace fk::nn::detail
