// Bench cases of the lora family (seed 003's LoRA case study). The unfused path is the seed's:
// three cuBLAS GEMMs P = x Wᵀ, T = x Aᵀ, Q = T Bᵀ, then the add-multiply-activation kernel
// y = act(P + s Q + b) (fusekit's bias_act_forward, one memory-bound pass). The fused record
// carries gemm_only_us, the plain cuBLAS GEMM x Wᵀ alone in the same run; a third record,
// impl "lowrank_t_only", times the skinny cuBLAS GEMM t = s x Aᵀ that the fused forward runs
// before its one big GEMM (its share of the gap to gemm_only). tflops counts the flops of
// x Wᵀ + x Aᵀ + t Bᵀ for every impl.
//
// Backward (W frozen, bias frozen as LoRA trains it, act = relu: act' from the saved y). The
// unfused path: g = dy ⊙ relu'(y) (bias_act_backward), then cuBLAS u = g B, dB = s gᵀ T,
// dA = s uᵀ x, dx = g W and dx += s u A. The fused one (lora_backward): the same g pass and
// skinny GEMMs, and dx as one GEMM g W with (s u) A added in its epilogue. gemm_only_us is the
// cuBLAS g W alone.
#include <string>
#include <vector>

#include "bench/harness.hpp"
#include "fusekit/ops/lora.hpp"
#include "fusekit/ops/pointwise.hpp"
#include "nn/gemm.hpp"

namespace fk::bench {
namespace {

using nn::detail::Op;

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
  const Tensor t_only = ctx.empty({s.m, s.r}, kType);
  const Stream* st = &ctx.fk_stream();
  auto fused = [&](const LoraSet& g) {
    lora_forward({g.x, l.w, l.bias.view(), l.a, l.b, y, std::nullopt, std::nullopt}, p, st);
  };
  auto baseline = [&](const LoraSet& g) {
    nn::detail::gemm(Op::n, Op::t, g.x, l.w, pm, st);
    nn::detail::gemm(Op::n, Op::t, g.x, l.a, tm, st);
    nn::detail::gemm(Op::n, Op::t, tm, l.b, qm, st);
    bias_act_forward({pm, qm.view(), l.bias.view(), y_base, std::nullopt}, {Activation::relu, kScale}, st);
  };
  auto gemm = [&](const LoraSet& g) { nn::detail::gemm(Op::n, Op::t, g.x, l.w, pm, st); };
  auto lowrank_t = [&](const LoraSet& g) { nn::detail::gemm(Op::n, Op::t, g.x, l.a, t_only, st, false, kScale); };
  fused(sets[0]);
  baseline(sets[0]);
  // Same products; the baseline rounds P, T and Q to bf16, the fused path only t and y.
  const double err = ctx.rel_err(y, y_base);
  require_close(name, err, 2e-2);
  const auto at = [&](int i) -> const LoraSet& { return sets[static_cast<std::size_t>(i)]; };
  const std::vector<double> t = ctx.time_us_interleaved({[&](int i) { fused(at(i)); }, [&](int i) { baseline(at(i)); },
                                                         [&](int i) { gemm(at(i)); }, [&](int i) { lowrank_t(at(i)); }},
                                                        rot);
  const double flops = flops_of(s);
  Record fr{"lora", name, "fused", "cublas+act"};
  fr.median_us = t[0];
  fr.tflops = flops / (t[0] * 1e6);
  fr.rel_err = err;
  fr.gemm_only_us = t[2];
  Record br{"lora", name, "cublas+act", "cublas+act"};
  br.median_us = t[1];
  br.tflops = flops / (t[1] * 1e6);
  br.gemm_only_us = t[2];
  Record tr{"lora", name, "lowrank_t_only", "cublas+act"};
  tr.median_us = t[3];
  tr.gbps = static_cast<double>(s.m * s.k + s.m * s.r) * dtype_size(kType) / (t[3] * 1e3);
  ctx.add(fr);
  ctx.add(br);
  ctx.add(tr);
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
  nn::detail::gemm(Op::n, Op::t, sets[0].x, l.a, tm, st);
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
    nn::detail::gemm(Op::n, Op::n, g, l.b, u, st);
    nn::detail::gemm(Op::t, Op::n, g, tm, db_b, st, false, kScale);
    nn::detail::gemm(Op::t, Op::n, u, d.x, da_b, st, false, kScale);
    nn::detail::gemm(Op::n, Op::n, g, l.w, dx_b, st);
    nn::detail::gemm(Op::n, Op::n, u, l.a, dx_b, st, false, kScale, 1.0f);
  };
  auto gemm = [&](const LoraSet& d) { nn::detail::gemm(Op::n, Op::n, d.dy, l.w, dx_b, st); };
  fused(sets[0]);
  baseline(sets[0]);
  const double err = std::max({ctx.rel_err(dx, dx_b), ctx.rel_err(da, da_b), ctx.rel_err(db, db_b)});
  require_close(name, err, 3e-2);
  const auto at = [&](int i) -> const LoraSet& { return sets[static_cast<std::size_t>(i)]; };
  const std::vector<double> tm_us = ctx.time_us_interleaved(
      {[&](int i) { fused(at(i)); }, [&](int i) { baseline(at(i)); }, [&](int i) { gemm(at(i)); }}, rot);
  // g W, u = g B, dB, dA and u A: the backward's flops.
  const double flops = 2.0 * s.m * s.n * s.k + 2.0 * s.m * s.n * s.r * 2 + 2.0 * s.r * s.m * s.k * 2;
  Record fr{"lora", name, "fused", "cublas+act"};
  fr.median_us = tm_us[0];
  fr.tflops = flops / (tm_us[0] * 1e6);
  fr.rel_err = err;
  fr.gemm_only_us = tm_us[2];
  Record br{"lora", name, "cublas+act", "cublas+act"};
  br.median_us = tm_us[1];
  br.tflops = flops / (tm_us[1] * 1e6);
  br.gemm_only_us = tm_us[2];
  ctx.add(fr);
  ctx.add(br);
}

void lora_cases(Context& ctx) {
  const LoraShape shapes[] = {{8192, 4096, 4096, 16}, {8192, 4096, 4096, 64}, {2048, 4096, 4096, 16}};
  for (const LoraShape& s : shapes) forward_case(ctx, s);
  for (const LoraShape& s : shapes) backward_case(ctx, s);
}

FK_BENCH_CASE("lora", "lora", lora_cases);

}  // namespace
}  // namespace fk::bench
