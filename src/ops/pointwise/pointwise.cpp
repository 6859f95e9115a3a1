// Dispatch of the pointwise family: argument checks, then the CPU spec or the CUDA kernels.
#include "fusekit/ops/pointwise.hpp"

#include "ops/op_checks.hpp"
#include "pointwise_cuda.hpp"

namespace fk {
namespace {

constexpr std::initializer_list<DType> kFloatTypes = {DType::f32, DType::bf16, DType::f16};

// An optional [rows, cols] companion of `ref`: same dtype, shape and device.
void check_like(const char* op, const char* arg, const TensorView& t, const TensorView& ref) {
  checks::tensor(op, arg, t, 2);
  checks::same_dtype(op, arg, t, ref);
  checks::shape_is(op, arg, t, ref.shape());
  checks::same_device(op, arg, t, ref.device());
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
  checks::tensor(op, "x", a.x, 2);
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
  checks::tensor(op, "dy", a.dy, 2);
  checks::dtype_in(op, "dy", a.dy, kFloatTypes);
  const Device dev = a.dy.device();
  checks::cuda_available(op, dev);
  check_like(op, "saved", a.saved, a.dy);
  FK_CHECK_ARG(a.saved_kind == SavedForBackward::preactivation || derivative_from_output(p.act), op,
               "saved_kind", fmt::format("preactivation (the derivative of {} needs z)", activation_name(p.act)),
               "output");
  check_like(op, "dx", a.dx, a.dy);
  if (a.dr) check_like(op, "dr", *a.dr, a.dy);
  if (a.dbias) {
    checks::tensor(op, "dbias", *a.dbias, 1);
    checks::dtype_in(op, "dbias", *a.dbias, {DType::f32, a.dy.dtype()});
    checks::shape_is(op, "dbias", *a.dbias, Dims{a.dy.size(1)});
    checks::same_device(op, "dbias", *a.dbias, dev);
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
