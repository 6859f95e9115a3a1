// Dispatch of the glu family: argument checks, the weight layout conversions, then the CPU spec,
// the fused Hopper GEMM, or the unfused path (cuBLAS GEMM into C, one pass over C).
#include "fusekit/ops/glu.hpp"

#include <cstring>

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
  if (a.out.numel() == 0) return;
  if (a.x.device().is_cpu()) {
    const Tensor w = glu_unprepare_weight(a.w);
    std::optional<Tensor> b;
    if (a.bias) b = glu_unprepare_weight(*a.bias);
    return reference::glu_forward({a.x, w.view(), b ? std::optional(b->view()) : std::nullopt, a.out}, opt);
  }
#if FUSEKIT_WITH_CUDA
  const TensorView* bias = a.bias ? &*a.bias : nullptr;
  if (cuda::glu_gemm_fused(a.x, a.w, bias, nullptr, a.out, nullptr, opt, stream)) return;
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
    auto view = [](const std::optional<Tensor>& t) { return t ? std::optional(t->view()) : std::nullopt; };
    reference::glu_backward({a.dy, a.x, w.view(), view(b), a.dx, view(dw), view(db)}, opt);
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
  const bool fused = m > 0 && cuda::glu_gemm_fused(a.x, a.w, bias, &a.dy, dc.view(), partial, opt, stream);
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

}  // namespace fk
