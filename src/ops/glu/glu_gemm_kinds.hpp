// The fused GLU GEMM of one kind (kernels in glu_gemm.cuh), compiled one kind per translation unit
// (glu_gemm_<kind>.cu, each an explicit instantiation) and called by glu_gemm_fused (glu_gemm.cu)
// after its checks.
#pragma once

#include "fusekit/ops/glu.hpp"

namespace fk::cuda {

// Without dy: the forward, out [M, N], and C [M, 2N] to preact unless it is null. With dy: the
// backward, out = dC [M, 2N] and db_partial (or null); see glu_gemm_fused. many_tiles: more than two waves of 128 x 256 tiles, run with the
// ping-pong configuration (16-bit operands; f32 always runs the cooperative one).
template <GluKind K>
void glu_gemm_run(const TensorView& x, const TensorView& w, const TensorView* bias, const TensorView* dy,
                  const TensorView& out, const TensorView* db_partial, const TensorView* preact, bool many_tiles,
                  const Stream* stream);

}  // namespace fk::cuda
