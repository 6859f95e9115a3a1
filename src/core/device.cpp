#include "fusekit/core/device.hpp"

#include <fmt/format.h>

#include <charconv>

#include "fusekit/core/error.hpp"

#if FUSEKIT_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace fk {

Device Device::parse(std::string_view s) {
  if (s == "cpu") return cpu();
  if (s == "cuda") return cuda(0);
  if (s.starts_with("cuda:")) {
    int i = -1;
    const auto digits = s.substr(5);
    const auto [p, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), i);
    if (ec == std::errc() && p == digits.data() + digits.size() && i >= 0) return cuda(i);
  }
  throw Error("Device::parse", "device", "'cpu', 'cuda' or 'cuda:N'", fmt::format("'{}'", s));
}

std::string Device::str() const { return is_cpu() ? "cpu" : fmt::format("cuda:{}", index); }

bool built_with_cuda() noexcept { return FUSEKIT_WITH_CUDA != 0; }

int cuda_device_count() noexcept {
#if FUSEKIT_WITH_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
#else
  return 0;
#endif
}

std::string cuda_unavailable_reason() {
#if FUSEKIT_WITH_CUDA
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return fmt::format("no usable CUDA device ({})", cudaGetErrorString(e));
  }
  return n > 0 ? "" : "no CUDA device present";
#else
  return "fusekit was built without CUDA (FUSEKIT_CUDA=OFF or no toolkit)";
#endif
}

}  // namespace fk
