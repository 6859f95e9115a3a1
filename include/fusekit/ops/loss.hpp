// Family `loss`: an LM head's linear layer fused with cross-entropy, and the gradients of that
// loss in the same pass; the [N, V] logits never exist in full.
//
//   z = h wᵀ + b                                     z [N, V]   (never stored whole)
//   lse_i = log Σ_j exp z_ij
//   loss_i = (1 − ε)(lse_i − z_{i,t_i}) + ε (lse_i − (1/V) Σ_j z_ij) + ζ lse_i²
//   loss = Σ_{i: t_i ≠ ignore} loss_i / D             D = that count (mean) or 1 (sum)
//   h [N, H], w [V, H], b [V] (optional), targets i64 [N]
//
// ε is F.cross_entropy's label_smoothing, ζ PaLM's z-loss coefficient. Rows whose target is
// ignore_index contribute nothing (and get a zero gradient). A mean over zero rows is 0/0 = NaN,
// as F.cross_entropy gives. A target outside [0, V) other than ignore_index is an fk::Error naming
// the row and the value.
//
// Gradients of `loss` (each output optional, each overwritten, never accumulated):
//   g_ij = (p_ij (1 + 2 ζ lse_i) − (1 − ε)[j = t_i] − ε / V) / D,   p = softmax(z)   (0 for ignored rows)
//   dh = g w [N, H] (h's dtype),  dw = gᵀ h [V, H] (w's dtype),  dbias = Σ_i g_i [V] (b's dtype)
// Skip dw and dbias when the head is frozen (LoRA), every gradient for evaluation.
//
// On the GPU (Liger-Kernel's design): N is split into chunks of C rows; per chunk, z_c = h_c wᵀ
// by cuBLAS into a buffer [C, V] in the operands' dtype (bf16 / f16 operands with f32 accumulation,
// rounded once, as F.linear's logits are; f32 operands on TF32 only when allow_tf32), one kernel per
// chunk computes each row's max, lse and loss in f32 and overwrites the row in place with g, then
// dh_c = g_c w, dw += g_cᵀ h_c and dbias += 1ᵀ g_c (cuBLAS, beta = 1 into f32 accumulators,
// converted once at the end for 16-bit w). The count D is taken on the device first, so nothing
// waits on the host, except the check of the targets (check_targets), which reads one flag back
// before any work is queued. Scratch: the chunk's logits (C ceil8(V) values: auto C keeps them
// near 512 MiB, or one chunk up to 1 GiB), f32 accumulators for dw and dbias when w is 16-bit, and N floats of row losses;
// all from the caching allocator.
//
// Accuracy: 16-bit operands give 16-bit logits (one rounding of each, as the eager expression
// F.cross_entropy(F.linear(h, w).float(), t) has), so the loss is within a few units of the
// dtype's roundoff times |logits| (tests hold bf16 to 2e-2, f16 to 4e-3 relative); f32's within
// f32's. The gradients carry one rounding of g to the operands' dtype before the two GEMMs, so
// their normwise relative error against the spec is about that dtype's unit roundoff (tests hold
// bf16 to 1e-2, f16 to 2e-3, f32 to 1e-4, TF32 to 5e-3).
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

#include "fusekit/core/tensor.hpp"

namespace fk {

class Stream;

enum class LossReduction { mean, sum };

std::string_view loss_reduction_name(LossReduction r) noexcept;
// "mean" or "sum"; throws fk::Error naming `op` and argument "reduction" otherwise.
LossReduction parse_loss_reduction(std::string_view name, const char* op);

struct LinearCrossEntropyParams {
  std::int64_t ignore_index = -100;
  float label_smoothing = 0.0f;  // ε in [0, 1]
  float z_loss = 0.0f;           // ζ >= 0, finite; 0 = off
  LossReduction reduction = LossReduction::mean;
  // Rows per chunk on the GPU; 0 picks them so that the chunk's logits take about 512 MiB (at
  // least 4096 rows), or one chunk up to 1 GiB of logits plus the accumulators it does not need
  // (linear_cross_entropy_chunk_rows).
  std::int64_t chunk_rows = 0;
  bool allow_tf32 = false;  // f32 operands on TF32 tensor cores (GPU)
  // GPU: read back, before queuing the work, whether every target is in [0, V) or ignore_index,
  // and throw if not (one host synchronisation). Off: nothing waits; a bad target's row gets a NaN
  // loss and NaN gradients, so the loss is NaN, and nothing is written out of bounds.
  bool check_targets = true;
};

struct LinearCrossEntropyArgs {
  TensorView h;                     // [N, H]      f32, bf16 or f16
  TensorView w;                     // [V, H]      h's dtype
  std::optional<TensorView> bias;   // [V]         h's dtype
  TensorView targets;               // [N]         i64
  TensorView loss;                  // [] or [1]   f32
  std::optional<TensorView> dh;     // [N, H]      h's dtype
  std::optional<TensorView> dw;     // [V, H]      w's dtype
  std::optional<TensorView> dbias;  // [V]         b's dtype (needs bias)
};

// Validates every argument (fk::Error naming it), then runs on the tensors' device. Outputs
// overlap no input and no other output.
void linear_cross_entropy(const LinearCrossEntropyArgs& args, const LinearCrossEntropyParams& p = {},
                          const Stream* stream = nullptr);

// The chunk rows the GPU path uses for N rows and V classes with logits of dtype `logits` (the
// operands'), p.chunk_rows when set. accumulator_bytes: the f32 accumulators that several chunks
// of 16-bit dw and dbias need (4 V H + 4 V) and one chunk does not; N rows are one chunk when
// their logits fit in 1 GiB and those accumulators together.
std::int64_t linear_cross_entropy_chunk_rows(std::int64_t n, std::int64_t v, std::int64_t chunk_rows = 0,
                                             DType logits = DType::f32, std::int64_t accumulator_bytes = 0);

namespace reference {
// The spec: plain loops over host tensors in double, one rounding per output.
void linear_cross_entropy(const LinearCrossEntropyArgs& args, const LinearCrossEntropyParams& p);
}  // namespace reference

}  // namespace fk
