// The CUDA launchers of the pointwise family (bias_act.cu, convert.cu, rope.cu), called by pointwise.cpp after every
// argument was checked.
#pragma once

#include "fusekit/ops/pointwise.hpp"
#include "pointwise_walk.hpp"

namespace fk::cuda {

void bias_act_forward(const BiasActForwardArgs& a, const BiasActParams& p, const Stream* stream);
void bias_act_backward(const BiasActBackwardArgs& a, const BiasActParams& p, const Stream* stream);
// dst = src in dst's dtype, each walked as rows (ConvertWalk).
void convert(const TensorView& src, const ConvertWalk& ws, const TensorView& dst, const ConvertWalk& wd,
             const Stream* stream);
// rope_forward (backward false) or rope_backward over q and k in one launch.
void rope(const RopeArgs& a, bool backward, const Stream* stream);

}  // namespace fk::cuda
