// The CUDA launchers of the lora family, called by lora.cpp after every argument was checked.
#pragma once

#include <cstdint>

#include "fusekit/ops/lora.hpp"

namespace fk::cuda {

// One tensor-core GEMM with a rank-r update (lora_gemm.cu, lora_gemm_tma.cu; CUTLASS ping-pong):
//   z = lhs · op(rhs) + bias + lowrank_left · lowrank_rightᵀ,   out = act(z)   [M, N]
// lhs [M, Kg]; rhs [N, Kg] (op = transpose: the forward's x Wᵀ) or [Kg, N] (op = identity: the
// backward's g W); lowrank_left [M, rb] and lowrank_right [N, rb] (B in the forward, Aᵀ in the
// backward), zero-padded to rb = 16 ceil(r / 16) columns. preact, when not null, receives z.
// How the tile is finished: `registers`, CUTLASS's no-shared-memory epilogue (the rank-r term by
// mma.sync on the accumulators, 2-element stores straight from them; the only one that also
// writes preact); `tma`, the same rank-r update, then CUTLASS's TMA warp-specialized epilogue (the
// tile staged in shared memory, TMA stores); `tma_ktile`, the rank-r term computed by the mainloop
// as one more k-tile [lhs | L] · [rhs | R]ᵀ, then the TMA epilogue (rhs [K, N]: with
// lowrank_right_t only; else as tma); `tma_rs` (rb = 16), the rank-16 term by one
// register-sourced wgmma per 64 rows (L's rows as the register operand, R's 128 x 16 slice in
// shared memory), then the TMA epilogue (lora_gemm_t.cu). automatic: registers when preact is
// asked for, else tma_rs at rb = 16 and tma_ktile above, the faster ones on the H100
// (docs/notes/lora.md).
enum class LoraEpilogueKind { automatic, registers, tma, tma_ktile, tma_rs };

struct LoraGemmArgs {
  TensorView lhs;
  TensorView rhs;
  bool rhs_is_n_by_k = true;
  TensorView lowrank_left;
  TensorView lowrank_right;
  const TensorView* bias = nullptr;
  Activation act = Activation::identity;
  TensorView out;
  const TensorView* preact = nullptr;
  // rhs [K, N] only: R transposed, [rb, N] (the backward's A zero-padded to rb rows), for the
  // k-tile path; without it (empty) that layout takes the epilogue path.
  TensorView lowrank_right_t{};
  LoraEpilogueKind epilogue = LoraEpilogueKind::automatic;
  // The persistent tile scheduler's order: swizzle 1, 2, 4, 8 along the raster; raster 0 CUTLASS's
  // heuristic, 1 along M, 2 along N. Both 0: the measured default (TMA: 4 along M; registers:
  // CUTLASS's, 1 along the heuristic's).
  int swizzle = 0;
  int raster = 0;
  // The forward with t inside the GEMM (lora_gemm_t.cu): when lowrank_a ([16, Kg], A zero-padded
  // to 16 rows) is set, lowrank_left [M, 16] is an output, t = lowrank_scale · lhs · lowrank_aᵀ,
  // computed by the GEMM and then used as L. Needs rhs [N, Kg], rb = 16, N > 128, no preact; otherwise
  // lora_gemm_fused returns false and the caller computes t itself.
  TensorView lowrank_a{};
  float lowrank_scale = 1.0f;
};

// Returns false, having done nothing, when the device or the shape has no fused kernel (not
// sm_90, not bf16 / f16, rows of lhs, rhs or out not 16-byte multiples, sizes past int32).
bool lora_gemm_fused(const LoraGemmArgs& args, const Stream* stream);
// The TMA-epilogue kernels (lora_gemm_tma.cu), called by lora_gemm_fused once it has checked
// that they take the arguments (and preact is null).
void lora_gemm_tma(const LoraGemmArgs& args, const Stream* stream);
// The rank-16 term by a register-sourced wgmma in the TMA epilogue (lora_gemm_t.cu), likewise.
void lora_gemm_tma_rs(const LoraGemmArgs& args, const Stream* stream);
// The forward with t computed inside the GEMM (lora_gemm_t.cu), likewise.
void lora_gemm_tma_t(const LoraGemmArgs& args, const Stream* stream);

// The backward's first pass (lora_grad.cu): g = dy ⊙ act'(saved), su = scale g B, db = gᵀ t and
// dbias = Σ_m g from one read of dy and saved. Shapes: dy, saved, g [M, N]; b, db [N, r]; t
// [M, r]; su [M, 16] (zero-padded); dbias [N] or null. Returns false, having done nothing, unless
// r <= 16, bf16 / f16, N % 8 == 0 and dy, saved, g 16-byte aligned.
struct LoraGradArgs {
  TensorView dy, saved, b, t, g, su, db;
  const TensorView* dbias = nullptr;
  Activation act = Activation::identity;
  bool from_output = false;
};
bool lora_grad_fused(const LoraGradArgs& args, float scale, const Stream* stream);


// at [K, rb] = Aᵀ, zero past column r (lora_transpose.cu); a [r, K], any float dtype.
void lora_transpose_pad(const TensorView& a, const TensorView& at, const Stream* stream);

}  // namespace fk::cuda
