// The CUDA launchers of the glu family, called by glu.cpp after every argument was checked. All
// tensors are in the prepared layout (columns 2n, 2n + 1 of C are the pair (L[:, n], R[:, n])).
#pragma once

#include "fusekit/ops/glu.hpp"

namespace fk::cuda {

// glu_gemm.cu: the fused GEMM C = x wᵀ + b on Hopper tensor cores with the gated epilogue.
// Without dy: out [M, N] = glu(C). With dy: out = dC [M, 2N], the pairs (dy dglu/dl, dy dglu/dr),
// and, if db_partial (f32 [ceil(M / 16), 2N], contiguous) is given, its row s = the column sums of
// dC's rows 16 s .. 16 s + 15 (the fp32 values before dC's rounding): db = column_sums(db_partial).
// Without dy and with preact ([M, 2N], contiguous): the forward also writes C (bias included,
// rounded to the operand dtype) there.
// Returns false, having done nothing, when the device or the shape has no fused kernel
// (not sm_90, rows not 16-byte multiples, f32 without allow_tf32).
bool glu_gemm_fused(const TensorView& x, const TensorView& w, const TensorView* bias, const TensorView* dy,
                    const TensorView& out, const TensorView* db_partial, const TensorView* preact,
                    const GluOptions& opt, const Stream* stream);

// glu_gemm_dgrad.cu: the gated MLP's backward from kept pre-activations on Hopper tensor cores:
// dh = dy down_w (dy [M, K'], down_w [K', N], both contiguous) formed by a GEMM whose epilogue
// writes dpreact = dC [M, 2N] from dh and preact = C [M, 2N] (prepared order), and act [M, N] =
// glu(C) (the epilogue's D), as glu_pairs with dy = dh: dh never in memory. Any size; the op
// calls it only where it beats cuBLAS's dh and glu_pairs (glu.cpp, dgrad_fusion_pays).
// Returns false, having done nothing, when the device, dtype (16-bit only) or shape has no fused
// kernel (not sm_90; act null; K' or N not a multiple of 8; a pointer not 16-byte aligned).
bool glu_dgrad_fused(const TensorView& dy, const TensorView& down_w, const TensorView& preact,
                     const TensorView& dpreact, const TensorView* act, GluKind kind, const Stream* stream);

// glu_pairs.cu: the unfused epilogue as one memory-bound pass over a C [M, 2N] in memory.
// Without dy: out [M, N] = glu(C + b). With dy: out = dC [M, 2N], which may be c itself (dC
// written over C: each thread reads its elements of C before it writes the same ones of dC), and,
// when act is given, act [M, N] = glu(C + b) from the same read of C.
void glu_pairs(const TensorView& c, const TensorView* bias, const TensorView* dy, const TensorView& out,
               GluKind kind, const Stream* stream, const TensorView* act = nullptr);

// glu_pairs.cu: out [cols] = the column sums of a [rows, cols] (fp32 sums in a fixed order).
void column_sums(const TensorView& a, const TensorView& out, const Stream* stream);

}  // namespace fk::cuda
