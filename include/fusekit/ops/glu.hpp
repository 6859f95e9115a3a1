// Family `glu`: a GEMM fused with a gated activation, the feed-forward block of modern
// LLMs.
//
//   C = x wᵀ + b,  x [M, K], w [2N, K], b [2N]        (a Linear with 2N outputs, as PyTorch stores it)
//   L = C[:, :N], R = C[:, N:]                         (torch.chunk order)
//   out[m, n] = glu(L[m, n], R[m, n])                  out [M, N]
//
//   kind          glu(l, r)
//   sigmoid_tanh  sigmoid(l) * tanh(r)      a sigmoid gate on a tanh value
//   swiglu        silu(l) * r               silu(l) = l * sigmoid(l)
//   geglu_tanh    l * gelu_tanh(r)          `z1 * F.gelu(z2, approximate='tanh')`
//   geglu_erf     l * gelu_erf(r)           ... with the exact gelu, F.gelu's default
//   reglu         relu(l) * r
//
// Kernel layout. `glu_prepare_weight` permutes the 2N rows of w (and the 2N entries of b) once so
// that left row n and right row n are neighbours: prepared row 2n is w[n], row 2n + 1 is w[N + n].
// The fused GEMM computes the prepared C [M, 2N] on the tensor cores and every thread of the
// epilogue holds the pair (L[m, n], R[m, n]) in two adjacent accumulator registers, so the
// activation costs a few instructions per output and C never reaches memory: the fused forward
// allocates nothing. Gradients of w and b come back in the same prepared layout (an optimizer can
// step prepared weights directly); `glu_unprepare_weight` converts back to PyTorch's.
//
// Backward, two ways (docs/glu.md says when to pick which):
// - recompute (glu_backward): the backward reruns the fused GEMM with an epilogue that reads dy
//   and writes dC = [dy * dglu/dl, dy * dglu/dr] in the prepared order, in the operand dtype (no
//   fp32 [M, 2N] buffer); then dx = dC w and dw = dCᵀ x are two cuBLAS GEMMs and db the column
//   sums of dC. Nothing but x is kept from the forward: three GEMMs in the backward.
// - keep (glu_forward with `preact`, then glu_backward_from_preact): the forward's epilogue also
//   writes C [M, 2N] (bias included, prepared order, operand dtype) beside out; the backward
//   reads it in one elementwise pass for dC (in place into C when the caller allows it), then the
//   same two GEMMs. M x 2N values per layer stay alive from forward to backward (128 MiB in bf16
//   at M = 4096, N = 8192) to skip one of the three GEMMs.
//
// Dtypes: x, w, b, out, dy and the gradients share one dtype: bf16, f16 or f32. 16-bit operands
// run on the tensor cores with fp32 accumulation. f32 operands run through TF32 only when
// `allow_tf32` is set (as torch.backends.cuda.matmul.allow_tf32); otherwise in full fp32 through
// cuBLAS and a separate activation pass (correct, not fused). The fused kernels need Hopper
// (sm_90) and rows of 16-byte multiples (K % 8 == 0 for 16-bit, K % 4 == 0 for f32); other GPUs
// and shapes take the same unfused path, which allocates the [M, 2N] C it needs.
#pragma once

#include <optional>
#include <string_view>

#include "fusekit/core/tensor.hpp"

namespace fk {

class Stream;

enum class GluKind { sigmoid_tanh, swiglu, geglu_tanh, geglu_erf, reglu };

std::string_view glu_kind_name(GluKind k) noexcept;  // "sigmoid_tanh", "swiglu", ...
GluKind parse_glu_kind(std::string_view name);       // throws fk::Error

struct GluOptions {
  GluKind kind = GluKind::swiglu;
  bool allow_tf32 = false;  // f32 operands: TF32 tensor cores (fused) instead of full fp32 (unfused)
};

// PyTorch layout -> kernel layout, for w [2N, K] or b [2N]: returns a new tensor on w's device.
Tensor glu_prepare_weight(const TensorView& w, const Stream* stream = nullptr);
// Kernel layout -> PyTorch layout (the inverse), e.g. for a prepared gradient.
Tensor glu_unprepare_weight(const TensorView& w_prepared, const Stream* stream = nullptr);

struct GluForwardArgs {
  TensorView x;                    // [M, K]
  TensorView w;                    // [2N, K], prepared
  std::optional<TensorView> bias;  // [2N], prepared
  TensorView out;                  // [M, N]
  // [M, 2N], prepared column order (2n: L[:, n], 2n + 1: R[:, n]): overwritten with C = x wᵀ + b,
  // rounded once to the operand dtype, for glu_backward_from_preact.
  std::optional<TensorView> preact = std::nullopt;
};
void glu_forward(const GluForwardArgs& a, const GluOptions& opt, const Stream* stream = nullptr);

struct GluBackwardArgs {
  TensorView dy;                    // [M, N]
  TensorView x;                     // [M, K], the forward's input
  TensorView w;                     // [2N, K], prepared
  std::optional<TensorView> bias;   // [2N], prepared: the forward's bias
  std::optional<TensorView> dx;     // [M, K]: overwritten with dC w
  std::optional<TensorView> dw;     // [2N, K]: overwritten with dCᵀ x (prepared layout)
  std::optional<TensorView> dbias;  // [2N]: overwritten with the column sums of dC (prepared)
};
void glu_backward(const GluBackwardArgs& a, const GluOptions& opt, const Stream* stream = nullptr);

// The backward from the pre-activations glu_forward kept: dC from preact and dy in one
// elementwise pass (accurate activations, fp32 arithmetic, dC rounded to the operand dtype), then
// dx, dw and db as glu_backward computes them. The forward's bias is inside preact already.
struct GluBackwardFromPreactArgs {
  TensorView dy;                    // [M, N]
  TensorView x;                     // [M, K], the forward's input
  TensorView w;                     // [2N, K], prepared
  TensorView preact;                // [M, 2N], prepared: GluForwardArgs::preact of the forward
  std::optional<TensorView> dx;     // [M, K]: overwritten with dC w
  std::optional<TensorView> dw;     // [2N, K]: overwritten with dCᵀ x (prepared layout)
  std::optional<TensorView> dbias;  // [2N]: overwritten with the column sums of dC (prepared)
  // The caller has no further use for preact: dC is written over it (no [M, 2N] allocation), and
  // preact's contents afterwards are unspecified.
  bool overwrite_preact = false;
  // [M, N], preact's dtype: overwritten with glu(L, R) (glu_activate's out) in the pass that forms
  // dC, for a backward that also needs the forward's out (the MLP's down projection's weight
  // gradient) without a second read of preact.
  std::optional<TensorView> out = std::nullopt;
  // [K', N], x's dtype: the gated MLP's down projection, whose output's gradient dy is then
  // ([M, K'] instead of [M, N]). The gradient of out, dy down_w, is formed here; on Hopper (16-bit
  // operands, out given, from one wave of output tiles of 128 x 128 (128) up) by one GEMM
  // whose epilogue computes dC and out from its fp32 accumulators with the fused forward's fast
  // activations (out within an ulp of glu_activate's), so that it never reaches memory;
  // elsewhere it is rounded to x's dtype before dC is formed.
  std::optional<TensorView> down_w = std::nullopt;
};
void glu_backward_from_preact(const GluBackwardFromPreactArgs& a, const GluOptions& opt,
                              const Stream* stream = nullptr);

// out [M, N] = glu(L, R) of the pre-activations glu_forward kept (bias included): the forward's out
// recomputed in one elementwise pass, for a backward that keeps C but not out (the MLP's down
// projection needs out for its weight gradient). Computed from C as rounded to the operand dtype,
// where the fused forward activates C's fp32 accumulators: the two differ by that rounding.
struct GluActivateArgs {
  TensorView preact;  // [M, 2N], prepared: GluForwardArgs::preact of the forward
  TensorView out;     // [M, N], preact's dtype
};
void glu_activate(const GluActivateArgs& a, const GluOptions& opt, const Stream* stream = nullptr);

// dC [M, 2N] = [dy ⊙ dglu/dL, dy ⊙ dglu/dR] of the pre-activations glu_forward kept: the
// elementwise first half of glu_backward_from_preact alone (fp32 arithmetic from C as rounded to
// the operand dtype, dC rounded once to it), for a caller that forms dx, dw and db itself (the
// weight gradient from a packed x: weight_grad_from_packed). preact and dpreact in the prepared
// column order; dpreact may be preact itself (written over it).
struct GluPreactGradArgs {
  TensorView dy;       // [M, N]
  TensorView preact;   // [M, 2N], prepared: GluForwardArgs::preact of the forward
  TensorView dpreact;  // [M, 2N], preact's dtype, prepared
  // [M, N], preact's dtype: overwritten with glu(L, R) in the same pass (as in
  // GluBackwardFromPreactArgs).
  std::optional<TensorView> out = std::nullopt;
};
void glu_preact_grad(const GluPreactGradArgs& a, const GluOptions& opt, const Stream* stream = nullptr);

namespace reference {
// The spec: plain loops on host tensors, in double, on the PyTorch layout (w and b unprepared;
// glu_forward's preact, when given, in the PyTorch column order [L | R]).
void glu_forward(const GluForwardArgs& a, const GluOptions& opt);
void glu_backward(const GluBackwardArgs& a, const GluOptions& opt);
// preact here is in the PyTorch column order ([L | R], as w unprepared); it is never overwritten.
void glu_backward_from_preact(const GluBackwardFromPreactArgs& a, const GluOptions& opt);
// preact in the PyTorch column order, as above.
void glu_activate(const GluActivateArgs& a, const GluOptions& opt);
// preact and dpreact in the PyTorch column order.
void glu_preact_grad(const GluPreactGradArgs& a, const GluOptions& opt);
// glu(l, r) and its two partial derivatives, in double.
double glu(GluKind k, double l, double r);
double glu_dl(GluKind k, double l, double r);
double glu_dr(GluKind k, double l, double r);
}  // namespace reference

}  // namespace fk
