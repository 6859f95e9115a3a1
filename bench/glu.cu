// Bench cases of the glu family: the fused GEMM + gated activation against what eager
// PyTorch runs, one cuBLAS GEMM writing C [M, 2N] then one separate activation kernel (fusekit's
// glu_pairs, a single memory-bound pass: the best separate kernel we have). Every fused record
// carries gemm_only_us, the cuBLAS GEMM(s) of the same shapes alone in the same run; tflops counts
// the GEMM flops (2 M 2N K per GEMM) for every impl.
//
// The backward recomputes C: its GEMMs are C = x wᵀ, dx = dC w and dw = dCᵀ x (gemm_only_us is
// their sum); the baseline is the unfused sequence cuBLAS C, one pass for dC, two cuBLAS GEMMs and
// the column sums for db.
//
// A training step (glu_train/): forward and backward of one layer, three ways. "keep": the fused
// forward also writes C [M, 2N], the backward reads it (one pass for dC, two cuBLAS GEMMs, column
// sums). "recompute": the fused forward, then the recomputing backward (glu_backward). Baseline
// "cublas+act", what eager PyTorch runs: cuBLAS C, the activation pass, then from the kept C the dC
// pass, two cuBLAS GEMMs and the column sums. gemm_only_us: the three GEMMs (C, dx, dw) alone, the
// floor of both keeping paths; tflops counts those three for every impl.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "bench/harness.hpp"
#include "fusekit/core/error.hpp"
#include "fusekit/ops/glu.hpp"
#include "fusekit/ops/gemm.hpp"
#include "ops/glu/glu_cuda.hpp"

namespace fk::bench {
namespace {

struct GluShape {
  GluKind kind;
  DType dtype;
  bool tf32;
  std::int64_t m, n, k;
};

std::string shape_name(const GluShape& s) {
  const std::string dt = s.tf32 ? "tf32" : std::string(dtype_name(s.dtype));
  return std::string(glu_kind_name(s.kind)) + "_" + dt + "_M" + std::to_string(s.m) + "_N" + std::to_string(s.n) +
         "_K" + std::to_string(s.k);
}

// Operands of one run; w and b in the prepared layout.
struct GluSet {
  Tensor x, w, b, dy;
};

std::vector<GluSet> make_sets(Context& ctx, const GluShape& s, bool backward) {
  const std::size_t e = dtype_size(s.dtype);
  const std::size_t bytes = static_cast<std::size_t>(s.m * s.k + 2 * s.n * s.k + s.m * s.n) * e;
  std::vector<GluSet> sets;
  const int rot = ctx.rotations_for(bytes);
  const float wscale = 1.0f / static_cast<float>(s.k);  // keeps C of order 1, away from saturation
  for (int i = 0; i < rot; ++i) {
    GluSet g;
    g.x = ctx.random({s.m, s.k}, s.dtype, -1.f, 1.f);
    g.w = ctx.random({2 * s.n, s.k}, s.dtype, -wscale * 30, wscale * 30);
    g.b = ctx.random({2 * s.n}, s.dtype, -0.5f, 0.5f);
    if (backward) g.dy = ctx.random({s.m, s.n}, s.dtype, -1.f, 1.f);
    sets.push_back(std::move(g));
  }
  return sets;
}

// The fused and baseline records of a case from the interleaved medians {fused, baseline,
// GEMMs alone}; tflops counts the GEMM flops for both.
void add_records(Context& ctx, const std::string& name, const std::vector<double>& t, double flops, double err) {
  Record fr{"glu", name, "fused", "cublas+act"};
  fr.median_us = t[0];
  fr.tflops = flops / (fr.median_us * 1e6);
  fr.rel_err = err;
  fr.gemm_only_us = t[2];
  Record br{"glu", name, "cublas+act", "cublas+act"};
  br.median_us = t[1];
  br.tflops = flops / (br.median_us * 1e6);
  br.gemm_only_us = t[2];
  ctx.add(fr);
  ctx.add(br);
}

// The forward: fused (glu_forward) against cuBLAS's C and the activation pass. keep: the training
// forward that also keeps C (as glu_mlp_train runs it, no bias), the fused GEMM writing out and C.
void forward_case(Context& ctx, const GluShape& s, bool keep = false) {
  const std::string name = (keep ? "glu_fwd_keep/" : "glu_fwd/") + shape_name(s);
  if (!ctx.selected("glu", name)) return;
  const GluOptions opt{.kind = s.kind, .allow_tf32 = s.tf32};
  std::vector<GluSet> sets = make_sets(ctx, s, false);
  const int rot = static_cast<int>(sets.size());
  const Tensor out = ctx.empty({s.m, s.n}, s.dtype), out_base = ctx.empty({s.m, s.n}, s.dtype);
  const Tensor c = ctx.empty({s.m, 2 * s.n}, s.dtype);  // the baseline's C, reused like a cached block
  const Tensor kept = keep ? ctx.empty({s.m, 2 * s.n}, s.dtype) : Tensor();  // the fused forward's C
  const Stream* st = &ctx.fk_stream();
  auto fused = [&](const GluSet& g) {
    if (keep) glu_forward({g.x, g.w, std::nullopt, out, kept.view()}, opt, st);
    else glu_forward({g.x, g.w, g.b.view(), out}, opt, st);
  };
  auto gemm = [&](const GluSet& g) { matmul(g.x, g.w, c, Trans::n, Trans::t, st, s.tf32); };
  auto baseline = [&](const GluSet& g) {
    gemm(g);
    const TensorView b = g.b.view();
    cuda::glu_pairs(c, keep ? nullptr : &b, nullptr, out_base, s.kind, st);
  };
  fused(sets[0]);
  baseline(sets[0]);
  // Same products, fp32 accumulation in a different order, one rounding each.
  double err = ctx.rel_err(out, out_base);
  if (keep) err = std::max(err, ctx.rel_err(kept, c));
  require_close(name, err, s.dtype == DType::f32 ? 2e-3 : 1e-2);
  const double flops = 2.0 * s.m * (2.0 * s.n) * s.k;
  const auto at = [&](int i) -> const GluSet& { return sets[static_cast<std::size_t>(i)]; };
  const std::vector<double> t = ctx.time_us_interleaved(
      {[&](int i) { fused(at(i)); }, [&](int i) { baseline(at(i)); }, [&](int i) { gemm(at(i)); }}, rot);
  add_records(ctx, name, t, flops, err);
}

void backward_case(Context& ctx, const GluShape& s) {
  const std::string name = "glu_bwd/" + shape_name(s);
  if (!ctx.selected("glu", name)) return;
  const GluOptions opt{.kind = s.kind, .allow_tf32 = s.tf32};
  std::vector<GluSet> sets = make_sets(ctx, s, true);
  const int rot = static_cast<int>(sets.size());
  const Tensor dx = ctx.empty({s.m, s.k}, s.dtype), dw = ctx.empty({2 * s.n, s.k}, s.dtype),
               db = ctx.empty({2 * s.n}, s.dtype);
  const Tensor dx_b = ctx.empty({s.m, s.k}, s.dtype), dw_b = ctx.empty({2 * s.n, s.k}, s.dtype),
               db_b = ctx.empty({2 * s.n}, s.dtype);
  const Tensor c = ctx.empty({s.m, 2 * s.n}, s.dtype), dc = ctx.empty({s.m, 2 * s.n}, s.dtype);
  const Stream* st = &ctx.fk_stream();
  auto fused = [&](const GluSet& g) {
    glu_backward({g.dy, g.x, g.w, g.b.view(), dx.view(), dw.view(), db.view()}, opt, st);
  };
  auto gemms = [&](const GluSet& g) {
    matmul(g.x, g.w, c, Trans::n, Trans::t, st, s.tf32);
    matmul(dc, g.w, dx_b, Trans::n, Trans::n, st, s.tf32);
    matmul(dc, g.x, dw_b, Trans::t, Trans::n, st, s.tf32);
  };
  auto baseline = [&](const GluSet& g) {
    matmul(g.x, g.w, c, Trans::n, Trans::t, st, s.tf32);
    const TensorView b = g.b.view(), dy = g.dy.view();
    cuda::glu_pairs(c, &b, &dy, dc, s.kind, st);
    matmul(dc, g.w, dx_b, Trans::n, Trans::n, st, s.tf32);
    matmul(dc, g.x, dw_b, Trans::t, Trans::n, st, s.tf32);
    cuda::column_sums(dc, db_b, st);
  };
  fused(sets[0]);
  baseline(sets[0]);
  const double bound = s.dtype == DType::f32 ? 4e-3 : 2e-2;
  const double err = std::max({ctx.rel_err(dx, dx_b), ctx.rel_err(dw, dw_b), ctx.rel_err(db, db_b)});
  require_close(name, err, bound);
  const double flops = 3 * 2.0 * s.m * (2.0 * s.n) * s.k;
  const auto at = [&](int i) -> const GluSet& { return sets[static_cast<std::size_t>(i)]; };
  const std::vector<double> t = ctx.time_us_interleaved(
      {[&](int i) { fused(at(i)); }, [&](int i) { baseline(at(i)); }, [&](int i) { gemms(at(i)); }}, rot);
  add_records(ctx, name, t, flops, err);
}

void train_case(Context& ctx, const GluShape& s) {
  const std::string name = "glu_train/" + shape_name(s);
  if (!ctx.selected("glu", name)) return;
  const GluOptions opt{.kind = s.kind, .allow_tf32 = s.tf32};
  std::vector<GluSet> sets = make_sets(ctx, s, true);
  const int rot = static_cast<int>(sets.size());
  struct Grads {
    Tensor dx, dw, db;
    const Tensor& operator[](int i) const { return i == 0 ? dx : (i == 1 ? dw : db); }
  };
  auto grads = [&] {
    return Grads{ctx.empty({s.m, s.k}, s.dtype), ctx.empty({2 * s.n, s.k}, s.dtype), ctx.empty({2 * s.n}, s.dtype)};
  };
  const Grads gk = grads(), gr = grads(), gb = grads();  // keep, recompute, baseline
  const Tensor out = ctx.empty({s.m, s.n}, s.dtype), c = ctx.empty({s.m, 2 * s.n}, s.dtype),
               dc = ctx.empty({s.m, 2 * s.n}, s.dtype);
  const Stream* st = &ctx.fk_stream();
  // As the Python op runs it: dC in its own buffer, C left intact.
  auto keep = [&](const GluSet& g) {
    glu_forward({g.x, g.w, g.b.view(), out, c.view()}, opt, st);
    glu_backward_from_preact({g.dy, g.x, g.w, c, gk[0].view(), gk[1].view(), gk[2].view()}, opt, st);
  };
  auto recompute = [&](const GluSet& g) {
    glu_forward({g.x, g.w, g.b.view(), out}, opt, st);
    glu_backward({g.dy, g.x, g.w, g.b.view(), gr[0].view(), gr[1].view(), gr[2].view()}, opt, st);
  };
  auto baseline = [&](const GluSet& g) {
    matmul(g.x, g.w, c, Trans::n, Trans::t, st, s.tf32);
    const TensorView b = g.b.view(), dy = g.dy.view();
    cuda::glu_pairs(c, &b, nullptr, out, s.kind, st);
    cuda::glu_pairs(c, &b, &dy, dc, s.kind, st);
    matmul(dc, g.w, gb[0], Trans::n, Trans::n, st, s.tf32);
    matmul(dc, g.x, gb[1], Trans::t, Trans::n, st, s.tf32);
    cuda::column_sums(dc, gb[2], st);
  };
  auto gemms = [&](const GluSet& g) {
    matmul(g.x, g.w, c, Trans::n, Trans::t, st, s.tf32);
    matmul(dc, g.w, gb[0], Trans::n, Trans::n, st, s.tf32);
    matmul(dc, g.x, gb[1], Trans::t, Trans::n, st, s.tf32);
  };
  keep(sets[0]);
  recompute(sets[0]);
  baseline(sets[0]);
  const double bound = s.dtype == DType::f32 ? 4e-3 : 2e-2;
  double err_keep = 0, err_recompute = 0;
  for (int i = 0; i < 3; ++i) {
    err_keep = std::max(err_keep, ctx.rel_err(gk[i], gb[i]));
    err_recompute = std::max(err_recompute, ctx.rel_err(gr[i], gb[i]));
  }
  require_close(name + " (keep)", err_keep, bound);
  require_close(name + " (recompute)", err_recompute, bound);
  const double flops = 3 * 2.0 * s.m * (2.0 * s.n) * s.k;
  const auto at = [&](int i) -> const GluSet& { return sets[static_cast<std::size_t>(i)]; };
  const std::vector<double> t = ctx.time_us_interleaved({[&](int i) { keep(at(i)); }, [&](int i) { recompute(at(i)); },
                                                         [&](int i) { baseline(at(i)); }, [&](int i) { gemms(at(i)); }},
                                                        rot);
  const char* impls[] = {"keep", "recompute", "cublas+act"};
  const double errs[] = {err_keep, err_recompute, 0.0};
  for (int i = 0; i < 3; ++i) {
    Record r{"glu", name, impls[i], "cublas+act"};
    r.median_us = t[static_cast<std::size_t>(i)];
    r.tflops = flops / (r.median_us * 1e6);
    r.rel_err = errs[i];
    r.gemm_only_us = t[3];
    ctx.add(r);
  }
}

// The gated MLP's backward from kept pre-activations through its down projection: dh = dy down_w
// (dy [M, K'], down_w [K', N]) and dC, glu(C) from it. Fused: one GEMM forming dC and glu(C) in its
// epilogue (cuda::glu_dgrad_fused, as glu_backward_from_preact runs it when given down_w);
// baseline: cuBLAS's dh, then the pass over C and dh. The shape's K is K'.
void mlp_dgrad_case(Context& ctx, const GluShape& s) {
  const std::string name = "glu_mlp_dgrad/" + shape_name(s);
  if (!ctx.selected("glu", name)) return;
  struct Set {
    Tensor dy, down_w, c;
  };
  const std::size_t bytes = static_cast<std::size_t>(s.m * s.k + s.k * s.n + 2 * s.m * s.n) * dtype_size(s.dtype);
  const int rot = ctx.rotations_for(bytes);
  std::vector<Set> sets;
  for (int i = 0; i < rot; ++i)
    sets.push_back({ctx.random({s.m, s.k}, s.dtype, -1.f, 1.f),
                    ctx.random({s.k, s.n}, s.dtype, -1.f / std::sqrt(static_cast<float>(s.k)), 1.f / std::sqrt(static_cast<float>(s.k))),
                    ctx.random({s.m, 2 * s.n}, s.dtype, -3.f, 3.f)});
  const Tensor dc = ctx.empty({s.m, 2 * s.n}, s.dtype), act = ctx.empty({s.m, s.n}, s.dtype),
               dc_b = ctx.empty({s.m, 2 * s.n}, s.dtype), act_b = ctx.empty({s.m, s.n}, s.dtype),
               dh = ctx.empty({s.m, s.n}, s.dtype);
  const Stream* st = &ctx.fk_stream();
  auto fused = [&](const Set& g) {
    const TensorView a = act.view();
    if (!cuda::glu_dgrad_fused(g.dy, g.down_w, g.c, dc, &a, s.kind, st))
      throw Error("bench glu_mlp_dgrad", "no fused kernel for this device or shape");
  };
  auto baseline = [&](const Set& g) {
    matmul(g.dy, g.down_w, dh, Trans::n, Trans::n, st);
    const TensorView d = dh.view(), a = act_b.view();
    cuda::glu_pairs(g.c, nullptr, &d, dc_b, s.kind, st, &a);
  };
  auto gemm = [&](const Set& g) { matmul(g.dy, g.down_w, dh, Trans::n, Trans::n, st); };
  fused(sets[0]);
  baseline(sets[0]);
  const double err = ctx.rel_err(dc, dc_b);
  require_close(name, err, 2e-2);
  require_close(name + " (out)", ctx.rel_err(act, act_b), 1e-2);  // fast activations against the pass's
  const auto at = [&](int i) -> const Set& { return sets[static_cast<std::size_t>(i)]; };
  const std::vector<double> t = ctx.time_us_interleaved(
      {[&](int i) { fused(at(i)); }, [&](int i) { baseline(at(i)); }, [&](int i) { gemm(at(i)); }}, rot);
  add_records(ctx, name, t, 2.0 * s.m * s.n * s.k, err);
}

void glu_cases(Context& ctx) {
  const GluShape fwd[] = {
      {GluKind::sigmoid_tanh, DType::bf16, false, 1024, 2048, 2048},
      {GluKind::sigmoid_tanh, DType::f32, true, 1024, 2048, 2048},
      {GluKind::swiglu, DType::bf16, false, 1024, 2048, 2048},
      {GluKind::geglu_tanh, DType::bf16, false, 1024, 2048, 2048},
      {GluKind::swiglu, DType::bf16, false, 4096, 8192, 8192},
      {GluKind::sigmoid_tanh, DType::bf16, false, 4096, 8192, 8192},
  };
  for (const GluShape& s : fwd) forward_case(ctx, s);
  const GluShape bwd[] = {
      {GluKind::sigmoid_tanh, DType::bf16, false, 1024, 2048, 2048},
      {GluKind::swiglu, DType::bf16, false, 4096, 8192, 8192},
  };
  for (const GluShape& s : bwd) backward_case(ctx, s);
  // The LLaMA-width MLP of the LM bench (65536 tokens, width 768, SwiGLU 2048), a wider one, and
  // a one-wave shape: the training step, and its forward alone.
  const GluShape train[] = {
      {GluKind::swiglu, DType::bf16, false, 65536, 2048, 768},
      {GluKind::swiglu, DType::bf16, false, 16384, 5632, 2048},
      {GluKind::swiglu, DType::bf16, false, 1024, 2048, 2048},
  };
  for (const GluShape& s : train) train_case(ctx, s);
  for (const GluShape& s : train) forward_case(ctx, s, true);
  // The same MLPs' backward through the down projection (K here is K', the model's width).
  const GluShape dgrad[] = {
      {GluKind::swiglu, DType::bf16, false, 65536, 2048, 768},
      {GluKind::swiglu, DType::bf16, false, 16384, 5632, 2048},
      {GluKind::swiglu, DType::bf16, false, 1024, 2048, 2048},
      {GluKind::geglu_tanh, DType::f16, false, 8192, 4096, 1024},
  };
  for (const GluShape& s : dgrad) mlp_dgrad_case(ctx, s);
}

FK_BENCH_CASE("glu", "glu", glu_cases);

}  // namespace
}  // namespace fk::bench
