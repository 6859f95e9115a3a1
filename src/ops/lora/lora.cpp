// Dispatch of the lora family: argument checks, then the CPU spec, the fused Hopper path (at
// r <= 16 one tensor-core GEMM that also computes t; otherwise a skinny cuBLAS GEMM for t, then
// one tensor-core GEMM with the rank-r term as a mainloop k-tile), or the same math unfused
// (cuBLAS GEMMs and the pointwise family's pass).
#include <cmath>
#include "fusekit/ops/lora.hpp"

#include <string>

#include "fusekit/ops/gemm.hpp"
#include "ops/common/op_checks.hpp"

#if FUSEKIT_WITH_CUDA
#include <cuda_runtime.h>

#include "fusekit/core/cuda_check.hpp"
#include "lora_cuda.hpp"
#endif

namespace fk {
namespace {

using checks::kFloatTypes;

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
  checks::companion(op, "b", b, x, Dims{s.n, s.r});
  return s;
}

void check_params(const char* op, const LoraParams& p) {
  FK_CHECK_ARG(std::isfinite(p.scale), op, "scale", "a finite number", fmt::format("{}", p.scale));
}

const TensorView* opt(const std::optional<TensorView>& t) { return t ? &*t : nullptr; }

#if FUSEKIT_WITH_CUDA
// r rounded up to a multiple of 16: the rank-r operands of the fused kernels come zero-padded to it.
std::int64_t padded_rank(std::int64_t r) { return (r + 15) / 16 * 16; }

// A tensor or a zero-padded copy of it.
struct Padded {
  std::optional<Tensor> own;
  TensorView view;
};

// [rows, r] -> [rows, rb], zero past column r (the tensor itself when r == rb).
Padded pad_columns(const TensorView& src, std::int64_t rb, const Stream* stream) {
  if (src.size(1) == rb) return {std::nullopt, src};
  Tensor t = Tensor::empty({src.size(0), rb}, src.dtype(), src.device(), stream);
  const std::size_t e = dtype_size(src.dtype());
  const cudaStream_t s = fk::detail::cuda_stream(stream);
  const fk::detail::DeviceScope on_device(src.device().index);
  FK_CUDA_CHECK(cudaMemsetAsync(t.data(), 0, t.nbytes(), s));
  if (src.numel() > 0)
    FK_CUDA_CHECK(cudaMemcpy2DAsync(t.data(), rb * e, src.data(), src.size(1) * e, src.size(1) * e,
                                    static_cast<std::size_t>(src.size(0)), cudaMemcpyDeviceToDevice, s));
  const TensorView v = t.view();
  return {std::move(t), v};
}

// [r, K] -> [rb, K], zero rows past r.
Padded pad_rows(const TensorView& src, std::int64_t rb, const Stream* stream) {
  if (src.size(0) == rb) return {std::nullopt, src};
  Tensor t = Tensor::empty({rb, src.size(1)}, src.dtype(), src.device(), stream);
  const cudaStream_t s = fk::detail::cuda_stream(stream);
  const fk::detail::DeviceScope on_device(src.device().index);
  FK_CUDA_CHECK(cudaMemsetAsync(t.data(), 0, t.nbytes(), s));
  FK_CUDA_CHECK(cudaMemcpyAsync(t.data(), src.data(), src.nbytes(), cudaMemcpyDeviceToDevice, s));
  const TensorView v = t.view();
  return {std::move(t), v};
}

// dst [rows, r] = the first r columns of src [rows, rb].
void copy_columns(const TensorView& src, const TensorView& dst, const Stream* stream) {
  if (dst.numel() == 0) return;
  const std::size_t e = dtype_size(src.dtype());
  const fk::detail::DeviceScope on_device(src.device().index);
  FK_CUDA_CHECK(cudaMemcpy2DAsync(dst.data(), dst.size(1) * e, src.data(), src.size(1) * e, dst.size(1) * e,
                                  static_cast<std::size_t>(dst.size(0)), cudaMemcpyDeviceToDevice,
                                  fk::detail::cuda_stream(stream)));
}

// dst [r, K] = the first r rows of src [rb, K].
void copy_rows(const TensorView& src, const TensorView& dst, const Stream* stream) {
  const fk::detail::DeviceScope on_device(src.device().index);
  FK_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), dst.nbytes(), cudaMemcpyDeviceToDevice,
                                fk::detail::cuda_stream(stream)));
}
#endif

[[maybe_unused]] std::optional<Tensor> scratch_unless(const std::optional<TensorView>& given, Dims shape, const TensorView& like,
                                     const Stream* stream) {
  if (given) return std::nullopt;
  return Tensor::empty(shape, like.dtype(), like.device(), stream);
}

}  // namespace

void lora_forward(const LoraForwardArgs& args, const LoraParams& p, [[maybe_unused]] const Stream* stream) {
  constexpr const char* op = "lora_forward";
  const Sizes s = check_operands(op, args.x, args.w, args.a, args.b);
  check_params(op, p);
  if (args.bias) checks::companion(op, "bias", *args.bias, args.x, Dims{s.n});
  checks::companion(op, "y", args.y, args.x, Dims{s.m, s.n});
  if (args.t) checks::companion(op, "t", *args.t, args.x, Dims{s.m, s.r});
  if (args.preact) checks::companion(op, "preact", *args.preact, args.x, Dims{s.m, s.n});
  // Outputs alias nothing: y over x gave wrong results on the CPU, preact over w corrupted W.
  checks::outputs_disjoint(op, {{"y", &args.y}, {"t", opt(args.t)}, {"preact", opt(args.preact)}},
                           {{"x", &args.x}, {"w", &args.w}, {"bias", opt(args.bias)}, {"a", &args.a}, {"b", &args.b}});
  if (args.x.device().is_cpu()) return reference::lora_forward(args, p);
  if (s.m == 0) return;
#if FUSEKIT_WITH_CUDA
  // t = s x Aᵀ, kept zero-padded to rb columns for the GEMM's epilogue ([M, rb]).
  const std::int64_t rb = padded_rank(s.r);
  std::optional<Tensor> t_own;
  if (!args.t || s.r != rb) t_own = Tensor::empty({s.m, rb}, args.x.dtype(), args.x.device(), stream);
  const TensorView t = t_own ? t_own->view() : *args.t;
  const TensorView* t_user = args.t && s.r != rb ? &*args.t : nullptr;
  // One memory-bound pass over x by cuBLAS's skinny GEMM: at the copy rate already, so no kernel of
  // our own (the ones tried are in docs/notes/lora.md).
  const Padded a_pad = pad_rows(args.a, rb, stream);
  const Padded b_pad = pad_columns(args.b, rb, stream);  // [N, rb]
  const TensorView* bias = args.bias ? &*args.bias : nullptr;
  const TensorView* preact = args.preact ? &*args.preact : nullptr;
  // r <= 16 without preact: t computed inside the fused GEMM (lora_gemm_t.cu), no pass of its own.
  if (rb == 16 && preact == nullptr) {
    cuda::LoraGemmArgs g{args.x, args.w, true, t, b_pad.view, bias, p.act, args.y, nullptr};
    g.lowrank_a = a_pad.view;
    g.lowrank_scale = p.scale;
    if (cuda::lora_gemm_fused(g, stream)) {
      if (t_user != nullptr) copy_columns(t, *t_user, stream);
      return;
    }
  }
  gemm({args.x, a_pad.view, t}, {.trans_a = Trans::n, .trans_b = Trans::t, .alpha = p.scale}, stream);
  if (t_user != nullptr) copy_columns(t, *t_user, stream);
  if (cuda::lora_gemm_fused({args.x, args.w, true, t, b_pad.view, bias, p.act, args.y, preact}, stream)) return;
  // Unfused: z = x Wᵀ, z += t Bᵀ, then y = act(z + b) in one pointwise pass.
  const std::optional<Tensor> z_own = scratch_unless(args.preact, {s.m, s.n}, args.x, stream);
  const TensorView z = args.preact ? *args.preact : z_own->view();
  matmul(args.x, args.w, z, Trans::n, Trans::t, stream);
  gemm({t, b_pad.view, z}, {.trans_a = Trans::n, .trans_b = Trans::t, .beta = 1.0f}, stream);
  bias_act_forward({z, std::nullopt, args.bias, args.y, args.preact}, {p.act, 1.0f}, stream);
#endif
}

void lora_backward(const LoraBackwardArgs& args, const LoraParams& p, [[maybe_unused]] const Stream* stream) {
  constexpr const char* op = "lora_backward";
  const Sizes s = check_operands(op, args.x, args.w, args.a, args.b);
  check_params(op, p);
  checks::companion(op, "dy", args.dy, args.x, Dims{s.m, s.n});
  checks::companion(op, "saved", args.saved, args.x, Dims{s.m, s.n});
  FK_CHECK_ARG(args.saved_kind == SavedForBackward::preactivation || derivative_from_output(p.act), op, "saved",
               fmt::format("the pre-activation z ({}'s derivative needs z)", activation_name(p.act)), "the output y");
  if (args.t) checks::companion(op, "t", *args.t, args.x, Dims{s.m, s.r});
  if (args.dx) checks::companion(op, "dx", *args.dx, args.x, Dims{s.m, s.k});
  checks::companion(op, "da", args.da, args.x, Dims{s.r, s.k});
  checks::companion(op, "db", args.db, args.x, Dims{s.n, s.r});
  if (args.dbias) checks::companion(op, "dbias", *args.dbias, args.x, Dims{s.n});
  checks::outputs_disjoint(op, {{"dx", opt(args.dx)}, {"da", &args.da}, {"db", &args.db}, {"dbias", opt(args.dbias)}},
                           {{"dy", &args.dy}, {"saved", &args.saved}, {"x", &args.x}, {"w", &args.w}, {"a", &args.a},
                            {"b", &args.b}, {"t", opt(args.t)}});
  if (args.x.device().is_cpu()) return reference::lora_backward(args, p);
#if FUSEKIT_WITH_CUDA
  const std::int64_t rb = padded_rank(s.r);
  const std::optional<Tensor> t_own = scratch_unless(args.t, {s.m, s.r}, args.x, stream);
  const TensorView t = args.t ? *args.t : t_own->view();
  if (!args.t) gemm({args.x, args.a, t}, {.trans_a = Trans::n, .trans_b = Trans::t, .alpha = p.scale}, stream);
  const Tensor g = Tensor::empty({s.m, s.n}, args.x.dtype(), args.x.device(), stream);    // dy ⊙ act'(z)
  const Tensor su = Tensor::empty({s.m, rb}, args.x.dtype(), args.x.device(), stream);   // s g B, zero-padded
  const bool from_output = args.saved_kind == SavedForBackward::output;
  if (!cuda::lora_grad_fused({args.dy, args.saved, args.b, t, g.view(), su.view(), args.db,
                              args.dbias ? &*args.dbias : nullptr, p.act, from_output},
                             p.scale, stream)) {
    bias_act_backward({args.dy, args.saved, args.saved_kind, g.view(), std::nullopt, args.dbias}, {p.act, 1.0f},
                      stream);
    const Padded b_pad = pad_columns(args.b, rb, stream);
    gemm({g.view(), b_pad.view, su.view()}, {.trans_a = Trans::n, .trans_b = Trans::n, .alpha = p.scale}, stream);
    matmul(g.view(), t, args.db, Trans::t, Trans::n, stream);  // dB = gᵀ t
  }
  // dA = (s u)ᵀ x: the first r rows of the [rb, K] product.
  if (s.r == rb) {
    matmul(su.view(), args.x, args.da, Trans::t, Trans::n, stream);
  } else {
    const Tensor da_pad = Tensor::empty({rb, s.k}, args.x.dtype(), args.x.device(), stream);
    matmul(su.view(), args.x, da_pad.view(), Trans::t, Trans::n, stream);
    copy_rows(da_pad.view(), args.da, stream);
  }
  if (!args.dx) return;
  const Tensor at = Tensor::empty({s.k, rb}, args.x.dtype(), args.x.device(), stream);  // Aᵀ, zero-padded
  cuda::lora_transpose_pad(args.a, at.view(), stream);
  // The fused GEMM takes A itself, zero-padded to rb rows, as the right factor of its rank-r k-tile.
  const Padded a_pad = pad_rows(args.a, rb, stream);
  if (cuda::lora_gemm_fused({g.view(), args.w, false, su.view(), at.view(), nullptr, Activation::identity, *args.dx,
                             nullptr, a_pad.view},
                            stream))
    return;
  matmul(g.view(), args.w, *args.dx, Trans::n, Trans::n, stream);  // dx = g W
  gemm({su.view(), a_pad.view, *args.dx}, {.trans_a = Trans::n, .trans_b = Trans::n, .beta = 1.0f}, stream);  // + (s u) A
#endif
}

}  // namespace fk
