// The CUDA launchers of attention_forward, called by attention.cpp (sm_90 kernel first, else the
// warp-per-row kernel) after every argument was
// checked: q [B, H, Sq, D], k and v [B, Hk, Sk, D], out like q, lse [B, H, Sq] f32, contiguous, on
// one CUDA device, one float dtype, 1 <= D <= 256, out overlapping no input, Sq >= 1.
#pragma once

#include "fusekit/ops/attention.hpp"
#include "fusekit/ops/primitives.hpp"

namespace fk::cuda {

// attention_rowwise.cu: one warp per query row, any dtype, D <= 256, every AttentionOptions, any
// GPU (the fallback).
void attention_forward_rowwise(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                               const TensorView& lse, const AttentionOptions& opt, const Stream* stream);
// attention_rowwise.cu: the backward, a warp per query row (delta, dq) then a warp per key row (dk,
// dv); delta: f32 [B, H, Sq] scratch. Every AttentionOptions; dq, dk, dv overwritten.
void attention_backward_rowwise(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                                const TensorView& dout, const TensorView& lse, const TensorView& dq,
                                const TensorView& dk, const TensorView& dv, const TensorView& delta,
                                const AttentionOptions& opt, const Stream* stream);

// attention_sm90.cu: true when the wgmma/TMA kernel takes this call (sm_90 device, bf16/f16,
// D = 64 or 128, Sk >= 1, 16-byte aligned bases, B * H * ceil(Sq / 128) < 2^31) and it was launched.
bool attention_forward_sm90(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                            const TensorView& lse, bool causal, float scale, const Stream* stream);

}  // namespace fk::cuda
