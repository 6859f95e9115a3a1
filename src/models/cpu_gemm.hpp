// Single-precision GEMM for the CPU backend of the models: C [M, N] = alpha op(A) op(B) + beta C,
// row-major with leading dimensions, float accumulation. The nn spec GEMM (src/nn/gemm.hpp) reads
// every element through a dtype switch and accumulates in double: right for checking kernels, but
// ~50x too slow to train a DLRM on. This one runs row-panel axpy loops that the compiler
// vectorises (an AVX2/FMA build of them is chosen at run time where the CPU has it) and blocks K
// so that the B panel stays in L2.
#pragma once

#include <cstdint>

namespace fk::models::cpu {

// A is [M, K] (lda >= K) or, transposed, [K, M] (lda >= M); B is [K, N] (ldb >= N) or [N, K].
void sgemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const float* a,
           std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc);

}  // namespace fk::models::cpu
