#include <gtest/gtest.h>

#include <tuple>
#include <vector>

#include "fusekit/fusekit.hpp"
#include "test_util.hpp"

namespace fk {
namespace {

TEST(Allocator, RoundsSizes) {
  EXPECT_EQ(allocator::round_size(0), 0u);
  EXPECT_EQ(allocator::round_size(1), 512u);
  EXPECT_EQ(allocator::round_size(513), 1024u);
  EXPECT_EQ(allocator::round_size((1u << 20) + 1), 2u << 20);
  EXPECT_EQ(allocator::round_size(5u << 20), 6u << 20);
}

TEST(Allocator, HostMemoryIsAligned) {
  void* p = allocator::allocate(100, Device::cpu());
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p) % 64, 0u);
  allocator::deallocate(p);
  EXPECT_EQ(allocator::allocate(0, Device::cpu()), nullptr);
}

TEST(Allocator, DeviceBlocksAreCachedAndReused) {
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  allocator::release_cached(gpu);
  const AllocatorStats before = allocator::stats(gpu);
  void* a = allocator::allocate(3000, gpu);
  allocator::deallocate(a);
  void* b = allocator::allocate(2900, gpu);  // same rounded size (3072): the cached block comes back
  EXPECT_EQ(a, b);
  const AllocatorStats mid = allocator::stats(gpu);
  EXPECT_EQ(mid.device_allocations, before.device_allocations + 1);
  EXPECT_EQ(mid.cache_hits, before.cache_hits + 1);
  EXPECT_EQ(mid.allocated_bytes, before.allocated_bytes + 3072);
  allocator::deallocate(b);
  EXPECT_EQ(allocator::stats(gpu).cached_bytes, before.cached_bytes + 3072);
  allocator::release_cached(gpu);
  EXPECT_EQ(allocator::stats(gpu).cached_bytes, 0u);
}

TEST(Allocator, AnInstalledSourceServesEveryDeviceBlock) {
  FK_SKIP_WITHOUT_GPU();
  // A source that logs every call and hands out addresses in a host arena (nothing here reads or
  // writes the blocks).
  struct Log {
    std::vector<char> arena = std::vector<char>(1 << 20);
    std::size_t used = 0;
    std::vector<std::tuple<std::size_t, int, void*>> allocs;
    std::vector<std::tuple<void*, int, void*>> frees;
  } log;
  DeviceMemorySource source;
  source.context = &log;
  source.allocate = [](void* ctx, std::size_t bytes, int device, void* stream) -> void* {
    auto& l = *static_cast<Log*>(ctx);
    l.allocs.emplace_back(bytes, device, stream);
    void* p = l.arena.data() + l.used;
    l.used += bytes;
    return p;
  };
  source.deallocate = [](void* ctx, void* ptr, int device, void* stream) noexcept {
    static_cast<Log*>(ctx)->frees.emplace_back(ptr, device, stream);
  };
  const Device gpu = Device::cuda(0);
  const AllocatorStats before = allocator::stats(gpu);
  const Stream stream = Stream::create(gpu);
  allocator::set_device_memory_source(&source);
  void* p = nullptr;
  {
    const Tensor t = Tensor::empty({1000}, DType::f32, gpu, &stream);
    p = t.data();
    EXPECT_EQ(p, log.arena.data());
    ASSERT_EQ(log.allocs.size(), 1u);
    EXPECT_EQ(std::get<0>(log.allocs[0]), allocator::round_size(4000));
    EXPECT_EQ(std::get<1>(log.allocs[0]), 0);
    EXPECT_EQ(std::get<2>(log.allocs[0]), stream.handle());
    EXPECT_TRUE(log.frees.empty());
  }
  ASSERT_EQ(log.frees.size(), 1u);
  EXPECT_EQ(std::get<0>(log.frees[0]), p);
  EXPECT_EQ(std::get<2>(log.frees[0]), stream.handle());
  // Host memory never goes to the source, and fusekit's cache counted nothing.
  allocator::deallocate(allocator::allocate(100, Device::cpu()));
  EXPECT_EQ(log.allocs.size(), 1u);
  const AllocatorStats after = allocator::stats(gpu);
  EXPECT_EQ(after.device_allocations, before.device_allocations);
  EXPECT_EQ(after.allocated_bytes, before.allocated_bytes);
  // A block from the source outlives the source's removal and still goes back to it.
  void* q = allocator::allocate(512, gpu, &stream);
  allocator::set_device_memory_source(nullptr);
  void* r = allocator::allocate(512, gpu, &stream);  // fusekit's cache again
  EXPECT_EQ(log.allocs.size(), 2u);
  EXPECT_EQ(allocator::stats(gpu).allocated_bytes, before.allocated_bytes + 512);
  allocator::deallocate(q);
  EXPECT_EQ(log.frees.size(), 2u);
  allocator::deallocate(r);
  EXPECT_EQ(log.frees.size(), 2u);
  EXPECT_EQ(allocator::stats(gpu).allocated_bytes, before.allocated_bytes);
}

TEST(Allocator, OutOfMemoryIsAnErrorNotACrash) {
  FK_SKIP_WITHOUT_GPU();
  EXPECT_THROW(allocator::allocate(std::size_t{1} << 50, Device::cuda(0)), Error);
}

TEST(Allocator, CudaTensorInCpuOnlyBuildIsAnError) {
  if (built_with_cuda()) GTEST_SKIP() << "only meaningful in a CPU-only build";
  EXPECT_THROW(Tensor::empty({4}, DType::f32, Device::cuda(0)), Error);
}

}  // namespace
}  // namespace fk
