// Family `primitives`: the Triton puzzles as real ops, each with a CPU spec in
// fk::reference (the definition), a CUDA kernel and tests (docs/primitives.md has the details):
//   broadcast binary ops and outer ops, fused relu(x * y) forward and backward  (puzzles 1-6)
//   row_sum over rows of any length                                              (puzzle 7)
//   softmax over the last dimension, online statistics, rows of any length       (puzzle 8)
//   conv2d, stride 1, NCHW, 'valid' / 'same' / the puzzle's bottom-right padding  (puzzle 10)
//   batched_matmul, cuBLAS strided-batched and a CuTe tensor-core kernel          (puzzle 11)
// Every op validates all its arguments first and throws fk::Error(op, argument, expected, got);
// host tensors run the spec, CUDA tensors the kernels. Arithmetic is fp32 on the GPU (double in
// the spec) with one rounding to the output dtype at the store.
#pragma once

#include <optional>
#include <string_view>

#include "fusekit/core/tensor.hpp"

namespace fk {

class Stream;

// =============================================================================================
// Broadcast binary ops and outer ops (puzzles 1-6)
// =============================================================================================

// f(x, y) of a broadcast binary op. mul_relu is relu(x * y) fused (NaN propagates, like torch).
enum class BinaryOp { add, mul, mul_relu };
std::string_view binary_op_name(BinaryOp op) noexcept;  // "add", "mul", "mul_relu"

// z = f(x, y) with NumPy broadcasting: shapes are aligned on their last dimension, and each
// dimension of x and y is either z's or 1 (or absent, counting as 1). z's shape must be exactly
// the broadcast shape of x and y (z is never larger than needed). x, y, z: contiguous, one dtype
// (f32, bf16 or f16), rank <= kMaxRank; z may alias x or y when that operand has z's shape, and
// overlaps them in no other way. The product/sum is fp32, rounded once to z's dtype, so the GPU
// equals the spec exactly. Examples: x + 10 is broadcast_binary(add, x, ten, z) with ten of
// shape [1]; the outer op z[i, j] = f(x[j], y[i]) takes x as [1, N0] (or [N0]) and y as [N1, 1].
void broadcast_binary(BinaryOp op, const TensorView& x, const TensorView& y, const TensorView& z,
                      const Stream* stream = nullptr);

// The outer op of puzzles 3-5: z[i, j] = f(x[j], y[i]), x: [N0], y: [N1], z: [N1, N0].
void outer(BinaryOp op, const TensorView& x, const TensorView& y, const TensorView& z,
           const Stream* stream = nullptr);

// Backward of z = f(x, y) (broadcast_binary), given dz = dL/dz of z's shape. Overwrites
//   dx = sum over the dimensions x was broadcast along of  dz * df/dx
//   dy = the same for y,
// with df/dx = 1 (add), y (mul), y * [x*y > 0] (mul_relu; x*y computed in fp32 as the forward
// does, so the mask is exactly the forward's), and symmetrically for y. Either gradient may be
// absent (not computed). dx has x's shape and dtype, dy y's; dz the dtype of x; none of dx, dy
// overlaps an input or the other. Sums are fp32 in a fixed order (deterministic), against the
// spec's double sums within (terms summed) * 2^-23 relative to the sum of |terms|, plus one
// rounding to the dtype. Puzzle 6 is mul_relu with x [90, 100], y [90, 1]: dx = dz * y * [x*y > 0].
void broadcast_binary_backward(BinaryOp op, const TensorView& x, const TensorView& y, const TensorView& dz,
                               const std::optional<TensorView>& dx, const std::optional<TensorView>& dy,
                               const Stream* stream = nullptr);

// =============================================================================================
// Row reductions: row_sum (puzzle 7) and softmax (puzzle 8)
// =============================================================================================

// out[r] = sum_c x[r, c] for x [rows, cols] (f32, bf16 or f16), out [rows] in f32 or x's dtype,
// overwritten. Any cols, 0 included (sum = 0), a million and more: long rows are split across
// CTAs and the partial sums added in a fixed order, so the result is the same bits every run.
// fp32 accumulation: against the spec (double) within cols * 2^-23 * sum|x| (a bound; random
// signs give far less), plus one rounding to out's dtype.
void row_sum(const TensorView& x, const TensorView& out, const Stream* stream = nullptr);

// y[r, :] = softmax(x[r, :]) = exp(x - max) / sum exp(x - max) over each row of x [rows, cols],
// numerically stable for any finite input (values of +-1e4 included). x and y: one dtype (f32,
// bf16 or f16), same shape; y may be x itself (in place) and otherwise overlaps it not at all.
// One pass over the row gathers the statistics online (running max and the sum of exponentials
// rescaled whenever the max grows); rows of up to 32768 elements are held in registers (read
// once, written once), longer rows are split across CTAs whose (max, sum) pairs are merged and
// re-read for the output. A row of -inf gives NaN, like the spec (and torch). fp32 arithmetic:
// against the spec within 2^-16 relative to each output plus one rounding to y's dtype.
void softmax(const TensorView& x, const TensorView& y, const Stream* stream = nullptr);

// =============================================================================================
// conv2d (puzzle 10)
// =============================================================================================

// Where the KH-1 rows and KW-1 columns of zero padding go. valid: none, the output shrinks to
// (H-KH+1) x (W-KW+1). same: PyTorch's padding='same', (K-1)/2 before and the rest after.
// same_end: all after (bottom / right), the puzzle's: z[i, j] = sum k[a, b] x[i + a, j + b].
enum class Conv2dPadding { valid, same, same_end };
std::string_view conv2d_padding_name(Conv2dPadding p) noexcept;  // "valid", "same", "same_end"

// Cross-correlation (the kernel is not flipped), stride 1, no dilation, NCHW:
//   y[n, o, i, j] = sum_{c, a, b} w[o, c, a, b] * x[n, c, i + a - top, j + b - left]
// with x read as 0 outside [0, H) x [0, W). x: [N, C, H, W], w: [O, C, KH, KW] (KH, KW >= 1),
// y: [N, O, Ho, Wo] overwritten (Ho = H - KH + 1 for valid, H otherwise; likewise Wo); one dtype
// (f32, bf16 or f16), fp32 sums. y overlaps neither input. The puzzle's batched single-channel
// case is C = O = 1 with same_end: x [4, 1, 8, 8], w [1, 1, 4, 4]. Against the spec (double)
// within C*KH*KW * 2^-23 relative to sum |w x|, plus one rounding to y's dtype.
void conv2d(const TensorView& x, const TensorView& w, const TensorView& y, Conv2dPadding padding,
            const Stream* stream = nullptr);

namespace reference {  // the specs of the sections above
void broadcast_binary(BinaryOp op, const TensorView& x, const TensorView& y, const TensorView& z);
void broadcast_binary_backward(BinaryOp op, const TensorView& x, const TensorView& y, const TensorView& dz,
                               const std::optional<TensorView>& dx, const std::optional<TensorView>& dy);
void row_sum(const TensorView& x, const TensorView& out);
void softmax(const TensorView& x, const TensorView& y);
void conv2d(const TensorView& x, const TensorView& w, const TensorView& y, Conv2dPadding padding);
}  // namespace reference

// =============================================================================================
// batched_matmul (puzzle 11)
// =============================================================================================

// How batched_matmul runs on a GPU: cuBLAS strided-batched (the production path), or fusekit's
// tensor-core kernels (bf16/f16 operands only): on an sm_90 GPU, CUTLASS's SM90 GEMM (TMA +
// wgmma, warp-specialized) when K and N are multiples of 8 and a, b, c are 16-byte aligned;
// otherwise (and on other GPUs) an SM80-style CuTe kernel (mma.sync, cp.async).
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
