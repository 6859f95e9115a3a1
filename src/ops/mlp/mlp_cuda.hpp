// The CUDA launchers of the mlp family (fused_mlp.cu), called by mlp.cpp after every argument was
// checked, and the shared-memory budgets that decide whether an MLP fits the fused kernels.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "fusekit/ops/mlp.hpp"

namespace fk::cuda {

// Warps per CTA of the fused kernel; each warp owns 16 rows at a time.
inline constexpr int kMlpWarps = 8;
// Layers the kernel's parameter block holds.
inline constexpr int kMlpMaxLayers = 32;

inline std::int64_t round_up(std::int64_t v, std::int64_t m) { return (v + m - 1) / m * m; }

// Elements of every weight matrix in shared memory, zero-padded to 16 columns and 16 rows, with
// rows 8 elements longer than the padded width (ldmatrix rows 16 bytes apart modulo 128:
// conflict-free). The forward and the backward kernel hold the weights alike.
inline std::int64_t fused_mlp_weight_elems(std::int64_t in, std::int64_t hidden, std::int64_t out, std::int64_t layers) {
  const std::int64_t k0 = round_up(in, 16), n_out = round_up(out, 16);
  return hidden * (k0 + 8) + (layers - 2) * hidden * (hidden + 8) + n_out * (hidden + 8);
}

// Bias elements of the MLP with the output layer padded to 16: the forward's fp32 biases and the
// backward's per-warp db accumulators.
inline std::int64_t fused_mlp_bias_elems(std::int64_t hidden, std::int64_t out, std::int64_t layers) {
  return (layers - 1) * hidden + round_up(out, 16);
}

// Shared memory of the forward kernel: the weights, fp32 biases, one staging tile of 16 input
// rows per warp and, for the training forward, one of 16 hidden rows per warp.
inline std::size_t fused_mlp_smem_bytes(std::int64_t in, std::int64_t hidden, std::int64_t out, std::int64_t layers,
                                        bool train) {
  const std::int64_t stage = kMlpWarps * 16 * (round_up(in, 16) + 8 + (train ? hidden + 8 : 0));
  return static_cast<std::size_t>((fused_mlp_weight_elems(in, hidden, out, layers) + stage) * 2 +
                                  fused_mlp_bias_elems(hidden, out, layers) * 4);
}

// Shared memory of the backward kernel: the weights and one fp32 db accumulator per warp.
inline std::size_t fused_mlp_backward_smem_bytes(std::int64_t in, std::int64_t hidden, std::int64_t out,
                                                 std::int64_t layers) {
  return static_cast<std::size_t>(fused_mlp_weight_elems(in, hidden, out, layers) * 2 +
                                  kMlpWarps * fused_mlp_bias_elems(hidden, out, layers) * 4);
}

// Shared memory of the backward kernel that also accumulates dW on chip (used when it fits):
// the weights, two [128, max(H, out) + 8] buffers of g, a ring of three [128, max(H, in) + 8]
// buffers of the layer inputs, [128, out + 8] of dy and of y, every dW_l in fp32 (padded to
// 16 x 16 blocks) and the per-warp db accumulators.
inline std::size_t fused_mlp_backward_fused_dw_smem_bytes(std::int64_t in, std::int64_t hidden, std::int64_t out,
                                                          std::int64_t layers) {
  const std::int64_t k0 = round_up(in, 16), n_out = round_up(out, 16);
  const std::int64_t rows = 16 * kMlpWarps;
  const std::int64_t g_buf = 2 * rows * (std::max(hidden, n_out) + 8), h_buf = 3 * rows * (std::max(hidden, k0) + 8);
  const std::int64_t dy_buf = 2 * rows * (n_out + 8);
  const std::int64_t dw = hidden * k0 + (layers - 2) * hidden * hidden + n_out * hidden;
  return static_cast<std::size_t>((fused_mlp_weight_elems(in, hidden, out, layers) + g_buf + h_buf + dy_buf) * 2 +
                                  (dw + kMlpWarps * fused_mlp_bias_elems(hidden, out, layers)) * 4);
}

// The opt-in shared memory per block of the current device.
std::size_t fused_mlp_smem_limit();

// The forward; `hidden` ([L-1, batch, H]): where the training forward stores the hidden layers'
// outputs, nullptr for inference.
void fused_mlp_forward(const FusedMlpForwardArgs& a, const TensorView* hidden, const Stream* stream);

void fused_mlp_backward(const FusedMlpBackwardArgs& a, const Stream* stream);

}  // namespace fk::cuda
