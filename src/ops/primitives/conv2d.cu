// conv2d (puzzle 10): stride-1 cross-correlation, NCHW, zero padding `top` rows and `left`
// columns before the image (and whatever the output size implies after it).
//   y[n, o, i, j] = sum_{c, a, b} w[o, c, a, b] * x[n, c, i + a - top, j + b - left]
//
// A direct kernel, no performance target: a 16x16 block of threads covers a 16x16 tile of output
// pixels of one image and kOuts output channels; each thread keeps kOuts fp32 sums for its pixel
// and walks c, a, b. Neighbouring threads read neighbouring pixels of x (coalesced, reused from
// L1 across the KH x KW taps); the weights are the same address for the whole block (broadcast).
// No shared memory, any kernel size.
#include <algorithm>
#include <cstdint>
#include <string>

#include "fusekit/core/cuda_check.hpp"
#include "fusekit/core/tensor.hpp"
#include "ops/common/cuda_common.cuh"
#include "ops/common/activations.cuh"
#include "primitives_cuda.hpp"

namespace fk::cuda {
namespace {

constexpr int kTile = 16;
constexpr int kOuts = 4;

struct ConvShape {
  std::int64_t n, c, h, w, o, kh, kw, ho, wo, top, left;
};

template <class T>
__global__ void __launch_bounds__(kTile * kTile) conv2d_kernel(const T* x, const T* wt, T* y, ConvShape s) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.y) * kTile + threadIdx.y;  // output row
  const std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * kTile + threadIdx.x;  // output column
  const std::int64_t groups = (s.o + kOuts - 1) / kOuts;
  for (std::int64_t z = blockIdx.z; z < s.n * groups; z += gridDim.z) {
    const std::int64_t n = z / groups, o0 = (z % groups) * kOuts;
    if (i >= s.ho || j >= s.wo) continue;
    float acc[kOuts] = {};
    for (std::int64_t c = 0; c < s.c; ++c) {
      const T* xc = x + (n * s.c + c) * s.h * s.w;
      for (std::int64_t a = 0; a < s.kh; ++a) {
        const std::int64_t r = i + a - s.top;
        if (r < 0 || r >= s.h) continue;
        for (std::int64_t b = 0; b < s.kw; ++b) {
          const std::int64_t q = j + b - s.left;
          if (q < 0 || q >= s.w) continue;
          const float xv = device::to_float(xc[r * s.w + q]);
          for (int k = 0; k < kOuts; ++k) {
            const std::int64_t o = std::min(o0 + k, s.o - 1);  // past the last channel: computed, not stored
            acc[k] += device::to_float(wt[((o * s.c + c) * s.kh + a) * s.kw + b]) * xv;
          }
        }
      }
    }
    for (int k = 0; k < kOuts && o0 + k < s.o; ++k)
      y[((n * s.o + o0 + k) * s.ho + i) * s.wo + j] = device::from_float<T>(acc[k]);
  }
}

}  // namespace

void conv2d(const TensorView& x, const TensorView& w, const TensorView& y, std::int64_t top, std::int64_t left,
            const Stream* stream) {
  detail::DeviceScope on_device(x.device().index);
  const ConvShape s{x.size(0), x.size(1), x.size(2), x.size(3), w.size(0), w.size(2),
                    w.size(3), y.size(2), y.size(3), top,       left};
  const std::int64_t tiles_x = (s.wo + kTile - 1) / kTile, tiles_y = (s.ho + kTile - 1) / kTile;
  FK_CHECK_ARG(tiles_x <= 0x7fffffff && tiles_y <= 65535, "conv2d", "x",
               "an output of at most 65535 * 16 rows", std::to_string(s.ho) + " rows");
  const std::int64_t planes = s.n * ((s.o + kOuts - 1) / kOuts);
  const dim3 grid(static_cast<unsigned>(tiles_x), static_cast<unsigned>(tiles_y),
                  static_cast<unsigned>(std::min<std::int64_t>(planes, 65535)));
  const cudaStream_t st = detail::cuda_stream(stream);
  with_float_type(x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    conv2d_kernel<T><<<grid, dim3(kTile, kTile), 0, st>>>(x.data_as<T>(), w.data_as<T>(), y.data_as<T>(), s);
    FK_CUDA_CHECK_LAUNCH("conv2d_kernel");
  });
}

}  // namespace fk::cuda
