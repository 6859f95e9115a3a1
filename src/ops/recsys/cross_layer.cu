// The elementwise passes of DCNv2's low-rank cross layer (contracts in recsys_cuda.hpp; the GEMMs
// around them run through fk::gemm in cross_layer.cpp).
//
// Forward: the second GEMM leaves p = U h in `out`; one pass reads p, x0, x_l and b once and
// writes x_{l+1} = x0 ⊙ (p + b) + x_l over p (unfused: a bias add, a multiply and an add, three
// passes over [B, N] with two temporaries). Backward: one pass reads dy, x0, p and b once,
// accumulates dx0 += dy ⊙ (p + b) (+ dy for the first layer, whose x_l is x0) and writes
// dp = dy ⊙ x0 over p, the operand of the three GEMMs that follow (dU with db fused, dh, and
// dL/dx_l = dy + dh V accumulated by the last GEMM's beta = 1). Everything is fp32; the result of
// each element depends on no other, so the passes are deterministic.
#include <cstdint>

#include "fusekit/core/cuda_check.hpp"
#include "ops/common/cuda_common.cuh"
#include "ops/common/grid_stride.cuh"
#include "recsys_cuda.hpp"

namespace fk::cuda {

namespace {

constexpr int kThreads = 256;

__global__ void cross_forward_epilogue_kernel(const float* __restrict__ x0, std::int64_t ld_x0,  // [B, N]
                                              const float* __restrict__ xl, std::int64_t ld_xl,  // [B, N]
                                              const float* __restrict__ bias,                    // [N]
                                              float* __restrict__ out, std::int64_t ld_out,      // [B, N]
                                              std::int64_t batch, std::int64_t n) {
  const std::int64_t total = batch * n;
  for (std::int64_t e = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; e < total;
       e += std::int64_t{gridDim.x} * blockDim.x) {
    const std::int64_t i = e / n, j = e - i * n;
    float& o = out[i * ld_out + j];
    o = fmaf(x0[i * ld_x0 + j], o + bias[j], xl[i * ld_xl + j]);
  }
}

__global__ void cross_backward_epilogue_kernel(const float* __restrict__ x0, std::int64_t ld_x0,  // [B, N]
                                               const float* __restrict__ dy, std::int64_t ld_dy,  // [B, N]
                                               const float* __restrict__ bias,                    // [N]
                                               float* __restrict__ p,                             // [B, N] contiguous
                                               float* __restrict__ dx0, std::int64_t ld_dx0,      // [B, N]
                                               std::int64_t batch, std::int64_t n, bool first_layer) {
  const std::int64_t total = batch * n;
  for (std::int64_t e = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; e < total;
       e += std::int64_t{gridDim.x} * blockDim.x) {
    const std::int64_t i = e / n, j = e - i * n;
    const float g = dy[i * ld_dy + j];
    float& d = dx0[i * ld_dx0 + j];
    d = fmaf(g, p[e] + bias[j], first_layer ? d + g : d);
    p[e] = g * x0[i * ld_x0 + j];
  }
}

}  // namespace

void cross_forward_epilogue(const float* x0, std::int64_t ld_x0, const float* xl, std::int64_t ld_xl,
                            const float* bias, float* out, std::int64_t ld_out, std::int64_t batch, std::int64_t n,
                            cudaStream_t s) {
  cross_forward_epilogue_kernel<<<grid_stride_blocks(batch * n, kThreads), kThreads, 0, s>>>(x0, ld_x0, xl, ld_xl, bias,
                                                                                             out, ld_out, batch, n);
  FK_CUDA_CHECK_LAUNCH("cross_forward_epilogue");
}

void cross_backward_epilogue(const float* x0, std::int64_t ld_x0, const float* dy, std::int64_t ld_dy,
                             const float* bias, float* p, float* dx0, std::int64_t ld_dx0, std::int64_t batch,
                             std::int64_t n, bool first_layer, cudaStream_t s) {
  cross_backward_epilogue_kernel<<<grid_stride_blocks(batch * n, kThreads), kThreads, 0, s>>>(
      x0, ld_x0, dy, ld_dy, bias, p, dx0, ld_dx0, batch, n, first_layer);
  FK_CUDA_CHECK_LAUNCH("cross_backward_epilogue");
}

}  // namespace fk::cuda
