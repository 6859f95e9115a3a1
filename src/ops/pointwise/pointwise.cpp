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

// A tensor of rope's of rank `rank`: non-negative strides, stride 1 on the last dimension,
// non-null data unless empty.
void check_rope_layout(const char* op, const char* arg, const TensorView& t, int rank) {
  FK_CHECK_ARG(t.rank() == rank, op, arg, fmt::format("a rank-{} tensor", rank), t.str());
  bool ok = t.size(rank - 1) <= 1 || t.strides()[rank - 1] == 1;
  for (int i = 0; i < rank - 1; ++i) ok = ok && t.strides()[i] >= 0;
  FK_CHECK_ARG(ok, op, arg, "stride 1 on the last dimension and non-negative strides on the others",
               fmt::format("{} strides {}", t.str(), t.strides().str()));
  FK_CHECK_ARG(t.data() != nullptr || t.numel() == 0, op, arg, "non-null data", "a null pointer");
}

// An output of rope: its input itself (the same view), or memory that overlaps no other tensor.
void check_rope_output(const char* op, const char* arg, const TensorView& out, const char* in_arg,
                       const TensorView& in, std::initializer_list<checks::Named> others) {
  check_rope_layout(op, arg, out, 4);
  checks::same_dtype(op, arg, out, in);
  checks::shape_is(op, arg, out, in.shape());
  checks::same_device(op, arg, out, in.device());
  const bool in_place = out.data() == in.data() && out.strides() == in.strides();
  if (!in_place && checks::overlaps(out, in) && !checks::disjoint_elements(out, in))
    throw Error(op, arg, fmt::format("{} itself (the same view) or memory that does not overlap it", in_arg),
                fmt::format("an overlapping view with strides {} ({}'s: {})", out.strides().str(), in_arg,
                            in.strides().str()));
  for (const checks::Named& o : others)
    if (checks::overlaps(out, *o.t) && !checks::disjoint_elements(out, *o.t))
      throw Error(op, arg, fmt::format("memory that does not overlap {}", o.name), "an overlapping tensor");
}

void check_rope(const char* op, const RopeArgs& a) {
  check_rope_layout(op, "q", a.q, 4);
  checks::dtype_in(op, "q", a.q, kFloatTypes);
  const Device dev = a.q.device();
  checks::cuda_available(op, dev);
  const std::int64_t batch = a.q.size(0), seq = a.q.size(2), dim = a.q.size(3);
  FK_CHECK_ARG(dim % 2 == 0, op, "q", "an even last dimension (the rotation pairs its two halves)", a.q.str());
  check_rope_layout(op, "k", a.k, 4);
  checks::same_dtype(op, "k", a.k, a.q);
  checks::same_device(op, "k", a.k, dev);
  FK_CHECK_ARG(a.k.size(0) == batch && a.k.size(2) == seq && a.k.size(3) == dim, op, "k",
               fmt::format("shape [{}, Hk, {}, {}] (q's batch, sequence and head dimension)", batch, seq, dim),
               a.k.shape().str());
  FK_CHECK_ARG(a.q.size(1) + a.k.size(1) <= (std::int64_t{1} << 30), op, "k", "at most 2^30 heads of q and k together",
               fmt::format("{} + {}", a.q.size(1), a.k.size(1)));
  const int table_rank = a.cos.rank();
  FK_CHECK_ARG(table_rank == 2 || table_rank == 3, op, "cos", "a rank-2 [T, D] or rank-3 [B or 1, T, D] tensor",
               a.cos.str());
  check_rope_layout(op, "cos", a.cos, table_rank);
  checks::dtype_in(op, "cos", a.cos, {a.q.dtype(), DType::f32});
  checks::same_device(op, "cos", a.cos, dev);
  const bool shape_ok = table_rank == 2 ? a.cos.shape() == Dims{seq, dim}
                                        : (a.cos.size(0) == 1 || a.cos.size(0) == batch) && a.cos.size(1) == seq &&
                                              a.cos.size(2) == dim;
  FK_CHECK_ARG(shape_ok, op, "cos", fmt::format("shape [{0}, {1}], [1, {0}, {1}] or [{2}, {0}, {1}]", seq, dim, batch),
               a.cos.shape().str());
  check_rope_layout(op, "sin", a.sin, table_rank);
  checks::same_dtype(op, "sin", a.sin, a.cos);
  checks::shape_is(op, "sin", a.sin, a.cos.shape());
  checks::same_device(op, "sin", a.sin, dev);
  check_rope_output(op, "q_out", a.q_out, "q", a.q,
                    {{"k", &a.k}, {"cos", &a.cos}, {"sin", &a.sin}, {"k_out", &a.k_out}});
  check_rope_output(op, "k_out", a.k_out, "k", a.k, {{"q", &a.q}, {"cos", &a.cos}, {"sin", &a.sin}});
}

void rope(const char* op, const RopeArgs& a, bool backward, const Stream* stream) {
  check_rope(op, a);
  if (a.q.numel() == 0 && a.k.numel() == 0) return;
  if (a.q.device().is_cpu()) {
    if (stream != nullptr) stream->synchronize();
    return backward ? reference::rope_backward(a) : reference::rope_forward(a);
  }
#if FUSEKIT_WITH_CUDA
  checks::check_stream(op, stream, a.q.device());
  cuda::rope(a, backward, stream);
#else
  (void)stream;
#endif
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

void rope_forward(const RopeArgs& a, const Stream* stream) { rope("rope_forward", a, false, stream); }
void rope_backward(const RopeArgs& a, const Stream* stream) { rope("rope_backward", a, true, stream); }

}  // namespace fk
