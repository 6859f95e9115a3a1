// The CUDA launcher of the mlp family (fused_mlp.cu), called by mlp.cpp after every argument was
// checked, and the shared-memory budget that decides whether an MLP fits the fused kernel.
#pragma once

#include <cstddef>
#include <cstdint>

#include "fusekit/ops/mlp.hpp"

namespace fk::cuda {

// Warps per CTA of the fused kernel; each warp owns 16 rows at a time.
inline constexpr int kMlpWarps = 8;
// Layers the kernel's parameter block holds.
inline constexpr int kMlpMaxLayers = 32;

inline std::int64_t round_up(std::int64_t v, std::int64_t m) { return (v + m - 1) / m * m; }

// Shared memory of the fused kernel: every weight matrix, zero-padded to 16 columns and 16 rows,
// with rows 8 elements longer than the padded width (ldmatrix rows 16 bytes apart modulo 128:
// conflict-free), fp32 biases, and one staging tile of 16 input rows per warp.
inline std::size_t fused_mlp_smem_bytes(std::int64_t in, std::int64_t hidden, std::int64_t out, std::int64_t layers) {
  const std::int64_t k0 = round_up(in, 16), n_out = round_up(out, 16);
  const std::int64_t w = hidden * (k0 + 8) + (layers - 2) * hidden * (hidden + 8) + n_out * (hidden + 8);
  const std::int64_t bias = (layers - 1) * hidden + n_out;
  const std::int64_t stage = kMlpWarps * 16 * (k0 + 8);
  return static_cast<std::size_t>((w + stage) * 2 + bias * 4);
}

// The opt-in shared memory per block of the current device.
std::size_t fused_mlp_smem_limit();

void fused_mlp_forward(const FusedMlpForwardArgs& a, const Stream* stream);

}  // namespace fk::cuda
