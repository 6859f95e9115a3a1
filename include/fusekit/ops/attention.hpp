// Attention with the options training needs (grouped-query heads, causal masks aligned top-left or
// bottom-right, sliding windows, a softcap) and its backward, on dense [B, H, S, D] batches or on
// variable-length sequences packed without padding. The plain forward,
// attention_forward(q, k, v, out, lse, causal, scale), is in primitives.hpp; the forward here
// computes the same function where the options are the plain ones.
#pragma once

#include <cstdint>

#include "fusekit/core/tensor.hpp"

namespace fk {

class Stream;

// Which keys query i sees, and the scores:
//   o = Sk - Sq when bottom_right, else 0 (the diagonal of a causal mask starts at key o)
//   key j visible to query i  iff  (window_left < 0 or j >= i + o - window_left)
//                              and (right < 0 or j <= i + o + right),
//   right = 0 when causal (whatever window_right says), else window_right (-1: unbounded)
//   s_ij = scale * q_i · k_j, or softcap * tanh(scale * q_i · k_j / softcap) when softcap > 0
// Top-left causal is torch SDPA's is_causal; bottom-right is FlashAttention's (2.1 and later) and
// what a decoder's last Sq queries against a cache of Sk keys need.
// Which GPU kernel runs attention_backward, for tests and benchmarks that compare them. automatic
// picks the fastest that takes the call (sm_90 wgmma, then mma.sync, then warp-per-row); the others
// force one and throw fk::Error naming backward_kernel when it cannot take the call. A CPU call
// runs the spec whatever this says. wgmma_sm90_tma_dq is the sm_90 kernel with dq added by TMA
// reduces of shared-memory tiles (what automatic takes on sm_90); wgmma_sm90 is the same kernel
// adding dq by f32 atomics from registers.
enum class AttentionBackwardKernel { automatic, wgmma_sm90, mma_sync, rowwise, wgmma_sm90_tma_dq };
// How many query rows a CTA of the sm_90 forward computes, for tests and benchmarks that compare
// them: automatic takes 192 (three consumer warpgroups) at D 64 and 128 (two) at D 128; rows_128
// and rows_192 force one where the sm_90 kernel takes the call (rows_192 at D 64 only: fk::Error
// naming forward_tile at D 128). The other kernels and the CPU spec ignore it.
enum class AttentionForwardTile { automatic, rows_128, rows_192 };

struct AttentionOptions {
  bool causal = false;
  bool bottom_right = false;
  std::int64_t window_left = -1;
  std::int64_t window_right = -1;
  float scale = 1.0f;
  float softcap = 0.0f;
  // Backward only: dq summed in a fixed order, so that the same inputs give the same bits on every
  // run, at the price of a second pass over the keys that recomputes the scores (tensor-core path).
  // The default adds each key block's share of dq by f32 atomics, whose order varies between
  // runs (a few ulps of f32 before the rounding to the dtype). dk and dv are deterministic either way.
  bool deterministic = false;
  AttentionBackwardKernel backward_kernel = AttentionBackwardKernel::automatic;
  AttentionForwardTile forward_tile = AttentionForwardTile::automatic;
};

// q [B, H, Sq, D]; k, v [B, Hk, Sk, D] with H a multiple of Hk (grouped-query attention: q head h
// reads k/v head h / (H / Hk)); out [B, H, Sq, D]; lse [B, H, Sq] f32 as attention_forward's
// (-inf for a row that sees no key, whose out is 0). One float dtype, 1 <= D <= 256. q, k, v and
// out may have any strides with stride 1 on D (Hugging Face's [B, S, H, D] projections seen as
// [B, H, S, D], rows padded past D); out's elements in distinct places; lse contiguous. On a GPU
// bf16/f16 at D 64 or 128 without window or softcap (grouped-query heads and either causal
// alignment included) run on the sm_90 tensor-core kernel, which reads and writes the tensors
// where they are (strides multiples of 8 elements, 16-byte aligned bases); everything else on a
// warp-per-row kernel (correct, not fast), which reads contiguous copies of strided tensors and
// copies out back.
void attention_forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                       const TensorView& lse, const AttentionOptions& opt, const Stream* stream = nullptr);

// dq [B, H, Sq, D], dk and dv [B, Hk, Sk, D] (overwritten; a k/v head's gradient summed over the
// q heads of its group) from dout [B, H, Sq, D] and the forward's q, k, v, out and lse, without
// the [Sq, Sk] matrices of a whole head in memory: P = exp(s - lse) recomputed, dP = dout vᵀ,
// dS = P ⊙ (dP - rowsum(dout ⊙ out)) (times the softcap's 1 - tanh²), dq = scale dS k,
// dk = scale dSᵀ q, dv = Pᵀ dout. Layouts as attention_forward's: every tensor but lse in any
// strides with stride 1 on D. On a GPU (sm_80 and later), bf16/f16 with D = 64, 96 or 128 run on
// tensor cores (FlashAttention-2's algorithm, mma.sync; P and dS rounded to the dtype before their
// products), every option; on sm_90 the calls with D 64 or 128, no window, no softcap and not
// deterministic run on the wgmma/TMA kernel (FlashAttention-3's) instead, reading and writing
// every tensor where it is; f32, other head dims (256 included) and older GPUs on warp-per-row
// kernels (correct, not fast). The kernels other than sm_90's read contiguous copies of strided
// tensors and write dq, dk, dv through contiguous ones. Scratch from the caching allocator: delta
// [B, H, Sq] f32, and on the tensor-core path without opt.deterministic a dq accumulator
// [B, H, Sq, D] f32.
void attention_backward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                        const TensorView& dout, const TensorView& lse, const TensorView& dq, const TensorView& dk,
                        const TensorView& dv, const AttentionOptions& opt, const Stream* stream = nullptr);

// A batch of sequences of different lengths packed without padding (FlashAttention's varlen
// layout, as flash_attn_varlen_func takes it): sequence b is the query tokens
// [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q and the key tokens [cu_seqlens_k[b],
// cu_seqlens_k[b + 1]) of k and v, and sees only its own keys. Every AttentionOptions applies per
// sequence, with that sequence's Sq and Sk (bottom-right causal aligns each sequence's last query
// with its last key). Lengths may be 0.
struct AttentionVarlen {
  TensorView cu_seqlens_q;        // [B + 1] i32, B >= 1: 0, then the running total of the query lengths
  TensorView cu_seqlens_k;        // [B + 1] i32: the same for the keys
  std::int64_t max_seqlen_q = 0;  // >= every query length: the GPU grid's extent over a sequence
  std::int64_t max_seqlen_k = 0;  // >= every key length
};

// attention_forward on a packed batch: q [total_q, H, D], k and v [total_k, Hk, D], out
// [total_q, H, D], lse [H, total_q] f32 (FlashAttention's varlen lse layout); one float dtype,
// 1 <= D <= 256, H a multiple of Hk; strides as attention_forward takes them (q, k, v sliced from
// one [total, 3, H, D] tensor, say). cu_seqlens on the tensors' device (host memory on the
// CPU, device memory on a GPU). On the CPU their values are checked: 0 first, non-decreasing,
// total_q (total_k) last, no length above max_seqlen. On a GPU only their shape, dtype and device
// are (reading B + 1 ints back would synchronise every call): the values are trusted, as
// FlashAttention trusts them. Wrong values there read out of bounds, and a sequence longer than its
// max_seqlen has its rows past max_seqlen left unwritten. On a GPU the kernels are
// attention_forward's (the sm_90 tensor-core kernel for bf16/f16 at D 64 or 128 without window or
// softcap, else the warp-per-row one).
void attention_forward_varlen(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                              const TensorView& lse, const AttentionVarlen& seqs, const AttentionOptions& opt,
                              const Stream* stream = nullptr);

// attention_backward on a packed batch: dq [total_q, H, D], dk and dv [total_k, Hk, D] (overwritten)
// from dout [total_q, H, D] and the varlen forward's q, k, v, out and lse [H, total_q]; seqs as
// attention_forward_varlen takes them (the same checks, the same trust on a GPU; the same
// layouts). The kernels are attention_backward's (sm_90's wgmma kernel where it takes the call,
// tensor cores for bf16/f16 at D 64, 96, 128 on sm_80+, every option and deterministic mode;
// warp-per-row otherwise). Scratch: delta [H, total_q] f32, and the f32 dq
// accumulator [total_q, H, D] on the tensor-core path without opt.deterministic.
void attention_backward_varlen(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                               const TensorView& dout, const TensorView& lse, const TensorView& dq,
                               const TensorView& dk, const TensorView& dv, const AttentionVarlen& seqs,
                               const AttentionOptions& opt, const Stream* stream = nullptr);

namespace reference {
// The spec, in double on host tensors, one query row at a time.
void attention_forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                       const TensorView& lse, const AttentionOptions& opt);
void attention_backward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                        const TensorView& dout, const TensorView& lse, const TensorView& dq, const TensorView& dk,
                        const TensorView& dv, const AttentionOptions& opt);
// The packed layout: each sequence as the dense spec computes it alone (cu_seqlens on the host,
// their values as attention_forward_varlen checks them).
void attention_forward_varlen(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                              const TensorView& lse, const AttentionVarlen& seqs, const AttentionOptions& opt);
void attention_backward_varlen(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                               const TensorView& dout, const TensorView& lse, const TensorView& dq,
                               const TensorView& dk, const TensorView& dv, const AttentionVarlen& seqs,
                               const AttentionOptions& opt);
}  // namespace reference

}  // namespace fk
