// Dispatch of attention_forward: argument checks, then the CPU spec or the CUDA kernels.
#include <cmath>
#include <cstdint>
#include <functional>

#include "fusekit/core/stream.hpp"
#include "fusekit/ops/primitives.hpp"
#include "ops/common/op_checks.hpp"
#if FUSEKIT_WITH_CUDA
#include "attention_cuda.hpp"
#endif

namespace fk {
namespace {

bool overlaps(const TensorView& x, const TensorView& y) {
  if (x.numel() == 0 || y.numel() == 0) return false;
  const auto* x0 = static_cast<const unsigned char*>(x.data());
  const auto* y0 = static_cast<const unsigned char*>(y.data());
  return std::less<>{}(x0, y0 + y.nbytes()) && std::less<>{}(y0, x0 + x.nbytes());
}

}  // namespace

void attention_forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                       const TensorView& lse, bool causal, float scale, const Stream* stream) {
  constexpr const char* op = "attention_forward";
  checks::tensor(op, "q", q, 4);
  checks::dtype_in(op, "q", q, {DType::f32, DType::bf16, DType::f16});
  const Device dev = q.device();
  checks::cuda_available(op, dev);
  const std::int64_t b = q.size(0), h = q.size(1), sq = q.size(2), d = q.size(3);
  FK_CHECK_ARG(d >= 1 && d <= 256, op, "q", "head_dim (last dimension) in [1, 256]", q.shape().str());

  checks::tensor(op, "k", k, 4);
  checks::same_dtype(op, "k", k, q);
  FK_CHECK_ARG(k.size(0) == b && k.size(1) == h && k.size(3) == d, op, "k",
               fmt::format("shape [{}, {}, Sk, {}]", b, h, d), k.shape().str());
  checks::same_device(op, "k", k, dev);

  checks::tensor(op, "v", v, 4);
  checks::same_dtype(op, "v", v, q);
  checks::shape_is(op, "v", v, k.shape());
  checks::same_device(op, "v", v, dev);

  checks::tensor(op, "out", out, 4);
  checks::same_dtype(op, "out", out, q);
  checks::shape_is(op, "out", out, q.shape());
  checks::same_device(op, "out", out, dev);
  FK_CHECK_ARG(!overlaps(out, q) && !overlaps(out, k) && !overlaps(out, v), op, "out",
               "memory that overlaps neither q, k nor v", "an overlapping tensor");

  checks::tensor(op, "lse", lse, 3);
  checks::dtype_in(op, "lse", lse, {DType::f32});
  checks::shape_is(op, "lse", lse, Dims{b, h, sq});
  checks::same_device(op, "lse", lse, dev);
  FK_CHECK_ARG(!overlaps(lse, out) && !overlaps(lse, q) && !overlaps(lse, k) && !overlaps(lse, v), op, "lse",
               "memory that overlaps neither q, k, v nor out", "an overlapping tensor");

  FK_CHECK_ARG(std::isfinite(scale), op, "scale", "a finite float", fmt::format("{}", scale));
  if (stream && stream->handle() && dev.is_cuda())
    FK_CHECK_ARG(stream->device() == dev, op, "stream", fmt::format("a stream on {}", dev.str()),
                 fmt::format("a stream on {}", stream->device().str()));

  if (out.numel() == 0) return;
  if (dev.is_cpu()) return reference::attention_forward(q, k, v, out, lse, causal, scale);
#if FUSEKIT_WITH_CUDA
  if (!cuda::attention_forward_sm90(q, k, v, out, lse, causal, scale, stream))
    cuda::attention_forward_rowwise(q, k, v, out, lse, causal, scale, stream);
#else
  (void)stream;
#endif
}

}  // namespace fk
