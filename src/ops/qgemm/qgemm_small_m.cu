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
//   - each lane keeps two batches of KU k-tiles x kNT tiles of 16-byte words in flight
//     (ld.global.nc.L1::no_allocate.v4: the words are read once), both issued before x is staged,
//     then each refilled right after its math, plus the scales and zero points of those k-tiles
//     (read through L1: 16 rows share a 32-byte sector). KU = 2 where a group is a multiple of 128
//     (one scale and zero point per batch: the centering constants and the scaling once per
//     group), else 1;
//   - x [M, chunk] is staged once per CTA in shared memory in fragment order (each lane's B
//     fragments of a 32-wide half are one 16-byte load), zero beyond K, with a zero row for the
//     lanes whose row of x does not exist (no predicates in the main loop);
//   - dequantization to q - z exactly (centered_word), the scale applied in fp32 once per group
//     entry, fp32 accumulators.
// Split-K is reduced without a workspace and deterministically: the warps of a CTA put their fp32
// partials in shared memory, and on sm_90 the S CTAs of one block of rows form a thread-block
// cluster (1 x S x 1, S <= 8) whose CTA rank r sums rows r·kBN/S.. of all S·kWarpsK partials through
// distributed shared memory, always in the order (split, warp), then rounds and writes y once.
// The last cluster barrier is arrive.release after every read of another CTA's shared memory and
// wait.acquire before the CTA exits, so no CTA leaves (its shared memory released) while a peer
// still reads it; y is stored between the two. On sm_80 (no clusters) S = 1.
// The push reduction (QgemmOptions::reduction = cluster_push, sm_90; template PUSH) reads no other
// CTA's memory and has no barrier before exit: each CTA has a receive buffer of its own (after x's,
// not aliasing it, so peers may write into it while it still computes) and an mbarrier, initialized
// at the start and published by a cluster barrier arrive that every CTA waits on only before its
// first push. Each lane sends its partials of a row to the row's owner with one 8- or 16-byte
// st.async (complete_tx on the owner's mbarrier; its own rows by plain stores and an arrival), the
// owner waits for its byte count and the arrivals, sums in the same order (split, warp) as the
// pull — the same bytes of y — and exits. A sender may leave as soon as its st.async are issued
// (they carry registers, not its shared memory); an owner leaves only after every byte sent to it
// has landed.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>

#include "fusekit/core/cuda_check.hpp"
#include "ops/common/cuda_common.cuh"
#include "ops/common/activations.cuh"
#include "qgemm_cuda.hpp"
#include "qgemm_device.cuh"

namespace fk::cuda {
namespace {

using namespace qgemm_device;
namespace cg = cooperative_groups;

constexpr int kNT = 2;                   // 16-row tiles per warp
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
  int units_per_group;          // groups of 64+: k-tiles per group; else 32-wide halves (k_pad / 64 or / 32 for one group per row)
  int k_tiles;                  // k_pad / 64
  int tiles_per_warp;           // k-tiles per warp; a CTA covers kWarpsK of them, split y of the grid's y
  int x_stride;                 // pairs of values per row of x in shared memory: kWarpsK * tiles_per_warp * 32 + kXPad
  int recv_offset;              // push: the receive buffer's offset in floats from the start of shared memory
  int recv_floats;              // push: its size in floats; its mbarrier follows it
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// The push reduction's primitives (sm_90): a shared::cta address mapped to CTA `rank` of the
// cluster, and 8- or 16-byte st.async into it counted on that CTA's mbarrier.
__device__ __forceinline__ std::uint32_t map_to_rank(std::uint32_t addr, int rank) {
  std::uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}
__device__ __forceinline__ void st_async(std::uint32_t addr, float a, float b, std::uint32_t bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b32 [%0], {%1, %2}, [%3];\n" ::"r"(addr),
               "r"(__float_as_uint(a)), "r"(__float_as_uint(b)), "r"(bar)
               : "memory");
}
__device__ __forceinline__ void st_async(std::uint32_t addr, float a, float b, float c, float d, std::uint32_t bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];\n" ::"r"(
                   addr),
               "r"(__float_as_uint(a)), "r"(__float_as_uint(b)), "r"(__float_as_uint(c)), "r"(__float_as_uint(d)),
               "r"(bar)
               : "memory");
}
#endif

// The push reduction's receive buffer in the CTA that owns rows [r0, r0 + rows) of the block:
// [split][warp wk][row - r0][MP] floats. A lane's partials of one row (columns 2t, 2t + 1 of each
// n8 tile mt) are one chunk of 2 MT floats at position p = 2 MT t + MT (column % 2) + mt, i.e. column
// (p % MT) * 8 + p / MT, so that it goes in one 8- or 16-byte st.async; chunk t lies at t ^ swizzle
// (row) (fewer bank conflicts when the owner's threads read consecutive rows of one column).
template <int MT>
__device__ __forceinline__ int recv_swizzle(int row) {
  return MT == 1 ? (row / 4) % 4 : (row / 2) % 4;
}

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

// One batch of a lane's loads: KU k-tiles x kNT tiles of words, and per group entry (H: one when
// the batch lies in one group, else one per 32-wide half of its k-tile) the zero words of the
// warp's 2 * kNT 8-row blocks and the scales of the lane's rows g, g + 8 of each tile.
template <int KU, int H>
struct Batch {
  int4 w[KU][kNT];
  uint4 z[H];  // kNT == 2: zero words of 8-row blocks 0..3 of the warp
  unsigned short s[H][kNT][2];
};

// centering_constants and centered_word (q - z exactly): qgemm_device.cuh.

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

// Resident CTAs an SM must hold (the register budget): 3 (80 registers a thread, no spills on
// sm_90a) for one k-tile a batch at M <= 8 with groups of 64+; 2 (128 registers) otherwise (two
// k-tiles a batch take 113 at M <= 8; M <= 16 holds twice the accumulators).
constexpr int min_ctas(int mt, int ku, bool group64) { return mt == 1 && ku == 1 && group64 ? 3 : 2; }

// x in shared memory, in fragment order: per row and k-tile, the 32 pairs of values (k = 2w, 2w + 1
// for pair w = 16 b + 8 h + 4 hi + t: half b, k16 step h, fragment register hi, lane column t) at
// position 8 t + 4 b + 2 h + hi, so that lane (g, t) reads its B fragments of a 32-wide half with
// one 16-byte load. Rows are kXPad pairs longer than the chunk (stride = 4 mod 8 pairs: the two
// rows one quarter-warp reads land in disjoint banks); row m is zero and serves the lanes whose
// row of x does not exist (no predicates in the main loop).
constexpr int kXPad = 4;

// PUSH: the push reduction (QgemmReduction::cluster_push; sm_90 only: elsewhere the pull's code).
template <class T, int MT, int KU, bool GROUP64, bool PUSH>
__global__ void __launch_bounds__(kThreads, min_ctas(MT, KU, GROUP64)) qgemm_small_m_kernel(const SmallMParams<T> p) {
  constexpr int kWarpsN = CtaShape<MT>::WN, kWarpsK = CtaShape<MT>::WK, kBN = CtaShape<MT>::BN;
  constexpr int H = GROUP64 ? 1 : 2;  // group entries per batch with their own scales
  constexpr int MP = MT * 8;          // columns of yᵀ per mma tile row
  static_assert(kNT == 2, "one 16-byte load of zero words covers the warp's 4 blocks of 8 rows");
  static_assert(KU == 1 || GROUP64, "a batch of several k-tiles lies in one group");
  extern __shared__ int4 smem[];
  std::uint32_t* xs = reinterpret_cast<std::uint32_t*>(smem);  // [m + 1][x_stride] pairs, fragment order
  float* red = reinterpret_cast<float*>(smem);  // [kWarpsK][MP][kBN] after the main loop (aliases xs)

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int wn = warp % kWarpsN, wk = warp / kWarpsN;
  const int g = lane / 4, t = lane % 4;
  const int tiles_cta = kWarpsK * p.tiles_per_warp;
  const int kt_cta = blockIdx.y * tiles_cta;                 // first k-tile of the CTA
  const int kt0 = kt_cta + wk * p.tiles_per_warp;            // first k-tile of the warp
  const int nk = max(0, min(p.k_tiles, kt0 + p.tiles_per_warp) - kt0);
  const int nt0 = blockIdx.x * (kWarpsN * kNT) + wn * kNT;  // first 16-row tile of the warp
  const int tiles_n = p.n_pad / 16;

  // Loads of the batch starting at k-tile kt0 + base (KU k-tiles; tiles_per_warp is a multiple of
  // KU and, for KU > 1, of the k-tiles a group spans is a multiple of KU: a batch is all in or out
  // of range and in one group). The group comes from a running counter and pointers, advanced in k
  // order. Groups of 64+ (GROUP64) never run past the last group: K is a multiple of the group
  // there, or there is one group. Otherwise (groups of 32 or 96, ...) entries go by 32-wide halves
  // and stop at the last group (the padding beyond K: x is 0 there).
  const int4* wptr = p.words + (static_cast<std::int64_t>(kt0) * tiles_n + nt0) * 32 + lane;
  const std::int64_t wstep = static_cast<std::int64_t>(tiles_n) * 32;
  const int unit0 = GROUP64 ? kt0 : kt0 * 2;  // k-tiles or halves
  int grp = min(unit0 / p.units_per_group, p.groups - 1), in_grp = unit0 % p.units_per_group;
  const unsigned short* sptr = p.scale + static_cast<std::int64_t>(grp) * p.n_pad + nt0 * 16 + g;
  const uint4* zptr = reinterpret_cast<const uint4*>(p.zero + static_cast<std::int64_t>(grp) * (p.n_pad / 8) + nt0 * 2);
  auto advance = [&](int units) {
    in_grp += units;
    if (in_grp == p.units_per_group) {
      in_grp = 0;
      if (GROUP64 || grp < p.groups - 1) {
        ++grp;
        sptr += p.n_pad;
        zptr += p.n_pad / 32;
      }
    }
  };
  auto load = [&](Batch<KU, H>& b, int base) {
    if (base < nk) {
#pragma unroll
      for (int u = 0; u < KU; ++u) {
#pragma unroll
        for (int i = 0; i < kNT; ++i) b.w[u][i] = load_streaming(wptr + i * 32);
        wptr += wstep;
      }
#pragma unroll
      for (int hb = 0; hb < H; ++hb) {
        b.z[hb] = load_l1(zptr);
#pragma unroll
        for (int i = 0; i < kNT; ++i)
#pragma unroll
          for (int j = 0; j < 2; ++j) b.s[hb][i][j] = load_l1(sptr + i * 16 + j * 8);
        advance(GROUP64 ? KU : 1);
      }
    }
  };

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // A kernel after this one launched as a programmatic dependent may start now (it waits for this
  // one to complete before it reads what this one writes).
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  // Push reduction: this CTA's receive mbarrier expects the bytes of its rows' partials from every
  // other split (st.async transactions, counted by thread 0's first arrival) and one arrival of each
  // of its threads after it stored its own partials of those rows (plain shared stores: no
  // st.async to the executing CTA). Its initialization is made visible to the cluster (fence + the
  // arrive below) before any peer pushes: they wait on the same cluster barrier first, long after.
  float* const recv = reinterpret_cast<float*>(smem) + p.recv_offset;
  const std::uint32_t recv_bar = static_cast<std::uint32_t>(__cvta_generic_to_shared(recv)) +
                                 static_cast<std::uint32_t>(sizeof(float)) * p.recv_floats;
  if constexpr (PUSH) {
    const cg::cluster_group cluster = cg::this_cluster();
    const int splits = static_cast<int>(cluster.num_blocks()), rank = static_cast<int>(cluster.block_rank());
    const int rows = (kBN + splits - 1) / splits, r0 = rank * rows, nr = max(0, min(kBN, r0 + rows) - r0);
    const int chunks_row = min(4, (p.m + 1) / 2);  // lanes t with a column 2t < m
    const std::uint32_t bytes = static_cast<std::uint32_t>((splits - 1) * kWarpsK * nr * chunks_row * 8 * MT);
    if (tid == 0) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(recv_bar), "r"(kThreads + 1) : "memory");
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(recv_bar), "r"(bytes) : "memory");
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
  }
#endif
  Batch<KU, H> cur, nxt;
  // The first two batches are on their way while x is staged.
  load(cur, 0);
  load(nxt, KU);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Launched as a programmatic dependent (constant weights): x is read and y written only after
  // the kernel before this one has completed and its writes are visible. Otherwise a no-op.
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif

  {  // x [m, kt_cta * 64 .. + tiles_cta * 64) -> xs in fragment order, zero beyond K; row m zero
    const int chunks_per_row = tiles_cta * 8;  // 16-byte chunks: 8 values, pairs 4 c .. 4 c + 3
    const int chunks = p.m * chunks_per_row;
    // Loads issued together: one round trip per kAhead chunks a thread (M <= 16 with 8 splits of
    // K = 8192: 8 chunks a thread, one round trip).
    constexpr int kAhead = MT == 1 ? 4 : 8;
    for (int c0 = tid; c0 < chunks; c0 += kAhead * kThreads) {
      uint4 v[kAhead];
#pragma unroll
      for (int a = 0; a < kAhead; ++a) {
        const int c = c0 + a * kThreads, row = c / chunks_per_row, gk = kt_cta * 64 + (c % chunks_per_row) * 8;
        v[a] = make_uint4(0u, 0u, 0u, 0u);
        if (c < chunks && gk < p.k)
          v[a] = load_l1(reinterpret_cast<const uint4*>(p.x + static_cast<std::int64_t>(row) * p.k + gk));
      }
#pragma unroll
      for (int a = 0; a < kAhead; ++a) {
        const int c = c0 + a * kThreads, row = c / chunks_per_row, cc = c % chunks_per_row;
        if (c >= chunks) break;
        // pairs w0 .. w0 + 3 of k-tile cc / 8 (w0 = 4 (cc % 8)): lane column t = 0..3 at 8 t + w0 / 4
        std::uint32_t* dst = xs + row * p.x_stride + (cc / 8) * 32 + cc % 8;
        dst[0] = v[a].x;
        dst[8] = v[a].y;
        dst[16] = v[a].z;
        dst[24] = v[a].w;
      }
    }
    for (int c = tid; c < p.x_stride / 4; c += kThreads)
      reinterpret_cast<uint4*>(xs + p.m * p.x_stride)[c] = make_uint4(0u, 0u, 0u, 0u);
    __syncthreads();
  }
  // This lane's B-fragment rows of x (g, g + 8; row m, all zero, where they do not exist), at the
  // warp's first k-tile and column t.
  const uint4* xrow[MT];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
    xrow[mt] = reinterpret_cast<const uint4*>(xs + min(g + 8 * mt, p.m) * p.x_stride + wk * p.tiles_per_warp * 32 +
                                              t * 8);

  float acc[kNT][MT][4];
#pragma unroll
  for (int i = 0; i < kNT; ++i)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[i][mt][r] = 0.0f;

  // The math of the batch at k-tile kt0 + base (loaded into bt).
  auto compute = [&](const Batch<KU, H>& bt, int base) {
    if (base >= nk) return;
#pragma unroll
    for (int hb = 0; hb < H; ++hb) {
      // Per tile row g, g + 8 (block i * 2 + j of the warp): the centering constants of its zero
      // point and its scale, for this group entry.
      std::uint32_t c0[kNT][2], c1[kNT][2];
      float sf[kNT][2];
      const uint4 zw = bt.z[hb];
#pragma unroll
      for (int i = 0; i < kNT; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int blk = i * 2 + j;
          const std::uint32_t zword = blk == 0 ? zw.x : blk == 1 ? zw.y : blk == 2 ? zw.z : zw.w;
          centering_constants<T>((zword >> (4 * g)) & 0xFu, c0[i][j], c1[i][j]);
          sf[i][j] = scale_to_float<T>(bt.s[hb][i][j]);
        }
      // Σ x · (q - z) over the k16 steps of this group entry, then scaled once per row.
      float part[kNT][MT][4];
#pragma unroll
      for (int u = 0; u < KU; ++u)
#pragma unroll
        for (int bb = 0; bb < 2 / H; ++bb) {
          const int b = GROUP64 ? bb : hb;  // 32-wide half of the k-tile
          // B fragments (x) of the two k16 steps of this half: one 16-byte load per row of x.
          uint4 xv[MT];
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) xv[mt] = xrow[mt][(base + u) * 8 + b];
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
                const std::uint32_t b0 = h == 0 ? xv[mt].x : xv[mt].z, b1 = h == 0 ? xv[mt].y : xv[mt].w;
                if (u == 0 && bb == 0 && h == 0)
                  mma_16816_first<T>(part[i][mt], a, b0, b1);
                else
                  mma_16816<T>(part[i][mt], a, b0, b1);
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
  };

  // Two batches in turn: one in flight while the other is used (no register copies between them).
  for (int base = 0; base < nk; base += 2 * KU) {
    compute(cur, base);
    load(cur, base + 2 * KU);
    compute(nxt, base + KU);
    load(nxt, base + 3 * KU);
  }

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (PUSH) {
    const cg::cluster_group cluster = cg::this_cluster();
    const int splits = static_cast<int>(cluster.num_blocks()), rank = static_cast<int>(cluster.block_rank());
    const int rows = (kBN + splits - 1) / splits;
    // Every CTA's receive mbarrier is initialized (the arrive of the prologue).
    asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
    // This lane's partials of rows g, g + 8 of each tile (c0, c1 / c2, c3: columns 2t, 2t + 1) into
    // the receive buffer of the row's owner, slot (rank, wk); only chunks holding a column < m. Rows
    // this CTA owns: plain shared stores, made visible by each thread's arrival below.
    const std::uint32_t recv_base = static_cast<std::uint32_t>(__cvta_generic_to_shared(recv));
    if (2 * t < p.m) {
#pragma unroll
      for (int i = 0; i < kNT; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = (wn * kNT + i) * 16 + g + 8 * h, dst = row / rows, rl = row - dst * rows;
          const int off = ((rank * kWarpsK + wk) * rows + rl) * MP + (t ^ recv_swizzle<MT>(rl)) * 2 * MT;
          if (dst == rank) {
            if constexpr (MT == 1)
              *reinterpret_cast<float2*>(recv + off) = make_float2(acc[i][0][2 * h], acc[i][0][2 * h + 1]);
            else
              *reinterpret_cast<float4*>(recv + off) =
                  make_float4(acc[i][0][2 * h], acc[i][1][2 * h], acc[i][0][2 * h + 1], acc[i][1][2 * h + 1]);
            continue;
          }
          const std::uint32_t addr = map_to_rank(recv_base + static_cast<std::uint32_t>(sizeof(float) * off), dst);
          const std::uint32_t bar = map_to_rank(recv_bar, dst);
          if constexpr (MT == 1)
            st_async(addr, acc[i][0][2 * h], acc[i][0][2 * h + 1], bar);
          else
            st_async(addr, acc[i][0][2 * h], acc[i][1][2 * h], acc[i][0][2 * h + 1], acc[i][1][2 * h + 1], bar);
        }
    }
    asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];\n" ::"r"(recv_bar) : "memory");
    // The owner: once every split's bytes have landed (no CTA leaves while a peer may still write
    // to it: each waits here for all that is sent to it; a sender's st.async reads registers only,
    // so it may leave right after issuing them), sum in the order (split, warp) as the pull does.
    const int r0 = rank * rows, nr = max(0, min(kBN, r0 + rows) - r0), count = min(p.m, MP) * nr;
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT_RECV:\n"
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], 0;\n"
        "@!done bra WAIT_RECV;\n"
        "}\n" ::"r"(recv_bar)
        : "memory");
    const int n_cta = blockIdx.x * kBN;
    for (int e = tid; e < count; e += kThreads) {
      const int col = e / nr, rl = e % nr, pc = (col % 8) * MT + col / 8;
      const int pos = ((pc / (2 * MT)) ^ recv_swizzle<MT>(rl)) * 2 * MT + pc % (2 * MT);
      float sum = 0.0f;
      for (int s = 0; s < splits; ++s)
#pragma unroll
        for (int w = 0; w < kWarpsK; ++w) sum += recv[((s * kWarpsK + w) * rows + rl) * MP + pos];
      const int n = n_cta + r0 + rl;
      if (n < p.n) p.y[static_cast<std::int64_t>(col) * p.n + n] = device::from_float<T>(sum);
    }
    return;
  }
#endif

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
  cluster.sync();  // arrive.release + wait.acquire: every CTA's partials are visible to the cluster
#else
  constexpr int splits = 1, rank = 0;
  __syncthreads();
#endif
  const int rows = (kBN + splits - 1) / splits, r0 = rank * rows, r1 = min(kBN, r0 + rows);
  const int cols = min(p.m, MP), count = cols * max(0, r1 - r0);
  // A thread sums at most kPerThread outputs (e = tid + kThreads q), all read before the final
  // barrier, stored after its arrive.
  constexpr int kPerThread = (MP * kBN + kThreads - 1) / kThreads;
  float sum[kPerThread];
#pragma unroll
  for (int q = 0; q < kPerThread; ++q) {
    const int e = tid + q * kThreads;
    sum[q] = 0.0f;
    if (e < count) {
      const int col = e / (r1 - r0), row = r0 + e % (r1 - r0);
      // The splits' values are requested 4 at a time before they are added (not one round trip of
      // the distributed shared memory per split), and added in the order (split, warp).
      for (int s0 = 0; s0 < splits; s0 += 4) {
        float v[4][kWarpsK];
#pragma unroll
        for (int d = 0; d < 4; ++d) {
          const int s = min(s0 + d, splits - 1);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
          const float* rs = cluster.map_shared_rank(red, s);
#else
          const float* rs = red;
#endif
#pragma unroll
          for (int w = 0; w < kWarpsK; ++w) v[d][w] = rs[(w * MP + col) * kBN + row];
        }
#pragma unroll
        for (int d = 0; d < 4; ++d)
          if (s0 + d < splits)
#pragma unroll
            for (int w = 0; w < kWarpsK; ++w) sum[q] += v[d][w];
      }
    }
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Every read of another CTA's shared memory is done (release) before this CTA may leave; the
  // stores of y need no ordering, so they go between the arrive and the wait (no fence of global
  // stores in the barrier). No CTA leaves before every CTA of the cluster arrived (acquire).
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
#endif
#pragma unroll
  for (int q = 0; q < kPerThread; ++q) {
    const int e = tid + q * kThreads;
    if (e < count) {
      const int col = e / (r1 - r0), n = n_cta + r0 + e % (r1 - r0);
      if (n < p.n) p.y[static_cast<std::int64_t>(col) * p.n + n] = device::from_float<T>(sum[q]);
    }
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
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
  int recv_offset = 0, recv_floats = 0;  // the push reduction's receive buffer (floats)
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

// The split of K (at most kMaxSplits, the portable cluster size; 1 without clusters): the most
// splits whose clusters all run at once (one wave: a second wave pays every CTA's fixed costs —
// launch, x staging, the reduction — again, and a partial one leaves SMs idle; measured in
// docs/notes/qgemm.md). When no split fits in one wave, the least time by a simple
// model: waves of clusters x k-tiles per CTA; ties go to more splits. A warp's k-tiles are a
// multiple of KU (the k-tiles of one batch). False when x's chunk never fits a CTA's shared memory.
// push: the push reduction's receive buffer (its own region after x's, and its mbarrier) instead of
// partials in x's place, with the pull's split (so that both reductions give the same bytes of y:
// the split is chosen by the pull's shared memory; the push's larger CTA must still fit).
template <int kWarpsK, int kBN, int KU, class Kernel>
bool plan_split(Kernel kernel, int m, int mp, int n_blocks, int k_tiles, int device, bool push, Plan& plan) {
  const DeviceFacts f = device_facts(device);
  const int by_regs = resident_by_registers(kernel, device, f);
  int most = f.major >= 9 ? std::min(kMaxSplits, std::max(1, k_tiles / (kWarpsK * KU))) : 1;
  long best = -1;
  bool one_wave = false;
  for (int s = most; s >= 1; --s) {
    Plan c;
    c.tiles_per_warp = (k_tiles + s * kWarpsK - 1) / (s * kWarpsK);
    c.tiles_per_warp = (c.tiles_per_warp + KU - 1) / KU * KU;
    c.splits = (k_tiles + kWarpsK * c.tiles_per_warp - 1) / (kWarpsK * c.tiles_per_warp);  // no empty split
    if (c.splits != s) continue;  // the same plan as a larger s
    c.x_stride = kWarpsK * c.tiles_per_warp * 32 + kXPad;
    const std::size_t x_bytes = static_cast<std::size_t>(m + 1) * c.x_stride * 4;
    const std::size_t red_bytes = static_cast<std::size_t>(kWarpsK) * mp * kBN * 4;
    c.smem = std::max(x_bytes, red_bytes);
    if (push) {
      const int rows = (kBN + s - 1) / s;
      c.recv_offset = static_cast<int>((x_bytes + 15) / 16 * 4);
      c.recv_floats = s * kWarpsK * rows * mp;
    }
    if (c.smem > static_cast<std::size_t>(f.smem_optin)) continue;
    const int clusters = std::max(1, active_clusters(kernel, device, s, c.smem, by_regs, f));
    const long waves = (n_blocks + clusters - 1) / clusters;
    const long cost = waves * kWarpsK * c.tiles_per_warp;
    if (waves == 1 && !one_wave) {
      one_wave = true;  // the first, i.e. the most splits in one wave
      best = cost;
      plan = c;
    } else if (!one_wave && (best < 0 || cost < best)) {
      best = cost;
      plan = c;
    }
  }
  if (best < 0) return false;
  if (push) {
    plan.smem = static_cast<std::size_t>(plan.recv_offset + plan.recv_floats) * 4 + 16;  // + the mbarrier
    if (plan.smem > static_cast<std::size_t>(f.smem_optin)) return false;
  }
  return true;
}

template <class T, int MT, int KU, bool GROUP64, bool PUSH>
bool launch_small_m(const TensorView& x, const QuantizedWeight& qw, const TensorView& y, const Stream* stream,
                    const QgemmOptions& options) {
  using C = CtaShape<MT>;
  const bool sm90 = device_facts(y.device().index).major >= 9;
  const auto kernel = qgemm_small_m_kernel<T, MT, KU, GROUP64, PUSH>;
  const int m = static_cast<int>(x.size(0)), n = static_cast<int>(qw.n);
  const int k_tiles = static_cast<int>(qw.k_pad() / 64), n_blocks = (n + C::BN - 1) / C::BN;
  Plan plan;
  if (!plan_split<C::WK, C::BN, KU>(kernel, m, MT * 8, n_blocks, k_tiles, y.device().index, PUSH, plan)) return false;

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
  const int group = qw.groups() == 1 ? static_cast<int>(qw.k_pad()) : qw.group;
  p.units_per_group = GROUP64 ? group / 64 : group / 32;
  p.k_tiles = k_tiles;
  p.tiles_per_warp = plan.tiles_per_warp;
  p.x_stride = plan.x_stride;
  p.recv_offset = plan.recv_offset;
  p.recv_floats = plan.recv_floats;

  cudaLaunchConfig_t config{};
  config.gridDim = dim3(n_blocks, plan.splits, 1);
  config.blockDim = dim3(kThreads, 1, 1);
  config.dynamicSmemBytes = plan.smem;
  config.stream = fk::detail::cuda_stream(stream);
  cudaLaunchAttribute attrs[2]{};
  unsigned n_attrs = 0;
  if (plan.splits > 1) {
    cudaLaunchAttribute& a = attrs[n_attrs++];
    a.id = cudaLaunchAttributeClusterDimension;
    a.val.clusterDim.x = 1;
    a.val.clusterDim.y = static_cast<unsigned>(plan.splits);
    a.val.clusterDim.z = 1;
  }
  // Constant weights on sm_90: a programmatic dependent launch (the kernel waits with
  // griddepcontrol.wait after its first weight loads, before it reads x).
  if (options.constant_weights && sm90) {
    cudaLaunchAttribute& a = attrs[n_attrs++];
    a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    a.val.programmaticStreamSerializationAllowed = 1;
  }
  config.attrs = n_attrs > 0 ? attrs : nullptr;
  config.numAttrs = n_attrs;
  FK_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, p));
  FK_CUDA_CHECK_LAUNCH("qgemm_small_m_kernel");
  return true;
}

}  // namespace

bool qgemm_small_m(const TensorView& x, const QuantizedWeight& qw, const TensorView& y, const Stream* stream,
                   const QgemmOptions& options) {
  const std::int64_t m = x.size(0);
  if (m > 16) return false;
  // A group that is a multiple of 64 (or one group per row) has one scale per row and k-tile; one
  // that is a multiple of 128 (more than one group) one per batch of two k-tiles.
  const bool group64 = qw.groups() == 1 || qw.group % 64 == 0;
  const bool group128 = qw.groups() > 1 && qw.group % 128 == 0;
  // The push reduction needs sm_90 (clusters, st.async); elsewhere the pull runs (one split).
  const bool push =
      options.reduction == QgemmReduction::cluster_push && device_facts(y.device().index).major >= 9;
  bool done = false;
  with_float_type(qw.dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, float>) {
      throw_internal("qgemm: f32 weights are not packed");
    } else {
      auto run = [&](auto mt, auto ku, auto g64) {
        constexpr int MT = decltype(mt)::value, KU = decltype(ku)::value;
        constexpr bool G64 = decltype(g64)::value;
        done = push ? launch_small_m<T, MT, KU, G64, true>(x, qw, y, stream, options)
                    : launch_small_m<T, MT, KU, G64, false>(x, qw, y, stream, options);
      };
      using One = std::integral_constant<int, 1>;
      using Two = std::integral_constant<int, 2>;
      const auto mt = [&](auto m_tiles) {
        if (group128)
          run(m_tiles, Two{}, std::true_type{});
        else if (group64)
          run(m_tiles, One{}, std::true_type{});
        else
          run(m_tiles, One{}, std::false_type{});
      };
      if (m <= 8)
        mt(One{});
      else
        mt(Two{});
    }
  });
  return done;
}

}  // namespace fk::cuda
