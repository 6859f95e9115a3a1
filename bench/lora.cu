// Bench cases of the lora family (seed 003's LoRA case study). The unfused path is the seed's:
// three cuBLAS GEMMs P = x Wᵀ, T = x Aᵀ, Q = T Bᵀ, then the add-multiply-activation kernel
// y = act(P + s Q + b) (fusekit's bias_act_forward, one memory-bound pass). The fused record
// carries gemm_only_us, the plain cuBLAS GEMM x Wᵀ alone in the same run. The breakdown of the
// fused path comes as records of their own: "lowrank_t_only" (the down-projection pass
// t = s x Aᵀ, a skinny cuBLAS GEMM) and "fused_gemm_only" (the one GEMM with the rank-r
// term, t given); at r <= 16 the fused path computes t inside its GEMM (lora_gemm_t.cu), and
// "fused_t_pass_then_gemm" is the path before that (the two parts back to back). tflops counts the flops of x Wᵀ + x Aᵀ + t Bᵀ for every impl.
//
// Backward (W frozen, bias frozen as LoRA trains it, act = relu: act' from the saved y). The
// unfused path: g = dy ⊙ relu'(y) (bias_act_backward), then cuBLAS u = g B, dB = s gᵀ T,
// dA = s uᵀ x, dx = g W and dx += s u A. The fused one (lora_backward): one pass over dy and y
// giving g, s u and dB (lora_grad.cu), cuBLAS dA, and dx as one GEMM g W with (s u) A added in
// its epilogue. gemm_only_us is the
// cuBLAS g W alone; "grad_pass_only" and "dx_gemm_only" time the fused path's two big parts.
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "bench/harness.hpp"
#include "fusekit/ops/lora.hpp"
#include "fusekit/ops/pointwise.hpp"
#include "fusekit/ops/gemm.hpp"
#include "ops/lora/lora_cuda.hpp"

namespace fk::bench {
namespace {

struct LoraShape {
  std::int64_t m, n, k, r;
};

std::string shape_name(const LoraShape& s) {
  return "bf16_M" + std::to_string(s.m) + "_N" + std::to_string(s.n) + "_K" + std::to_string(s.k) + "_r" +
         std::to_string(s.r);
}

constexpr DType kType = DType::bf16;
constexpr float kScale = 2.0f;  // alpha / r = 32 / 16

struct LoraSet {
  Tensor x, dy;
};

// Operands: x and dy rotate (they are what streams from memory); W, A, B, b are the layer's.
struct Layer {
  Tensor w, a, b, bias;
};

Layer make_layer(Context& ctx, const LoraShape& s) {
  const float ws = 30.0f / static_cast<float>(s.k);  // z of order 1, away from saturation
  return {ctx.random({s.n, s.k}, kType, -ws, ws), ctx.random({s.r, s.k}, kType, -ws, ws),
          ctx.random({s.n, s.r}, kType, -1.f, 1.f), ctx.random({s.n}, kType, -0.5f, 0.5f)};
}

double flops_of(const LoraShape& s) {
  return 2.0 * s.m * s.n * s.k + 2.0 * s.m * s.r * s.k + 2.0 * s.m * s.n * s.r;
}

// The fused record (against the unfused path, with gemm_only_us) and the unfused one, from the
// medians of one interleaved run: the fused path's at t[0], the unfused one's at t[unfused], the
// GEMM alone at t[gemm].
void add_fused_and_baseline(Context& ctx, const std::string& name, const std::vector<double>& t, double flops,
                            double err, std::size_t unfused = 1, std::size_t gemm = 2) {
  Record fr{"lora", name, "fused", "cublas+act"};
  fr.median_us = t[0];
  fr.tflops = flops / (t[0] * 1e6);
  fr.rel_err = err;
  fr.gemm_only_us = t[gemm];
  Record br{"lora", name, "cublas+act", "cublas+act"};
  br.median_us = t[unfused];
  br.tflops = flops / (t[unfused] * 1e6);
  br.gemm_only_us = t[gemm];
  ctx.add(fr);
  ctx.add(br);
}

void forward_case(Context& ctx, const LoraShape& s) {
  const std::string name = "lora_fwd/" + shape_name(s);
  if (!ctx.selected("lora", name)) return;
  const LoraParams p{Activation::relu, kScale};
  const Layer l = make_layer(ctx, s);
  const std::size_t bytes = static_cast<std::size_t>(s.m * s.k + s.m * s.n) * dtype_size(kType);
  const int rot = ctx.rotations_for(bytes);
  std::vector<LoraSet> sets;
  for (int i = 0; i < rot; ++i) sets.push_back({ctx.random({s.m, s.k}, kType), Tensor()});
  const Tensor y = ctx.empty({s.m, s.n}, kType), y_base = ctx.empty({s.m, s.n}, kType);
  // The unfused path's intermediates, reused across runs as a caching allocator would hand them out.
  const Tensor pm = ctx.empty({s.m, s.n}, kType), tm = ctx.empty({s.m, s.r}, kType), qm = ctx.empty({s.m, s.n}, kType);
  const std::int64_t rb = (s.r + 15) / 16 * 16;
  const Tensor t_only = ctx.empty({s.m, rb}, kType);
  const Stream* st = &ctx.fk_stream();
  auto fused = [&](const LoraSet& g) {
    lora_forward({g.x, l.w, l.bias.view(), l.a, l.b, y, std::nullopt, std::nullopt}, p, st);
  };
  auto baseline = [&](const LoraSet& g) {
    matmul(g.x, l.w, pm, Trans::n, Trans::t, st);
    matmul(g.x, l.a, tm, Trans::n, Trans::t, st);
    matmul(tm, l.b, qm, Trans::n, Trans::t, st);
    bias_act_forward({pm, qm.view(), l.bias.view(), y_base, std::nullopt}, {Activation::relu, kScale}, st);
  };
  auto gemm = [&](const LoraSet& g) { matmul(g.x, l.w, pm, Trans::n, Trans::t, st); };
  auto lowrank_t = [&](const LoraSet& g) { fk::gemm({g.x, l.a, t_only}, {.trans_a = Trans::n, .trans_b = Trans::t, .alpha = kScale}, st); };
  const TensorView bias = l.bias.view();
  // The one GEMM (ping-pong) with its epilogue, t given, in each epilogue; with rb = 0
  // (no rank-r term: bias, relu and the store only) to separate the epilogue's parts.
  const Tensor no_t = ctx.empty({s.m, 0}, kType), no_b = ctx.empty({s.n, 0}, kType);
  struct Variant {
    cuda::LoraEpilogueKind epi;
    bool low_rank;
    int swizzle, raster;
  };
  auto fused_gemm = [&](const LoraSet& g, const Variant& v) {
    // r is a multiple of 16 in these cases: B needs no padding.
    cuda::lora_gemm_fused({g.x, l.w, true, v.low_rank ? t_only.view() : no_t.view(),
                           v.low_rank ? l.b.view() : no_b.view(), &bias, Activation::relu, y, nullptr, {}, v.epi,
                           v.swizzle, v.raster},
                          st);
  };
  using cuda::LoraEpilogueKind;
  fused(sets[0]);
  baseline(sets[0]);
  // Same products; the baseline rounds P, T and Q to bf16, the fused path only t and y.
  const double err = ctx.rel_err(y, y_base);
  require_close(name, err, 2e-2);
  const auto at = [&](int i) -> const LoraSet& { return sets[static_cast<std::size_t>(i)]; };
  // Order: the fused path and the plain GEMM each run right after a GEMM-bound call (the last
  // entry, then the fused path), so that neither starts from the power and clock headroom a
  // memory-bound kernel leaves behind: on the H100 the same cuBLAS GEMM measured 385.8 us right
  // after the unfused path's memory-bound last pass and 422.7 us right after a GEMM, in one run.
  const std::vector<double> t = ctx.time_us_interleaved(
      {[&](int i) { fused(at(i)); }, [&](int i) { gemm(at(i)); }, [&](int i) { baseline(at(i)); },
       [&](int i) { lowrank_t(at(i)); },
       [&](int i) { fused_gemm(at(i), {LoraEpilogueKind::automatic, true, 0, 0}); },
       [&](int i) {  // the fused path before t moved into the GEMM: t's own pass, then the GEMM
         lowrank_t(at(i));
         fused_gemm(at(i), {LoraEpilogueKind::automatic, true, 0, 0});
       }},
      rot);
  const double flops = flops_of(s);
  add_fused_and_baseline(ctx, name, t, flops, err, 2, 1);
  const double t_bytes = static_cast<double>(s.m * s.k + s.m * s.r) * dtype_size(kType);
  const char* parts[] = {"lowrank_t_only", "fused_gemm_only", "fused_t_pass_then_gemm"};
  for (int i = 0; i < 3; ++i) {
    Record pr{"lora", name, parts[i], "cublas+act"};
    pr.median_us = t[3 + i];
    if (i == 0) pr.gbps = t_bytes / (t[3 + i] * 1e3);
    else pr.tflops = flops / (t[3 + i] * 1e6);
    ctx.add(pr);
  }
  // The GEMM's schedules compared (timed in a second interleaved run, with the plain cuBLAS GEMM
  // again as the reference), each checked against the baseline first: a schedule whose result
  // disagrees is reported and left out, without costing the case's main records.
  std::vector<std::function<void(int)>> runs{[&](int i) { gemm(at(i)); }};
  std::vector<std::string> names;
  std::vector<std::pair<std::string, Variant>> variants;
  for (LoraEpilogueKind epi : {LoraEpilogueKind::registers, LoraEpilogueKind::tma}) {
    const std::string v = std::string("pingpong") + (epi == LoraEpilogueKind::tma ? "_tma" : "_registers");
    variants.push_back({"fused_gemm_" + v, {epi, true, 0, 0}});
    variants.push_back({"epilogue_no_lowrank_" + v, {epi, false, 0, 0}});  // bias, relu and store only
  }
  // The rank-r term as the mainloop's last k-tile instead of in the epilogue.
  variants.push_back({"fused_gemm_pingpong_tma_ktile", {LoraEpilogueKind::tma_ktile, true, 0, 0}});
  // rb = 16: the rank-16 term by one register-sourced wgmma in the TMA epilogue.
  if (s.r == 16) variants.push_back({"fused_gemm_pingpong_tma_rs", {LoraEpilogueKind::tma_rs, true, 0, 0}});
  // The persistent scheduler's tile order (swizzle 1, 2, 4, 8 along the raster; raster along M
  // or N), TMA epilogue; the issue's case only.
  if (s.m == 8192 && s.r == 16) {
    for (int raster : {1, 2})
      for (int swz : {1, 2, 4, 8}) {
        const std::string v =
            std::string("pingpong_tma_raster") + (raster == 1 ? "M" : "N") + "_swizzle" + std::to_string(swz);
        variants.push_back({"fused_gemm_" + v, {LoraEpilogueKind::tma, true, swz, raster}});
      }
  }
  baseline(sets[0]);  // y_base of set 0 again: the timed runs above left another set's there
  lowrank_t(sets[0]);
  for (const auto& [vname, v] : variants) {
    if (v.low_rank) {  // each checked against the baseline first
      fused_gemm(sets[0], v);
      const double e = ctx.rel_err(y, y_base);
      if (e > 2e-2) {
        std::fprintf(stderr, "%s: the %s variant disagrees with the baseline (rel_err %.3g), not timed\n",
                     name.c_str(), vname.c_str(), e);
        continue;
      }
    }
    const Variant vv = v;
    runs.push_back([&, vv](int i) { fused_gemm(at(i), vv); });
    names.push_back(vname);
  }
  const std::vector<double> tv = ctx.time_us_interleaved(runs, rot);
  for (std::size_t i = 0; i < names.size(); ++i) {
    Record vr{"lora", name, names[i], "cublas+act"};
    vr.median_us = tv[i + 1];
    vr.tflops = flops / (tv[i + 1] * 1e6);
    vr.gemm_only_us = tv[0];
    ctx.add(vr);
  }
}

void backward_case(Context& ctx, const LoraShape& s) {
  const std::string name = "lora_bwd/" + shape_name(s);
  if (!ctx.selected("lora", name)) return;
  const LoraParams p{Activation::relu, kScale};
  const Layer l = make_layer(ctx, s);
  const std::size_t bytes = static_cast<std::size_t>(s.m * s.k * 2 + s.m * s.n * 2) * dtype_size(kType);
  const int rot = ctx.rotations_for(bytes);
  std::vector<LoraSet> sets;
  for (int i = 0; i < rot; ++i) sets.push_back({ctx.random({s.m, s.k}, kType), ctx.random({s.m, s.n}, kType)});
  // The forward's saved tensors (y, and t = s x Aᵀ for the fused path, T = x Aᵀ for the unfused),
  // of set 0: every set's backward reads them, a shared activation cache.
  const Tensor y = ctx.empty({s.m, s.n}, kType), t = ctx.empty({s.m, s.r}, kType), tm = ctx.empty({s.m, s.r}, kType);
  const Stream* st = &ctx.fk_stream();
  lora_forward({sets[0].x, l.w, l.bias.view(), l.a, l.b, y, t.view(), std::nullopt}, p, st);
  matmul(sets[0].x, l.a, tm, Trans::n, Trans::t, st);
  const Tensor dx = ctx.empty({s.m, s.k}, kType), da = ctx.empty({s.r, s.k}, kType), db = ctx.empty({s.n, s.r}, kType);
  const Tensor dx_b = ctx.empty({s.m, s.k}, kType), da_b = ctx.empty({s.r, s.k}, kType),
               db_b = ctx.empty({s.n, s.r}, kType);
  const Tensor g = ctx.empty({s.m, s.n}, kType), u = ctx.empty({s.m, s.r}, kType);
  auto fused = [&](const LoraSet& d) {
    lora_backward({d.dy, y, SavedForBackward::output, d.x, l.w, l.a, l.b, t.view(), dx.view(), da, db, std::nullopt},
                  p, st);
  };
  auto baseline = [&](const LoraSet& d) {
    bias_act_backward({d.dy, y, SavedForBackward::output, g, std::nullopt, std::nullopt}, {Activation::relu, 1.0f}, st);
    matmul(g, l.b, u, Trans::n, Trans::n, st);
    gemm({g, tm, db_b}, {.trans_a = Trans::t, .trans_b = Trans::n, .alpha = kScale}, st);
    gemm({u, d.x, da_b}, {.trans_a = Trans::t, .trans_b = Trans::n, .alpha = kScale}, st);
    matmul(g, l.w, dx_b, Trans::n, Trans::n, st);
    gemm({u, l.a, dx_b}, {.trans_a = Trans::n, .trans_b = Trans::n, .alpha = kScale, .beta = 1.0f}, st);
  };
  auto gemm = [&](const LoraSet& d) { matmul(d.dy, l.w, dx_b, Trans::n, Trans::n, st); };
  // The fused path's parts: the gradient pass (g, s u, dB) and the dx GEMM with (s u) Aᵀ in its
  // epilogue (r is a multiple of 16 here: no padding).
  const Tensor su = ctx.empty({s.m, s.r}, kType), a_t = ctx.empty({s.k, s.r}, kType);
  cuda::lora_transpose_pad(l.a, a_t, st);
  auto grad_pass = [&](const LoraSet& d) {
    cuda::lora_grad_fused({d.dy, y, l.b, t, g, su, db, nullptr, Activation::relu, true}, kScale, st);
  };
  auto dx_gemm = [&](const LoraSet& d, cuda::LoraEpilogueKind epi) {
    cuda::lora_gemm_fused({d.dy, l.w, false, su, a_t, nullptr, Activation::identity, dx, nullptr, l.a, epi}, st);
  };
  fused(sets[0]);
  baseline(sets[0]);
  const double err = std::max({ctx.rel_err(dx, dx_b), ctx.rel_err(da, da_b), ctx.rel_err(db, db_b)});
  require_close(name, err, 3e-2);
  const auto at = [&](int i) -> const LoraSet& { return sets[static_cast<std::size_t>(i)]; };
  std::vector<std::function<void(int)>> runs{
      [&](int i) { fused(at(i)); }, [&](int i) { baseline(at(i)); }, [&](int i) { gemm(at(i)); },
      [&](int i) { grad_pass(at(i)); }, [&](int i) { dx_gemm(at(i), cuda::LoraEpilogueKind::automatic); },
      [&](int i) { dx_gemm(at(i), cuda::LoraEpilogueKind::registers); },
      [&](int i) { dx_gemm(at(i), cuda::LoraEpilogueKind::tma); },
      [&](int i) { dx_gemm(at(i), cuda::LoraEpilogueKind::tma_ktile); }};
  // The rank-16 wgmma epilogue exists at rb = 16 only.
  if (s.r == 16) runs.push_back([&](int i) { dx_gemm(at(i), cuda::LoraEpilogueKind::tma_rs); });
  const std::vector<double> tm_us = ctx.time_us_interleaved(runs, rot);
  // g W, u = g B, dB, dA and u A: the backward's flops.
  const double flops = 2.0 * s.m * s.n * s.k + 2.0 * s.m * s.n * s.r * 2 + 2.0 * s.r * s.m * s.k * 2;
  add_fused_and_baseline(ctx, name, tm_us, flops, err);
  Record gr{"lora", name, "grad_pass_only", "cublas+act"};
  gr.median_us = tm_us[3];
  gr.gbps = static_cast<double>(3 * s.m * s.n) * dtype_size(kType) / (tm_us[3] * 1e3);  // dy, y read; g written
  Record xr{"lora", name, "dx_gemm_only", "cublas+act"};
  xr.median_us = tm_us[4];
  xr.tflops = 2.0 * s.m * s.n * s.k / (tm_us[4] * 1e6);
  ctx.add(gr);
  ctx.add(xr);
  const char* variants[] = {"dx_gemm_pingpong_registers", "dx_gemm_pingpong_tma", "dx_gemm_pingpong_tma_ktile",
                            "dx_gemm_pingpong_tma_rs"};
  for (std::size_t i = 0; i + 5 < tm_us.size(); ++i) {
    Record vr{"lora", name, variants[i], "cublas+act"};
    vr.median_us = tm_us[5 + i];
    vr.tflops = 2.0 * s.m * s.n * s.k / (tm_us[5 + i] * 1e6);
    ctx.add(vr);
  }
}

void lora_cases(Context& ctx) {
  const LoraShape shapes[] = {{8192, 4096, 4096, 16}, {8192, 4096, 4096, 64}, {2048, 4096, 4096, 16}};
  for (const LoraShape& s : shapes) forward_case(ctx, s);
  for (const LoraShape& s : shapes) backward_case(ctx, s);
}

FK_BENCH_CASE("lora", "lora", lora_cases);

}  // namespace
}  // namespace fk::bench
