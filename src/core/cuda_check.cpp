#include "fusekit/core/cuda_check.hpp"

#include <fmt/format.h>

namespace fk::detail {

void throw_cuda(cudaError_t e, const char* call, std::source_location where) {
  cudaGetLastError();  // clear a non-sticky error so that later calls are not blamed for it
  throw Error("cuda", fmt::format("{} failed: {} ({}) at {}:{}", call, cudaGetErrorString(e), cudaGetErrorName(e),
                                  where.file_name(), where.line()));
}

void throw_cublas(cublasStatus_t s, const char* call, std::source_location where) {
  throw Error("cublas", fmt::format("{} failed: {} ({}) at {}:{}", call, cublasGetStatusString(s),
                                    cublasGetStatusName(s), where.file_name(), where.line()));
}

}  // namespace fk::detail
