// Dispatch of the primitives family: argument checks, then the CPU spec or the CUDA kernels.
#include "fusekit/ops/primitives.hpp"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "fusekit/core/stream.hpp"
#include "fusekit/ops/gemm.hpp"
#include "ops/common/op_checks.hpp"
#include "primitives_cuda.hpp"

namespace fk {
namespace {

constexpr std::initializer_list<DType> kFloatTypes = {DType::f32, DType::bf16, DType::f16};

using checks::check_stream;
using checks::overlaps;

// A contiguous tensor of any rank up to kMaxRank, non-null unless empty.
void any_rank_tensor(const char* op, const char* arg, const TensorView& t) {
  FK_CHECK_ARG(t.is_contiguous(), op, arg, "a contiguous (row-major) tensor", t.str());
  FK_CHECK_ARG(t.data() != nullptr || t.numel() == 0, op, arg, "non-null data", "a null pointer");
}

// An output that is either exactly the input `in` (same memory, same shape) or disjoint from it.
bool same_or_disjoint(const TensorView& out, const TensorView& in) {
  return !overlaps(out, in) || (out.data() == in.data() && out.shape() == in.shape());
}

// The broadcast shape of x and y (NumPy rules); names y when the two do not broadcast.
Dims broadcast_shape(const char* op, const TensorView& x, const TensorView& y) {
  const int rank = std::max(x.rank(), y.rank());
  std::vector<std::int64_t> d(static_cast<std::size_t>(rank));
  for (int i = 0; i < rank; ++i) {
    const int xi = i - (rank - x.rank()), yi = i - (rank - y.rank());
    const std::int64_t a = xi >= 0 ? x.size(xi) : 1, b = yi >= 0 ? y.size(yi) : 1;
    FK_CHECK_ARG(a == b || a == 1 || b == 1, op, "y", fmt::format("a shape that broadcasts with x {}", x.shape().str()),
                 y.shape().str());
    d[static_cast<std::size_t>(i)] = a == 1 ? b : a;
  }
  return Dims(std::span<const std::int64_t>(d));
}

// Checks x and y of a broadcast op; returns their device and broadcast shape.
Dims check_binary_operands(const char* op, const TensorView& x, const TensorView& y) {
  any_rank_tensor(op, "x", x);
  checks::dtype_in(op, "x", x, kFloatTypes);
  checks::cuda_available(op, x.device());
  any_rank_tensor(op, "y", y);
  checks::same_dtype(op, "y", y, x);
  checks::same_device(op, "y", y, x.device());
  return broadcast_shape(op, x, y);
}

void broadcast_binary_checked(const char* op, BinaryOp f, const TensorView& x, const TensorView& y, const TensorView& z,
                              const Stream* stream) {
  const Dims shape = check_binary_operands(op, x, y);
  any_rank_tensor(op, "z", z);
  checks::same_dtype(op, "z", z, x);
  checks::shape_is(op, "z", z, shape);
  checks::same_device(op, "z", z, x.device());
  FK_CHECK_ARG(same_or_disjoint(z, x) && same_or_disjoint(z, y), op, "z",
               "x or y itself (in place) or memory disjoint from both", "a partly overlapping tensor");
  check_stream(op, stream, x.device());
  if (z.numel() == 0) return;
  if (x.device().is_cpu()) return reference::broadcast_binary(f, x, y, z);
#if FUSEKIT_WITH_CUDA
  cuda::broadcast_binary(f, x, y, z, stream);
#endif
}

}  // namespace

std::string_view binary_op_name(BinaryOp op) noexcept {
  switch (op) {
    case BinaryOp::add: return "add";
    case BinaryOp::mul: return "mul";
    case BinaryOp::mul_relu: return "mul_relu";
  }
  return "?";
}

std::string_view conv2d_padding_name(Conv2dPadding p) noexcept {
  switch (p) {
    case Conv2dPadding::valid: return "valid";
    case Conv2dPadding::same: return "same";
    case Conv2dPadding::same_end: return "same_end";
  }
  return "?";
}

void broadcast_binary(BinaryOp op, const TensorView& x, const TensorView& y, const TensorView& z,
                      const Stream* stream) {
  broadcast_binary_checked("broadcast_binary", op, x, y, z, stream);
}

void outer(BinaryOp op, const TensorView& x, const TensorView& y, const TensorView& z, const Stream* stream) {
  constexpr const char* name = "outer";
  checks::tensor(name, "x", x, 1);
  checks::tensor(name, "y", y, 1);
  checks::tensor(name, "z", z, 2);
  checks::shape_is(name, "z", z, Dims{y.size(0), x.size(0)});
  broadcast_binary_checked(name, op, x.reshape({1, x.size(0)}), y.reshape({y.size(0), 1}), z, stream);
}

void broadcast_binary_backward(BinaryOp op, const TensorView& x, const TensorView& y, const TensorView& dz,
                               const std::optional<TensorView>& dx, const std::optional<TensorView>& dy,
                               const Stream* stream) {
  constexpr const char* name = "broadcast_binary_backward";
  const Dims shape = check_binary_operands(name, x, y);
  const Device dev = x.device();
  any_rank_tensor(name, "dz", dz);
  checks::same_dtype(name, "dz", dz, x);
  checks::shape_is(name, "dz", dz, shape);
  checks::same_device(name, "dz", dz, dev);
  const auto check_grad = [&](const char* arg, const std::optional<TensorView>& g, const TensorView& of) {
    if (!g) return;
    any_rank_tensor(name, arg, *g);
    checks::same_dtype(name, arg, *g, x);
    checks::shape_is(name, arg, *g, of.shape());
    checks::same_device(name, arg, *g, dev);
    FK_CHECK_ARG(!overlaps(*g, x) && !overlaps(*g, y) && !overlaps(*g, dz), name, arg,
                 "memory that overlaps none of x, y, dz", "an overlapping tensor");
  };
  check_grad("dx", dx, x);
  check_grad("dy", dy, y);
  if (dx && dy) FK_CHECK_ARG(!overlaps(*dx, *dy), name, "dy", "memory disjoint from dx", "an overlapping tensor");
  check_stream(name, stream, dev);
  if (!dx && !dy) return;
  if (dev.is_cpu()) return reference::broadcast_binary_backward(op, x, y, dz, dx, dy);
#if FUSEKIT_WITH_CUDA
  cuda::broadcast_binary_backward(op, x, y, dz, dx, dy, stream);
#endif
}

void row_sum(const TensorView& x, const TensorView& out, const Stream* stream) {
  constexpr const char* op = "row_sum";
  checks::tensor(op, "x", x, 2);
  checks::dtype_in(op, "x", x, kFloatTypes);
  const Device dev = x.device();
  checks::cuda_available(op, dev);
  checks::tensor(op, "out", out, 1);
  if (x.dtype() == DType::f32)
    checks::dtype_in(op, "out", out, {DType::f32});
  else
    checks::dtype_in(op, "out", out, {DType::f32, x.dtype()});
  checks::shape_is(op, "out", out, Dims{x.size(0)});
  checks::same_device(op, "out", out, dev);
  FK_CHECK_ARG(!overlaps(out, x), op, "out", "memory that does not overlap x", "an overlapping tensor");
  check_stream(op, stream, dev);
  if (out.numel() == 0) return;
  if (dev.is_cpu()) return reference::row_sum(x, out);
#if FUSEKIT_WITH_CUDA
  cuda::row_sum(x, out, stream);
#endif
}

void softmax(const TensorView& x, const TensorView& y, const Stream* stream) {
  constexpr const char* op = "softmax";
  checks::tensor(op, "x", x, 2);
  checks::dtype_in(op, "x", x, kFloatTypes);
  const Device dev = x.device();
  checks::cuda_available(op, dev);
  checks::tensor(op, "y", y, 2);
  checks::same_dtype(op, "y", y, x);
  checks::shape_is(op, "y", y, x.shape());
  checks::same_device(op, "y", y, dev);
  FK_CHECK_ARG(same_or_disjoint(y, x), op, "y", "x itself (in place) or memory disjoint from x",
               "a partly overlapping tensor");
  check_stream(op, stream, dev);
  if (y.numel() == 0) return;
  if (dev.is_cpu()) return reference::softmax(x, y);
#if FUSEKIT_WITH_CUDA
  cuda::softmax(x, y, stream);
#endif
}

void conv2d(const TensorView& x, const TensorView& w, const TensorView& y, Conv2dPadding padding,
            const Stream* stream) {
  constexpr const char* op = "conv2d";
  checks::tensor(op, "x", x, 4);
  checks::dtype_in(op, "x", x, kFloatTypes);
  const Device dev = x.device();
  checks::cuda_available(op, dev);
  const std::int64_t n = x.size(0), c = x.size(1), h = x.size(2), wd = x.size(3);
  checks::tensor(op, "w", w, 4);
  checks::same_dtype(op, "w", w, x);
  checks::same_device(op, "w", w, dev);
  const std::int64_t o = w.size(0), kh = w.size(2), kw = w.size(3);
  FK_CHECK_ARG(w.size(1) == c && kh >= 1 && kw >= 1, op, "w", fmt::format("shape [O, {}, KH >= 1, KW >= 1]", c),
               w.shape().str());
  if (padding == Conv2dPadding::valid)
    FK_CHECK_ARG(kh <= h && kw <= wd, op, "w", fmt::format("a kernel no larger than the image {}x{} (valid)", h, wd),
                 w.shape().str());
  const std::int64_t ho = padding == Conv2dPadding::valid ? h - kh + 1 : h;
  const std::int64_t wo = padding == Conv2dPadding::valid ? wd - kw + 1 : wd;
  checks::tensor(op, "y", y, 4);
  checks::same_dtype(op, "y", y, x);
  checks::shape_is(op, "y", y, Dims{n, o, ho, wo});
  checks::same_device(op, "y", y, dev);
  FK_CHECK_ARG(!overlaps(y, x) && !overlaps(y, w), op, "y", "memory that overlaps neither x nor w",
               "an overlapping tensor");
  check_stream(op, stream, dev);
  if (y.numel() == 0) return;
  if (dev.is_cpu()) return reference::conv2d(x, w, y, padding);
#if FUSEKIT_WITH_CUDA
  const std::int64_t top = padding == Conv2dPadding::same ? (kh - 1) / 2 : 0;
  const std::int64_t left = padding == Conv2dPadding::same ? (kw - 1) / 2 : 0;
  cuda::conv2d(x, w, y, top, left, stream);
#endif
}

void batched_matmul(const TensorView& a, const TensorView& b, const TensorView& c, BatchedMatmulImpl impl,
                    const Stream* stream) {
  constexpr const char* op = "batched_matmul";
  checks::tensor(op, "a", a, 3);
  checks::dtype_in(op, "a", a, kFloatTypes);
  const Device dev = a.device();
  checks::cuda_available(op, dev);
  const std::int64_t batch = a.size(0), m = a.size(1), k = a.size(2);

  checks::tensor(op, "b", b, 3);
  checks::same_dtype(op, "b", b, a);
  FK_CHECK_ARG(b.size(0) == batch && b.size(1) == k, op, "b", fmt::format("shape [{}, {}, N]", batch, k),
               b.shape().str());
  checks::same_device(op, "b", b, dev);
  const std::int64_t n = b.size(2);

  checks::tensor(op, "c", c, 3);
  if (a.dtype() == DType::f32)
    checks::dtype_in(op, "c", c, {DType::f32});
  else
    checks::dtype_in(op, "c", c, {DType::f32, a.dtype()});
  checks::shape_is(op, "c", c, Dims{batch, m, n});
  checks::same_device(op, "c", c, dev);
  FK_CHECK_ARG(!overlaps(c, a) && !overlaps(c, b), op, "c", "memory that overlaps neither a nor b",
               "an overlapping tensor");

  // Checked on every device, so that a call is valid or not whatever device its tensors are on.
  FK_CHECK_ARG(impl == BatchedMatmulImpl::cublas || a.dtype() != DType::f32, op, "impl",
               "cublas for f32 operands (the CuTe kernel takes bf16 or f16)", "cute");
  check_stream(op, stream, dev);

  if (c.numel() == 0) return;
  if (dev.is_cpu()) return reference::batched_matmul(a, b, c);
#if FUSEKIT_WITH_CUDA
  if (impl == BatchedMatmulImpl::cute)
    cuda::batched_matmul_cute(a, b, c, stream);
  else
    gemm({a, b, c}, {}, stream);  // cuBLAS strided-batched, fp32 compute (never TF32)
#else
  (void)stream;
#endif
}

}  // namespace fk
