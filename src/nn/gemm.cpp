#include "gemm.hpp"

#include <fmt/format.h>

#include <vector>

#include "fusekit/core/error.hpp"
#include "ops/reference_io.hpp"

#if FUSEKIT_WITH_CUDA
#include "fusekit/core/cuda_check.hpp"
#endif

namespace fk::nn::detail {

void gemm(Op op_a, Op op_b, const TensorView& a, const TensorView& b, const TensorView& c, const Stream* stream,
          bool allow_tf32, float alpha, float beta) {
  const std::int64_t m = c.size(0), n = c.size(1);
  const std::int64_t k = op_a == Op::n ? a.size(1) : a.size(0);
  FK_CHECK_ARG((op_a == Op::n ? a.size(0) : a.size(1)) == m && (op_b == Op::n ? b.size(0) : b.size(1)) == k &&
                   (op_b == Op::n ? b.size(1) : b.size(0)) == n,
               "nn::gemm", "b", fmt::format("operands for a [{}, {}] product over {}", m, n, k),
               fmt::format("a {} b {}", a.shape().str(), b.shape().str()));
  if (m == 0 || n == 0) return;
  if (k == 0) {  // the sum over nothing (and cuBLAS wants lda >= 1)
    FK_CHECK_ARG(beta == 0.0f || beta == 1.0f, "nn::gemm", "beta", "0 or 1 when the product is over K = 0",
                 fmt::format("{}", beta));
    if (beta == 0.0f) fill(c, 0.0);
    return;
  }
  if (c.device().is_cpu()) {
    std::vector<double> acc(static_cast<std::size_t>(m * n), 0.0);
    for (std::int64_t i = 0; i < m; ++i)
      for (std::int64_t p = 0; p < k; ++p) {
        const double av = reference::load(a, op_a == Op::n ? i * k + p : p * m + i);
        for (std::int64_t j = 0; j < n; ++j)
          acc[i * n + j] += av * reference::load(b, op_b == Op::n ? p * n + j : j * k + p);
      }
    for (std::int64_t i = 0; i < m * n; ++i) {
      const double prior = beta == 0.0f ? 0.0 : static_cast<double>(beta) * reference::load(c, i);
      reference::store(c, i, static_cast<double>(alpha) * acc[static_cast<std::size_t>(i)] + prior);
    }
    return;
  }
#if FUSEKIT_WITH_CUDA
  const fk::detail::DeviceScope on_device(c.device().index);
  const fk::detail::CublasLease cublas(c.device().index, fk::detail::cuda_stream(stream));
  const cudaDataType_t t = fk::detail::cuda_data_type(c.dtype());
  // Row-major C = A B is column-major Cᵀ = Bᵀ Aᵀ: cuBLAS gets B first, M and N swapped; each
  // leading dimension is the row length of the row-major matrix.
  FK_CUBLAS_CHECK(cublasGemmEx(cublas.get(), op_b == Op::n ? CUBLAS_OP_N : CUBLAS_OP_T,
                               op_a == Op::n ? CUBLAS_OP_N : CUBLAS_OP_T, static_cast<int>(n), static_cast<int>(m),
                               static_cast<int>(k), &alpha, b.data(), t, static_cast<int>(b.size(1)), a.data(), t,
                               static_cast<int>(a.size(1)), &beta, c.data(), t, static_cast<int>(n),
                               allow_tf32 && c.dtype() == DType::f32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F,
                               CUBLAS_GEMM_DEFAULT));
#else
  (void)stream;
  (void)allow_tf32;
  throw Error("nn::gemm", "c", "a host tensor (fusekit was built without CUDA)", c.str());
#endif
}

}  // namespace fk::nn::detail
