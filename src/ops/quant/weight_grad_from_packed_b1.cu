// weight_grad_from_packed's kernels for 1-bit activations (x̂ through shared memory): one translation unit per bit width, so
// that the builds of the widths run in parallel.
#include "weight_grad_kernel.cuh"

namespace fk::cuda::wgrad {

template <>
void launch_main<1, false>(const Params& p, unsigned ctas, const CUtensorMap& map_dy, const CUtensorMap& map_x,
                           cudaStream_t s) {
  launch_kernels<1, false>(p, ctas, map_dy, map_x, s);
}

}  // namespace fk::cuda::wgrad
