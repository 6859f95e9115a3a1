// Dispatch of DCNv2's low-rank cross layer: argument checks, then the CPU spec or, on a GPU, the
// GEMMs through fk::gemm around the fused elementwise passes of cross_layer.cu.
#include <fmt/format.h>

#include "fusekit/core/stream.hpp"
#include "fusekit/ops/gemm.hpp"
#include "fusekit/ops/recsys.hpp"
#include "ops/common/op_checks.hpp"
#if FUSEKIT_WITH_CUDA
#include "fusekit/core/cuda_check.hpp"
#include "recsys_cuda.hpp"
#endif

namespace fk {
namespace {

// An f32 matrix [rows, cols] with unit column stride and row stride >= cols (a view of columns of
// a wider buffer is fine, as fk::gemm takes it).
void check_matrix(const char* op, const char* arg, const TensorView& t, std::int64_t rows, std::int64_t cols,
                  Device device) {
  FK_CHECK_ARG(t.rank() == 2, op, arg, fmt::format("a rank-2 tensor [{}, {}]", rows, cols), t.str());
  checks::dtype_in(op, arg, t, {DType::f32});
  FK_CHECK_ARG(t.size(0) == rows && t.size(1) == cols, op, arg, fmt::format("shape [{}, {}]", rows, cols),
               t.shape().str());
  FK_CHECK_ARG(t.strides()[1] == 1 && t.strides()[0] >= cols, op, arg,
               fmt::format("strides (>= {}, 1)", cols), t.strides().str());
  FK_CHECK_ARG(t.data() != nullptr || t.numel() == 0, op, arg, "non-null data", "a null pointer");
  checks::same_device(op, arg, t, device);
}

struct Sizes {
  std::int64_t batch, n, rank;
  Device dev;
};

// x0 fixes B, N and the device, u the rank; every other operand must agree.
Sizes check_common(const char* op, const TensorView& x0, const TensorView& xl, const TensorView& u,
                   const TensorView& v, const TensorView& bias, const TensorView& h) {
  FK_CHECK_ARG(x0.rank() == 2, op, "x0", "a rank-2 tensor [B, N]", x0.str());
  FK_CHECK_ARG(u.rank() == 2, op, "u", "a rank-2 tensor [N, r]", u.str());
  const Sizes s{x0.size(0), x0.size(1), u.size(1), x0.device()};
  checks::cuda_available(op, s.dev);
  FK_CHECK_ARG(s.n >= 1, op, "x0", "N >= 1 features", x0.shape().str());
  FK_CHECK_ARG(s.rank >= 1, op, "u", "a rank r >= 1 (shape [N, r])", u.shape().str());
  check_matrix(op, "x0", x0, s.batch, s.n, s.dev);
  check_matrix(op, "xl", xl, s.batch, s.n, s.dev);
  check_matrix(op, "u", u, s.n, s.rank, s.dev);
  check_matrix(op, "v", v, s.rank, s.n, s.dev);
  checks::tensor(op, "bias", bias, 1);
  checks::dtype_in(op, "bias", bias, {DType::f32});
  checks::shape_is(op, "bias", bias, Dims{s.n});
  checks::same_device(op, "bias", bias, s.dev);
  check_matrix(op, "h", h, s.batch, s.rank, s.dev);
  return s;
}

#if FUSEKIT_WITH_CUDA
// Zeros into a gradient with no samples to sum (padded rows allowed), after the stream's work.
void zero_gradient(const TensorView& t, const Stream* stream) {
  if (stream) stream->synchronize();
  const Tensor zeros = Tensor::empty(t.shape(), DType::f32, Device::cpu());
  fill(zeros, 0.0);
  copy(t, zeros);
}
#endif

}  // namespace

std::int64_t cross_layer_workspace_floats(std::int64_t batch, std::int64_t n, std::int64_t rank) {
  return batch * (n + rank);
}

void cross_layer_forward(const CrossLayerForwardArgs& a, const CrossLayerParams& p, const Stream* stream) {
  constexpr const char* op = "cross_layer_forward";
  const Sizes s = check_common(op, a.x0, a.xl, a.u, a.v, a.bias, a.h);
  check_matrix(op, "out", a.out, s.batch, s.n, s.dev);
  checks::outputs_disjoint(op, {{"out", &a.out}, {"h", &a.h}},
                           {{"x0", &a.x0}, {"xl", &a.xl}, {"u", &a.u}, {"v", &a.v}, {"bias", &a.bias}});
  checks::check_stream(op, stream, s.dev);
  if (s.batch == 0) return;
  if (s.dev.is_cpu()) return reference::cross_layer_forward(a);
#if FUSEKIT_WITH_CUDA
  const detail::DeviceScope on(s.dev.index);
  // h = x_l Vᵀ [B, r]; out = h Uᵀ [B, N] (p); then out = x0 ⊙ (p + b) + x_l in one pass.
  matmul(a.xl, a.v, a.h, Trans::n, Trans::t, stream, p.allow_tf32);
  matmul(a.h, a.u, a.out, Trans::n, Trans::t, stream, p.allow_tf32);
  cuda::cross_forward_epilogue(a.x0.data_as<float>(), a.x0.strides()[0], a.xl.data_as<float>(), a.xl.strides()[0],
                               a.bias.data_as<float>(), a.out.data_as<float>(), a.out.strides()[0], s.batch, s.n,
                               detail::cuda_stream(stream));
#else
  (void)p;
#endif
}

void cross_layer_backward(const CrossLayerBackwardArgs& a, const CrossLayerParams& p, const Stream* stream) {
  constexpr const char* op = "cross_layer_backward";
  const Sizes s = check_common(op, a.x0, a.xl, a.u, a.v, a.bias, a.h);
  check_matrix(op, "dy", a.dy, s.batch, s.n, s.dev);
  check_matrix(op, "dx0", a.dx0, s.batch, s.n, s.dev);
  check_matrix(op, "du", a.du, s.n, s.rank, s.dev);
  check_matrix(op, "dv", a.dv, s.rank, s.n, s.dev);
  checks::tensor(op, "dbias", a.dbias, 1);
  checks::dtype_in(op, "dbias", a.dbias, {DType::f32});
  checks::shape_is(op, "dbias", a.dbias, Dims{s.n});
  checks::same_device(op, "dbias", a.dbias, s.dev);
  if (!a.first_layer)
    FK_CHECK_ARG(!checks::overlaps(a.xl, a.x0), op, "xl",
                 "a tensor apart from x0 (x_l is x0 only in the first layer: set first_layer)", "x0's memory");
  const std::optional<TensorView> ws = s.dev.is_cuda() ? a.workspace : std::nullopt;
  checks::outputs_disjoint(op,
                           {{"dy", &a.dy}, {"dx0", &a.dx0}, {"du", &a.du}, {"dv", &a.dv}, {"dbias", &a.dbias},
                            {"workspace", ws ? &*ws : nullptr}},
                           {{"x0", &a.x0}, {"xl", &a.xl}, {"u", &a.u}, {"v", &a.v}, {"bias", &a.bias}, {"h", &a.h}});
  checks::check_stream(op, stream, s.dev);
  if (s.dev.is_cpu()) return reference::cross_layer_backward(a);  // B = 0 included: zero gradients
#if FUSEKIT_WITH_CUDA
  const std::int64_t floats = cross_layer_workspace_floats(s.batch, s.n, s.rank);
  FK_CHECK_ARG(ws.has_value(), op, "workspace", fmt::format("f32 [{}] (the GPU backward)", floats), "none");
  checks::companion(op, "workspace", *ws, a.x0, Dims{floats});
  const detail::DeviceScope on(s.dev.index);
  const Stream* st = stream;
  if (s.batch == 0) {
    for (const TensorView* t : {&a.du, &a.dv, &a.dbias}) zero_gradient(*t, st);
    return;
  }
  float* base = ws->data_as<float>();
  const TensorView pm(base, DType::f32, {s.batch, s.n}, s.dev);                 // p, then dp  [B, N]
  const TensorView dh(base + s.batch * s.n, DType::f32, {s.batch, s.rank}, s.dev);  // [B, r]
  GemmParams g;
  g.allow_tf32 = p.allow_tf32;
  // p = h Uᵀ, then (one pass) dx0 += dy ⊙ (p + b) (+ dy), p = dp = dy ⊙ x0.
  matmul(a.h, a.u, pm, Trans::n, Trans::t, st, p.allow_tf32);
  cuda::cross_backward_epilogue(a.x0.data_as<float>(), a.x0.strides()[0], a.dy.data_as<float>(), a.dy.strides()[0],
                                a.bias.data_as<float>(), pm.data_as<float>(), a.dx0.data_as<float>(),
                                a.dx0.strides()[0], s.batch, s.n, a.first_layer, detail::cuda_stream(st));
  // dU = dpᵀ h and db = Σ_b dp in one cuBLASLt call.
  GemmParams gu = g;
  gu.trans_a = Trans::t;
  gu.epilogue = GemmEpilogue::bgrad_a;
  gemm({pm, a.h, a.du, std::nullopt, std::nullopt, a.dbias}, gu, st);
  // dh = dp U; dV = dhᵀ x_l; dL/dx_l = dy + dh V (beta = 1 over dy, or over dx0 when x_l is x0).
  matmul(pm, a.u, dh, Trans::n, Trans::n, st, p.allow_tf32);
  matmul(dh, a.xl, a.dv, Trans::t, Trans::n, st, p.allow_tf32);
  GemmParams gx = g;
  gx.beta = 1.0f;
  gemm({dh, a.v, a.first_layer ? a.dx0 : a.dy, std::nullopt, std::nullopt, std::nullopt}, gx, st);
#else
  (void)p;
#endif
}

}  // namespace fk
