// Hopper's asynchronous copies and mbarriers, shared by the hand-written sm_90 kernels
// (attention_sm90.cu, weight_grad_from_packed.cu, qgemm.cu), and the host-side lookup of the
// driver's tensor-map encoder and the one function that builds a tensor map. Barriers and shared-memory destinations are addressed by their
// 32-bit shared-window address (smem_addr).
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <string>

#include "fusekit/core/cuda_check.hpp"
#include "fusekit/core/error.hpp"

namespace fk::cuda::sm90 {

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
__device__ __forceinline__ std::uint32_t smem_addr(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(std::uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(std::uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// Arrives and adds `bytes` to the transaction count the current phase waits for.
__device__ __forceinline__ void mbar_arrive_expect_tx(std::uint32_t bar, std::uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// Adds `bytes` to the transaction count the current phase waits for (no arrival).
__device__ __forceinline__ void mbar_expect_tx(std::uint32_t bar, std::uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// Waits until the phase of parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(std::uint32_t bar, int parity) {
  std::uint32_t done = 0;
  do {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}
// Makes this thread's generic-proxy shared-memory stores visible to the async proxy (wgmma, TMA).
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
// `bytes` (a multiple of 16, both ends 16-byte aligned) global -> shared by the TMA unit,
// completing on `bar`.
__device__ __forceinline__ void bulk_copy(std::uint32_t dst, const void* src, std::uint32_t bytes, std::uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}
// One box of a 2-D / 3-D / 4-D tensor map at coordinates (c0, c1[, c2[, c3]]) into shared memory.
__device__ __forceinline__ void tma_load_2d(const CUtensorMap* map, std::uint32_t bar, std::uint32_t dst, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
          dst),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void tma_load_3d(const CUtensorMap* map, std::uint32_t bar, std::uint32_t dst, int c0,
                                            int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];" ::"r"(
          dst),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void tma_load_4d(const CUtensorMap* map, std::uint32_t bar, std::uint32_t dst, int c0,
                                            int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];" ::"r"(dst),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}
#endif

// cuTensorMapEncodeTiled from the driver, found through the runtime (no link against libcuda);
// `op` names the op in the error when the driver has none.
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder(const char* op) {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [op] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
    FK_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &found));
    if (found != cudaDriverEntryPointSuccess || f == nullptr)
      throw Error(op, "the CUDA driver has no cuTensorMapEncodeTiled (TMA needs driver 12.0 or newer)");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// A tiled TMA map of a Rank-dimensional tensor at `base`, sizes `dims` innermost first, the byte
// strides of dimensions 1.. in `strides`, boxes of `box`, unit element strides, 256-byte L2
// promotion, zeros outside the tensor. Throws fk::Error naming `op` and `what` when the driver
// refuses the map.
template <int Rank>
inline CUtensorMap tensor_map(const char* op, const char* what, CUtensorMapDataType type, const void* base,
                              const std::array<cuuint64_t, Rank>& dims, const std::array<cuuint64_t, Rank - 1>& strides,
                              const std::array<cuuint32_t, Rank>& box, CUtensorMapSwizzle swizzle) {
  CUtensorMap map{};
  std::array<cuuint32_t, Rank> elem_strides;
  elem_strides.fill(1);
  const CUresult r = tensor_map_encoder(op)(&map, type, Rank, const_cast<void*>(base), dims.data(), strides.data(),
                                            box.data(), elem_strides.data(), CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw Error(op, std::string("cuTensorMapEncodeTiled failed for ") + what + " (error " + std::to_string(r) + ")");
  return map;
}

}  // namespace fk::cuda::sm90
