// qgemm for small M (M <= 16): y [M, N] = x [M, K] · w̃ᵀ, bound by reading the 4-bit weights once.
//
// The weight is the mma's A operand (yᵀ = w̃ · xᵀ, m16n8k16 with 16 rows of N as "M" and the rows of
// x as "N": one n8 tile for M <= 8, two for M <= 16), so that no tensor-core work is spent on
// padding beyond 8 rows of x. The packed layout (qgemm_layout.hpp) holds, per lane, the words of
// rows g and g + 8 of a 16-row tile for k = 2t, 2t+1, 2t+8, 2t+9 (+16): exactly the A fragment, so
// the words go from global memory into registers and straight into mma.sync, never through shared
// memory:
//   - a CTA is 8 warps, kWarpsN along N (kNT 16-row tiles each) x kWarpsK along K (4 x 2 for
//     M <= 8, 8 x 1 for M <= 16: CtaShape); it owns kBN = 128 or 256 rows and a chunk of K; the
//     grid's y dimension splits K further (S chunks);
//   - each lane keeps two batches of kU k-tiles x kNT tiles of 16-byte words in flight
//     (ld.global.nc.L1::no_allocate.v4: the words are read once), issued one batch ahead of the
//     math, plus the scales and zero points of those k-tiles (read through L1: 16 rows share a
//     32-byte sector);
//   - x [M, chunk] is staged once per CTA in shared memory (cp.async, zero beyond K), read as the
//     mma's B fragments (rows padded by 16 bytes: no bank conflicts);
//   - dequantization as in the tensor-core path (qgemm_device.cuh): bit-identical to
//     dequantize_weights, fp32 accumulators.
// Split-K is reduced without a workspace and deterministically: the warps of a CTA put their fp32
// partials in shared memory, and on sm_90 the S CTAs of one 128-row block form a thread-block
// cluster (1 x S x 1, S <= 8) whose CTA rank r sums rows r·kBN/S.. of all S·kWarpsK partials through
// distributed shared memory, always in the order (split, warp), then rounds and writes y once.
// On sm_80 (no clusters) S = 1.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>

#include "fusekit/core/cuda_check.hpp"
#include "ops/cuda_common.cuh"
#include "ops/pointwise/activations.cuh"
#include "qgemm_cuda.hpp"
#include "qgemm_device.cuh"

namespace fk::cuda {
namespace {

using namespace qgemm_device;
namespace cg = cooperative_groups;

constexpr int kNT = 2;                   // 16-row tiles per warp
constexpr int kU = 1;                    // k-tiles (64 of K) per batch of loads
constexpr int kThreads = 256;
constexpr int kMaxSplits = 8;            // portable cluster size

// The warps of a CTA: WN along N (kNT 16-row tiles each) x WK along K. M <= 8 splits K inside the
// CTA (4 x 2: 128 rows); M <= 16, whose x chunk is twice as large, gives each x chunk more rows
// (8 x 1: 256 rows: in an H100 run of a variant, 24 % faster at M = 16 for N x K = 11008 x 4096
// and 8192 x 8192, 2 % at 4096 x 4096, and slower at M = 1).
template <int MT>
struct CtaShape {
  static constexpr int WN = MT == 1 ? 4 : 8;
  static constexpr int WK = kThreads / 32 / WN;
  static constexpr int BN = WN * kNT * 16;  // rows of N per CTA
  static_assert(WN * WK * 32 == kThreads);
  static_assert(kQgemmRowPad % BN == 0, "a CTA's rows never pass the padded rows");
};

template <class T>
struct SmallMParams {
  const T* x;                   // [m, k]
  const int4* words;            // packed: [k_pad / 64][n_pad / 16][32 lanes] of 16 bytes
  const unsigned short* scale;  // [groups, n_pad], T's bits
  const std::uint32_t* zero;    // [groups, n_pad / 8]
  T* y;                         // [m, n]
  int m, n, k, n_pad, groups;
  int halves_per_group;         // group / 32 (k_pad / 32 for one group per row)
  int k_tiles;                  // k_pad / 64
  int tiles_per_warp;           // k-tiles per warp; a CTA covers kWarpsK of them, split z of the grid's y
  int x_stride;                 // halves per row of x in shared memory: kWarpsK * tiles_per_warp * 64 + 8
};

__device__ __forceinline__ uint4 load_l1(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ unsigned short load_l1(const unsigned short* p) {
  unsigned short v;
  asm volatile("ld.global.nc.u16 %0, [%1];\n" : "=h"(v) : "l"(p));
  return v;
}
// Scales and zero points are read through L1 (the 16 rows of a tile share a sector, and the k-tiles
// of a group the same values); the words stream past it. All volatile, so that a batch's loads
// are issued together, one batch ahead of the math that uses them.
__device__ __forceinline__ int4 load_streaming(const int4* p) {
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// One batch of a lane's loads: kU k-tiles x kNT tiles of words, and per k-tile and group-half hb
// (one when a group spans whole k-tiles) the zero words of the warp's 2 * kNT 8-row blocks and the
// scales of the lane's rows g, g + 8 of each tile.
template <int H>
struct Batch {
  int4 w[kU][kNT];
  uint4 z[kU][H];  // kNT == 2: zero words of 8-row blocks 0..3 of the warp
  unsigned short s[kU][H][kNT][2];
};

// q - z for the 8 values of one word, as the four mma fragment registers (register i: nibbles i and
// i + 4), exactly: f16 takes nibbles 0-3 / 8-11 as (1024 + q) - (1024 + z) (one LOP3, one HSUB2) and
// nibbles 4-7 / 12-15 unshifted as (1024 + 16 q) / 16 - (64 + z) (one LOP3, one HFMA2: the product
// and the sum are exact); bf16 (7 mantissa bits: no room for 16 q) shifts every nibble down and
// takes (128 + q) - (128 + z). c0 and c1 are the per-row constants of centering_constants.
// (a & mask) | c in one LOP3 (the compiler splits it in two when both constants are immediates).
template <std::uint32_t MASK>
__device__ __forceinline__ std::uint32_t and_or(std::uint32_t a, std::uint32_t c) {
  std::uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(r) : "r"(a), "n"(MASK), "r"(c));
  return r;
}

template <class T>
__device__ __forceinline__ void centering_constants(std::uint32_t z, std::uint32_t& c0, std::uint32_t& c1) {
  c0 = z * 0x10001u + Half2<T>::magic * 0x10001u;                  // magic + z, both halves
  c1 = std::is_same_v<T, __half> ? z * 0x100010u + 0xD400D400u : c0;  // f16 -(64 + z): z in the mantissa at 2^-4
}
template <class T>
__device__ __forceinline__ void centered_word(std::uint32_t q, std::uint32_t c0, std::uint32_t c1, std::uint32_t (&out)[4]) {
  using T2 = typename Half2<T>::type;
  constexpr std::uint32_t magic = Half2<T>::magic * 0x10001u;
  const std::uint32_t q8 = q >> 8;
  if constexpr (std::is_same_v<T, __half>) {
    const __half2 sixteenth = bits_as<__half2>(0x2C002C00u);  // 1/16
    out[0] = bits_as<std::uint32_t>(__hsub2(bits_as<T2>(and_or<0x000F000Fu>(q, magic)), bits_as<T2>(c0)));
    out[1] = bits_as<std::uint32_t>(__hfma2(bits_as<T2>(and_or<0x00F000F0u>(q, magic)), sixteenth, bits_as<T2>(c1)));
    out[2] = bits_as<std::uint32_t>(__hsub2(bits_as<T2>(and_or<0x000F000Fu>(q8, magic)), bits_as<T2>(c0)));
    out[3] = bits_as<std::uint32_t>(__hfma2(bits_as<T2>(and_or<0x00F000F0u>(q8, magic)), sixteenth, bits_as<T2>(c1)));
  } else {
    (void)c1;
    out[0] = bits_as<std::uint32_t>(__hsub2(bits_as<T2>(and_or<0x000F000Fu>(q, magic)), bits_as<T2>(c0)));
    out[1] = bits_as<std::uint32_t>(__hsub2(bits_as<T2>(and_or<0x000F000Fu>(q >> 4, magic)), bits_as<T2>(c0)));
    out[2] = bits_as<std::uint32_t>(__hsub2(bits_as<T2>(and_or<0x000F000Fu>(q8, magic)), bits_as<T2>(c0)));
    out[3] = bits_as<std::uint32_t>(__hsub2(bits_as<T2>(and_or<0x000F000Fu>(q >> 12, magic)), bits_as<T2>(c0)));
  }
}

template <class T>
__device__ __forceinline__ float scale_to_float(unsigned short bits) {
  if constexpr (std::is_same_v<T, __half>)
    return __half2float(__ushort_as_half(bits));
  else
    return __uint_as_float(static_cast<std::uint32_t>(bits) << 16);
}

// c = a · b (m16n8k16, fp32), the accumulator starting at zero.
template <class T>
__device__ __forceinline__ void mma_16816_first(float (&c)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                                std::uint32_t b1) {
  const float z = 0.0f;
  if constexpr (std::is_same_v<T, __half>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%10,%10,%10};\n"
        : "=f"(c[0]), "=f"(c[1]), "=f"(c[2]), "=f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(z));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%10,%10,%10};\n"
        : "=f"(c[0]), "=f"(c[1]), "=f"(c[2]), "=f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(z));
  }
}

// Resident CTAs an SM must hold (the register budget: 80 or 128 a thread): 3 where the kernel fits
// in 80 registers without spilling.
constexpr int min_ctas(int mt, bool group64) { return mt == 1 && group64 ? 3 : 2; }

template <class T, int MT, bool GROUP64>
__global__ void __launch_bounds__(kThreads, min_ctas(MT, GROUP64)) qgemm_small_m_kernel(const SmallMParams<T> p) {
  constexpr int kWarpsN = CtaShape<MT>::WN, kWarpsK = CtaShape<MT>::WK, kBN = CtaShape<MT>::BN;
  constexpr int H = GROUP64 ? 1 : 2;  // group halves per k-tile with their own scales
  constexpr int MP = MT * 8;          // columns of yᵀ per mma tile row
  static_assert(kNT == 2, "one 16-byte load of zero words covers the warp's 4 blocks of 8 rows");
  extern __shared__ int4 smem[];
  T* xs = reinterpret_cast<T*>(smem);            // [m][x_stride]: x of the CTA's chunk
  float* red = reinterpret_cast<float*>(smem);   // [kWarpsK][MP][kBN] after the main loop (aliases xs)

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int wn = warp % kWarpsN, wk = warp / kWarpsN;
  const int g = lane / 4, t = lane % 4;
  const int tiles_cta = kWarpsK * p.tiles_per_warp;
  const int kt_cta = blockIdx.y * tiles_cta;                 // first k-tile of the CTA
  const int kt0 = kt_cta + wk * p.tiles_per_warp;            // first k-tile of the warp
  const int nk = max(0, min(p.k_tiles, kt0 + p.tiles_per_warp) - kt0);
  const int nt0 = blockIdx.x * (kWarpsN * kNT) + wn * kNT;  // first 16-row tile of the warp
  const int tiles_n = p.n_pad / 16;

  // Loads of the batch starting at k-tile kt0 + base. The group of each k-tile half comes from a
  // running (group, half within it) pair and pointers, advanced in k order; the group stops at the
  // last one (padding beyond K: x is 0 there).
  const int4* wptr = p.words + (static_cast<std::int64_t>(kt0) * tiles_n + nt0) * 32 + lane;
  const std::int64_t wstep = static_cast<std::int64_t>(tiles_n) * 32;
  int grp = min((kt0 * 2) / p.halves_per_group, p.groups - 1), half_in_grp = (kt0 * 2) % p.halves_per_group;
  const unsigned short* sptr = p.scale + static_cast<std::int64_t>(grp) * p.n_pad + nt0 * 16 + g;
  const uint4* zptr = reinterpret_cast<const uint4*>(p.zero + static_cast<std::int64_t>(grp) * (p.n_pad / 8) + nt0 * 2);
  auto load = [&](Batch<H>& b, int base) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      if (base + u < nk) {
#pragma unroll
        for (int i = 0; i < kNT; ++i) b.w[u][i] = load_streaming(wptr + i * 32);
        wptr += wstep;
#pragma unroll
        for (int hb = 0; hb < H; ++hb) {
          b.z[u][hb] = load_l1(zptr);
#pragma unroll
          for (int i = 0; i < kNT; ++i)
#pragma unroll
            for (int j = 0; j < 2; ++j) b.s[u][hb][i][j] = load_l1(sptr + i * 16 + j * 8);
          // Advance by the halves this entry covers (2 when one entry serves the whole k-tile).
#pragma unroll
          for (int a = 0; a < 2 / H; ++a)
            if (++half_in_grp == p.halves_per_group) {
              half_in_grp = 0;
              if (grp < p.groups - 1) {
                ++grp;
                sptr += p.n_pad;
                zptr += p.n_pad / 32;
              }
            }
        }
      }
    }
  };

  Batch<H> cur, nxt;
  load(cur, 0);  // the first weights are on their way while x is staged

  {  // x [m, kt_cta * 64 .. + tiles_cta * 64) -> xs, zero beyond K
    const int chunks_per_row = tiles_cta * 8;
    const std::uint32_t sx = static_cast<std::uint32_t>(__cvta_generic_to_shared(xs));
    for (int c = tid; c < p.m * chunks_per_row; c += kThreads) {
      const int row = c / chunks_per_row, col = (c % chunks_per_row) * 8, gk = kt_cta * 64 + col;
      const bool in = gk < p.k;
      const T* src = in ? p.x + static_cast<std::int64_t>(row) * p.k + gk : p.x;
      cp_async_16(sx + (row * p.x_stride + col) * 2, src, in ? 16 : 0);
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
  }
  // This lane's B-fragment rows of x (g, g + 8), as pairs of values, at k = 2t.
  const std::uint32_t* xrow[MT];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
    xrow[mt] = reinterpret_cast<const std::uint32_t*>(xs) + (g + 8 * mt) * (p.x_stride / 2) + t;

  float acc[kNT][MT][4];
#pragma unroll
  for (int i = 0; i < kNT; ++i)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[i][mt][r] = 0.0f;

  // The math of the batch at k-tile kt0 + base (loaded into bt).
  auto compute = [&](const Batch<H>& bt, int base) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      if (base + u >= nk) break;
      const unsigned xk = static_cast<unsigned>(wk * p.tiles_per_warp + base + u) * 32;  // the k-tile in xs, in pairs
#pragma unroll
      for (int hb = 0; hb < H; ++hb) {
        // Per tile row g, g + 8 (block i * 2 + j of the warp): the centering constants of its zero
        // point and its scale, for this group.
        std::uint32_t c0[kNT][2], c1[kNT][2];
        float sf[kNT][2];
        const uint4 zw = bt.z[u][hb];
#pragma unroll
        for (int i = 0; i < kNT; ++i)
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const int blk = i * 2 + j;
            const std::uint32_t zword = blk == 0 ? zw.x : blk == 1 ? zw.y : blk == 2 ? zw.z : zw.w;
            centering_constants<T>((zword >> (4 * g)) & 0xFu, c0[i][j], c1[i][j]);
            sf[i][j] = scale_to_float<T>(bt.s[u][hb][i][j]);
          }
        // Σ x · (q - z) over the k16 steps of this group entry, then scaled once per row.
        float part[kNT][MT][4];
#pragma unroll
        for (int bb = 0; bb < 2 / H; ++bb) {
          const int b = GROUP64 ? bb : hb;  // 32-wide half of the k-tile
          // B fragments (x) of the two k16 steps of this half: rows g (+ 8) of x, k = 2t.. and 2t + 8..
          std::uint32_t xb[2][MT][2];
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
              const std::uint32_t* at = xrow[mt] + xk + b * 16 + h * 8;
              xb[h][mt][0] = g + 8 * mt < p.m ? at[0] : 0u;
              xb[h][mt][1] = g + 8 * mt < p.m ? at[4] : 0u;
            }
#pragma unroll
          for (int i = 0; i < kNT; ++i) {
            const int4 v = bt.w[u][i];
            std::uint32_t deq[2][4];  // rows g, g + 8 of the tile: q - z, exact
#pragma unroll
            for (int j = 0; j < 2; ++j) {
              const int slot = j * 2 + b;
              const int q = slot == 0 ? v.x : slot == 1 ? v.y : slot == 2 ? v.z : v.w;
              centered_word<T>(static_cast<std::uint32_t>(q), c0[i][j], c1[i][j], deq[j]);
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const std::uint32_t a[4] = {deq[0][2 * h], deq[1][2 * h], deq[0][2 * h + 1], deq[1][2 * h + 1]};
#pragma unroll
              for (int mt = 0; mt < MT; ++mt) {
                if (bb == 0 && h == 0)
                  mma_16816_first<T>(part[i][mt], a, xb[h][mt][0], xb[h][mt][1]);
                else
                  mma_16816<T>(part[i][mt], a, xb[h][mt][0], xb[h][mt][1]);
              }
            }
          }
        }
        // c0, c1: row g; c2, c3: row g + 8.
#pragma unroll
        for (int i = 0; i < kNT; ++i)
#pragma unroll
          for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int r = 0; r < 4; ++r) acc[i][mt][r] = fmaf(sf[i][r / 2], part[i][mt][r], acc[i][mt][r]);
      }
    }
  };

  // Two batches in turn: one in flight while the other is used (no register copies between them).
  for (int base = 0; base < nk; base += 2 * kU) {
    if (base + kU < nk) load(nxt, base + kU);
    compute(cur, base);
    if (base + kU >= nk) break;
    if (base + 2 * kU < nk) load(cur, base + 2 * kU);
    compute(nxt, base + kU);
  }

  // Partials of the CTA's warps -> red [wk][col][row] (c0, c1: row g, columns 2t, 2t + 1; c2, c3: row g + 8).
  __syncthreads();  // every warp is done with xs
#pragma unroll
  for (int i = 0; i < kNT; ++i)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int row = (wn * kNT + i) * 16 + g + 8 * (r / 2), col = mt * 8 + 2 * t + r % 2;
        red[(wk * MP + col) * kBN + row] = acc[i][mt][r];
      }

  // Sum over (split, warp) in that order; CTA rank r of the cluster takes rows [r0, r1) of the block.
  const int n_cta = blockIdx.x * kBN;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const cg::cluster_group cluster = cg::this_cluster();
  const int splits = static_cast<int>(cluster.num_blocks()), rank = static_cast<int>(cluster.block_rank());
  cluster.sync();
#else
  constexpr int splits = 1, rank = 0;
  __syncthreads();
#endif
  const int rows = (kBN + splits - 1) / splits, r0 = rank * rows, r1 = min(kBN, r0 + rows);
  const int cols = min(p.m, MP);
  for (int e = tid; e < cols * (r1 - r0); e += kThreads) {
    const int col = e / (r1 - r0), row = r0 + e % (r1 - r0), n = n_cta + row;
    if (n >= p.n) continue;
    float sum = 0.0f;
    for (int s = 0; s < splits; ++s) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      const float* rs = cluster.map_shared_rank(red, s);
#else
      const float* rs = red;
#endif
      float v[kWarpsK];
#pragma unroll
      for (int w = 0; w < kWarpsK; ++w) v[w] = rs[(w * MP + col) * kBN + row];
#pragma unroll
      for (int w = 0; w < kWarpsK; ++w) sum += v[w];
    }
    p.y[static_cast<std::int64_t>(col) * p.n + n] = device::from_float<T>(sum);
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cluster.sync();  // no CTA leaves while another still reads its shared memory
#endif
}

// Per device: SMs, compute capability, the shared memory an SM has for CTAs, per CTA at most.
struct DeviceFacts {
  int sms = 0, major = 0, smem_per_sm = 0, smem_reserved = 0, smem_optin = 0;
};
DeviceFacts device_facts(int device) {
  static std::mutex mutex;
  static std::map<int, DeviceFacts> facts;
  const std::lock_guard<std::mutex> lock(mutex);
  if (const auto it = facts.find(device); it != facts.end()) return it->second;
  DeviceFacts f;
  FK_CUDA_CHECK(cudaDeviceGetAttribute(&f.sms, cudaDevAttrMultiProcessorCount, device));
  FK_CUDA_CHECK(cudaDeviceGetAttribute(&f.major, cudaDevAttrComputeCapabilityMajor, device));
  FK_CUDA_CHECK(cudaDeviceGetAttribute(&f.smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
  FK_CUDA_CHECK(cudaDeviceGetAttribute(&f.smem_reserved, cudaDevAttrReservedSharedMemoryPerBlock, device));
  FK_CUDA_CHECK(cudaDeviceGetAttribute(&f.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  return facts[device] = f;
}

// CTAs of `kernel` an SM holds by its registers and threads alone (after opting in to all of the
// shared memory a CTA may have), once per kernel and device.
template <class Kernel>
int resident_by_registers(Kernel kernel, int device, const DeviceFacts& f) {
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, int> per_sm;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(reinterpret_cast<const void*>(kernel), device);
  if (const auto it = per_sm.find(key); it != per_sm.end()) return it->second;
  FK_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, f.smem_optin));
  FK_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                     cudaSharedmemCarveoutMaxShared));
  int n = 0;
  FK_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, 0));
  return per_sm[key] = std::max(1, n);
}

struct Plan {
  int splits = 1, tiles_per_warp = 1, x_stride = 0;
  std::size_t smem = 0;
};

// Clusters of `splits` CTAs (each with `smem` bytes of shared memory) the device runs at once: a
// cluster lives in one GPC, so this is less than the resident CTAs / splits (on an H100 with 2
// CTAs an SM: 62 clusters of 4, not 66). Once per kernel, device, size and shared memory.
template <class Kernel>
int active_clusters(Kernel kernel, int device, int splits, std::size_t smem, int by_regs, const DeviceFacts& f) {
  const int by_smem = f.smem_per_sm / static_cast<int>(smem + f.smem_reserved);
  if (splits == 1) return std::max(1, std::min(by_regs, by_smem)) * f.sms;
  static std::mutex mutex;
  static std::map<std::tuple<const void*, int, int, std::size_t>, int> cache;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_tuple(reinterpret_cast<const void*>(kernel), device, splits, smem);
  if (const auto it = cache.find(key); it != cache.end()) return it->second;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(1, static_cast<unsigned>(splits), 1);
  config.blockDim = dim3(kThreads, 1, 1);
  config.dynamicSmemBytes = smem;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = 1;
  attr.val.clusterDim.y = static_cast<unsigned>(splits);
  attr.val.clusterDim.z = 1;
  config.attrs = &attr;
  config.numAttrs = 1;
  int clusters = 0;
  FK_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &config));
  return cache[key] = clusters;
}

// The split of K (at most kMaxSplits, the portable cluster size; 1 without clusters) with the
// least time by a simple model: waves of clusters x k-tiles per CTA (the CTAs of a wave stream
// concurrently); ties go to more splits (more CTAs share the memory system). False when x's chunk
// never fits a CTA's shared memory.
template <int kWarpsK, int kBN, class Kernel>
bool plan_split(Kernel kernel, int m, int mp, int n_blocks, int k_tiles, int device, Plan& plan) {
  const DeviceFacts f = device_facts(device);
  const int by_regs = resident_by_registers(kernel, device, f);
  const int most = f.major >= 9 ? std::min(kMaxSplits, std::max(1, k_tiles / kWarpsK)) : 1;
  long best = -1;
  for (int s = most; s >= 1; --s) {
    Plan c;
    c.tiles_per_warp = (k_tiles + s * kWarpsK - 1) / (s * kWarpsK);
    c.splits = (k_tiles + kWarpsK * c.tiles_per_warp - 1) / (kWarpsK * c.tiles_per_warp);  // no empty split
    if (c.splits != s) continue;  // the same plan as a larger s
    c.x_stride = kWarpsK * c.tiles_per_warp * 64 + 8;
    const std::size_t x_bytes = static_cast<std::size_t>(m) * c.x_stride * 2;
    const std::size_t red_bytes = static_cast<std::size_t>(kWarpsK) * mp * kBN * 4;
    c.smem = std::max(x_bytes, red_bytes);
    if (c.smem > static_cast<std::size_t>(f.smem_optin)) continue;
    const int clusters = std::max(1, active_clusters(kernel, device, s, c.smem, by_regs, f));
    const long waves = (n_blocks + clusters - 1) / clusters;
    const long cost = waves * kWarpsK * c.tiles_per_warp;
    if (best < 0 || cost < best) {
      best = cost;
      plan = c;
    }
  }
  return best >= 0;
}

template <class T, int MT, bool GROUP64>
bool launch_small_m(const TensorView& x, const QuantizedWeight& qw, const TensorView& y, const Stream* stream) {
  using C = CtaShape<MT>;
  const auto kernel = qgemm_small_m_kernel<T, MT, GROUP64>;
  const int m = static_cast<int>(x.size(0)), n = static_cast<int>(qw.n);
  const int k_tiles = static_cast<int>(qw.k_pad() / 64), n_blocks = (n + C::BN - 1) / C::BN;
  Plan plan;
  if (!plan_split<C::WK, C::BN>(kernel, m, MT * 8, n_blocks, k_tiles, y.device().index, plan)) return false;

  SmallMParams<T> p{};
  p.x = x.data_as<const T>();
  p.words = qw.packed.data_as<const int4>();
  p.scale = qw.scale.data_as<const unsigned short>();
  p.zero = qw.zero.data_as<const std::uint32_t>();
  p.y = y.data_as<T>();
  p.m = m;
  p.n = n;
  p.k = static_cast<int>(qw.k);
  p.n_pad = static_cast<int>(qw.n_pad());
  p.groups = static_cast<int>(qw.groups());
  p.halves_per_group = (qw.groups() == 1 ? static_cast<int>(qw.k_pad()) : qw.group) / 32;
  p.k_tiles = k_tiles;
  p.tiles_per_warp = plan.tiles_per_warp;
  p.x_stride = plan.x_stride;

  cudaLaunchConfig_t config{};
  config.gridDim = dim3(n_blocks, plan.splits, 1);
  config.blockDim = dim3(kThreads, 1, 1);
  config.dynamicSmemBytes = plan.smem;
  config.stream = fk::detail::cuda_stream(stream);
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = 1;
  attr.val.clusterDim.y = static_cast<unsigned>(plan.splits);
  attr.val.clusterDim.z = 1;
  if (plan.splits > 1) {
    config.attrs = &attr;
    config.numAttrs = 1;
  }
  FK_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, p));
  FK_CUDA_CHECK_LAUNCH("qgemm_small_m_kernel");
  return true;
}

}  // namespace

bool qgemm_small_m(const TensorView& x, const QuantizedWeight& qw, const TensorView& y, const Stream* stream) {
  const std::int64_t m = x.size(0);
  if (m > 16) return false;
  // A group that is a multiple of 64 (or one group per row) has one scale per row and k-tile.
  const bool group64 = qw.groups() == 1 || qw.group % 64 == 0;
  bool done = false;
  with_float_type(qw.dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, float>) {
      throw_internal("qgemm: f32 weights are not packed");
    } else {
      if (m <= 8)
        done = group64 ? launch_small_m<T, 1, true>(x, qw, y, stream) : launch_small_m<T, 1, false>(x, qw, y, stream);
      else
        done = group64 ? launch_small_m<T, 2, true>(x, qw, y, stream) : launch_small_m<T, 2, false>(x, qw, y, stream);
    }
  });
  return done;
}

}  // namespace fk::cuda
