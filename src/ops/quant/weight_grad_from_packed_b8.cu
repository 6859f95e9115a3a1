// weight_grad_from_packed's kernels for 8-bit activations: one translation unit per bit width, so
// that the builds of the widths run in parallel.
#include "weight_grad_kernel.cuh"

namespace fk::cuda::wgrad {

template <>
void launch_main<8, false>(const Params& p, unsigned ctas, const CUtensorMap& map_dy, const CUtensorMap& map_x,
                           cudaStream_t s) {
  launch_kernels<8, false>(p, ctas, map_dy, map_x, s);
}

template <>
void launch_main<8, true>(const Params& p, unsigned ctas, const CUtensorMap& map_dy, const CUtensorMap& map_x,
                           cudaStream_t s) {
  launch_kernels<8, true>(p, ctas, map_dy, map_x, s);
}

}  // namespace fk::cuda::wgrad
