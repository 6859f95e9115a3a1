#include <gtest/gtest.h>

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
