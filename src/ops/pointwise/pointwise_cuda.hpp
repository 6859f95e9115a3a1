// The CUDA launchers of the pointwise family (bias_act.cu), called by pointwise.cpp after every
// argument was checked.
#pragma once

#include "fusekit/ops/pointwise.hpp"

namespace fk::cuda {

void bias_act_forward(const BiasActForwardArgs& a, const BiasActParams& p, const Stream* stream);
void bias_act_backward(const BiasActBackwardArgs& a, const BiasActParams& p, const Stream* stream);

}  // namespace fk::cuda
