// The fused GLU GEMM's kernels of kind swiglu, every direction (forward, forward keeping C,
// backward), every dtype and tile configuration (glu_gemm.cuh). One kind per translation unit:
// see glu_gemm.cuh.
#include "glu_gemm.cuh"

namespace fk::cuda {

template void glu_gemm_run<GluKind::swiglu>(const TensorView&, const TensorView&, const TensorView*, const TensorView*,
                                        const TensorView&, const TensorView*, const TensorView*, bool,
                                        const Stream*);

}  // namespace fk::cuda
