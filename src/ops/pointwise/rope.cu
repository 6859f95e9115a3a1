// Rotary position embedding over q and k in one launch, forward and backward (see ops/pointwise.hpp).
//
// q and k are read once and q_out and k_out written once; cos and sin are loaded once per token
// and column vector by each thread, which then rotates every head it is given with them (the
// threads of the other heads find them in L1 or L2). The floor is the bytes of q, k, q_out, k_out
// (plus cos and sin once) over HBM bandwidth.
//
// Mapping: a block of (bx, bt, bh) threads covers bx vectors along a row, bt tokens (b, t) and bh
// heads, q's Hq and k's Hk counted as one list of Hq + Hk heads; the grid strides over the tokens.
// Rows whose halves are under 128 bytes (D = 16..64 in bf16) take one lane per vector and exchange
// halves by warp shuffles (rope_row_kernel), so that each access of a warp covers whole lines;
// longer or odd rows take one lane per pair (x1 at column c, x2 at c + D/2: rope_kernel). Every row has its own base from the (b, h, t) strides,
// so transposed views (Hugging Face's q is [B, T, H, D] memory seen as [B, H, T, D]) are read as
// they are. Vectors are 16 bytes of q's dtype when D/2, every stride and every pointer allow it,
// else single elements. One division per token (b and t from the flat token index), none per
// element. The backward is the forward's formula with (-s2, -s1) in place of (s1, s2).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

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
constexpr int kMaxBlockZ = 64;  // CUDA's limit on blockDim.z

struct RopeParams {
  const void* q;      // [B, Hq, T, D], strides q_stride (b, h, t) and 1
  const void* k;      // [B, Hk, T, D], strides k_stride
  void* q_out;        // [B, Hq, T, D], strides qo_stride; may be q
  void* k_out;        // [B, Hk, T, D], strides ko_stride; may be k
  const void* cos;    // [B or 1, T, D], strides cos_stride (b: 0 when broadcast, t)
  const void* sin;    // as cos, strides sin_stride
  std::int64_t q_stride[3], k_stride[3], qo_stride[3], ko_stride[3];
  std::int64_t cos_stride[2], sin_stride[2];
  std::int64_t batch, seq, half;
  int q_heads, heads;  // Hq, and Hq + Hk
  bool backward;
};

// -v, element by element (a sign-bit flip for the 16-bit types, exact).
template <class T, int V>
__device__ __forceinline__ Vec<T, V> negated(Vec<T, V> v) {
#pragma unroll
  for (int j = 0; j < V; ++j) {
    if constexpr (std::is_same_v<T, float>) v.v[j] = -v.v[j];
    else v.v[j] ^= 0x8000u;
  }
  return v;
}

// Blocks of 256 per SM the register budget is set for: 4 (64 registers), 3 where 16-bit q reads f32
// tables 8 wide (32 table values per thread; at 64 registers they spill).
template <class T, class TC, int V>
inline constexpr int kMinBlocks = sizeof(TC) == 4 && V == 8 ? 3 : 4;

template <class T, class TC, int V>
__global__ void __launch_bounds__(kThreads, (kMinBlocks<T, TC, V>)) rope_kernel(RopeParams p) {
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  T* q_out = static_cast<T*>(p.q_out);
  T* k_out = static_cast<T*>(p.k_out);
  const std::int64_t tokens = p.batch * p.seq;
  const std::int64_t token_step = static_cast<std::int64_t>(gridDim.x) * blockDim.y;
  for (std::int64_t token = static_cast<std::int64_t>(blockIdx.x) * blockDim.y + threadIdx.y; token < tokens;
       token += token_step) {
    const std::int64_t b = token / p.seq, t = token - b * p.seq;
    const TC* cos = static_cast<const TC*>(p.cos) + b * p.cos_stride[0] + t * p.cos_stride[1];
    const TC* sin = static_cast<const TC*>(p.sin) + b * p.sin_stride[0] + t * p.sin_stride[1];
    for (std::int64_t c = static_cast<std::int64_t>(threadIdx.x) * V; c < p.half;
         c += static_cast<std::int64_t>(blockDim.x) * V) {
      // y1 = x1 c1 - x2 sa,  y2 = x2 c2 + x1 sb:  (sa, sb) = (s1, s2) forward, (-s2, -s1) backward.
      // Held as loaded (16-bit values stay packed) and widened at each use: fewer registers.
      const Vec<TC, V> c1 = load_vec<TC, V>(cos + c), c2 = load_vec<TC, V>(cos + p.half + c);
      const Vec<TC, V> s1 = load_vec<TC, V>(sin + c), s2 = load_vec<TC, V>(sin + p.half + c);
      const Vec<TC, V> sa = p.backward ? negated(s2) : s1, sb = p.backward ? negated(s1) : s2;
      for (int h = threadIdx.z; h < p.heads; h += blockDim.z) {
        const bool is_k = h >= p.q_heads;
        const std::int64_t hh = is_k ? h - p.q_heads : h;
        const T* x = is_k ? k + b * p.k_stride[0] + hh * p.k_stride[1] + t * p.k_stride[2]
                          : q + b * p.q_stride[0] + hh * p.q_stride[1] + t * p.q_stride[2];
        T* y = is_k ? k_out + b * p.ko_stride[0] + hh * p.ko_stride[1] + t * p.ko_stride[2]
                    : q_out + b * p.qo_stride[0] + hh * p.qo_stride[1] + t * p.qo_stride[2];
        const Vec<T, V> x1 = load_vec<T, V>(x + c), x2 = load_vec<T, V>(x + p.half + c);
        Vec<T, V> y1, y2;
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const float a = x1.get(j), e = x2.get(j);
          y1.set(j, fmaf(a, c1.get(j), -e * sa.get(j)));
          y2.set(j, fmaf(e, c2.get(j), a * sb.get(j)));
        }
        store_vec<T, V>(y + c, y1);
        store_vec<T, V>(y + p.half + c, y2);
      }
    }
  }
}

// The partner's vector of a row, from lane ^ offset, among the lanes in `mask`.
template <class T, int V>
__device__ __forceinline__ Vec<T, V> shuffle_xor(unsigned mask, const Vec<T, V>& v, int offset) {
  static_assert(sizeof(Vec<T, V>) % 4 == 0);
  constexpr int kWords = sizeof(Vec<T, V>) / 4;
  unsigned w[kWords];
  memcpy(w, &v, sizeof(v));
#pragma unroll
  for (int i = 0; i < kWords; ++i) w[i] = __shfl_xor_sync(mask, w[i], offset);
  Vec<T, V> out;
  memcpy(&out, w, sizeof(out));
  return out;
}

// Rows of a few vectors (blockDim.x = D / V, a power of two up to 8): each thread
// loads one vector of the row, so a warp's access covers whole rows (a half row of 64 bytes, bf16
// at D = 64, would otherwise be read by two instructions a line apart), and takes its partner's
// vector (column c -/+ D/2) by a shuffle. Its own output column is
//   y = x c + x_partner s',  s' = -s1 (first half) and s2 (second half) forward, from its own
//   column; s2 and -s1 backward, from the partner's column.
template <class T, class TC, int V, int R, int MinBlocks>
__global__ void __launch_bounds__(kThreads, MinBlocks) rope_row_kernel(RopeParams p) {
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  T* q_out = static_cast<T*>(p.q_out);
  T* k_out = static_cast<T*>(p.k_out);
  const int row_lanes = blockDim.x, half_lanes = row_lanes / 2;
  const bool second = static_cast<int>(threadIdx.x) >= half_lanes;
  const std::int64_t col = static_cast<std::int64_t>(threadIdx.x) * V;
  const std::int64_t sin_col = p.backward ? (second ? col - p.half : col + p.half) : col;
  const bool negate = second == p.backward;
  // The lanes of this thread's row (consecutive and aligned in the warp: blockDim.x divides 32);
  // they share every loop bound below, so all of them reach each shuffle.
  const unsigned linear = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const unsigned mask = row_lanes == 32 ? 0xffffffffu : ((1u << row_lanes) - 1) << ((linear & 31) & ~(row_lanes - 1));
  const std::int64_t tokens = p.batch * p.seq;
  const std::int64_t token_step = static_cast<std::int64_t>(gridDim.x) * blockDim.y;
  for (std::int64_t token = static_cast<std::int64_t>(blockIdx.x) * blockDim.y + threadIdx.y; token < tokens;
       token += token_step) {
    const std::int64_t b = token / p.seq, t = token - b * p.seq;
    const TC* cos = static_cast<const TC*>(p.cos) + b * p.cos_stride[0] + t * p.cos_stride[1];
    const TC* sin = static_cast<const TC*>(p.sin) + b * p.sin_stride[0] + t * p.sin_stride[1];
    const Vec<TC, V> c = load_vec<TC, V>(cos + col);
    const Vec<TC, V> s_loaded = load_vec<TC, V>(sin + sin_col);
    const Vec<TC, V> sv = negate ? negated(s_loaded) : s_loaded;
    // R heads a round (h0, h0 + bz, ..): R loads in flight before the first shuffle. Per token, the
    // (b, t) part of each operand's offset; per head, its h part.
    const std::int64_t q_base = b * p.q_stride[0] + t * p.q_stride[2], k_base = b * p.k_stride[0] + t * p.k_stride[2];
    const std::int64_t qo_base = b * p.qo_stride[0] + t * p.qo_stride[2];
    const std::int64_t ko_base = b * p.ko_stride[0] + t * p.ko_stride[2];
    const int bz = static_cast<int>(blockDim.z);
    for (int h0 = threadIdx.z; h0 < p.heads; h0 += R * bz) {
      Vec<T, V> xv[R];
#pragma unroll
      for (int u = 0; u < R; ++u) {
        const int h = h0 + u * bz;
        if (h < p.heads) {
          const T* x = h >= p.q_heads ? k + k_base + (h - p.q_heads) * p.k_stride[1] : q + q_base + h * p.q_stride[1];
          xv[u] = load_vec<T, V>(x + col);
        }
      }
#pragma unroll
      for (int u = 0; u < R; ++u) {
        const int h = h0 + u * bz;
        if (h < p.heads) {
          const Vec<T, V> xp = shuffle_xor(mask, xv[u], half_lanes);
          Vec<T, V> yv;
#pragma unroll
          for (int j = 0; j < V; ++j) yv.set(j, fmaf(xv[u].get(j), c.get(j), xp.get(j) * sv.get(j)));
          T* y = h >= p.q_heads ? k_out + ko_base + (h - p.q_heads) * p.ko_stride[1]
                                : q_out + qo_base + h * p.qo_stride[1];
          store_vec<T, V>(y + col, yv);
        }
      }
    }
  }
}

// Whether every stride of a rope operand's leading dimensions is a multiple of v elements and its
// data is aligned to v elements of `bytes` each.
bool vector_friendly(const TensorView& t, int v, std::size_t bytes) {
  for (int i = 0; i + 1 < t.rank(); ++i)
    if (t.size(i) > 1 && t.strides()[i] % v != 0) return false;
  return reinterpret_cast<std::uintptr_t>(t.data()) % (v * bytes) == 0;
}

// Blocks of (bx, bt, bh) threads: bx lanes along a row, bh heads in as few equal rounds as fit the
// block, bt tokens to fill the rest; the grid strides over the tokens.
inline dim3 rope_block(int bx, int heads_a_block, std::int64_t tokens) {
  const int bt = static_cast<int>(std::max<std::int64_t>(1, std::min<std::int64_t>(kThreads / (bx * heads_a_block), tokens)));
  return dim3(bx, bt, heads_a_block);
}
inline unsigned rope_grid(const dim3& block, std::int64_t tokens) {
  return static_cast<unsigned>(std::min<std::int64_t>((tokens + block.y - 1) / block.y, std::int64_t{multiprocessor_count()} * 32));
}
inline int equal_rounds(int heads, int most) {
  const int rounds = (heads + most - 1) / most;
  return (heads + rounds - 1) / rounds;
}

// rope_row_kernel with R heads a round (at most heads / R a block) and registers for MinBlocks
// blocks of 256 an SM: a lane a 16-byte vector, whole rows.
template <class T, class TC, int R, int MinBlocks>
void launch_rows(const RopeParams& p, cudaStream_t s) {
  constexpr int kVec = 16 / sizeof(T);
  const int bx = static_cast<int>(2 * p.half / kVec);
  const int most = std::min({kMaxBlockZ, kThreads / bx, std::max(1, (p.heads + R - 1) / R)});
  const dim3 block = rope_block(bx, equal_rounds(p.heads, most), p.batch * p.seq);
  rope_row_kernel<T, TC, kVec, R, MinBlocks><<<rope_grid(block, p.batch * p.seq), block, 0, s>>>(p);
}

// Heads a round and registers of the whole-row kernel: 4 heads a round (4 loads of 16 bytes in
// flight a thread) at 64 registers (4 blocks of 256 an SM). On the H100 at the LLM bench's bf16
// shapes (q, k as Hugging Face hands them) 4 heads a round took 142.6 and 62.5 µs where 2 took
// 146.8 and 66.3 (B64 H12 T1024 D64; B8 H32 KV8 T2048 D64); 8 heads, or more registers, no better.
// 16-bit q with f32 tables (twice the table registers) is given 3 blocks' worth: no spills.
constexpr int kRowHeads = 4;
template <class T, class TC>
inline constexpr int kRowMinBlocks = sizeof(TC) == 4 && sizeof(T) == 2 ? 3 : 4;

template <class T, class TC>
void launch(const RopeParams& p, const RopeArgs& a, cudaStream_t s) {
  constexpr int kVec = 16 / sizeof(T);
  bool vec = p.half % kVec == 0;
  for (const TensorView* t : {&a.q, &a.k, &a.q_out, &a.k_out}) vec = vec && vector_friendly(*t, kVec, sizeof(T));
  for (const TensorView* t : {&a.cos, &a.sin}) vec = vec && vector_friendly(*t, kVec, sizeof(TC));
  // Whole rows, a lane a vector, where half a row is under 128 bytes (a power-of-two number of
  // vectors), else half a row's vectors (pairs), up to a warp (where half a row is 128 bytes or
  // more the pairs' accesses already cover whole lines, and measured faster).
  const std::int64_t vectors = p.half / (vec ? kVec : 1), row_vectors = 2 * vectors;
  if (vec && vectors < 8 && (row_vectors & (row_vectors - 1)) == 0) return launch_rows<T, TC, kRowHeads, kRowMinBlocks<T, TC>>(p, s);
  const int bx = static_cast<int>(std::min<std::int64_t>(vectors, 32));
  const dim3 block = rope_block(bx, equal_rounds(p.heads, std::min(kMaxBlockZ, kThreads / bx)), p.batch * p.seq);
  const unsigned grid = rope_grid(block, p.batch * p.seq);
  if (vec)
    rope_kernel<T, TC, kVec><<<grid, block, 0, s>>>(p);
  else
    rope_kernel<T, TC, 1><<<grid, block, 0, s>>>(p);
}

}  // namespace

void rope(const RopeArgs& a, bool backward, const Stream* stream) {
  RopeParams p{};
  p.q = a.q.data();
  p.k = a.k.data();
  p.q_out = a.q_out.data();
  p.k_out = a.k_out.data();
  p.cos = a.cos.data();
  p.sin = a.sin.data();
  for (int i = 0; i < 3; ++i) {
    p.q_stride[i] = a.q.strides()[i];
    p.k_stride[i] = a.k.strides()[i];
    p.qo_stride[i] = a.q_out.strides()[i];
    p.ko_stride[i] = a.k_out.strides()[i];
  }
  // [T, D] and [1, T, D] tables broadcast over the batch: a batch stride of 0.
  const auto table_strides = [](const TensorView& t, std::int64_t out[2]) {
    const bool per_batch = t.rank() == 3 && t.size(0) > 1;
    out[0] = per_batch ? t.strides()[0] : 0;
    out[1] = t.strides()[t.rank() - 2];
  };
  table_strides(a.cos, p.cos_stride);
  table_strides(a.sin, p.sin_stride);
  p.batch = a.q.size(0);
  p.seq = a.q.size(2);
  p.half = a.q.size(3) / 2;
  p.q_heads = static_cast<int>(a.q.size(1));
  p.heads = static_cast<int>(a.q.size(1) + a.k.size(1));
  p.backward = backward;
  if (p.batch * p.seq == 0 || p.half == 0 || p.heads == 0) return;
  const cudaStream_t s = detail::cuda_stream(stream);
  with_float_type(a.q.dtype(), [&](auto qi) {
    using T = decltype(qi);
    if constexpr (!std::is_same_v<T, float>) {
      if (a.cos.dtype() == DType::f32) return launch<T, float>(p, a, s);
    }
    launch<T, T>(p, a, s);
  });
  FK_CUDA_CHECK_LAUNCH(backward ? "rope_backward" : "rope_forward");
}

}  // namespace fk::cuda
