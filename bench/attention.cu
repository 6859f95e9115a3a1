// Bench cases of attention_forward (family primitives): the fused FlashAttention-style kernel
// against the unfused path a user would otherwise run, in the same run on the same inputs:
// cuBLAS strided-batched S = scale Q Kᵀ into a bf16 [B*H, S, S] buffer (2 GiB at the headline
// shape), a row softmax kernel over S in place (causal: keys past the row are zeroed), and cuBLAS
// strided-batched O = P V. FLOPs are 4 B H S² D (two GEMMs), halved for causal, for both
// implementations, so that tflops compare the same useful work; pct_of_gemm reads tflops against
// the gemm_bf16 ceiling of the run.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "bench/harness.hpp"
#include "fusekit/ops/attention.hpp"
#include "fusekit/ops/gemm.hpp"
#include "fusekit/ops/pointwise.hpp"
#include "fusekit/core/cuda_check.hpp"
#include "fusekit/ops/primitives.hpp"
#include "ops/primitives/attention_cuda.hpp"

namespace fk::bench {
namespace {

using T = __nv_bfloat16;
constexpr int kSoftmaxThreads = 256, kSoftmaxPerThread = 16;  // rows of up to 4096 held in registers

// One block a row of S [rows, cols] (bf16, cols % 8 == 0, cols <= 4096): p = softmax(s) in place,
// fp32 statistics; with causal, row r of each head keeps keys <= r % rows_per_head.
__global__ void __launch_bounds__(kSoftmaxThreads)
    softmax_rows_kernel(T* __restrict__ s, int cols, int rows_per_head, bool causal) {
  __shared__ float red[kSoftmaxThreads / 32];
  T* row = s + static_cast<std::int64_t>(blockIdx.x) * cols;
  const int visible = causal ? min(cols, static_cast<int>(blockIdx.x % rows_per_head) + 1) : cols;
  float x[kSoftmaxPerThread];
  const int c0 = threadIdx.x * 8;
  float mx = -INFINITY;
#pragma unroll
  for (int h = 0; h < kSoftmaxPerThread / 8; ++h) {
    const int c = c0 + h * kSoftmaxThreads * 8;
    uint4 raw = make_uint4(0, 0, 0, 0);
    if (c < cols) raw = *reinterpret_cast<const uint4*>(row + c);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      x[8 * h + j] = c + j < visible ? __bfloat162float(e[j]) : -INFINITY;
      mx = fmaxf(mx, x[8 * h + j]);
    }
  }
  auto block_reduce = [&](float v, bool is_max) {
    for (int o = 16; o > 0; o /= 2) {
      const float w = __shfl_xor_sync(0xffffffffu, v, o);
      v = is_max ? fmaxf(v, w) : v + w;
    }
    __syncthreads();
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
    __syncthreads();
    v = red[0];
    for (int w = 1; w < kSoftmaxThreads / 32; ++w) v = is_max ? fmaxf(v, red[w]) : v + red[w];
    return v;
  };
  mx = block_reduce(mx, true);
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < kSoftmaxPerThread; ++i) {
    x[i] = __expf(x[i] - mx);
    sum += x[i];
  }
  const float inv = 1.0f / block_reduce(sum, false);
#pragma unroll
  for (int h = 0; h < kSoftmaxPerThread / 8; ++h) {
    const int c = c0 + h * kSoftmaxThreads * 8;
    if (c >= cols) continue;
    uint4 raw;
    T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int j = 0; j < 8; ++j) e[j] = __float2bfloat16_rn(x[8 * h + j] * inv);
    *reinterpret_cast<uint4*>(row + c) = raw;
  }
}

// --breakdown at D 64: the sm_90 forward with 128 query rows a CTA (two consumer warpgroups), the
// tile automatic does not take there, on the same inputs.
void forward_tile_record(Context& ctx, const std::string& name, const TensorView& q, const TensorView& k,
                         const TensorView& v, const TensorView& out, const TensorView& lse, bool causal, float scale,
                         double flops) {
  const AttentionOptions opt{.causal = causal, .scale = scale, .forward_tile = AttentionForwardTile::rows_128};
  Record r{"primitives", name, "sm90_rows_128", "fused"};
  r.median_us = ctx.time_us([&](int) { attention_forward(q, k, v, out, lse, opt, &ctx.fk_stream()); }, 1);
  r.tflops = flops / (r.median_us * 1e6);
  ctx.add(r);
}

void attention_cases(Context& ctx, std::int64_t d) {
  const std::int64_t b = 4, h = 16, s = 4096, bh = b * h;
  const std::string shape = "bf16_b4_h16_s4096_d" + std::to_string(d);
  const std::string name_full = "attention_fwd/" + shape, name_causal = name_full + "_causal";
  const bool want_full = ctx.selected("primitives", name_full), want_causal = ctx.selected("primitives", name_causal);
  if (!want_full && !want_causal) return;
  static_assert(kSoftmaxThreads * kSoftmaxPerThread >= 4096);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const Tensor q = ctx.random({b, h, s, d}, DType::bf16), k = ctx.random({b, h, s, d}, DType::bf16);
  const Tensor v = ctx.random({b, h, s, d}, DType::bf16);
  const Tensor out = ctx.empty({b, h, s, d}, DType::bf16), lse = ctx.empty({b, h, s}, DType::f32);
  const Tensor scores = ctx.empty({bh, s, s}, DType::bf16);  // the unfused path's S, then P
  const Tensor out_ref = ctx.empty({b, h, s, d}, DType::bf16);

  auto unfused = [&](bool causal) {
    const int n = static_cast<int>(s);
    const auto heads = [&](const Tensor& t) { return t.view().reshape({bh, s, d}); };
    GemmParams qk;
    qk.trans_b = Trans::t;
    qk.alpha = scale;
    gemm({heads(q), heads(k), scores.view().reshape({bh, s, s})}, qk, &ctx.fk_stream());  // S = scale Q Kᵀ
    softmax_rows_kernel<<<static_cast<unsigned>(bh * s), kSoftmaxThreads, 0, ctx.stream()>>>(scores.data_as<T>(), n, n,
                                                                                             causal);
    FK_CUDA_CHECK_LAUNCH("softmax_rows_kernel");
    gemm({scores.view().reshape({bh, s, s}), heads(v), heads(out_ref)}, {}, &ctx.fk_stream());  // O = P V
  };

  for (const bool causal : {false, true}) {
    const std::string& name = causal ? name_causal : name_full;
    if (!(causal ? want_causal : want_full)) continue;
    attention_forward(q, k, v, out, lse, causal, scale, &ctx.fk_stream());
    unfused(causal);
    // The unfused path rounds S and P to bf16 (the fused kernel only P): a few bf16 units apart.
    const double err = ctx.rel_err(out, out_ref);
    require_close(name, err, 2e-2);
    const double flops = 4.0 * static_cast<double>(bh) * s * s * d / (causal ? 2.0 : 1.0);
    Record f{"primitives", name, "fused", "cublas+softmax+cublas"};
    f.median_us = ctx.time_us([&](int) { attention_forward(q, k, v, out, lse, causal, scale, &ctx.fk_stream()); }, 1);
    f.tflops = flops / (f.median_us * 1e6);
    f.rel_err = err;
    Record u{"primitives", name, "cublas+softmax+cublas", "cublas+softmax+cublas"};
    u.median_us = ctx.time_us([&](int) { unfused(causal); }, 1);
    u.tflops = flops / (u.median_us * 1e6);
    ctx.add(f);
    ctx.add(u);
    if (d == 64 && ctx.breakdown()) forward_tile_record(ctx, name, q, k, v, out, lse, causal, scale, flops);
  }
}

void attention_layout_forward_cases(Context& ctx);
void attention_layout_backward_cases(Context& ctx);

// A long-sequence training shape (D = 128) and the same at D = 64; the training layouts (GQA,
// varlen) of attention_layout_cases.
void attention_cases_all(Context& ctx) {
  attention_cases(ctx, 128);
  attention_cases(ctx, 64);
  attention_layout_forward_cases(ctx);
}

FK_BENCH_CASE("primitives", "attention_fwd", attention_cases_all);

// Median of `runs` CUDA-event timings of f (which ran once already): for the warp-per-row
// baseline, far slower than the tensor-core kernels, where the harness's 50 runs would take minutes.
double time_few_us(Context& ctx, const std::function<void()>& f, int runs) {
  cudaEvent_t a, b;
  FK_CUDA_CHECK(cudaEventCreate(&a));
  FK_CUDA_CHECK(cudaEventCreate(&b));
  std::vector<double> us;
  for (int r = 0; r < runs; ++r) {
    FK_CUDA_CHECK(cudaEventRecord(a, ctx.stream()));
    f();
    FK_CUDA_CHECK(cudaEventRecord(b, ctx.stream()));
    FK_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    FK_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    us.push_back(ms * 1e3);
  }
  FK_CUDA_CHECK(cudaEventDestroy(a));
  FK_CUDA_CHECK(cudaEventDestroy(b));
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

// attention_backward (bf16): the sm_90 wgmma kernel (FlashAttention-3's design; on an sm_90 GPU
// only; dq by atomics, and by TMA reduces as wgmma_sm90_tma_dq), the mma.sync kernels (FlashAttention-2's algorithm; the default atomic-dq mode, and
// deterministic mode), each forced through AttentionOptions::backward_kernel, against the
// warp-per-row kernels that ran before them, on the same forward's out and lse. FLOPs: five
// [S, S, D] GEMMs (S recomputed, dP, dV, dK, dQ), 10 B H S² D = 2.5x the forward's 4 B H S² D,
// halved for causal.
void attention_backward_cases(Context& ctx, std::int64_t b, std::int64_t h, std::int64_t s, std::int64_t d) {
  const std::string shape = "bf16_b" + std::to_string(b) + "_h" + std::to_string(h) + "_s" + std::to_string(s) + "_d" +
                            std::to_string(d);
  for (const bool causal : {false, true}) {
    const std::string name = "attention_bwd/" + shape + (causal ? "_causal" : "");
    if (!ctx.selected("primitives", name)) continue;
    const AttentionOptions opt{.causal = causal, .scale = 1.0f / std::sqrt(static_cast<float>(d))};
    const Dims qs{b, h, s, d};
    const std::size_t bytes = 8 * static_cast<std::size_t>(b * h * s * d) * 2;  // q k v out dout dq dk dv
    const int rot = ctx.rotations_for(bytes);
    struct Set {
      Tensor q, k, v, out, lse, dout;
    };
    std::vector<Set> sets;
    for (int i = 0; i < rot; ++i) {
      Set x{ctx.random(qs, DType::bf16), ctx.random(qs, DType::bf16), ctx.random(qs, DType::bf16),
            ctx.empty(qs, DType::bf16), ctx.empty({b, h, s}, DType::f32), ctx.random(qs, DType::bf16)};
      attention_forward(x.q, x.k, x.v, x.out, x.lse, opt, &ctx.fk_stream());
      sets.push_back(std::move(x));
    }
    const Tensor dq = ctx.empty(qs, DType::bf16), dk = ctx.empty(qs, DType::bf16), dv = ctx.empty(qs, DType::bf16);
    const Tensor dq_ref = ctx.empty(qs, DType::bf16), dk_ref = ctx.empty(qs, DType::bf16);
    const Tensor dv_ref = ctx.empty(qs, DType::bf16), delta = ctx.empty({b, h, s}, DType::f32);
    auto fused = [&](int i, AttentionBackwardKernel kernel, bool deterministic) {
      AttentionOptions o = opt;
      o.deterministic = deterministic;
      o.backward_kernel = kernel;
      const Set& x = sets[static_cast<std::size_t>(i)];
      attention_backward(x.q, x.k, x.v, x.out, x.dout, x.lse, dq, dk, dv, o, &ctx.fk_stream());
    };
    auto rowwise = [&] {
      const Set& x = sets[0];
      cuda::attention_backward_rowwise(x.q, x.k, x.v, x.out, x.dout, x.lse, dq_ref, dk_ref, dv_ref, delta, nullptr,
                                       opt, &ctx.fk_stream());
    };
    rowwise();
    const double flops = 10.0 * static_cast<double>(b * h) * s * s * d / (causal ? 2.0 : 1.0);
    // Each tensor-core kernel is checked against the spec by attention_test; here it must agree
    // with the rowwise one at bf16's level (the tensor-core paths round P and dS to bf16, the
    // rowwise one does not).
    auto measure = [&](const char* impl, AttentionBackwardKernel kernel, bool deterministic) {
      fused(0, kernel, deterministic);
      const double err = std::max({ctx.rel_err(dq, dq_ref), ctx.rel_err(dk, dk_ref), ctx.rel_err(dv, dv_ref)});
      require_close(name + " (" + impl + ")", err, 2e-2);
      Record f{"primitives", name, impl, "rowwise"};
      f.median_us = ctx.time_us([&](int i) { fused(i, kernel, deterministic); }, rot);
      f.tflops = flops / (f.median_us * 1e6);
      f.rel_err = err;
      ctx.add(f);
    };
    int device = 0, major = 0, minor = 0;
    FK_CUDA_CHECK(cudaGetDevice(&device));
    FK_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    FK_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    if (major == 9 && minor == 0) {
      measure("wgmma_sm90", AttentionBackwardKernel::wgmma_sm90, false);
      measure("wgmma_sm90_tma_dq", AttentionBackwardKernel::wgmma_sm90_tma_dq, false);
    }
    measure("mma_sync", AttentionBackwardKernel::mma_sync, false);
    measure("mma_sync_deterministic", AttentionBackwardKernel::mma_sync, true);

    Record r{"primitives", name, "rowwise", "rowwise"};
    r.median_us = time_few_us(ctx, rowwise, 3);
    r.tflops = flops / (r.median_us * 1e6);
    r.extra.emplace_back("runs", 3.0);
    ctx.add(r);
  }
}

// A long-sequence training shape at D = 128 and D = 64, and a shorter one at D = 64; the training
// layouts (GQA, varlen) of attention_layout_cases.
void attention_backward_cases_all(Context& ctx) {
  attention_backward_cases(ctx, 4, 16, 2048, 128);
  attention_backward_cases(ctx, 4, 16, 2048, 64);
  attention_backward_cases(ctx, 8, 16, 1024, 64);
  attention_layout_backward_cases(ctx);
}

FK_BENCH_CASE("primitives", "attention_bwd", attention_backward_cases_all);

// The training layouts on the sm_90 kernels (sm_90 GPUs only: elsewhere they are the warp-per-row
// kernels): grouped-query heads (Hk < H), a varlen batch of B equal sequences of S tokens, and
// every tensor as Hugging Face hands it ([B, S, H, D] memory seen as [B, H, S, D], "bshd"), each
// timed next to the dense multi-head call with the same B, H, S, D in the same run (impl "dense",
// the baseline), so that tflops compare the same FLOPs directly (4 B H S² D forward, 10 B H S² D
// backward, halved for causal) and a speedup below 1 is what the layout costs. Forward and
// backward (automatic kernel choice: wgmma_sm90_tma_dq) checked against the warp-per-row kernels
// on the same inputs (bshd: against the same call on contiguous copies).
enum class LayoutKind { gqa, varlen, bshd };
struct LayoutShape {
  std::int64_t b, h, hk, s, d;
  LayoutKind kind;
};

void attention_layout_cases(Context& ctx, const LayoutShape& x, bool bwd) {
  int device = 0, major = 0, minor = 0;
  FK_CUDA_CHECK(cudaGetDevice(&device));
  FK_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  FK_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  if (major != 9 || minor != 0) return;
  const bool varlen_kind = x.kind == LayoutKind::varlen, bshd = x.kind == LayoutKind::bshd;
  const std::string shape = std::string("bf16_") + (varlen_kind ? "varlen_" : "") + "b" + std::to_string(x.b) + "_h" +
                            std::to_string(x.h) + (x.hk != x.h ? "_hk" + std::to_string(x.hk) : "") + "_s" +
                            std::to_string(x.s) + "_d" + std::to_string(x.d) +
                            (x.kind == LayoutKind::gqa ? "_gqa" : bshd ? "_bshd" : "");
  const std::string name_full = std::string(bwd ? "attention_bwd/" : "attention_fwd/") + shape;
  if (!ctx.selected("primitives", name_full) && !ctx.selected("primitives", name_full + "_causal")) return;
  const std::int64_t tokens = x.b * x.s;
  // The dense multi-head call of the same FLOPs, and the call under test: packed [B S, H, D] with
  // cu_seqlens 0, S, 2 S, ... (varlen) or dense with Hk k/v heads (GQA).
  const Dims dq_shape{x.b, x.h, x.s, x.d}, dstat{x.b, x.h, x.s};
  const Dims q_shape = varlen_kind ? Dims{tokens, x.h, x.d} : dq_shape;
  const Dims k_shape = varlen_kind ? Dims{tokens, x.hk, x.d} : Dims{x.b, x.hk, x.s, x.d};
  const Dims stat = varlen_kind ? Dims{x.h, tokens} : dstat;
  Tensor cu_host = Tensor::empty({x.b + 1}, DType::i32, Device::cpu());
  for (std::int64_t i = 0; i <= x.b; ++i) cu_host.data_as<std::int32_t>()[i] = static_cast<std::int32_t>(i * x.s);
  const Tensor cu = cu_host.copy_to(Device::cuda(device));
  const AttentionVarlen seqs{cu.view(), cu.view(), x.s, x.s};
  const AttentionVarlen* varlen = varlen_kind ? &seqs : nullptr;

  // bshd: each tensor's memory is [B, S, H, D], seen as [B, H, S, D].
  auto seen = [&](const Tensor& mem) -> TensorView {
    if (!bshd) return mem.view();
    const std::int64_t heads = mem.size(1);
    return TensorView(mem.data(), mem.dtype(), mem.shape(), {x.s * heads * x.d, x.d, heads * x.d, 1}, mem.device());
  };
  const Tensor qm = ctx.random(q_shape, DType::bf16), km = ctx.random(k_shape, DType::bf16);
  const Tensor vm = ctx.random(k_shape, DType::bf16), doutm = ctx.random(q_shape, DType::bf16);
  const Tensor outm = ctx.empty(q_shape, DType::bf16), lse = ctx.empty(stat, DType::f32);
  const Tensor dqm = ctx.empty(q_shape, DType::bf16), dkm = ctx.empty(k_shape, DType::bf16);
  const Tensor dvm = ctx.empty(k_shape, DType::bf16);
  const TensorView q = seen(qm), k = seen(km), v = seen(vm), dout = seen(doutm), out = seen(outm), dq = seen(dqm),
                   dk = seen(dkm), dv = seen(dvm);
  const Tensor qd = ctx.random(dq_shape, DType::bf16), kd = ctx.random(dq_shape, DType::bf16);
  const Tensor vd = ctx.random(dq_shape, DType::bf16), doutd = ctx.random(dq_shape, DType::bf16);
  const Tensor outd = ctx.empty(dq_shape, DType::bf16), lsed = ctx.empty(dstat, DType::f32);
  const Tensor dqd = ctx.empty(dq_shape, DType::bf16), dkd = ctx.empty(dq_shape, DType::bf16);
  const Tensor dvd = ctx.empty(dq_shape, DType::bf16);
  for (const bool causal : {false, true}) {
    const AttentionOptions opt{.causal = causal, .scale = 1.0f / std::sqrt(static_cast<float>(x.d))};
    auto forward = [&] {
      if (varlen) attention_forward_varlen(q, k, v, out, lse, *varlen, opt, &ctx.fk_stream());
      else attention_forward(q, k, v, out, lse, opt, &ctx.fk_stream());
    };
    auto backward = [&] {
      if (varlen) attention_backward_varlen(q, k, v, out, dout, lse, dq, dk, dv, *varlen, opt, &ctx.fk_stream());
      else attention_backward(q, k, v, out, dout, lse, dq, dk, dv, opt, &ctx.fk_stream());
    };
    const std::string name = name_full + (causal ? "_causal" : "");
    if (!ctx.selected("primitives", name)) continue;
    forward();
    if (bwd) backward();
    // The warp-per-row kernels on the same inputs (the bf16 tensor-core paths round P, and dS, to
    // bf16; the row-wise ones do not).
    const Tensor out_ref = ctx.empty(q_shape, DType::bf16), lse_ref = ctx.empty(stat, DType::f32);
    double err = 0;
    if (bshd) {
      // The same call on contiguous copies, each result copied out of its [B, S, H, D] memory.
      auto dense = [&](const TensorView& t) {
        Tensor c = ctx.empty(t.shape(), t.dtype());
        convert(t, c, &ctx.fk_stream());
        return c;
      };
      const Tensor qc = dense(q), kc = dense(k), vc = dense(v), doc = dense(dout);
      attention_forward(qc, kc, vc, out_ref, lse_ref, opt, &ctx.fk_stream());
      err = ctx.rel_err(dense(out), out_ref);
      if (bwd) {
        const Tensor dq_ref = ctx.empty(q_shape, DType::bf16), dk_ref = ctx.empty(k_shape, DType::bf16);
        const Tensor dv_ref = ctx.empty(k_shape, DType::bf16);
        attention_backward(qc, kc, vc, out_ref, doc, lse_ref, dq_ref, dk_ref, dv_ref, opt, &ctx.fk_stream());
        err = std::max(
            {ctx.rel_err(dense(dq), dq_ref), ctx.rel_err(dense(dk), dk_ref), ctx.rel_err(dense(dv), dv_ref)});
      }
    } else if (!bwd) {
      cuda::attention_forward_rowwise(q, k, v, out_ref, lse_ref, varlen, opt, &ctx.fk_stream());
      err = ctx.rel_err(out, out_ref);
    } else {
      const Tensor dq_ref = ctx.empty(q_shape, DType::bf16), dk_ref = ctx.empty(k_shape, DType::bf16);
      const Tensor dv_ref = ctx.empty(k_shape, DType::bf16), delta = ctx.empty(stat, DType::f32);
      cuda::attention_backward_rowwise(q, k, v, out, dout, lse, dq_ref, dk_ref, dv_ref, delta, varlen, opt,
                                       &ctx.fk_stream());
      err = std::max({ctx.rel_err(dq, dq_ref), ctx.rel_err(dk, dk_ref), ctx.rel_err(dv, dv_ref)});
    }
    require_close(name, err, 2e-2);
    const double flops = (bwd ? 10.0 : 4.0) * static_cast<double>(x.b * x.h) * x.s * x.s * x.d / (causal ? 2.0 : 1.0);
    Record f{"primitives", name, "fused", "dense"};
    f.median_us = ctx.time_us([&](int) { bwd ? backward() : forward(); }, 1);
    f.tflops = flops / (f.median_us * 1e6);
    f.rel_err = err;
    attention_forward(qd, kd, vd, outd, lsed, opt, &ctx.fk_stream());
    Record r{"primitives", name, "dense", "dense"};
    r.median_us = ctx.time_us(
        [&](int) {
          if (bwd) attention_backward(qd, kd, vd, outd, doutd, lsed, dqd, dkd, dvd, opt, &ctx.fk_stream());
          else attention_forward(qd, kd, vd, outd, lsed, opt, &ctx.fk_stream());
        },
        1);
    r.tflops = flops / (r.median_us * 1e6);
    ctx.add(f);
    ctx.add(r);
    if (!bwd && !varlen && x.d == 64 && ctx.breakdown())
      forward_tile_record(ctx, name, qd, kd, vd, outd, lsed, causal, opt.scale, flops);
  }
}

// LLaMA-3-style grouped-query heads (32 q heads over 8 k/v heads, D 128), varlen batches with
// the dense cases' tokens (4 x 4096 forward as attention_fwd/bf16_b4_h16_s4096_d128{,_causal},
// 4 x 2048 backward as attention_bwd/bf16_b4_h16_s2048_d{128,64}{,_causal}), and the LLM training
// benchmark's small model as Hugging Face hands it (B 64, H 12, S 1024, D 64, bshd).
void attention_layout_forward_cases(Context& ctx) {
  attention_layout_cases(ctx, {4, 32, 8, 4096, 128, LayoutKind::gqa}, false);
  attention_layout_cases(ctx, {4, 16, 16, 4096, 128, LayoutKind::varlen}, false);
  attention_layout_cases(ctx, {64, 12, 12, 1024, 64, LayoutKind::bshd}, false);
}
void attention_layout_backward_cases(Context& ctx) {
  attention_layout_cases(ctx, {4, 32, 8, 2048, 128, LayoutKind::gqa}, true);
  attention_layout_cases(ctx, {4, 16, 16, 2048, 128, LayoutKind::varlen}, true);
  attention_layout_cases(ctx, {4, 16, 16, 2048, 64, LayoutKind::varlen}, true);
  attention_layout_cases(ctx, {64, 12, 12, 1024, 64, LayoutKind::bshd}, true);
}

}  // namespace
}  // namespace fk::bench
