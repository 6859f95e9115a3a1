// Status checks for the CUDA runtime and cuBLAS that throw fk::Error naming the call and its
// site. For .cu files and CUDA-enabled .cpp files only.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <mutex>
#include <source_location>

#include "fusekit/core/dtype.hpp"
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

// Makes `device` current for one call (cuBLAS handles, launches and the legacy default stream
// are all per device), its primary context current on this thread, and gives the caller's
// device back.
class DeviceScope {
 public:
  explicit DeviceScope(int device);
  ~DeviceScope();
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int device_, previous_ = 0;
};

// The cuBLAS handle of a device, held for one call: made on first use, set to `stream`, and
// locked meanwhile (a handle's stream is shared state). The handles live until the process ends,
// since cublasDestroy from a static destructor could run after the CUDA runtime is gone.
class CublasLease {
 public:
  CublasLease(int device, cudaStream_t stream);
  cublasHandle_t get() const noexcept { return handle_; }

 private:
  std::unique_lock<std::mutex> lock_;
  cublasHandle_t handle_ = nullptr;
};

// CUDA_R_32F, CUDA_R_16BF, CUDA_R_16F for the floating dtypes; throws otherwise.
cudaDataType_t cuda_data_type(DType t);

}  // namespace fk::detail

#define FK_CUDA_CHECK(expr) ::fk::detail::check_cuda((expr), #expr)
#define FK_CUBLAS_CHECK(expr) ::fk::detail::check_cublas((expr), #expr)
// After a kernel launch: launch-configuration errors surface here, with the call site.
#define FK_CUDA_CHECK_LAUNCH(name) ::fk::detail::check_cuda(cudaGetLastError(), name)
