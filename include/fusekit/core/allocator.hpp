// The caching device allocator. cudaMalloc and cudaFree synchronise the device and cost tens of
// microseconds; training allocates the same sizes every step. Freed blocks are kept in per-device,
// per-stream free lists (a block is reused only on the stream that freed it, so stream order
// alone makes reuse safe) and handed out again for requests of the same rounded size.
#pragma once

#include <cstddef>

#include "fusekit/core/device.hpp"

namespace fk {

class Stream;

struct AllocatorStats {
  std::size_t allocated_bytes = 0;       // in live blocks
  std::size_t cached_bytes = 0;          // in free blocks kept for reuse
  std::size_t peak_allocated_bytes = 0;
  std::size_t device_allocations = 0;    // calls to cudaMalloc so far
  std::size_t cache_hits = 0;
};

namespace allocator {

// Memory for `bytes` bytes on `device`, ordered on `stream` (default stream when null). Never
// returns null for bytes > 0: throws fk::Error when the device is out of memory even after the
// cache was released. Host memory (Device::cpu()) is 64-byte aligned plain memory.
void* allocate(std::size_t bytes, Device device, const Stream* stream = nullptr);
void deallocate(void* ptr) noexcept;
// Returns every cached block to the driver.
void release_cached(Device device);
AllocatorStats stats(Device device);
// Starts a new peak: peak_allocated_bytes = allocated_bytes now.
void reset_peak(Device device);
// Rounded size a request of `bytes` is served with: 512-byte granularity under 1 MiB, 2 MiB above.
std::size_t round_size(std::size_t bytes) noexcept;

}  // namespace allocator
}  // namespace fk
