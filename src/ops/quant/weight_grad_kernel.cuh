// weight_grad_from_packed's main kernel (producer and consumer warpgroups) and its launch with
// the fix-up kernel, instantiated per bit width by weight_grad_from_packed_b*.cu.
#pragma once

#include "fusekit/core/cuda_check.hpp"
#include "weight_grad_mainloop_rs.cuh"
#include "weight_grad_mainloop_ss.cuh"

namespace fk::cuda::wgrad {
namespace {

template <int kBits, bool kRs>
__global__ void __launch_bounds__(kThreads, 1)
    weight_grad_packed_kernel(const __grid_constant__ Params p, const __grid_constant__ CUtensorMap tmap_dy,
                              const __grid_constant__ CUtensorMap tmap_x) {
#if FK_WGRAD_SM90
  // The fix-up kernel may be launched now: it waits for this grid to finish before it reads.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  extern __shared__ std::uint8_t smem_raw[];
  const Smem sm = carve_smem<kBits, kRs>(smem_raw);
  constexpr int kTransposers = kProducerThreads - 32;  // RS: producer warps 1-3
  if (threadIdx.x == 0) {
    for (int s = 0; s < sm.stages; ++s) {
      mbar_init(sm.full(s), kRs ? 1 : kFullArrivals);
      mbar_init(sm.empty(s), kEmptyArrivals);
      if (kRs) mbar_init(sm.ready(s), kTransposers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const CtaWork w = cta_work(p);
  // RS: the groups the tile's columns fall in (the last one for columns past CIN).
  const int g_first = w.nb * kBlockN / p.group;
  const int slots = min((w.nb * kBlockN + kBlockN - 1) / p.group, p.groups - 1) - g_first + 1;
  if (threadIdx.x < kProducerThreads) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kProducerRegs));
    const int pt = static_cast<int>(threadIdx.x);
    if constexpr (kRs) {
      ProducerRs<kBits> producer{{p, &tmap_dy, &tmap_x, sm, w, pt}, g_first, slots};
      if (pt == 0) producer.load();
      else if (pt >= 32) producer.transpose_stats(pt - 32);
    } else {
      Producer<kBits>{p, &tmap_dy, &tmap_x, sm, w, pt}.run();
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kConsumerRegs));
    if constexpr (kRs) consume_rs<kBits>(p, sm, smem_raw, w, g_first);
    else consume<kBits>(p, sm, smem_raw, w);
  }
#else
  __trap();  // the launcher never starts this kernel off sm_90
#endif
}

// The fix-up as a programmatic dependent launch: it is scheduled while the main kernel runs and
// waits for it on the GPU (griddepcontrol.wait), so no launch gap separates the two.
template <int kBits, bool kRs>
void launch_fixup(const Params& p, unsigned tiles, cudaStream_t s) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(tiles, p.half_partials ? kBlockM / 16 : kBlockM / 8);  // (tile, rows)
  cfg.blockDim = dim3(kFixupThreads);
  cfg.stream = s;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  auto* kernel = p.half_partials ? weight_grad_fixup_f16_kernel<kBits, kRs> : weight_grad_fixup_kernel<kBits, kRs>;
  // The same shared-memory carveout as the main kernel's, so that an SM going from one kernel to
  // the other need not reconfigure its L1 / shared memory split.
  FK_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared));
  FK_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p));
}

template <int kBits, bool kRs = false>
void launch_kernels(const Params& p, unsigned ctas, const CUtensorMap& map_dy, const CUtensorMap& map_x, cudaStream_t s) {
  auto kernel = weight_grad_packed_kernel<kBits, kRs>;
  constexpr int smem = kSmemBytes<kBits, kRs>;
  FK_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<ctas, kThreads, smem, s>>>(p, map_dy, map_x);
  FK_CUDA_CHECK_LAUNCH("weight_grad_packed_kernel");
  if (p.splits > 1) launch_fixup<kBits, kRs>(p, ctas / static_cast<unsigned>(p.splits), s);
}

}  // namespace
}  // namespace fk::cuda::wgrad
