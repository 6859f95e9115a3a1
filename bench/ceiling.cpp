// The ceilings every bench run measures on its device, so that each figure can be read against
// what the GPU does at best in the same run:
//   copy       device-to-device cudaMemcpyAsync of 1 GiB; gbps counts bytes read + written.
//   gemm_bf16  cuBLAS bf16 GEMM 8192^3 (fp32 accumulation, bf16 out) on random data.
//   launch     a kernel that does nothing, timed as every case is (events around each call, the
//              batch enqueued behind a spin): the floor of any one-kernel call's median_us.
#include "bench/harness.hpp"
#include "fusekit/ops/gemm.hpp"
#include "fusekit/core/cuda_check.hpp"

namespace fk::bench {
namespace {

void copy_ceiling(Context& ctx) {
  const std::int64_t bytes = std::int64_t{1} << 30;
  const Tensor src = ctx.random({bytes / 4}, DType::f32);
  const Tensor dst = ctx.empty({bytes / 4}, DType::f32);
  const double us = ctx.time_us(
      [&](int) {
        FK_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), static_cast<std::size_t>(bytes),
                                      cudaMemcpyDeviceToDevice, ctx.stream()));
      },
      1);
  Record r{"ceiling", "copy", "cudaMemcpyAsync", "cudaMemcpyAsync"};
  r.median_us = us;
  r.gbps = 2.0 * static_cast<double>(bytes) / (us * 1e3);
  ctx.add(r);
}

void gemm_ceiling(Context& ctx) {
  const int n = 8192;
  const Tensor a = ctx.random({n, n}, DType::bf16), b = ctx.random({n, n}, DType::bf16);
  const Tensor c = ctx.empty({n, n}, DType::bf16);
  const double us = ctx.time_us([&](int) { matmul(a, b, c, Trans::n, Trans::n, &ctx.fk_stream()); }, 1);
  Record r{"ceiling", "gemm_bf16", "cublas", "cublas"};
  r.median_us = us;
  r.tflops = 2.0 * n * static_cast<double>(n) * n / (us * 1e6);
  ctx.add(r);
}

void launch_ceiling(Context& ctx) {
  Record r{"ceiling", "launch", "empty_kernel", "empty_kernel"};
  r.median_us = ctx.time_us([&](int) { launch_empty(ctx.stream()); }, 1);
  ctx.add(r);
}

FK_BENCH_CASE("ceiling", "copy", copy_ceiling);
FK_BENCH_CASE("ceiling", "gemm_bf16", gemm_ceiling);
FK_BENCH_CASE("ceiling", "launch", launch_ceiling);

}  // namespace
}  // namespace fk::bench
