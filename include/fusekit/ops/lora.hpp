// Family `lora`: a frozen linear layer with a trainable low-rank adapter (LoRA), its
// GEMM, the low-rank term, the bias and the activation fused.
//
//   t = s x Aᵀ                          t [M, r]        (the adapter's down-projection, scaled)
//   z = x Wᵀ + b + t Bᵀ                 z [M, N]        (pre-activation)
//   y = act(z)                          y [M, N]
//   x [M, K], W [N, K] (frozen), b [N], A [r, K], B [N, r], 1 <= r <= 64, s a float
//
// Forward on the GPU (sm_90, 16-bit operands): t is one skinny cuBLAS GEMM (a memory-bound pass
// over x); then ONE tensor-core GEMM x Wᵀ whose epilogue adds the rank-r term t Bᵀ onto the fp32
// accumulators with mma.sync (fragments of t and B read straight from L2), adds b, applies act and
// stores y. Neither x Wᵀ nor t Bᵀ reaches memory. docs/lora.md gives the design and the figures.
//
// Backward (W frozen: no dW). With g = dy ⊙ act'(z) and u = g B [M, r]:
//   dB = gᵀ t,   dA = s uᵀ x,   dx = g W + s u A,   db = Σ_m g
// act'(z) comes from the saved output y for identity / relu / sigmoid / tanh and from the saved
// pre-activation z (the forward's `preact`) for gelu and silu, as in the pointwise family. dx is
// one tensor-core GEMM g W with the rank-r term (s u) A added in its epilogue, like the forward.
// t may be passed from the forward (it writes it when asked); otherwise the backward recomputes
// it. Gradients are overwritten (=), never accumulated.
//
// Dtypes: every tensor has one dtype, f32, bf16 or f16; arithmetic in fp32 (the spec in double).
// t, g and u are rounded to the dtype where they are kept in memory. The fused kernels need
// Hopper (sm_90), bf16 or f16, and 16-byte rows (K % 8 == 0 and N % 8 == 0); everything else
// runs the same math unfused (cuBLAS GEMMs and a pointwise pass, allocating z).
#pragma once

#include <cstdint>
#include <optional>

#include "fusekit/core/tensor.hpp"
#include "fusekit/ops/pointwise.hpp"

namespace fk {

class Stream;

inline constexpr std::int64_t kLoraMaxRank = 64;

struct LoraParams {
  Activation act = Activation::identity;
  float scale = 1.0f;  // s, the adapter's alpha / r
};

struct LoraForwardArgs {
  TensorView x;                      // [M, K]
  TensorView w;                      // [N, K], frozen
  std::optional<TensorView> bias;    // [N]
  TensorView a;                      // [r, K]
  TensorView b;                      // [N, r]
  TensorView y;                      // [M, N]: act(z)
  std::optional<TensorView> t;       // [M, r]: s x Aᵀ written here when present
  std::optional<TensorView> preact;  // [M, N]: z written here when present
};
// Outputs (y, t, preact; dx, da, db, dbias) overlap no input and no other output; scale is finite.
void lora_forward(const LoraForwardArgs& args, const LoraParams& p, const Stream* stream = nullptr);

struct LoraBackwardArgs {
  TensorView dy;                     // [M, N]
  TensorView saved;                  // [M, N]: y or z, as saved_kind says
  SavedForBackward saved_kind = SavedForBackward::output;
  TensorView x;                      // [M, K]
  TensorView w;                      // [N, K]
  TensorView a;                      // [r, K]
  TensorView b;                      // [N, r]
  std::optional<TensorView> t;       // [M, r]: the forward's s x Aᵀ; recomputed when absent
  std::optional<TensorView> dx;      // [M, K]
  TensorView da;                     // [r, K]
  TensorView db;                     // [N, r]
  std::optional<TensorView> dbias;   // [N]
};
void lora_backward(const LoraBackwardArgs& args, const LoraParams& p, const Stream* stream = nullptr);

namespace reference {
// The spec: plain loops over host tensors, double accumulation, one rounding per output.
void lora_forward(const LoraForwardArgs& args, const LoraParams& p);
void lora_backward(const LoraBackwardArgs& args, const LoraParams& p);
}  // namespace reference

}  // namespace fk
