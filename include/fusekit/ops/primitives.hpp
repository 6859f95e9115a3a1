// Family `primitives`: the Triton puzzles (seed 001) as real ops. So far: batched matmul
// (puzzle 11), whose tensor-core kernel is written with CuTe.
#pragma once

#include "fusekit/core/tensor.hpp"

namespace fk {

class Stream;

// How batched_matmul runs on a GPU: cuBLAS strided-batched (the production path), or fusekit's
// CuTe kernel (bf16/f16 operands only).
enum class BatchedMatmulImpl { cublas, cute };

// c[i] = a[i] @ b[i] for every batch i, fp32 accumulation (overwrites c).
//   a: [B, M, K], b: [B, K, N], c: [B, M, N], all row-major contiguous.
//   a and b share one dtype: f32, bf16 or f16; c is f32 or that dtype; c overlaps neither.
// Any sizes, zeros included (K = 0 gives c = 0). Against the spec (double sums), for operands
// of random sign: within K^1.5 * 2^-22 * max|a| * max|b| (fp32 summation) plus one ulp of c's
// dtype (final rounding); the tests hold both implementations to that.
// impl=cute with f32 operands throws fk::Error naming 'impl' on every device; otherwise the CPU
// path ignores `impl`.
void batched_matmul(const TensorView& a, const TensorView& b, const TensorView& c,
                    BatchedMatmulImpl impl = BatchedMatmulImpl::cublas, const Stream* stream = nullptr);

namespace reference {
void batched_matmul(const TensorView& a, const TensorView& b, const TensorView& c);
}  // namespace reference

}  // namespace fk

// ---------------------------------------------------------------------------------------------
// Attention (puzzle 9, FlashAttention-style forward)
// ---------------------------------------------------------------------------------------------
namespace fk {

// out = softmax(scale * q kᵀ + mask) v for every (batch, head), and the row statistics
//   lse[b, h, i] = log(sum_j exp(scale * q[b, h, i, :] · k[b, h, j, :]))   (natural log, over the
//   unmasked j), so that softmax row i is exp(scale * q_i · k_j - lse_i).
//   q: [B, H, Sq, D], k and v: [B, H, Sk, D], out: [B, H, Sq, D], all contiguous, one dtype
//   (f32, bf16 or f16); lse: [B, H, Sq] f32. 1 <= D <= 256; Sq, Sk >= 0.
//   causal: key j is visible to query i iff j <= i (aligned top-left, as torch SDPA is_causal).
//   scale: any finite float (1/sqrt(D) is the usual choice; puzzle 9 uses 1).
// Overwrites out and lse. A row that sees no key (Sk = 0) gets out = 0 and lse = -inf.
// The CUDA path never materialises the [Sq, Sk] score matrix: it streams k and v tiles through
// an online softmax with fp32 statistics and accumulators (docs/attention.md). On sm_90 GPUs,
// bf16/f16 with D = 64 or 128 run the wgmma/TMA kernel; every other supported case runs a simple
// warp-per-row kernel (correct, not fast). Accuracy against the spec (double), |v| <= 1: out
// within 4 units of roundoff of the dtype, absolute and relative (P is rounded to the dtype
// before P·v on the tensor cores, out once at the store): the tests hold bf16 to 2^-6, f16 to
// 2^-9, f32 to 1e-4 (fp32 dot products); lse within 1e-4 + 1e-5 |lse|.
// Errors: fk::Error naming the argument for wrong rank/shape/dtype/device, D outside [1, 256],
// a non-finite scale, out overlapping an input.
void attention_forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                       const TensorView& lse, bool causal, float scale, const Stream* stream = nullptr);

namespace reference {
void attention_forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                       const TensorView& lse, bool causal, float scale);
}  // namespace reference

}  // namespace fk
