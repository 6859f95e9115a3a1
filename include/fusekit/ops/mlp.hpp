// Family `mlp`: a whole narrow MLP in one kernel (seed 003's "dot + bias + ReLU + dot + bias +
// sigmoid as one kernel"; tiny-cuda-nn's FullyFusedMLP is the model).
//
//   h_0 = x                                         x: [batch, in]
//   h_l = act_l(h_{l-1} · W_lᵀ + b_l)               W_l: [out_l, in_l] (nn.Linear layout), b_l: [out_l]
//   y   = h_L                                       y: [batch, out]
//
// Shapes: L >= 2 layers; layer 0 maps `in` (1..128) to the hidden width H; layers 1..L-2 map H to
// H; layer L-1 maps H to `out` (1..128). H is one of 16, 32, 64, 128 and shared by every hidden
// layer (as in tiny-cuda-nn). act_l ∈ {identity, relu, sigmoid}.
//
// Numerics: bf16 or f16 everywhere (x, W, b, y share one dtype), products accumulated in fp32,
// bias and activation applied in fp32, and every layer's output rounded once to the dtype: the
// hidden activations are rounded exactly where an unfused per-layer run would store them, so the
// fused kernel and the per-layer path compute the same function.
//
// The CUDA kernel keeps every weight matrix in shared memory and the hidden activations in
// registers (the mma accumulator of one layer becomes the A operand of the next); it reads x and
// writes y once. The weights of all layers must fit in shared memory together (at most ~6 layers
// at H = 128 on H100); a larger MLP raises fk::Error.
#pragma once

#include <vector>

#include "fusekit/core/tensor.hpp"
#include "fusekit/ops/pointwise.hpp"

namespace fk {

class Stream;

struct MlpLayer {
  TensorView weight;                  // [out_l, in_l], row-major
  TensorView bias;                    // [out_l]
  Activation act = Activation::relu;  // identity, relu or sigmoid
};

struct FusedMlpForwardArgs {
  TensorView x;                // [batch, in]
  std::vector<MlpLayer> layers;
  TensorView y;                // [batch, out]; must not overlap x
};

// y = the MLP applied to every row of x (inference: nothing is saved for a backward).
void fused_mlp_forward(const FusedMlpForwardArgs& a, const Stream* stream = nullptr);

namespace reference {
// The spec: plain loops in double, each layer's output rounded to the dtype; host tensors only.
void fused_mlp_forward(const FusedMlpForwardArgs& a);
}  // namespace reference

}  // namespace fk
