// Bench cases of the qgemm family: y = x · w̃ᵀ from 4-bit weights (group 128) against what a user
// without the kernel runs, cuBLAS (fusekit's gemm, fp32 accumulation) on the 16-bit weights (here the
// dequantized ones, so that both compute the same product). Small M is bound by the weight bytes:
// gbps counts the bytes of the weight each side reads (4-bit words + scales + zero points, or the
// 16-bit matrix). Each side cycles through enough copies of its weight that L2 holds none of them.
#include <string>
#include <vector>

#include "bench/harness.hpp"
#include "fusekit/core/stream.hpp"
#include "fusekit/ops/qgemm.hpp"
#include "fusekit/ops/gemm.hpp"

namespace fk::bench {
namespace {

void qgemm_cases(Context& ctx, DType dt, std::int64_t n, std::int64_t k) {
  constexpr int kGroup = 128;
  const std::int64_t ms[] = {1, 16, 64, 128};
  auto name_of = [&](std::int64_t m) {
    return std::string(dtype_name(dt)) + "_M" + std::to_string(m) + "_N" + std::to_string(n) + "_K" +
           std::to_string(k) + "_g" + std::to_string(kGroup);
  };
  bool any = false;
  for (std::int64_t m : ms) any |= ctx.selected("qgemm", name_of(m));
  if (!any) return;
  const Stream* st = &ctx.fk_stream();
  const Tensor w = ctx.random({n, k}, dt, -1.f, 1.f);
  const QuantizedWeight qw = quantize_weights(w, kGroup, st);  // on the host: once per shape
  const Tensor wt = dequantize_weights(qw, st);
  st->synchronize();  // the copies below are plain cudaMemcpy calls
  const double q_bytes = static_cast<double>(qw.nbytes()), w_bytes = static_cast<double>(wt.nbytes());
  // Copies of each weight for the rotation (the largest M's activations and outputs included).
  const std::size_t io = static_cast<std::size_t>(128 * (k + n)) * dtype_size(dt);
  std::vector<QuantizedWeight> qws;
  std::vector<Tensor> wts;
  for (int i = 0, r = ctx.rotations_for(qw.nbytes() + io); i < r; ++i) qws.push_back(qw.copy_to(w.device()));
  for (int i = 0, r = ctx.rotations_for(wt.nbytes() + io); i < r; ++i) wts.push_back(wt.clone());
  for (std::int64_t m : ms) {
    const std::string name = name_of(m);
    if (!ctx.selected("qgemm", name)) continue;
    const Tensor x = ctx.random({m, k}, dt, -1.f, 1.f);
    const Tensor y = ctx.empty({m, n}, dt), y_base = ctx.empty({m, n}, dt);
    auto fused = [&](int i) { qgemm(x, qws[static_cast<std::size_t>(i)], y, st); };
    auto baseline = [&](int i) {
      matmul(x, wts[static_cast<std::size_t>(i)], y_base, Trans::n, Trans::t, st);
    };
    fused(0);
    baseline(0);
    // The same products of the same 16-bit values, fp32 accumulation in another order, one rounding.
    const double err = ctx.rel_err(y, y_base);
    require_close(name, err, 5e-3);
    const double flops = 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
    Record fr{"qgemm", name, "w4_mma", "cublas"};
    fr.median_us = ctx.time_us(fused, static_cast<int>(qws.size()));
    fr.gbps = q_bytes / (fr.median_us * 1e3);
    fr.tflops = flops / (fr.median_us * 1e6);
    fr.rel_err = err;
    Record br{"qgemm", name, "cublas", "cublas"};
    br.median_us = ctx.time_us(baseline, static_cast<int>(wts.size()));
    br.gbps = w_bytes / (br.median_us * 1e3);
    br.tflops = flops / (br.median_us * 1e6);
    // Decoders replay these GEMMs in CUDA graphs: under 50 µs a call, the per-call figure is mostly
    // launch and event overhead, so both sides are also timed as graphs of back-to-back calls.
    if (fr.median_us < 50.0 || br.median_us < 50.0) {
      fr.graph_us = ctx.graph_us(fused, static_cast<int>(qws.size()));
      br.graph_us = ctx.graph_us(baseline, static_cast<int>(wts.size()));
    }
    ctx.add(fr);
    ctx.add(br);
    // The small-M kernel's variants, each against the same cuBLAS record: QgemmOptions::
    // constant_weights (as a decoder's weights are: a programmatic dependent launch, its weight
    // loads overlapping the end of the call before it), and the push split-K reduction
    // (QgemmOptions::reduction: the default push, and pull without and with the promise).
    if (m <= 16) {
      struct Variant {
        const char* impl;
        QgemmOptions options;
      };
      const Variant variants[] = {
          {"w4_mma_constant_weights", {.constant_weights = true}},
          {"w4_mma_pull", {.reduction = QgemmReduction::cluster_pull}},
          {"w4_mma_constant_weights_pull", {.constant_weights = true, .reduction = QgemmReduction::cluster_pull}},
      };
      for (const Variant& v : variants) {
        auto call = [&](int i) { qgemm(x, qws[static_cast<std::size_t>(i)], y, st, v.options); };
        st->synchronize();
        fill(y, 0.0);  // the previous variant's y must not pass for this one's
        call(0);
        Record cr{"qgemm", name, v.impl, "cublas"};
        cr.rel_err = ctx.rel_err(y, y_base);
        require_close(name, cr.rel_err, 5e-3);
        cr.median_us = ctx.time_us(call, static_cast<int>(qws.size()));
        cr.gbps = q_bytes / (cr.median_us * 1e3);
        cr.tflops = flops / (cr.median_us * 1e6);
        cr.graph_us = ctx.graph_us(call, static_cast<int>(qws.size()));
        ctx.add(cr);
      }
    }
  }
}

void all_cases(Context& ctx) {
  for (DType dt : {DType::f16, DType::bf16}) {
    qgemm_cases(ctx, dt, 4096, 4096);
    qgemm_cases(ctx, dt, 11008, 4096);
    qgemm_cases(ctx, dt, 8192, 8192);
  }
}

FK_BENCH_CASE("qgemm", "w4a16", all_cases);

}  // namespace
}  // namespace fk::bench
