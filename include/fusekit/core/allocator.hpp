// The caching device allocator. cudaMalloc and cudaFree synchronise the device and cost tens of
// microseconds; training allocates the same sizes every step. Freed blocks are kept in per-device,
// per-stream free lists (a block is reused only on the stream that freed it, so stream order
// alone makes reuse safe) and handed out again for requests of the same rounded size.
//
// A framework that owns the device memory installs its own source instead (the Python package
// installs PyTorch's caching allocator), so that every buffer an op allocates is counted, ordered
// and reused by that framework.
#pragma once

#include <cstddef>

#include "fusekit/core/device.hpp"

namespace fk {

class Stream;

// fusekit's cache, not an installed DeviceMemorySource's blocks.
struct AllocatorStats {
  std::size_t allocated_bytes = 0;       // in live blocks
  std::size_t cached_bytes = 0;          // in free blocks kept for reuse
  std::size_t peak_allocated_bytes = 0;
  std::size_t device_allocations = 0;    // calls to cudaMalloc so far
  std::size_t cache_hits = 0;
};

// A source of device memory other than fusekit's cache. Both calls run with `device` the current
// CUDA device and without the allocator's lock held.
struct DeviceMemorySource {
  // Memory for `bytes` (> 0) bytes, ordered on `stream` (a cudaStream_t); throws on failure.
  void* (*allocate)(void* context, std::size_t bytes, int device, void* stream) = nullptr;
  // Gives back a block `allocate` returned, once, when the tensor holding it is destroyed (its
  // last use is ordered on the stream it was allocated on). Never throws.
  void (*deallocate)(void* context, void* ptr, int device, void* stream) noexcept = nullptr;
  void* context = nullptr;
};

namespace allocator {

// Memory for `bytes` bytes on `device`, ordered on `stream` (default stream when null). Never
// returns null for bytes > 0: throws fk::Error when the device is out of memory even after the
// cache was released. Host memory (Device::cpu()) is 64-byte aligned plain memory.
void* allocate(std::size_t bytes, Device device, const Stream* stream = nullptr);
void deallocate(void* ptr) noexcept;
// Device allocations from now on come from `source` (null: fusekit's cache again). Blocks handed
// out before go back to where they came from.
void set_device_memory_source(const DeviceMemorySource* source);
// Returns every cached block to the driver.
void release_cached(Device device);
AllocatorStats stats(Device device);
// Starts a new peak: peak_allocated_bytes = allocated_bytes now.
void reset_peak(Device device);
// Rounded size a request of `bytes` is served with: 512-byte granularity under 1 MiB, 2 MiB above.
std::size_t round_size(std::size_t bytes) noexcept;

}  // namespace allocator
}  // namespace fk
