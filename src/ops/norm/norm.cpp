// Dispatch of the norm family: argument checks, then the CPU spec or the CUDA kernels.
#include "fusekit/ops/norm.hpp"

#include <cmath>

#include "norm_cuda.hpp"
#include "ops/common/op_checks.hpp"

namespace fk {
namespace {

// A [rows, cols] operand: rank 2, rows of unit inner stride, a row stride of at least cols (each
// tensor has its own row stride), non-null data unless empty.
void check_rows(const char* op, const char* arg, const TensorView& t) {
  FK_CHECK_ARG(t.rank() == 2, op, arg, "a rank-2 tensor", t.str());
  const std::int64_t rows = t.size(0), cols = t.size(1);
  FK_CHECK_ARG(t.numel() == 0 || ((cols <= 1 || t.strides()[1] == 1) && (rows <= 1 || t.strides()[0] >= cols)), op,
               arg, "rows with inner stride 1 and a row stride >= cols", t.str());
  FK_CHECK_ARG(t.data() != nullptr || t.numel() == 0, op, arg, "non-null data", "a null pointer");
}

// A [rows, cols] operand of the given shape, dtype and device.
void check_rows_like(const char* op, const char* arg, const TensorView& t, const TensorView& shape_of, DType dtype) {
  check_rows(op, arg, t);
  checks::shape_is(op, arg, t, shape_of.shape());
  FK_CHECK_ARG(t.dtype() == dtype, op, arg, "dtype " + std::string(dtype_name(dtype)), std::string(dtype_name(t.dtype())));
  checks::same_device(op, arg, t, shape_of.device());
}

// A contiguous vector of n elements of the given dtype on `dev`.
void check_vector(const char* op, const char* arg, const TensorView& t, std::int64_t n, DType dtype, Device dev) {
  checks::tensor(op, arg, t, 1);
  checks::shape_is(op, arg, t, Dims{n});
  FK_CHECK_ARG(t.dtype() == dtype, op, arg, "dtype " + std::string(dtype_name(dtype)), std::string(dtype_name(t.dtype())));
  checks::same_device(op, arg, t, dev);
}

// The weight: [cols], s's dtype or f32.
void check_weight(const char* op, const TensorView& w, const TensorView& s) {
  checks::tensor(op, "weight", w, 1);
  checks::shape_is(op, "weight", w, Dims{s.size(1)});
  checks::dtype_in(op, "weight", w, {s.dtype(), DType::f32});
  checks::same_device(op, "weight", w, s.device());
}

// out (or dout): of the promotion of s's and the weight's dtypes, or a 16-bit type for f32 rows.
void check_out(const char* op, const char* arg, const TensorView& t, const TensorView& s, DType weight) {
  check_rows(op, arg, t);
  checks::shape_is(op, arg, t, s.shape());
  const DType promoted = rms_norm_out_dtype(s.dtype(), weight);
  FK_CHECK_ARG(rms_norm_out_dtype_allowed(s.dtype(), weight, t.dtype()), op, arg,
               "dtype " + std::string(dtype_name(promoted)) +
                   (s.dtype() == DType::f32 ? " (or bf16/f16 for f32 rows and weight)" : ""),
               std::string(dtype_name(t.dtype())));
  checks::same_device(op, arg, t, s.device());
}

void check_params(const char* op, const RmsNormParams& p) {
  FK_CHECK_ARG(std::isfinite(p.eps) && p.eps >= 0.0f, op, "eps", "a finite eps >= 0", std::to_string(p.eps));
  FK_CHECK_ARG(std::isfinite(p.offset), op, "offset", "a finite offset", std::to_string(p.offset));
}

}  // namespace

DType rms_norm_out_dtype(DType x, DType weight) { return x == weight ? x : DType::f32; }

bool rms_norm_out_dtype_allowed(DType s, DType weight, DType out) {
  const DType promoted = rms_norm_out_dtype(s, weight);
  return out == promoted || (promoted == DType::f32 && s == DType::f32 && (out == DType::bf16 || out == DType::f16));
}

void rms_norm_forward(const RmsNormForwardArgs& a, const RmsNormParams& p, const Stream* stream) {
  const char* op = a.residual ? "add_rms_norm_forward" : "rms_norm_forward";
  check_rows(op, "x", a.x);
  checks::dtype_in(op, "x", a.x, checks::kFloatTypes);
  const Device dev = a.x.device();
  checks::cuda_available(op, dev);
  checks::check_stream(op, stream, dev);
  check_params(op, p);
  // s = x, or x + residual in residual's dtype: x of that dtype, or 16-bit added to f32.
  if (a.residual) {
    check_rows(op, "residual", *a.residual);
    checks::dtype_in(op, "residual", *a.residual, checks::kFloatTypes);
    checks::shape_is(op, "residual", *a.residual, a.x.shape());
    checks::same_device(op, "residual", *a.residual, dev);
    FK_CHECK_ARG(a.residual->dtype() == a.x.dtype() || a.residual->dtype() == DType::f32, op, "residual",
                 "x's dtype " + std::string(dtype_name(a.x.dtype())) + ", or f32 (x then added in f32)",
                 std::string(dtype_name(a.residual->dtype())));
  }
  const TensorView& s = a.residual ? *a.residual : a.x;
  check_weight(op, a.weight, s);
  FK_CHECK_ARG(a.residual.has_value() == a.residual_out.has_value(), op, "residual_out",
               a.residual ? "a tensor (residual was given)" : "none (no residual was given)",
               a.residual_out ? "a tensor" : "none");
  if (a.residual_out) check_rows_like(op, "residual_out", *a.residual_out, s, s.dtype());
  check_out(op, "out", a.out, s, a.weight.dtype());
  check_vector(op, "rstd", a.rstd, a.x.size(0), DType::f32, dev);
  checks::outputs_disjoint(op, {{"out", &a.out}, {"residual_out", a.residual_out ? &*a.residual_out : nullptr},
                                {"rstd", &a.rstd}},
                           {{"x", &a.x}, {"residual", a.residual ? &*a.residual : nullptr}, {"weight", &a.weight}});
  FK_CHECK_ARG(a.x.size(0) == 0 || a.x.size(1) > 0, op, "x", "rows of at least one column (the mean of none is undefined)",
               a.x.str());
  if (a.x.numel() == 0) return;
  if (dev.is_cpu()) return reference::rms_norm_forward(a, p);
#if FUSEKIT_WITH_CUDA
  cuda::rms_norm_forward(a, p, stream);
#else
  (void)stream;
#endif
}

void rms_norm_backward(const RmsNormBackwardArgs& a, const RmsNormParams& p, const Stream* stream) {
  constexpr const char* op = "rms_norm_backward";
  check_rows(op, "s", a.s);
  checks::dtype_in(op, "s", a.s, checks::kFloatTypes);
  const Device dev = a.s.device();
  checks::cuda_available(op, dev);
  checks::check_stream(op, stream, dev);
  check_params(op, p);
  check_weight(op, a.weight, a.s);
  check_out(op, "dout", a.dout, a.s, a.weight.dtype());
  if (a.dresidual_out) check_rows_like(op, "dresidual_out", *a.dresidual_out, a.s, a.s.dtype());
  check_vector(op, "rstd", a.rstd, a.s.size(0), DType::f32, dev);
  check_rows_like(op, "dx", a.dx, a.s, a.s.dtype());
  if (a.dweight) check_vector(op, "dweight", *a.dweight, a.s.size(1), a.weight.dtype(), dev);
  if (a.dx_low) {
    FK_CHECK_ARG(a.s.dtype() == DType::f32 && (a.dout.dtype() == DType::bf16 || a.dout.dtype() == DType::f16), op,
                 "dx_low", "absent unless s is f32 and dout bf16 or f16",
                 fmt::format("s {}, dout {}", dtype_name(a.s.dtype()), dtype_name(a.dout.dtype())));
    check_rows_like(op, "dx_low", *a.dx_low, a.s, a.dout.dtype());
  }
  checks::outputs_disjoint(op, {{"dx", &a.dx}, {"dweight", a.dweight ? &*a.dweight : nullptr},
                                {"dx_low", a.dx_low ? &*a.dx_low : nullptr}},
                           {{"dout", &a.dout}, {"dresidual_out", a.dresidual_out ? &*a.dresidual_out : nullptr},
                            {"s", &a.s}, {"weight", &a.weight}, {"rstd", &a.rstd}});
  FK_CHECK_ARG(a.s.size(0) == 0 || a.s.size(1) > 0, op, "s", "rows of at least one column (the mean of none is undefined)",
               a.s.str());
  if (a.s.numel() == 0) {
    if (a.dweight) fill(*a.dweight, 0.0);  // the sum over zero rows
    return;
  }
  if (dev.is_cpu()) return reference::rms_norm_backward(a, p);
#if FUSEKIT_WITH_CUDA
  cuda::rms_norm_backward(a, p, stream);
#else
  (void)stream;
#endif
}

}  // namespace fk
