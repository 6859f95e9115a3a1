// The first pass of the fused LoRA backward: one read of dy and of the saved y or z, producing
//   g  = dy ⊙ act'(z)          [M, N], in the operand dtype (the dx GEMM's left operand)
//   su = s g B                 [M, 16]  (r <= 16, zero-padded to 16 columns)
//   dB = gᵀ t                  [N, r]
//   db = Σ_m g                 [N]     (when asked)
// so that no later kernel reads g except the dx GEMM. The two skinny products run on the tensor
// cores (mma.sync m16n8k16, fp32 accumulation) on the g values each thread already holds:
//
// Layout. A CTA of 8 warps owns a strip of 256 columns and a range of rows, walked in slabs of
// 16. Warp w owns columns [32 w, 32 w + 32) of the strip; lane (gq = lane / 4, q = lane % 4)
// loads 16 bytes (8 columns 8q .. 8q + 7) of rows gq and gq + 8 of each slab: full 32-byte
// sectors, one load instruction per row and tensor.
//  - g B: the contraction over columns may run in any order, so the thread's 8 columns serve
//    as the k indices (2q, 2q + 1, 2q + 8, 2q + 9) of two mma k16 steps: its g registers are the
//    A fragments as loaded. The B fragments (rows of B for the warp's 32 columns) are loaded once.
//    The [16, r] partial sums of the 8 warps are added in shared memory and written per strip.
//  - gᵀ t, as dBᵀ = tᵀ g: the contraction is over rows, so each 32-bit word of g (2 columns of
//    one row) is transposed within its 8 x 8 block by movmatrix into the B fragment layout
//    (2 rows of one column); the A fragment is tᵀ, read from t. Each thread accumulates dB for
//    its columns over all the slabs of its row range: no atomics.
// Strip partials of su and row-range partials of dB and db go to an fp32 workspace; a second,
// small kernel sums them in a fixed order (deterministic), scales, and rounds to the dtype.
//
// Needs N % 8 == 0 and 16-byte aligned dy, saved and g (whole 16-byte chunks per lane).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "fusekit/core/cuda_check.hpp"
#include "fusekit/core/error.hpp"
#include "fusekit/core/tensor.hpp"
#include "lora_cuda.hpp"
#include "ops/common/cuda_common.cuh"
#include "ops/common/activations.cuh"

namespace fk::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kStripCols = 32 * kWarps;

template <class T>
struct GradParams {
  const T* dy;         // [M, N]
  const T* saved;      // [M, N]: y or z
  const T* b;          // [N, r]
  const T* t;          // [M, r]
  T* g;                // [M, N]
  float* part_u;       // [strips, M, RB]
  float* part_db;      // [groups, N, RB]
  float* part_dbias;   // [groups, N]
  std::int64_t m, n;
  int r;
  int rows_per_group;  // a multiple of 16
  Activation act;
  bool from_output;
};

__device__ __forceinline__ float grad_of(Activation act, bool from_output, float s) {
  using namespace fk::device;
  if (from_output) {
    switch (act) {
      case Activation::identity: return 1.0f;
      case Activation::relu: return activation_grad_from_output<Activation::relu>(s);
      case Activation::sigmoid: return activation_grad_from_output<Activation::sigmoid>(s);
      case Activation::tanh: return activation_grad_from_output<Activation::tanh>(s);
      default: return 0.0f;  // rejected by the dispatch
    }
  }
  switch (act) {
    case Activation::identity: return 1.0f;
    case Activation::relu: return activation_grad<Activation::relu>(s);
    case Activation::sigmoid: return activation_grad<Activation::sigmoid>(s);
    case Activation::tanh: return activation_grad<Activation::tanh>(s);
    case Activation::gelu_tanh: return activation_grad<Activation::gelu_tanh>(s);
    case Activation::gelu_erf: return activation_grad<Activation::gelu_erf>(s);
    case Activation::silu: return activation_grad<Activation::silu>(s);
  }
  return 0.0f;
}

template <class T>
__device__ __forceinline__ uint32_t raw(const T* p, std::int64_t i, bool ok) {
  return ok ? static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) : 0u;
}

template <class T>
__device__ __forceinline__ float lo_f(uint32_t w) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __uint_as_float(w << 16);
  else return __half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xffffu)));
}
template <class T>
__device__ __forceinline__ float hi_f(uint32_t w) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __uint_as_float(w & 0xffff0000u);
  else return __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16)));
}
template <class T>
__device__ __forceinline__ uint32_t pack(float a, float b) {  // a in the low half
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    return reinterpret_cast<const uint32_t&>(v);
  } else {
    const __half2 v = __floats2half2_rn(a, b);
    return reinterpret_cast<const uint32_t&>(v);
  }
}

template <class T>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

__device__ __forceinline__ uint32_t transpose8x8(uint32_t v) {
  uint32_t out;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(out) : "r"(v));
  return out;
}

// RB: r rounded up to a multiple of 16. Up to RB = 16 the loads run two slabs ahead within 128
// registers a thread (2 CTAs an SM); wider ranks hold more fragments and run one slab ahead.
template <int RB> constexpr int kAhead = RB <= 16 ? 2 : 1;
// kRelu: act' is the ReLU's (1 where the saved y or z is positive: the same test for both), inlined;
// otherwise the runtime switch of grad_of per element.
template <class T, int RB, bool kRelu>
__global__ void __launch_bounds__(kThreads, kAhead<RB> == 2 ? 2 : 1) lora_grad_pass(const GradParams<T> p) {
  constexpr int kJ8 = RB / 8, kJ16 = RB / 16;
  // The 8 warps' [16, RB] partials of one slab; two buffers (slab parity) where they fit the 48 KB
  // of static shared memory, so that one barrier a slab suffices.
  constexpr int kUBufs = RB <= 32 ? 2 : 1;
  __shared__ float u_sum_buf[kUBufs][kWarps][16][RB];

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gq = lane / 4, q = lane % 4;
  const std::int64_t col = static_cast<std::int64_t>(blockIdx.x) * kStripCols + warp * 32 + 8 * q;
  const bool col_ok = col < p.n;  // N % 8 == 0: the lane's 8 columns are all in or all out
  const int r = p.r;

  // B fragments of g B for the warp's columns: step h covers columns 8q + 4h .. 8q + 4h + 3 as
  // k = 2q, 2q + 1, 2q + 8, 2q + 9; n-block jb is j = 8 jb .. 8 jb + 7, this lane feeding j = 8 jb + gq.
  uint32_t bfrag[kJ8][2][2];
#pragma unroll
  for (int jb = 0; jb < kJ8; ++jb) {
    const int j = 8 * jb + gq;
    const bool ok = col_ok && j < r;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const std::int64_t c0 = col + 4 * h;
      bfrag[jb][h][0] = raw(p.b, c0 * r + j, ok) | raw(p.b, (c0 + 1) * r + j, ok) << 16;
      bfrag[jb][h][1] = raw(p.b, (c0 + 2) * r + j, ok) | raw(p.b, (c0 + 3) * r + j, ok) << 16;
    }
  }

  float db_acc[kJ16][4][4] = {};  // dBᵀ fragments: [j block][word p][C fragment]
  float dbias_acc[8] = {};
  const std::int64_t row_begin = static_cast<std::int64_t>(blockIdx.y) * p.rows_per_group;
  const std::int64_t row_end = std::min<std::int64_t>(p.m, row_begin + p.rows_per_group);
  // dy and saved of rows gq and gq + 8 of a slab; the next kAhead slabs' are loaded before the
  // current one is worked on (the pass is bound by memory latency: 2 CTAs of 8 warps an SM,
  // limited by registers).
  // With the slab's rows of t as the A fragments of tᵀ g (below): loaded with the slab, so that
  // their L2 round trip is not on the slab's critical path either.
  struct Slab {
    uint4 dya, dyb, sa, sb;
    uint32_t tf[kJ16][4];
  };
  auto load_slab = [&](std::int64_t row0) {
    const std::int64_t ra = row0 + gq, rb = ra + 8;
    Slab v{make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0), {}};
    if (col_ok && ra < p.m) {
      v.dya = __ldg(reinterpret_cast<const uint4*>(p.dy + ra * p.n + col));
      v.sa = __ldg(reinterpret_cast<const uint4*>(p.saved + ra * p.n + col));
    }
    if (col_ok && rb < p.m) {
      v.dyb = __ldg(reinterpret_cast<const uint4*>(p.dy + rb * p.n + col));
      v.sb = __ldg(reinterpret_cast<const uint4*>(p.saved + rb * p.n + col));
    }
    // tᵀ fragments: rows row0 + 2q, + 1, + 8, + 9 (the k of the mma), j = 16 jb + gq and + 8.
#pragma unroll
    for (int jb = 0; jb < kJ16; ++jb) {
      const int j0 = 16 * jb + gq, j1 = j0 + 8;
      const std::int64_t r0 = row0 + 2 * q, r8 = r0 + 8;
      const bool r0ok = r0 < p.m, r1ok = r0 + 1 < p.m, r8ok = r8 < p.m, r9ok = r8 + 1 < p.m;
      v.tf[jb][0] = raw(p.t, r0 * r + j0, r0ok && j0 < r) | raw(p.t, (r0 + 1) * r + j0, r1ok && j0 < r) << 16;
      v.tf[jb][1] = raw(p.t, r0 * r + j1, r0ok && j1 < r) | raw(p.t, (r0 + 1) * r + j1, r1ok && j1 < r) << 16;
      v.tf[jb][2] = raw(p.t, r8 * r + j0, r8ok && j0 < r) | raw(p.t, (r8 + 1) * r + j0, r9ok && j0 < r) << 16;
      v.tf[jb][3] = raw(p.t, r8 * r + j1, r8ok && j1 < r) | raw(p.t, (r8 + 1) * r + j1, r9ok && j1 < r) << 16;
    }
    return v;
  };
  Slab next = load_slab(row_begin), after{};
  if constexpr (kAhead<RB> == 2) after = load_slab(row_begin + 16);
  for (std::int64_t row0 = row_begin; row0 < row_end; row0 += 16) {
    float (&u_sum)[kWarps][16][RB] = u_sum_buf[kUBufs == 2 ? (row0 - row_begin) / 16 % 2 : 0];
    const Slab cur = next;
    if constexpr (kAhead<RB> == 2) {
      next = after;
      if (row0 + 32 < row_end) after = load_slab(row0 + 32);
    } else {
      if (row0 + 16 < row_end) next = load_slab(row0 + 16);
    }
    const uint4 dya = cur.dya, dyb = cur.dyb, sa = cur.sa, sb = cur.sb;
    const std::int64_t ra = row0 + gq, rb = ra + 8;
    const bool ok_a = col_ok && ra < p.m, ok_b = col_ok && rb < p.m;
    // g for rows a and b, word w = columns 2w, 2w + 1 of the lane's 8.
    uint32_t ga[4], gb[4];
    {
      const uint32_t dyw[2][4] = {{dya.x, dya.y, dya.z, dya.w}, {dyb.x, dyb.y, dyb.z, dyb.w}};
      const uint32_t sw[2][4] = {{sa.x, sa.y, sa.z, sa.w}, {sb.x, sb.y, sb.z, sb.w}};
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        float v[2][2];
#pragma unroll
        for (int row = 0; row < 2; ++row) {
          if constexpr (kRelu) {
            v[row][0] = lo_f<T>(dyw[row][w]) * (lo_f<T>(sw[row][w]) > 0.0f ? 1.0f : 0.0f);
            v[row][1] = hi_f<T>(dyw[row][w]) * (hi_f<T>(sw[row][w]) > 0.0f ? 1.0f : 0.0f);
          } else {
            v[row][0] = lo_f<T>(dyw[row][w]) * grad_of(p.act, p.from_output, lo_f<T>(sw[row][w]));
            v[row][1] = hi_f<T>(dyw[row][w]) * grad_of(p.act, p.from_output, hi_f<T>(sw[row][w]));
          }
        }
        ga[w] = pack<T>(v[0][0], v[0][1]);
        gb[w] = pack<T>(v[1][0], v[1][1]);
        // Out-of-range rows and columns loaded zeros: g = 0 there, whatever act'(0) is.
        dbias_acc[2 * w] += (ok_a ? v[0][0] : 0.0f) + (ok_b ? v[1][0] : 0.0f);
        dbias_acc[2 * w + 1] += (ok_a ? v[0][1] : 0.0f) + (ok_b ? v[1][1] : 0.0f);
      }
      if (!ok_a) ga[0] = ga[1] = ga[2] = ga[3] = 0u;
      if (!ok_b) gb[0] = gb[1] = gb[2] = gb[3] = 0u;
    }
    if (ok_a) *reinterpret_cast<uint4*>(p.g + ra * p.n + col) = make_uint4(ga[0], ga[1], ga[2], ga[3]);
    if (ok_b) *reinterpret_cast<uint4*>(p.g + rb * p.n + col) = make_uint4(gb[0], gb[1], gb[2], gb[3]);

    // s g B, this warp's columns: two k16 steps.
    float u_acc[kJ8][4] = {};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t a[4] = {ga[2 * h], gb[2 * h], ga[2 * h + 1], gb[2 * h + 1]};
#pragma unroll
      for (int jb = 0; jb < kJ8; ++jb) mma16816<T>(u_acc[jb], a, bfrag[jb][h][0], bfrag[jb][h][1]);
    }

    // dBᵀ += tᵀ g: word w of rows (a, b) transposed is the B fragment of the 8 columns
    // {8 c + 2w, 8 c + 2w + 1 : c = 0..3} (lane gq feeds column 8 (gq / 2) + 2w + gq % 2).
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const uint32_t b0 = transpose8x8(ga[w]), b1 = transpose8x8(gb[w]);
#pragma unroll
      for (int jb = 0; jb < kJ16; ++jb) mma16816<T>(db_acc[jb][w], cur.tf[jb], b0, b1);
    }

    // The slab's g B: the 8 warps' fragments summed in shared memory, one strip partial per row.
#pragma unroll
    for (int jb = 0; jb < kJ8; ++jb) {
      const int j = 8 * jb + 2 * q;
      u_sum[warp][gq][j] = u_acc[jb][0];
      u_sum[warp][gq][j + 1] = u_acc[jb][1];
      u_sum[warp][gq + 8][j] = u_acc[jb][2];
      u_sum[warp][gq + 8][j + 1] = u_acc[jb][3];
    }
    __syncthreads();
    for (int e = threadIdx.x; e < 16 * RB; e += kThreads) {
      const int rr = e / RB, j = e % RB;
      float s = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) s += u_sum[w][rr][j];
      if (row0 + rr < p.m) p.part_u[(static_cast<std::int64_t>(blockIdx.x) * p.m + row0 + rr) * RB + j] = s;
    }
    // With two buffers the next slab writes the other one; this one is written again only after
    // the next slab's barrier, which every thread reaches after finishing the sum above.
    if constexpr (kUBufs == 1) __syncthreads();
  }

  // dB partial of this row range: fragment (jb, w) holds j = 16 jb + gq (c0, c1) and + 8 (c2, c3)
  // at columns 8q + 2w and 8q + 2w + 1 of the warp's 32.
  if (col_ok) {
    float* pdb = p.part_db + static_cast<std::int64_t>(blockIdx.y) * p.n * RB;
#pragma unroll
    for (int jb = 0; jb < kJ16; ++jb)
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const std::int64_t c = col + 2 * w;
        const int j = 16 * jb + gq;
        pdb[c * RB + j] = db_acc[jb][w][0];
        pdb[(c + 1) * RB + j] = db_acc[jb][w][1];
        pdb[c * RB + j + 8] = db_acc[jb][w][2];
        pdb[(c + 1) * RB + j + 8] = db_acc[jb][w][3];
      }
  }
  // Column sums: add over the 8 lanes of equal q (rows gq), then lane gq = 0 writes.
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    float v = dbias_acc[c];
    v += __shfl_xor_sync(0xffffffffu, v, 4);
    v += __shfl_xor_sync(0xffffffffu, v, 8);
    v += __shfl_xor_sync(0xffffffffu, v, 16);
    dbias_acc[c] = v;
  }
  if (col_ok && gq == 0) {
    float* pdbias = p.part_dbias + static_cast<std::int64_t>(blockIdx.y) * p.n + col;
#pragma unroll
    for (int c = 0; c < 8; ++c) pdbias[c] = dbias_acc[c];
  }
}

// Σ_{c < count} base[c * stride], in order, with up to 8 loads in flight.
__device__ __forceinline__ float sum_strided(const float* base, int count, std::int64_t stride) {
  float s = 0.0f;
  for (int c0 = 0; c0 < count; c0 += 8) {
    float v[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = c0 + k < count ? base[(c0 + k) * stride] : 0.0f;
#pragma unroll
    for (int k = 0; k < 8; ++k)
      if (c0 + k < count) s += v[k];
  }
  return s;
}

// su = s Σ_strips part_u, dB = Σ_groups part_db, db = Σ_groups part_dbias, in a fixed order.
// su [M, rb] (the padding columns come out zero: B's were loaded as zeros). (A programmatic
// dependent launch after the pass measured no faster: docs/notes/lora.md.)
template <class T>
__global__ void lora_grad_reduce(const float* part_u, int strips, const float* part_db, const float* part_dbias,
                                 int groups, T* su, T* db, T* dbias, std::int64_t m, std::int64_t n, int r, int rb,
                                 float scale) {
  const std::int64_t n_u = m * rb, n_db = n * r, n_bias = dbias != nullptr ? n : 0;
  for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < n_u + n_db + n_bias;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    if (e < n_u) {
      su[e] = fk::device::from_float<T>(scale * sum_strided(part_u + e, strips, m * rb));
    } else if (e < n_u + n_db) {
      const std::int64_t i = e - n_u, col = i / r, j = i % r;
      db[i] = fk::device::from_float<T>(sum_strided(part_db + col * rb + j, groups, n * rb));
    } else {
      const std::int64_t col = e - n_u - n_db;
      dbias[col] = fk::device::from_float<T>(sum_strided(part_dbias + col, groups, n));
    }
  }
}

template <class T, int RB>
void launch(const LoraGradArgs& a, float scale, const Stream* stream) {
  const std::int64_t m = a.dy.size(0), n = a.dy.size(1);
  const int r = static_cast<int>(a.b.size(1));
  const int strips = static_cast<int>((n + kStripCols - 1) / kStripCols);
  // One wave: as many CTAs as fit on the GPU at once (by registers), row ranges of whole
  // slabs. (400 CTAs for M = 8192, N = 4096 were 1.52 waves: the second, half-full wave cost
  // about a third of the pass.)
  const std::int64_t slabs = (m + 15) / 16;
  int per_sm = 0;
  const bool relu = a.act == Activation::relu;
  auto kernel = relu ? lora_grad_pass<T, RB, true> : lora_grad_pass<T, RB, false>;
  FK_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0));
  const std::int64_t want = std::max<std::int64_t>(1, std::max(per_sm, 1) * multiprocessor_count() / strips);
  const int groups = static_cast<int>(std::min<std::int64_t>(slabs, want));
  const int rows_per_group = static_cast<int>(16 * ((slabs + groups - 1) / groups));
  const Device dev = a.dy.device();
  const Tensor part_u = Tensor::empty({strips, m, RB}, DType::f32, dev, stream);
  const Tensor part_db = Tensor::empty({groups, n, RB}, DType::f32, dev, stream);
  const Tensor part_dbias = Tensor::empty({groups, n}, DType::f32, dev, stream);
  const cudaStream_t s = fk::detail::cuda_stream(stream);
  GradParams<T> p{static_cast<const T*>(a.dy.data()),
                  static_cast<const T*>(a.saved.data()),
                  static_cast<const T*>(a.b.data()),
                  static_cast<const T*>(a.t.data()),
                  static_cast<T*>(a.g.data()),
                  part_u.data_as<float>(),
                  part_db.data_as<float>(),
                  part_dbias.data_as<float>(),
                  m,
                  n,
                  r,
                  rows_per_group,
                  a.act,
                  a.from_output};
  kernel<<<dim3(strips, groups), kThreads, 0, s>>>(p);
  FK_CUDA_CHECK_LAUNCH("lora_backward (gradient pass)");
  const std::int64_t total = m * RB + n * r + (a.dbias != nullptr ? n : 0);
  const int blocks = static_cast<int>(std::min<std::int64_t>((total + 255) / 256, 4 * multiprocessor_count()));
  lora_grad_reduce<T><<<blocks, 256, 0, s>>>(part_u.data_as<float>(), strips, part_db.data_as<float>(),
                                             part_dbias.data_as<float>(), groups, static_cast<T*>(a.su.data()),
                                             static_cast<T*>(a.db.data()),
                                             a.dbias != nullptr ? static_cast<T*>(a.dbias->data()) : nullptr, m, n, r,
                                             RB, scale);
  FK_CUDA_CHECK_LAUNCH("lora_backward (gradient reduction)");
}

}  // namespace

bool lora_grad_fused(const LoraGradArgs& a, float scale, const Stream* stream) {
  const DType t = a.dy.dtype();
  if (t != DType::bf16 && t != DType::f16) return false;
  const std::int64_t m = a.dy.size(0), n = a.dy.size(1);
  // r <= 16 only: above it the pass's registers hold one CTA an SM and it runs at a quarter to a
  // half of the copy rate, slower than the unfused gradient (docs/lora.md, "Dispatch").
  if (m == 0 || n == 0 || n % 8 != 0 || a.b.size(1) > 16) return false;
  if (a.su.size(1) != 16) throw_internal("lora_grad_fused: su must be [M, 16]");
  for (const TensorView* v : {&a.dy, &a.saved, &a.g})
    if (!aligned16(v->data())) return false;
  const fk::detail::DeviceScope on_device(a.dy.device().index);
  if (t == DType::bf16) launch<__nv_bfloat16, 16>(a, scale, stream);
  else launch<__half, 16>(a, scale, stream);
  return true;
}

}  // namespace fk::cuda
