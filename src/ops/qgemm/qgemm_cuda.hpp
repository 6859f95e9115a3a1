// The CUDA launchers of the qgemm family, called by qgemm.cpp after every argument was checked.
#pragma once

#include "fusekit/ops/qgemm.hpp"

namespace fk::cuda {

// qgemm.cu
void qgemm(const TensorView& x, const QuantizedWeight& qw, const TensorView& y, const Stream* stream);
void dequantize_weights(const QuantizedWeight& qw, const TensorView& out, const Stream* stream);

}  // namespace fk::cuda
