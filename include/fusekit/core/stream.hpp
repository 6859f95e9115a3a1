// Stream: an owning CUDA stream (or the device's default stream), and the one place fusekit code
// gets a cudaStream_t from. In a CPU-only build it exists and does nothing, so that op signatures
// are the same in both builds.
#pragma once

#include "fusekit/core/device.hpp"

namespace fk {

class Stream {
 public:
  // The legacy default stream of the current device.
  static const Stream& default_stream() noexcept;
  // A new non-blocking stream on `device` (CUDA only).
  static Stream create(Device device);
  // A caller's stream (a cudaStream_t from PyTorch, CuPy, ...) on `device`, not owned: fusekit
  // enqueues its work there and never destroys it. Null is the device's legacy default stream.
  static Stream adopt(void* handle, Device device);

  Stream(Stream&& o) noexcept;
  Stream& operator=(Stream&& o) noexcept;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  ~Stream();

  void synchronize() const;
  // The cudaStream_t, as an opaque pointer so this header needs no CUDA headers.
  void* handle() const noexcept { return handle_; }
  Device device() const noexcept { return device_; }

 private:
  Stream(void* handle, Device device, bool owned) noexcept
      : handle_(handle), device_(device), owned_(owned) {}
  void* handle_ = nullptr;
  Device device_;
  bool owned_ = false;
};

}  // namespace fk
