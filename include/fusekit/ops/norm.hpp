// Family `norm`: RMSNorm, alone and fused with the residual add that precedes it in a pre-norm
// transformer block, forward and backward, each one pass over memory per row.
//
//   forward    s = x                        (rms_norm)
//              s = x + residual             (add_rms_norm: rounded to residual's dtype, as
//                                            PyTorch's `residual + hidden` is; to residual_out)
//              rstd[m] = 1 / sqrt(mean_n(s[m, n]^2) + eps)                         (f32)
//              out[m, n] = (s[m, n] * rstd[m]) * (weight[n] + offset)             (one rounding)
//   backward   g = dout * (weight + offset),  x^ = s * rstd
//              ds[m, n] = rstd[m] * (g - x^ * mean_n(g * x^)) + dresidual_out[m, n]
//              dx = ds (for add_rms_norm, also the residual's gradient: returned once;
//                       optionally also in dout's 16-bit dtype for f32 rows: dx_low)
//              dweight[n] = sum_m dout[m, n] * x^[m, n]
//
// offset is 0 for LLaMA's RMSNorm (weight * x^) and 1 for Gemma's ((1 + weight) * x^). Every
// product and sum is fp32 (rstd, mean_n(g * x^), dweight's sum over rows) with one rounding at each
// store; dweight is summed in a fixed order (per-block partials, then a reduction over them), so
// that the same inputs give the same bits.
//
// Layout: x, residual, out, residual_out, dout, dresidual_out, s and dx are [rows, cols], each row
// contiguous (inner stride 1) with its own row stride >= cols; weight, dweight [cols] and rstd [rows]
// are contiguous. Outputs overlap no input and no other output.
//
// Dtypes: s (residual, residual_out, dx, dresidual_out; x without a residual) bf16, f16 or f32; x
// with a residual of s's dtype, or bf16/f16 added to f32 rows (s = x + residual in f32, as
// PyTorch's f32 + bf16 gives); weight s's dtype or f32; out (and dout) of the promotion of s's and
// weight's dtypes, as Hugging Face's LlamaRMSNorm (`weight * x^.to(x.dtype)`) gives: s's dtype when
// the weight is of s's dtype, f32 when it is f32; or, for f32 rows and weight, bf16 or f16: the f32
// result rounded once, as autocast's cast in front of the GEMM that reads it would round it; rstd
// f32; dweight weight's dtype.
#pragma once

#include <optional>

#include "fusekit/core/tensor.hpp"

namespace fk {

class Stream;

// out's dtype for x's and weight's: the promotion of the two (x's, or f32 for an f32 weight).
DType rms_norm_out_dtype(DType x, DType weight);
// Whether out (and dout) may have dtype `out` for rows s and this weight: the promotion, or bf16/f16
// for f32 rows and weight.
bool rms_norm_out_dtype_allowed(DType s, DType weight, DType out);

struct RmsNormParams {
  float eps = 1e-6f;
  float offset = 0.0f;  // 0: weight * x^ (LLaMA); 1: (1 + weight) * x^ (Gemma)
};

struct RmsNormForwardArgs {
  TensorView x;                            // [rows, cols]
  std::optional<TensorView> residual;      // [rows, cols], s's dtype: present for add_rms_norm
  TensorView weight;                       // [cols]
  TensorView out;                          // [rows, cols]
  std::optional<TensorView> residual_out;  // [rows, cols], s's dtype: s = x + residual; with residual only
  TensorView rstd;                         // [rows], f32
};

void rms_norm_forward(const RmsNormForwardArgs& a, const RmsNormParams& p, const Stream* stream = nullptr);

struct RmsNormBackwardArgs {
  TensorView dout;                          // [rows, cols], out's dtype
  std::optional<TensorView> dresidual_out;  // [rows, cols], s's dtype: added to ds (add_rms_norm)
  TensorView s;                             // [rows, cols]: the normalized input (x, or residual_out)
  TensorView weight;                        // [cols]
  TensorView rstd;                          // [rows], f32, as the forward wrote it
  TensorView dx;                            // [rows, cols], s's dtype: overwritten with ds
  std::optional<TensorView> dweight;        // [cols], weight's dtype: overwritten; absent: not computed
  // [rows, cols], dout's dtype when that is bf16 or f16 and s is f32: ds again, rounded once from
  // f32 (the gradient of a 16-bit x added to f32 rows, as autocast's add_rms_norm has it, written
  // in the pass instead of cast from dx after); absent: not written.
  std::optional<TensorView> dx_low;
};

void rms_norm_backward(const RmsNormBackwardArgs& a, const RmsNormParams& p, const Stream* stream = nullptr);

namespace reference {
// The spec: plain loops over the same arguments, host tensors only, double arithmetic.
void rms_norm_forward(const RmsNormForwardArgs& a, const RmsNormParams& p);
void rms_norm_backward(const RmsNormBackwardArgs& a, const RmsNormParams& p);
}  // namespace reference

}  // namespace fk
