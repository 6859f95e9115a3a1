// The kernel that holds a stream while the harness enqueues a batch of timed runs, and the empty
// kernel of the `launch` ceiling.
#include "bench/harness.hpp"
#include "fusekit/core/cuda_check.hpp"

namespace fk::bench {
namespace {

__global__ void spin_kernel(std::uint64_t ns) {
  std::uint64_t start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}

__global__ void empty_kernel() {}

}  // namespace

void launch_empty(cudaStream_t stream) {
  empty_kernel<<<1, 32, 0, stream>>>();
  FK_CUDA_CHECK_LAUNCH("empty_kernel");
}

void hold_stream(cudaStream_t stream, std::uint64_t ns) {
  spin_kernel<<<1, 1, 0, stream>>>(ns);
  FK_CUDA_CHECK_LAUNCH("spin_kernel");
}

}  // namespace fk::bench
