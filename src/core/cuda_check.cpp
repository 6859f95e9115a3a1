#include "fusekit/core/cuda_check.hpp"

#include <fmt/format.h>

#include <vector>

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

DeviceScope::DeviceScope(int device) : device_(device) {
  FK_CUDA_CHECK(cudaGetDevice(&previous_));
  // Set even when it is already the current device: on a thread that has made no CUDA runtime
  // call yet (PyTorch's autograd threads set their device only where it differs), cudaGetDevice
  // reports device 0 with no context current, and the driver calls an op makes before its first
  // launch (cuTensorMapEncodeTiled for a TMA descriptor) need one. cudaSetDevice makes the
  // device's primary context current.
  FK_CUDA_CHECK(cudaSetDevice(device_));
}

DeviceScope::~DeviceScope() {
  if (previous_ != device_) cudaSetDevice(previous_);
}

namespace {
struct CublasHandles {
  std::mutex mutex;
  std::vector<cublasHandle_t> per_device;
};
CublasHandles& cublas_handles() {
  static CublasHandles* h = new CublasHandles();  // never destroyed: see CublasLease
  return *h;
}
}  // namespace

CublasLease::CublasLease(int device, cudaStream_t stream) : lock_(cublas_handles().mutex) {
  auto& v = cublas_handles().per_device;
  const auto i = static_cast<std::size_t>(device);
  if (i >= v.size()) v.resize(i + 1, nullptr);
  if (!v[i]) FK_CUBLAS_CHECK(cublasCreate(&v[i]));
  handle_ = v[i];
  FK_CUBLAS_CHECK(cublasSetStream(handle_, stream));
}

cudaDataType_t cuda_data_type(DType t) {
  switch (t) {
    case DType::f32: return CUDA_R_32F;
    case DType::bf16: return CUDA_R_16BF;
    case DType::f16: return CUDA_R_16F;
    default: throw Error("cuda_data_type", "dtype", "f32, bf16 or f16", std::string(dtype_name(t)));
  }
}

}  // namespace fk::detail
