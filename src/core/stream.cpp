#include "fusekit/core/stream.hpp"

#include <utility>

#include "fusekit/core/error.hpp"

#if FUSEKIT_WITH_CUDA
#include "fusekit/core/cuda_check.hpp"
#endif

namespace fk {

const Stream& Stream::default_stream() noexcept {
  static const Stream s(nullptr, Device::cuda(0), false);
  return s;
}

Stream Stream::create(Device device) {
  FK_CHECK_ARG(device.is_cuda(), "Stream::create", "device", "a CUDA device", device.str());
#if FUSEKIT_WITH_CUDA
  FK_CUDA_CHECK(cudaSetDevice(device.index));
  cudaStream_t s = nullptr;
  FK_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return Stream(s, device, true);
#else
  throw Error("Stream::create", "fusekit was built without CUDA");
#endif
}

Stream Stream::adopt(void* handle, Device device) {
  FK_CHECK_ARG(device.is_cuda(), "Stream::adopt", "device", "a CUDA device", device.str());
  return Stream(handle, device, false);
}

Stream::Stream(Stream&& o) noexcept
    : handle_(std::exchange(o.handle_, nullptr)), device_(o.device_), owned_(std::exchange(o.owned_, false)) {}

Stream& Stream::operator=(Stream&& o) noexcept {
  if (this != &o) {
    this->~Stream();
    handle_ = std::exchange(o.handle_, nullptr);
    device_ = o.device_;
    owned_ = std::exchange(o.owned_, false);
  }
  return *this;
}

Stream::~Stream() {
#if FUSEKIT_WITH_CUDA
  if (owned_ && handle_) cudaStreamDestroy(static_cast<cudaStream_t>(handle_));
#endif
}

void Stream::synchronize() const {
#if FUSEKIT_WITH_CUDA
  FK_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(handle_)));
#endif
}

}  // namespace fk
