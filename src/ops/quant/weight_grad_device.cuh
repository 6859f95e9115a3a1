// weight_grad_from_packed's device basics: the CuTe shared-memory layouts and MMA, shared-memory
// accessors, the dequantization arithmetic (levels to bf16 pairs), the shared-memory carve-up and
// a CTA's share of the work.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <climits>
#include <cstdint>
#include <string>

#include <cute/tensor.hpp>  // first: the atom headers rely on what it includes before them
#include <cute/atom/mma_atom.hpp>

#include "ops/common/sm90_async.cuh"
#include "weight_grad_traits.hpp"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FK_WGRAD_SM90 1
#else
#define FK_WGRAD_SM90 0
#endif

namespace fk::cuda::wgrad {
namespace {

using namespace sm90;  // mbarriers, TMA and bulk copies (ops/common/sm90_async.cuh)

using namespace cute;
using cute::Tensor;  // fk declares Tensor too

using Bf16 = cute::bfloat16_t;
// Both operands are M/N-major (dy is [K, COUT], x̂ is [K, CIN], both row-major): 128-byte swizzled
// atoms of 64 (m or n) x 8 (k), k-atoms adjacent, so that a 64x64 box of A is one contiguous 8 KB
// TMA destination. Element (mn, k) of stage s sits at byte
//   s * stage_bytes + (mn / 64) * 8192 + (k / 8) * 1024 + (k % 8) * 128 + (((mn % 64) / 8) ^ (k % 8)) * 16 + (mn % 8) * 2.
template <int kPipe>
using SmemLayoutAOf = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Bf16>{},
                                             Shape<Int<kBlockM>, Int<kBlockK>, Int<kPipe>>{},
                                             Step<_2, _1, _3>{}));  // (BLK_M,BLK_K,PIPE)
using SmemLayoutA = SmemLayoutAOf<kStages>;
using SmemLayoutX = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Bf16>{},
                                           Shape<Int<kBlockN>, Int<kBlockK>, Int<kXBufs>>{},
                                           Step<_2, _1, _3>{}));  // (BLK_N,BLK_K,XBUFS)
static_assert(cosize_v<SmemLayoutA> * 2 == kStages * kStageBytesA);
static_assert(cosize_v<SmemLayoutX> * 2 == kXBufs * kXBufBytes);
// The MMA computes the tile transposed, dWᵀ [128 CIN, 256 COUT] = x̂ᵀ dy, so that each consumer
// warpgroup issues wgmma 64x256x16 (its 64 CIN rows against all 256 COUT columns): per k-block
// the two warpgroups read 2 x 4 x (2 + 8) KB of shared memory, against 96 KB for 4 x 64x128
// blocks of dW, and shared-memory bandwidth is what the tensor cores share with the TMA and
// dequantization traffic. Warpgroup j's A operand is x̂ᵀ rows [64 j, 64 j + 64): exactly the
// x̂ columns it dequantizes itself, so only its own 128 threads need to agree before its wgmmas.
using TiledMma = decltype(make_tiled_mma(SM90_64x256x16_F32BF16BF16_SS<GMMA::Major::MN, GMMA::Major::MN>{},
                                         Layout<Shape<_2, _1, _1>>{}));
static_assert(decltype(size(TiledMma{}))::value == kConsumerThreads);

#if FK_WGRAD_SM90

__device__ __forceinline__ void st_shared_v4(std::uint32_t addr, uint4 v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}
__device__ __forceinline__ void st_shared_u16(std::uint32_t addr, std::uint16_t v) {
  asm volatile("st.shared.u16 [%0], %1;" ::"r"(addr), "h"(v) : "memory");
}
__device__ __forceinline__ void st_shared_u32(std::uint32_t addr, std::uint32_t v) {
  asm volatile("st.shared.u32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ uint4 ld_shared_v4(std::uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ uint2 ld_shared_v2(std::uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ std::uint32_t ld_shared_u32(std::uint32_t addr) {
  std::uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
  return v;
}
// Synchronises the 128 threads of consumer warpgroup `wg` (barrier 0 is __syncthreads).
__device__ __forceinline__ void consumer_barrier(int wg) {
  asm volatile("bar.sync %0, 128;" ::"r"(1 + wg) : "memory");
}


__device__ __forceinline__ std::uint32_t ld_shared_u16(std::uint32_t addr) {
  unsigned short v;
  asm volatile("ld.shared.u16 %0, [%1];" : "=h"(v) : "r"(addr) : "memory");
  return v;
}

__device__ __forceinline__ float ld_shared_stat(std::uint32_t addr, bool bf16) {
  if (bf16) return __uint_as_float(ld_shared_u16(addr) << 16);
  return __uint_as_float(ld_shared_u32(addr));
}

__device__ __forceinline__ float load_stat(const void* base, std::int64_t i, bool bf16) {
  if (bf16) return __uint_as_float(static_cast<std::uint32_t>(__ldg(static_cast<const unsigned short*>(base) + i)) << 16);
  return __ldg(static_cast<const float*>(base) + i);
}

// (a & b) | c in one LOP3: with b and c both constants the compiler emits two (a LOP3 takes one
// immediate); here one of them is kept in a register across the loop.
__device__ __forceinline__ std::uint32_t and_or(std::uint32_t a, std::uint32_t b, std::uint32_t c) {
  std::uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// Level q of element e (0..31) of a chunk (its kBits words in w) as the float f = 1 + q 2^-t
// (t = kBits, or 15 at 8 bits): q goes into the top of the mantissa of 1.0 with one shift and one
// LOP3 (one PRMT at 8 bits), no int-to-float conversion. Then x̂ = f S + M with S = scale 2^t
// (exact) and M = min - S, one FFMA: it differs from the spec's fmaf(q, scale, min) by the
// rounding of M, at most 2^-24 (|min| + 2^t scale), far below the bf16 rounding of x̂ that follows.
template <int kBits> constexpr int kMagicShift = kBits == 8 ? 15 : kBits;
template <int kBits, int E>
__device__ __forceinline__ float unit_level(const std::uint32_t (&w)[kBits]) {
  constexpr int bit = E * kBits;
  const std::uint32_t v0 = w[bit / 32];
  if constexpr (kBits == 8) {
    return __uint_as_float(__byte_perm(v0, 0x3F800000u, 0x7604u | ((bit % 32 / 8) << 4)));  // bytes (0, q, 0x80, 0x3F)
  } else {
    constexpr int d = 23 - kBits - bit % 32;  // where q goes minus where it is
    const std::uint32_t v = d >= 0 ? v0 << (d & 31) : v0 >> (-d & 31);
    return __uint_as_float(and_or(v, ((1u << kBits) - 1u) << (23 - kBits), 0x3F800000u));
  }
}

// x̂ is stored pair by pair (one bf16x2 a 32-bit word). At 2, 4 and 8 bits a pair is columns e
// and e + W/2 of one packed word (W = 32 / kBits columns), which sit 16 bits apart, so that one
// shift and one LOP3 (one PRMT at 8 bits) place both levels (bf16x2 arithmetic below); the x̂
// ring, and therefore the rows of dWᵀ, hold the tile's columns in that order: within each W
// columns, position 2i is column i and position 2i + 1 column i + W/2. At 1 bit pairs are
// adjacent columns.
template <int kBits> constexpr bool kInterleaved = kBits == 2 || kBits == 4 || kBits == 8;
template <int kBits> constexpr int kWordCols = 32 / kBits;
// The elements (0..31 of a chunk) of pair P (0..15).
template <int kBits, int P>
constexpr int kPairFirst = kInterleaved<kBits> ? P / (kWordCols<kBits> / 2) * kWordCols<kBits> + P % (kWordCols<kBits> / 2)
                                               : 2 * P;
template <int kBits, int P>
constexpr int kPairSecond = kInterleaved<kBits> ? kPairFirst<kBits, P> + kWordCols<kBits> / 2 : 2 * P + 1;
// Tile column of x̂ position (dWᵀ row) m.
template <int kBits>
__device__ __forceinline__ int column_of(int m) {
  if constexpr (kInterleaved<kBits>) {
    constexpr int W = kWordCols<kBits>;
    const int j = m % W;
    return m - j + (j % 2) * (W / 2) + j / 2;
  } else {
    return m;
  }
}

// RS (register-sourced A, 2, 4 and 8 bits): the A fragment of warp w (of its warpgroup) holds
// rows 16 w + q and 16 w + q + 8 of x̂ᵀ for lane quad q, each as pairs of k rows; ldmatrix.trans
// hands lane quad q the 16-bit half q of a 16-byte piece of a packed row (16 / kBits columns), of
// k rows 2 j and 2 j + 1 at once. The warp's piece is the warpgroup's 16-byte unit w / W (W = 8 /
// kBits warps share one), and its two rows are columns 2 v and 2 v + 1 of the half (v = w % W).
// Tile column of dWᵀ row m:
template <int kBits>
__device__ __forceinline__ int column_of_rs(int m) {
  constexpr int W = 8 / kBits;
  const int wg = m / 64, w = m % 64 / 16, q = m % 8, e = m % 16 / 8;
  return 64 * wg + w / W * (128 / kBits) + q * (16 / kBits) + 2 * (w % W) + e;
}

// Pair P in f32 arithmetic (f32 statistics, or 1 and 8 bits): two FFMAs, one rounding to bf16x2.
template <int kBits, int P>
__device__ __forceinline__ std::uint32_t pair_f32(const std::uint32_t (&w)[kBits], float S, float M) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(fmaf(unit_level<kBits, kPairFirst<kBits, P>>(w), S, M),
                                                 fmaf(unit_level<kBits, kPairSecond<kBits, P>>(w), S, M));
  return *reinterpret_cast<const std::uint32_t*>(&v);
}

// Pair P in bf16x2 arithmetic (bf16 statistics at 2 and 4 bits): one LOP3 puts the two levels
// into the mantissas of 1.0 at bit p (f = 1 + q 2^(p - 7)): at 2 bits where they already are
// when they fit below bit 7, else after a shift that brings them to the top (p = 7 - t). An
// HFMA2 makes q exactly (f 2^(7 - p) - 2^(7 - p)), and an HFMA2 computes q scale + min with a
// single rounding to bf16: x̂ is the spec's value correctly rounded, the same as the f32 path's
// up to its double rounding. The RS path's pairs take 3 instructions at 2 bits, 4 at 4 bits.
// At 8 bits a level has more bits than a bf16 mantissa, so it goes in as a subnormal instead: the
// bf16 bit pattern q (0..255; q >= 128 spills into the lowest exponent bit, which continues the
// subnormal scale linearly) is q 2^-133 exactly. One PRMT puts bytes e and e + 2 of the word into
// the low bytes of the two halves, an HMUL2 by 2^66 makes q 2^-67 (exact), and one HFMA2 with
// scale2 = scale 2^67 (exact; the caller takes the f32 path when that would overflow bf16)
// computes q scale + min with a single rounding: 3 instructions a pair, against 5 in f32.
// The pair is the levels at bits [kBit, kBit + kBits) and [kBit + 16, kBit + 16 + kBits) of v0
// (kBit < 16, a multiple of 8 at 8 bits), each with its half of scale2 and min2.
template <int kBits, int kBit>
__device__ __forceinline__ std::uint32_t pair_bf16_at(std::uint32_t v0, __nv_bfloat162 scale2, __nv_bfloat162 min2) {
  constexpr int bit = kBit;
  if constexpr (kBits == 8) {
    const std::uint32_t d = __byte_perm(v0, 0u, 0x4240u + (bit / 8) * 0x101u);  // bytes (q_lo, 0, q_hi, 0)
    constexpr std::uint32_t kTwo66 = 0x60806080u;                                 // bf16x2 (2^66, 2^66)
    const __nv_bfloat162 y = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&d),
                                     *reinterpret_cast<const __nv_bfloat162*>(&kTwo66));
    const __nv_bfloat162 x = __hfma2(y, scale2, min2);
    return *reinterpret_cast<const std::uint32_t*>(&x);
  } else {
    // At 2 bits the level stays where it is when it fits in the 7-bit mantissa (no shift: the RS
    // path's levels at bits 0 and 2), else it goes to the mantissa's top. (At 4 bits, leaving the
    // level at bit 0 in place measured slower, so 4 bits always shifts: docs/notes/quant.md.)
    constexpr int pos = kBits == 2 && bit + kBits <= 7 ? bit : 7 - kBits;  // its bit in the low bf16
    constexpr int d = pos - bit;
    const std::uint32_t v = d >= 0 ? v0 << (d & 31) : v0 >> (-d & 31);
    constexpr std::uint32_t m = ((1u << kBits) - 1u) << pos;
    const std::uint32_t f = and_or(v, m | m << 16, 0x3F803F80u);  // 1 + q 2^(pos - 7) in each half
    const __nv_bfloat162 two_t = __float2bfloat162_rn(static_cast<float>(1 << (7 - pos)));
    const __nv_bfloat162 q = __hfma2(*reinterpret_cast<const __nv_bfloat162*>(&f), two_t, __hneg2(two_t));
    const __nv_bfloat162 x = __hfma2(q, scale2, min2);
    return *reinterpret_cast<const std::uint32_t*>(&x);
  }
}
// Pair P of a chunk: columns e and e + W/2 of one word, 16 bits apart.
template <int kBits, int P>
__device__ __forceinline__ std::uint32_t pair_bf16(const std::uint32_t (&w)[kBits], __nv_bfloat162 scale2,
                                                   __nv_bfloat162 min2) {
  static_assert(kInterleaved<kBits>);
  constexpr int E = kPairFirst<kBits, P>;
  return pair_bf16_at<kBits, E * kBits % 32>(w[E * kBits / 32], scale2, min2);
}

// Positions 8J..8J+7 of a chunk (pairs 4J..4J+3) as 8 bf16.
template <int kBits, int J, bool kBf16Math>
__device__ __forceinline__ uint4 dequant8(const std::uint32_t (&w)[kBits], float S, float M, __nv_bfloat162 scale2,
                                          __nv_bfloat162 min2) {
  std::uint32_t out[4];
  [&]<int... P>(std::integer_sequence<int, P...>) {
    if constexpr (kBf16Math) {
      ((out[P] = pair_bf16<kBits, 4 * J + P>(w, scale2, min2)), ...);
    } else {
      ((out[P] = pair_f32<kBits, 4 * J + P>(w, S, M)), ...);
    }
  }(std::make_integer_sequence<int, 4>{});
  return make_uint4(out[0], out[1], out[2], out[3]);
}

// Shared-memory carve-up, as shared-window addresses: dy stages (1024-aligned, for the 128-byte
// swizzle), x̂ buffers, word slots, statistics slots, then the full and empty mbarrier of each
// stage.
// RS: no x̂ buffers; after the statistics slots come the rearranged statistics, and a third
// mbarrier per stage (`ready`: the rearranged statistics are in).
struct Smem {
  std::uint32_t a, x, words, stats, tstats, bars;
  int word_bytes, stages;
  __device__ std::uint32_t full(int s) const { return bars + 8 * s; }
  __device__ std::uint32_t empty(int s) const { return bars + 8 * (stages + s); }
  __device__ std::uint32_t ready(int s) const { return bars + 8 * (2 * stages + s); }
  __device__ std::uint32_t word_slot(int s) const { return words + s * word_bytes; }
  __device__ std::uint32_t stat_slot(int s) const { return stats + s * kStatBytes; }
  __device__ std::uint32_t tstat_slot(int s) const { return tstats + s * kTStatBytes; }
};

template <int kBits, bool kRs = false>
__device__ __forceinline__ Smem carve_smem(const std::uint8_t* raw) {
  constexpr int S = kStagesOf<kRs>;
  const std::uint32_t a = (smem_addr(raw) + 1023) & ~1023u;
  const std::uint32_t x = a + S * kStageBytesA;
  const std::uint32_t w = x + (kRs ? 0 : kXBufs * kXBufBytes);
  const std::uint32_t st = w + S * kWordBytes<kBits>;
  const std::uint32_t ts = st + S * kStatBytes;
  return {a, x, w, st, ts, ts + (kRs ? S * kTStatBytes : 0), kWordBytes<kBits>, S};
}

// The CTA's work: tile `tile`, k-blocks [kb_begin, kb_end).
struct CtaWork {
  int tile, mb, nb, kb_begin, kb_end;
};

__device__ __forceinline__ CtaWork cta_work(const Params& p) {
  const int tile = blockIdx.x / p.splits, split = blockIdx.x % p.splits;
  const int kb0 = static_cast<int>(static_cast<std::int64_t>(split) * p.kblocks / p.splits);
  const int kb1 = static_cast<int>(static_cast<std::int64_t>(split + 1) * p.kblocks / p.splits);
  return {tile, tile / p.tiles_n, tile % p.tiles_n, kb0, kb1};
}

#endif  // FK_WGRAD_SM90

}  // namespace
}  // namespace fk::cuda::wgrad
