// Bench cases of the loss family: linear_cross_entropy (loss and the gradients dh, dw of an LM
// head, bf16) against the unfused path a user would otherwise run: the full logits [N, V] by one
// cuBLAS GEMM (bf16, as F.linear gives them under autocast), a softmax-statistics kernel (each
// row's logsumexp), a cross-entropy kernel (each row's loss and its gradient softmax − onehot,
// written to a second [N, V] buffer), then cuBLAS dh = g w and dw = gᵀ h. Both give the mean
// loss over every row (no ignored targets, no smoothing). tflops counts the three GEMMs
// (6 N V H) for both; gemm_only_us is the plain cuBLAS logits GEMM alone. extra: the scratch each
// path allocates (MiB).
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "bench/harness.hpp"
#include "fusekit/core/cuda_check.hpp"
#include "fusekit/core/error.hpp"
#include "fusekit/ops/gemm.hpp"
#include "fusekit/ops/loss.hpp"

namespace fk::bench {
namespace {

constexpr DType kType = DType::bf16;
constexpr int kThreads = 256;

__device__ float block_reduce(float v, bool take_max) {
  __shared__ float part[kThreads / 32];
  for (int off = 16; off > 0; off >>= 1) {
    const float o = __shfl_xor_sync(0xffffffffu, v, off);
    v = take_max ? fmaxf(v, o) : v + o;
  }
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = v;
  __syncthreads();
  float r = part[0];
  for (int w = 1; w < kThreads / 32; ++w) r = take_max ? fmaxf(r, part[w]) : r + part[w];
  __syncthreads();
  return r;
}

// lse[i] = logsumexp of row i: a max pass and a sum pass over the row.
__global__ void row_lse_kernel(const __nv_bfloat16* logits, std::int64_t v, float* lse) {
  const __nv_bfloat16* z = logits + blockIdx.x * v;
  float m = -INFINITY;
  for (std::int64_t j = threadIdx.x; j < v; j += kThreads) m = fmaxf(m, __bfloat162float(z[j]));
  m = block_reduce(m, true);
  float s = 0.0f;
  for (std::int64_t j = threadIdx.x; j < v; j += kThreads) s += __expf(__bfloat162float(z[j]) - m);
  s = block_reduce(s, false);
  if (threadIdx.x == 0) lse[blockIdx.x] = m + logf(s);
}

// row_loss[i] = lse_i − z_{i,t}; g = (softmax − onehot) / N into its own buffer.
__global__ void cross_entropy_grad_kernel(const __nv_bfloat16* logits, const float* lse, const std::int64_t* targets,
                                          std::int64_t n, std::int64_t v, float* row_loss, __nv_bfloat16* g) {
  const std::int64_t i = blockIdx.x, t = targets[i];
  const __nv_bfloat16* z = logits + i * v;
  const float l = lse[i], inv_n = 1.0f / static_cast<float>(n);
  if (threadIdx.x == 0) row_loss[i] = l - __bfloat162float(z[t]);
  for (std::int64_t j = threadIdx.x; j < v; j += kThreads)
    g[i * v + j] = __float2bfloat16_rn((__expf(__bfloat162float(z[j]) - l) - (j == t ? 1.0f : 0.0f)) * inv_n);
}

__global__ void mean_kernel(const float* row_loss, std::int64_t n, float* loss) {
  float s = 0.0f;
  for (std::int64_t i = threadIdx.x; i < n; i += kThreads) s += row_loss[i];
  s = block_reduce(s, false);
  if (threadIdx.x == 0) loss[0] = s / static_cast<float>(n);
}

struct Shape {
  std::int64_t n, h, v;
};

std::string shape_name(const Shape& s) {
  return "bf16_N" + std::to_string(s.n) + "_H" + std::to_string(s.h) + "_V" + std::to_string(s.v);
}

void loss_case(Context& ctx, const Shape& s) {
  const std::string name = "linear_cross_entropy/" + shape_name(s);
  if (!ctx.selected("loss", name)) return;
  const Stream* st = &ctx.fk_stream();
  const cudaStream_t cs = ctx.stream();
  const float hs = 2.0f / std::sqrt(static_cast<float>(s.h));
  const Tensor w = ctx.random({s.v, s.h}, kType, -1.f, 1.f);
  const std::size_t bytes = static_cast<std::size_t>(s.n * s.h) * dtype_size(kType);
  const int rot = ctx.rotations_for(bytes);
  std::vector<Tensor> hs_;
  for (int i = 0; i < rot; ++i) hs_.push_back(ctx.random({s.n, s.h}, kType, -hs, hs));
  // Targets spread over the vocabulary (a fixed stride through it), none ignored.
  Tensor targets_host = Tensor::empty({s.n}, DType::i64, Device::cpu());
  for (std::int64_t i = 0; i < s.n; ++i) targets_host.data_as<std::int64_t>()[i] = (i * 7919) % s.v;
  const Tensor targets = targets_host.copy_to(w.device());
  const Tensor loss = ctx.empty({}, DType::f32), loss_base = ctx.empty({}, DType::f32);
  const Tensor dh = ctx.empty({s.n, s.h}, kType), dw = ctx.empty({s.v, s.h}, kType);
  const Tensor dh_base = ctx.empty({s.n, s.h}, kType), dw_base = ctx.empty({s.v, s.h}, kType);
  // The unfused path's intermediates, reused across runs as a caching allocator would hand them out.
  const Tensor logits = ctx.empty({s.n, s.v}, kType), g = ctx.empty({s.n, s.v}, kType);
  const Tensor lse = ctx.empty({s.n}, DType::f32), row_loss = ctx.empty({s.n}, DType::f32);
  LinearCrossEntropyParams p;
  p.check_targets = false;  // no host synchronisation inside the timed runs
  auto fused = [&](const Tensor& h) {
    linear_cross_entropy({h, w, std::nullopt, targets, loss, dh.view(), dw.view(), std::nullopt}, p, st);
  };
  auto baseline = [&](const Tensor& h) {
    matmul(h, w, logits, Trans::n, Trans::t, st);
    row_lse_kernel<<<static_cast<unsigned>(s.n), kThreads, 0, cs>>>(logits.data_as<const __nv_bfloat16>(), s.v,
                                                                     lse.data_as<float>());
    cross_entropy_grad_kernel<<<static_cast<unsigned>(s.n), kThreads, 0, cs>>>(
        logits.data_as<const __nv_bfloat16>(), lse.data_as<const float>(), targets.data_as<const std::int64_t>(), s.n,
        s.v, row_loss.data_as<float>(), g.data_as<__nv_bfloat16>());
    mean_kernel<<<1, kThreads, 0, cs>>>(row_loss.data_as<const float>(), s.n, loss_base.data_as<float>());
    FK_CUDA_CHECK_LAUNCH("loss baseline");
    matmul(g, w, dh_base, Trans::n, Trans::n, st);
    matmul(g, h, dw_base, Trans::t, Trans::n, st);
  };
  auto gemm = [&](const Tensor& h) { matmul(h, w, logits, Trans::n, Trans::t, st); };
  fused(hs_[0]);
  baseline(hs_[0]);
  // The baseline rounds the logits to bf16 (the fused path keeps them in f32): the loss agrees to
  // a few bf16 units of the logits, the gradients to one bf16 rounding of g.
  const double loss_err = ctx.rel_err(loss, loss_base);
  require_close(name + " loss", loss_err, 1e-2);
  const double err = std::max(ctx.rel_err(dh, dh_base), ctx.rel_err(dw, dw_base));
  require_close(name, err, 3e-2);
  const auto at = [&](int i) -> const Tensor& { return hs_[static_cast<std::size_t>(i)]; };
  const std::vector<double> t = ctx.time_us_interleaved(
      {[&](int i) { fused(at(i)); }, [&](int i) { gemm(at(i)); }, [&](int i) { baseline(at(i)); }}, rot);
  const double flops = 6.0 * static_cast<double>(s.n) * static_cast<double>(s.v) * static_cast<double>(s.h);
  const std::int64_t c = linear_cross_entropy_chunk_rows(s.n, s.v);
  const double fused_mib =
      static_cast<double>(c * ((s.v + 7) / 8 * 8) * 4 + s.v * s.h * 4 + s.n * 4) / static_cast<double>(1 << 20);
  const double base_mib = static_cast<double>(2 * s.n * s.v * 2 + s.n * 8) / static_cast<double>(1 << 20);
  Record fr{"loss", name, "fused", "cublas+softmax+ce"};
  fr.median_us = t[0];
  fr.tflops = flops / (t[0] * 1e6);
  fr.rel_err = err;
  fr.gemm_only_us = t[1];
  fr.extra = {{"scratch_mib", fused_mib}, {"chunk_rows", static_cast<double>(c)}};
  Record br{"loss", name, "cublas+softmax+ce", "cublas+softmax+ce"};
  br.median_us = t[2];
  br.tflops = flops / (t[2] * 1e6);
  br.gemm_only_us = t[1];
  br.extra = {{"scratch_mib", base_mib}};
  ctx.add(fr);
  ctx.add(br);
}

void run_loss(Context& ctx) {
  // The LM benchmark's head (width 768, vocabulary 32000, 8 sequences of 1024), a LLaMA-3-sized
  // one (4096, 128256) and an odd vocabulary.
  for (const Shape& s : {Shape{8192, 768, 32000}, Shape{8192, 2048, 32000}, Shape{4096, 4096, 128256},
                         Shape{4096, 1024, 50257}})
    loss_case(ctx, s);
}

}  // namespace

FK_BENCH_CASE("loss", "linear_cross_entropy", run_loss);

}  // namespace fk::bench
