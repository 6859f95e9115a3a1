// The CUDA launchers of the lora family, called by lora.cpp after every argument was checked.
#pragma once

#include <cstdint>

#include "fusekit/ops/lora.hpp"

namespace fk::cuda {

// One tensor-core GEMM with a rank-r update in its epilogue (lora_gemm.cu):
//   z = lhs · op(rhs) + bias + lowrank_left · lowrank_rightᵀ,   out = act(z)   [M, N]
// lhs [M, Kg]; rhs [N, Kg] (op = transpose: the forward's x Wᵀ) or [Kg, N] (op = identity: the
// backward's g W); lowrank_left [M, r]; lowrank_right(n, j) at lowrank_right[n * ld_n + j * ld_j]
// ([N, r]: B in the forward, Aᵀ in the backward). preact, when not null, receives z.
struct LoraGemmArgs {
  TensorView lhs;
  TensorView rhs;
  bool rhs_is_n_by_k = true;
  TensorView lowrank_left;
  const void* lowrank_right = nullptr;
  std::int64_t ld_n = 0, ld_j = 0;
  std::int64_t rank = 0;
  const TensorView* bias = nullptr;
  Activation act = Activation::identity;
  TensorView out;
  const TensorView* preact = nullptr;
};

// Returns false, having done nothing, when the device or the shape has no fused kernel (not
// sm_90, not bf16 / f16, rows of lhs, rhs or out not 16-byte multiples, sizes past int32).
bool lora_gemm_fused(const LoraGemmArgs& args, const Stream* stream);

// The backward's first pass (lora_grad.cu): g = dy ⊙ act'(saved), su = scale g B, db = gᵀ t and
// dbias = Σ_m g from one read of dy and saved. Shapes: dy, saved, g [M, N]; b, db [N, r]; t, su
// [M, r]; dbias [N] or null. Returns false, having done nothing, unless bf16 / f16, N % 8 == 0
// and dy, saved, g 16-byte aligned.
struct LoraGradArgs {
  TensorView dy, saved, b, t, g, su, db;
  const TensorView* dbias = nullptr;
  Activation act = Activation::identity;
  bool from_output = false;
};
bool lora_grad_fused(const LoraGradArgs& args, float scale, const Stream* stream);

}  // namespace fk::cuda
