// The CUDA launchers of the norm family (rms_norm.cu), called by norm.cpp after every argument was
// checked.
#pragma once

#include "fusekit/ops/norm.hpp"

namespace fk::cuda {

void rms_norm_forward(const RmsNormForwardArgs& a, const RmsNormParams& p, const Stream* stream);
void rms_norm_backward(const RmsNormBackwardArgs& a, const RmsNormParams& p, const Stream* stream);

}  // namespace fk::cuda
