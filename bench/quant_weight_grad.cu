// Bench cases of weight_grad_from_packed, the weight gradient of a linear layer whose input was
// saved packed: dW [768, 768] = dyᵀ x̂ with dy [K, 768] bf16 and x packed at 2, 4 or 8 bits
// (group 256, bf16 statistics), dW in bf16. The fused kernel is set against what a user would
// otherwise run: fusekit's unpack into a bf16 x̂ [K, 768] then one cuBLAS bf16 GEMM (fp32
// compute). Each fused record also carries gemm_only_us, that cuBLAS GEMM alone on an x̂ unpacked
// beforehand, in the same run, and tflops counts the GEMM's 2 K COUT CIN flops for every impl.
// With `fusekit bench --breakdown`, also "fused_fp32_partials": the fused kernel with its split-K
// partials kept in fp32 instead of the default fp16 with a scale per 8 values
// (WeightGradParams::fp32_partials), what the fp16 round trip saves.

#include <string>
#include <vector>

#include "bench/harness.hpp"
#include "fusekit/ops/gemm.hpp"
#include "fusekit/core/cuda_check.hpp"
#include "fusekit/ops/quant.hpp"

namespace fk::bench {
namespace {

struct WeightGradSet {
  Tensor dy;            // bf16 [K, COUT]
  PackedTensor x;       // packed from a bf16 [K, CIN]
  Tensor xhat;          // bf16 [K, CIN], unpacked once, for the GEMM alone
  Tensor dw_fused;      // bf16 [COUT, CIN]
};

// dW [COUT, CIN] = dyᵀ x̂ (bf16 out, fp32 accumulation): the GEMM a user runs after unpack.
void gemm_dyt_xhat(Context& ctx, const Tensor& dy, const Tensor& xhat, const Tensor& dw) {
  matmul(dy, xhat, dw, Trans::t, Trans::n, &ctx.fk_stream());
}

void weight_grad_cases(Context& ctx) {
  const std::int64_t cout = 768, cin = 768;
  for (const std::int64_t k : {std::int64_t{8192}, std::int64_t{100864}}) {
    for (const int bits : {2, 4, 8}) {
      const std::string name = "weight_grad_packed/K" + std::to_string(k) + "_CIN" + std::to_string(cin) + "_COUT" +
                               std::to_string(cout) + "_b" + std::to_string(bits);
      if (!ctx.selected("quant", name)) continue;
      const PackParams pp{.bits = bits, .group = 256, .stats_dtype = DType::bf16};
      // What one run reads: dy and the packed x (the baseline also writes and reads x̂).
      const std::size_t run_bytes = static_cast<std::size_t>(k * cout * 2) +
                                    static_cast<std::size_t>(k * cin * bits / 8 + k * ((cin + 255) / 256) * 4);
      const int rot = ctx.rotations_for(run_bytes);
      std::vector<WeightGradSet> sets;
      for (int i = 0; i < rot; ++i) {
        WeightGradSet s;
        s.dy = ctx.random({k, cout}, DType::bf16, -1.f, 1.f);
        {
          const Tensor x = ctx.random({k, cin}, DType::bf16, -2.f, 3.f);
          s.x = pack(x, pp, &ctx.fk_stream());
        }
        s.xhat = unpack(s.x.view(), DType::bf16, &ctx.fk_stream());
        s.dw_fused = ctx.empty({cout, cin}, DType::bf16);
        sets.push_back(std::move(s));
      }
      // The baseline's x̂ and dW are reused from run to run, as a caching allocator hands them out.
      const Tensor xhat_base = ctx.empty({k, cin}, DType::bf16), dw_base = ctx.empty({cout, cin}, DType::bf16);
      const Tensor dw_gemm = ctx.empty({cout, cin}, DType::bf16);
      auto fused = [&](const WeightGradSet& s) {
        weight_grad_from_packed(s.dy, s.x.view(), s.dw_fused, {.beta = 0.0f}, &ctx.fk_stream());
      };
      auto fused_fp32_partials = [&](const WeightGradSet& s) {
        weight_grad_from_packed(s.dy, s.x.view(), s.dw_fused, {.beta = 0.0f, .fp32_partials = true}, &ctx.fk_stream());
      };
      auto baseline = [&](const WeightGradSet& s) {
        unpack(s.x.view(), xhat_base, &ctx.fk_stream());
        gemm_dyt_xhat(ctx, s.dy, xhat_base, dw_base);
      };
      fused(sets[0]);
      baseline(sets[0]);
      // Both multiply the same bf16 x̂ with fp32 accumulation and round dW to bf16 once: they
      // differ by the order of the fp32 sums and that rounding, far below the op's stated 1e-2.
      const double err = ctx.rel_err(sets[0].dw_fused, dw_base);
      require_close(name, err, 1e-2);
      double err_fp32_partials = 0;
      if (ctx.breakdown()) {
        fused_fp32_partials(sets[0]);
        err_fp32_partials = ctx.rel_err(sets[0].dw_fused, dw_base);
        require_close(name + " (fp32 partials)", err_fp32_partials, 1e-2);
      }

      const double flops = 2.0 * static_cast<double>(k) * static_cast<double>(cout) * static_cast<double>(cin);
      const auto at = [&](int i) -> const WeightGradSet& { return sets[static_cast<std::size_t>(i)]; };
      const double gemm_us = ctx.time_us([&](int i) { gemm_dyt_xhat(ctx, at(i).dy, at(i).xhat, dw_gemm); }, rot);
      Record fr{"quant", name, "fused", "unpack+cublas"};
      fr.median_us = ctx.time_us([&](int i) { fused(at(i)); }, rot);
      fr.tflops = flops / (fr.median_us * 1e6);
      fr.rel_err = err;
      fr.gemm_only_us = gemm_us;
      ctx.add(fr);
      if (ctx.breakdown()) {
        Record pr{"quant", name, "fused_fp32_partials", "unpack+cublas"};
        pr.median_us = ctx.time_us([&](int i) { fused_fp32_partials(at(i)); }, rot);
        pr.tflops = flops / (pr.median_us * 1e6);
        pr.rel_err = err_fp32_partials;
        pr.gemm_only_us = gemm_us;
        ctx.add(pr);
      }
      Record br{"quant", name, "unpack+cublas", "unpack+cublas"};
      br.median_us = ctx.time_us([&](int i) { baseline(at(i)); }, rot);
      br.tflops = flops / (br.median_us * 1e6);
      br.gemm_only_us = gemm_us;
      ctx.add(br);
    }
  }
}

FK_BENCH_CASE("quant", "weight_grad_packed", weight_grad_cases);

}  // namespace
}  // namespace fk::bench
