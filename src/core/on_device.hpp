// OnDevice: makes a model's or a layer's GPU current for one call, and nothing on the CPU (or in
// a build without CUDA), for code that runs on either device. Kernels, cuBLAS handles and the
// legacy default stream belong to the current device; a caller driving several GPUs from one
// process (a thread a GPU) may have another one current.
#pragma once

#include <optional>

#include "fusekit/core/device.hpp"

#if FUSEKIT_WITH_CUDA
#include "fusekit/core/cuda_check.hpp"
#endif

namespace fk::detail {

class OnDevice {
 public:
  explicit OnDevice(Device d) {
#if FUSEKIT_WITH_CUDA
    if (d.is_cuda()) scope_.emplace(d.index);
#else
    (void)d;
#endif
  }

 private:
#if FUSEKIT_WITH_CUDA
  std::optional<DeviceScope> scope_;
#endif
};

}  // namespace fk::detail
