// CSR bags put in another order (contracts in recsys_cuda.hpp): the owner's side of the sharded
// embeddings' id exchange, which receives every rank's bags rank by rank and pools them table by
// table. Integer moves only. The two prefix sums are CUB's (DeviceScan); the gather of the
// lengths and the copy of the entries are one grid-stride kernel each, one thread a bag (a bag is
// a multi-hot bag: up to about a hundred ids, read and written contiguously).
#include <cub/device/device_scan.cuh>

#include <cstdint>

#include "fusekit/core/cuda_check.hpp"
#include "ops/common/grid_stride.cuh"
#include "recsys_cuda.hpp"

namespace fk::cuda {

namespace {

constexpr int kThreads = 256;

__global__ void gather_lengths_kernel(const std::int64_t* lengths, const std::int64_t* perm, std::int64_t n,
                                      std::int64_t* out_lengths) {
  for (std::int64_t k = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; k < n;
       k += std::int64_t{gridDim.x} * blockDim.x)
    out_lengths[k] = lengths[perm[k]];
}

__global__ void copy_bags_kernel(const std::int64_t* indices, const std::int64_t* in_start, const std::int64_t* perm,
                                 std::int64_t n, const std::int64_t* out_offsets, std::int64_t* out_indices) {
  for (std::int64_t k = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; k < n;
       k += std::int64_t{gridDim.x} * blockDim.x) {
    const std::int64_t* src = indices + in_start[perm[k]];
    std::int64_t* dst = out_indices + out_offsets[k];
    const std::int64_t len = out_offsets[k + 1] - out_offsets[k];
    for (std::int64_t e = 0; e < len; ++e) dst[e] = src[e];
  }
}

}  // namespace

std::size_t permute_bags_scan_bytes(std::int64_t n) {
  std::size_t exclusive = 0, inclusive = 0;
  FK_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, exclusive, static_cast<const std::int64_t*>(nullptr),
                                              static_cast<std::int64_t*>(nullptr), n));
  FK_CUDA_CHECK(cub::DeviceScan::InclusiveSum(nullptr, inclusive, static_cast<const std::int64_t*>(nullptr),
                                              static_cast<std::int64_t*>(nullptr), n));
  return exclusive > inclusive ? exclusive : inclusive;
}

void permute_bags(const std::int64_t* lengths, const std::int64_t* indices, const std::int64_t* perm, std::int64_t n,
                  std::int64_t* out_offsets, std::int64_t* out_indices, const PermuteBagsWorkspace& ws,
                  cudaStream_t s) {
  FK_CUDA_CHECK(cudaMemsetAsync(out_offsets, 0, sizeof(std::int64_t), s));
  if (n == 0) return;
  std::size_t bytes = ws.scan_bytes;
  FK_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(ws.scan_temp, bytes, lengths, ws.in_start, n, s));
  gather_lengths_kernel<<<grid_stride_blocks(n, kThreads), kThreads, 0, s>>>(lengths, perm, n, ws.out_lengths);
  FK_CUDA_CHECK_LAUNCH("permute_bags (lengths)");
  bytes = ws.scan_bytes;
  FK_CUDA_CHECK(cub::DeviceScan::InclusiveSum(ws.scan_temp, bytes, ws.out_lengths, out_offsets + 1, n, s));
  copy_bags_kernel<<<grid_stride_blocks(n, kThreads), kThreads, 0, s>>>(indices, ws.in_start, perm, n, out_offsets,
                                                                       out_indices);
  FK_CUDA_CHECK_LAUNCH("permute_bags (entries)");
}

}  // namespace fk::cuda
