// Family `pointwise`: the fused bias + scaled residual + activation, y = act(x + alpha * r + b),
// one pass over memory where eager code makes three (add, scale-add, activation); rotary position
// embedding over q and k in one pass (rope_forward / rope_backward, below); dtype conversion.
//
//   forward   y = act(z),  z = x + alpha * r + b[col]        x, r, y: [rows, cols]; b: [cols]
//   backward  dz = dy * act'(z);  dx = dz;  dr = alpha * dz;  db[c] = sum_rows dz[:, c]
//
// What the backward reads: for identity / relu / sigmoid / tanh the derivative is a function of
// the output y (relu: y > 0; sigmoid: y(1 - y); tanh: 1 - y^2), so the forward saves nothing
// beyond the y it returns (and y may overwrite x: the op works in place). gelu and silu
// need z itself: the forward writes it to `preact` when asked, and the backward reads it.
//
// Layout: each [rows, cols] tensor (x, r, y, preact; dy, saved, dx, dr) is row-major with inner
// stride 1 and its own row stride >= cols (rows may be padded, e.g. columns of a wider buffer);
// b and db are contiguous. Every tensor is of one dtype (f32, bf16 or f16); arithmetic is fp32,
// rounded once to the dtype at the store. db is accumulated in fp32 in a fixed order
// (deterministic) and written in f32 or the dtype of dy. y may be x itself, dx may be dy itself
// (the same view: sharing the data pointer requires the same strides).
#pragma once

#include <optional>
#include <string_view>

#include "fusekit/core/tensor.hpp"

namespace fk {

class Stream;

enum class Activation { identity, relu, sigmoid, tanh, gelu_tanh, gelu_erf, silu };

std::string_view activation_name(Activation a) noexcept;  // "relu", "gelu_tanh", ...
Activation parse_activation(std::string_view name);       // throws fk::Error
// True when act'(z) can be computed from y = act(z) alone.
bool derivative_from_output(Activation a) noexcept;

struct BiasActParams {
  Activation act = Activation::relu;
  float alpha = 1.0f;  // the residual's scale
};

struct BiasActForwardArgs {
  TensorView x;                     // [rows, cols]
  std::optional<TensorView> r;      // [rows, cols]; absent: z = x + b (add + activation)
  std::optional<TensorView> bias;   // [cols]; absent: no bias
  TensorView y;                     // [rows, cols]; may be x itself
  std::optional<TensorView> preact; // [rows, cols]; z is written here when present
};

void bias_act_forward(const BiasActForwardArgs& a, const BiasActParams& p,
                      const Stream* stream = nullptr);

// Which tensor the backward computes act'(z) from.
enum class SavedForBackward { output, preactivation };

struct BiasActBackwardArgs {
  TensorView dy;                    // [rows, cols]
  TensorView saved;                 // y or z, as `saved_kind` says; [rows, cols]
  SavedForBackward saved_kind = SavedForBackward::output;
  TensorView dx;                    // [rows, cols]; may be dy itself
  std::optional<TensorView> dr;     // [rows, cols]: alpha * dx, when r was given to the forward
  std::optional<TensorView> dbias;  // [cols], f32 or dy's dtype: overwritten with column sums of dx;
                                    // overlaps none of dy, saved, dx, dr
};

void bias_act_backward(const BiasActBackwardArgs& a, const BiasActParams& p,
                       const Stream* stream = nullptr);

namespace reference {
// The spec: plain loops over the same arguments, host tensors only, double accumulation for db.
void bias_act_forward(const BiasActForwardArgs& a, const BiasActParams& p);
void bias_act_backward(const BiasActBackwardArgs& a, const BiasActParams& p);
// act(z) and act'(z) in double, for the spec and for tests.
double activation(Activation act, double z);
double activation_grad(Activation act, double z);
}  // namespace reference

// Rotary position embedding, the half-rotation convention of GPT-NeoX and Hugging Face LLaMA's
// apply_rotary_pos_emb, over q and k in one launch:
//
//   forward   y = x * cos + rotate_half(x) * sin,       rotate_half(x) = cat(-x2, x1)
//             y1 = x1 c1 - x2 s1,  y2 = x2 c2 + x1 s2     (x1, x2: the halves of x's last dimension)
//   backward  dx = dy * cos + rotate_half_T(dy * sin),  rotate_half_T(g) = cat(g2, -g1)
//             dx1 = dy1 c1 + dy2 s2,  dx2 = dy2 c2 - dy1 s1
//
// for x = q and x = k alike, cos and sin broadcast over heads (and over the batch when they have
// none). The backward is the forward's transpose for any cos and sin; where their halves are equal
// (as Hugging Face's cat(freqs, freqs) makes them) it is the forward with sin negated.
//
// Layout: q [B, Hq, T, D] and k [B, Hk, T, D] (Hk may differ from Hq: grouped-query attention)
// with any non-negative strides on dims 0..2 and stride 1 on the last (so Hugging Face's q, a
// transposed view of [B, T, H, D], is read as it is); D even. cos and sin: [T, D], [1, T, D] or
// [B, T, D], any non-negative strides on the leading dims, stride 1 on the last. Outputs as their
// inputs (any strides on dims 0..2, stride 1 on the last); q_out may be q itself and k_out k itself
// (the same view), otherwise an output overlaps no other tensor.
// dtypes: q, k, q_out, k_out one of f32, bf16, f16; cos and sin both q's dtype or both f32.
// Arithmetic in fp32, one rounding to the dtype at the store.
struct RopeArgs {
  TensorView q;      // [B, Hq, T, D]; the backward: dL/dq_out
  TensorView k;      // [B, Hk, T, D]; the backward: dL/dk_out
  TensorView cos;    // [T, D], [1, T, D] or [B, T, D]
  TensorView sin;    // as cos
  TensorView q_out;  // [B, Hq, T, D]; the backward: dL/dq; may be q itself
  TensorView k_out;  // [B, Hk, T, D]; the backward: dL/dk; may be k itself
};

void rope_forward(const RopeArgs& a, const Stream* stream = nullptr);
void rope_backward(const RopeArgs& a, const Stream* stream = nullptr);
namespace reference {
// The spec: the formulas above in double over every element, host tensors only.
void rope_forward(const RopeArgs& a);
void rope_backward(const RopeArgs& a);
}  // namespace reference

// dst = src, each element converted to dst's dtype (f32, bf16 or f16; rounded to nearest even);
// with one dtype, a copy between layouts. Same shape and device; each side contiguous, or of rank
// <= 4 with stride 1 on the last dimension and non-negative strides on the others (rows [rows,
// cols] of a padded matrix, a transposed view of [B, S, H, D] memory: only the view's elements are
// read and written); dst's elements in distinct places. No overlap unless dst is src.
void convert(const TensorView& src, const TensorView& dst, const Stream* stream = nullptr);
namespace reference {
void convert(const TensorView& src, const TensorView& dst);
}  // namespace reference

}  // namespace fk
