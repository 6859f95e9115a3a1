// Sigmoid + binary cross-entropy (contracts in recsys_cuda.hpp).
//
// Fused: one pass over the logits and labels computes the loss stably from the logit
// (max(x, 0) - x y + log1p(exp(-|x|))) and dlogit = (sigmoid(x) - y) / B; each block's losses are
// summed in double in a fixed order into a per-block partial, and one thread adds the partials in
// block order into the caller's device accumulator (no host round trip, so a CUDA graph can
// capture the step). The baseline runs what PyTorch's BCELoss on sigmoid(x) runs: three kernels,
// the loss from the probability with the log clamped at -100.
#include <algorithm>
#include <cstdint>

#include "fusekit/core/cuda_check.hpp"
#include "ops/common/cuda_common.cuh"
#include "ops/common/grid_stride.cuh"
#include "recsys_cuda.hpp"

namespace fk::cuda {

namespace {

constexpr int kThreads = 256;

constexpr int kLossThreads = 1024;

__device__ double block_sum(double v) {
  __shared__ double s[kLossThreads];
  s[threadIdx.x] = v;
  __syncthreads();
  for (int w = kLossThreads / 2; w > 0; w >>= 1) {
    if (threadIdx.x < w) s[threadIdx.x] += s[threadIdx.x + w];
    __syncthreads();
  }
  return s[0];
}

// Per block: the losses of its samples (fixed order) into partial[block]; the final kernel adds
// the partials in order. Deterministic.
constexpr int kLossBlocks = 64;
static_assert(kLossAccDoubles == 2 + kLossBlocks, "loss_acc holds the two accumulators and one partial per block");

__global__ void bce_fused_kernel(const float* logits, const float* labels, std::int64_t batch, float* dlogits,
                                 double* partial) {
  double acc = 0.0;
  const float inv_b = 1.0f / static_cast<float>(batch);
  for (std::int64_t i = blockIdx.x * std::int64_t{kLossThreads} + threadIdx.x; i < batch;
       i += std::int64_t{kLossThreads} * gridDim.x) {
    const float x = logits[i], y = labels[i];
    acc += static_cast<double>(fmaxf(x, 0.0f) - x * y + log1pf(expf(-fabsf(x))));
    dlogits[i] = (1.0f / (1.0f + expf(-x)) - y) * inv_b;
  }
  const double total = block_sum(acc);
  if (threadIdx.x == 0) partial[blockIdx.x] = total;
}

__global__ void loss_final_kernel(const double* partial, int blocks, std::int64_t batch, double* loss_acc) {
  if (threadIdx.x != 0) return;
  double s = 0.0;
  for (int k = 0; k < blocks; ++k) s += partial[k];
  loss_acc[0] += s / static_cast<double>(batch);
  loss_acc[1] += 1.0;
}

__global__ void sigmoid_kernel(const float* x, float* p, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n; i += std::int64_t{gridDim.x} * blockDim.x)
    p[i] = 1.0f / (1.0f + expf(-x[i]));
}

__global__ void bce_reference_kernel(const float* p, const float* labels, std::int64_t batch, double* loss_acc) {
  double acc = 0.0;
  for (std::int64_t i = threadIdx.x; i < batch; i += kLossThreads) {
    const float y = labels[i];
    acc -= static_cast<double>(y * fmaxf(logf(p[i]), -100.0f) + (1.0f - y) * fmaxf(logf(1.0f - p[i]), -100.0f));
  }
  const double total = block_sum(acc);
  if (threadIdx.x == 0) {
    loss_acc[0] += total / static_cast<double>(batch);
    loss_acc[1] += 1.0;
  }
}

__global__ void dlogit_kernel(const float* p, const float* labels, std::int64_t batch, float* dlogits) {
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < batch; i += std::int64_t{gridDim.x} * blockDim.x)
    dlogits[i] = (p[i] - labels[i]) / static_cast<float>(batch);
}

}  // namespace

void sigmoid_bce_fused(const float* logits, const float* labels, std::int64_t batch, float* dlogits,
                       double* loss_acc, cudaStream_t s) {
  // loss_acc has room for kLossBlocks partials after its two accumulators.
  const int blocks = static_cast<int>(std::min<std::int64_t>(kLossBlocks, (batch + kLossThreads - 1) / kLossThreads));
  bce_fused_kernel<<<blocks, kLossThreads, 0, s>>>(logits, labels, batch, dlogits, loss_acc + 2);
  FK_CUDA_CHECK_LAUNCH("sigmoid_bce_fused");
  loss_final_kernel<<<1, 32, 0, s>>>(loss_acc + 2, blocks, batch, loss_acc);
  FK_CUDA_CHECK_LAUNCH("sigmoid_bce_fused");
}

void sigmoid(const float* x, float* p, std::int64_t n, cudaStream_t s) {
  sigmoid_kernel<<<grid_stride_blocks(n), kThreads, 0, s>>>(x, p, n);
  FK_CUDA_CHECK_LAUNCH("sigmoid");
}

void sigmoid_bce_reference(const float* logits, const float* labels, std::int64_t batch, float* p, float* dlogits,
                           double* loss_acc, cudaStream_t s) {
  sigmoid(logits, p, batch, s);
  bce_reference_kernel<<<1, kLossThreads, 0, s>>>(p, labels, batch, loss_acc);
  FK_CUDA_CHECK_LAUNCH("sigmoid_bce_reference");
  dlogit_kernel<<<grid_stride_blocks(batch), kThreads, 0, s>>>(p, labels, batch, dlogits);
  FK_CUDA_CHECK_LAUNCH("sigmoid_bce_reference");
}

}  // namespace fk::cuda
