// Dispatch of attention_forward and attention_backward, dense and packed (varlen): argument checks,
// then the CPU spec or the CUDA kernels, dense or packed alike (the sm_90 tensor-core forward for
// bf16/f16 at D 64, 128 without window or softcap, grouped-query heads and either causal alignment
// included, else the warp-per-row kernel; the sm_90 wgmma backward for bf16/f16 at D 64, 128
// without window, softcap or deterministic mode, else the mma.sync backward for bf16/f16 at D 64,
// 96, 128 on sm_80+, else the warp-per-row kernels; AttentionOptions::backward_kernel forces one).
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <utility>

#include "fusekit/core/stream.hpp"
#include "fusekit/ops/attention.hpp"
#include "fusekit/ops/pointwise.hpp"
#include "fusekit/ops/primitives.hpp"
#include "ops/common/op_checks.hpp"
#if FUSEKIT_WITH_CUDA
#include "attention_cuda.hpp"
#endif

namespace fk {
namespace {

using checks::overlaps;  // of the views' spans

// A copy of t in contiguous memory, kept in `keep` (t itself, and `keep` left empty, when t is
// contiguous): what the kernels other than the sm_90 ones read.
TensorView contiguous_input(const TensorView& t, Tensor& keep, const Stream* stream) {
  if (t.is_contiguous()) return t;
  keep = Tensor::empty(t.shape(), t.dtype(), t.device(), stream);
  convert(t, keep.view(), stream);
  return keep.view();
}
// Contiguous memory for an output (t itself when contiguous), copied into t by finish_output.
TensorView contiguous_output(const TensorView& t, Tensor& keep, const Stream* stream) {
  if (t.is_contiguous()) return t;
  keep = Tensor::empty(t.shape(), t.dtype(), t.device(), stream);
  return keep.view();
}
void finish_output(const TensorView& t, const Tensor& keep, const Stream* stream) {
  if (keep.data() != nullptr) convert(keep.view(), t, stream);  // a default Tensor holds nothing
}

// Dense: q [B, H, Sq, D], k and v [B, Hk, Sk, D]; packed: q [total_q, H, D], k and v
// [total_k, Hk, D]. H a multiple of Hk, one float dtype, one device; the options' values. Returns
// the device.
Device check_inputs(const char* op, const TensorView& q, const TensorView& k, const TensorView& v,
                    const AttentionOptions& opt, const Stream* stream, bool packed = false) {
  const int rank = packed ? 3 : 4;
  checks::rows_tensor(op, "q", q, rank, false);
  checks::dtype_in(op, "q", q, {DType::f32, DType::bf16, DType::f16});
  const Device dev = q.device();
  checks::cuda_available(op, dev);
  const std::int64_t h = q.size(1), d = q.size(rank - 1);
  FK_CHECK_ARG(d >= 1 && d <= 256, op, "q", "head_dim (last dimension) in [1, 256]", q.shape().str());

  checks::rows_tensor(op, "k", k, rank, false);
  checks::same_dtype(op, "k", k, q);
  const bool heads_ok = k.size(1) >= 1 && h % k.size(1) == 0 && k.size(rank - 1) == d;
  if (packed)
    FK_CHECK_ARG(heads_ok, op, "k", fmt::format("shape [total_k, Hk, {}] with {} heads a multiple of Hk", d, h),
                 k.shape().str());
  else
    FK_CHECK_ARG(heads_ok && k.size(0) == q.size(0), op, "k",
                 fmt::format("shape [{}, Hk, Sk, {}] with {} heads a multiple of Hk", q.size(0), d, h), k.shape().str());
  checks::same_device(op, "k", k, dev);

  checks::rows_tensor(op, "v", v, rank, false);
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

// One cu_seqlens on the host: 0 first, non-decreasing, `total` last, no step above max_len.
void check_seqlen_values(const char* op, const char* arg, const TensorView& cu, std::int64_t total, const char* of,
                         std::int64_t max_len, const char* max_arg) {
  const auto* c = cu.data_as<const std::int32_t>();
  FK_CHECK_ARG(c[0] == 0, op, arg, "0 as its first entry", fmt::format("{}[0] = {}", arg, c[0]));
  for (std::int64_t i = 1; i < cu.numel(); ++i) {
    FK_CHECK_ARG(c[i] >= c[i - 1], op, arg, "non-decreasing entries (sequence lengths >= 0)",
                 fmt::format("{}[{}] = {} after {}", arg, i, c[i], c[i - 1]));
    FK_CHECK_ARG(c[i] - c[i - 1] <= max_len, op, max_arg, "at least the longest sequence's length",
                 fmt::format("{} with sequence {} of length {}", max_len, i - 1, c[i] - c[i - 1]));
  }
  FK_CHECK_ARG(c[cu.numel() - 1] == total, op, arg, fmt::format("{} as its last entry ({}'s tokens)", total, of),
               fmt::format("{}[{}] = {}", arg, cu.numel() - 1, c[cu.numel() - 1]));
}

// cu_seqlens_q and cu_seqlens_k [B + 1] i32 on q's device, B >= 1; the max_seqlens in [0, 2^31);
// on the host also the values (on a GPU they are trusted, as the header says).
void check_seqlens(const char* op, const TensorView& q, const TensorView& k, const AttentionVarlen& seqs) {
  const Device dev = q.device();
  for (auto [name, cu] : {std::pair{"cu_seqlens_q", &seqs.cu_seqlens_q}, std::pair{"cu_seqlens_k", &seqs.cu_seqlens_k}}) {
    checks::tensor(op, name, *cu, 1);
    checks::dtype_in(op, name, *cu, {DType::i32});
    FK_CHECK_ARG(cu->size(0) >= 2, op, name, "shape [B + 1] with B >= 1 sequences", cu->shape().str());
    checks::same_device(op, name, *cu, dev);
  }
  checks::shape_is(op, "cu_seqlens_k", seqs.cu_seqlens_k, seqs.cu_seqlens_q.shape());
  constexpr std::int64_t kMaxI32 = std::numeric_limits<std::int32_t>::max();
  FK_CHECK_ARG(q.size(0) <= kMaxI32, op, "q", "at most 2^31 - 1 tokens (cu_seqlens are i32)", q.shape().str());
  FK_CHECK_ARG(k.size(0) <= kMaxI32, op, "k", "at most 2^31 - 1 tokens (cu_seqlens are i32)", k.shape().str());
  FK_CHECK_ARG(seqs.max_seqlen_q >= 0 && seqs.max_seqlen_q <= kMaxI32, op, "max_seqlen_q", "a length in [0, 2^31)",
               std::to_string(seqs.max_seqlen_q));
  FK_CHECK_ARG(seqs.max_seqlen_k >= 0 && seqs.max_seqlen_k <= kMaxI32, op, "max_seqlen_k", "a length in [0, 2^31)",
               std::to_string(seqs.max_seqlen_k));
  if (dev.is_cpu()) {
    check_seqlen_values(op, "cu_seqlens_q", seqs.cu_seqlens_q, q.size(0), "q", seqs.max_seqlen_q, "max_seqlen_q");
    check_seqlen_values(op, "cu_seqlens_k", seqs.cu_seqlens_k, k.size(0), "k", seqs.max_seqlen_k, "max_seqlen_k");
  }
}

// An output (or, with no `inputs`, a further input): dtype, shape and device of `like`'s kind, any
// strides with the last one 1, overlapping none of `inputs`.
void check_output(const char* op, const char* name, const TensorView& t, const TensorView& like, const Dims& shape,
                  std::initializer_list<const TensorView*> inputs, bool output = true) {
  checks::rows_tensor(op, name, t, static_cast<int>(shape.size()), output);
  checks::same_dtype(op, name, t, like);
  checks::shape_is(op, name, t, shape);
  checks::same_device(op, name, t, like.device());
  for (const TensorView* in : inputs)
    FK_CHECK_ARG(!overlaps(t, *in), op, name, "memory that overlaps no input or other output", "an overlapping tensor");
}

// lse f32 of `shape` ([B, H, Sq] dense, [H, total_q] packed) on q's device.
void check_lse(const char* op, const TensorView& lse, const TensorView& q, const Dims& shape) {
  checks::tensor(op, "lse", lse, static_cast<int>(shape.size()));
  checks::dtype_in(op, "lse", lse, {DType::f32});
  checks::shape_is(op, "lse", lse, shape);
  checks::same_device(op, "lse", lse, q.device());
}

Dims lse_shape(const TensorView& q, bool packed) {
  return packed ? Dims{q.size(1), q.size(0)} : Dims{q.size(0), q.size(1), q.size(2)};
}

// The outputs of a forward: out like q, lse, overlapping no input and each other.
void check_forward_outputs(const char* op, const TensorView& q, const TensorView& k, const TensorView& v,
                           const TensorView& out, const TensorView& lse, bool packed) {
  check_output(op, "out", out, q, q.shape(), {&q, &k, &v});
  check_lse(op, lse, q, lse_shape(q, packed));
  FK_CHECK_ARG(!overlaps(lse, out) && !overlaps(lse, q) && !overlaps(lse, k) && !overlaps(lse, v), op, "lse",
               "memory that overlaps neither q, k, v nor out", "an overlapping tensor");
}

// The backward's further inputs (out, dout, lse) and its outputs dq, dk, dv.
void check_backward_tensors(const char* op, const TensorView& q, const TensorView& k, const TensorView& v,
                            const TensorView& out, const TensorView& dout, const TensorView& lse, const TensorView& dq,
                            const TensorView& dk, const TensorView& dv, bool packed) {
  check_output(op, "out", out, q, q.shape(), {}, false);  // an input here: the forward's out
  checks::rows_tensor(op, "dout", dout, q.rank(), false);
  checks::same_dtype(op, "dout", dout, q);
  checks::shape_is(op, "dout", dout, q.shape());
  checks::same_device(op, "dout", dout, q.device());
  check_lse(op, lse, q, lse_shape(q, packed));
  const std::initializer_list<const TensorView*> inputs = {&q, &k, &v, &out, &dout, &lse};
  check_output(op, "dq", dq, q, q.shape(), inputs);
  check_output(op, "dk", dk, q, k.shape(), inputs);
  check_output(op, "dv", dv, q, k.shape(), inputs);
  FK_CHECK_ARG(!overlaps(dk, dq), op, "dk", "memory that overlaps neither dq nor dv", "a tensor overlapping dq");
  FK_CHECK_ARG(!overlaps(dv, dq) && !overlaps(dv, dk), op, "dv", "memory that overlaps neither dq nor dk",
               "a tensor overlapping dq or dk");
}

bool all_contiguous(std::initializer_list<const TensorView*> ts) {
  for (const TensorView* t : ts)
    if (!t->is_contiguous()) return false;
  return true;
}

// The forward on the CPU spec or the CUDA kernels, dense (varlen null) or packed: the sm_90 kernel
// reads q, k, v and writes out where they are; the spec and the warp-per-row kernel take contiguous
// copies (out copied back).
void forward_dispatch(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                      const TensorView& lse, const AttentionVarlen* varlen, const AttentionOptions& opt,
                      const Stream* stream) {
#if FUSEKIT_WITH_CUDA
  if (q.device().is_cuda() && cuda::attention_forward_sm90(q, k, v, out, lse, varlen, opt, stream)) return;
#endif
  if (!all_contiguous({&q, &k, &v, &out})) {
    Tensor kq, kk, kv, ko;
    const TensorView cq = contiguous_input(q, kq, stream), ck = contiguous_input(k, kk, stream),
                     cv = contiguous_input(v, kv, stream), co = contiguous_output(out, ko, stream);
    forward_dispatch(cq, ck, cv, co, lse, varlen, opt, stream);
    return finish_output(out, ko, stream);
  }
  if (q.device().is_cpu()) {
    if (varlen) return reference::attention_forward_varlen(q, k, v, out, lse, *varlen, opt);
    return reference::attention_forward(q, k, v, out, lse, opt);
  }
#if FUSEKIT_WITH_CUDA
  cuda::attention_forward_rowwise(q, k, v, out, lse, varlen, opt, stream);
#endif
}

// The backward, dense (varlen null) or packed: on the CPU the spec; on a GPU the kernel
// opt.backward_kernel names, or (automatic) the sm_90 wgmma kernel, else the mma.sync one, where
// they take the call, else the warp-per-row ones. The sm_90 kernel reads and writes every tensor
// where it is; the others take contiguous copies (dq, dk, dv copied back). delta takes lse's layout.
void backward_dispatch(const char* op, const TensorView& q, const TensorView& k, const TensorView& v,
                       const TensorView& out, const TensorView& dout, const TensorView& lse, const TensorView& dq,
                       const TensorView& dk, const TensorView& dv, const AttentionVarlen* varlen,
                       const AttentionOptions& opt, const Stream* stream) {
  using K = AttentionBackwardKernel;
  const K which = opt.backward_kernel;
  const bool contiguous = all_contiguous({&q, &k, &v, &out, &dout, &dq, &dk, &dv});
#if FUSEKIT_WITH_CUDA
  if (q.device().is_cuda() && (which == K::automatic || which == K::wgmma_sm90 || which == K::wgmma_sm90_tma_dq)) {
    if (cuda::attention_backward_sm90_supports(q, k, v, out, dout, dq, dk, dv, varlen, opt)) {
      const Tensor delta = Tensor::empty(lse.shape(), DType::f32, q.device(), stream);
      const Tensor dq_accum = Tensor::empty(q.shape(), DType::f32, q.device(), stream);
      return cuda::attention_backward_sm90(q, k, v, out, dout, lse, dq, dk, dv, delta.view(), dq_accum.view(), varlen,
                                           opt, stream);
    }
    FK_CHECK_ARG(which == K::automatic || !contiguous, op, "backward_kernel",
                 "wgmma_sm90 (and wgmma_sm90_tma_dq) only for a bf16/f16 call (dense or varlen) with D 64 or 128, "
                 "no window, no softcap, not deterministic, 16-byte aligned tensors, on an sm_90 GPU",
                 "a wgmma_sm90 kernel for a call it does not take");
  }
#endif
  if (!contiguous) {
    Tensor kq, kk, kv, ko, kdo, kdq, kdk, kdv;
    const TensorView cq = contiguous_input(q, kq, stream), ck = contiguous_input(k, kk, stream),
                     cv = contiguous_input(v, kv, stream), co = contiguous_input(out, ko, stream),
                     cdo = contiguous_input(dout, kdo, stream), cdq = contiguous_output(dq, kdq, stream),
                     cdk = contiguous_output(dk, kdk, stream), cdv = contiguous_output(dv, kdv, stream);
    backward_dispatch(op, cq, ck, cv, co, cdo, lse, cdq, cdk, cdv, varlen, opt, stream);
    finish_output(dq, kdq, stream);
    finish_output(dk, kdk, stream);
    return finish_output(dv, kdv, stream);
  }
  if (q.device().is_cpu()) {
    if (varlen) return reference::attention_backward_varlen(q, k, v, out, dout, lse, dq, dk, dv, *varlen, opt);
    return reference::attention_backward(q, k, v, out, dout, lse, dq, dk, dv, opt);
  }
#if FUSEKIT_WITH_CUDA
  const Tensor delta = Tensor::empty(lse.shape(), DType::f32, q.device(), stream);
  if (which != K::rowwise && cuda::attention_backward_mma_supports(q, k, varlen)) {
    const Tensor dq_accum = opt.deterministic ? Tensor() : Tensor::empty(q.shape(), DType::f32, q.device(), stream);
    if (cuda::attention_backward_mma(q, k, v, out, dout, lse, dq, dk, dv, delta.view(), dq_accum.view(), varlen, opt,
                                     stream))
      return;
  }
  FK_CHECK_ARG(which != K::mma_sync, op, "backward_kernel",
               "mma_sync only for bf16/f16 with D 64, 96 or 128 on an sm_80+ GPU (16-byte aligned tensors)",
               "mma_sync for a call it does not take");
  cuda::attention_backward_rowwise(q, k, v, out, dout, lse, dq, dk, dv, delta.view(), varlen, opt, stream);
#else
  (void)op, (void)which;
#endif
}

}  // namespace

void attention_forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                       const TensorView& lse, const AttentionOptions& opt, const Stream* stream) {
  constexpr const char* op = "attention_forward";
  check_inputs(op, q, k, v, opt, stream);
  check_forward_outputs(op, q, k, v, out, lse, false);
  if (out.numel() == 0) return;
  forward_dispatch(q, k, v, out, lse, nullptr, opt, stream);
}

void attention_forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                       const TensorView& lse, bool causal, float scale, const Stream* stream) {
  attention_forward(q, k, v, out, lse, AttentionOptions{.causal = causal, .scale = scale}, stream);
}

void attention_backward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                        const TensorView& dout, const TensorView& lse, const TensorView& dq, const TensorView& dk,
                        const TensorView& dv, const AttentionOptions& opt, const Stream* stream) {
  constexpr const char* op = "attention_backward";
  check_inputs(op, q, k, v, opt, stream);
  check_backward_tensors(op, q, k, v, out, dout, lse, dq, dk, dv, false);
  backward_dispatch(op, q, k, v, out, dout, lse, dq, dk, dv, nullptr, opt, stream);
}

void attention_forward_varlen(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                              const TensorView& lse, const AttentionVarlen& seqs, const AttentionOptions& opt,
                              const Stream* stream) {
  constexpr const char* op = "attention_forward_varlen";
  check_inputs(op, q, k, v, opt, stream, true);
  check_seqlens(op, q, k, seqs);
  check_forward_outputs(op, q, k, v, out, lse, true);
  if (out.numel() == 0) return;
  forward_dispatch(q, k, v, out, lse, &seqs, opt, stream);
}

void attention_backward_varlen(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                               const TensorView& dout, const TensorView& lse, const TensorView& dq,
                               const TensorView& dk, const TensorView& dv, const AttentionVarlen& seqs,
                               const AttentionOptions& opt, const Stream* stream) {
  constexpr const char* op = "attention_backward_varlen";
  check_inputs(op, q, k, v, opt, stream, true);
  check_seqlens(op, q, k, seqs);
  check_backward_tensors(op, q, k, v, out, dout, lse, dq, dk, dv, true);
  backward_dispatch(op, q, k, v, out, dout, lse, dq, dk, dv, &seqs, opt, stream);
}

}  // namespace fk
