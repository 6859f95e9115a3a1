// Family `mlp`: a whole narrow MLP in one kernel (dot + bias + ReLU + ... + dot + bias + sigmoid,
// every layer's activations kept on chip; tiny-cuda-nn's FullyFusedMLP is the model).
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
// at H = 128 on H100); a larger MLP raises fk::Error. Training: a forward that also stores the
// hidden layers, and a backward whose gradients walk down the layers on chip (docs/mlp.md).
#pragma once

#include <optional>
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

// ---------------------------------------------------------------------------------------------
// Training. The forward also stores every hidden layer's output h_l (l = 0..L-2), rounded to the
// dtype exactly as the inference forward holds it, so that the backward reads what an unfused
// per-layer run would have stored. The backward is
//
//   g_{L-1} = dy ⊙ act'_{L-1}(y)                    (act' from the output: y > 0, y(1 - y), 1)
//   g_l     = (g_{l+1} · W_{l+1}) ⊙ act'_l(h_l)      dh accumulated in fp32, g_l rounded to the dtype
//   dx      = g_0 · W_0                              rounded to the dtype
//   dW_l    = g_lᵀ · h_{l-1}  (h_{-1} = x),  db_l = Σ_rows g_l      fp32, overwritten (not +=)
//
// dW and db are fp32 (master-gradient precision: a sum over 2^20 rows is worth more than 8
// bits), summed in a fixed order (deterministic).
// ---------------------------------------------------------------------------------------------

struct FusedMlpTrainForwardArgs {
  TensorView x;                // [batch, in]
  std::vector<MlpLayer> layers;
  TensorView y;                // [batch, out]; must not overlap x
  TensorView hidden;           // [L-1, batch, H]: h_0 .. h_{L-2}, the dtype of x; overwritten
};

void fused_mlp_forward_train(const FusedMlpTrainForwardArgs& a, const Stream* stream = nullptr);

struct FusedMlpBackwardArgs {
  TensorView dy;                   // [batch, out], the dtype of x
  TensorView x;                    // [batch, in], the forward's input
  TensorView hidden;               // [L-1, batch, H], from fused_mlp_forward_train
  TensorView y;                    // [batch, out], the forward's output (read when act_{L-1} != identity)
  std::vector<MlpLayer> layers;    // the forward's layers
  std::optional<TensorView> dx;    // [batch, in], the dtype of x; absent: not computed
  std::vector<TensorView> dweight; // one per layer, [out_l, in_l] f32
  std::vector<TensorView> dbias;   // one per layer, [out_l] f32
};

void fused_mlp_backward(const FusedMlpBackwardArgs& a, const Stream* stream = nullptr);

namespace reference {
// The spec: plain loops in double, each layer's output rounded to the dtype; host tensors only.
// The reference functions also take f32 tensors (rounding to f32), for finite-difference checks.
void fused_mlp_forward(const FusedMlpForwardArgs& a);
void fused_mlp_forward_train(const FusedMlpTrainForwardArgs& a);
void fused_mlp_backward(const FusedMlpBackwardArgs& a);
}  // namespace reference

}  // namespace fk
