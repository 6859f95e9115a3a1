// Dispatch of the glu family: argument checks, the weight layout conversions, then the CPU spec,
// the fused Hopper GEMM, or the unfused path (cuBLAS GEMM into C, one pass over C). The backward
// from kept pre-activations is one pass over C for dC, then the same cuBLAS GEMMs.
#include "fusekit/ops/glu.hpp"

#include <cstring>
#include <utility>

#include "fusekit/ops/gemm.hpp"
#include "ops/common/op_checks.hpp"

#if FUSEKIT_WITH_CUDA
#include <cuda_runtime.h>

#include "fusekit/core/cuda_check.hpp"
#include "glu_cuda.hpp"
#endif

namespace fk {
namespace {

using checks::kFloatTypes;

#if FUSEKIT_WITH_CUDA
// Whether the down projection's dh GEMM with dC formed in its epilogue (cuda::glu_dgrad_fused)
// beats cuBLAS's dh and the pass over C: taken from one wave of output tiles of 128 x 128 (128)
// up, where `fusekit bench --filter glu/glu_mlp_dgrad` measured it faster (docs/glu.md).
bool dgrad_fusion_pays(std::int64_t m, std::int64_t n) { return ((m + 127) / 128) * ((n + 127) / 128) >= 128; }
#endif

// x [M, K], w [2N, K], bias [2N]: returns N.
std::int64_t check_operands(const char* op, const TensorView& x, const TensorView& w,
                            const std::optional<TensorView>& bias) {
  checks::tensor(op, "x", x, 2);
  checks::dtype_in(op, "x", x, kFloatTypes);
  checks::cuda_available(op, x.device());
  checks::tensor(op, "w", w, 2);
  checks::same_dtype(op, "w", w, x);
  checks::same_device(op, "w", w, x.device());
  FK_CHECK_ARG(w.size(0) % 2 == 0 && w.size(0) > 0, op, "w", "[2N, K] with an even, non-zero number of rows",
               w.shape().str());
  FK_CHECK_ARG(w.size(1) == x.size(1), op, "w", fmt::format("[2N, {}] (K of x)", x.size(1)), w.shape().str());
  if (bias) checks::companion(op, "bias", *bias, x, Dims{w.size(0)});
  return w.size(0) / 2;
}

// Moves the 2N rows of `src` (rank 1 or 2) between the two layouts: to_prepared: dst row 2n =
// src row n, dst row 2n + 1 = src row N + n; else the inverse.
void permute_rows(const TensorView& src, const TensorView& dst, bool to_prepared, const Stream* stream) {
  const std::int64_t n = src.size(0) / 2;
  const std::size_t row = static_cast<std::size_t>(src.numel() / src.size(0)) * dtype_size(src.dtype());
  auto* d = static_cast<char*>(dst.data());
  const auto* s = static_cast<const char*>(src.data());
  // Half h (0 = left, 1 = right): rows of the torch layout at h N + i, of the prepared at 2 i + h.
  for (int h = 0; h < 2; ++h) {
    char* dst0 = to_prepared ? d + h * row : d + h * n * row;
    const char* src0 = to_prepared ? s + h * n * row : s + h * row;
    const std::size_t dpitch = to_prepared ? 2 * row : row, spitch = to_prepared ? row : 2 * row;
    if (src.device().is_cpu()) {
      for (std::int64_t i = 0; i < n; ++i) std::memcpy(dst0 + i * dpitch, src0 + i * spitch, row);
    } else {
#if FUSEKIT_WITH_CUDA
      const fk::detail::DeviceScope on_device(src.device().index);
      FK_CUDA_CHECK(cudaMemcpy2DAsync(dst0, dpitch, src0, spitch, row, static_cast<std::size_t>(n),
                                      cudaMemcpyDeviceToDevice, fk::detail::cuda_stream(stream)));
#endif
    }
  }
  (void)stream;
}

// Moves the 2N columns of a host [M, 2N] matrix between the layouts: PyTorch column h N + j is
// prepared column 2 j + h (h = 0 left, 1 right).
// preact [M, 2N] (an even number of columns), a float dtype, on a device that runs: (M, N).
std::pair<std::int64_t, std::int64_t> check_preact(const char* op, const TensorView& preact) {
  checks::tensor(op, "preact", preact, 2);
  checks::dtype_in(op, "preact", preact, kFloatTypes);
  checks::cuda_available(op, preact.device());
  FK_CHECK_ARG(preact.size(1) % 2 == 0, op, "preact", "[M, 2N] with an even number of columns", preact.shape().str());
  return {preact.size(0), preact.size(1) / 2};
}

void permute_columns_host(const TensorView& src, const TensorView& dst, bool to_prepared) {
  const std::int64_t m = src.size(0), n2 = src.size(1), n = n2 / 2;
  const std::size_t e = dtype_size(src.dtype());
  auto* d = static_cast<char*>(dst.data());
  const auto* s = static_cast<const char*>(src.data());
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j)
      for (std::int64_t h = 0; h < 2; ++h) {
        const std::int64_t torch_col = h * n + j, prepared_col = 2 * j + h;
        const std::int64_t from = to_prepared ? torch_col : prepared_col, to = to_prepared ? prepared_col : torch_col;
        std::memcpy(d + static_cast<std::size_t>(i * n2 + to) * e, s + static_cast<std::size_t>(i * n2 + from) * e, e);
      }
}

std::optional<TensorView> view_of(const std::optional<Tensor>& t) {
  return t ? std::optional(t->view()) : std::nullopt;
}

Tensor permuted(const char* op, const TensorView& w, bool to_prepared, const Stream* stream) {
  FK_CHECK_ARG((w.rank() == 1 || w.rank() == 2) && w.is_contiguous(), op, "w",
               "a contiguous [2N, K] weight or [2N] bias", w.str());
  FK_CHECK_ARG(w.size(0) % 2 == 0, op, "w", "an even number of rows (2N)", w.shape().str());
  checks::cuda_available(op, w.device());
  Tensor out = Tensor::empty(w.shape(), w.dtype(), w.device(), stream);
  if (w.numel() > 0) permute_rows(w, out.view(), to_prepared, stream);
  return out;
}

}  // namespace

std::string_view glu_kind_name(GluKind k) noexcept {
  switch (k) {
    case GluKind::sigmoid_tanh: return "sigmoid_tanh";
    case GluKind::swiglu: return "swiglu";
    case GluKind::geglu_tanh: return "geglu_tanh";
    case GluKind::geglu_erf: return "geglu_erf";
    case GluKind::reglu: return "reglu";
  }
  return "?";
}

GluKind parse_glu_kind(std::string_view name) {
  for (GluKind k : {GluKind::sigmoid_tanh, GluKind::swiglu, GluKind::geglu_tanh, GluKind::geglu_erf, GluKind::reglu})
    if (glu_kind_name(k) == name) return k;
  throw Error("parse_glu_kind", "name", "sigmoid_tanh, swiglu, geglu_tanh, geglu_erf or reglu", std::string(name));
}

Tensor glu_prepare_weight(const TensorView& w, const Stream* stream) {
  return permuted("glu_prepare_weight", w, true, stream);
}

Tensor glu_unprepare_weight(const TensorView& w_prepared, const Stream* stream) {
  return permuted("glu_unprepare_weight", w_prepared, false, stream);
}

void glu_forward(const GluForwardArgs& a, const GluOptions& opt, [[maybe_unused]] const Stream* stream) {
  constexpr const char* op = "glu_forward";
  const std::int64_t n = check_operands(op, a.x, a.w, a.bias);
  checks::companion(op, "out", a.out, a.x, Dims{a.x.size(0), n});
  if (a.preact) {
    checks::companion(op, "preact", *a.preact, a.x, Dims{a.x.size(0), 2 * n});
    checks::outputs_disjoint(op, {{"preact", &*a.preact}, {"out", &a.out}},
                             {{"x", &a.x}, {"w", &a.w}, {"bias", a.bias ? &*a.bias : nullptr}});
  }
  if (a.out.numel() == 0) return;
  if (a.x.device().is_cpu()) {
    const Tensor w = glu_unprepare_weight(a.w);
    std::optional<Tensor> b, c;
    if (a.bias) b = glu_unprepare_weight(*a.bias);
    if (a.preact) c = Tensor::empty(a.preact->shape(), a.preact->dtype(), a.preact->device());
    reference::glu_forward({a.x, w.view(), view_of(b), a.out, view_of(c)}, opt);
    if (c) permute_columns_host(c->view(), *a.preact, true);
    return;
  }
#if FUSEKIT_WITH_CUDA
  const TensorView* bias = a.bias ? &*a.bias : nullptr;
  const TensorView* keep = a.preact ? &*a.preact : nullptr;
  if (cuda::glu_gemm_fused(a.x, a.w, bias, nullptr, a.out, nullptr, keep, opt, stream)) return;
  if (keep != nullptr) {
    // C with the bias to preact (cuBLASLt's bias epilogue), then the activation from it.
    GemmParams p;
    p.trans_b = Trans::t;
    p.allow_tf32 = opt.allow_tf32;
    p.epilogue = bias ? GemmEpilogue::bias : GemmEpilogue::none;
    gemm({a.x, a.w, *keep, a.bias, {}, {}}, p, stream);
    cuda::glu_pairs(*keep, nullptr, nullptr, a.out, opt.kind, stream);
    return;
  }
  const Tensor c = Tensor::empty({a.x.size(0), 2 * n}, a.x.dtype(), a.x.device(), stream);
  matmul(a.x, a.w, c.view(), Trans::n, Trans::t, stream, opt.allow_tf32);
  cuda::glu_pairs(c.view(), bias, nullptr, a.out, opt.kind, stream);
#endif
}

void glu_backward(const GluBackwardArgs& a, const GluOptions& opt, [[maybe_unused]] const Stream* stream) {
  constexpr const char* op = "glu_backward";
  const std::int64_t n = check_operands(op, a.x, a.w, a.bias);
  const std::int64_t m = a.x.size(0), k = a.x.size(1);
  checks::companion(op, "dy", a.dy, a.x, Dims{m, n});
  if (a.dx) checks::companion(op, "dx", *a.dx, a.x, Dims{m, k});
  if (a.dw) checks::companion(op, "dw", *a.dw, a.x, Dims{2 * n, k});
  if (a.dbias) checks::companion(op, "dbias", *a.dbias, a.x, Dims{2 * n});
  if (a.x.device().is_cpu()) {
    const Tensor w = glu_unprepare_weight(a.w);
    std::optional<Tensor> b, dw, db;
    if (a.bias) b = glu_unprepare_weight(*a.bias);
    if (a.dw) dw = Tensor::empty(a.dw->shape(), a.dw->dtype(), a.dw->device());
    if (a.dbias) db = Tensor::empty(a.dbias->shape(), a.dbias->dtype(), a.dbias->device());
    reference::glu_backward({a.dy, a.x, w.view(), view_of(b), a.dx, view_of(dw), view_of(db)}, opt);
    if (dw) copy(*a.dw, glu_prepare_weight(dw->view()).view());
    if (db) copy(*a.dbias, glu_prepare_weight(db->view()).view());
    return;
  }
#if FUSEKIT_WITH_CUDA
  const TensorView* bias = a.bias ? &*a.bias : nullptr;
  // dC [M, 2N] in the prepared layout, the operand dtype. The fused GEMM also sums dC over
  // 16-row slabs for db (db_partial, 1/8 of dC's size in fp32), so db reads that, not dC.
  const Tensor dc = Tensor::empty({m, 2 * n}, a.x.dtype(), a.x.device(), stream);
  Tensor db_partial;
  if (a.dbias && m > 0) db_partial = Tensor::empty({(m + 15) / 16, 2 * n}, DType::f32, a.x.device(), stream);
  const TensorView* partial = a.dbias ? &db_partial.view() : nullptr;
  const bool fused = m > 0 && cuda::glu_gemm_fused(a.x, a.w, bias, &a.dy, dc.view(), partial, nullptr, opt, stream);
  if (m > 0 && !fused) {
    const Tensor c = Tensor::empty({m, 2 * n}, a.x.dtype(), a.x.device(), stream);
    matmul(a.x, a.w, c.view(), Trans::n, Trans::t, stream, opt.allow_tf32);
    cuda::glu_pairs(c.view(), bias, &a.dy, dc.view(), opt.kind, stream);
  }
  if (a.dx) matmul(dc.view(), a.w, *a.dx, Trans::n, Trans::n, stream, opt.allow_tf32);
  if (a.dw) matmul(dc.view(), a.x, *a.dw, Trans::t, Trans::n, stream, opt.allow_tf32);
  if (a.dbias) {
    if (m == 0) fill(*a.dbias, 0.0);
    else cuda::column_sums(fused ? db_partial.view() : dc.view(), *a.dbias, stream);
  }
#endif
}

void glu_backward_from_preact(const GluBackwardFromPreactArgs& a, const GluOptions& opt,
                              [[maybe_unused]] const Stream* stream) {
  constexpr const char* op = "glu_backward_from_preact";
  const std::int64_t n = check_operands(op, a.x, a.w, std::nullopt);
  const std::int64_t m = a.x.size(0), k = a.x.size(1);
  if (a.down_w) {
    checks::tensor(op, "down_w", *a.down_w, 2);
    checks::same_dtype(op, "down_w", *a.down_w, a.x);
    checks::same_device(op, "down_w", *a.down_w, a.x.device());
    FK_CHECK_ARG(a.down_w->size(1) == n, op, "down_w", fmt::format("[K', {}] (N of w)", n), a.down_w->shape().str());
    checks::companion(op, "dy", a.dy, a.x, Dims{m, a.down_w->size(0)});
  } else {
    checks::companion(op, "dy", a.dy, a.x, Dims{m, n});
  }
  checks::companion(op, "preact", a.preact, a.x, Dims{m, 2 * n});
  if (a.dx) checks::companion(op, "dx", *a.dx, a.x, Dims{m, k});
  if (a.dw) checks::companion(op, "dw", *a.dw, a.x, Dims{2 * n, k});
  if (a.dbias) checks::companion(op, "dbias", *a.dbias, a.x, Dims{2 * n});
  if (a.out) checks::companion(op, "out", *a.out, a.x, Dims{m, n});
  checks::outputs_disjoint(op,
                           {{"dx", a.dx ? &*a.dx : nullptr}, {"dw", a.dw ? &*a.dw : nullptr},
                            {"dbias", a.dbias ? &*a.dbias : nullptr}, {"out", a.out ? &*a.out : nullptr}},
                           {{"dy", &a.dy}, {"x", &a.x}, {"w", &a.w}, {"preact", &a.preact},
                            {"down_w", a.down_w ? &*a.down_w : nullptr}});
  // dh = dy down_w rounded to x's dtype, where no fused kernel forms it in registers.
  const auto down_grad = [&] {
    Tensor dh = Tensor::empty({m, n}, a.x.dtype(), a.x.device(), stream);
    if (m > 0) matmul(a.dy, *a.down_w, dh.view(), Trans::n, Trans::n, stream, opt.allow_tf32);
    return dh;
  };
  if (a.x.device().is_cpu()) {
    if (a.down_w) {
      const Tensor dh = down_grad();
      GluBackwardFromPreactArgs b = a;
      b.dy = dh.view();
      b.down_w = std::nullopt;
      glu_backward_from_preact(b, opt, stream);
      return;
    }
    const Tensor w = glu_unprepare_weight(a.w);
    const Tensor c = Tensor::empty(a.preact.shape(), a.preact.dtype(), a.preact.device());
    permute_columns_host(a.preact, c.view(), false);
    std::optional<Tensor> dw, db;
    if (a.dw) dw = Tensor::empty(a.dw->shape(), a.dw->dtype(), a.dw->device());
    if (a.dbias) db = Tensor::empty(a.dbias->shape(), a.dbias->dtype(), a.dbias->device());
    reference::glu_backward_from_preact(
        {a.dy, a.x, w.view(), c.view(), a.dx, view_of(dw), view_of(db), false, a.out}, opt);
    if (dw) copy(*a.dw, glu_prepare_weight(dw->view()).view());
    if (db) copy(*a.dbias, glu_prepare_weight(db->view()).view());
    return;
  }
#if FUSEKIT_WITH_CUDA
  // dC [M, 2N], prepared, operand dtype: over preact when the caller allows it.
  Tensor dc_owned;
  if (!a.overwrite_preact) dc_owned = Tensor::empty({m, 2 * n}, a.x.dtype(), a.x.device(), stream);
  const TensorView dc = a.overwrite_preact ? a.preact : dc_owned.view();
  const TensorView* out = a.out ? &*a.out : nullptr;
  if (m > 0) {
    if (!a.down_w) {
      cuda::glu_pairs(a.preact, nullptr, &a.dy, dc, opt.kind, stream, out);
    } else if (!dgrad_fusion_pays(m, n) || !cuda::glu_dgrad_fused(a.dy, *a.down_w, a.preact, dc, out, opt.kind, stream)) {
      const Tensor dh = down_grad();
      cuda::glu_pairs(a.preact, nullptr, &dh.view(), dc, opt.kind, stream, out);
    }
  }
  if (a.dx) matmul(dc, a.w, *a.dx, Trans::n, Trans::n, stream, opt.allow_tf32);
  if (a.dw) matmul(dc, a.x, *a.dw, Trans::t, Trans::n, stream, opt.allow_tf32);
  if (a.dbias) {
    if (m == 0) fill(*a.dbias, 0.0);
    else cuda::column_sums(dc, *a.dbias, stream);
  }
#endif
}

void glu_activate(const GluActivateArgs& a, const GluOptions& opt, [[maybe_unused]] const Stream* stream) {
  constexpr const char* op = "glu_activate";
  const auto [m, n] = check_preact(op, a.preact);
  checks::companion(op, "out", a.out, a.preact, Dims{m, n});
  checks::outputs_disjoint(op, {{"out", &a.out}}, {{"preact", &a.preact}});
  if (m == 0 || n == 0) return;
  if (a.preact.device().is_cpu()) {
    const Tensor c = Tensor::empty(a.preact.shape(), a.preact.dtype(), a.preact.device());
    permute_columns_host(a.preact, c.view(), false);
    reference::glu_activate({c.view(), a.out}, opt);
    return;
  }
#if FUSEKIT_WITH_CUDA
  cuda::glu_pairs(a.preact, nullptr, nullptr, a.out, opt.kind, stream);
#endif
}

void glu_preact_grad(const GluPreactGradArgs& a, const GluOptions& opt, [[maybe_unused]] const Stream* stream) {
  constexpr const char* op = "glu_preact_grad";
  const auto [m, n] = check_preact(op, a.preact);
  checks::companion(op, "dy", a.dy, a.preact, Dims{m, n});
  checks::companion(op, "dpreact", a.dpreact, a.preact, Dims{m, 2 * n});
  if (a.out) checks::companion(op, "out", *a.out, a.preact, Dims{m, n});
  const bool in_place = a.dpreact.data() == a.preact.data();
  const TensorView* out = a.out ? &*a.out : nullptr;
  if (!in_place) {
    checks::outputs_disjoint(op, {{"dpreact", &a.dpreact}, {"out", out}}, {{"dy", &a.dy}, {"preact", &a.preact}});
  } else {
    checks::outputs_disjoint(op, {{"dpreact", &a.dpreact}, {"out", out}}, {{"dy", &a.dy}});
  }
  if (m == 0 || n == 0) return;
  if (a.preact.device().is_cpu()) {
    const Tensor c = Tensor::empty(a.preact.shape(), a.preact.dtype(), a.preact.device());
    const Tensor dc = Tensor::empty(a.preact.shape(), a.preact.dtype(), a.preact.device());
    permute_columns_host(a.preact, c.view(), false);
    reference::glu_preact_grad({a.dy, c.view(), dc.view(), a.out}, opt);
    permute_columns_host(dc.view(), a.dpreact, true);
    return;
  }
#if FUSEKIT_WITH_CUDA
  cuda::glu_pairs(a.preact, nullptr, &a.dy, a.dpreact, opt.kind, stream, out);
#endif
}

}  // namespace fk
