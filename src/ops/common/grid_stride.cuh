// The grid of a grid-stride loop: the launch helper of fusekit's simple elementwise kernels.
#pragma once

#include <cstdint>

namespace fk::cuda {

// Blocks of `threads` for a grid-stride loop over n elements: enough for one element per thread,
// at least 1 and at most 2^20.
inline unsigned grid_stride_blocks(std::int64_t n, int threads = 256) {
  const std::int64_t b = (n + threads - 1) / threads;
  return static_cast<unsigned>(b < 1 ? 1 : b > (1 << 20) ? (1 << 20) : b);
}

}  // namespace fk::cuda
