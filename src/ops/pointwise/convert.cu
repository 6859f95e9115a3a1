// convert: dst = src element by element, from one float dtype to another, over rows with their
// own row strides, or (strided views of rank 3 and 4) rows placed by up to three leading strides.
// A grid-stride loop of 256 threads, one element each (the floor is the bytes read and written
// over HBM bandwidth; the callers convert small batches and weight ranges, and copy strided views
// for kernels that take contiguous ones).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "fusekit/core/cuda_check.hpp"
#include "ops/common/activations.cuh"
#include "ops/common/cuda_common.cuh"
#include "ops/common/grid_stride.cuh"
#include "pointwise_cuda.hpp"

namespace fk::cuda {
namespace {

constexpr int kThreads = 256;

template <class S, class D>
__global__ void convert_kernel(const S* __restrict__ src, std::int64_t ld_src, D* __restrict__ dst,
                               std::int64_t ld_dst, std::int64_t rows, std::int64_t cols) {
  const std::int64_t n = rows * cols;
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * blockDim.x) {
    const std::int64_t r = i / cols, c = i % cols;
    dst[r * ld_dst + c] = device::from_float<D>(device::to_float(src[r * ld_src + c]));
  }
}

template <class S, class D>
__global__ void convert_strided_kernel(const S* __restrict__ src, const ConvertWalk ws, D* __restrict__ dst,
                                       const ConvertWalk wd, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * blockDim.x) {
    const std::int64_t r = i / ws.cols, c = i % ws.cols;
    dst[wd.row(r) + c] = device::from_float<D>(device::to_float(src[ws.row(r) + c]));
  }
}

}  // namespace

void convert(const TensorView& src, const ConvertWalk& ws, const TensorView& dst, const ConvertWalk& wd,
             const Stream* stream) {
  const std::int64_t rows = ws.n[0] * ws.n[1] * ws.n[2], cols = ws.cols;
  if (rows * cols == 0) return;
  const cudaStream_t s = detail::cuda_stream(stream);
  with_float_type(src.dtype(), [&](auto si) {
    with_float_type(dst.dtype(), [&](auto di) {
      using S = decltype(si);
      using D = decltype(di);
      if (ws.plain_rows() && wd.plain_rows())
        convert_kernel<S, D><<<grid_stride_blocks(rows * cols), kThreads, 0, s>>>(
            static_cast<const S*>(src.data()), ws.s[2], static_cast<D*>(dst.data()), wd.s[2], rows, cols);
      else
        convert_strided_kernel<S, D><<<grid_stride_blocks(rows * cols), kThreads, 0, s>>>(
            static_cast<const S*>(src.data()), ws, static_cast<D*>(dst.data()), wd, rows * cols);
    });
  });
  FK_CUDA_CHECK_LAUNCH("convert");
}

}  // namespace fk::cuda
