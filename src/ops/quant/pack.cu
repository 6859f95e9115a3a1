// The memory-bound kernels of the quant family: pack, unpack, and the ReLU that keeps its mask at
// one bit per element. Each reads its input once and writes its output once; the floor is those
// bytes over HBM bandwidth. The arithmetic is quant_math.hpp's, shared with the CPU spec, so the
// packed words and statistics are bit-identical to the spec's.
//
// pack: a warp quantizes 32 / L groups at once, L lanes per group, each lane holding V = max(8,
//   32 / bits) consecutive values in registers (one or two output words). It is bound by
//   instruction issue rather than bandwidth, so the level arithmetic avoids conversions (see
//   quant_math.hpp) and the register budget keeps 4 blocks per SM. The group's min and max
//   come from xor-shuffles within the L-lane segment, so x is read once. Groups where L is not a
//   power of two of at most 32 (unusual group sizes) take a simple thread-per-group kernel that
//   reads the group twice.
// unpack: each lane writes 8 consecutive values (16 bytes of bf16) of one row, reading the word
//   or two words that hold them and its group's scale and minimum, so every store of a warp
//   covers one contiguous span.
// relu: each lane handles 8 consecutive elements; the 8 mask bits of 4 neighbouring lanes are
//   OR-ed into one 32-bit word by two shuffles.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "fusekit/core/cuda_check.hpp"
#include "ops/common/cuda_common.cuh"
#include "ops/common/activations.cuh"
#include "quant_cuda.hpp"
#include "quant_math.hpp"

namespace fk::cuda {
namespace {

using device::load_vec;
using device::store_vec;
using device::Vec;

constexpr int kThreads = 256;


// Loads n consecutive values (n a multiple of 16 / sizeof(T)) with 16-byte accesses when the
// whole span is valid and aligned, else element by element up to `valid`; the rest are `fill`.
template <class T, int N>
__device__ __forceinline__ void load_values(const T* p, int valid, float (&out)[N], float fill) {
  constexpr int kVec = 16 / sizeof(T);
  static_assert(N % kVec == 0);
  if (valid >= N && (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0) {
#pragma unroll
    for (int i = 0; i < N / kVec; ++i) {
      const Vec<T, kVec> v = load_vec<T, kVec>(p + i * kVec);
#pragma unroll
      for (int j = 0; j < kVec; ++j) out[i * kVec + j] = v.get(j);
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = i < valid ? device::to_float(p[i]) : fill;
  }
}

// Loads N consecutive elements as raw storage (bits for the 16-bit types), 16 bytes at a time
// when the whole span is valid and aligned; elements past `valid` are left zero.
template <class T, int N>
__device__ __forceinline__ void load_raw(const T* p, int valid, Vec<T, N>& r) {
  constexpr int kVec = 16 / sizeof(T);
  static_assert(N % kVec == 0);
  if (valid >= N && (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0) {
#pragma unroll
    for (int i = 0; i < N / kVec; ++i) {
      const Vec<T, kVec> v = load_vec<T, kVec>(p + i * kVec);
#pragma unroll
      for (int j = 0; j < kVec; ++j) r.v[i * kVec + j] = v.v[j];
    }
  } else {
    using B = typename device::Bits<T>::type;
#pragma unroll
    for (int i = 0; i < N; ++i) r.v[i] = i < valid ? reinterpret_cast<const B*>(p)[i] : B{};
  }
}

template <class T, int N>
__device__ __forceinline__ void store_values(T* p, int valid, const float (&v)[N]) {
  constexpr int kVec = 16 / sizeof(T);
  static_assert(N % kVec == 0);
  if (valid >= N && (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0) {
#pragma unroll
    for (int i = 0; i < N / kVec; ++i) {
      if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        // Two values per conversion instruction (cvt.rn.bf16x2.f32).
        uint4 o;
        unsigned* w = reinterpret_cast<unsigned*>(&o);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const __nv_bfloat162 pair = __floats2bfloat162_rn(v[i * kVec + 2 * j], v[i * kVec + 2 * j + 1]);
          w[j] = *reinterpret_cast<const unsigned*>(&pair);
        }
        *reinterpret_cast<uint4*>(p + i * kVec) = o;
      } else {
        Vec<T, kVec> o;
#pragma unroll
        for (int j = 0; j < kVec; ++j) o.set(j, v[i * kVec + j]);
        store_vec<T, kVec>(p + i * kVec, o);
      }
    }
  } else {
    for (int i = 0; i < N && i < valid; ++i) {
      Vec<T, 1> o;
      o.set(0, v[i]);
      store_vec<T, 1>(p + i, o);
    }
  }
}

template <class S> __device__ __forceinline__ void store_stat(S* p, float v);
template <> __device__ __forceinline__ void store_stat(float* p, float v) { *p = v; }
template <> __device__ __forceinline__ void store_stat(__nv_bfloat16* p, float v) {
  *p = __float2bfloat16_rn(v);  // v is already a bf16 value: exact
}
template <class S> __device__ __forceinline__ float load_stat(const S* p) { return device::to_float(*p); }

struct PackArgs {
  const void* x;     // [rows, cols]
  std::uint32_t* words;
  void* scale;
  void* min;
  std::int64_t rows, cols, groups;
  int group, wpg;    // values and words per group
  bool stochastic;
  std::uint64_t seed, offset;
  const std::uint64_t* offset_counter;  // added to offset when the kernel runs; null: none
};

// The stochastic rounding's subsequence: offset, plus the counter's value when the kernel runs
// (PackParams::offset_counter: a CUDA graph replaying the pack then draws anew).
__device__ __forceinline__ std::uint64_t rounding_offset(const PackArgs& a) {
  return a.offset_counter != nullptr ? a.offset + *a.offset_counter : a.offset;
}

// Where a lane's V values of group `fg` are, and how many of them are data.
struct LaneSpan {
  std::int64_t row, g, c0;
  int valid;
};

template <int V>
__device__ __forceinline__ LaneSpan lane_span(const PackArgs& a, std::int64_t fg, int sub, std::int64_t total) {
  if (fg >= total) return {0, 0, 0, 0};
  // 32-bit division where the group count allows: this runs once per lane per group.
  const std::int64_t row = total < (std::int64_t{1} << 31) ? static_cast<std::uint32_t>(fg) / static_cast<std::uint32_t>(a.groups)
                                                         : fg / a.groups;
  const std::int64_t g = fg - row * a.groups;
  const std::int64_t c0 = g * a.group + static_cast<std::int64_t>(sub) * V;
  return {row, g, c0, static_cast<int>(max(std::int64_t{0}, min(std::int64_t{V}, a.cols - c0)))};
}

// The lane's min and max over its valid values, and whether any is NaN or infinite. Full lanes
// of 16-bit types work on pairs (bf16x2 / half2 min, max and fma: exact, two values an
// instruction); x * 0 is NaN exactly for the non-finite x, so one fma chain detects them.
template <class T, int V>
__device__ __forceinline__ void lane_min_max(const Vec<T, V>& raw, int valid, float& mn, float& mx, bool& nonfinite) {
  if constexpr (sizeof(T) == 2) {
    if (valid == V) {
      using P2 = std::conditional_t<std::is_same_v<T, __nv_bfloat16>, __nv_bfloat162, __half2>;
      auto pair = [&](int i) {
        const unsigned w = static_cast<unsigned>(raw.v[2 * i]) | (static_cast<unsigned>(raw.v[2 * i + 1]) << 16);
        return *reinterpret_cast<const P2*>(&w);
      };
      P2 lo[2] = {pair(0), pair(1)}, hi[2] = {pair(0), pair(1)};
      P2 acc[2] = {__hmul2(pair(0), P2{}), __hmul2(pair(1), P2{})};
#pragma unroll
      for (int i = 2; i < V / 2; ++i) {
        const P2 p = pair(i);
        lo[i % 2] = __hmin2(lo[i % 2], p);
        hi[i % 2] = __hmax2(hi[i % 2], p);
        acc[i % 2] = __hfma2(p, P2{}, acc[i % 2]);
      }
      const P2 l = __hmin2(lo[0], lo[1]), h = __hmax2(hi[0], hi[1]), z = __hadd2(acc[0], acc[1]);
      mn = fminf(device::to_float(l.x), device::to_float(l.y));
      mx = fmaxf(device::to_float(h.x), device::to_float(h.y));
      nonfinite = device::to_float(z.x) != 0.0f || device::to_float(z.y) != 0.0f;  // NaN != 0 too
      return;
    }
  }
  float lo[4] = {INFINITY, INFINITY, INFINITY, INFINITY}, hi[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
  float acc = 0.0f;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const float x = raw.get(i);
    const bool data = i < valid;
    acc = fmaf(data ? x : 0.0f, 0.0f, acc);
    lo[i % 4] = fminf(lo[i % 4], data ? x : INFINITY);
    hi[i % 4] = fmaxf(hi[i % 4], data ? x : -INFINITY);
  }
  mn = fminf(fminf(lo[0], lo[1]), fminf(lo[2], lo[3]));
  mx = fmaxf(fmaxf(hi[0], hi[1]), fmaxf(hi[2], hi[3]));
  nonfinite = acc != 0.0f;
}

// The lane's levels packed into its words (kFull: all V values are data, no bounds checks).
template <class T, int BITS, int V, bool kStochastic, bool kFull>
__device__ __forceinline__ void quantize_lane(const PackArgs& a, const LaneSpan& sp, const Vec<T, V>& raw,
                                              const quant::Stats& st, std::uint32_t* w) {
  constexpr int kVpw = 32 / BITS;
  std::uint64_t cached = ~std::uint64_t{0};
  philox::U32x4 block{};
#pragma unroll
  for (int i = 0; i < V; ++i) {
    if (kFull || i < sp.valid) {
      float u = 0.0f;
      if constexpr (kStochastic) {
        const std::uint64_t e = static_cast<std::uint64_t>(sp.row * a.cols + sp.c0 + i);
        if ((e >> 3) != cached) {
          cached = e >> 3;
          block = philox::random_block(a.seed, a.offset, cached);
        }
        u = quant::dither_from(block, e);
      }
      w[i / kVpw] |= quant::quantize(raw.get(i), st, BITS, kStochastic, u) << ((i % kVpw) * BITS);
    }
  }
}

// Min/max over the L-lane segment, statistics, levels and the lane's words for one group.
template <class T, class S, int BITS, int V, bool kStochastic>
__device__ __forceinline__ void pack_group(const PackArgs& a, std::int64_t fg, const LaneSpan& sp, const Vec<T, V>& raw,
                                           int sub, int L, unsigned seg_mask, std::int64_t total) {
  constexpr int kVpw = 32 / BITS;
  constexpr int kWords = V / kVpw;  // words a lane writes
  float mn, mx;
  bool nonfinite;
  lane_min_max<T, V>(raw, sp.valid, mn, mx, nonfinite);
  for (int off = L >> 1; off > 0; off >>= 1) {
    mn = fminf(mn, __shfl_xor_sync(0xffffffffu, mn, off));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  }
  nonfinite = (__ballot_sync(0xffffffffu, nonfinite) & seg_mask) != 0;
  if (fg >= total) return;
  const quant::Stats st = quant::group_stats(mn, mx, nonfinite, BITS, std::is_same_v<S, __nv_bfloat16>);
  if (sub == 0) {
    store_stat(static_cast<S*>(a.scale) + fg, st.scale);
    store_stat(static_cast<S*>(a.min) + fg, st.min);
  }
  std::uint32_t w[kWords] = {};
  if (!nonfinite) {
    if (sp.valid == V) quantize_lane<T, BITS, V, kStochastic, true>(a, sp, raw, st, w);
    else quantize_lane<T, BITS, V, kStochastic, false>(a, sp, raw, st, w);
  }
  std::uint32_t* out = a.words + fg * a.wpg + sub * kWords;  // aligned to kWords words (see pack())
  if constexpr (kWords % 4 == 0) {
#pragma unroll
    for (int i = 0; i < kWords; i += 4) *reinterpret_cast<uint4*>(out + i) = make_uint4(w[i], w[i + 1], w[i + 2], w[i + 3]);
  } else if constexpr (kWords == 2) {
    *reinterpret_cast<uint2*>(out) = make_uint2(w[0], w[1]);
  } else {
    out[0] = w[0];
  }
}

// V values per lane, L lanes per group (a power of two <= 32); at least 4 blocks per SM.
template <class T, class S, int BITS, int V, bool kStochastic>
__global__ void __launch_bounds__(kThreads, 4) pack_warp_kernel(PackArgs a, int lanes_per_group_log2) {
  if constexpr (kStochastic) a.offset = rounding_offset(a);
  const int lane = threadIdx.x & 31;
  const int L = 1 << lanes_per_group_log2;
  const int sub = lane & (L - 1);  // lane within its group
  const std::int64_t groups_per_warp = 32 >> lanes_per_group_log2;
  const std::int64_t total = a.rows * a.groups;
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (kThreads / 32);
  const std::int64_t warp = static_cast<std::int64_t>(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;
  const unsigned seg_mask = (L == 32 ? 0xffffffffu : ((1u << L) - 1u)) << (lane & ~(L - 1));
  const T* x = static_cast<const T*>(a.x);
  const std::int64_t mine = lane >> lanes_per_group_log2;
  for (std::int64_t base = warp * groups_per_warp; base < total; base += warps * groups_per_warp) {
    const LaneSpan sp = lane_span<V>(a, base + mine, sub, total);
    Vec<T, V> raw;
    load_raw<T, V>(x + sp.row * a.cols + sp.c0, sp.valid, raw);
    pack_group<T, S, BITS, V, kStochastic>(a, base + mine, sp, raw, sub, L, seg_mask, total);
  }
}

// Any group size: one thread per group, two passes over it (min/max, then quantize).
template <class T, class S, int BITS>
__global__ void __launch_bounds__(kThreads) pack_group_kernel(PackArgs a) {
  constexpr int kVpw = 32 / BITS;
  if (a.stochastic) a.offset = rounding_offset(a);
  const T* x = static_cast<const T*>(a.x);
  const std::int64_t total = a.rows * a.groups;
  for (std::int64_t fg = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x; fg < total;
       fg += static_cast<std::int64_t>(gridDim.x) * kThreads) {
    const std::int64_t row = fg / a.groups, g = fg - row * a.groups;
    const std::int64_t c0 = g * a.group, c1 = min(a.cols, c0 + a.group);
    const T* p = x + row * a.cols;
    float lo = INFINITY, hi = -INFINITY;
    bool nonfinite = false;
    for (std::int64_t c = c0; c < c1; ++c) {
      const float v = device::to_float(p[c]);
      nonfinite |= !quant::is_finite(v);
      lo = fminf(lo, v);
      hi = fmaxf(hi, v);
    }
    const quant::Stats st = quant::group_stats(lo, hi, nonfinite, BITS, std::is_same_v<S, __nv_bfloat16>);
    store_stat(static_cast<S*>(a.scale) + fg, st.scale);
    store_stat(static_cast<S*>(a.min) + fg, st.min);
    std::uint32_t* out = a.words + fg * a.wpg;
    for (int wi = 0; wi < a.wpg; ++wi) {
      std::uint32_t w = 0;
      for (int j = 0; j < kVpw; ++j) {
        const std::int64_t c = c0 + static_cast<std::int64_t>(wi) * kVpw + j;
        if (c >= c1) break;
        const float u = a.stochastic ? quant::stochastic_u(a.seed, a.offset, static_cast<std::uint64_t>(row * a.cols + c))
                                     : 0.0f;
        if (!nonfinite) w |= quant::quantize(device::to_float(p[c]), st, BITS, a.stochastic, u) << (j * BITS);
      }
      out[wi] = w;
    }
  }
}

struct UnpackArgs {
  const std::uint32_t* words;
  const void* scale;
  const void* min;
  void* out;  // [rows, cols]
  std::int64_t rows, cols, groups, chunks_per_row;
  int group, wpg;
};

// Lane = 8 consecutive values of one row (group % 8 == 0, so they share one group): each store
// instruction of a warp covers 512 contiguous bytes of bf16. (Wider lanes, two chunks a thread and
// a software-pipelined loop were each measured slower: docs/notes/quant.md.)
template <class T, class S, int BITS, int NT>
__global__ void __launch_bounds__(NT) unpack_kernel(UnpackArgs a) {
  constexpr int kVpw = 32 / BITS;
  constexpr std::uint32_t kMask = (1u << BITS) - 1u;
  const std::int64_t total = a.rows * a.chunks_per_row;
  T* out = static_cast<T*>(a.out);
  for (std::int64_t ch = static_cast<std::int64_t>(blockIdx.x) * NT + threadIdx.x; ch < total;
       ch += static_cast<std::int64_t>(gridDim.x) * NT) {
    // 32-bit divisions where the sizes allow: 64-bit ones cost tens of instructions per 8 values.
    const std::int64_t row = total <= 0xffffffffLL ? static_cast<std::uint32_t>(ch) / static_cast<std::uint32_t>(a.chunks_per_row)
                                                   : ch / a.chunks_per_row;
    const std::int64_t c0 = (ch - row * a.chunks_per_row) * 8;
    const std::int64_t g = static_cast<std::uint32_t>(c0) / static_cast<std::uint32_t>(a.group);
    const int j0 = static_cast<int>(c0 - g * a.group);  // first value's index in its group
    const std::int64_t fg = row * a.groups + g;
    // inv (1 / scale) is for quantizing only: unpack needs scale and min.
    const quant::Stats st{load_stat(static_cast<const S*>(a.scale) + fg), load_stat(static_cast<const S*>(a.min) + fg),
                          0.0f};
    const std::uint32_t* wp = a.words + fg * a.wpg + j0 / kVpw;
    // The 8 values' 8 * BITS bits: part of one word (BITS <= 4) or two whole words (BITS = 8).
    std::uint64_t bits;
    if constexpr (BITS == 8) {
      const uint2 w = *reinterpret_cast<const uint2*>(wp);
      bits = w.x | (static_cast<std::uint64_t>(w.y) << 32);
    } else {
      bits = wp[0] >> ((j0 % kVpw) * BITS);
    }
    float v[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = quant::dequantize(static_cast<std::uint32_t>(bits >> (i * BITS)) & kMask, st);
    const int valid = static_cast<int>(std::min<std::int64_t>(8, a.cols - c0));
    store_values<T, 8>(out + row * a.cols + c0, valid, v);
  }
}

// ReLU forward: lane = 8 consecutive elements, 4 lanes = one mask word.
template <class T>
__global__ void __launch_bounds__(kThreads) relu_forward_packed_kernel(const T* __restrict__ x, T* y,
                                                                       std::uint32_t* __restrict__ mask,
                                                                       std::int64_t n) {
  const std::int64_t chunks = (n + 7) / 8;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * kThreads;
  // Whole warps iterate together (the shuffles need all lanes), so round the bound up to a warp.
  const std::int64_t bound = (chunks + 31) / 32 * 32;
  for (std::int64_t ch = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x; ch < bound; ch += stride) {
    const std::int64_t e0 = ch * 8;
    const int valid = ch < chunks ? static_cast<int>(std::min<std::int64_t>(8, n - e0)) : 0;
    float v[8];
    load_values<T, 8>(x + (valid ? e0 : 0), valid, v, 0.0f);
    std::uint32_t bits = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      bits |= static_cast<std::uint32_t>(v[i] > 0.0f) << i;
      v[i] = (v[i] > 0.0f || v[i] != v[i]) ? v[i] : 0.0f;
    }
    if (valid) store_values<T, 8>(y + e0, valid, v);
    bits <<= (threadIdx.x & 3) * 8;
    bits |= __shfl_xor_sync(0xffffffffu, bits, 1);
    bits |= __shfl_xor_sync(0xffffffffu, bits, 2);
    if ((threadIdx.x & 3) == 0 && ch < chunks) mask[ch / 4] = bits;
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads) relu_backward_packed_kernel(const T* dy, const std::uint32_t* __restrict__ mask,
                                                                        T* dx, std::int64_t n) {
  const std::int64_t chunks = (n + 7) / 8;
  for (std::int64_t ch = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x; ch < chunks;
       ch += static_cast<std::int64_t>(gridDim.x) * kThreads) {
    const std::int64_t e0 = ch * 8;
    const int valid = static_cast<int>(std::min<std::int64_t>(8, n - e0));
    const std::uint32_t bits = mask[ch / 4] >> ((ch & 3) * 8);
    float v[8];
    load_values<T, 8>(dy + e0, valid, v, 0.0f);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = ((bits >> i) & 1u) ? v[i] : 0.0f;
    store_values<T, 8>(dx + e0, valid, v);
  }
}

// A grid-stride launch: enough blocks of `threads` for `items` threads, at most `per_sm` blocks per
// SM (8 of kThreads: one resident wave).
unsigned grid_for(std::int64_t items, int threads = kThreads, int per_sm = 8) {
  const std::int64_t want = (items + threads - 1) / threads;
  return static_cast<unsigned>(
      std::clamp<std::int64_t>(want, 1, static_cast<std::int64_t>(multiprocessor_count()) * per_sm));
}
// unpack launches many short-lived blocks instead (128 threads, up to 256 blocks an SM): of the
// launch shapes measured on the H100 this one was fastest, and one resident wave of long-lived
// blocks the slowest; the shapes tried are in docs/notes/quant.md.
constexpr int kUnpackThreads = 128, kUnpackBlocksPerSm = 256;

template <class F>
void with_stats_type(DType t, F&& f) {
  if (t == DType::f32) return f(float{});
  return f(__nv_bfloat16{});
}

template <class F>
void with_bits(int bits, F&& f) {
  switch (bits) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 8: return f(std::integral_constant<int, 8>{});
    default: throw_internal("quant: bits not checked by the caller");
  }
}

}  // namespace

void pack(const TensorView& x, const PackedView& out, const PackParams& p, const Stream* stream) {
  const cudaStream_t s = detail::cuda_stream(stream);
  PackArgs a{x.data(), out.words.data_as<std::uint32_t>(), out.scale.data(), out.min.data(), out.rows, out.cols,
             out.groups(), out.group, out.words_per_group(), p.rounding == Rounding::stochastic, p.seed, p.offset,
             p.offset_counter.data_as<const std::uint64_t>()};
  with_float_type(x.dtype(), [&](auto t) {
    using T = decltype(t);
    with_stats_type(out.scale.dtype(), [&](auto st) {
      using S = decltype(st);
      with_bits(out.bits, [&](auto b) {
        constexpr int BITS = decltype(b)::value;
        // 32 values a lane where the group allows (the per-group work, shuffles and statistics,
        // is then shared by more values), else the fewest that fill whole words.
        auto fits = [&](int v) {
          const int lanes = out.group / v;
          return out.group % v == 0 && lanes <= 32 && (lanes & (lanes - 1)) == 0 &&
                 (out.words_per_group() * 4) % 16 == 0;
        };
        auto launch = [&](auto v_const) {
          constexpr int V = decltype(v_const)::value;
          int log2 = 0;
          while ((1 << log2) < out.group / V) ++log2;
          const std::int64_t warps = (a.rows * a.groups * (out.group / V) + 31) / 32;
          if (a.stochastic) pack_warp_kernel<T, S, BITS, V, true><<<grid_for(warps * 32), kThreads, 0, s>>>(a, log2);
          else pack_warp_kernel<T, S, BITS, V, false><<<grid_for(warps * 32), kThreads, 0, s>>>(a, log2);
          FK_CUDA_CHECK_LAUNCH("pack_warp_kernel");
        };
        constexpr int kSmall = std::max(8, 32 / BITS);
        if (fits(32)) {
          launch(std::integral_constant<int, 32>{});
        } else if (fits(kSmall)) {
          launch(std::integral_constant<int, kSmall>{});
        } else {
          pack_group_kernel<T, S, BITS><<<grid_for(a.rows * a.groups), kThreads, 0, s>>>(a);
          FK_CUDA_CHECK_LAUNCH("pack_group_kernel");
        }
      });
    });
  });
}

void unpack(const PackedView& packed, const TensorView& out, const Stream* stream) {
  FK_CHECK_ARG(packed.group % 8 == 0, "unpack", "packed", "a group size that is a multiple of 8 on the GPU",
               std::to_string(packed.group));
  const cudaStream_t s = detail::cuda_stream(stream);
  UnpackArgs a{packed.words.data_as<const std::uint32_t>(), packed.scale.data(), packed.min.data(), out.data(),
               packed.rows, packed.cols, packed.groups(), (packed.cols + 7) / 8, packed.group,
               packed.words_per_group()};
  with_float_type(out.dtype(), [&](auto t) {
    using T = decltype(t);
    with_stats_type(packed.scale.dtype(), [&](auto st) {
      using S = decltype(st);
      with_bits(packed.bits, [&](auto b) {
        const unsigned grid = grid_for(a.rows * a.chunks_per_row, kUnpackThreads, kUnpackBlocksPerSm);
        unpack_kernel<T, S, decltype(b)::value, kUnpackThreads><<<grid, kUnpackThreads, 0, s>>>(a);
        FK_CUDA_CHECK_LAUNCH("unpack_kernel");
      });
    });
  });
}

void relu_forward_packed(const TensorView& x, const TensorView& y, const TensorView& mask, const Stream* stream) {
  const cudaStream_t s = detail::cuda_stream(stream);
  with_float_type(x.dtype(), [&](auto t) {
    using T = decltype(t);
    const std::int64_t chunks = (x.numel() + 7) / 8;
    relu_forward_packed_kernel<T><<<grid_for(chunks), kThreads, 0, s>>>(x.data_as<const T>(), y.data_as<T>(),
                                                                        mask.data_as<std::uint32_t>(), x.numel());
    FK_CUDA_CHECK_LAUNCH("relu_forward_packed_kernel");
  });
}

void relu_backward_packed(const TensorView& dy, const TensorView& mask, const TensorView& dx, const Stream* stream) {
  const cudaStream_t s = detail::cuda_stream(stream);
  with_float_type(dy.dtype(), [&](auto t) {
    using T = decltype(t);
    const std::int64_t chunks = (dy.numel() + 7) / 8;
    relu_backward_packed_kernel<T><<<grid_for(chunks), kThreads, 0, s>>>(
        dy.data_as<const T>(), mask.data_as<const std::uint32_t>(), dx.data_as<T>(), dy.numel());
    FK_CUDA_CHECK_LAUNCH("relu_backward_packed_kernel");
  });
}

}  // namespace fk::cuda
