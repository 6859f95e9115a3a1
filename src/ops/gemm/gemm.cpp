// Dispatch of the gemm family: argument checks, then the CPU backends or cuBLAS / cuBLASLt.
#include "fusekit/ops/gemm.hpp"

#include <fmt/format.h>

#include <cmath>
#include <algorithm>
#include <limits>

#include "ops/gemm/gemm_impl.hpp"
#include "ops/common/op_checks.hpp"

namespace fk {

std::string_view gemm_epilogue_name(GemmEpilogue e) noexcept {
  switch (e) {
    case GemmEpilogue::none: return "none";
    case GemmEpilogue::bias: return "bias";
    case GemmEpilogue::relu: return "relu";
    case GemmEpilogue::relu_bias: return "relu_bias";
    case GemmEpilogue::gelu: return "gelu";
    case GemmEpilogue::gelu_bias: return "gelu_bias";
    case GemmEpilogue::gelu_aux_bias: return "gelu_aux_bias";
    case GemmEpilogue::dgelu: return "dgelu";
    case GemmEpilogue::dgelu_bgrad: return "dgelu_bgrad";
    case GemmEpilogue::bgrad_a: return "bgrad_a";
  }
  return "?";
}

namespace {

constexpr const char* kOp = "gemm";

bool needs_bias(GemmEpilogue e) {
  return e == GemmEpilogue::bias || e == GemmEpilogue::relu_bias || e == GemmEpilogue::gelu_bias ||
         e == GemmEpilogue::gelu_aux_bias;
}
bool needs_aux(GemmEpilogue e) {
  return e == GemmEpilogue::gelu_aux_bias || e == GemmEpilogue::dgelu || e == GemmEpilogue::dgelu_bgrad;
}
bool needs_bias_grad(GemmEpilogue e) { return e == GemmEpilogue::dgelu_bgrad || e == GemmEpilogue::bgrad_a; }

// A matrix operand: rank 2, or 3 with a leading batch dimension; unit column stride and a row
// stride of at least the row length (padded rows are fine); non-negative strides; non-null data.
gemm_detail::Matrix matrix(const char* arg, const TensorView& t, int rank) {
  FK_CHECK_ARG(t.rank() == rank, kOp, arg,
               rank == 2 ? std::string("a matrix [rows, cols]") : std::string("a batch of matrices [batch, rows, cols]"),
               t.str());
  const std::int64_t rows = t.size(rank - 2), cols = t.size(rank - 1);
  std::int64_t ld = t.strides()[rank - 2];
  // An empty matrix's strides are never used, nor a single row's stride: cuBLAS still wants one
  // of at least the row length.
  if (t.numel() == 0 || rows <= 1) ld = std::max({ld, cols, std::int64_t{1}});
  FK_CHECK_ARG(t.numel() == 0 || ((t.strides()[rank - 1] == 1 || cols <= 1) && ld >= std::max<std::int64_t>(cols, 1) &&
                                  (rank == 2 || t.strides()[0] >= 0)),
               kOp, arg, "unit column stride and a row stride >= the row length (rows may be padded)", t.str());
  FK_CHECK_ARG(t.data() != nullptr || t.numel() == 0, kOp, arg, "non-null data", "a null pointer");
  return {t.data(), ld, rank == 3 ? t.strides()[0] : 0};
}

void vector_arg(const char* arg, const TensorView& t, std::int64_t n, const TensorView& c) {
  checks::companion(kOp, arg, t, c, {n});
}

void unused(const char* arg, bool given, GemmEpilogue e) {
  FK_CHECK_ARG(!given, kOp, arg, fmt::format("no {} with epilogue {}", arg, gemm_epilogue_name(e)), "one");
}

}  // namespace

void gemm(const GemmArgs& x, const GemmParams& p, const Stream* stream) {
  const int rank = x.c.rank() == 3 ? 3 : 2;
  gemm_detail::Problem q;
  q.p = p;
  q.a = matrix("a", x.a, rank);
  q.b = matrix("b", x.b, rank);
  q.c = matrix("c", x.c, rank);
  checks::dtype_in(kOp, "a", x.a, checks::kFloatTypes);
  checks::same_dtype(kOp, "b", x.b, x.a);
  FK_CHECK_ARG(x.c.dtype() == x.a.dtype() || (x.c.dtype() == DType::f32 && x.a.dtype() != DType::f32), kOp, "c",
               fmt::format("dtype {}{}", dtype_name(x.a.dtype()), x.a.dtype() == DType::f32 ? "" : " or f32"),
               std::string(dtype_name(x.c.dtype())));
  q.in_type = x.a.dtype();
  q.out_type = x.c.dtype();
  q.device = x.c.device();
  checks::same_device(kOp, "a", x.a, q.device);
  checks::same_device(kOp, "b", x.b, q.device);
  checks::cuda_available(kOp, q.device);
  checks::check_stream(kOp, stream, q.device);

  const int r = rank - 2;
  const bool ta = p.trans_a == Trans::t, tb = p.trans_b == Trans::t;
  q.m = x.c.size(r);
  q.n = x.c.size(r + 1);
  q.k = ta ? x.a.size(r) : x.a.size(r + 1);
  FK_CHECK_ARG((ta ? x.a.size(r + 1) : x.a.size(r)) == q.m, kOp, "a",
               fmt::format("{} rows of op(a), as c has", q.m), x.a.shape().str());
  FK_CHECK_ARG((tb ? x.b.size(r + 1) : x.b.size(r)) == q.k && (tb ? x.b.size(r) : x.b.size(r + 1)) == q.n, kOp, "b",
               fmt::format("op(b) [{}, {}] (K from a, N from c)", q.k, q.n), x.b.shape().str());
  if (rank == 3) {
    q.batch = x.c.size(0);
    FK_CHECK_ARG(x.a.size(0) == q.batch, kOp, "a", fmt::format("a batch of {} (c's)", q.batch), x.a.shape().str());
    FK_CHECK_ARG(x.b.size(0) == q.batch, kOp, "b", fmt::format("a batch of {} (c's)", q.batch), x.b.shape().str());
    FK_CHECK_ARG(p.epilogue == GemmEpilogue::none, kOp, "epilogue", "none for a batched GEMM",
                 std::string(gemm_epilogue_name(p.epilogue)));
  }
  if (q.device.is_cuda()) {  // cuBLAS takes int sizes and leading dimensions
    constexpr std::int64_t kInt = std::numeric_limits<int>::max();
    FK_CHECK_ARG(q.m <= kInt && q.n <= kInt && q.k <= kInt && q.batch <= kInt && q.a.ld <= kInt && q.b.ld <= kInt &&
                     q.c.ld <= kInt,
                 kOp, "c", "sizes and row strides below 2^31 on CUDA",
                 fmt::format("M {} N {} K {} batch {}", q.m, q.n, q.k, q.batch));
  }
  FK_CHECK_ARG(std::isfinite(p.alpha) && std::isfinite(p.beta), kOp, "alpha", "finite alpha and beta",
               fmt::format("alpha {} beta {}", p.alpha, p.beta));

  const GemmEpilogue e = p.epilogue;
  if (e != GemmEpilogue::none)
    FK_CHECK_ARG(p.beta == 0.0f, kOp, "beta", fmt::format("0 with epilogue {}", gemm_epilogue_name(e)),
                 fmt::format("{}", p.beta));
  if (e == GemmEpilogue::bgrad_a)  // cuBLASLt's BGRADB reduces a transposed operand only
    FK_CHECK_ARG(p.trans_a == Trans::t, kOp, "trans_a", "t with epilogue bgrad_a (a = dy [K, M], the weight gradient's dyᵀ)",
                 "n");
  if (needs_bias_grad(e))
    FK_CHECK_ARG(p.alpha == 1.0f, kOp, "alpha", fmt::format("1 with epilogue {}", gemm_epilogue_name(e)),
                 fmt::format("{}", p.alpha));
  if (needs_bias(e)) {
    FK_CHECK_ARG(x.bias.has_value(), kOp, "bias", fmt::format("a bias [N] for epilogue {}", gemm_epilogue_name(e)),
                 "none");
    vector_arg("bias", *x.bias, q.n, x.c);
    q.bias = x.bias->data();
  } else {
    unused("bias", x.bias.has_value(), e);
  }
  if (needs_aux(e)) {
    FK_CHECK_ARG(x.aux.has_value(), kOp, "aux",
                 fmt::format("an aux [M, N] (the pre-activation) for epilogue {}", gemm_epilogue_name(e)), "none");
    q.aux = matrix("aux", *x.aux, 2);
    checks::same_dtype(kOp, "aux", *x.aux, x.c);
    checks::shape_is(kOp, "aux", *x.aux, {q.m, q.n});
    checks::same_device(kOp, "aux", *x.aux, q.device);
  } else {
    unused("aux", x.aux.has_value(), e);
  }
  if (needs_bias_grad(e)) {
    FK_CHECK_ARG(x.bias_grad.has_value(), kOp, "bias_grad",
                 fmt::format("a bias_grad for epilogue {}", gemm_epilogue_name(e)), "none");
    vector_arg("bias_grad", *x.bias_grad, e == GemmEpilogue::bgrad_a ? q.m : q.n, x.c);
    q.bias_grad = x.bias_grad->data();
  } else {
    unused("bias_grad", x.bias_grad.has_value(), e);
  }
  // c is written while a, b, bias and aux are read (aux is written by gelu_aux_bias: not c either).
  for (const auto& [arg, t] : {std::pair{"a", &x.a}, std::pair{"b", &x.b}})
    FK_CHECK_ARG(!checks::overlaps(x.c, *t), kOp, "c", fmt::format("memory that does not overlap {}", arg),
                 "an overlapping tensor");
  if (x.bias) FK_CHECK_ARG(!checks::overlaps(x.c, *x.bias), kOp, "c", "memory that does not overlap bias", "an overlapping tensor");
  if (x.aux) FK_CHECK_ARG(!checks::overlaps(x.c, *x.aux), kOp, "c", "memory that does not overlap aux", "an overlapping tensor");
  if (x.bias_grad)
    FK_CHECK_ARG(!checks::overlaps(*x.bias_grad, x.c), kOp, "bias_grad", "memory that does not overlap c",
                 "an overlapping tensor");

  if (q.device.is_cpu()) {
    if (q.m == 0 || q.batch == 0) return;
    if (q.n == 0) {
      if (e == GemmEpilogue::bgrad_a) gemm_detail::gemm_reference(q);  // bias_grad is [M]
      return;
    }
    if (q.in_type == DType::f32 && q.out_type == DType::f32) {
      for (std::int64_t g = 0; g < q.batch; ++g)
        gemm_detail::sgemm_blocked(ta, tb, q.m, q.n, q.k, p.alpha,
                                   static_cast<const float*>(q.a.data) + g * q.a.batch_stride, q.a.ld,
                                   static_cast<const float*>(q.b.data) + g * q.b.batch_stride, q.b.ld, p.beta,
                                   static_cast<float*>(q.c.data) + g * q.c.batch_stride, q.c.ld);
      if (e != GemmEpilogue::none) gemm_detail::epilogue_in_place(q);  // epilogues: unbatched, checked above
      return;
    }
    gemm_detail::gemm_reference(q);
    return;
  }
  if (q.m == 0 || q.n == 0 || q.batch == 0) {
    FK_CHECK_ARG(e != GemmEpilogue::bgrad_a || q.m == 0, kOp, "c", "N >= 1 for epilogue bgrad_a on CUDA",
                 x.c.shape().str());
    return;
  }
  if (q.k == 0)  // the sum over nothing; cuBLAS and cuBLASLt have no K = 0 path
    FK_CHECK_ARG(e == GemmEpilogue::none && (p.beta == 0.0f || p.beta == 1.0f), kOp, "a",
                 "K >= 1 on CUDA, except for epilogue none with beta 0 or 1", x.a.shape().str());
#if FUSEKIT_WITH_CUDA
  gemm_detail::gemm_cuda(q, stream);
#endif
}

}  // namespace fk
