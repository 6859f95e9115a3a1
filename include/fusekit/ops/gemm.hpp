// Family `gemm`: the one GEMM entry point of fusekit. Every other family, the nn layers, the
// models and the bench baselines call this; nothing else in the library calls cuBLAS's GEMMs.
//
//   z = alpha * op(a) op(b) + beta * c            op = identity or transpose, row-major operands
//   c = epilogue(z)                                 see GemmEpilogue
//
//   a     [M, K] (trans_a = n) or [K, M] (t)       f32, bf16 or f16
//   b     [K, N] (trans_b = n) or [N, K] (t)       a's dtype
//   c     [M, N]                                   a's dtype, or f32 for bf16 / f16 operands
//   bias  [N]                                      c's dtype (bias epilogues)
//   aux   [M, N]                                   c's dtype: the pre-activation a gelu_aux epilogue
//                                                  writes, and a dgelu epilogue reads
//   bias_grad [N] or [M]                           c's dtype: see the bgrad epilogues
//
// A batched GEMM gives a, b and c a leading batch dimension ([batch, rows, cols]); a or b may have
// batch stride 0 (one matrix for the whole batch). Rows may be padded: every matrix needs unit
// column stride and a row stride >= its row length, so a view of columns [0, n) of a wider buffer
// is fine (DLRM's 16-byte-aligned rows). beta = 0 overwrites c without reading it.
//
// Backends: on the CPU, f32 runs a blocked, vectorised float kernel (float accumulation, the CPU
// trainer's GEMM), then the spec's epilogue; bf16 and f16 run the spec (plain loops, double
// accumulation). On CUDA, `none` is cublasGemmEx (cublasGemmStridedBatchedEx when batched) and
// the other epilogues are one cublasLtMatmul with the epilogue fused, its algorithm chosen by
// cuBLASLt's heuristic once per shape and cached. allow_tf32 lets f32 operands run on TF32
// tensor cores (CUBLAS_COMPUTE_32F_FAST_TF32). The GPU result's error against the spec is that of
// fp32 accumulation in the operands' precision; tests/ops/gemm_test.cpp holds it, normwise, to
// 1e-5 for f32 (1e-4 with a GELU epilogue: cuBLASLt's fast tanh), 2e-3 for TF32 and 1e-2 for bf16
// and f16 outputs (one rounding to 8 or 11 bits). Epilogues other than none need beta = 0 and an
// unbatched problem, the bias-gradient ones alpha = 1.
#pragma once

#include <optional>
#include <string_view>

#include "fusekit/core/tensor.hpp"

namespace fk {

class Stream;

enum class Trans { n, t };

enum class GemmEpilogue {
  none,       // c = z
  bias,       // c = z + bias[col]
  relu,       // c = max(z, 0)
  relu_bias,  // c = max(z + bias[col], 0)
  gelu,       // c = gelu(z), the tanh approximation (cuBLASLt's)
  gelu_bias,  // c = gelu(z + bias[col])
  // As gelu_bias, also writing the pre-activation z + bias[col] to aux (what dgelu reads).
  gelu_aux_bias,
  // Backward through a gelu: c = z * gelu'(aux), aux the forward's pre-activation.
  dgelu,
  // As dgelu, also bias_grad[col] = sum over rows of c (the previous layer's bias gradient).
  dgelu_bgrad,
  // c = z, and bias_grad[row] = sum over k of op(a)[row, k]: with a = dy [B, out] and
  // trans_a = t (required), the weight gradient dW = dyᵀ x and the bias gradient sum_b dy in one
  // call.
  bgrad_a,
};

std::string_view gemm_epilogue_name(GemmEpilogue e) noexcept;

struct GemmParams {
  Trans trans_a = Trans::n;
  Trans trans_b = Trans::n;
  float alpha = 1.0f;
  float beta = 0.0f;
  GemmEpilogue epilogue = GemmEpilogue::none;
  bool allow_tf32 = false;  // f32 operands on TF32 tensor cores (GPU)
};

struct GemmArgs {
  TensorView a, b, c;
  std::optional<TensorView> bias = std::nullopt;       // bias, relu_bias, gelu_bias, gelu_aux_bias
  std::optional<TensorView> aux = std::nullopt;        // gelu_aux_bias (written), dgelu and dgelu_bgrad (read)
  std::optional<TensorView> bias_grad = std::nullopt;  // dgelu_bgrad [N], bgrad_a [M] (overwritten)
};

// Validates every argument (fk::Error naming it), then runs on the tensors' device. c may not
// alias a, b, bias or aux.
void gemm(const GemmArgs& args, const GemmParams& params = {}, const Stream* stream = nullptr);

// The common case: c = op(a) op(b), no epilogue.
inline void matmul(const TensorView& a, const TensorView& b, const TensorView& c, Trans trans_a = Trans::n,
                   Trans trans_b = Trans::n, const Stream* stream = nullptr, bool allow_tf32 = false) {
  GemmParams p;
  p.trans_a = trans_a;
  p.trans_b = trans_b;
  p.allow_tf32 = allow_tf32;
  gemm({a, b, c, {}, {}, {}}, p, stream);
}

}  // namespace fk
