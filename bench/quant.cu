// Bench cases of the quant family's memory-bound ops. Their targets are fractions of the copy
// ceiling, so pack and unpack are set against a device-to-device copy moving the same number of
// bytes (read + write); the ReLU with a bit mask against what eager PyTorch runs to save a mask:
// relu(x) and (x > 0) as a bool tensor (two kernels, 1 byte of mask per element), and for the
// backward where(mask, dy, 0) from that bool mask.
#include <cuda_bf16.h>

#include <cstdio>

#include "bench/harness.hpp"
#include "fusekit/core/cuda_check.hpp"
#include "fusekit/ops/quant.hpp"
#include "ops/common/cuda_common.cuh"
#include "ops/common/activations.cuh"

namespace fk::bench {
namespace {

using device::load_vec;
using device::store_vec;
using device::Vec;
using T = __nv_bfloat16;
constexpr int V = 8;

__global__ void eager_relu_kernel(const T* __restrict__ x, T* __restrict__ y, std::int64_t n) {
  for (std::int64_t i = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * V; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x * V) {
    const Vec<T, V> v = load_vec<T, V>(x + i);
    Vec<T, V> o;
    for (int j = 0; j < V; ++j) o.set(j, device::activation<Activation::relu>(v.get(j)));
    store_vec<T, V>(y + i, o);
  }
}

__global__ void eager_gt_zero_kernel(const T* __restrict__ x, std::uint8_t* __restrict__ mask, std::int64_t n) {
  for (std::int64_t i = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * V; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x * V) {
    const Vec<T, V> v = load_vec<T, V>(x + i);
    Vec<std::uint8_t, V> m;
    for (int j = 0; j < V; ++j) m.v[j] = v.get(j) > 0.0f;
    store_vec<std::uint8_t, V>(mask + i, m);
  }
}

__global__ void eager_where_kernel(const T* __restrict__ dy, const std::uint8_t* __restrict__ mask, T* __restrict__ dx,
                                   std::int64_t n) {
  for (std::int64_t i = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * V; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x * V) {
    const Vec<T, V> g = load_vec<T, V>(dy + i);
    const Vec<std::uint8_t, V> m = load_vec<std::uint8_t, V>(mask + i);
    Vec<T, V> o;
    for (int j = 0; j < V; ++j) o.set(j, m.v[j] ? g.get(j) : 0.0f);
    store_vec<T, V>(dx + i, o);
  }
}

unsigned grid_for(std::int64_t n) {
  return static_cast<unsigned>(
      std::min<std::int64_t>((n / V + 255) / 256, static_cast<std::int64_t>(cuda::multiprocessor_count()) * 8));
}

void pack_unpack_cases(Context& ctx) {
  const std::int64_t k = 100864, c = 768;
  for (int bits : {2, 4, 8}) {
    char name[64];
    std::snprintf(name, sizeof name, "K%lld_C%lld_b%d", static_cast<long long>(k), static_cast<long long>(c), bits);
    const std::string shape = name;
    const PackParams p{.bits = bits, .group = 256, .stats_dtype = DType::bf16};
    const bool want_pack = ctx.selected("quant", "pack/" + shape), want_unpack = ctx.selected("quant", "unpack/" + shape);
    if (!want_pack && !want_unpack) continue;
    const Tensor x = ctx.random({k, c}, DType::bf16, -3, 3);
    const PackedTensor packed = PackedTensor::empty(k, c, DType::bf16, p, x.device(), &ctx.fk_stream());
    const Tensor xhat = ctx.empty({k, c}, DType::bf16);
    pack(x, packed.view(), p, &ctx.fk_stream());
    unpack(packed.view(), xhat, &ctx.fk_stream());
    // Round trip of uniform data: the error is uniform within half a step, so ||x̂ - x|| / ||x||
    // is about 1 / levels (a third at 2 bits), plus the bf16 rounding of x̂ (2^-9 relative RMS
    // at most); 10% of slack. Checked, not timed.
    const double err = ctx.rel_err(xhat, x);
    require_close(shape, err, 1.1 / ((1 << bits) - 1) + 0x1p-9);
    const double x_bytes = static_cast<double>(x.nbytes()), packed_bytes = static_cast<double>(packed.nbytes());
    // One input set is 155 MB (bf16 x) + the packed copy: over 4x L2 already.
    if (want_pack) {
      Record r{"quant", "pack/" + shape, "fused", "copy_same_bytes"};
      r.median_us = ctx.time_us([&](int) { pack(x, packed.view(), p, &ctx.fk_stream()); }, 1);
      r.gbps = (x_bytes + packed_bytes) / (r.median_us * 1e3);
      r.rel_err = err;
      ctx.add(r);
      ctx.add(copy_record(ctx, "quant", "pack/" + shape, x_bytes + packed_bytes));
    }
    if (want_unpack) {
      Record r{"quant", "unpack/" + shape, "fused", "copy_same_bytes"};
      r.median_us = ctx.time_us([&](int) { unpack(packed.view(), xhat, &ctx.fk_stream()); }, 1);
      r.gbps = (x_bytes + packed_bytes) / (r.median_us * 1e3);
      r.rel_err = err;
      ctx.add(r);
      ctx.add(copy_record(ctx, "quant", "unpack/" + shape, x_bytes + packed_bytes));
    }
  }
}

void relu_cases(Context& ctx) {
  const std::int64_t rows = 65536, cols = 4096, n = rows * cols;
  const std::string fwd = "relu_fwd_packed/65536x4096_bf16", bwd = "relu_bwd_packed/65536x4096_bf16";
  if (!ctx.selected("quant", fwd) && !ctx.selected("quant", bwd)) return;
  const Tensor x = ctx.random({rows, cols}, DType::bf16), dy = ctx.random({rows, cols}, DType::bf16);
  const Tensor y = ctx.empty({rows, cols}, DType::bf16), dx = ctx.empty({rows, cols}, DType::bf16);
  const Tensor mask = ctx.empty({relu_mask_words(n)}, DType::i32);
  const Tensor y_eager = ctx.empty({rows, cols}, DType::bf16), dx_eager = ctx.empty({rows, cols}, DType::bf16);
  const Tensor bool_mask = ctx.empty({n}, DType::u8);
  auto eager_fwd = [&] {
    eager_relu_kernel<<<grid_for(n), 256, 0, ctx.stream()>>>(x.data_as<T>(), y_eager.data_as<T>(), n);
    eager_gt_zero_kernel<<<grid_for(n), 256, 0, ctx.stream()>>>(x.data_as<T>(), bool_mask.data_as<std::uint8_t>(), n);
    FK_CUDA_CHECK_LAUNCH("eager relu");
  };
  auto eager_bwd = [&] {
    eager_where_kernel<<<grid_for(n), 256, 0, ctx.stream()>>>(dy.data_as<T>(), bool_mask.data_as<std::uint8_t>(),
                                                             dx_eager.data_as<T>(), n);
    FK_CUDA_CHECK_LAUNCH("eager where");
  };
  eager_fwd();
  eager_bwd();
  relu_forward_packed(x, y, mask, &ctx.fk_stream());
  relu_backward_packed(dy, mask, dx, &ctx.fk_stream());
  const double err_f = ctx.rel_err(y, y_eager), err_b = ctx.rel_err(dx, dx_eager);
  require_close(fwd, err_f, 0.0);
  require_close(bwd, err_b, 0.0);
  const double t = static_cast<double>(x.nbytes()), m = static_cast<double>(mask.nbytes());
  if (ctx.selected("quant", fwd)) {
    Record r{"quant", fwd, "fused", "eager_relu+gt_bool"};
    r.median_us = ctx.time_us([&](int) { relu_forward_packed(x, y, mask, &ctx.fk_stream()); }, 1);
    r.gbps = (2 * t + m) / (r.median_us * 1e3);
    Record e{"quant", fwd, "eager_relu+gt_bool", "eager_relu+gt_bool"};
    e.median_us = ctx.time_us([&](int) { eager_fwd(); }, 1);
    e.gbps = (2 * t + m) / (e.median_us * 1e3);
    ctx.add(r);
    ctx.add(e);
  }
  if (ctx.selected("quant", bwd)) {
    Record r{"quant", bwd, "fused", "eager_where_bool"};
    r.median_us = ctx.time_us([&](int) { relu_backward_packed(dy, mask, dx, &ctx.fk_stream()); }, 1);
    r.gbps = (2 * t + m) / (r.median_us * 1e3);
    Record e{"quant", bwd, "eager_where_bool", "eager_where_bool"};
    e.median_us = ctx.time_us([&](int) { eager_bwd(); }, 1);
    e.gbps = (2 * t + m) / (e.median_us * 1e3);
    ctx.add(r);
    ctx.add(e);
  }
}

FK_BENCH_CASE("quant", "pack_unpack", pack_unpack_cases);
FK_BENCH_CASE("quant", "relu_packed", relu_cases);

}  // namespace
}  // namespace fk::bench
