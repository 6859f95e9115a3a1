// The CUDA launchers of attention_forward and attention_backward (dense and varlen), called by
// attention.cpp after every argument was checked: dense q [B, H, Sq, D], k and v [B, Hk, Sk, D],
// lse [B, H, Sq] f32; packed (varlen non-null) q [total_q, H, D], k and v [total_k, Hk, D], lse
// [H, total_q] f32, varlen's cu_seqlens [B + 1] i32 on the device. out and the gradients like their
// inputs; on one CUDA device, one float dtype, 1 <= D <= 256, outputs overlapping no input. The
// sm_90 functions take any strides with stride 1 on D (they say which they launch on); the others
// contiguous tensors (attention.cpp copies). lse, delta (lse's shape) and dq_accum contiguous.
#pragma once

#include "fusekit/ops/attention.hpp"
#include "fusekit/ops/primitives.hpp"

namespace fk::cuda {

// attention_rowwise.cu: one warp per query row, any dtype, D <= 256, every AttentionOptions, any
// GPU, dense or packed (the fallback, and the varlen forward).
void attention_forward_rowwise(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                               const TensorView& lse, const AttentionVarlen* varlen, const AttentionOptions& opt,
                               const Stream* stream);
// attention_rowwise.cu: the backward, a warp per query row (delta, dq) then a warp per key row (dk,
// dv). Every AttentionOptions; dq, dk, dv overwritten.
void attention_backward_rowwise(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                                const TensorView& dout, const TensorView& lse, const TensorView& dq,
                                const TensorView& dk, const TensorView& dv, const TensorView& delta,
                                const AttentionVarlen* varlen, const AttentionOptions& opt, const Stream* stream);

// attention_mma_bwd.cu: whether the tensor-core backward (mma.sync, sm_80 and later) takes these
// shapes: bf16/f16, D = 64, 96 or 128 (D = 256's dk/dv accumulators do not fit a thread's
// registers in this design; it stays on the rowwise kernels), Sq, Sk (packed: max_seqlen_q,
// max_seqlen_k) in [1, 2^30), 1 <= B * H <= 65535.
bool attention_backward_mma_supports(const TensorView& q, const TensorView& k, const AttentionVarlen* varlen);
// attention_mma_bwd.cu: the backward on tensor cores, true when it was launched (also needs an sm_80+
// device with the shared memory it asks for and 16-byte aligned tensors). dq_accum: f32 like q,
// scratch unless opt.deterministic (then unused, may be empty). Every AttentionOptions; dq, dk, dv
// overwritten.
bool attention_backward_mma(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                            const TensorView& dout, const TensorView& lse, const TensorView& dq, const TensorView& dk,
                            const TensorView& dv, const TensorView& delta, const TensorView& dq_accum,
                            const AttentionVarlen* varlen, const AttentionOptions& opt, const Stream* stream);

// attention_mma_bwd.cu, for the sm_90 backward, bf16/f16 with D a multiple of 8, dense or packed
// (out's rank 4 or 3), out, dout and dq in any strides that keep their rows 16-byte aligned:
// delta = rowsum(dout ⊙ out) f32 in lse's layout and dq_accum (contiguous f32 like out) zeroed;
// then, after the dk/dv kernel added dq into dq_accum, dq_accum rounded into dq.
void attention_backward_prologue(const TensorView& out, const TensorView& dout, const TensorView& delta,
                                 const TensorView& dq_accum, const Stream* stream);
void attention_backward_dq_from_accum(const TensorView& dq_accum, const TensorView& dq, const Stream* stream);

// attention_sm90_bwd.cu: whether the wgmma/TMA backward takes this call: dense (varlen null) or
// packed, bf16/f16, D = 64 or 128, no window (causal either alignment or none), no softcap, not
// deterministic, 1 <= Sq, Sk (packed: the max_seqlens) < 2^30, at least one query and one key,
// B * Hk <= 65535, on an sm_90 device, every tensor in a layout sm90_takes_layout takes (16-byte
// aligned, stride 1 on D, the other strides multiples of 8 elements).
bool attention_backward_sm90_supports(const TensorView& q, const TensorView& k, const TensorView& v,
                                      const TensorView& out, const TensorView& dout, const TensorView& dq,
                                      const TensorView& dk, const TensorView& dv, const AttentionVarlen* varlen,
                                      const AttentionOptions& opt);
// attention_sm90_bwd.cu: the backward on wgmma (FlashAttention-3's dk/dv kernel, dq by f32 atomics
// into dq_accum, f32 like q, scratch), for a call attention_backward_sm90_supports takes; delta
// scratch like lse. dq, dk, dv overwritten.
void attention_backward_sm90(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                             const TensorView& dout, const TensorView& lse, const TensorView& dq, const TensorView& dk,
                             const TensorView& dv, const TensorView& delta, const TensorView& dq_accum,
                             const AttentionVarlen* varlen, const AttentionOptions& opt, const Stream* stream);

// attention_sm90.cu: true when the wgmma/TMA kernel takes this call and it was launched: dense
// (varlen null) or packed, sm_90 device, bf16/f16, D = 64 or 128, grouped-query heads, causal
// (either alignment) or none, no window or softcap, Sq and Sk (packed: the max_seqlens) in
// [1, 2^30), packed total_k >= 1, q, k, v, out in layouts sm90_takes_layout takes (16-byte
// aligned, stride 1 on D, the other strides multiples of 8 elements), B * H * ceil(Sq / rows) < 2^31
// (rows: a CTA's, 192 at D 64 unless opt.forward_tile says 128, else 128).
bool attention_forward_sm90(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                            const TensorView& lse, const AttentionVarlen* varlen, const AttentionOptions& opt,
                            const Stream* stream);

}  // namespace fk::cuda
