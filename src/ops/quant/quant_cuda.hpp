// The CUDA launchers of the quant family, called by quant.cpp after every argument was checked.
#pragma once

#include "fusekit/ops/quant.hpp"

namespace fk::cuda {

void pack(const TensorView& x, const PackedView& out, const PackParams& p, const Stream* stream);
void unpack(const PackedView& packed, const TensorView& out, const Stream* stream);
void relu_forward_packed(const TensorView& x, const TensorView& y, const TensorView& mask, const Stream* stream);
void relu_backward_packed(const TensorView& dy, const TensorView& mask, const TensorView& dx, const Stream* stream);
// weight_grad_from_packed.cu
void weight_grad_from_packed(const TensorView& dy, const PackedView& x, const TensorView& dw,
                             const WeightGradParams& p, const Stream* stream);

}  // namespace fk::cuda
