// Caching allocator: see allocator.hpp for the policy.
#include "fusekit/core/allocator.hpp"

#include <fmt/format.h>

#include <cstdlib>
#include <map>
#include <mutex>
#include <new>
#include <optional>
#include <unordered_map>

#include "fusekit/core/error.hpp"
#include "fusekit/core/stream.hpp"

#if FUSEKIT_WITH_CUDA
#include "fusekit/core/cuda_check.hpp"
#endif

namespace fk::allocator {
namespace {

struct Block {
  std::size_t size;  // rounded
  Device device;
  void* stream;      // the stream the block is ordered on
  std::optional<DeviceMemorySource> source;  // where it came from, when not fusekit's cache
};

struct FreeKey {
  int device;
  void* stream;
  std::size_t size;
  friend auto operator<=>(const FreeKey&, const FreeKey&) = default;
};

struct State {
  std::mutex mu;
  std::unordered_map<void*, Block> live;     // every block handed out, host ones included
  std::multimap<FreeKey, void*> free_blocks; // cached device blocks
  std::unordered_map<int, AllocatorStats> stats;
  std::optional<DeviceMemorySource> source;
};

State& state() {
  static State* s = new State();  // never destroyed: blocks may be freed during static teardown
  return *s;
}

constexpr std::size_t kSmall = std::size_t{1} << 20;

#if FUSEKIT_WITH_CUDA
// Frees every cached block of `device`; caller holds the lock.
void release_locked(State& s, int device) {
  for (auto it = s.free_blocks.begin(); it != s.free_blocks.end();) {
    if (it->first.device == device) {
      cudaFree(it->second);
      s.stats[device].cached_bytes -= it->first.size;
      it = s.free_blocks.erase(it);
    } else {
      ++it;
    }
  }
}
#endif

}  // namespace

std::size_t round_size(std::size_t bytes) noexcept {
  if (bytes == 0) return 0;
  const std::size_t g = bytes < kSmall ? 512 : (std::size_t{2} << 20);
  return (bytes + g - 1) / g * g;
}

void* allocate(std::size_t bytes, Device device, const Stream* stream) {
  if (bytes == 0) return nullptr;
  State& s = state();
  const std::size_t size = round_size(bytes);
  if (device.is_cpu()) {
    void* p = std::aligned_alloc(64, size);
    if (!p) throw Error("allocate", fmt::format("out of host memory allocating {} bytes", bytes));
    std::lock_guard lock(s.mu);
    s.live.emplace(p, Block{size, device, nullptr, std::nullopt});
    return p;
  }
#if FUSEKIT_WITH_CUDA
  void* st = (stream ? *stream : Stream::default_stream()).handle();
  std::optional<DeviceMemorySource> source;
  {
    std::lock_guard lock(s.mu);
    source = s.source;
  }
  if (source) {
    void* p = nullptr;
    {
      const detail::DeviceScope on_device(device.index);
      p = source->allocate(source->context, size, device.index, st);
    }
    if (!p) throw Error("allocate", fmt::format("the device memory source returned no memory for {} bytes", bytes));
    std::lock_guard lock(s.mu);
    s.live.emplace(p, Block{size, device, st, source});
    return p;
  }
  std::lock_guard lock(s.mu);
  AllocatorStats& stats = s.stats[device.index];
  const auto it = s.free_blocks.find(FreeKey{device.index, st, size});
  void* p = nullptr;
  if (it != s.free_blocks.end()) {
    p = it->second;
    s.free_blocks.erase(it);
    stats.cached_bytes -= size;
    ++stats.cache_hits;
  } else {
    int previous = 0;
    FK_CUDA_CHECK(cudaGetDevice(&previous));
    FK_CUDA_CHECK(cudaSetDevice(device.index));
    cudaError_t e = cudaMalloc(&p, size);
    if (e == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      FK_CUDA_CHECK(cudaDeviceSynchronize());
      release_locked(s, device.index);
      e = cudaMalloc(&p, size);
    }
    cudaSetDevice(previous);
    if (e != cudaSuccess) {
      cudaGetLastError();
      throw Error("allocate", fmt::format("cannot allocate {} bytes on {}: {} ({} bytes in use by fusekit)",
                                          bytes, device.str(), cudaGetErrorString(e), stats.allocated_bytes));
    }
    ++stats.device_allocations;
  }
  stats.allocated_bytes += size;
  if (stats.allocated_bytes > stats.peak_allocated_bytes) stats.peak_allocated_bytes = stats.allocated_bytes;
  s.live.emplace(p, Block{size, device, st, std::nullopt});
  return p;
#else
  (void)stream;
  throw Error("allocate", "device", "cpu (fusekit was built without CUDA)", device.str());
#endif
}

void deallocate(void* ptr) noexcept {
  if (!ptr) return;
  State& s = state();
  std::unique_lock lock(s.mu);
  const auto it = s.live.find(ptr);
  if (it == s.live.end()) return;  // not ours: nothing to do (never happens through Tensor)
  const Block b = it->second;
  s.live.erase(it);
  if (b.source) {
    lock.unlock();
#if FUSEKIT_WITH_CUDA
    int previous = 0;
    const bool switched = cudaGetDevice(&previous) == cudaSuccess && previous != b.device.index &&
                          cudaSetDevice(b.device.index) == cudaSuccess;
    b.source->deallocate(b.source->context, ptr, b.device.index, b.stream);
    if (switched) cudaSetDevice(previous);
#endif
    return;
  }
  if (b.device.is_cpu()) {
    std::free(ptr);
    return;
  }
  AllocatorStats& stats = s.stats[b.device.index];
  stats.allocated_bytes -= b.size;
  stats.cached_bytes += b.size;
  s.free_blocks.emplace(FreeKey{b.device.index, b.stream, b.size}, ptr);
}

void set_device_memory_source(const DeviceMemorySource* source) {
  State& s = state();
  std::lock_guard lock(s.mu);
  if (source) s.source = *source;
  else s.source.reset();
}

void release_cached(Device device) {
  if (!device.is_cuda()) return;
#if FUSEKIT_WITH_CUDA
  State& s = state();
  std::lock_guard lock(s.mu);
  FK_CUDA_CHECK(cudaDeviceSynchronize());
  release_locked(s, device.index);
#endif
}

void reset_peak(Device device) {
  if (!device.is_cuda()) return;
  State& s = state();
  std::lock_guard lock(s.mu);
  AllocatorStats& st = s.stats[device.index];
  st.peak_allocated_bytes = st.allocated_bytes;
}

AllocatorStats stats(Device device) {
  State& s = state();
  std::lock_guard lock(s.mu);
  if (device.is_cpu()) return {};
  return s.stats[device.index];
}

}  // namespace fk::allocator
