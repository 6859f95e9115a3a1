// Bench cases of the pointwise family: the fused bias + scaled residual + activation against the
// same math as eager PyTorch runs it, one kernel per operation:
//   forward   t1 = alpha * r;  t2 = x + t1;  t3 = t2 + b;  y = act(t3)          (4 kernels)
//   backward  dz = act_backward(dy, y);  dr = alpha * dz;  db = dz.sum(0)       (3 kernels + fold)
// Rotary position embedding against Hugging Face's expression as eager PyTorch runs it, per tensor:
//   forward   t1 = x * cos;  t2 = -x[..., D/2:];  t3 = cat(t2, x[..., :D/2]);  t4 = t3 * sin;  y = t1 + t4
//   backward  t1 = g * cos;  t3 = g * sin;  t2 = -t3[..., :D/2];  t4 = cat(t3[..., D/2:], t2);  dx = t1 + t4
// (5 kernels for q and 5 for k; autograd's own backward of the expression launches more: the
// slices' backward fills zeros and copies).
// The separate kernels are written as well as such kernels can be (16-byte accesses, a grid
// sized to the GPU), so that the comparison measures fusion, not a weak baseline.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "bench/harness.hpp"
#include "fusekit/core/cuda_check.hpp"
#include "fusekit/ops/pointwise.hpp"
#include "ops/common/cuda_common.cuh"
#include "ops/common/activations.cuh"

namespace fk::bench {
namespace {

using device::load_vec;
using device::store_vec;
using device::to_float;
using device::Vec;

// One eager elementwise kernel: out[i..i+V) = op(i) over a flat [n] range, n % V == 0.
template <class T, int V, class Op>
__global__ void eager_map_kernel(Op op, std::int64_t n) {
  for (std::int64_t i = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * V; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x * V)
    op(i);
}

template <class T, int V>
struct ScaleOp {  // out = alpha * a
  const T* a; T* out; float alpha;
  __device__ void operator()(std::int64_t i) const {
    const Vec<T, V> va = load_vec<T, V>(a + i);
    Vec<T, V> o;
    for (int j = 0; j < V; ++j) o.set(j, alpha * va.get(j));
    store_vec<T, V>(out + i, o);
  }
};

template <class T, int V>
struct AddOp {  // out = a + b
  const T* a; const T* b; T* out;
  __device__ void operator()(std::int64_t i) const {
    const Vec<T, V> va = load_vec<T, V>(a + i), vb = load_vec<T, V>(b + i);
    Vec<T, V> o;
    for (int j = 0; j < V; ++j) o.set(j, va.get(j) + vb.get(j));
    store_vec<T, V>(out + i, o);
  }
};

template <class T, int V>
struct AddBiasOp {  // out = a + bias[col], broadcast along rows
  const T* a; const T* bias; T* out; std::int64_t cols;
  __device__ void operator()(std::int64_t i) const {
    const Vec<T, V> va = load_vec<T, V>(a + i), vb = load_vec<T, V>(bias + i % cols);
    Vec<T, V> o;
    for (int j = 0; j < V; ++j) o.set(j, va.get(j) + vb.get(j));
    store_vec<T, V>(out + i, o);
  }
};

template <class T, int V, Activation A>
struct ActOp {  // out = act(a)
  const T* a; T* out;
  __device__ void operator()(std::int64_t i) const {
    const Vec<T, V> va = load_vec<T, V>(a + i);
    Vec<T, V> o;
    for (int j = 0; j < V; ++j) o.set(j, device::activation<A>(va.get(j)));
    store_vec<T, V>(out + i, o);
  }
};

template <class T, int V, Activation A>
struct ActBackwardOp {  // dz = dy * act'(y), from the output
  const T* dy; const T* y; T* dz;
  __device__ void operator()(std::int64_t i) const {
    const Vec<T, V> g = load_vec<T, V>(dy + i), s = load_vec<T, V>(y + i);
    Vec<T, V> o;
    for (int j = 0; j < V; ++j)
      o.set(j, g.get(j) * device::activation_grad_from_output<A>(s.get(j)));
    store_vec<T, V>(dz + i, o);
  }
};

// Column sums, eager-reduction style: block (32, 8) owns 32 columns and a slice of rows, folds
// them in shared memory and writes one partial row; a second launch adds the partial rows.
template <class T>
__global__ void colsum_partial_kernel(const T* __restrict__ a, std::int64_t rows, std::int64_t cols,
                                      std::int64_t rows_per_block, float* __restrict__ partial) {
  __shared__ float fold[8][33];
  const std::int64_t col = static_cast<std::int64_t>(blockIdx.x) * 32 + threadIdx.x;
  const std::int64_t r0 = static_cast<std::int64_t>(blockIdx.y) * rows_per_block;
  const std::int64_t r1 = min(rows, r0 + rows_per_block);
  float s = 0;
  if (col < cols)
    for (std::int64_t r = r0 + threadIdx.y; r < r1; r += 8) s += to_float(a[r * cols + col]);
  fold[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    float t = 0;
    for (int g = 0; g < 8; ++g) t += fold[g][threadIdx.x];
    partial[blockIdx.y * cols + col] = t;
  }
}

__global__ void colsum_final_kernel(const float* __restrict__ partial, int parts, std::int64_t cols,
                                    float* __restrict__ out) {
  const std::int64_t col = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= cols) return;
  float s = 0;
  for (int p = 0; p < parts; ++p) s += partial[p * cols + col];
  out[col] = s;
}

template <class T, class Op>
void launch_map(const Op& op, std::int64_t n, cudaStream_t s) {
  constexpr int V = 16 / sizeof(T);
  const std::int64_t want = (n / V + 255) / 256;
  const int grid = static_cast<int>(std::min<std::int64_t>(want, cuda::multiprocessor_count() * 8));
  eager_map_kernel<T, V><<<grid, 256, 0, s>>>(op, n);
  FK_CUDA_CHECK_LAUNCH("eager_map_kernel");
}

template <class T> struct cuda_type { using type = T; };
template <> struct cuda_type<bf16> { using type = __nv_bfloat16; };
template <> struct cuda_type<f16> { using type = __half; };

// The inputs and outputs of one forward run (fused and eager share x, r, b).
struct ForwardSet {
  Tensor x, r, b, y_fused, y_eager, t1, t2, t3;
};

template <class H, Activation A>
void forward_case(Context& ctx, std::int64_t rows, std::int64_t cols) {
  using T = typename cuda_type<H>::type;
  const DType dt = dtype_v<H>;
  const std::string name = "add_mul_act/" + std::string(activation_name(A)) + "_" + std::string(dtype_name(dt)) + "_" + shape_str(rows, cols);
  if (!ctx.selected("pointwise", name)) return;
  const float alpha = 0.5f;
  const std::size_t tensor_bytes = static_cast<std::size_t>(rows * cols) * dtype_size(dt);
  const int rot = ctx.rotations_for(3 * tensor_bytes);
  std::vector<ForwardSet> sets;
  for (int i = 0; i < rot; ++i) {
    ForwardSet s;
    s.x = ctx.random({rows, cols}, dt, -2.f, 2.f);
    s.r = ctx.random({rows, cols}, dt, -2.f, 2.f);
    s.b = ctx.random({cols}, dt, -1.f, 1.f);
    s.y_fused = ctx.empty({rows, cols}, dt);
    sets.push_back(std::move(s));
  }
  // The eager temporaries are reused across runs, as a caching allocator would hand them out.
  ForwardSet& s0 = sets[0];
  s0.y_eager = ctx.empty({rows, cols}, dt);
  s0.t1 = ctx.empty({rows, cols}, dt);
  s0.t2 = ctx.empty({rows, cols}, dt);
  s0.t3 = ctx.empty({rows, cols}, dt);
  const std::int64_t n = rows * cols;
  constexpr int V = 16 / sizeof(T);
  auto eager = [&](const ForwardSet& s) {
    launch_map<T>(ScaleOp<T, V>{s.r.data_as<T>(), s0.t1.data_as<T>(), alpha}, n, ctx.stream());
    launch_map<T>(AddOp<T, V>{s.x.data_as<T>(), s0.t1.data_as<T>(), s0.t2.data_as<T>()}, n, ctx.stream());
    launch_map<T>(AddBiasOp<T, V>{s0.t2.data_as<T>(), s.b.data_as<T>(), s0.t3.data_as<T>(), cols}, n, ctx.stream());
    launch_map<T>(ActOp<T, V, A>{s0.t3.data_as<T>(), s0.y_eager.data_as<T>()}, n, ctx.stream());
  };
  auto fused = [&](const ForwardSet& s) {
    bias_act_forward({s.x, s.r.view(), s.b.view(), s.y_fused, std::nullopt}, {A, alpha}, &ctx.fk_stream());
  };

  eager(s0);
  fused(s0);
  const double err = ctx.rel_err(s0.y_fused, s0.y_eager);
  // The eager path rounds to the dtype after every op, the fused one once: they differ by a few
  // roundings of the dtype.
  require_close(name, err, dt == DType::f32 ? 1e-6 : 2e-2);

  const double bytes = 3.0 * static_cast<double>(tensor_bytes) + static_cast<double>(cols * dtype_size(dt));
  Record fr{"pointwise", name, "fused", "eager_4_kernels"};
  fr.median_us = ctx.time_us([&](int i) { fused(sets[static_cast<std::size_t>(i)]); }, rot);
  fr.gbps = bytes / (fr.median_us * 1e3);
  fr.rel_err = err;
  Record er{"pointwise", name, "eager_4_kernels", "eager_4_kernels"};
  er.median_us = ctx.time_us([&](int i) { eager(sets[static_cast<std::size_t>(i)]); }, rot);
  er.gbps = bytes / (er.median_us * 1e3);  // the same useful bytes, for comparison
  ctx.add(fr);
  ctx.add(er);
}

struct BackwardSet {
  Tensor dy, y, dx, dr;
};

template <class H, Activation A>
void backward_case(Context& ctx, std::int64_t rows, std::int64_t cols) {
  using T = typename cuda_type<H>::type;
  const DType dt = dtype_v<H>;
  const std::string name = "add_mul_act_bwd/" + std::string(activation_name(A)) + "_" + std::string(dtype_name(dt)) + "_" + shape_str(rows, cols);
  if (!ctx.selected("pointwise", name)) return;
  const float alpha = 0.5f;
  const std::size_t tensor_bytes = static_cast<std::size_t>(rows * cols) * dtype_size(dt);
  const int rot = ctx.rotations_for(4 * tensor_bytes);
  std::vector<BackwardSet> sets;
  for (int i = 0; i < rot; ++i) {
    BackwardSet s;
    s.dy = ctx.random({rows, cols}, dt, -1.f, 1.f);
    // y as a forward would leave it: relu outputs, half of them exactly zero.
    Tensor z = ctx.random({rows, cols}, dt, -1.f, 1.f);
    s.y = ctx.empty({rows, cols}, dt);
    bias_act_forward({z, std::nullopt, std::nullopt, s.y, std::nullopt}, {A, 1.0f}, &ctx.fk_stream());
    s.dx = ctx.empty({rows, cols}, dt);
    s.dr = ctx.empty({rows, cols}, dt);
    sets.push_back(std::move(s));
  }
  const Tensor db_fused = ctx.empty({cols}, DType::f32), db_eager = ctx.empty({cols}, DType::f32);
  const Tensor dz_eager = ctx.empty({rows, cols}, dt), dr_eager = ctx.empty({rows, cols}, dt);
  const std::int64_t rows_per_block = 64;
  const int parts = static_cast<int>((rows + rows_per_block - 1) / rows_per_block);
  const Tensor partial = ctx.empty({parts, cols}, DType::f32);
  const std::int64_t n = rows * cols;
  constexpr int V = 16 / sizeof(T);
  auto eager = [&](const BackwardSet& s) {
    launch_map<T>(ActBackwardOp<T, V, A>{s.dy.data_as<T>(), s.y.data_as<T>(), dz_eager.data_as<T>()}, n, ctx.stream());
    launch_map<T>(ScaleOp<T, V>{dz_eager.data_as<T>(), dr_eager.data_as<T>(), alpha}, n, ctx.stream());
    colsum_partial_kernel<<<dim3(static_cast<unsigned>((cols + 31) / 32), static_cast<unsigned>(parts)), dim3(32, 8), 0,
                            ctx.stream()>>>(dz_eager.data_as<T>(), rows, cols, rows_per_block, partial.data_as<float>());
    colsum_final_kernel<<<static_cast<unsigned>((cols + 255) / 256), 256, 0, ctx.stream()>>>(
        partial.data_as<float>(), parts, cols, db_eager.data_as<float>());
    FK_CUDA_CHECK_LAUNCH("colsum kernels");
  };
  auto fused = [&](const BackwardSet& s) {
    bias_act_backward({s.dy, s.y, SavedForBackward::output, s.dx, s.dr.view(), db_fused.view()}, {A, alpha},
                      &ctx.fk_stream());
  };
  eager(sets[0]);
  fused(sets[0]);
  const double err = std::max({ctx.rel_err(sets[0].dx, dz_eager), ctx.rel_err(sets[0].dr, dr_eager), ctx.rel_err(db_fused, db_eager)});
  // dx and dr are rounded once in both paths; db sums the same fp32 values in different orders.
  require_close(name, err, dt == DType::f32 ? 1e-5 : 1e-2);

  const double bytes = 4.0 * static_cast<double>(tensor_bytes) + 4.0 * static_cast<double>(cols);
  Record fr{"pointwise", name, "fused", "eager_3_ops"};
  fr.median_us = ctx.time_us([&](int i) { fused(sets[static_cast<std::size_t>(i)]); }, rot);
  fr.gbps = bytes / (fr.median_us * 1e3);
  fr.rel_err = err;
  Record er{"pointwise", name, "eager_3_ops", "eager_3_ops"};
  er.median_us = ctx.time_us([&](int i) { eager(sets[static_cast<std::size_t>(i)]); }, rot);
  er.gbps = bytes / (er.median_us * 1e3);
  ctx.add(fr);
  ctx.add(er);
}

void pointwise_cases(Context& ctx) {
  forward_case<float, Activation::relu>(ctx, 65536, 1024);
  forward_case<bf16, Activation::sigmoid>(ctx, 65536, 1024);
  forward_case<float, Activation::relu>(ctx, 128, 512);
  forward_case<bf16, Activation::gelu_tanh>(ctx, 65536, 1024);
  backward_case<bf16, Activation::relu>(ctx, 65536, 1024);
  backward_case<float, Activation::sigmoid>(ctx, 65536, 1024);
}

FK_BENCH_CASE("pointwise", "add_mul_act", pointwise_cases);

// ---- rope -----------------------------------------------------------------------------------

// The eager kernels of the rope baseline over contiguous x [rows = B*H*T, D] and a [B, T, D]
// table (V elements never straddle a row or a half: D/2 % V == 0).
template <class T, int V>
struct MulTableOp {  // out = a * table[b, t, :] broadcast over heads
  const T* a; const T* table; T* out; std::int64_t dim, seq, heads;
  __device__ void operator()(std::int64_t i) const {
    const std::int64_t row = i / dim, d = i - row * dim;
    const std::int64_t t = row % seq, b = row / (seq * heads);
    const Vec<T, V> va = load_vec<T, V>(a + i), vt = load_vec<T, V>(table + (b * seq + t) * dim + d);
    Vec<T, V> o;
    for (int j = 0; j < V; ++j) o.set(j, va.get(j) * vt.get(j));
    store_vec<T, V>(out + i, o);
  }
};

template <class T, int V>
struct NegHalfOp {  // out [rows, D/2] = -a[:, first ? :D/2 : D/2:]
  const T* a; T* out; std::int64_t half; bool first;
  __device__ void operator()(std::int64_t i) const {
    const std::int64_t row = i / half, j = i - row * half;
    const Vec<T, V> va = load_vec<T, V>(a + row * 2 * half + (first ? 0 : half) + j);
    Vec<T, V> o;
    for (int k = 0; k < V; ++k) o.set(k, -va.get(k));
    store_vec<T, V>(out + i, o);
  }
};

template <class T, int V>
struct CatHalvesOp {  // out [rows, D] = cat(l, r): halves [rows, D/2] read with row strides ls, rs
  const T* l; std::int64_t ls; const T* r; std::int64_t rs; T* out; std::int64_t half;
  __device__ void operator()(std::int64_t i) const {
    const std::int64_t row = i / (2 * half), d = i - row * 2 * half;
    const Vec<T, V> v = d < half ? load_vec<T, V>(l + row * ls + d) : load_vec<T, V>(r + row * rs + d - half);
    store_vec<T, V>(out + i, v);
  }
};

struct RopeShape {
  std::int64_t batch, q_heads, k_heads, seq, dim;
};

struct RopeSet {
  Tensor q, k, q_out, k_out;
};

template <class H>
void rope_case(Context& ctx, RopeShape sh, bool backward) {
  using T = typename cuda_type<H>::type;
  const DType dt = dtype_v<H>;
  const std::string name = std::string(backward ? "rope_bwd/" : "rope/") + std::string(dtype_name(dt)) + "_B" +
                           std::to_string(sh.batch) + "_Hq" + std::to_string(sh.q_heads) + "_Hk" +
                           std::to_string(sh.k_heads) + "_T" + std::to_string(sh.seq) + "_D" + std::to_string(sh.dim);
  if (!ctx.selected("pointwise", name)) return;
  const Dims qs{sh.batch, sh.q_heads, sh.seq, sh.dim}, ks{sh.batch, sh.k_heads, sh.seq, sh.dim};
  const std::size_t es = dtype_size(dt);
  const std::size_t qk_bytes = static_cast<std::size_t>(qs.numel() + ks.numel()) * es;
  const std::size_t table_bytes = 2 * static_cast<std::size_t>(sh.batch * sh.seq * sh.dim) * es;
  const int rot = ctx.rotations_for(2 * qk_bytes + table_bytes);
  std::vector<RopeSet> sets;
  for (int i = 0; i < rot; ++i)
    sets.push_back({ctx.random(qs, dt, -2.f, 2.f), ctx.random(ks, dt, -2.f, 2.f), ctx.empty(qs, dt), ctx.empty(ks, dt)});
  // One pair of tables for every run, as one rotary embedding serves every layer of a model.
  const Tensor cos = ctx.random({sh.batch, sh.seq, sh.dim}, dt, -1.f, 1.f);
  const Tensor sin = ctx.random({sh.batch, sh.seq, sh.dim}, dt, -1.f, 1.f);
  const Tensor eager_q = ctx.empty(qs, dt), eager_k = ctx.empty(ks, dt);
  const Tensor t1 = ctx.empty(qs, dt), t3 = ctx.empty(qs, dt), t4 = ctx.empty(qs, dt);
  const Tensor t2 = ctx.empty({qs.numel() / 2}, dt);
  constexpr int V = 16 / sizeof(T);
  const std::int64_t half = sh.dim / 2;
  auto eager_one = [&](const Tensor& x, const Tensor& out, std::int64_t heads) {
    const std::int64_t n = sh.batch * heads * sh.seq * sh.dim;
    const T* c = cos.data_as<T>();
    const T* sn = sin.data_as<T>();
    T* o1 = t1.data_as<T>();
    T* o2 = t2.data_as<T>();
    T* o3 = t3.data_as<T>();
    T* o4 = t4.data_as<T>();
    const T* xs = x.data_as<T>();
    if (!backward) {
      launch_map<T>(MulTableOp<T, V>{xs, c, o1, sh.dim, sh.seq, heads}, n, ctx.stream());
      launch_map<T>(NegHalfOp<T, V>{xs, o2, half, false}, n / 2, ctx.stream());
      launch_map<T>(CatHalvesOp<T, V>{o2, half, xs, sh.dim, o3, half}, n, ctx.stream());
      launch_map<T>(MulTableOp<T, V>{o3, sn, o4, sh.dim, sh.seq, heads}, n, ctx.stream());
    } else {
      launch_map<T>(MulTableOp<T, V>{xs, c, o1, sh.dim, sh.seq, heads}, n, ctx.stream());
      launch_map<T>(MulTableOp<T, V>{xs, sn, o3, sh.dim, sh.seq, heads}, n, ctx.stream());
      launch_map<T>(NegHalfOp<T, V>{o3, o2, half, true}, n / 2, ctx.stream());
      launch_map<T>(CatHalvesOp<T, V>{o3 + half, sh.dim, o2, half, o4, half}, n, ctx.stream());
    }
    launch_map<T>(AddOp<T, V>{o1, o4, out.data_as<T>()}, n, ctx.stream());
  };
  auto eager = [&](const RopeSet& s) {
    eager_one(s.q, eager_q, sh.q_heads);
    eager_one(s.k, eager_k, sh.k_heads);
  };
  auto fused = [&](const RopeSet& s) {
    const RopeArgs a{s.q, s.k, cos, sin, s.q_out, s.k_out};
    backward ? rope_backward(a, &ctx.fk_stream()) : rope_forward(a, &ctx.fk_stream());
  };
  eager(sets[0]);
  fused(sets[0]);
  const double err = std::max(ctx.rel_err(sets[0].q_out, eager_q), ctx.rel_err(sets[0].k_out, eager_k));
  // The eager path rounds after every op, the fused one once.
  require_close(name, err, dt == DType::f32 ? 1e-6 : 2e-2);

  const double bytes = 2.0 * static_cast<double>(qk_bytes) + static_cast<double>(table_bytes);
  const std::string baseline = "eager_5_kernels_x2";
  Record fr{"pointwise", name, "fused", baseline};
  fr.median_us = ctx.time_us([&](int i) { fused(sets[static_cast<std::size_t>(i)]); }, rot);
  fr.gbps = bytes / (fr.median_us * 1e3);
  fr.rel_err = err;
  Record er{"pointwise", name, baseline, baseline};
  er.median_us = ctx.time_us([&](int i) { eager(sets[static_cast<std::size_t>(i)]); }, rot);
  er.gbps = bytes / (er.median_us * 1e3);
  ctx.add(fr);
  ctx.add(er);
}

void rope_cases(Context& ctx) {
  // The issue's LLaMA (width 768, 12 heads of 64) at batch 16 x 1024 tokens; a 1B LLaMA (32 q heads,
  // 8 kv heads of 64) at 4 x 2048; an 8B-like head dimension of 128.
  for (bool backward : {false, true}) {
    rope_case<bf16>(ctx, {16, 12, 12, 1024, 64}, backward);
    rope_case<bf16>(ctx, {4, 32, 8, 2048, 64}, backward);
    rope_case<bf16>(ctx, {2, 32, 8, 2048, 128}, backward);
  }
  rope_case<float>(ctx, {4, 32, 8, 2048, 64}, false);
}

FK_BENCH_CASE("pointwise", "rope", rope_cases);

}  // namespace
}  // namespace fk::bench
