// Fused bias + scaled residual + activation, forward and backward (see ops/pointwise.hpp).
//
// Forward reads x, r and b once and writes y (and z when asked) once: the floor is those bytes
// over HBM bandwidth. Backward reads dy and the saved tensor once, writes dx (and dr) once, and
// reduces db without a second pass over dx: each thread keeps fp32 column sums of the rows it
// visits, a block folds its rows through shared memory, and a second small kernel adds the
// per-block partials in a fixed order, so db is the same bits on every run of a given grid.
//
// Every [rows, cols] tensor has unit inner stride and its own row stride (ld). Mapping: a block
// of 256 threads covers `tpr` consecutive column vectors (16 bytes each when cols, every row
// stride and every pointer allow it, else single elements) times 256/tpr rows, and walks down the
// rows with a grid-sized stride, kUnroll rows at a time so that several loads are in flight
// before the first use. The bias vector of a thread's columns is loaded once. No integer
// division per element.
#include <algorithm>
#include <cstdint>

#include "fusekit/core/cuda_check.hpp"
#include "fusekit/core/tensor.hpp"
#include "ops/common/activations.cuh"
#include "ops/common/cuda_common.cuh"
#include "pointwise_cuda.hpp"

namespace fk::cuda {
namespace {

using device::load_vec;
using device::store_vec;
using device::Vec;

constexpr int kThreads = 256;
// Rows a thread loads before it computes: 4 rows of 16 bytes per tensor in flight for f32 and
// the scalar path, 2 for the 16-bit types, whose 8-wide vectors and their fp32 values would
// otherwise not fit the register budget (3 blocks of 256 per SM) without spilling.
template <int VEC>
inline constexpr int kUnroll = VEC == 8 ? 2 : 4;

struct ForwardParams {
  const void* x;  // [rows, cols], row stride ld_x
  const void* r;  // [rows, cols], row stride ld_r, or null
  const void* b;  // [cols] or null
  void* y;        // [rows, cols], row stride ld_y
  void* z;        // [rows, cols], row stride ld_z, or null
  std::int64_t rows, cols;
  std::int64_t ld_x, ld_r, ld_y, ld_z;
  float alpha;
  int tpr_log2;   // log2 of the threads per row
};

struct BackwardParams {
  const void* dy;     // [rows, cols], row stride ld_dy
  const void* saved;  // [rows, cols], row stride ld_saved: y or z
  void* dx;           // [rows, cols], row stride ld_dx
  void* dr;           // [rows, cols], row stride ld_dr, or null
  float* partial;     // [gridDim.y, cols] per-block column sums, or null when db is not wanted
  std::int64_t rows, cols;
  std::int64_t ld_dy, ld_saved, ld_dx, ld_dr;
  float alpha;
  int tpr_log2;
};

// kRows: the tensors have row strides of their own; otherwise every row stride is cols (one
// product per row for all tensors: the contiguous case keeps the index arithmetic it had).
template <class T, int VEC, Activation A, bool kRows>
__global__ void __launch_bounds__(kThreads, 3) bias_act_forward_kernel(ForwardParams p) {
  const std::int64_t ld_x = kRows ? p.ld_x : p.cols, ld_r = kRows ? p.ld_r : p.cols;
  const std::int64_t ld_y = kRows ? p.ld_y : p.cols, ld_z = kRows ? p.ld_z : p.cols;
  const int tx = threadIdx.x & ((1 << p.tpr_log2) - 1);
  const int ty = threadIdx.x >> p.tpr_log2;
  const int rows_per_iter = kThreads >> p.tpr_log2;
  const std::int64_t col = (static_cast<std::int64_t>(blockIdx.x) << p.tpr_log2 | tx) * VEC;
  if (col >= p.cols) return;

  const T* x = static_cast<const T*>(p.x);
  const T* r = static_cast<const T*>(p.r);
  T* y = static_cast<T*>(p.y);
  T* z = static_cast<T*>(p.z);
  float bias[VEC];
  if (p.b) {
    const Vec<T, VEC> bv = load_vec<T, VEC>(static_cast<const T*>(p.b) + col);
#pragma unroll
    for (int j = 0; j < VEC; ++j) bias[j] = bv.get(j);
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) bias[j] = 0.0f;
  }

  const std::int64_t stride = static_cast<std::int64_t>(gridDim.y) * rows_per_iter;
  for (std::int64_t row0 = static_cast<std::int64_t>(blockIdx.y) * rows_per_iter + ty; row0 < p.rows;
       row0 += stride * kUnroll<VEC>) {
    Vec<T, VEC> xv[kUnroll<VEC>], rv[kUnroll<VEC>];
#pragma unroll
    for (int u = 0; u < kUnroll<VEC>; ++u) {
      const std::int64_t row = row0 + u * stride;
      if (row < p.rows) {
        xv[u] = load_vec<T, VEC>(x + row * ld_x + col);
        if (r) rv[u] = load_vec<T, VEC>(r + row * ld_r + col);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll<VEC>; ++u) {
      const std::int64_t row = row0 + u * stride;
      if (row < p.rows) {
        Vec<T, VEC> yv, zv;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          float v = xv[u].get(j);
          if (r) v = fmaf(p.alpha, rv[u].get(j), v);
          v += bias[j];
          zv.set(j, v);
          yv.set(j, device::activation<A>(v));
        }
        store_vec<T, VEC>(y + row * ld_y + col, yv);
        if (z) store_vec<T, VEC>(z + row * ld_z + col, zv);
      }
    }
  }
}

template <class T, int VEC, Activation A, bool kFromOutput, bool kRows>
__global__ void __launch_bounds__(kThreads, 3) bias_act_backward_kernel(BackwardParams p) {
  const std::int64_t ld_dy = kRows ? p.ld_dy : p.cols, ld_saved = kRows ? p.ld_saved : p.cols;
  const std::int64_t ld_dx = kRows ? p.ld_dx : p.cols, ld_dr = kRows ? p.ld_dr : p.cols;
  __shared__ float fold[kThreads * VEC];  // [rows_per_iter][tpr * VEC] column sums of each row group
  const int tx = threadIdx.x & ((1 << p.tpr_log2) - 1);
  const int ty = threadIdx.x >> p.tpr_log2;
  const int rows_per_iter = kThreads >> p.tpr_log2;
  const std::int64_t col = (static_cast<std::int64_t>(blockIdx.x) << p.tpr_log2 | tx) * VEC;
  const bool active = col < p.cols;

  const T* dy = static_cast<const T*>(p.dy);
  const T* saved = static_cast<const T*>(p.saved);
  T* dx = static_cast<T*>(p.dx);
  T* dr = static_cast<T*>(p.dr);
  float acc[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) acc[j] = 0.0f;

  const std::int64_t stride = static_cast<std::int64_t>(gridDim.y) * rows_per_iter;
  for (std::int64_t row0 = static_cast<std::int64_t>(blockIdx.y) * rows_per_iter + ty; active && row0 < p.rows;
       row0 += stride * kUnroll<VEC>) {
    Vec<T, VEC> gv[kUnroll<VEC>], sv[kUnroll<VEC>];
#pragma unroll
    for (int u = 0; u < kUnroll<VEC>; ++u) {
      const std::int64_t row = row0 + u * stride;
      if (row < p.rows) {
        gv[u] = load_vec<T, VEC>(dy + row * ld_dy + col);
        sv[u] = load_vec<T, VEC>(saved + row * ld_saved + col);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll<VEC>; ++u) {
      const std::int64_t row = row0 + u * stride;
      if (row < p.rows) {
        Vec<T, VEC> dxv, drv;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float s = sv[u].get(j);
          const float g = kFromOutput ? device::activation_grad_from_output<A>(s) : device::activation_grad<A>(s);
          const float dz = gv[u].get(j) * g;
          acc[j] += dz;
          dxv.set(j, dz);
          drv.set(j, p.alpha * dz);
        }
        store_vec<T, VEC>(dx + row * ld_dx + col, dxv);
        if (dr) store_vec<T, VEC>(dr + row * ld_dr + col, drv);
      }
    }
  }

  if (!p.partial) return;
  float* out = p.partial + static_cast<std::int64_t>(blockIdx.y) * p.cols;
  if (rows_per_iter == 1) {
    if (active)
#pragma unroll
      for (int j = 0; j < VEC; ++j) out[col + j] = acc[j];
    return;
  }
  const int width = (1 << p.tpr_log2) * VEC;
#pragma unroll
  for (int j = 0; j < VEC; ++j) fold[ty * width + tx * VEC + j] = acc[j];
  __syncthreads();
  if (ty == 0 && active) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      float s = 0.0f;
      for (int t = 0; t < rows_per_iter; ++t) s += fold[t * width + tx * VEC + j];
      out[col + j] = s;
    }
  }
}

// db[c] = sum over the partial rows, in row order. Block (32, 8): 32 columns, 8 row groups that
// stride over the partial rows, folded in shared memory in a fixed order.
template <class TOut>
__global__ void __launch_bounds__(256) sum_partials_kernel(const float* __restrict__ partial, int parts,
                                                           std::int64_t cols, TOut* __restrict__ db) {
  __shared__ float fold[8][33];
  const std::int64_t col = static_cast<std::int64_t>(blockIdx.x) * 32 + threadIdx.x;
  float s = 0.0f;
  if (col < cols)
    for (int i = threadIdx.y; i < parts; i += 8) s += partial[i * cols + col];
  fold[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    float t = 0.0f;
#pragma unroll
    for (int g = 0; g < 8; ++g) t += fold[g][threadIdx.x];
    db[col] = device::from_float<TOut>(t);
  }
}

// Blocks of kThreads that one SM holds at once for `Kernel` (asked once per kernel).
template <auto Kernel>
int resident_blocks() {
  static const int n = [] {
    int b = 0;
    FK_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, Kernel, kThreads, 0));
    return std::max(b, 1);
  }();
  return n;
}

struct Launch {
  dim3 grid;
  int tpr_log2;
};

// Threads per row: the smallest power of two covering the row's vectors, at most a block.
// Rows are spread over exactly as many blocks as the GPU holds at once (one wave, no tail).
Launch plan(std::int64_t rows, std::int64_t cols, int vec, int blocks_per_sm) {
  const std::int64_t col_vecs = cols / vec;
  int tpr_log2 = 0;
  while ((1 << tpr_log2) < col_vecs && (1 << tpr_log2) < kThreads) ++tpr_log2;
  const int rows_per_iter = kThreads >> tpr_log2;
  const std::int64_t gx = (col_vecs + (1 << tpr_log2) - 1) >> tpr_log2;
  const std::int64_t wave = static_cast<std::int64_t>(multiprocessor_count()) * blocks_per_sm;
  const std::int64_t want = std::max<std::int64_t>(1, wave / gx);
  const std::int64_t gy = std::clamp<std::int64_t>((rows + rows_per_iter - 1) / rows_per_iter, 1,
                                                   std::min<std::int64_t>(want, 65535));
  FK_CHECK_ARG(gx <= 0x7fffffff, "bias_act", "x", "at most 2^31 column vectors", std::to_string(gx));
  return {dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy)), tpr_log2};
}

// The row stride of a [rows, cols] operand; a single row's (never used) is taken as cols, and an
// absent operand's as 0, so that neither keeps the vector path from being taken.
std::int64_t row_stride(const TensorView& t) { return t.size(0) <= 1 ? t.size(1) : t.strides()[0]; }
std::int64_t row_stride(const std::optional<TensorView>& t) { return t ? row_stride(*t) : 0; }

template <class T>
constexpr int vec16() { return 16 / static_cast<int>(sizeof(T)); }

template <template <Activation> class K, class... Args>
void with_activation(Activation a, Args&&... args) {
  switch (a) {
    case Activation::identity: return K<Activation::identity>::run(args...);
    case Activation::relu: return K<Activation::relu>::run(args...);
    case Activation::sigmoid: return K<Activation::sigmoid>::run(args...);
    case Activation::tanh: return K<Activation::tanh>::run(args...);
    case Activation::gelu_tanh: return K<Activation::gelu_tanh>::run(args...);
    case Activation::gelu_erf: return K<Activation::gelu_erf>::run(args...);
    case Activation::silu: return K<Activation::silu>::run(args...);
  }
}

template <class T, int VEC, Activation A, bool kRows>
void launch_forward(ForwardParams p, cudaStream_t s) {
  constexpr auto kernel = bias_act_forward_kernel<T, VEC, A, kRows>;
  const Launch l = plan(p.rows, p.cols, VEC, resident_blocks<kernel>());
  p.tpr_log2 = l.tpr_log2;
  kernel<<<l.grid, kThreads, 0, s>>>(p);
  FK_CUDA_CHECK_LAUNCH("bias_act_forward_kernel");
}

template <Activation A>
struct ForwardLauncher {
  template <class T>
  static void run(T, const ForwardParams& p, bool vectorized, bool rows, cudaStream_t s) {
    if (rows) {
      if (vectorized) launch_forward<T, vec16<T>(), A, true>(p, s);
      else launch_forward<T, 1, A, true>(p, s);
    } else {
      if (vectorized) launch_forward<T, vec16<T>(), A, false>(p, s);
      else launch_forward<T, 1, A, false>(p, s);
    }
  }
};

// The backward kernel, then (when db is wanted) the fold of its per-block partial sums.
template <class T, int VEC, Activation A, bool kFromOutput, bool kRows>
void launch_backward(BackwardParams p, const BiasActBackwardArgs& a, const Stream* stream) {
  constexpr auto kernel = bias_act_backward_kernel<T, VEC, A, kFromOutput, kRows>;
  const Launch l = plan(p.rows, p.cols, VEC, resident_blocks<kernel>());
  p.tpr_log2 = l.tpr_log2;
  const cudaStream_t s = detail::cuda_stream(stream);
  Tensor partial;  // [grid.y, cols]; freed into the stream-ordered cache once both kernels are queued
  if (a.dbias) {
    partial = Tensor::empty({static_cast<std::int64_t>(l.grid.y), p.cols}, DType::f32, a.dy.device(), stream);
    p.partial = partial.data_as<float>();
  }
  kernel<<<l.grid, kThreads, 0, s>>>(p);
  FK_CUDA_CHECK_LAUNCH("bias_act_backward_kernel");
  if (!a.dbias) return;
  const dim3 grid(static_cast<unsigned>((p.cols + 31) / 32)), block(32, 8);
  const int parts = static_cast<int>(l.grid.y);
  if (a.dbias->dtype() == DType::f32) {
    sum_partials_kernel<<<grid, block, 0, s>>>(p.partial, parts, p.cols, a.dbias->data_as<float>());
  } else {
    sum_partials_kernel<<<grid, block, 0, s>>>(p.partial, parts, p.cols, a.dbias->data_as<T>());
  }
  FK_CUDA_CHECK_LAUNCH("sum_partials_kernel");
}

template <Activation A>
struct BackwardLauncher {
  template <class T>
  static void run(T, const BackwardParams& p, bool vectorized, bool from_output, bool rows,
                  const BiasActBackwardArgs& a, const Stream* stream) {
    if (rows) pick<T, true>(p, vectorized, from_output, a, stream);
    else pick<T, false>(p, vectorized, from_output, a, stream);
  }
  template <class T, bool kRows>
  static void pick(const BackwardParams& p, bool vectorized, bool from_output, const BiasActBackwardArgs& a,
                   const Stream* stream) {
    // Activations whose derivative needs z never take the from-output path (checked by dispatch).
    constexpr bool kCanUseOutput = A == Activation::identity || A == Activation::relu ||
                                   A == Activation::sigmoid || A == Activation::tanh;
    if constexpr (kCanUseOutput) {
      if (from_output) {
        if (vectorized) launch_backward<T, vec16<T>(), A, true, kRows>(p, a, stream);
        else launch_backward<T, 1, A, true, kRows>(p, a, stream);
        return;
      }
    }
    if (vectorized) launch_backward<T, vec16<T>(), A, false, kRows>(p, a, stream);
    else launch_backward<T, 1, A, false, kRows>(p, a, stream);
  }
};

}  // namespace

void bias_act_forward(const BiasActForwardArgs& a, const BiasActParams& prm, const Stream* stream) {
  const ForwardParams p{a.x.data(),
                        a.r ? a.r->data() : nullptr,
                        a.bias ? a.bias->data() : nullptr,
                        a.y.data(),
                        a.preact ? a.preact->data() : nullptr,
                        a.x.size(0),
                        a.x.size(1),
                        row_stride(a.x),
                        row_stride(a.r),
                        row_stride(a.y),
                        row_stride(a.preact),
                        prm.alpha,
                        0};
  const int vec = 16 / static_cast<int>(dtype_size(a.x.dtype()));
  const bool vectorized = p.cols % vec == 0 && p.ld_x % vec == 0 && p.ld_r % vec == 0 && p.ld_y % vec == 0 &&
                          p.ld_z % vec == 0 && aligned16(p.x) && aligned16(p.r) && aligned16(p.b) && aligned16(p.y) &&
                          aligned16(p.z);
  // Rows of their own stride, or every row stride the column count (absent operands: 0).
  const auto own = [&](std::int64_t ld) { return ld != 0 && ld != p.cols; };
  const bool rows = own(p.ld_x) || own(p.ld_r) || own(p.ld_y) || own(p.ld_z);
  const cudaStream_t s = detail::cuda_stream(stream);
  with_float_type(a.x.dtype(), [&](auto t) { with_activation<ForwardLauncher>(prm.act, t, p, vectorized, rows, s); });
}

void bias_act_backward(const BiasActBackwardArgs& a, const BiasActParams& prm, const Stream* stream) {
  const BackwardParams p{a.dy.data(),
                         a.saved.data(),
                         a.dx.data(),
                         a.dr ? a.dr->data() : nullptr,
                         nullptr,
                         a.dy.size(0),
                         a.dy.size(1),
                         row_stride(a.dy),
                         row_stride(a.saved),
                         row_stride(a.dx),
                         row_stride(a.dr),
                         prm.alpha,
                         0};
  const int vec = 16 / static_cast<int>(dtype_size(a.dy.dtype()));
  const bool vectorized = p.cols % vec == 0 && p.ld_dy % vec == 0 && p.ld_saved % vec == 0 && p.ld_dx % vec == 0 &&
                          p.ld_dr % vec == 0 && aligned16(p.dy) && aligned16(p.saved) && aligned16(p.dx) &&
                          aligned16(p.dr);
  const bool from_output = a.saved_kind == SavedForBackward::output;
  const auto own = [&](std::int64_t ld) { return ld != 0 && ld != p.cols; };
  const bool rows = own(p.ld_dy) || own(p.ld_saved) || own(p.ld_dx) || own(p.ld_dr);
  with_float_type(a.dy.dtype(), [&](auto t) {
    with_activation<BackwardLauncher>(prm.act, t, p, vectorized, from_output, rows, a, stream);
  });
}

}  // namespace fk::cuda
