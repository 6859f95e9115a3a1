// Dispatch of the pointwise family: argument checks, then the CPU spec or the CUDA kernels.
#include "fusekit/ops/pointwise.hpp"

#include "ops/common/op_checks.hpp"
#include "pointwise_cuda.hpp"

namespace fk {
namespace {

constexpr std::initializer_list<DType> kFloatTypes = {DType::f32, DType::bf16, DType::f16};

// A [rows, cols] operand: rank 2, rows of unit inner stride, a row stride of at least cols (rows
// may be padded; each tensor has its own row stride), non-null data unless empty.
void check_rows(const char* op, const char* arg, const TensorView& t) {
  FK_CHECK_ARG(t.rank() == 2, op, arg, "a rank-2 tensor", t.str());
  const std::int64_t rows = t.size(0), cols = t.size(1);
  FK_CHECK_ARG(t.numel() == 0 || ((cols <= 1 || t.strides()[1] == 1) && (rows <= 1 || t.strides()[0] >= cols)), op,
               arg, "rows with inner stride 1 and a row stride >= cols", t.str());
  FK_CHECK_ARG(t.data() != nullptr || t.numel() == 0, op, arg, "non-null data", "a null pointer");
}

// An optional [rows, cols] companion of `ref`: same dtype, shape and device.
void check_like(const char* op, const char* arg, const TensorView& t, const TensorView& ref) {
  check_rows(op, arg, t);
  checks::same_dtype(op, arg, t, ref);
  checks::shape_is(op, arg, t, ref.shape());
  checks::same_device(op, arg, t, ref.device());
}

// An output that may be its input in place: sharing the input's data means being the same view.
void check_in_place(const char* op, const char* arg, const TensorView& out, const char* in_arg, const TensorView& in) {
  if (out.data() != in.data() || out.numel() <= 1) return;
  const bool same_rows = out.size(0) <= 1 || out.strides()[0] == in.strides()[0];
  const bool same_cols = out.size(1) <= 1 || out.strides()[1] == in.strides()[1];
  FK_CHECK_ARG(same_rows && same_cols, op, arg, fmt::format("{}'s strides {} when it shares {}'s data", in_arg,
                                                            in.strides().str(), in_arg),
               out.strides().str());
}

}  // namespace

std::string_view activation_name(Activation a) noexcept {
  switch (a) {
    case Activation::identity: return "identity";
    case Activation::relu: return "relu";
    case Activation::sigmoid: return "sigmoid";
    case Activation::tanh: return "tanh";
    case Activation::gelu_tanh: return "gelu_tanh";
    case Activation::gelu_erf: return "gelu_erf";
    case Activation::silu: return "silu";
  }
  return "?";
}

Activation parse_activation(std::string_view name) {
  for (Activation a : {Activation::identity, Activation::relu, Activation::sigmoid, Activation::tanh,
                       Activation::gelu_tanh, Activation::gelu_erf, Activation::silu})
    if (activation_name(a) == name) return a;
  throw Error("parse_activation", "name", "identity, relu, sigmoid, tanh, gelu_tanh, gelu_erf or silu",
              std::string(name));
}

bool derivative_from_output(Activation a) noexcept {
  return a == Activation::identity || a == Activation::relu || a == Activation::sigmoid || a == Activation::tanh;
}

void bias_act_forward(const BiasActForwardArgs& a, const BiasActParams& p, const Stream* stream) {
  constexpr const char* op = "bias_act_forward";
  check_rows(op, "x", a.x);
  checks::dtype_in(op, "x", a.x, kFloatTypes);
  const Device dev = a.x.device();
  checks::cuda_available(op, dev);
  if (a.r) check_like(op, "r", *a.r, a.x);
  if (a.bias) {
    checks::tensor(op, "bias", *a.bias, 1);
    checks::same_dtype(op, "bias", *a.bias, a.x);
    checks::shape_is(op, "bias", *a.bias, Dims{a.x.size(1)});
    checks::same_device(op, "bias", *a.bias, dev);
  }
  check_like(op, "y", a.y, a.x);
  check_in_place(op, "y", a.y, "x", a.x);
  if (a.preact) check_like(op, "preact", *a.preact, a.x);
  if (a.x.numel() == 0) return;
  if (dev.is_cpu()) return reference::bias_act_forward(a, p);
#if FUSEKIT_WITH_CUDA
  cuda::bias_act_forward(a, p, stream);
#else
  (void)stream;
#endif
}

void bias_act_backward(const BiasActBackwardArgs& a, const BiasActParams& p, const Stream* stream) {
  constexpr const char* op = "bias_act_backward";
  check_rows(op, "dy", a.dy);
  checks::dtype_in(op, "dy", a.dy, kFloatTypes);
  const Device dev = a.dy.device();
  checks::cuda_available(op, dev);
  check_like(op, "saved", a.saved, a.dy);
  FK_CHECK_ARG(a.saved_kind == SavedForBackward::preactivation || derivative_from_output(p.act), op,
               "saved_kind", fmt::format("preactivation (the derivative of {} needs z)", activation_name(p.act)),
               "output");
  check_like(op, "dx", a.dx, a.dy);
  check_in_place(op, "dx", a.dx, "dy", a.dy);
  if (a.dr) check_like(op, "dr", *a.dr, a.dy);
  if (a.dbias) {
    checks::tensor(op, "dbias", *a.dbias, 1);
    checks::dtype_in(op, "dbias", *a.dbias, {DType::f32, a.dy.dtype()});
    checks::shape_is(op, "dbias", *a.dbias, Dims{a.dy.size(1)});
    checks::same_device(op, "dbias", *a.dbias, dev);
    checks::outputs_disjoint(op, {{"dbias", &*a.dbias}},
                             {{"dy", &a.dy}, {"saved", &a.saved}, {"dx", &a.dx}, {"dr", a.dr ? &*a.dr : nullptr}});
  }
  if (a.dy.numel() == 0) {
    if (a.dbias) fill(*a.dbias, 0.0);  // the sum over zero rows
    return;
  }
  if (dev.is_cpu()) return reference::bias_act_backward(a, p);
#if FUSEKIT_WITH_CUDA
  cuda::bias_act_backward(a, p, stream);
#else
  (void)stream;
#endif
}

}  // namespace fk
