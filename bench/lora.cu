// Bench cases of the lora family. The unfused path is the textbook one:
// three cuBLAS GEMMs P = x Wᵀ, T = x Aᵀ, Q = T Bᵀ, then the add-multiply-activation kernel
// y = act(P + s Q + b) (fusekit's bias_act_forward, one memory-bound pass). The fused record
// carries gemm_only_us, the plain cuBLAS GEMM x Wᵀ alone in the same run. tflops counts the flops
// of x Wᵀ + x Aᵀ + t Bᵀ for every impl.
//
// Backward (W frozen, bias frozen as LoRA trains it, act = relu: act' from the saved y). The
// unfused path: g = dy ⊙ relu'(y) (bias_act_backward), then cuBLAS u = g B, dB = s gᵀ T,
// dA = s uᵀ x, dx = g W and dx += s u A. The fused one (lora_backward): one pass over dy and y
// giving g, s u and dB (lora_grad.cu), cuBLAS dA, and dx as one GEMM g W with (s u) A added in
// its epilogue. gemm_only_us is the cuBLAS g W alone.
//
// With `fusekit bench --breakdown`, the fused paths' parts, timed in the same run, as records of
// their own: forward "lowrank_t_only" (the down-projection pass t = s x Aᵀ, a skinny cuBLAS GEMM;
// at r <= 16 the fused path computes t inside its GEMM instead) and "fused_gemm_only" (the one
// GEMM with the rank-r term, t given); backward "grad_pass_only" (g, s u, dB) and "dx_gemm_only".
#include <functional>
#include <string>
#include <vector>

#include "bench/harness.hpp"
#include "fusekit/core/error.hpp"
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
  // The breakdown's parts: t's own pass, and the one GEMM with its epilogue, t given (r is a
  // multiple of 16 in these cases: t and B need no padding).
  const Tensor t_only = ctx.empty({s.m, s.r}, kType);
  const TensorView bias = l.bias.view();
  auto lowrank_t = [&](const LoraSet& g) { fk::gemm({g.x, l.a, t_only}, {.trans_a = Trans::n, .trans_b = Trans::t, .alpha = kScale}, st); };
  auto fused_gemm = [&](const LoraSet& g) {
    cuda::lora_gemm_fused({g.x, l.w, true, t_only, l.b, &bias, Activation::relu, y, nullptr}, st);
  };
  fused(sets[0]);
  baseline(sets[0]);
  // Same products; the baseline rounds P, T and Q to bf16, the fused path only t and y.
  const double err = ctx.rel_err(y, y_base);
  require_close(name, err, 2e-2);
  const auto at = [&](int i) -> const LoraSet& { return sets[static_cast<std::size_t>(i)]; };
  // Order: the fused path and the plain GEMM each run right after a GEMM-bound call (the last
  // entry, then the fused path), so that neither starts from the power and clock headroom a
  // memory-bound kernel leaves behind (the same GEMM measures ~9% faster after a memory-bound pass
  // than after a GEMM: docs/notes/lora.md).
  // Without the breakdown, the last entry is the plain GEMM once more, its time not recorded.
  std::vector<std::function<void(int)>> runs{[&](int i) { fused(at(i)); }, [&](int i) { gemm(at(i)); },
                                             [&](int i) { baseline(at(i)); }};
  if (ctx.breakdown()) {
    runs.push_back([&](int i) { lowrank_t(at(i)); });
    runs.push_back([&](int i) { fused_gemm(at(i)); });
  } else {
    runs.push_back([&](int i) { gemm(at(i)); });
  }
  const std::vector<double> t = ctx.time_us_interleaved(runs, rot);
  const double flops = flops_of(s);
  add_fused_and_baseline(ctx, name, t, flops, err, 2, 1);
  if (!ctx.breakdown()) return;
  Record tr{"lora", name, "lowrank_t_only", "cublas+act"};
  tr.median_us = t[3];
  tr.gbps = static_cast<double>(s.m * s.k + s.m * s.r) * dtype_size(kType) / (t[3] * 1e3);  // x read, t written
  Record gr{"lora", name, "fused_gemm_only", "cublas+act"};
  gr.median_us = t[4];
  gr.tflops = flops / (t[4] * 1e6);
  ctx.add(tr);
  ctx.add(gr);
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
    fk::gemm({g, tm, db_b}, {.trans_a = Trans::t, .trans_b = Trans::n, .alpha = kScale}, st);
    fk::gemm({u, d.x, da_b}, {.trans_a = Trans::t, .trans_b = Trans::n, .alpha = kScale}, st);
    matmul(g, l.w, dx_b, Trans::n, Trans::n, st);
    fk::gemm({u, l.a, dx_b}, {.trans_a = Trans::n, .trans_b = Trans::n, .alpha = kScale, .beta = 1.0f}, st);
  };
  auto gemm = [&](const LoraSet& d) { matmul(d.dy, l.w, dx_b, Trans::n, Trans::n, st); };
  fused(sets[0]);
  baseline(sets[0]);
  const double err = std::max({ctx.rel_err(dx, dx_b), ctx.rel_err(da, da_b), ctx.rel_err(db, db_b)});
  require_close(name, err, 3e-2);
  const auto at = [&](int i) -> const LoraSet& { return sets[static_cast<std::size_t>(i)]; };
  std::vector<std::function<void(int)>> runs{[&](int i) { fused(at(i)); }, [&](int i) { baseline(at(i)); },
                                             [&](int i) { gemm(at(i)); }};
  // The breakdown's parts: the gradient pass (g, s u, dB; r <= 16, where lora_backward runs it)
  // and the dx GEMM with (s u) Aᵀ in its epilogue (r is a multiple of 16 here: no padding).
  const Tensor su = ctx.empty({s.m, s.r}, kType), a_t = ctx.empty({s.k, s.r}, kType);
  const bool grad_pass = s.r <= 16;
  if (ctx.breakdown()) {
    cuda::lora_transpose_pad(l.a, a_t, st);
    if (grad_pass)
      runs.push_back([&](int i) {
        const LoraSet& d = at(i);
        if (!cuda::lora_grad_fused({d.dy, y, l.b, t, g, su, db, nullptr, Activation::relu, true}, kScale, st))
          throw Error("bench", name + ": the fused gradient pass refused the case");
      });
    runs.push_back([&](int i) {
      cuda::lora_gemm_fused({at(i).dy, l.w, false, su, a_t, nullptr, Activation::identity, dx, nullptr, l.a}, st);
    });
  }
  const std::vector<double> tm_us = ctx.time_us_interleaved(runs, rot);
  // g W, u = g B, dB, dA and u A: the backward's flops.
  const double flops = 2.0 * s.m * s.n * s.k + 2.0 * s.m * s.n * s.r * 2 + 2.0 * s.r * s.m * s.k * 2;
  add_fused_and_baseline(ctx, name, tm_us, flops, err);
  if (!ctx.breakdown()) return;
  std::size_t part = 3;
  if (grad_pass) {
    Record gr{"lora", name, "grad_pass_only", "cublas+act"};
    gr.median_us = tm_us[part++];
    gr.gbps = static_cast<double>(3 * s.m * s.n) * dtype_size(kType) / (gr.median_us * 1e3);  // dy, y read; g written
    ctx.add(gr);
  }
  Record xr{"lora", name, "dx_gemm_only", "cublas+act"};
  xr.median_us = tm_us[part];
  xr.tflops = 2.0 * s.m * s.n * s.k / (xr.median_us * 1e6);
  ctx.add(xr);
}

void lora_cases(Context& ctx) {
  const LoraShape shapes[] = {{8192, 4096, 4096, 16}, {8192, 4096, 4096, 32}, {8192, 4096, 4096, 48},
                              {8192, 4096, 4096, 64}, {2048, 4096, 4096, 16}, {2048, 4096, 4096, 64}};
  for (const LoraShape& s : shapes) forward_case(ctx, s);
  for (const LoraShape& s : shapes) backward_case(ctx, s);
}

FK_BENCH_CASE("lora", "lora", lora_cases);

}  // namespace
}  // namespace fk::bench
