// Bench cases of the primitives family.
//   softmax/bf16_8192x32768   fused (one read, one write) against the unfused path a user would
//                             otherwise run: a row-max kernel, an exp-sum kernel, a normalize
//                             kernel (x read three times), each written as well as such a
//                             kernel can be (16-byte loads, a block per row). gbps counts x read
//                             once + y written once for every implementation, so it reads as
//                             the useful bandwidth; copy_same_bytes moves the same bytes.
//   softmax/bf16_64x1048576   rows too long for one CTA: the split path (x read twice); the
//                             eager kernels get only 64 CTAs here (a block per row).
//   row_sum/f32_8192x32768    fused against cuBLAS gemv with a vector of ones (x @ 1), the
//                             usual library way to sum rows; gbps counts x + out.
//   batched_matmul/bf16_64x512x512x512   impl=cute (on an H100: the CUTLASS SM90 GEMM) against
//                             cuBLAS strided-batched.
#include <cuda_bf16.h>

#include <string>
#include <vector>

#include "bench/harness.hpp"
#include "fusekit/core/cuda_check.hpp"
#include "fusekit/ops/primitives.hpp"
#include "ops/common/cuda_common.cuh"
#include "ops/primitives/rows.cuh"

namespace fk::bench {
namespace {

using device::exp_of_difference;
using device::load_vec;
using device::row_reduce;
using device::store_vec;
using device::Vec;
using T = __nv_bfloat16;
constexpr int V = 8;
constexpr int kThreads = 512;

struct MaxOp {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// The three eager kernels: one block of kThreads per row, cols % V == 0.
__global__ void __launch_bounds__(kThreads) eager_row_max_kernel(const T* x, float* m, std::int64_t cols) {
  __shared__ float smem[32];
  const T* xr = x + static_cast<std::int64_t>(blockIdx.x) * cols;
  float v = -INFINITY;
  for (std::int64_t c = threadIdx.x * V; c < cols; c += kThreads * V) {
    const Vec<T, V> a = load_vec<T, V>(xr + c);
    for (int j = 0; j < V; ++j) v = fmaxf(v, a.get(j));
  }
  v = row_reduce(v, MaxOp{}, -INFINITY, smem);
  if (threadIdx.x == 0) m[blockIdx.x] = v;
}

__global__ void __launch_bounds__(kThreads) eager_exp_sum_kernel(const T* x, const float* m, float* s, std::int64_t cols) {
  __shared__ float smem[32];
  const T* xr = x + static_cast<std::int64_t>(blockIdx.x) * cols;
  const float mx = m[blockIdx.x];
  float v = 0.0f;
  for (std::int64_t c = threadIdx.x * V; c < cols; c += kThreads * V) {
    const Vec<T, V> a = load_vec<T, V>(xr + c);
    for (int j = 0; j < V; ++j) v += exp_of_difference(a.get(j) - mx);
  }
  v = row_reduce(v, device::SumOp{}, 0.0f, smem);
  if (threadIdx.x == 0) s[blockIdx.x] = v;
}

__global__ void __launch_bounds__(kThreads) eager_normalize_kernel(const T* x, const float* m, const float* s, T* y,
                                                                   std::int64_t cols) {
  const std::int64_t off = static_cast<std::int64_t>(blockIdx.x) * cols;
  const float mx = m[blockIdx.x], inv = 1.0f / s[blockIdx.x];
  for (std::int64_t c = threadIdx.x * V; c < cols; c += kThreads * V) {
    const Vec<T, V> a = load_vec<T, V>(x + off + c);
    Vec<T, V> o;
    for (int j = 0; j < V; ++j) o.set(j, exp_of_difference(a.get(j) - mx) * inv);
    store_vec<T, V>(y + off + c, o);
  }
}

void softmax_case(Context& ctx, std::int64_t rows, std::int64_t cols) {
  const std::string name = "softmax/bf16_" + shape_str(rows, cols);
  if (!ctx.selected("primitives", name)) return;
  const Tensor x = ctx.random({rows, cols}, DType::bf16, -8, 8);
  const Tensor y = ctx.empty({rows, cols}, DType::bf16), y_eager = ctx.empty({rows, cols}, DType::bf16);
  const Tensor m = ctx.empty({rows}, DType::f32), s = ctx.empty({rows}, DType::f32);
  auto eager = [&] {
    const auto blocks = static_cast<unsigned>(rows);
    eager_row_max_kernel<<<blocks, kThreads, 0, ctx.stream()>>>(x.data_as<T>(), m.data_as<float>(), cols);
    eager_exp_sum_kernel<<<blocks, kThreads, 0, ctx.stream()>>>(x.data_as<T>(), m.data_as<float>(), s.data_as<float>(), cols);
    eager_normalize_kernel<<<blocks, kThreads, 0, ctx.stream()>>>(x.data_as<T>(), m.data_as<float>(), s.data_as<float>(),
                                                                  y_eager.data_as<T>(), cols);
    FK_CUDA_CHECK_LAUNCH("eager softmax");
  };
  softmax(x, y, &ctx.fk_stream());
  eager();
  // Both round fp32 values once to bf16 (relative RMS difference well below 2^-8).
  const double err = ctx.rel_err(y, y_eager);
  require_close(name, err, 0x1p-8);
  const double bytes = 2.0 * static_cast<double>(x.nbytes());  // x + y of one run span >= 256 MB: beyond 4x L2 as is
  Record r{"primitives", name, "fused", "eager_max+expsum+normalize"};
  r.median_us = ctx.time_us([&](int) { softmax(x, y, &ctx.fk_stream()); }, 1);
  r.gbps = bytes / (r.median_us * 1e3);
  r.rel_err = err;
  ctx.add(r);
  Record e{"primitives", name, "eager_max+expsum+normalize", "eager_max+expsum+normalize"};
  e.median_us = ctx.time_us([&](int) { eager(); }, 1);
  e.gbps = bytes / (e.median_us * 1e3);
  ctx.add(e);
  ctx.add(copy_record(ctx, "primitives", name, bytes));
}

void softmax_cases(Context& ctx) {
  softmax_case(ctx, 8192, 32768);
  softmax_case(ctx, 64, 1 << 20);
}

void row_sum_cases(Context& ctx) {
  const std::int64_t rows = 8192, cols = 32768;
  const std::string name = "row_sum/f32_" + shape_str(rows, cols);
  if (!ctx.selected("primitives", name)) return;
  const Tensor x = ctx.random({rows, cols}, DType::f32);
  const Tensor out = ctx.empty({rows}, DType::f32), out_blas = ctx.empty({rows}, DType::f32);
  const Tensor ones = ctx.empty({cols}, DType::f32);
  FK_CUDA_CHECK(cudaStreamSynchronize(ctx.stream()));  // fill runs on the legacy default stream
  fill(ones, 1.0);
  const float alpha = 1.0f, beta = 0.0f;
  // Row-major x [rows, cols] is column-major [cols, rows]: out = (x^T)^T ones, i.e. OP_T.
  auto gemv = [&] {
    FK_CUBLAS_CHECK(cublasSgemv(ctx.cublas(), CUBLAS_OP_T, static_cast<int>(cols), static_cast<int>(rows), &alpha,
                                x.data_as<float>(), static_cast<int>(cols), ones.data_as<float>(), 1, &beta,
                                out_blas.data_as<float>(), 1));
  };
  row_sum(x, out, &ctx.fk_stream());
  gemv();
  const double err = ctx.rel_err(out, out_blas);
  require_close(name, err, 1e-5);  // two fp32 summation orders of 32768 terms
  const double bytes = static_cast<double>(x.nbytes() + out.nbytes());
  Record r{"primitives", name, "fused", "cublas_gemv_ones"};
  r.median_us = ctx.time_us([&](int) { row_sum(x, out, &ctx.fk_stream()); }, 1);
  r.gbps = bytes / (r.median_us * 1e3);
  r.rel_err = err;
  Record b{"primitives", name, "cublas_gemv_ones", "cublas_gemv_ones"};
  b.median_us = ctx.time_us([&](int) { gemv(); }, 1);
  b.gbps = bytes / (b.median_us * 1e3);
  ctx.add(r);
  ctx.add(b);
  ctx.add(copy_record(ctx, "primitives", name, bytes));
}

void batched_matmul_cases(Context& ctx) {
  const std::int64_t batch = 64, m = 512, n = 512, k = 512;
  const std::string name = "batched_matmul/bf16_64x512x512x512";
  if (!ctx.selected("primitives", name)) return;
  const std::size_t set_bytes = static_cast<std::size_t>(batch * (m * k + k * n + m * n)) * 2;
  const int rotations = ctx.rotations_for(set_bytes);
  std::vector<Tensor> a, b, c;
  for (int i = 0; i < rotations; ++i) {
    a.push_back(ctx.random({batch, m, k}, DType::bf16));
    b.push_back(ctx.random({batch, k, n}, DType::bf16));
    c.push_back(ctx.empty({batch, m, n}, DType::bf16));
  }
  const Tensor c_blas = ctx.empty({batch, m, n}, DType::bf16);
  batched_matmul(a[0], b[0], c[0], BatchedMatmulImpl::cute, &ctx.fk_stream());
  batched_matmul(a[0], b[0], c_blas, BatchedMatmulImpl::cublas, &ctx.fk_stream());
  const double err = ctx.rel_err(c[0], c_blas);
  require_close(name, err, 0x1p-7);  // both fp32 sums rounded once to bf16
  const double flops = 2.0 * static_cast<double>(batch * m * n * k);
  Record r{"primitives", name, "cute", "cublas_strided_batched"};
  r.median_us = ctx.time_us(
      [&](int i) { batched_matmul(a[i], b[i], c[i], BatchedMatmulImpl::cute, &ctx.fk_stream()); }, rotations);
  r.tflops = flops / (r.median_us * 1e6);
  r.rel_err = err;
  Record base{"primitives", name, "cublas_strided_batched", "cublas_strided_batched"};
  base.median_us = ctx.time_us(
      [&](int i) { batched_matmul(a[i], b[i], c[i], BatchedMatmulImpl::cublas, &ctx.fk_stream()); }, rotations);
  base.tflops = flops / (base.median_us * 1e6);
  ctx.add(r);
  ctx.add(base);
}

FK_BENCH_CASE("primitives", "softmax", softmax_cases);
FK_BENCH_CASE("primitives", "row_sum", row_sum_cases);
FK_BENCH_CASE("primitives", "batched_matmul", batched_matmul_cases);

}  // namespace
}  // namespace fk::bench
