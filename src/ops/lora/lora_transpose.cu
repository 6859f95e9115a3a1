// Aᵀ, zero-padded to rb = 16 ceil(r / 16) columns: the rank-r factor of the backward's dx GEMM
// (lora_gemm.cu reads its rows 8 bytes at a time). A is small (r x K), so this is a plain
// grid-stride copy.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "fusekit/core/cuda_check.hpp"
#include "fusekit/core/error.hpp"
#include "fusekit/core/tensor.hpp"
#include "lora_cuda.hpp"
#include "ops/common/cuda_common.cuh"
#include "ops/common/activations.cuh"

namespace fk::cuda {
namespace {

template <class T>
__global__ void transpose_pad(const T* a, T* at, std::int64_t r, std::int64_t k, std::int64_t rb) {
  for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < k * rb;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t col = e / rb, j = e % rb;
    at[e] = j < r ? a[j * k + col] : fk::device::from_float<T>(0.0f);
  }
}

}  // namespace

void lora_transpose_pad(const TensorView& a, const TensorView& at, const Stream* stream) {
  const std::int64_t r = a.size(0), k = a.size(1), rb = at.size(1);
  if (k == 0) return;
  const fk::detail::DeviceScope on_device(a.device().index);
  const int blocks = static_cast<int>(std::min<std::int64_t>((k * rb + 255) / 256, 4 * multiprocessor_count()));
  with_float_type(a.dtype(), [&](auto tag) {
    using T = decltype(tag);
    transpose_pad<T><<<blocks, 256, 0, fk::detail::cuda_stream(stream)>>>(static_cast<const T*>(a.data()),
                                                                           static_cast<T*>(at.data()), r, k, rb);
  });
  FK_CUDA_CHECK_LAUNCH("lora_backward (transpose of A)");
}

}  // namespace fk::cuda
