// The CUDA launchers of the pointwise family (bias_act.cu, convert.cu, rope.cu), called by pointwise.cpp after every
// argument was checked.
#pragma once

#include "fusekit/ops/pointwise.hpp"

namespace fk::cuda {

void bias_act_forward(const BiasActForwardArgs& a, const BiasActParams& p, const Stream* stream);
void bias_act_backward(const BiasActBackwardArgs& a, const BiasActParams& p, const Stream* stream);
// dst [rows, cols] (row stride ld_dst) = src [rows, cols] (row stride ld_src) in dst's dtype.
void convert(const TensorView& src, std::int64_t ld_src, const TensorView& dst, std::int64_t ld_dst,
             std::int64_t rows, std::int64_t cols, const Stream* stream);
// rope_forward (backward false) or rope_backward over q and k in one launch.
void rope(const RopeArgs& a, bool backward, const Stream* stream);

}  // namespace fk::cuda
