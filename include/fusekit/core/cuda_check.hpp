// Status checks for the CUDA runtime and cuBLAS that throw fk::Error naming the call and its
// site. For .cu files and CUDA-enabled .cpp files only.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <source_location>

#include "fusekit/core/error.hpp"
#include "fusekit/core/stream.hpp"

namespace fk::detail {

[[noreturn]] void throw_cuda(cudaError_t e, const char* call, std::source_location where);
[[noreturn]] void throw_cublas(cublasStatus_t s, const char* call, std::source_location where);

inline void check_cuda(cudaError_t e, const char* call,
                       std::source_location where = std::source_location::current()) {
  if (e != cudaSuccess) throw_cuda(e, call, where);
}
inline void check_cublas(cublasStatus_t s, const char* call,
                         std::source_location where = std::source_location::current()) {
  if (s != CUBLAS_STATUS_SUCCESS) throw_cublas(s, call, where);
}

inline cudaStream_t cuda_stream(const Stream* s) {
  return static_cast<cudaStream_t>((s ? *s : Stream::default_stream()).handle());
}

}  // namespace fk::detail

#define FK_CUDA_CHECK(expr) ::fk::detail::check_cuda((expr), #expr)
#define FK_CUBLAS_CHECK(expr) ::fk::detail::check_cublas((expr), #expr)
// After a kernel launch: launch-configuration errors surface here, with the call site.
#define FK_CUDA_CHECK_LAUNCH(name) ::fk::detail::check_cuda(cudaGetLastError(), name)
