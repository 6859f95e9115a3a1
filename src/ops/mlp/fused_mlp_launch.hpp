// The fused MLP's kernel parameter blocks and launchers, shared by the host side (fused_mlp.cu)
// and the kernels' translation units (fused_mlp_forward.cu, fused_mlp_backward.cu,
// fused_mlp_backward_fused_dw.cu). The launchers are instantiated for T = __nv_bfloat16 and
// __half and H = 16, 32, 64 and 128.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <functional>

#include "fusekit/ops/mlp.hpp"
#include "mlp_cuda.hpp"

namespace fk::cuda::mlp {

constexpr int kThreads = kMlpWarps * 32;
using u16 = unsigned short;

struct MlpParams {
  const u16* x;     // [batch, in]
  u16* y;           // [batch, out]
  u16* hidden;      // [L-1, batch, H]: the training forward's hidden outputs; nullptr for inference
  std::int64_t batch;
  int in, out, layers;
  const u16* w[kMlpMaxLayers];  // [out_l, in_l]
  const u16* b[kMlpMaxLayers];  // [out_l]
  Activation act[kMlpMaxLayers];
};

struct MlpBackwardParams {
  const u16* dy;      // [batch, out]
  const u16* y;       // [batch, out], the forward's output (act' of the output layer)
  const u16* hidden;  // [L-1, batch, H], the forward's hidden outputs
  const u16* x;       // [batch, in], the forward's input (the fused-dW kernel's dW_0)
  u16* dx;            // [batch, in]; nullptr: not computed
  u16* g_hidden;      // [L-1, batch, H]: g_0 .. g_{L-2}, read by the dW GEMMs
  u16* g_out;         // [batch, out]: g_{L-1}
  float* db_part;     // [gridDim.x, n_bias]: each CTA's column sums of every g
  std::int64_t batch;
  int in, out, layers;
  const u16* w[kMlpMaxLayers];  // [out_l, in_l]
  Activation act[kMlpMaxLayers];
};

struct DbOut {
  float* db[kMlpMaxLayers];  // [out_l]
};

// Rows of the batch one CTA takes at a time: 16 per warp.
constexpr int kChunkRows = 16 * kMlpWarps;

struct MlpFusedDwParams {
  MlpBackwardParams b;
  float* dw_part;                 // [gridDim.x, dw_total]: each CTA's dW_l, row-major per layer
  int dw_total;
  int dw_offset[kMlpMaxLayers];   // where dW_l starts in a CTA's row of dw_part
  int acc_offset[kMlpMaxLayers];  // where layer l's accumulator starts in shared memory (floats)
};

struct DwOut {
  float* dw[kMlpMaxLayers];
  int offset[kMlpMaxLayers + 1];  // offset[layers] = the total
};

// The forward kernel on a persistent grid sized by occupancy.
template <class T, int H>
void launch(const MlpParams& p, std::size_t smem, cudaStream_t stream);

// The backward kernel that stores every g_l (for cuBLAS dW GEMMs); returns its CTA count, after
// taking its db partials [CTAs, n_bias] from alloc_part (also returned in *db_part_out).
template <class T, int H>
int launch_backward(MlpBackwardParams p, std::size_t smem, cudaStream_t stream, float** db_part_out,
                    const std::function<float*(std::int64_t)>& alloc_part);

// The backward kernel with dW and db accumulated on chip, on `blocks` CTAs.
template <class T, int H>
void launch_backward_fused_dw(const MlpFusedDwParams& fp, int blocks, std::size_t smem, cudaStream_t stream);

// db_l = the CTAs' partial column sums part [blocks, n_bias] added in a fixed order.
void launch_bias_grad_sum(const float* part, int blocks, int n_bias, int hidden, int layers, int out, const DbOut& d,
                          cudaStream_t stream);

// dW_l = the CTAs' partial dW part [blocks, total] added in a fixed order.
void launch_weight_grad_sum(const float* part, int blocks, int total, int layers, const DwOut& d, cudaStream_t stream);

}  // namespace fk::cuda::mlp
