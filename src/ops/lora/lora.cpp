// Dispatch of the lora family: argument checks, then the CPU spec, the fused Hopper path (a
// skinny cuBLAS GEMM for t, then one tensor-core GEMM with the rank-r term in its epilogue), or
// the same math unfused (cuBLAS GEMMs and the pointwise family's pass).
#include "fusekit/ops/lora.hpp"

#include "nn/gemm.hpp"
#include "ops/op_checks.hpp"

#if FUSEKIT_WITH_CUDA
#include "lora_cuda.hpp"
#endif

namespace fk {
namespace {

constexpr std::initializer_list<DType> kFloatTypes = {DType::f32, DType::bf16, DType::f16};

void check_companion(const char* op, const char* arg, const TensorView& t, const TensorView& ref, const Dims& shape) {
  checks::tensor(op, arg, t, static_cast<int>(shape.size()));
  checks::same_dtype(op, arg, t, ref);
  checks::shape_is(op, arg, t, shape);
  checks::same_device(op, arg, t, ref.device());
}

struct Sizes {
  std::int64_t m, n, k, r;
};

// x [M, K], w [N, K], a [r, K], b [N, r]; returns the sizes.
Sizes check_operands(const char* op, const TensorView& x, const TensorView& w, const TensorView& a,
                     const TensorView& b) {
  checks::tensor(op, "x", x, 2);
  checks::dtype_in(op, "x", x, kFloatTypes);
  checks::cuda_available(op, x.device());
  checks::tensor(op, "w", w, 2);
  checks::same_dtype(op, "w", w, x);
  checks::same_device(op, "w", w, x.device());
  FK_CHECK_ARG(w.size(1) == x.size(1), op, "w", fmt::format("[N, {}] (K of x)", x.size(1)), w.shape().str());
  checks::tensor(op, "a", a, 2);
  checks::same_dtype(op, "a", a, x);
  checks::same_device(op, "a", a, x.device());
  FK_CHECK_ARG(a.size(0) >= 1 && a.size(0) <= kLoraMaxRank && a.size(1) == x.size(1), op, "a",
               fmt::format("[r, {}] with 1 <= r <= {}", x.size(1), kLoraMaxRank), a.shape().str());
  const Sizes s{x.size(0), w.size(0), x.size(1), a.size(0)};
  check_companion(op, "b", b, x, Dims{s.n, s.r});
  return s;
}

void check_params(const char* op, const LoraParams& p) {
  FK_CHECK_ARG(p.scale == p.scale, op, "scale", "a number", "NaN");
}

std::optional<Tensor> scratch_unless(const std::optional<TensorView>& given, Dims shape, const TensorView& like,
                                     const Stream* stream) {
  if (given) return std::nullopt;
  return Tensor::empty(shape, like.dtype(), like.device(), stream);
}

}  // namespace

void lora_forward(const LoraForwardArgs& args, const LoraParams& p, const Stream* stream) {
  constexpr const char* op = "lora_forward";
  const Sizes s = check_operands(op, args.x, args.w, args.a, args.b);
  check_params(op, p);
  if (args.bias) check_companion(op, "bias", *args.bias, args.x, Dims{s.n});
  check_companion(op, "y", args.y, args.x, Dims{s.m, s.n});
  if (args.t) check_companion(op, "t", *args.t, args.x, Dims{s.m, s.r});
  if (args.preact) check_companion(op, "preact", *args.preact, args.x, Dims{s.m, s.n});
  if (args.x.device().is_cpu()) return reference::lora_forward(args, p);
  if (s.m == 0) return;
#if FUSEKIT_WITH_CUDA
  using nn::detail::Op;
  const std::optional<Tensor> t_own = scratch_unless(args.t, {s.m, s.r}, args.x, stream);
  const TensorView t = args.t ? *args.t : t_own->view();
  nn::detail::gemm(Op::n, Op::t, args.x, args.a, t, stream, false, p.scale);  // t = s x Aᵀ
  const TensorView* bias = args.bias ? &*args.bias : nullptr;
  const TensorView* preact = args.preact ? &*args.preact : nullptr;
  if (cuda::lora_gemm_fused({args.x, args.w, true, t, args.b.data(), s.r, 1, s.r, bias, p.act, args.y, preact},
                            stream))
    return;
  // Unfused: z = x Wᵀ, z += t Bᵀ, then y = act(z + b) in one pointwise pass.
  const std::optional<Tensor> z_own = scratch_unless(args.preact, {s.m, s.n}, args.x, stream);
  const TensorView z = args.preact ? *args.preact : z_own->view();
  nn::detail::gemm(Op::n, Op::t, args.x, args.w, z, stream);
  nn::detail::gemm(Op::n, Op::t, t, args.b, z, stream, false, 1.0f, 1.0f);
  bias_act_forward({z, std::nullopt, args.bias, args.y, args.preact}, {p.act, 1.0f}, stream);
#endif
}

void lora_backward(const LoraBackwardArgs& args, const LoraParams& p, const Stream* stream) {
  constexpr const char* op = "lora_backward";
  const Sizes s = check_operands(op, args.x, args.w, args.a, args.b);
  check_params(op, p);
  check_companion(op, "dy", args.dy, args.x, Dims{s.m, s.n});
  check_companion(op, "saved", args.saved, args.x, Dims{s.m, s.n});
  FK_CHECK_ARG(args.saved_kind == SavedForBackward::preactivation || derivative_from_output(p.act), op, "saved",
               fmt::format("the pre-activation z ({}'s derivative needs z)", activation_name(p.act)), "the output y");
  if (args.t) check_companion(op, "t", *args.t, args.x, Dims{s.m, s.r});
  if (args.dx) check_companion(op, "dx", *args.dx, args.x, Dims{s.m, s.k});
  check_companion(op, "da", args.da, args.x, Dims{s.r, s.k});
  check_companion(op, "db", args.db, args.x, Dims{s.n, s.r});
  if (args.dbias) check_companion(op, "dbias", *args.dbias, args.x, Dims{s.n});
  if (args.x.device().is_cpu()) return reference::lora_backward(args, p);
#if FUSEKIT_WITH_CUDA
  using nn::detail::Op;
  const std::optional<Tensor> t_own = scratch_unless(args.t, {s.m, s.r}, args.x, stream);
  const TensorView t = args.t ? *args.t : t_own->view();
  if (!args.t) nn::detail::gemm(Op::n, Op::t, args.x, args.a, t, stream, false, p.scale);
  const Tensor g = Tensor::empty({s.m, s.n}, args.x.dtype(), args.x.device(), stream);    // dy ⊙ act'(z)
  const Tensor su = Tensor::empty({s.m, s.r}, args.x.dtype(), args.x.device(), stream);  // s u = s g B
  const bool from_output = args.saved_kind == SavedForBackward::output;
  if (!cuda::lora_grad_fused({args.dy, args.saved, args.b, t, g.view(), su.view(), args.db,
                              args.dbias ? &*args.dbias : nullptr, p.act, from_output},
                             p.scale, stream)) {
    bias_act_backward({args.dy, args.saved, args.saved_kind, g.view(), std::nullopt, args.dbias}, {p.act, 1.0f},
                      stream);
    nn::detail::gemm(Op::n, Op::n, g.view(), args.b, su.view(), stream, false, p.scale);
    nn::detail::gemm(Op::t, Op::n, g.view(), t, args.db, stream);  // dB = gᵀ t
  }
  nn::detail::gemm(Op::t, Op::n, su.view(), args.x, args.da, stream);  // dA = (s u)ᵀ x
  if (!args.dx) return;
  if (cuda::lora_gemm_fused({g.view(), args.w, false, su.view(), args.a.data(), 1, s.k, s.r, nullptr,
                             Activation::identity, *args.dx, nullptr},
                            stream))
    return;
  nn::detail::gemm(Op::n, Op::n, g.view(), args.w, *args.dx, stream);       // dx = g W
  nn::detail::gemm(Op::n, Op::n, su.view(), args.a, *args.dx, stream, false, 1.0f, 1.0f);  // + (s u) A
#endif
}

}  // namespace fk
