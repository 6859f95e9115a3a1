// weight_grad_from_packed on the GPU: dW [COUT, CIN] = beta * dW + dyᵀ · x̂, where dy [K, COUT] is
// bf16 row-major and x̂ [K, CIN] is dequantized on the fly from the packed activations (1, 2, 4 or
// 8 bits, group-wise scale and minimum; docs/quant-format.md). x̂ never exists in global memory:
// the packed words are read once per 256-row block of dW (3 times for COUT = 768), dy once per
// 128-column block of dW (6 times for CIN = 768, mostly from L2), dW written once.
//
// The GEMM (M = COUT, N = CIN, reduction over K) runs on Hopper tensor cores (wgmma, sm_90a).
// A CTA computes a 256x128 tile of dW in 64-deep k-blocks with three warpgroups:
//   - the producer warpgroup fills a 4-stage shared-memory ring. One thread brings the dy
//     k-block (the A operand, 64 k x 256 m, M-major) by TMA with the 128-byte swizzle; all 128
//     threads dequantize the x k-block (64 k x 128 n) into bf16 in the same swizzled M/N-major
//     layout that wgmma reads as its B operand. Each thread owns 64 columns of one row: it loads
//     their packed words and the two (scale, min) pairs that cover them from global memory into
//     registers two k-blocks ahead (a 3-deep register ring, so that no load latency is exposed),
//     turns each level q into fp32 exactly with the 2^23 magic-number trick (no int->float
//     convert), applies x̂ = fmaf(q, scale, min) exactly as the spec does, rounds pairs to bf16x2
//     and stores 16 bytes at a time, bank-conflict free. Per 256x128x64 k-block that is 8192
//     values, about 4 instructions each, against 4.2 MFLOP of tensor work (~1000 cycles): the
//     dequantization runs on the CUDA cores while the tensor cores work on earlier stages.
//   - two consumer warpgroups each issue 2x4 wgmma 64x128x16 per k-block (fp32 accumulators,
//     128 registers a thread) and release a stage once the wgmmas reading it have retired.
// Full/empty mbarriers order the ring; the producer's generic-proxy stores are made visible to
// wgmma with fence.proxy.async before it arrives.
//
// Work split (stream-K with a deterministic fix-up): with T tiles and KB k-blocks, the T * KB
// (tile, k-block) units are cut into P equal contiguous ranges, one per CTA, P = the SM count
// when T is smaller than that (COUT = CIN = 768 gives 18 tiles), else P = T. A tile covered by one
// CTA is stored straight into dW (with beta); a tile shared by several CTAs gets one fp32 partial
// per CTA in a workspace, and a second kernel adds them in CTA order, applies beta and rounds to
// dW's dtype. The sum order depends only on the shape and the SM count, so results are
// bit-identical from run to run (deterministic = true and false take the same path).
//
// Rows k >= K and columns >= CIN are zero in both operands (TMA zero-fills, the producer writes
// zeros), so tails need no special MMA; stores are masked. dy goes through TMA when COUT % 8 == 0
// and dy is 16-byte aligned, else the producer copies it element by element (slow, for odd
// shapes only). Supported: group a multiple of 32 (any multiple of 32 / bits is a valid format;
// smaller groups are rejected here with fk::Error on argument 'x'). GPUs other than sm_90 have no
// kernel and get fk::Error.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>

#include <cute/tensor.hpp>  // first: the atom headers rely on what it includes before them
#include <cute/atom/mma_atom.hpp>

#include "fusekit/core/cuda_check.hpp"
#include "fusekit/core/error.hpp"
#include "fusekit/core/tensor.hpp"
#include "ops/cuda_common.cuh"
#include "quant_cuda.hpp"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FK_WGRAD_SM90 1
#else
#define FK_WGRAD_SM90 0
#endif

namespace fk::cuda {
namespace {

using namespace cute;
using cute::Tensor;  // fk declares Tensor too

constexpr const char* kOp = "weight_grad_from_packed";

// CTA tile (M = COUT rows of dW, N = CIN columns, K = reduction), pipeline depth, warp roles.
constexpr int kBlockM = 256, kBlockN = 128, kBlockK = 64, kStages = 4;
constexpr int kProducerThreads = 128, kConsumerThreads = 256, kThreads = kProducerThreads + kConsumerThreads;
constexpr int kStageBytesA = kBlockM * kBlockK * 2;  // 32 KB of bf16 dy
constexpr int kStageBytesB = kBlockN * kBlockK * 2;  // 16 KB of bf16 x̂
constexpr int kTileElems = kBlockM * kBlockN;
// Each full barrier expects the producer's 128 threads (after their stores) plus one arrival that
// carries the TMA byte count (or a plain one when dy is copied by the threads).
[[maybe_unused]] constexpr int kFullArrivals = kProducerThreads + 1;
[[maybe_unused]] constexpr int kEmptyArrivals = 2;  // one per consumer warpgroup
constexpr int kProducerRegs = 120, kConsumerRegs = 192;
static_assert(kProducerRegs * kProducerThreads + kConsumerRegs * kConsumerThreads <= 168 * kThreads);
// The packed words of a k-block (64 rows x 128 columns, 1 KB a bit) and the statistics rows of
// its 64 rows (all G groups: they are contiguous, 64 G scales then as many minimums) come by TMA
// into a ring of raw slots, kRawSlots - 1 k-blocks ahead of the dequantization (3 slots at 8 bits,
// where 4 do not fit next to the 192 KB of operand stages).
template <int kBits> constexpr int kRawSlots = kBits == 8 ? 3 : 4;
template <int kBits> constexpr int kRawWordBytes = kBlockK * kBlockN * kBits / 8;
constexpr int kStatsBytes = 1536;  // per array and slot: 64 G scales fit when G <= 12 (bf16) or 6 (f32)
template <int kBits> constexpr int kRawSlotBytes = kRawWordBytes<kBits> + 2 * kStatsBytes;
template <int kBits>
constexpr int kSmemBytes = kStages * (kStageBytesA + kStageBytesB) + kRawSlots<kBits> * kRawSlotBytes<kBits> +
                           (2 * kStages + kRawSlots<kBits>) * 8 + 1024;  // + slack for the 1024-byte alignment
static_assert(kSmemBytes<8> <= 227 * 1024 && kSmemBytes<4> <= 227 * 1024);
// Fewer k-blocks than this per CTA and the pipeline fill costs more than the extra CTAs bring.
constexpr int kMinUnitsPerCta = 8;

using Bf16 = cute::bfloat16_t;
// Both operands are M/N-major (dy is [K, COUT], x̂ is [K, CIN], both row-major): 128-byte swizzled
// atoms of 64 (m or n) x 8 (k), k-atoms adjacent, so that a 64x64 box of A is one contiguous 8 KB
// TMA destination. Element (mn, k) of stage s sits at byte
//   s * stage_bytes + (mn / 64) * 8192 + (k / 8) * 1024 + (k % 8) * 128 + (((mn % 64) / 8) ^ (k % 8)) * 16 + (mn % 8) * 2.
using SmemLayoutA = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Bf16>{},
                                           Shape<Int<kBlockM>, Int<kBlockK>, Int<kStages>>{},
                                           Step<_2, _1, _3>{}));  // (BLK_M,BLK_K,PIPE)
using SmemLayoutB = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Bf16>{},
                                           Shape<Int<kBlockN>, Int<kBlockK>, Int<kStages>>{},
                                           Step<_2, _1, _3>{}));  // (BLK_N,BLK_K,PIPE)
static_assert(cosize_v<SmemLayoutA> * 2 == kStages * kStageBytesA);
static_assert(cosize_v<SmemLayoutB> * 2 == kStages * kStageBytesB);
// Two consumer warpgroups stacked along M; each covers m-rows {64w..64w+63, 128+64w..}.
using TiledMma = decltype(make_tiled_mma(SM90_64x128x16_F32BF16BF16_SS<GMMA::Major::MN, GMMA::Major::MN>{},
                                         Layout<Shape<_2, _1, _1>>{}));
static_assert(decltype(size(TiledMma{}))::value == kConsumerThreads);

struct Params {
  const std::uint16_t* dy;     // bf16 [K, COUT]
  const std::uint32_t* words;  // [K, row_words]: row k's bitstream, column c at bits [c * bits, +bits)
  const void* scale;           // bf16 or f32 [K, G]
  const void* min;             // bf16 or f32 [K, G]
  void* dw;                    // f32 or bf16 [COUT, CIN]
  float* workspace;            // [P + T - 1, kBlockM, kBlockN]: partial tiles, slot = cta + tile
  std::int64_t k;              // K
  std::int64_t units;          // T * KB
  int cout, cin, groups, group, row_words;
  int kblocks, tiles_n, ctas;
  int stats_bytes;             // 2 (bf16) or 4 (f32)
  bool stats_bf16, dw_bf16, accumulate;
  bool tma_a;                  // dy by TMA (else copied by the producer threads)
  bool tma_x;                  // packed words and statistics by TMA (else loaded by the producer threads)
  bool vec_words;              // without TMA: 16-byte (8 at 1 bit) loads of a thread's words
};

// The CTA whose range holds unit u: ranges are [c * U / P, (c + 1) * U / P), P <= U.
__host__ __device__ inline int cta_of_unit(std::int64_t u, std::int64_t units, int ctas) {
  return static_cast<int>(((u + 1) * ctas + units - 1) / units - 1);
}
__host__ __device__ inline std::int64_t first_unit(int cta, std::int64_t units, int ctas) {
  return static_cast<std::int64_t>(cta) * units / ctas;
}

#if FK_WGRAD_SM90

// (tile, k-block) of a unit, advanced one unit at a time (no 64-bit division in the loops).
struct UnitPos {
  int tile, kb;
  __device__ void advance(int kblocks) {
    if (++kb == kblocks) kb = 0, ++tile;
  }
};

__device__ __forceinline__ std::uint32_t smem_addr(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void st_shared_v4(std::uint32_t addr, uint4 v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}
__device__ __forceinline__ void st_shared_u16(std::uint32_t addr, std::uint16_t v) {
  asm volatile("st.shared.u16 [%0], %1;" ::"r"(addr), "h"(v) : "memory");
}
// Makes this thread's generic-proxy shared-memory stores visible to the async proxy (wgmma).
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
// mbarriers, addressed by their shared-window address.
__device__ __forceinline__ void mbar_init(std::uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(std::uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// Arrives and adds `bytes` to the transaction count the phase waits for.
__device__ __forceinline__ void mbar_arrive_expect_tx(std::uint32_t bar, std::uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// Waits until the phase of parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(std::uint32_t bar, int parity) {
  std::uint32_t done = 0;
  do {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}
__device__ __forceinline__ uint4 ld_shared_v4(std::uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}
__device__ __forceinline__ uint2 ld_shared_v2(std::uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(addr));
  return v;
}
// Synchronises the producer warpgroup only (barrier 0 is __syncthreads).
__device__ __forceinline__ void producer_barrier() {
  asm volatile("bar.sync 1, %0;" ::"n"(kProducerThreads) : "memory");
}
// `bytes` (a multiple of 16) from global to shared memory by the TMA unit, completing on `bar`.
__device__ __forceinline__ void bulk_copy(std::uint32_t dst, const void* src, std::uint32_t bytes, std::uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}
__device__ __forceinline__ float ld_shared_stat(std::uint32_t addr, bool bf16) {
  if (bf16) {
    unsigned short v;
    asm volatile("ld.shared.u16 %0, [%1];" : "=h"(v) : "r"(addr));
    return __uint_as_float(static_cast<std::uint32_t>(v) << 16);
  }
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ void tma_load_2d(const CUtensorMap* map, std::uint32_t bar, std::uint32_t dst, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
          dst),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

__device__ __forceinline__ float load_stat(const void* base, std::int64_t i, bool bf16) {
  if (bf16) return __uint_as_float(static_cast<std::uint32_t>(__ldg(static_cast<const unsigned short*>(base) + i)) << 16);
  return __ldg(static_cast<const float*>(base) + i);
}

// One producer thread's share of a k-block: 64 consecutive columns [c0, c0 + 64) of one row,
// as packed words, and the statistics of the groups of [c0, c0 + 32) and [c0 + 32, c0 + 64)
// (group % 32 == 0, so each half lies in one group).
template <int kBits>
struct Span {
  std::uint32_t w[2 * kBits];
  float s0, m0, s1, m1;
};

// Without TMA: loads the span's words and statistics with plain loads. The caller issues them
// right after arriving on a full barrier, so that they are in flight while it waits for the next
// stage (a fence or a release with loads outstanding would wait for them).
template <int kBits>
__device__ __forceinline__ void load_span(Span<kBits>& sp, const Params& p, UnitPos pos, int r, int h) {
  const std::int64_t k = static_cast<std::int64_t>(pos.kb) * kBlockK + r;
  const int c0 = (pos.tile % p.tiles_n) * kBlockN + 64 * h;
  if (k >= p.k || c0 >= p.cin) return;  // the span is stored as zeros
  const std::int64_t srow = k * p.groups;
  const int g0 = c0 / p.group;
  const int g1 = c0 + 32 < p.cin ? (c0 + 32) / p.group : g0;
  sp.s0 = load_stat(p.scale, srow + g0, p.stats_bf16);
  sp.m0 = load_stat(p.min, srow + g0, p.stats_bf16);
  sp.s1 = load_stat(p.scale, srow + g1, p.stats_bf16);
  sp.m1 = load_stat(p.min, srow + g1, p.stats_bf16);
  const int w0 = c0 / 32 * kBits;  // first word of the span in the row
  const std::uint32_t* row = p.words + k * p.row_words + w0;
  if (p.vec_words) {  // row stride and span start 16-byte aligned (8 at 1 bit); spans never straddle the row end
    if constexpr (kBits == 1) {
      const uint2 v = __ldg(reinterpret_cast<const uint2*>(row));
      sp.w[0] = v.x, sp.w[1] = v.y;
    } else {
#pragma unroll
      for (int i = 0; i < kBits / 2; ++i) {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(row) + i);
        sp.w[4 * i] = v.x, sp.w[4 * i + 1] = v.y, sp.w[4 * i + 2] = v.z, sp.w[4 * i + 3] = v.w;
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < 2 * kBits; ++i) sp.w[i] = w0 + i < p.row_words ? __ldg(row + i) : 0u;
  }
}

// The span's words from raw slot `slot`, where TMA left row r's 16 * kBits bytes at r * 16 * kBits
// with the tensor map's swizzle (none, 32, 64 or 128 bytes at 1, 2, 4, 8 bits): 16-byte chunk c
// of row r sits at chunk c ^ (r / 4 % 2), c ^ (r / 2 % 4) or c ^ (r % 8). Consecutive rows then
// fall in different banks.
template <int kBits>
__device__ __forceinline__ void read_raw_words(Span<kBits>& sp, std::uint32_t slot, int r, int h) {
  if constexpr (kBits == 1) {
    const uint2 v = ld_shared_v2(slot + r * 16 + h * 8);
    sp.w[0] = v.x, sp.w[1] = v.y;
  } else {
    constexpr int kChunks = kBits / 2;  // 16-byte chunks a thread
    const int swz = kBits == 2 ? (r >> 2) & 1 : kBits == 4 ? (r >> 1) & 3 : r & 7;
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const uint4 v = ld_shared_v4(slot + r * 16 * kBits + (((h * kChunks + i) ^ swz) << 4));
      sp.w[4 * i] = v.x, sp.w[4 * i + 1] = v.y, sp.w[4 * i + 2] = v.z, sp.w[4 * i + 3] = v.w;
    }
  }
}

// Level e of chunk j (8 columns) of the span as the float 2^23 + q: q is OR-ed into the mantissa
// of 2^23, which is exact for q < 2^23.
template <int kBits, int J, int E>
__device__ __forceinline__ float magic_level(const Span<kBits>& sp) {
  constexpr int bit = 8 * kBits * J + E * kBits;
  const std::uint32_t w = sp.w[bit / 32];
  std::uint32_t f;
  if constexpr (kBits == 8) {
    f = __byte_perm(w, 0x4B000000u, 0x7440u | ((bit % 32) / 8));  // bytes (q, 0, 0, 0x4B)
  } else {
    f = ((w >> (bit % 32)) & ((1u << kBits) - 1u)) | 0x4B000000u;
  }
  return __uint_as_float(f);
}

template <int kBits, int J>
__device__ __forceinline__ uint4 dequant_chunk(const Span<kBits>& sp) {
  const float s = J < 4 ? sp.s0 : sp.s1, m = J < 4 ? sp.m0 : sp.m1;
  std::uint32_t out[4];
  auto deq = [&](float magic) { return fmaf(magic - 8388608.0f, s, m); };  // the spec's fmaf(q, scale, min)
  [&]<int... P>(std::integer_sequence<int, P...>) {
    ((out[P] = [&] {
       const __nv_bfloat162 v = __floats2bfloat162_rn(deq(magic_level<kBits, J, 2 * P>(sp)),
                                                      deq(magic_level<kBits, J, 2 * P + 1>(sp)));
       return *reinterpret_cast<const std::uint32_t*>(&v);
     }()),
     ...);
  }(std::make_integer_sequence<int, 4>{});
  return make_uint4(out[0], out[1], out[2], out[3]);
}

// Writes the span's 8 chunks into B stage `b_stage` (shared address); chunks past CIN or rows
// past K become zeros.
template <int kBits>
__device__ __forceinline__ void store_span(const Span<kBits>& sp, std::uint32_t b_stage, int r, int h, int valid_chunks) {
  const std::uint32_t row_base = b_stage + h * 8192 + (r / 8) * 1024 + (r % 8) * 128;
  const int x = r % 8;
  [&]<int... J>(std::integer_sequence<int, J...>) {
    ((st_shared_v4(row_base + ((J ^ x) << 4), J < valid_chunks ? dequant_chunk<kBits, J>(sp) : make_uint4(0, 0, 0, 0))),
     ...);
  }(std::make_integer_sequence<int, 8>{});
}

// dy k-block into A stage `a_stage` by the producer threads, element by element (odd COUT or a
// misaligned dy: no TMA). Zeros outside [K, COUT].
__device__ void load_a_by_threads(const Params& p, std::uint32_t a_stage, int m0, std::int64_t k0, int pt) {
#pragma unroll 4
  for (int e = pt; e < kBlockM * kBlockK; e += kProducerThreads) {
    const int m = e % kBlockM, k = e / kBlockM;
    std::uint16_t v = 0;
    if (m0 + m < p.cout && k0 + k < p.k) v = p.dy[(k0 + k) * p.cout + m0 + m];
    const int mm = m % 64;
    st_shared_u16(a_stage + (m / 64) * 8192 + (k / 8) * 1024 + (k % 8) * 128 + (((mm / 8) ^ (k % 8)) << 4) + (mm % 8) * 2,
                  v);
  }
}

// Shared-memory carve-up, as shared-window addresses: A stages (1024-aligned, for the 128-byte
// swizzle), B stages, raw word slots, then the full and empty mbarriers of each stage and the
// full mbarrier of each raw slot.
struct Smem {
  std::uint32_t a, b, raw, bars;
  __device__ std::uint32_t full(int s) const { return bars + 8 * s; }
  __device__ std::uint32_t empty(int s) const { return bars + 8 * (kStages + s); }
  __device__ std::uint32_t raw_full(int j) const { return bars + 8 * (2 * kStages + j); }
};

template <int kBits>
__device__ __forceinline__ Smem carve_smem(const std::uint8_t* raw) {
  const std::uint32_t a = (smem_addr(raw) + 1023) & ~1023u;
  const std::uint32_t b = a + kStages * kStageBytesA;
  const std::uint32_t w = b + kStages * kStageBytesB;
  return {a, b, w, w + kRawSlots<kBits> * kRawSlotBytes<kBits>};
}

template <int kBits>
struct Producer {
  const Params& p;
  const CUtensorMap* tmap_dy;
  const CUtensorMap* tmap_x;
  Smem sm;
  int pt, r, h;
  int left;        // units still to produce
  int it;          // units produced so far: stage it % kStages, raw slot it % kRawSlots
  UnitPos cur;     // the unit being produced
  UnitPos pref;    // thread 0: the next unit whose words are loaded by TMA
  Span<kBits> sp;  // statistics (and words without TMA) of unit `cur`

  // Bytes of a k-block's statistics rows that TMA copies (a multiple of 16: the rest of a last,
  // partial k-block is read from global memory).
  __device__ __forceinline__ std::uint32_t stats_copy_bytes(int k0) const {
    return static_cast<std::uint32_t>(std::min<std::int64_t>(kBlockK, p.k - k0) * p.groups * p.stats_bytes) & ~15u;
  }

  // Thread 0: unit pref's packed words (zeros past K and the row's words) and its k-block's
  // statistics rows into raw slot `slot` by TMA.
  __device__ __forceinline__ void issue_raw(int slot) {
    const std::uint32_t bar = sm.raw_full(slot), dst = sm.raw + slot * kRawSlotBytes<kBits>;
    const int k0 = pref.kb * kBlockK;
    const std::uint32_t stats = stats_copy_bytes(k0);
    mbar_arrive_expect_tx(bar, kRawWordBytes<kBits> + 2 * stats);
    tma_load_2d(tmap_x, bar, dst, (pref.tile % p.tiles_n) * (kBlockN * kBits / 32), k0);
    if (stats > 0) {
      const std::int64_t first = static_cast<std::int64_t>(k0) * p.groups * p.stats_bytes;
      bulk_copy(dst + kRawWordBytes<kBits>, static_cast<const char*>(p.scale) + first, stats, bar);
      bulk_copy(dst + kRawWordBytes<kBits> + kStatsBytes, static_cast<const char*>(p.min) + first, stats, bar);
    }
    pref.advance(p.kblocks);
  }

  // The span's words and statistics from raw slot `slot`.
  __device__ __forceinline__ void read_raw(std::uint32_t slot, std::int64_t k0, int c0) {
    read_raw_words(sp, slot, r, h);
    if (k0 + r >= p.k || c0 >= p.cin) return;  // stored as zeros
    const int g0 = c0 / p.group, g1 = c0 + 32 < p.cin ? (c0 + 32) / p.group : g0;
    const std::uint32_t copied = stats_copy_bytes(static_cast<int>(k0));
    const std::int64_t e0 = static_cast<std::int64_t>(r) * p.groups + g0, e1 = e0 + (g1 - g0);
    const std::uint32_t scale = slot + kRawWordBytes<kBits>, min = scale + kStatsBytes;
    auto get = [&](std::uint32_t base, const void* global, std::int64_t e) {
      return e * p.stats_bytes < copied ? ld_shared_stat(base + static_cast<std::uint32_t>(e) * p.stats_bytes, p.stats_bf16)
                                        : load_stat(global, k0 * p.groups + e, p.stats_bf16);
    };
    sp.s0 = get(scale, p.scale, e0), sp.m0 = get(min, p.min, e0);
    sp.s1 = get(scale, p.scale, e1), sp.m1 = get(min, p.min, e1);
  }

  __device__ __forceinline__ void step() {
    if (p.tma_x) {
      producer_barrier();  // every producer thread has read the raw slot of the previous unit ...
      if (pt == 0 && left > kRawSlots<kBits> - 1)  // ... which is refilled
        issue_raw((it + kRawSlots<kBits> - 1) % kRawSlots<kBits>);
    }
    const int s = it % kStages;
    mbar_wait(sm.empty(s), ((it / kStages) & 1) ^ 1);
    const int mb = cur.tile / p.tiles_n, nb = cur.tile % p.tiles_n;
    const std::int64_t k0 = static_cast<std::int64_t>(cur.kb) * kBlockK;
    const std::uint32_t a_stage = sm.a + s * kStageBytesA;
    if (p.tma_a) {
      if (pt == 0) {
        mbar_arrive_expect_tx(sm.full(s), kStageBytesA);
#pragma unroll
        for (int i = 0; i < kBlockM / 64; ++i)
          tma_load_2d(tmap_dy, sm.full(s), a_stage + i * 8192, mb * kBlockM + 64 * i, static_cast<int>(k0));
      }
    } else {
      load_a_by_threads(p, a_stage, mb * kBlockM, k0, pt);
      if (pt == 0) mbar_arrive(sm.full(s));
    }
    const int c0 = nb * kBlockN + 64 * h;
    if (p.tma_x) {
      const int slot = it % kRawSlots<kBits>;
      mbar_wait(sm.raw_full(slot), (it / kRawSlots<kBits>) & 1);
      read_raw(sm.raw + slot * kRawSlotBytes<kBits>, k0, c0);
    }
    const int valid_chunks = k0 + r < p.k ? std::clamp((p.cin - c0 + 7) / 8, 0, 8) : 0;
    store_span(sp, sm.b + s * kStageBytesB, r, h, valid_chunks);
    fence_proxy_async_shared();
    mbar_arrive(sm.full(s));
    --left, ++it;
    cur.advance(p.kblocks);
    if (!p.tma_x && left > 0) load_span(sp, p, cur, r, h);
  }

  __device__ void run() {
    if (p.tma_x) {
      if (pt == 0)
        for (int i = 0; i < kRawSlots<kBits> - 1 && i < left; ++i) issue_raw(i);
    } else {
      load_span(sp, p, cur, r, h);
    }
    while (left > 0) step();
  }
};

// Stores one consumer thread's accumulators: into dW (tile not split) or the tile's workspace slot.
// The SM90 64xN fp32 accumulator layout, tiled twice along M by TiledMma: accumulator
// i = e0 + 2 e1 + 4 j + 64 mi of consumer thread ct holds tile element
//   m = 64 (ct / 128) + 16 (ct % 128 / 32) + ct % 32 / 4 + 8 e1 + 128 mi,   n = 2 (ct % 4) + 8 j + e0.
// (Written out rather than taken from an identity tensor, whose 128 coordinate pairs the compiler
// would otherwise keep live across both store paths.)
// `whole`: this CTA's range covers the whole tile, which no other CTA then touches.
template <class Acc>
__device__ void store_tile(const Acc& acc, int ct, const Params& p, int tile, bool whole) {
  static_assert(decltype(size(acc))::value == 128);
  const int mt = 64 * (ct / 128) + 16 * (ct % 128 / 32) + ct % 32 / 4, nt = 2 * (ct % 4);
  if (!whole) {
    float* ws = p.workspace + (static_cast<std::int64_t>(blockIdx.x) + tile) * kTileElems + mt * kBlockN + nt;
    CUTE_UNROLL
    for (int i = 0; i < 128; i += 2) {
      const int m = 8 * (i / 2 % 2) + 128 * (i / 64), n = 8 * (i / 4 % 16);
      *reinterpret_cast<float2*>(ws + m * kBlockN + n) = make_float2(acc(i), acc(i + 1));
    }
    return;
  }
  const int m0 = tile / p.tiles_n * kBlockM + mt, n0 = tile % p.tiles_n * kBlockN + nt;
  CUTE_UNROLL
  for (int r = 0; r < 4; ++r) {  // the thread's 4 rows: (e1, mi) = (r % 2, r / 2)
    const int m = m0 + 8 * (r % 2) + 128 * (r / 2);
    if (m >= p.cout) continue;
    const std::int64_t row = static_cast<std::int64_t>(m) * p.cin;
    CUTE_UNROLL
    for (int c = 0; c < 32; ++c) {  // (e0, j) = (c % 2, c / 2)
      const int n = n0 + 8 * (c / 2) + c % 2;
      const float v = acc(c % 2 + 2 * (r % 2) + 4 * (c / 2) + 64 * (r / 2));
      if (n < p.cin) {
        if (p.dw_bf16) {
          auto* dw = static_cast<__nv_bfloat16*>(p.dw) + row + n;
          *dw = __float2bfloat16_rn((p.accumulate ? __bfloat162float(*dw) : 0.0f) + v);
        } else {
          auto* dw = static_cast<float*>(p.dw) + row + n;
          *dw = (p.accumulate ? *dw : 0.0f) + v;
        }
      }
      // Bounds the read-modify-writes the compiler batches (and the registers they hold).
      if (c % 8 == 7) asm volatile("" ::: "memory");
    }
  }
}

__device__ void consume(const Params& p, const Smem& sm, const std::uint8_t* smem_raw, std::int64_t u,
                        std::int64_t u_end, UnitPos pos) {
  const int ct = static_cast<int>(threadIdx.x) - kProducerThreads;  // 0..255
  const bool leader = ct % 128 == 0;
  TiledMma mma;
  auto thr = mma.get_thread_slice(ct);
  const Bf16* a = reinterpret_cast<const Bf16*>(smem_raw + (sm.a - smem_addr(smem_raw)));
  const Bf16* b = reinterpret_cast<const Bf16*>(smem_raw + (sm.b - smem_addr(smem_raw)));
  Tensor sA = make_tensor(make_smem_ptr(a), SmemLayoutA{});  // (BLK_M,BLK_K,PIPE)
  Tensor sB = make_tensor(make_smem_ptr(b), SmemLayoutB{});  // (BLK_N,BLK_K,PIPE)
  Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));  // (MMA,MMA_M,MMA_K,PIPE) descriptors
  Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));  // (MMA,MMA_N,MMA_K,PIPE) descriptors
  Tensor acc = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<kBlockN>>{});  // (MMA,MMA_M,MMA_N) fp32

  int it = 0;
  while (u < u_end) {  // one segment: the units of one tile in this CTA's range
    const std::int64_t tile_end = static_cast<std::int64_t>(pos.tile + 1) * p.kblocks;
    const std::int64_t seg_end = std::min(u_end, tile_end);
    const bool whole = pos.kb == 0 && seg_end == tile_end;
    mma.accumulate_ = GMMA::ScaleOut::Zero;  // the segment's first wgmmas overwrite the accumulators
    int prev_stage = -1;
    for (; u < seg_end; ++u, ++it) {
      const int s = it % kStages;
      mbar_wait(sm.full(s), (it / kStages) & 1);
      warpgroup_fence_operand(acc);
      warpgroup_arrive();
      CUTE_UNROLL
      for (int kk = 0; kk < size<2>(tCrA); ++kk) {  // 4 k16 steps, each 2 wgmma 64x128x16 (M = 128 a warpgroup)
        gemm(mma, tCrA(_, _, kk, s), tCrB(_, _, kk, s), acc);
        mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      warpgroup_wait<1>();  // the previous k-block's wgmmas have retired: its stage is free
      warpgroup_fence_operand(acc);
      if (prev_stage >= 0 && leader) mbar_arrive(sm.empty(prev_stage));
      prev_stage = s;
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc);
    if (leader) mbar_arrive(sm.empty(prev_stage));
    store_tile(acc, ct, p, pos.tile, whole);
    ++pos.tile, pos.kb = 0;
  }
}

#endif  // FK_WGRAD_SM90

template <int kBits>
__global__ void __launch_bounds__(kThreads, 1)
    weight_grad_packed_kernel(const __grid_constant__ Params p, const __grid_constant__ CUtensorMap tmap_dy,
                              const __grid_constant__ CUtensorMap tmap_x) {
#if FK_WGRAD_SM90
  // The fix-up kernel may be launched now: it waits for this grid to finish before it reads.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  extern __shared__ std::uint8_t smem_raw[];
  const Smem sm = carve_smem<kBits>(smem_raw);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(sm.full(s), kFullArrivals);
      mbar_init(sm.empty(s), kEmptyArrivals);
    }
    for (int j = 0; j < kRawSlots<kBits>; ++j) mbar_init(sm.raw_full(j), 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  const std::int64_t u0 = first_unit(blockIdx.x, p.units, p.ctas), u1 = first_unit(blockIdx.x + 1, p.units, p.ctas);
  const UnitPos pos{static_cast<int>(u0 / p.kblocks), static_cast<int>(u0 % p.kblocks)};
  // The register file is rebalanced towards the consumers: 3 x 168 = 120 + 2 x 192 a thread.
  if (threadIdx.x < kProducerThreads) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kProducerRegs));
    const int pt = threadIdx.x;
    Producer<kBits>{p, &tmap_dy, &tmap_x, sm, pt, pt % 64, pt / 64, static_cast<int>(u1 - u0), 0, pos, pos, {}}.run();
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kConsumerRegs));
    consume(p, sm, smem_raw, u0, u1, pos);
  }
#else
  __trap();  // the launcher never starts this kernel off sm_90
#endif
}

// dW for every split tile: the sum of its CTAs' partials in CTA order, plus beta * dW.
__global__ void __launch_bounds__(256) weight_grad_fixup_kernel(const Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");  // launched early (programmatic dependent launch)
#endif
  const int tile = blockIdx.x;
  const std::int64_t tu = static_cast<std::int64_t>(tile) * p.kblocks;
  const int c_lo = cta_of_unit(tu, p.units, p.ctas), c_hi = cta_of_unit(tu + p.kblocks - 1, p.units, p.ctas);
  if (c_lo == c_hi) return;  // stored directly by its CTA
  const int m0 = tile / p.tiles_n * kBlockM, n0 = tile % p.tiles_n * kBlockN;
  for (int v = blockIdx.y * blockDim.x + threadIdx.x; v < kTileElems / 4; v += gridDim.y * blockDim.x) {
    const int m = v / (kBlockN / 4), n = v % (kBlockN / 4) * 4;
    if (m0 + m >= p.cout) continue;
    const float* part = p.workspace + (static_cast<std::int64_t>(c_lo) + tile) * kTileElems + m * kBlockN + n;
    float4 s = *reinterpret_cast<const float4*>(part);
    for (int c = c_lo + 1; c <= c_hi; ++c) {
      part += kTileElems;
      const float4 q = *reinterpret_cast<const float4*>(part);
      s.x += q.x, s.y += q.y, s.z += q.z, s.w += q.w;
    }
    const float sum[4] = {s.x, s.y, s.z, s.w};
    const std::int64_t row = static_cast<std::int64_t>(m0 + m) * p.cin;
    for (int e = 0; e < 4; ++e) {
      const int n_abs = n0 + n + e;
      if (n_abs >= p.cin) break;
      if (p.dw_bf16) {
        auto* dw = static_cast<__nv_bfloat16*>(p.dw) + row + n_abs;
        *dw = __float2bfloat16_rn((p.accumulate ? __bfloat162float(*dw) : 0.0f) + sum[e]);
      } else {
        auto* dw = static_cast<float*>(p.dw) + row + n_abs;
        *dw = (p.accumulate ? *dw : 0.0f) + sum[e];
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Host side
// ---------------------------------------------------------------------------------------------

// Makes the tensors' device current for one call and gives the caller's back.
class DeviceScope {
 public:
  explicit DeviceScope(int device) : device_(device) {
    FK_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device_) FK_CUDA_CHECK(cudaSetDevice(device_));
  }
  ~DeviceScope() {
    if (previous_ != device_) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int device_;
  int previous_ = 0;
};

// cuTensorMapEncodeTiled from the driver, found through the runtime (no link against libcuda).
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
    FK_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &found));
    if (found != cudaDriverEntryPointSuccess || f == nullptr)
      throw Error(kOp, "the CUDA driver has no cuTensorMapEncodeTiled (TMA needs driver 12.0 or newer)");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// A row-major [rows, cols] tensor as a TMA source of box_cols x box_rows boxes, zeros outside.
CUtensorMap tensor_map_2d(const char* what, const void* base, CUtensorMapDataType type, int elem_bytes,
                          std::int64_t rows, std::int64_t cols, int box_cols, int box_rows, CUtensorMapSwizzle swizzle) {
  CUtensorMap map{};
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols) * elem_bytes};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = tensor_map_encoder()(&map, type, 2, const_cast<void*>(base), dims, strides, box, elem_strides,
                                          CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                          CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw Error(kOp, std::string("cuTensorMapEncodeTiled failed for ") + what + " (error " + std::to_string(r) + ")");
  return map;
}

template <int kBits>
void launch_main(const Params& p, const CUtensorMap& map_dy, const CUtensorMap& map_x, cudaStream_t s) {
  auto kernel = weight_grad_packed_kernel<kBits>;
  FK_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes<kBits>));
  kernel<<<p.ctas, kThreads, kSmemBytes<kBits>, s>>>(p, map_dy, map_x);
  FK_CUDA_CHECK_LAUNCH("weight_grad_packed_kernel");
}

// The fix-up as a programmatic dependent launch: it is scheduled while the main kernel runs and
// waits for it on the GPU (griddepcontrol.wait), so no launch gap separates the two.
void launch_fixup(const Params& p, unsigned tiles, cudaStream_t s) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(tiles, 8);
  cfg.blockDim = dim3(256);
  cfg.stream = s;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  FK_CUDA_CHECK(cudaLaunchKernelEx(&cfg, weight_grad_fixup_kernel, p));
}

bool aligned(const void* ptr, std::uintptr_t a) { return reinterpret_cast<std::uintptr_t>(ptr) % a == 0; }

}  // namespace

void weight_grad_from_packed(const TensorView& dy, const PackedView& x, const TensorView& dw,
                             const WeightGradParams& wp, const Stream* stream) {
  const int device = dy.device().index;
  DeviceScope on_device(device);
  int major = 0, minor = 0;
  FK_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  FK_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  FK_CHECK_ARG(major == 9 && minor == 0, kOp, "device", "an sm_90 GPU (H100/H200: the kernel uses wgmma and TMA)",
               "sm_" + std::to_string(major * 10 + minor));
  FK_CHECK_ARG(x.group % 32 == 0, kOp, "x", "a group size that is a multiple of 32 on CUDA",
               "group " + std::to_string(x.group));

  const std::int64_t k = dy.size(0), cout = dy.size(1), cin = x.cols;
  if (cout == 0 || cin == 0) return;
  const cudaStream_t s = fk::detail::cuda_stream(stream);
  if (k == 0) {  // the sum over nothing: dW = beta * dW
    if (wp.beta == 0.0f) FK_CUDA_CHECK(cudaMemsetAsync(dw.data(), 0, dw.nbytes(), s));
    return;
  }
  constexpr std::int64_t kMaxDim = INT_MAX - 1024;
  FK_CHECK_ARG(k <= kMaxDim && cout <= kMaxDim, kOp, "dy", "every dimension below 2^31 - 1024 on CUDA",
               dy.shape().str());
  FK_CHECK_ARG(cin <= kMaxDim, kOp, "x", "at most 2^31 - 1024 columns on CUDA", std::to_string(cin));

  Params p{};
  p.dy = static_cast<const std::uint16_t*>(dy.data());
  p.words = static_cast<const std::uint32_t*>(x.words.data());
  p.scale = x.scale.data();
  p.min = x.min.data();
  p.dw = dw.data();
  p.k = k;
  p.cout = static_cast<int>(cout);
  p.cin = static_cast<int>(cin);
  p.groups = static_cast<int>(x.groups());
  p.group = x.group;
  p.row_words = static_cast<int>(x.groups() * x.words_per_group());
  p.kblocks = static_cast<int>((k + kBlockK - 1) / kBlockK);
  p.tiles_n = static_cast<int>((cin + kBlockN - 1) / kBlockN);
  const std::int64_t tiles = ((cout + kBlockM - 1) / kBlockM) * p.tiles_n;
  FK_CHECK_ARG(tiles <= INT_MAX / 2, kOp, "dw", "fewer than 2^30 tiles of 256x128", dw.shape().str());
  p.units = tiles * p.kblocks;
  p.stats_bf16 = x.scale.dtype() == DType::bf16;
  p.dw_bf16 = dw.dtype() == DType::bf16;
  p.accumulate = wp.beta != 0.0f;
  p.stats_bytes = p.stats_bf16 ? 2 : 4;
  // TMA needs 16-byte aligned bases and row strides.
  const std::int64_t row_bytes = static_cast<std::int64_t>(p.row_words) * 4;
  p.tma_a = cout % 8 == 0 && aligned(dy.data(), 16);
  p.tma_x = row_bytes % 16 == 0 && aligned(x.words.data(), 16) && aligned(p.scale, 16) && aligned(p.min, 16) &&
            kBlockK * x.groups() * p.stats_bytes <= kStatsBytes;
  // Without TMA, 16-byte loads of a span (8 at 1 bit) need aligned rows, and a padded row length
  // that is a multiple of 64 columns so that no span runs past the row's last word.
  p.vec_words = aligned(x.words.data(), 16) && row_bytes % (x.bits == 1 ? 8 : 16) == 0 && (x.groups() * x.group) % 64 == 0;

  const int sms = multiprocessor_count();
  // One tile per CTA when the tiles fill the GPU; otherwise split K S ways, S = SMs / tiles (but
  // no fewer than kMinUnitsPerCta k-blocks a CTA): CTA t * S + s takes k-blocks
  // [s KB / S, (s + 1) KB / S) of tile t. All CTAs run at once, and those of one k-range read the
  // same dy rows (6 n-tiles for CIN = 768) and packed rows (3 m-tiles) at about the same time, so
  // that both come from DRAM about once.
  std::int64_t ctas = tiles;
  if (tiles < sms) ctas = tiles * std::clamp<std::int64_t>(std::min<std::int64_t>(sms / tiles, p.kblocks / kMinUnitsPerCta), 1, sms);
  p.ctas = static_cast<int>(ctas);
  // Split tiles exist iff some CTA boundary falls inside a tile.
  bool any_split = false;
  for (std::int64_t c = 1; c < ctas && !any_split; ++c) any_split = first_unit(static_cast<int>(c), p.units, p.ctas) % p.kblocks != 0;

  fk::Tensor workspace;
  if (any_split) {
    workspace = fk::Tensor::empty({ctas + tiles - 1, kTileElems}, DType::f32, dy.device(), stream);
    p.workspace = workspace.data_as<float>();
  }
  // dy: 64 (m) x 64 (k) boxes with the 128-byte swizzle wgmma reads. Packed words: the 128
  // columns (4 * bits words) x 64 rows of a k-block, swizzled so that the dequantizing threads
  // read them without bank conflicts.
  const CUtensorMap map_dy = p.tma_a ? tensor_map_2d("dy", dy.data(), CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, k, cout, 64,
                                                     kBlockK, CU_TENSOR_MAP_SWIZZLE_128B)
                                     : CUtensorMap{};
  const CUtensorMapSwizzle swizzle_x = x.bits == 1   ? CU_TENSOR_MAP_SWIZZLE_NONE
                                       : x.bits == 2 ? CU_TENSOR_MAP_SWIZZLE_32B
                                       : x.bits == 4 ? CU_TENSOR_MAP_SWIZZLE_64B
                                                     : CU_TENSOR_MAP_SWIZZLE_128B;
  const CUtensorMap map_x = p.tma_x ? tensor_map_2d("x.words", x.words.data(), CU_TENSOR_MAP_DATA_TYPE_UINT32, 4, k,
                                                    p.row_words, kBlockN * x.bits / 32, kBlockK, swizzle_x)
                                    : CUtensorMap{};
  switch (x.bits) {
    case 1: launch_main<1>(p, map_dy, map_x, s); break;
    case 2: launch_main<2>(p, map_dy, map_x, s); break;
    case 4: launch_main<4>(p, map_dy, map_x, s); break;
    case 8: launch_main<8>(p, map_dy, map_x, s); break;
    default: throw_internal("weight_grad_from_packed: bits not checked by the caller");
  }
  if (any_split) launch_fixup(p, static_cast<unsigned>(tiles), s);
}

}  // namespace fk::cuda
