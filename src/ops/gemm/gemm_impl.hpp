// The gemm family's internal layer: a validated problem in one flat form (pointers, sizes, row
// and batch strides in elements), and its three backends.
#pragma once

#include <cstdint>

#include "fusekit/core/tensor.hpp"
#include "fusekit/ops/gemm.hpp"

namespace fk::gemm_detail {

// One matrix operand: element (i, j) of batch entry g is at data + g * batch_stride + i * ld + j.
struct Matrix {
  void* data = nullptr;
  std::int64_t ld = 0, batch_stride = 0;
};

struct Problem {
  GemmParams p;
  DType in_type = DType::f32, out_type = DType::f32;
  Device device;
  std::int64_t batch = 1, m = 0, n = 0, k = 0;
  Matrix a, b, c, aux;
  void* bias = nullptr;
  void* bias_grad = nullptr;
};

// The spec: plain loops, double accumulation, every epilogue.
void gemm_reference(const Problem& q);
// The spec's epilogue alone, on a c that already holds z (unbatched f32 c: exact in place).
void epilogue_in_place(const Problem& q);
// f32, no epilogue: row-panel loops the compiler vectorises, float accumulation.
void sgemm_blocked(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                   const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c,
                   std::int64_t ldc);
#if FUSEKIT_WITH_CUDA
void gemm_cuda(const Problem& q, const Stream* stream);
#endif

}  // namespace fk::gemm_detail
