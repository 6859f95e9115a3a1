// CUDA path of fill_uniform / fill_normal (one thread per Philox block of four elements) and of
// advance_offset (one thread).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "fusekit/core/cuda_check.hpp"
#include "random_detail.hpp"

namespace fk::detail {
namespace {

__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store(__half* p, float v) { *p = __float2half_rn(v); }

template <class T>
__global__ void fill_random_kernel(T* __restrict__ out, std::int64_t n, Distribution d, float a, float b,
                                   std::uint64_t seed, std::uint64_t subsequence) {
  const std::int64_t blocks = (n + 3) / 4;
  for (std::int64_t blk = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; blk < blocks;
       blk += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    float v[4];
    transform_block(
        philox::random_block(seed, subsequence, static_cast<std::uint64_t>(blk)), d, a, b, v,
        [](float x) { return logf(x); }, [](float x) { return sqrtf(x); },
        [](float x, float& s, float& c) { sincosf(x, &s, &c); });
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (blk * 4 + j < n) store(out + blk * 4 + j, v[j]);
  }
}

template <class T>
void launch(const TensorView& t, Distribution d, float a, float b, RandomParams p, cudaStream_t s) {
  const std::int64_t blocks = (t.numel() + 3) / 4;
  const int threads = 256;
  const int grid = static_cast<int>(std::min<std::int64_t>((blocks + threads - 1) / threads, 65536));
  fill_random_kernel<<<grid, threads, 0, s>>>(t.data_as<T>(), t.numel(), d, a, b, p.seed, p.subsequence);
  FK_CUDA_CHECK_LAUNCH("fill_random_kernel");
}

__global__ void advance_offset_kernel(std::uint64_t* counter, std::uint64_t by) { *counter += by; }

}  // namespace

void advance_offset_cuda(std::uint64_t* counter, std::uint64_t by, void* stream) {
  advance_offset_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(counter, by);
  FK_CUDA_CHECK_LAUNCH("advance_offset_kernel");
}

void fill_random_cuda(const TensorView& t, Distribution d, float a, float b, RandomParams p, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  switch (t.dtype()) {
    case DType::f32: return launch<float>(t, d, a, b, p, s);
    case DType::bf16: return launch<__nv_bfloat16>(t, d, a, b, p, s);
    case DType::f16: return launch<__half>(t, d, a, b, p, s);
    default: throw_internal("fill_random_cuda: dtype not checked by the caller");
  }
}

}  // namespace fk::detail
