// weight_grad_from_packed's epilogue: a consumer thread's accumulators into dW or into the split-K
// workspace (fp32, or fp16 with a scale per 8 values), and the fix-up kernels that add a split
// tile's partials in a fixed order.
#pragma once

#include "weight_grad_device.cuh"

namespace fk::cuda::wgrad {
namespace {

#if FK_WGRAD_SM90

// In the SM90 64x256 fp32 accumulator layout, two warpgroups along M = CIN, accumulator
// i = e0 + 2 e1 + 4 j of consumer thread ct (warp w = ct % 128 / 32, lane l = ct % 32) holds dWᵀ
// tile element (cin, cout) =
//   (64 (ct / 128) + 16 w + l / 4 + 8 e1,  2 (l % 4) + 8 j + e0),
// dWᵀ row m being tile column column_of(m) (column_of_rs(m) on the RS path). So chunk j of a
// thread (accumulators 4 j .. 4 j + 3) lies in tile rows (COUT) [8 j, 8 j + 8).
// (Written out rather than taken from an identity tensor, whose 128 coordinate pairs the compiler
// would otherwise keep live across both store paths.)
struct AccMap {
  int ci_lo, ci_hi, co;  // the thread's tile columns for e1 = 0 and 1, and its first row
  __device__ static int cout_of(int i) { return 8 * (i / 4) + i % 2; }  // relative to co
  __device__ int cin_of(int i) const { return i / 2 % 2 ? ci_hi : ci_lo; }
};
template <int kBits, bool kRs>
__device__ __forceinline__ AccMap acc_map(int ct) {
  const int m = 64 * (ct / 128) + 16 * (ct % 128 / 32) + ct % 32 / 4;
  auto column = [](int r) { return kRs ? column_of_rs<kBits>(r) : column_of<kBits>(r); };
  return {column(m), column(m + 8), 2 * (ct % 4)};
}

// The fp16 partials of a split tile (Params::half_partials): accumulators 8 g .. 8 g + 7 of consumer
// thread ct (chunks 2 g and 2 g + 1: tile rows 16 g + {0, 1, 8, 9} + its co, its two columns) are
// scaled by 2^(141 - e), e the biased exponent of their largest finite magnitude (at least 15),
// which puts that magnitude in [2^14, 2^15), rounded to fp16 (one 16-byte store at uint4
// g * 256 + ct of the CTA's slot) and e stored as byte g * 256 + ct of the CTA's exponents. Every
// value at least 2^-28 of the largest keeps 11 significant bits; infinities and NaNs stay what
// they are (the largest is taken over the finite values).
template <class Acc>
__device__ void store_partial_f16(const Acc& acc, int ct, const Params& p) {
  uint4* vals = reinterpret_cast<uint4*>(p.workspace) + static_cast<std::int64_t>(blockIdx.x) * (kTileElems / 8) + ct;
  std::uint8_t* exps = p.partial_exps + static_cast<std::int64_t>(blockIdx.x) * (kTileElems / 8) + ct;
  CUTE_UNROLL
  for (int g = 0; g < 16; ++g) {
    float v[8];
    CUTE_UNROLL
    for (int i = 0; i < 8; ++i) v[i] = acc(8 * g + i);
    float amax = 0.0f;  // fmaxf skips NaNs
    CUTE_UNROLL
    for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[i]));
    if (amax > FLT_MAX) {  // an infinity: the scale comes from the finite values
      amax = 0.0f;
      CUTE_UNROLL
      for (int i = 0; i < 8; ++i) amax = fabsf(v[i]) <= FLT_MAX ? fmaxf(amax, fabsf(v[i])) : amax;
    }
    const std::uint32_t e = max(__float_as_uint(amax) >> 23, 15u);
    const float f = __uint_as_float((268u - e) << 23);  // 2^(141 - e), in [2^-113, 2^126]
    std::uint32_t h[4];
    CUTE_UNROLL
    for (int i = 0; i < 4; ++i)
      asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(h[i]) : "f"(v[2 * i + 1] * f), "f"(v[2 * i] * f));
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(vals + g * kConsumerThreads), "r"(h[0]), "r"(h[1]),
                 "r"(h[2]), "r"(h[3])
                 : "memory");
    asm volatile("st.global.u8 [%0], %1;" ::"l"(exps + g * kConsumerThreads), "h"(static_cast<unsigned short>(e))
                 : "memory");
  }
}

// Stores one consumer thread's accumulators: into dW (tile not split), as fp16 partials
// (half_partials: store_partial_f16) or into the CTA's fp32 slot of the workspace, in the
// accumulators' own order: chunk j of thread ct at float4 j * 256 + ct, one
// 16-byte store a chunk (a warp writes 512 contiguous bytes; no staging), the accumulators as the
// store's asm operands (C++ copies of them let ptxas serialize the k-loop's wgmmas: C7514). The
// fix-up kernel maps the chunks to dW.
template <int kBits, bool kRs = false, class Acc>
__device__ void store_tile(const Acc& acc, int ct, const Params& p, const CtaWork& w) {
  static_assert(decltype(size(acc))::value == 128);
  if (p.half_partials) {
    store_partial_f16(acc, ct, p);
    return;
  }
  if (p.splits > 1) {
    float* ws = p.workspace + static_cast<std::int64_t>(blockIdx.x) * kTileElems + ct * 4;
    CUTE_UNROLL
    for (int j = 0; j < 32; ++j)
      asm volatile("st.global.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(ws + j * kConsumerThreads * 4), "f"(acc(4 * j)),
                   "f"(acc(4 * j + 1)), "f"(acc(4 * j + 2)), "f"(acc(4 * j + 3))
                   : "memory");
    return;
  }
  const AccMap am = acc_map<kBits, kRs>(ct);
  const int co0 = w.mb * kBlockM + am.co, ci0 = w.nb * kBlockN;
  CUTE_UNROLL
  for (int i = 0; i < 128; ++i) {
    const int o = co0 + AccMap::cout_of(i), c = ci0 + am.cin_of(i);
    if (o < p.cout && c < p.cin) {
      const std::int64_t at = static_cast<std::int64_t>(o) * p.cin + c;
      if (p.dw_bf16) {
        auto* dw = static_cast<__nv_bfloat16*>(p.dw) + at;
        *dw = __float2bfloat16_rn((p.accumulate ? __bfloat162float(*dw) : 0.0f) + acc(i));
      } else {
        auto* dw = static_cast<float*>(p.dw) + at;
        *dw = (p.accumulate ? *dw : 0.0f) + acc(i);
      }
    }
    // Bounds the read-modify-writes the compiler batches (and the registers they hold).
    if (i % 16 == 15) asm volatile("" ::: "memory");
  }
}

#endif  // FK_WGRAD_SM90


// dW for every split tile: the sum of its S partials in split order, plus beta * dW. CTA
// (tile, j) takes chunk j of the tile's partials (store_tile's order: tile rows [8 j, 8 j + 8)):
// thread ct adds up its float4 of the S partials (up to 8 loads in flight; a warp reads 512
// contiguous bytes of each), puts the four sums at their tile coordinates in shared memory, and
// the 256 threads then write the 8 rows into dW, 4 consecutive columns each.
constexpr int kFixupThreads = kConsumerThreads;  // one per consumer thread of the main kernel
#if FK_WGRAD_SM90
// dW (m, n .. n + 3) = the sums s (+ beta dW), those inside [COUT, CIN]: one 8- or 16-byte store
// when all four are inside, beta = 0 and the address is aligned.
__device__ __forceinline__ void store_dw4(const Params& p, int m, int n, float4 s) {
  if (m >= p.cout || n >= p.cin) return;
  const float sum[4] = {s.x, s.y, s.z, s.w};
  const std::int64_t at = static_cast<std::int64_t>(m) * p.cin + n;
  if (n + 4 <= p.cin && !p.accumulate) {
    if (p.dw_bf16 && reinterpret_cast<std::uintptr_t>(static_cast<__nv_bfloat16*>(p.dw) + at) % 8 == 0) {
      const __nv_bfloat162 a = __floats2bfloat162_rn(sum[0], sum[1]), b = __floats2bfloat162_rn(sum[2], sum[3]);
      *reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(p.dw) + at) =
          make_uint2(*reinterpret_cast<const std::uint32_t*>(&a), *reinterpret_cast<const std::uint32_t*>(&b));
      return;
    }
    if (!p.dw_bf16 && reinterpret_cast<std::uintptr_t>(static_cast<float*>(p.dw) + at) % 16 == 0) {
      *reinterpret_cast<float4*>(static_cast<float*>(p.dw) + at) = s;
      return;
    }
  }
  for (int e = 0; e < 4 && n + e < p.cin; ++e) {
    if (p.dw_bf16) {
      auto* dw = static_cast<__nv_bfloat16*>(p.dw) + at + e;
      *dw = __float2bfloat16_rn((p.accumulate ? __bfloat162float(*dw) : 0.0f) + sum[e]);
    } else {
      auto* dw = static_cast<float*>(p.dw) + at + e;
      *dw = (p.accumulate ? *dw : 0.0f) + sum[e];
    }
  }
}
#endif
template <int kBits, bool kRs>
__global__ void __launch_bounds__(kFixupThreads) weight_grad_fixup_kernel(const Params p) {
#if FK_WGRAD_SM90
  asm volatile("griddepcontrol.wait;" ::: "memory");  // launched early (programmatic dependent launch)
  constexpr int kRowPitch = kBlockN + 4;  // floats: rows stay 16-byte aligned
  __shared__ __align__(16) float rows[8 * kRowPitch];
  const int tile = blockIdx.x, j = blockIdx.y, ct = static_cast<int>(threadIdx.x);
  const float4* part = reinterpret_cast<const float4*>(p.workspace) +
                       static_cast<std::int64_t>(tile) * p.splits * (kTileElems / 4) + j * kFixupThreads + ct;
  constexpr int kStride = kTileElems / 4;
  float4 s = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  for (int c = 0; c < p.splits; c += 8) {
    float4 q[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) q[i] = c + i < p.splits ? __ldcg(part + static_cast<std::int64_t>(c + i) * kStride) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int i = 0; i < 8; ++i)
      if (c + i < p.splits) s.x += q[i].x, s.y += q[i].y, s.z += q[i].z, s.w += q[i].w;
  }
  const AccMap am = acc_map<kBits, kRs>(ct);  // accumulator 4 j + e: row co + e % 2, column e / 2 ? hi : lo
  rows[am.co * kRowPitch + am.ci_lo] = s.x;
  rows[(am.co + 1) * kRowPitch + am.ci_lo] = s.y;
  rows[am.co * kRowPitch + am.ci_hi] = s.z;
  rows[(am.co + 1) * kRowPitch + am.ci_hi] = s.w;
  __syncthreads();
  const int r = ct / 32, c4 = 4 * (ct % 32);
  store_dw4(p, tile / p.tiles_n * kBlockM + 8 * j + r, tile % p.tiles_n * kBlockN + c4,
            *reinterpret_cast<const float4*>(rows + r * kRowPitch + c4));
#else
  __trap();  // the launcher never starts this kernel off sm_90
#endif
}

// The fix-up of fp16 partials (Params::half_partials): CTA (tile, g) takes accumulators 8 g .. 8 g + 7
// of every consumer thread (tile rows [16 g, 16 g + 16)): thread ct adds up its 8 values of the S
// partials in split order in fp32, each fp16 value times 2^(e - 141) (exact), puts the sums at
// their tile coordinates in shared memory, and the 256 threads write the 16 rows.
template <int kBits, bool kRs>
__global__ void __launch_bounds__(kFixupThreads) weight_grad_fixup_f16_kernel(const Params p) {
#if FK_WGRAD_SM90
  asm volatile("griddepcontrol.wait;" ::: "memory");  // launched early (programmatic dependent launch)
  constexpr int kRowPitch = kBlockN + 4;
  __shared__ __align__(16) float rows[16 * kRowPitch];
  const int tile = blockIdx.x, g = blockIdx.y, ct = static_cast<int>(threadIdx.x);
  constexpr int kSlot = kTileElems / 8;  // uint4s (and exponent bytes) a CTA's partial takes
  const std::int64_t first = static_cast<std::int64_t>(tile) * p.splits * kSlot + g * kFixupThreads + ct;
  const uint4* part = reinterpret_cast<const uint4*>(p.workspace) + first;
  const std::uint8_t* exps = p.partial_exps + first;
  float s[8] = {};
  for (int c = 0; c < p.splits; c += 8) {
    uint4 q[8];
    std::uint32_t e[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      q[i] = c + i < p.splits ? __ldcg(part + static_cast<std::int64_t>(c + i) * kSlot) : make_uint4(0, 0, 0, 0);
      e[i] = c + i < p.splits ? __ldcg(exps + static_cast<std::int64_t>(c + i) * kSlot) : 141;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (c + i >= p.splits) break;
      const float inv = __uint_as_float((e[i] - 14) << 23);  // 2^(e - 141)
      const std::uint32_t h[4] = {q[i].x, q[i].y, q[i].z, q[i].w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h[j]));
        s[2 * j] += f.x * inv;
        s[2 * j + 1] += f.y * inv;
      }
    }
  }
  // Value 4 c + e (chunk 2 g + c): row co + 8 c + e % 2, column e / 2 ? hi : lo.
  const AccMap am = acc_map<kBits, kRs>(ct);
#pragma unroll
  for (int i = 0; i < 8; ++i) rows[(am.co + 8 * (i / 4) + i % 2) * kRowPitch + (i / 2 % 2 ? am.ci_hi : am.ci_lo)] = s[i];
  __syncthreads();
  const int r = ct / 32, c4 = 4 * (ct % 32), m0 = tile / p.tiles_n * kBlockM + 16 * g, n = tile % p.tiles_n * kBlockN + c4;
  store_dw4(p, m0 + r, n, *reinterpret_cast<const float4*>(rows + r * kRowPitch + c4));
  store_dw4(p, m0 + r + 8, n, *reinterpret_cast<const float4*>(rows + (r + 8) * kRowPitch + c4));
#else
  __trap();  // the launcher never starts this kernel off sm_90
#endif
}

}  // namespace
}  // namespace fk::cuda::wgrad
