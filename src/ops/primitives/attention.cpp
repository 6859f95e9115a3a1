// Dispatch of attention_forward and attention_backward: argument checks, then the CPU spec or the
// CUDA kernels (the sm_90 tensor-core forward for the plain options, else the warp-per-row kernel;
// the mma.sync backward for bf16/f16 at D 64, 96, 128 on sm_80+, else the warp-per-row kernels).
#include <cmath>
#include <cstdint>
#include <functional>

#include "fusekit/core/stream.hpp"
#include "fusekit/ops/attention.hpp"
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

// q [B, H, Sq, D], k and v [B, Hk, Sk, D] (H a multiple of Hk), one float dtype, one device; the
// options' values. Returns the device.
Device check_inputs(const char* op, const TensorView& q, const TensorView& k, const TensorView& v,
                    const AttentionOptions& opt, const Stream* stream) {
  checks::tensor(op, "q", q, 4);
  checks::dtype_in(op, "q", q, {DType::f32, DType::bf16, DType::f16});
  const Device dev = q.device();
  checks::cuda_available(op, dev);
  const std::int64_t b = q.size(0), h = q.size(1), d = q.size(3);
  FK_CHECK_ARG(d >= 1 && d <= 256, op, "q", "head_dim (last dimension) in [1, 256]", q.shape().str());

  checks::tensor(op, "k", k, 4);
  checks::same_dtype(op, "k", k, q);
  FK_CHECK_ARG(k.size(0) == b && k.size(1) >= 1 && h % k.size(1) == 0 && k.size(3) == d, op, "k",
               fmt::format("shape [{}, Hk, Sk, {}] with {} heads a multiple of Hk", b, d, h), k.shape().str());
  checks::same_device(op, "k", k, dev);

  checks::tensor(op, "v", v, 4);
  checks::same_dtype(op, "v", v, q);
  checks::shape_is(op, "v", v, k.shape());
  checks::same_device(op, "v", v, dev);

  FK_CHECK_ARG(std::isfinite(opt.scale), op, "scale", "a finite float", fmt::format("{}", opt.scale));
  FK_CHECK_ARG(std::isfinite(opt.softcap) && opt.softcap >= 0.0f, op, "softcap", "a finite float >= 0 (0: none)",
               fmt::format("{}", opt.softcap));
  FK_CHECK_ARG(opt.window_left >= -1, op, "window_left", "-1 (unbounded) or a key count >= 0",
               std::to_string(opt.window_left));
  FK_CHECK_ARG(opt.window_right >= -1, op, "window_right", "-1 (unbounded) or a key count >= 0",
               std::to_string(opt.window_right));
  if (stream && stream->handle() && dev.is_cuda())
    FK_CHECK_ARG(stream->device() == dev, op, "stream", fmt::format("a stream on {}", dev.str()),
                 fmt::format("a stream on {}", stream->device().str()));
  return dev;
}

// An output: dtype, shape and device of `like`'s kind, overlapping none of `inputs`.
void check_output(const char* op, const char* name, const TensorView& t, const TensorView& like, const Dims& shape,
                  std::initializer_list<const TensorView*> inputs) {
  checks::tensor(op, name, t, static_cast<int>(shape.size()));
  checks::same_dtype(op, name, t, like);
  checks::shape_is(op, name, t, shape);
  checks::same_device(op, name, t, like.device());
  for (const TensorView* in : inputs)
    FK_CHECK_ARG(!overlaps(t, *in), op, name, "memory that overlaps no input or other output", "an overlapping tensor");
}

void check_lse(const char* op, const TensorView& lse, const TensorView& q) {
  checks::tensor(op, "lse", lse, 3);
  checks::dtype_in(op, "lse", lse, {DType::f32});
  checks::shape_is(op, "lse", lse, Dims{q.size(0), q.size(1), q.size(2)});
  checks::same_device(op, "lse", lse, q.device());
}

// What the sm_90 forward kernel computes: the plain options (a bottom-right causal mask is the
// top-left one when Sq = Sk).
[[maybe_unused]] bool plain(const TensorView& q, const TensorView& k, const AttentionOptions& opt) {
  return k.size(1) == q.size(1) && opt.window_left < 0 && (opt.causal || opt.window_right < 0) &&
         opt.softcap == 0.0f && (!opt.causal || !opt.bottom_right || q.size(2) == k.size(2));
}

}  // namespace

void attention_forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                       const TensorView& lse, const AttentionOptions& opt, const Stream* stream) {
  constexpr const char* op = "attention_forward";
  const Device dev = check_inputs(op, q, k, v, opt, stream);
  check_output(op, "out", out, q, q.shape(), {&q, &k, &v});
  check_lse(op, lse, q);
  FK_CHECK_ARG(!overlaps(lse, out) && !overlaps(lse, q) && !overlaps(lse, k) && !overlaps(lse, v), op, "lse",
               "memory that overlaps neither q, k, v nor out", "an overlapping tensor");
  if (out.numel() == 0) return;
  if (dev.is_cpu()) return reference::attention_forward(q, k, v, out, lse, opt);
#if FUSEKIT_WITH_CUDA
  if (!plain(q, k, opt) || !cuda::attention_forward_sm90(q, k, v, out, lse, opt.causal, opt.scale, stream))
    cuda::attention_forward_rowwise(q, k, v, out, lse, opt, stream);
#else
  (void)stream;
#endif
}

void attention_forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                       const TensorView& lse, bool causal, float scale, const Stream* stream) {
  attention_forward(q, k, v, out, lse, AttentionOptions{.causal = causal, .scale = scale}, stream);
}

void attention_backward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                        const TensorView& dout, const TensorView& lse, const TensorView& dq, const TensorView& dk,
                        const TensorView& dv, const AttentionOptions& opt, const Stream* stream) {
  constexpr const char* op = "attention_backward";
  const Device dev = check_inputs(op, q, k, v, opt, stream);
  check_output(op, "out", out, q, q.shape(), {});  // an input here: the forward's out
  checks::tensor(op, "dout", dout, 4);
  checks::same_dtype(op, "dout", dout, q);
  checks::shape_is(op, "dout", dout, q.shape());
  checks::same_device(op, "dout", dout, dev);
  check_lse(op, lse, q);
  const std::initializer_list<const TensorView*> inputs = {&q, &k, &v, &out, &dout, &lse};
  check_output(op, "dq", dq, q, q.shape(), inputs);
  check_output(op, "dk", dk, q, k.shape(), inputs);
  check_output(op, "dv", dv, q, k.shape(), inputs);
  FK_CHECK_ARG(!overlaps(dk, dq), op, "dk", "memory that overlaps neither dq nor dv", "a tensor overlapping dq");
  FK_CHECK_ARG(!overlaps(dv, dq) && !overlaps(dv, dk), op, "dv", "memory that overlaps neither dq nor dk",
               "a tensor overlapping dq or dk");
  if (dev.is_cpu()) return reference::attention_backward(q, k, v, out, dout, lse, dq, dk, dv, opt);
#if FUSEKIT_WITH_CUDA
  const Tensor delta = Tensor::empty({q.size(0), q.size(1), q.size(2)}, DType::f32, dev, stream);
  if (cuda::attention_backward_mma_supports(q, k)) {
    const Tensor dq_accum = opt.deterministic ? Tensor() : Tensor::empty(q.shape(), DType::f32, dev, stream);
    if (cuda::attention_backward_mma(q, k, v, out, dout, lse, dq, dk, dv, delta.view(), dq_accum.view(), opt, stream))
      return;
  }
  cuda::attention_backward_rowwise(q, k, v, out, dout, lse, dq, dk, dv, delta.view(), opt, stream);
#else
  (void)stream;
#endif
}

}  // namespace fk
