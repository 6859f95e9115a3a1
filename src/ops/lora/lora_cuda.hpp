// The CUDA launchers of the lora family, called by lora.cpp after every argument was checked.
#pragma once

#include <cstdint>

#include "fusekit/ops/lora.hpp"

namespace fk::cuda {

// One tensor-core GEMM with a rank-r update in its epilogue (lora_gemm.cu):
//   z = lhs · op(rhs) + bias + lowrank_left · lowrank_rightᵀ,   out = act(z)   [M, N]
// lhs [M, Kg]; rhs [N, Kg] (op = transpose: the forward's x Wᵀ) or [Kg, N] (op = identity: the
// backward's g W); lowrank_left [M, rb] and lowrank_right [N, rb] (B in the forward, Aᵀ in the
// backward), zero-padded to rb = 16 ceil(r / 16) columns. preact, when not null, receives z.
enum class LoraTile { automatic, pingpong, cooperative };

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
  LoraTile tile = LoraTile::automatic;  // the bench compares the two schedules
  bool lowrank_ffma = false;             // the rank-r term by CUDA-core FMAs (the bench compares)
};

// Returns false, having done nothing, when the device or the shape has no fused kernel (not
// sm_90, not bf16 / f16, rows of lhs, rhs or out not 16-byte multiples, sizes past int32).
bool lora_gemm_fused(const LoraGemmArgs& args, const Stream* stream);

// The backward's first pass (lora_grad.cu): g = dy ⊙ act'(saved), su = scale g B, db = gᵀ t and
// dbias = Σ_m g from one read of dy and saved. Shapes: dy, saved, g [M, N]; b, db [N, r]; t
// [M, r]; su [M, rb] (zero-padded to rb = 16 ceil(r / 16)); dbias [N] or null. Returns false, having done nothing, unless bf16 / f16, N % 8 == 0
// and dy, saved, g 16-byte aligned.
struct LoraGradArgs {
  TensorView dy, saved, b, t, g, su, db;
  const TensorView* dbias = nullptr;
  Activation act = Activation::identity;
  bool from_output = false;
};
bool lora_grad_fused(const LoraGradArgs& args, float scale, const Stream* stream);

// t [M, rb] = scale x [M, K] · a [rb, K]ᵀ on sm_90 (lora_t.cu): one TMA-fed streaming pass over x
// with wgmma. False (nothing launched) where it does not apply: not bf16/f16, rb not in
// {16, 32, 48, 64}, K % 8 != 0, unaligned bases, another GPU, or fewer than SMs / 2 blocks of 64
// rows; the caller then uses cuBLAS.
bool lora_lowrank_t(const TensorView& x, const TensorView& a, const TensorView& t, float scale, const Stream* stream);

// at [K, rb] = Aᵀ, zero past column r (lora_transpose.cu); a [r, K], any float dtype.
void lora_transpose_pad(const TensorView& a, const TensorView& at, const Stream* stream);

}  // namespace fk::cuda
