// Broadcast binary ops z = f(x, y) (add, mul, fused relu(x * y)) and their backward (puzzles 1-6).
//
// Forward reads x and y (a broadcast operand mostly from cache) and writes z once. The host folds
// the shapes into at most kMaxRank dimensions, merging neighbours that every operand walks the
// same way, so that plain elementwise is one dimension and an outer op two. A thread handles V
// consecutive elements of z's innermost dimension (16 bytes when that dimension is a multiple of
// V and the pointers allow), so only one index decode (integer divisions) per V elements.
//
// Backward: one thread per element of the gradient (dx over x's shape, dy over y's), summing
// dz * df over the dimensions that operand was broadcast along, in a fixed order (fp32,
// deterministic). Along a non-broadcast innermost dimension neighbouring threads read
// neighbouring addresses.
#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "fusekit/core/cuda_check.hpp"
#include "fusekit/core/tensor.hpp"
#include "ops/common/cuda_common.cuh"
#include "primitives_cuda.hpp"
#include "ops/common/activations.cuh"

namespace fk::cuda {
namespace {

using device::load_vec;
using device::store_vec;
using device::Vec;

// z's dimensions after folding, innermost last; xs / ys: the operands' element strides (0 where
// broadcast), zs: z's (row-major).
struct Layout {
  int rank;
  std::int64_t size[kMaxRank];
  std::int64_t xs[kMaxRank], ys[kMaxRank], zs[kMaxRank];
};

template <BinaryOp OP>
__device__ __forceinline__ float apply(float a, float b) {
  if constexpr (OP == BinaryOp::add) return a + b;
  if constexpr (OP == BinaryOp::mul) return a * b;
  if constexpr (OP == BinaryOp::mul_relu) {
    const float p = a * b;
    return (p > 0.0f || p != p) ? p : 0.0f;  // NaN propagates
  }
}

// d f / d a * g, where b is the other operand (every op here is symmetric in its operands).
template <BinaryOp OP>
__device__ __forceinline__ float grad(float g, float a, float b) {
  if constexpr (OP == BinaryOp::add) return g;
  if constexpr (OP == BinaryOp::mul) return g * b;
  if constexpr (OP == BinaryOp::mul_relu) return a * b > 0.0f ? g * b : 0.0f;
}

template <class T, int V, BinaryOp OP>
__global__ void broadcast_binary_kernel(const T* x, const T* y, T* z, Layout l, std::int64_t vectors) {
  const int inner = l.rank - 1;
  for (std::int64_t v = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < vectors;
       v += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    std::int64_t rem = v * V, xo = 0, yo = 0;
    for (int d = inner; d >= 0; --d) {
      const std::int64_t i = rem % l.size[d];
      rem /= l.size[d];
      xo += i * l.xs[d];
      yo += i * l.ys[d];
    }
    Vec<T, V> a, b, o;
    if (l.xs[inner] != 0) a = load_vec<T, V>(x + xo);
    else for (int j = 0; j < V; ++j) a.v[j] = load_vec<T, 1>(x + xo).v[0];
    if (l.ys[inner] != 0) b = load_vec<T, V>(y + yo);
    else for (int j = 0; j < V; ++j) b.v[j] = load_vec<T, 1>(y + yo).v[0];
    for (int j = 0; j < V; ++j) o.set(j, apply<OP>(a.get(j), b.get(j)));
    store_vec<T, V>(z + v * V, o);
  }
}

// da[i] = sum over the broadcast dimensions of a of grad(dz, a, b). as / bs: strides of the
// operand whose gradient this is and of the other one.
template <class T, BinaryOp OP>
__global__ void broadcast_grad_kernel(const T* a, const T* b, const T* dz, T* da, Layout l, std::int64_t count,
                                      bool a_is_x) {
  const std::int64_t* as = a_is_x ? l.xs : l.ys;
  const std::int64_t* bs = a_is_x ? l.ys : l.xs;
  for (std::int64_t e = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < count;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    // Decode e over a's own (non-broadcast) dimensions.
    std::int64_t rem = e, zo = 0, bo = 0;
    for (int d = l.rank - 1; d >= 0; --d) {
      if (as[d] == 0) continue;
      const std::int64_t i = rem % l.size[d];
      rem /= l.size[d];
      zo += i * l.zs[d];
      bo += i * bs[d];
    }
    const float av = device::to_float(a[e]);
    // Walk a's broadcast dimensions with an odometer (no divisions).
    std::int64_t idx[kMaxRank] = {};
    float acc = 0.0f;
    for (;;) {
      acc += grad<OP>(device::to_float(dz[zo]), av, device::to_float(b[bo]));
      int d = l.rank - 1;
      for (; d >= 0; --d) {
        if (as[d] != 0) continue;
        if (++idx[d] < l.size[d]) {
          zo += l.zs[d];
          bo += bs[d];
          break;
        }
        zo -= (l.size[d] - 1) * l.zs[d];
        bo -= (l.size[d] - 1) * bs[d];
        idx[d] = 0;
      }
      if (d < 0) break;
    }
    da[e] = device::from_float<T>(acc);
  }
}

// Folds z's shape and the operands' broadcast strides: drops size-1 dimensions, then merges a
// dimension into the next inner one when every operand's stride allows.
Layout make_layout(const TensorView& x, const TensorView& y, const TensorView& z) {
  const int rank = z.rank();
  std::int64_t size[kMaxRank], xs[kMaxRank], ys[kMaxRank];
  auto strides = [&](const TensorView& t, std::int64_t* out) {
    const Dims own = contiguous_strides(t.shape());
    for (int d = 0; d < rank; ++d) {
      const int td = d - (rank - t.rank());
      out[d] = (td >= 0 && t.size(td) != 1) ? own[td] : 0;
    }
  };
  strides(x, xs);
  strides(y, ys);
  for (int d = 0; d < rank; ++d) size[d] = z.size(d);
  Layout l{};
  for (int d = 0; d < rank; ++d) {
    if (size[d] == 1) continue;
    if (l.rank > 0) {
      const int p = l.rank - 1;  // merge d into p when p's strides continue d's
      if (l.xs[p] == xs[d] * size[d] && l.ys[p] == ys[d] * size[d]) {
        l.size[p] *= size[d];
        l.xs[p] = xs[d];
        l.ys[p] = ys[d];
        continue;
      }
    }
    l.size[l.rank] = size[d];
    l.xs[l.rank] = xs[d];
    l.ys[l.rank] = ys[d];
    ++l.rank;
  }
  if (l.rank == 0) {  // a single element
    l.rank = 1;
    l.size[0] = 1;
    l.xs[0] = l.ys[0] = 1;
  }
  std::int64_t stride = 1;
  for (int d = l.rank - 1; d >= 0; --d) {
    l.zs[d] = stride;
    stride *= l.size[d];
  }
  return l;
}


unsigned grid_for(std::int64_t items, int threads) {
  const std::int64_t cap = static_cast<std::int64_t>(multiprocessor_count()) * 16;
  return static_cast<unsigned>(std::max<std::int64_t>(1, std::min((items + threads - 1) / threads, cap)));
}

template <class T, BinaryOp OP>
void launch_forward(const TensorView& x, const TensorView& y, const TensorView& z, cudaStream_t s) {
  const Layout l = make_layout(x, y, z);
  constexpr int kVec = 16 / sizeof(T);
  const bool vectorized = l.size[l.rank - 1] % kVec == 0 && aligned16(x.data()) && aligned16(y.data()) &&
                          aligned16(z.data());
  const std::int64_t n = z.numel();
  if (vectorized) {
    broadcast_binary_kernel<T, kVec, OP><<<grid_for(n / kVec, 256), 256, 0, s>>>(x.data_as<T>(), y.data_as<T>(),
                                                                               z.data_as<T>(), l, n / kVec);
  } else {
    broadcast_binary_kernel<T, 1, OP><<<grid_for(n, 256), 256, 0, s>>>(x.data_as<T>(), y.data_as<T>(), z.data_as<T>(),
                                                                       l, n);
  }
  FK_CUDA_CHECK_LAUNCH("broadcast_binary_kernel");
}

template <class F>
void with_op(BinaryOp op, F&& f) {
  switch (op) {
    case BinaryOp::add: return f(std::integral_constant<BinaryOp, BinaryOp::add>{});
    case BinaryOp::mul: return f(std::integral_constant<BinaryOp, BinaryOp::mul>{});
    case BinaryOp::mul_relu: return f(std::integral_constant<BinaryOp, BinaryOp::mul_relu>{});
  }
}

}  // namespace

void broadcast_binary(BinaryOp op, const TensorView& x, const TensorView& y, const TensorView& z, const Stream* stream) {
  detail::DeviceScope on_device(x.device().index);
  const cudaStream_t s = detail::cuda_stream(stream);
  with_float_type(x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    with_op(op, [&](auto o) { launch_forward<T, decltype(o)::value>(x, y, z, s); });
  });
}

void broadcast_binary_backward(BinaryOp op, const TensorView& x, const TensorView& y, const TensorView& dz,
                               const std::optional<TensorView>& dx, const std::optional<TensorView>& dy,
                               const Stream* stream) {
  detail::DeviceScope on_device(x.device().index);
  const cudaStream_t s = detail::cuda_stream(stream);
  if (dz.numel() == 0) {  // every gradient is a sum over nothing; zero bits are 0.0 in each dtype
    if (dx) FK_CUDA_CHECK(cudaMemsetAsync(dx->data(), 0, dx->nbytes(), s));
    if (dy) FK_CUDA_CHECK(cudaMemsetAsync(dy->data(), 0, dy->nbytes(), s));
    return;
  }
  const Layout l = make_layout(x, y, dz);
  with_float_type(x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    with_op(op, [&](auto o) {
      constexpr BinaryOp kOp = decltype(o)::value;
      if (dx && dx->numel() > 0) {
        broadcast_grad_kernel<T, kOp><<<grid_for(x.numel(), 256), 256, 0, s>>>(
            x.data_as<T>(), y.data_as<T>(), dz.data_as<T>(), dx->data_as<T>(), l, x.numel(), true);
        FK_CUDA_CHECK_LAUNCH("broadcast_grad_kernel");
      }
      if (dy && dy->numel() > 0) {
        broadcast_grad_kernel<T, kOp><<<grid_for(y.numel(), 256), 256, 0, s>>>(
            y.data_as<T>(), x.data_as<T>(), dz.data_as<T>(), dy->data_as<T>(), l, y.numel(), false);
        FK_CUDA_CHECK_LAUNCH("broadcast_grad_kernel");
      }
    });
  });
}

}  // namespace fk::cuda
