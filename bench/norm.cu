// Bench cases of the norm family: the fused residual add + RMSNorm (forward) and its one-pass
// backward against the unfused path a user runs without fusion, one kernel per step:
//   forward   s = x + r;  rstd = 1 / sqrt(mean(s^2) + eps);  out = s * rstd * w        (3 kernels)
//   backward  dot = sum_n dout * w * s * rstd;  dx = rstd (g - x^ dot / n) + dres;
//             dw = column sums of dout * x^ (partial rows, then a fold)                  (4 kernels)
// The separate kernels are written as well as such kernels can be (16-byte accesses, one warp per
// row for the row statistics), so that the comparison measures fusion, not a weak baseline; each
// reads its operands again from memory, as separate launches do. Eager PyTorch (Hugging Face's
// LlamaRMSNorm: add, to(f32), pow, mean, add, rsqrt, mul, to(bf16), mul) launches more kernels
// still; python -m fusekit.bench times that path.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "bench/harness.hpp"
#include "fusekit/core/cuda_check.hpp"
#include "fusekit/ops/norm.hpp"
#include "ops/common/activations.cuh"
#include "ops/common/cuda_common.cuh"

namespace fk::bench {
namespace {

using device::load_vec;
using device::store_vec;
using device::Vec;

template <class T> struct cuda_type { using type = T; };
template <> struct cuda_type<bf16> { using type = __nv_bfloat16; };
template <> struct cuda_type<f16> { using type = __half; };

template <class T>
constexpr int kV = 16 / static_cast<int>(sizeof(T));

// A grid-stride loop over [n) in vectors of V: op(i) for each i = 0, V, 2V, ... (n % V == 0).
template <class Op>
__global__ void unfused_map_kernel(Op op, std::int64_t n, int v) {
  for (std::int64_t i = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * v; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x * v)
    op(i);
}

template <class T>
struct AddOp {  // s = x + r
  const T* x; const T* r; T* s;
  __device__ void operator()(std::int64_t i) const {
    constexpr int V = kV<T>;
    const Vec<T, V> a = load_vec<T, V>(x + i), b = load_vec<T, V>(r + i);
    Vec<T, V> o;
    for (int j = 0; j < V; ++j) o.set(j, a.get(j) + b.get(j));
    store_vec<T, V>(s + i, o);
  }
};

template <class T>
struct ScaleOp {  // out = s * rstd[row] * w[col]
  const T* s; const float* rstd; const T* w; T* out; std::int64_t cols;
  __device__ void operator()(std::int64_t i) const {
    constexpr int V = kV<T>;
    const Vec<T, V> a = load_vec<T, V>(s + i), b = load_vec<T, V>(w + i % cols);
    const float r = rstd[i / cols];
    Vec<T, V> o;
    for (int j = 0; j < V; ++j) o.set(j, a.get(j) * r * b.get(j));
    store_vec<T, V>(out + i, o);
  }
};

template <class T>
struct DxOp {  // dx = rstd (dout w - s rstd dot / n) + dres
  const T* dout; const T* s; const T* w; const T* dres; const float* rstd; const float* dot; T* dx; std::int64_t cols;
  __device__ void operator()(std::int64_t i) const {
    constexpr int V = kV<T>;
    const Vec<T, V> d = load_vec<T, V>(dout + i), a = load_vec<T, V>(s + i), b = load_vec<T, V>(w + i % cols);
    const Vec<T, V> e = load_vec<T, V>(dres + i);
    const std::int64_t row = i / cols;
    const float r = rstd[row], mean = dot[row] / static_cast<float>(cols);
    Vec<T, V> o;
    for (int j = 0; j < V; ++j) o.set(j, r * (d.get(j) * b.get(j) - a.get(j) * r * mean) + e.get(j));
    store_vec<T, V>(dx + i, o);
  }
};

// One warp per row: rstd[row] = 1 / sqrt(mean(s^2) + eps), or (dot) dot[row] = sum dout w s rstd.
template <class T, bool kDot>
__global__ void row_stat_kernel(const T* s, const T* dout, const T* w, float* stat, std::int64_t rows,
                                std::int64_t cols, float eps) {
  constexpr int V = kV<T>;
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = static_cast<int>(threadIdx.x % 32);
  float acc = 0.0f;
  for (std::int64_t c = lane * V; c < cols; c += 32 * V) {
    const Vec<T, V> a = load_vec<T, V>(s + row * cols + c);
    if constexpr (kDot) {
      const Vec<T, V> d = load_vec<T, V>(dout + row * cols + c), b = load_vec<T, V>(w + c);
      for (int j = 0; j < V; ++j) acc += d.get(j) * b.get(j) * a.get(j);
    } else {
      for (int j = 0; j < V; ++j) acc += a.get(j) * a.get(j);
    }
  }
  for (int m = 16; m >= 1; m >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, m);
  if (lane != 0) return;
  stat[row] = kDot ? acc * stat[rows + row] : rsqrtf(acc / static_cast<float>(cols) + eps);
}

// dw partial rows: block (32, 8) owns 32 columns and a slice of rows; then a fold over the parts.
template <class T>
__global__ void dw_partial_kernel(const T* dout, const T* s, const float* rstd, std::int64_t rows, std::int64_t cols,
                                  std::int64_t rows_per_block, float* partial) {
  __shared__ float fold[8][33];
  const std::int64_t col = static_cast<std::int64_t>(blockIdx.x) * 32 + threadIdx.x;
  const std::int64_t r0 = static_cast<std::int64_t>(blockIdx.y) * rows_per_block;
  const std::int64_t r1 = min(rows, r0 + rows_per_block);
  float acc = 0.0f;
  if (col < cols)
    for (std::int64_t r = r0 + threadIdx.y; r < r1; r += 8)
      acc += device::to_float(dout[r * cols + col]) * device::to_float(s[r * cols + col]) * rstd[r];
  fold[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y != 0 || col >= cols) return;
  float t = 0.0f;
  for (int g = 0; g < 8; ++g) t += fold[g][threadIdx.x];
  partial[blockIdx.y * cols + col] = t;
}

template <class T>
__global__ void dw_fold_kernel(const float* partial, int parts, std::int64_t cols, T* dw) {
  const std::int64_t col = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= cols) return;
  float t = 0.0f;
  for (int p = 0; p < parts; ++p) t += partial[p * cols + col];
  dw[col] = device::from_float<T>(t);
}

template <class T, class Op>
void launch_map(const Op& op, std::int64_t n, cudaStream_t s) {
  const std::int64_t want = (n / kV<T> + 255) / 256;
  const int grid = static_cast<int>(std::min<std::int64_t>(want, cuda::multiprocessor_count() * 8));
  unfused_map_kernel<<<grid, 256, 0, s>>>(op, n, kV<T>);
  FK_CUDA_CHECK_LAUNCH("unfused_map_kernel");
}

struct ForwardSet {
  Tensor x, r, out, rout, rstd;
};

template <class H>
void forward_case(Context& ctx, std::int64_t rows, std::int64_t cols) {
  using T = typename cuda_type<H>::type;
  const DType dt = dtype_v<H>;
  const std::string name = "add_rms_norm/" + std::string(dtype_name(dt)) + "_" + shape_str(rows, cols);
  if (!ctx.selected("norm", name)) return;
  const float eps = 1e-6f;
  const std::size_t tensor_bytes = static_cast<std::size_t>(rows * cols) * dtype_size(dt);
  const int rot = ctx.rotations_for(4 * tensor_bytes);
  std::vector<ForwardSet> sets;
  for (int i = 0; i < rot; ++i) {
    ForwardSet s;
    s.x = ctx.random({rows, cols}, dt, -2.f, 2.f);
    s.r = ctx.random({rows, cols}, dt, -2.f, 2.f);
    s.out = ctx.empty({rows, cols}, dt);
    s.rout = ctx.empty({rows, cols}, dt);
    s.rstd = ctx.empty({rows}, DType::f32);
    sets.push_back(std::move(s));
  }
  const Tensor w = ctx.random({cols}, dt, 0.5f, 1.5f);
  const Tensor s_unfused = ctx.empty({rows, cols}, dt), out_unfused = ctx.empty({rows, cols}, dt);
  const Tensor rstd_unfused = ctx.empty({rows}, DType::f32);
  const std::int64_t n = rows * cols;
  auto unfused = [&](const ForwardSet& s) {
    launch_map<T>(AddOp<T>{s.x.data_as<T>(), s.r.data_as<T>(), s_unfused.data_as<T>()}, n, ctx.stream());
    row_stat_kernel<T, false><<<static_cast<unsigned>((rows + 7) / 8), 256, 0, ctx.stream()>>>(
        s_unfused.data_as<T>(), nullptr, nullptr, rstd_unfused.data_as<float>(), rows, cols, eps);
    FK_CUDA_CHECK_LAUNCH("row_stat_kernel");
    launch_map<T>(ScaleOp<T>{s_unfused.data_as<T>(), rstd_unfused.data_as<float>(), w.data_as<T>(),
                             out_unfused.data_as<T>(), cols},
                  n, ctx.stream());
  };
  auto fused = [&](const ForwardSet& s) {
    rms_norm_forward({s.x, s.r.view(), w, s.out, s.rout.view(), s.rstd}, {eps, 0.0f}, &ctx.fk_stream());
  };
  unfused(sets[0]);
  fused(sets[0]);
  const double err = std::max(ctx.rel_err(sets[0].out, out_unfused), ctx.rel_err(sets[0].rout, s_unfused));
  require_close(name, err, dt == DType::f32 ? 1e-5 : 1e-2);  // the unfused path rounds s * rstd * w per product

  const double bytes = 4.0 * static_cast<double>(tensor_bytes) + 4.0 * static_cast<double>(rows);
  Record fr{"norm", name, "fused", "unfused_3_kernels"};
  fr.median_us = ctx.time_us([&](int i) { fused(sets[static_cast<std::size_t>(i)]); }, rot);
  fr.gbps = bytes / (fr.median_us * 1e3);
  fr.rel_err = err;
  Record ur{"norm", name, "unfused_3_kernels", "unfused_3_kernels"};
  ur.median_us = ctx.time_us([&](int i) { unfused(sets[static_cast<std::size_t>(i)]); }, rot);
  ur.gbps = bytes / (ur.median_us * 1e3);  // the same useful bytes, for comparison
  ctx.add(fr);
  ctx.add(ur);
  ctx.add(copy_record(ctx, "norm", name, bytes));
}

struct BackwardSet {
  Tensor dout, s, dres, rstd, dx;
};

template <class H>
void backward_case(Context& ctx, std::int64_t rows, std::int64_t cols) {
  using T = typename cuda_type<H>::type;
  const DType dt = dtype_v<H>;
  const std::string name = "add_rms_norm_bwd/" + std::string(dtype_name(dt)) + "_" + shape_str(rows, cols);
  if (!ctx.selected("norm", name)) return;
  const std::size_t tensor_bytes = static_cast<std::size_t>(rows * cols) * dtype_size(dt);
  const int rot = ctx.rotations_for(4 * tensor_bytes);
  const Tensor w = ctx.random({cols}, dt, 0.5f, 1.5f);
  std::vector<BackwardSet> sets;
  for (int i = 0; i < rot; ++i) {
    BackwardSet s;
    s.dout = ctx.random({rows, cols}, dt);
    s.s = ctx.random({rows, cols}, dt, -2.f, 2.f);
    s.dres = ctx.random({rows, cols}, dt);
    s.rstd = ctx.empty({rows}, DType::f32);
    Tensor out = ctx.empty({rows, cols}, dt);
    rms_norm_forward({s.s, std::nullopt, w, out, std::nullopt, s.rstd}, {1e-6f, 0.0f}, &ctx.fk_stream());
    s.dx = ctx.empty({rows, cols}, dt);
    sets.push_back(std::move(s));
  }
  const Tensor dw_fused = ctx.empty({cols}, dt), dw_unfused = ctx.empty({cols}, dt);
  const Tensor dx_unfused = ctx.empty({rows, cols}, dt);
  const Tensor dot = ctx.empty({2 * rows}, DType::f32);  // [dot | rstd] for row_stat_kernel<kDot>
  const std::int64_t rows_per_block = 64;
  const int parts = static_cast<int>((rows + rows_per_block - 1) / rows_per_block);
  const Tensor partial = ctx.empty({parts, cols}, DType::f32);
  const std::int64_t n = rows * cols;
  auto unfused = [&](const BackwardSet& s) {
    FK_CUDA_CHECK(cudaMemcpyAsync(dot.data_as<float>() + rows, s.rstd.data_as<float>(), rows * sizeof(float),
                                  cudaMemcpyDeviceToDevice, ctx.stream()));
    row_stat_kernel<T, true><<<static_cast<unsigned>((rows + 7) / 8), 256, 0, ctx.stream()>>>(
        s.s.data_as<T>(), s.dout.data_as<T>(), w.data_as<T>(), dot.data_as<float>(), rows, cols, 0.0f);
    FK_CUDA_CHECK_LAUNCH("row_stat_kernel");
    launch_map<T>(DxOp<T>{s.dout.data_as<T>(), s.s.data_as<T>(), w.data_as<T>(), s.dres.data_as<T>(),
                          s.rstd.data_as<float>(), dot.data_as<float>(), dx_unfused.data_as<T>(), cols},
                  n, ctx.stream());
    dw_partial_kernel<T><<<dim3(static_cast<unsigned>((cols + 31) / 32), static_cast<unsigned>(parts)), dim3(32, 8), 0,
                           ctx.stream()>>>(s.dout.data_as<T>(), s.s.data_as<T>(), s.rstd.data_as<float>(), rows, cols,
                                           rows_per_block, partial.data_as<float>());
    dw_fold_kernel<T><<<static_cast<unsigned>((cols + 255) / 256), 256, 0, ctx.stream()>>>(
        partial.data_as<float>(), parts, cols, dw_unfused.data_as<T>());
    FK_CUDA_CHECK_LAUNCH("dw kernels");
  };
  auto fused = [&](const BackwardSet& s) {
    rms_norm_backward({s.dout, s.dres.view(), s.s, w, s.rstd, s.dx, dw_fused.view()}, {1e-6f, 0.0f},
                      &ctx.fk_stream());
  };
  unfused(sets[0]);
  fused(sets[0]);
  const double err = std::max(ctx.rel_err(sets[0].dx, dx_unfused), ctx.rel_err(dw_fused, dw_unfused));
  require_close(name, err, dt == DType::f32 ? 1e-5 : 1e-2);
  const double bytes = 4.0 * static_cast<double>(tensor_bytes) + 4.0 * static_cast<double>(rows);
  Record fr{"norm", name, "fused", "unfused_4_kernels"};
  fr.median_us = ctx.time_us([&](int i) { fused(sets[static_cast<std::size_t>(i)]); }, rot);
  fr.gbps = bytes / (fr.median_us * 1e3);
  fr.rel_err = err;
  Record ur{"norm", name, "unfused_4_kernels", "unfused_4_kernels"};
  ur.median_us = ctx.time_us([&](int i) { unfused(sets[static_cast<std::size_t>(i)]); }, rot);
  ur.gbps = bytes / (ur.median_us * 1e3);
  ctx.add(fr);
  ctx.add(ur);
  ctx.add(copy_record(ctx, "norm", name, bytes));
}

// Issue 38's model (batch 64 x context 1024 tokens, width 768), a 1B-parameter width (2048) and
// LLaMA-7B's (4096); f32 as autocast runs the norms.
void norm_cases(Context& ctx) {
  forward_case<bf16>(ctx, 65536, 768);
  forward_case<bf16>(ctx, 16384, 2048);
  forward_case<bf16>(ctx, 8192, 4096);
  forward_case<float>(ctx, 65536, 768);
  backward_case<bf16>(ctx, 65536, 768);
  backward_case<bf16>(ctx, 16384, 2048);
  backward_case<bf16>(ctx, 8192, 4096);
  backward_case<float>(ctx, 65536, 768);
}

FK_BENCH_CASE("norm", "add_rms_norm", norm_cases);

}  // namespace
}  // namespace fk::bench
