// weight_grad_from_packed on the GPU: dW [COUT, CIN] = beta * dW + dyᵀ · x̂, where dy [K, COUT] is
// bf16 row-major and x̂ [K, CIN] is dequantized on the fly from the packed activations (1, 2, 4 or
// 8 bits, group-wise scale and minimum; docs/quant-format.md). x̂ never exists in global memory:
// the packed words are read once per 256-row block of dW (3 times for COUT = 768), dy once per
// 128-column block of dW (6 times for CIN = 768, mostly from L2), dW written once.
//
// The GEMM runs on Hopper tensor cores (wgmma, sm_90a). A CTA computes a 256 (COUT) x 128 (CIN)
// tile of dW, transposed (dWᵀ = x̂ᵀ dy), in 64-deep k-blocks with three warpgroups: one producer
// (TMA) and two consumers, each owning 64 CIN rows of dWᵀ (128 fp32 accumulators a thread, wgmma
// 64x256x16 against all 256 COUT columns of dy). Two ways to feed x̂ to the tensor cores:
//   - RS (register-sourced A; 2, 4 and 8 bits with bf16 statistics and every operand by TMA: the
//     common case). The producer's thread 0 fills a 5-stage ring by TMA, each stage holding a
//     k-block's dy (64 k x 256 m, M-major, 128-byte swizzle), packed words (a 2-D box of 128
//     columns x 64 rows) and statistics rows (two 1-D bulk copies); producer warps 1-3 rearrange
//     each stage's statistics into bf16x2 pairs over rows (k, k + 1), the layout the A fragments
//     want. Each consumer thread loads its warp's words of the k-block with two ldmatrix.trans
//     (which hand lane quad q a 16-bit half of rows k and k + 1) and dequantizes them straight
//     into its A fragment registers while the previous k-block's wgmmas run. x̂ never touches
//     shared memory: per k-block that saves 16 KB of stores and 16 KB of wgmma reads of the
//     ~140 KB of shared-memory traffic the SS path moves, which is what bounds it.
//   - SS (both operands from shared memory; 1 bit, f32 statistics, or an operand without TMA).
//     The producer fills a 4-stage ring; each consumer warpgroup dequantizes its own 64 x̂
//     columns of the next k-block (a thread: one row, 32 columns, one group) into a 3-buffer x̂
//     ring in the swizzled MN-major layout wgmma reads, while its 4 wgmmas on the current k-block
//     run; then it waits for the previous k-block's wgmmas, releases that stage, fences its x̂
//     stores to the async proxy and syncs its own 128 threads (a named barrier).
// No barrier spans warpgroups in either.
//
// Dequantization: at 2 and 4 bits with bf16 statistics, a pair of levels 16 bits apart in a word
// becomes bf16x2 with one shift and one LOP3 (1 + q 2^-t in each half), one HFMA2 (q, exact) and
// one HFMA2 (q scale + min, a single rounding: x̂ is the spec's value correctly rounded to bf16):
// 2 instructions an element. At 8 bits (a level wider than a bf16 mantissa) one PRMT makes the
// pair two bf16 subnormals q 2^-133, an HMUL2 by 2^66 and an HFMA2 with scale 2^67 give the same
// single rounding: 1.5 instructions an element (rows with scale >= 2^61 take the f32 path). Such
// pairs are columns e and e + W/2 of a word (W columns), so the x̂ ring and the rows of dWᵀ hold
// each word's columns interleaved; the stores map them back. Otherwise (f32 statistics, or 1
// bit) each level becomes the float 1 + q 2^-t (shift + LOP3, or one PRMT at 8 bits),
// x̂ = f S + M with one FFMA (S = scale 2^t, M = min - S; within 2^-24 (|min| + 2^t scale) of
// the spec's fmaf(q, scale, min)) and pairs are rounded to bf16x2. RS pairs are rows (k, k + 1) of
// one column (the halves of an ldmatrix register) with their own statistics, in the same bf16x2
// arithmetic; its 8-bit k-blocks with a scale >= 2^61 take fmaf(q, scale, min) in f32.
//
// Work split: with T tiles and KB k-blocks, when T is below the SM count K is split S = SMs / T
// ways (at least 8 k-blocks a CTA): CTA t * S + s takes k-blocks [s KB / S, (s + 1) KB / S) of
// tile t (COUT = CIN = 768: 18 tiles x 7 = 126 CTAs). All CTAs run at once, and those of one
// k-range read the same dy and packed rows at about the same time, so both come from DRAM about
// once. Each writes its fp32 partial tile into a workspace in its accumulators' own order (one
// 16-byte store per 4 accumulators, 512 contiguous bytes a warp, no staging); a fix-up kernel,
// launched as a programmatic dependent launch, adds a tile's S partials in split order (one
// float4 a thread, all loads in flight), puts the sums at their tile coordinates in shared memory,
// applies beta and writes dW rows. With a bf16 dW (unless WeightGradParams::fp32_partials) the
// partials cross the workspace as fp16 with a power-of-two scale per 8 values instead
// (store_partial_f16: 2^-11 relative a value, 8x below dW's own rounding), half the bytes of the
// round trip, and their fix-up kernel adds them in fp32. With S = 1 the CTA stores into dW
// directly. The sum order depends only on the shape and the SM count: results are bit-identical
// from run to run (deterministic = true and false take the same path).
//
// Speed: docs/quant.md has the current figures and the command that reproduces them. At small K
// the fixed costs, the split-K round trip above all, dominate, which is why a bf16 dW's partials
// travel in fp16. The floors, the cost model and what was tried and dropped (stream-K and split-K
// reduced in L2 among them) are in docs/notes/quant.md.
//
// Rows k >= K and columns >= CIN: TMA zero-fills dy rows >= K and the words; the consumers give
// rows >= K statistics 0 (x̂ = 0 there); columns >= CIN get finite values that only reach dWᵀ
// rows >= CIN, which are never stored. Tails need no special MMA.
//
// Fallbacks, correct but slower: dy goes through TMA when COUT % 8 == 0 and dy is 16-byte aligned,
// else the producer threads copy it element by element; packed words go through TMA when the
// packed rows are a multiple of 16 bytes and the base is 16-byte aligned, else the producer
// threads copy them; statistics go by bulk copies when the bases are 16-byte aligned and 64 G
// values fit a 2048-byte slot (G <= 16 with bf16 statistics, 8 with f32), else each consumer
// thread loads its own from global memory. Supported: group a multiple of 32 (any multiple of
// 32 / bits is a valid format; smaller groups are rejected here with fk::Error on argument 'x').
// GPUs other than sm_90 have no kernel and get fk::Error naming the op.
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

#include "fusekit/core/cuda_check.hpp"
#include "fusekit/core/error.hpp"
#include "fusekit/core/tensor.hpp"
#include "ops/common/cuda_common.cuh"
#include "ops/common/sm90_async.cuh"
#include "quant_cuda.hpp"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FK_WGRAD_SM90 1
#else
#define FK_WGRAD_SM90 0
#endif

namespace fk::cuda {
namespace {

using namespace sm90;  // mbarriers, TMA and bulk copies (ops/common/sm90_async.cuh)

using namespace cute;
using cute::Tensor;  // fk declares Tensor too

constexpr const char* kOp = "weight_grad_from_packed";

// CTA tile (M = COUT rows of dW, N = CIN columns, K = reduction), pipeline depths, warp roles.
constexpr int kBlockM = 256, kBlockN = 128, kBlockK = 64;
// Ring of dy k-blocks with their packed words and statistics (TMA, producer): 4 stages when the
// consumers dequantize into x̂ buffers in shared memory (SS), 5 when they dequantize into registers
// (RS: no x̂ buffers; see consume_rs).
template <bool kRs> constexpr int kStagesOf = kRs ? 5 : 4;
constexpr int kStages = kStagesOf<false>;
constexpr int kXBufs = 3;   // ring of dequantized x̂ k-blocks (written and read by the consumers)
// One producer warpgroup (TMA, statistics), two consumer warpgroups (dequantization and MMA): a
// wgmma 64x256 with its 128 accumulators needs more registers than the 128 a thread of a
// 512-thread CTA starts with.
constexpr int kProducerThreads = 128, kConsumerThreads = 256, kThreads = kProducerThreads + kConsumerThreads;
// Columns of a k-block row a consumer thread dequantizes (inside one group, as group % 32 == 0):
// chunk c of the 4 in a tile row is dequantized by consumer warpgroup c / 2.
[[maybe_unused]] constexpr int kChunkCols = 32;
constexpr int kStageBytesA = kBlockM * kBlockK * 2;   // 32 KB of bf16 dy
constexpr int kXBufBytes = kBlockN * kBlockK * 2;     // 16 KB of bf16 x̂
template <int kBits> constexpr int kWordBytes = kBlockK * kBlockN * kBits / 8;  // packed words of a k-block
// A k-block's statistics rows (its 64 rows x G groups: contiguous in [K, G]) come by 1-D bulk
// copies into a slot of this many bytes per array: G <= 16 with bf16 statistics, 8 with f32.
constexpr int kStatsBytes = 2048;
constexpr int kStatBytes = 2 * kStatsBytes;           // scales, then minimums
// RS: a stage's statistics rearranged for the A fragments (see transpose_stats): up to 4 groups of
// the tile x 256 bytes, then the 8-bit path's three flag words.
constexpr int kTStatGroupBytes = 256, kTStatFlags = 4 * kTStatGroupBytes;
constexpr int kTStatBytes = kTStatFlags + 16;
constexpr int kTileElems = kBlockM * kBlockN;
// Every producer thread arrives on a full barrier once (thread 0 adds the TMA byte count first;
// the others copy dy or the words when TMA cannot); every consumer thread arrives on an empty one
// once it has read the stage's words and statistics and seen the stage's wgmmas retire.
[[maybe_unused]] constexpr int kFullArrivals = kProducerThreads;
[[maybe_unused]] constexpr int kEmptyArrivals = kConsumerThreads;
// A thread of the 384 starts with 168 registers; the producer needs few, the consumers' 128 fp32
// accumulators a thread plus the dequantization many: 128 x 56 + 256 x 224 = 384 x 168.
constexpr int kStartRegs = 168;
constexpr int kProducerRegs = 56;
constexpr int kConsumerRegs = (kStartRegs * kThreads - kProducerRegs * kProducerThreads) / kConsumerThreads / 8 * 8;
static_assert(kConsumerRegs == 224);
// Shared memory: dy stages, x̂ buffers, word slots, statistics slots (each 1024-byte aligned: the
// swizzled TMA destinations need it), then the mbarriers.
template <int kBits, bool kRs = false>
constexpr int kSmemBytes = kStagesOf<kRs> * (kStageBytesA + kWordBytes<kBits> + kStatBytes + (kRs ? kTStatBytes : 0)) +
                           (kRs ? 0 : kXBufs * kXBufBytes) + 3 * kStagesOf<kRs> * 8 +
                           1024;  // + slack for the 1024-byte alignment
static_assert(kSmemBytes<8> <= 227 * 1024 && kSmemBytes<8, true> <= 227 * 1024);
static_assert(kWordBytes<1> % 1024 == 0 && kStatBytes % 1024 == 0);
// Split K no finer than this many k-blocks a CTA: the pipeline fill would cost more than it brings.
constexpr int kMinKBlocksPerCta = 8;

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

struct Params {
  const std::uint16_t* dy;     // bf16 [K, COUT]
  const std::uint32_t* words;  // [K, row_words]: row k's bitstream, column c at bits [c * bits, +bits)
  const void* scale;           // bf16 or f32 [K, G]
  const void* min;             // bf16 or f32 [K, G]
  void* dw;                    // f32 or bf16 [COUT, CIN]
  float* workspace;            // S > 1: CTA c's partial tile, fp32 or fp16 (half_partials; see store_partial_f16)
  std::uint8_t* partial_exps;  // half_partials: the exponent byte of each 8 values of the fp16 partials
  std::int64_t k;              // K
  int cout, cin, groups, group, row_words;
  int kblocks, tiles_n, splits;  // KB, N tiles, S: CTA t * S + s takes k-blocks [s KB / S, (s + 1) KB / S) of tile t
  int stats_bytes;             // 2 (bf16) or 4 (f32)
  bool stats_bf16, dw_bf16, accumulate;
  bool half_partials;          // S > 1, bf16 dW and not WeightGradParams::fp32_partials
  bool tma_a;                  // dy by TMA (else copied by the producer threads)
  bool tma_x;                  // packed words by TMA (else copied by the producer threads)
  bool tma_stats;              // statistics rows by bulk copies (else each consumer thread loads its own)
};

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

// Row r's packed words of a k-block sit in a word slot at r * 16 kBits bytes, with the swizzle of
// the words' tensor map (none, 32, 64 or 128 bytes at 1, 2, 4, 8 bits): 16-byte unit u of row r
// at unit u ^ (r / 4 % 2), u ^ (r / 2 % 4) or u ^ (r % 8), so that the 32 consecutive rows a warp
// reads fall in different banks.
template <int kBits>
__device__ __forceinline__ std::uint32_t word_offset(int r, int byte) {
  const int swz = kBits == 1 ? 0 : kBits == 2 ? (r >> 2) & 1 : kBits == 4 ? (r >> 1) & 3 : r & 7;
  return static_cast<std::uint32_t>(r * 16 * kBits + (((byte >> 4) ^ swz) << 4) + (byte & 15));
}

// Bytes of k-block kb's statistics rows (of each array) that the bulk copies bring: a multiple
// of 16, so the rest of a last, partial k-block is loaded from global memory by the consumers.
__device__ __forceinline__ std::uint32_t stats_copy_bytes(const Params& p, int kb) {
  const std::int64_t rows = min(static_cast<std::int64_t>(kBlockK), p.k - static_cast<std::int64_t>(kb) * kBlockK);
  return static_cast<std::uint32_t>(rows * p.groups * p.stats_bytes) & ~15u;
}

// The producer warpgroup. Thread 0 brings each k-block's dy (64 k x 256 m, M-major, 128-byte
// swizzle: what wgmma reads), packed words (a 2-D box of 128 columns x 64 rows) and statistics
// rows (two 1-D bulk copies: scales, minimums) by TMA, all on the stage's full barrier. Without
// TMA (odd COUT, rows not a multiple of 16 bytes, misaligned bases) all 128 threads copy dy or
// the words themselves.
template <int kBits>
struct Producer {
  const Params& p;
  const CUtensorMap* tmap_dy;
  const CUtensorMap* tmap_x;
  Smem sm;
  CtaWork w;
  int pt;

  // Without TMA: the k-block's words into word slot `slot` with the same layout, zeros past K and
  // past the row.
  __device__ void load_words_by_threads(std::uint32_t slot, std::int64_t k0) {
    constexpr int kRowWords = 4 * kBits;  // 128 columns
    const int w0 = w.nb * kRowWords;
    for (int e = pt; e < kBlockK * kRowWords; e += kProducerThreads) {
      const int rr = e / kRowWords, c = e % kRowWords;
      std::uint32_t v = 0;
      if (k0 + rr < p.k && w0 + c < p.row_words) v = __ldg(p.words + (k0 + rr) * p.row_words + w0 + c);
      st_shared_u32(slot + word_offset<kBits>(rr, 4 * c), v);
    }
  }

  // Bytes the TMA copies of k-block kb bring (what its full barrier waits for).
  __device__ std::uint32_t tma_bytes(int kb) const {
    const std::uint32_t stats = p.tma_stats ? stats_copy_bytes(p, kb) : 0;
    return (p.tma_a ? kStageBytesA : 0) + (p.tma_x ? kWordBytes<kBits> : 0) + 2 * stats;
  }
  // Thread 0: k-block kb's dy, words and statistics rows into stage s by TMA (those that go so).
  __device__ void issue_tma(int s, int kb) const {
    const std::int64_t k0 = static_cast<std::int64_t>(kb) * kBlockK;
    const std::uint32_t full = sm.full(s), stats = p.tma_stats ? stats_copy_bytes(p, kb) : 0;
    if (p.tma_a) {
#pragma unroll
      for (int i = 0; i < kBlockM / 64; ++i)
        tma_load_2d(tmap_dy, full, sm.a + s * kStageBytesA + i * 8192, w.mb * kBlockM + 64 * i, static_cast<int>(k0));
    }
    if (p.tma_x) tma_load_2d(tmap_x, full, sm.word_slot(s), w.nb * (kBlockN * kBits / 32), static_cast<int>(k0));
    if (stats > 0) {
      const std::int64_t first = k0 * p.groups * p.stats_bytes;
      bulk_copy(sm.stat_slot(s), static_cast<const char*>(p.scale) + first, stats, full);
      bulk_copy(sm.stat_slot(s) + kStatsBytes, static_cast<const char*>(p.min) + first, stats, full);
    }
  }

  __device__ void run() {
    const int n = w.kb_end - w.kb_begin;
    for (int it = 0; it < n; ++it) {
      const int s = it % kStages, kb = w.kb_begin + it;
      const std::int64_t k0 = static_cast<std::int64_t>(kb) * kBlockK;
      mbar_wait(sm.empty(s), ((it / kStages) & 1) ^ 1);
      const std::uint32_t a_stage = sm.a + s * kStageBytesA, words = sm.word_slot(s), full = sm.full(s);
      if (pt == 0) {
        const std::uint32_t bytes = tma_bytes(kb);
        if (bytes > 0) mbar_expect_tx(full, bytes);
        issue_tma(s, kb);
      }
      if (!p.tma_a) {
        load_a_by_threads(p, a_stage, w.mb * kBlockM, k0, pt);
        fence_proxy_async_shared();  // dy stored by the threads is read by wgmma
      }
      if (!p.tma_x) load_words_by_threads(words, k0);
      mbar_arrive(full);
    }
  }
};

// Consumer thread t (of its warpgroup's 128) dequantizes row r = t % 64 of k-block kb, chunk
// c = 2 wg + t / 64 (32 columns, one group): its kBits words (one 4-32 byte load), its scale and
// minimum (two 2- or 4-byte loads, turned into S = scale 2^t and M = min - S; 0 for rows >= K so
// that x̂ is 0 there), 32 FFMAs, and four 16-byte stores into the swizzled MN-major x̂ buffer
// that wgmma reads. Lanes of a warp hold consecutive rows: the stores are free of bank conflicts.
// Columns >= CIN get finite values (the last group's statistics) that only reach dWᵀ rows >= CIN,
// which are never stored.
template <int kBits>
__device__ __forceinline__ void dequantize(const Params& p, const Smem& sm, int s, int kb, int g, std::uint32_t xbuf,
                                           int wg, int t) {
  const int r = t % kBlockK, h = t / kBlockK, c = 2 * wg + h;
  std::uint32_t wd[kBits];
  const std::uint32_t slot = sm.word_slot(s);
  if constexpr (kBits == 1) {
    wd[0] = ld_shared_u32(slot + word_offset<1>(r, 4 * c));
  } else if constexpr (kBits == 2) {
    const uint2 v = ld_shared_v2(slot + word_offset<2>(r, 8 * c));
    wd[0] = v.x, wd[1] = v.y;
  } else {
#pragma unroll
    for (int i = 0; i < kBits / 4; ++i) {
      const uint4 v = ld_shared_v4(slot + word_offset<kBits>(r, 4 * kBits * c + 16 * i));
      wd[4 * i] = v.x, wd[4 * i + 1] = v.y, wd[4 * i + 2] = v.z, wd[4 * i + 3] = v.w;
    }
  }
  const std::int64_t k = static_cast<std::int64_t>(kb) * kBlockK + r;
  float scale = 0.0f, mn = 0.0f;
  if (k < p.k) {
    const std::uint32_t e = static_cast<std::uint32_t>((r * p.groups + g) * p.stats_bytes);
    if (p.tma_stats && e < stats_copy_bytes(p, kb)) {
      scale = ld_shared_stat(sm.stat_slot(s) + e, p.stats_bf16);
      mn = ld_shared_stat(sm.stat_slot(s) + kStatsBytes + e, p.stats_bf16);
    } else {  // no bulk copies, or past the bytes they brought in a last partial k-block
      scale = load_stat(p.scale, k * p.groups + g, p.stats_bf16);
      mn = load_stat(p.min, k * p.groups + g, p.stats_bf16);
    }
  }
  // x̂ position (n, k) of a buffer: (n / 64) * 8192 + (k / 8) * 1024 + (k % 8) * 128 + (((n % 64) / 8) ^ (k % 8)) * 16.
  const std::uint32_t row = xbuf + wg * 8192 + (r / 8) * 1024 + (r % 8) * 128;
  const int x = r % 8;
  // bf16x2 arithmetic needs bf16 statistics, and at 8 bits scale 2^67 below the bf16 overflow
  // (scale < 2^61: values spanning less than about 5.9e20).
  if (kInterleaved<kBits> && p.stats_bf16 && (kBits != 8 || scale < 0x1p61f)) {
    // The statistics as bf16 again (exact: they were bf16; scale 2^67 too), each in both halves.
    const __nv_bfloat162 scale2 = __bfloat162bfloat162(__float2bfloat16_rn(kBits == 8 ? scale * 0x1p67f : scale));
    const __nv_bfloat162 min2 = __bfloat162bfloat162(__float2bfloat16_rn(mn));
    [&]<int... J>(std::integer_sequence<int, J...>) {
      (st_shared_v4(row + (((4 * h + J) ^ x) << 4), dequant8<kBits, J, kInterleaved<kBits>>(wd, 0.f, 0.f, scale2, min2)),
       ...);
    }(std::make_integer_sequence<int, kChunkCols / 8>{});
  } else {
    const float S = scale * static_cast<float>(1 << kMagicShift<kBits>), M = mn - S;
    const __nv_bfloat162 z{};
    [&]<int... J>(std::integer_sequence<int, J...>) {
      (st_shared_v4(row + (((4 * h + J) ^ x) << 4), dequant8<kBits, J, false>(wd, S, M, z, z)), ...);
    }(std::make_integer_sequence<int, kChunkCols / 8>{});
  }
}

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

// ---------------------------------------------------------------------------------------------
// RS: x̂ dequantized straight into the A fragments of register-sourced wgmma (2, 4 and 8 bits,
// bf16 statistics, every operand by TMA). Per k-block this drops the x̂ buffers' 16 KB of
// stores and the wgmmas' 16 KB of x̂ reads from shared memory, which the tensor cores share with
// the TMA writes and the dy reads (the SS path's bound: see docs/notes/quant.md).
// ---------------------------------------------------------------------------------------------

// The statistics rearranged for the A fragments. A thread's fragment holds k rows 2 j, 2 j + 1,
// 2 j + 8 and 2 j + 9 of each 16-row step (j = lane % 4), one group; its pairs are (k, k + 1) of one
// column, so it wants each statistic as bf16x2 over rows (k, k + 1). Group slot gs (the tile's
// groups from its first, at most 4 as group >= 32) holds, for step t and lane residue j, 16 bytes:
// {scale (r, r + 1), scale (r + 8, r + 9), min (r, r + 1), min (r + 8, r + 9)}, r = 16 t + 2 j, at
// byte gs * 256 + t * 64 + j * 16. At 8 bits, flag word i (i < 3) after the 4 slots is a ballot
// of transposing warp i: some scale >= 2^61 (its scale 2^67 would overflow bf16).
constexpr std::uint32_t kHugeScaleBits = (61 + 127) << 7;  // bf16 2^61

// The producer warpgroup of the RS path: thread 0 brings dy, the words and the statistics rows by
// TMA (as the SS producer, all by TMA here, its one arrival on the full barrier); warps 1-3 then
// rearrange each stage's statistics (transpose_stats) and arrive on its ready barrier; the
// consumers wait for both.
template <int kBits>
struct ProducerRs : Producer<kBits> {
  int g_first, slots;
  using Producer<kBits>::p;
  using Producer<kBits>::sm;
  using Producer<kBits>::w;

  __device__ void load() {
    const int n = w.kb_end - w.kb_begin;
    for (int it = 0; it < n; ++it) {
      const int s = it % sm.stages, kb = w.kb_begin + it;
      mbar_wait(sm.empty(s), ((it / sm.stages) & 1) ^ 1);
      mbar_arrive_expect_tx(sm.full(s), this->tma_bytes(kb));
      this->issue_tma(s, kb);
    }
  }

  // Warps 1-3 (tt = 0..95): per stage, item (gs, row pair pr, array a) packs rows 2 pr, 2 pr + 1
  // of group g_first + gs into one bf16x2 (zero past K; rows past the bulk copy's bytes, in a last
  // partial k-block, from global memory).
  __device__ void transpose_stats(int tt) {
    const int n = w.kb_end - w.kb_begin;
    for (int it = 0; it < n; ++it) {
      const int s = it % sm.stages, kb = w.kb_begin + it;
      const std::int64_t k0 = static_cast<std::int64_t>(kb) * kBlockK;
      mbar_wait(sm.full(s), (it / sm.stages) & 1);
      const std::uint32_t raw = sm.stat_slot(s), dst = sm.tstat_slot(s), copied = stats_copy_bytes(p, kb);
      bool huge = false;
      for (int item = tt; item < slots * 64; item += 96) {
        const int gs = item / 64, a = item / 32 % 2, pr = item % 32, g = g_first + gs;
        std::uint32_t v[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int r = 2 * pr + e;
          const std::int64_t k = k0 + r;
          v[e] = 0;
          if (k < p.k) {
            const std::uint32_t off = static_cast<std::uint32_t>((r * p.groups + g) * 2);
            v[e] = off < copied ? ld_shared_u16(raw + a * kStatsBytes + off)
                                : __ldg(static_cast<const unsigned short*>(a == 0 ? p.scale : p.min) + k * p.groups + g);
          }
        }
        if (kBits == 8 && a == 0) huge |= (v[0] & 0x7FFFu) >= kHugeScaleBits || (v[1] & 0x7FFFu) >= kHugeScaleBits;
        st_shared_u32(dst + gs * kTStatGroupBytes + pr / 8 * 64 + pr % 4 * 16 + a * 8 + pr % 8 / 4 * 4, v[0] | v[1] << 16);
      }
      if constexpr (kBits == 8) {
        const unsigned ballot = __ballot_sync(0xFFFFFFFFu, huge);
        if (tt % 32 == 0) st_shared_u32(dst + kTStatFlags + 4 * (tt / 32), ballot);
      }
      mbar_arrive(sm.ready(s));
    }
  }
};

__device__ __forceinline__ void ldsm_x4_trans(std::uint32_t* r, std::uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// One pair of a register from ldmatrix (rows k, k + 1 of one 16-bit half), the level at bit kBit,
// in f32 arithmetic: the 8-bit fallback for scales >= 2^61.
template <int kBits, int kBit>
__device__ __forceinline__ std::uint32_t pair_f32_at(std::uint32_t v, std::uint32_t scale2, std::uint32_t min2) {
  constexpr std::uint32_t mask = (1u << kBits) - 1u;
  const float q0 = static_cast<float>(v >> kBit & mask), q1 = static_cast<float>(v >> (16 + kBit) & mask);
  const float s0 = __uint_as_float(scale2 << 16), s1 = __uint_as_float(scale2 & 0xFFFF0000u);
  const float m0 = __uint_as_float(min2 << 16), m1 = __uint_as_float(min2 & 0xFFFF0000u);
  const __nv_bfloat162 x = __floats2bfloat162_rn(fmaf(q0, s0, m0), fmaf(q1, s1, m1));
  return *reinterpret_cast<const std::uint32_t*>(&x);
}

// Consumer thread ct's A fragments of k-block stage s: a[4 t + i] is register i of k16 step t
// (i = 0: row 16 w + q, k rows 2 j, 2 j + 1; 1: row + 8; 2: k rows + 8; 3: both). Two
// ldmatrix.x4.trans bring the warp's 16-byte piece of all 64 packed rows (register i: rows
// 8 i + 2 j, + 1), four 16-byte loads the statistics.
template <int kBits>
__device__ __forceinline__ void dequant_rs(const Smem& sm, int s, int wg, int w, int lane, int gs, std::uint32_t (&a)[16]) {
  constexpr int W = 8 / kBits;
  const int unit = wg * (kBits / 2) + w / W, j = lane % 4;
  const std::uint32_t slot = sm.word_slot(s), stats = sm.tstat_slot(s) + gs * kTStatGroupBytes + j * 16;
  std::uint32_t m[8];
  ldsm_x4_trans(m, slot + word_offset<kBits>(lane, 16 * unit));
  ldsm_x4_trans(m + 4, slot + word_offset<kBits>(32 + lane, 16 * unit));
  // The warp's two columns to bits [0, kBits) and [kBits, 2 kBits) of each half (the halves'
  // other columns shift past them: 2 v kBits <= 16 - 2 kBits).
  if constexpr (W > 1) {
    const int shift = 2 * (w % W) * kBits;
#pragma unroll
    for (int i = 0; i < 8; ++i) m[i] >>= shift;
  }
  bool huge = false;
  if constexpr (kBits == 8) {
    const uint4 f = ld_shared_v4(sm.tstat_slot(s) + kTStatFlags);
    huge = (f.x | f.y | f.z) != 0;
  }
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    const uint4 st = ld_shared_v4(stats + t * 64);  // scale (2j), scale (2j + 8), min (2j), min (2j + 8)
    if (kBits == 8 && huge) {
      a[4 * t + 0] = pair_f32_at<kBits, 0>(m[2 * t], st.x, st.z);
      a[4 * t + 1] = pair_f32_at<kBits, kBits>(m[2 * t], st.x, st.z);
      a[4 * t + 2] = pair_f32_at<kBits, 0>(m[2 * t + 1], st.y, st.w);
      a[4 * t + 3] = pair_f32_at<kBits, kBits>(m[2 * t + 1], st.y, st.w);
      continue;
    }
    __nv_bfloat162 s_lo = *reinterpret_cast<const __nv_bfloat162*>(&st.x), s_hi = *reinterpret_cast<const __nv_bfloat162*>(&st.y);
    if constexpr (kBits == 8) {  // scale 2^67, exact (no scale >= 2^61 in this k-block)
      constexpr std::uint32_t kTwo67 = 0x61006100u;
      s_lo = __hmul2(s_lo, *reinterpret_cast<const __nv_bfloat162*>(&kTwo67));
      s_hi = __hmul2(s_hi, *reinterpret_cast<const __nv_bfloat162*>(&kTwo67));
    }
    const __nv_bfloat162 m_lo = *reinterpret_cast<const __nv_bfloat162*>(&st.z), m_hi = *reinterpret_cast<const __nv_bfloat162*>(&st.w);
    a[4 * t + 0] = pair_bf16_at<kBits, 0>(m[2 * t], s_lo, m_lo);
    a[4 * t + 1] = pair_bf16_at<kBits, kBits>(m[2 * t], s_lo, m_lo);
    a[4 * t + 2] = pair_bf16_at<kBits, 0>(m[2 * t + 1], s_hi, m_hi);
    a[4 * t + 3] = pair_bf16_at<kBits, kBits>(m[2 * t + 1], s_hi, m_hi);
  }
}

// Keeps A fragment registers alive and in place: wgmma reads them asynchronously, until the
// wgmma_wait that retires it.
__device__ __forceinline__ void fence_regs(std::uint32_t (&a)[16]) {
#pragma unroll
  for (int i = 0; i < 16; ++i) asm volatile("" : "+r"(a[i])::"memory");
}

// wgmma 64x256x16, A from registers (a[0..3], K-major by definition), B = dy from shared memory.
template <class Acc>
__device__ __forceinline__ void wgmma_rs(const std::uint32_t* a, std::uint64_t desc_b, Acc& acc, GMMA::ScaleOut scale) {
  [&]<int... I>(std::integer_sequence<int, I...>) {
    SM90::GMMA::MMA_64x256x16_F32BF16BF16_RS<GMMA::Major::K, GMMA::Major::MN>::fma(a[0], a[1], a[2], a[3], desc_b,
                                                                                  acc(I)..., scale);
  }(std::make_integer_sequence<int, 128>{});
}

// The consumers of the RS path. Per k-block: issue k-block it's 4 wgmmas from its A fragments,
// wait until k-block it - 1's have retired (release its stage), then dequantize k-block it + 1
// into the other fragment set while k-block it's run. No barrier between threads: each thread's
// fragments are its own.
template <int kBits>
__device__ void consume_rs(const Params& p, const Smem& sm, const std::uint8_t* smem_raw, const CtaWork& w, int g_first) {
  constexpr int S = kStagesOf<true>;
  const int ct = static_cast<int>(threadIdx.x) - kProducerThreads;  // 0..255
  const int wg = ct / 128, warp = ct % 128 / 32, lane = ct % 32;
  TiledMma mma;
  auto thr = mma.get_thread_slice(ct);
  const Bf16* dy = reinterpret_cast<const Bf16*>(smem_raw + (sm.a - smem_addr(smem_raw)));
  Tensor sDy = make_tensor(make_smem_ptr(dy), SmemLayoutAOf<S>{});  // (BLK_M,BLK_K,PIPE)
  Tensor tCrB = thr.make_fragment_B(thr.partition_B(sDy));          // (MMA,1,MMA_K,PIPE) descriptors: dy
  Tensor acc = partition_fragment_C(mma, Shape<Int<kBlockN>, Int<kBlockM>>{});  // (MMA,1,1) fp32: dWᵀ tile
  // The group of the thread's two columns (the last one for columns past CIN), as a slot.
  const int gs = min((w.nb * kBlockN + column_of_rs<kBits>(64 * wg + 16 * warp + lane / 4)) / p.group, p.groups - 1) - g_first;

  const int n = w.kb_end - w.kb_begin;
  std::uint32_t a0[16], a1[16];
  mbar_wait(sm.full(0), 0);
  mbar_wait(sm.ready(0), 0);
  dequant_rs<kBits>(sm, 0, wg, warp, lane, gs, a0);
  auto step = [&](int it, std::uint32_t(&cur)[16], std::uint32_t(&nxt)[16]) {
    const int s = it % S;
    fence_regs(cur);
    warpgroup_fence_operand(acc);
    warpgroup_arrive();
    CUTE_UNROLL
    for (int kk = 0; kk < kBlockK / 16; ++kk)
      wgmma_rs(cur + 4 * kk, tCrB(0, 0, kk, s), acc, it == 0 && kk == 0 ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One);
    warpgroup_commit_batch();
    warpgroup_wait<1>();  // k-block it - 1's wgmmas have retired: its stage and fragments are free
    warpgroup_fence_operand(acc);
    fence_regs(nxt);
    if (it > 0) mbar_arrive(sm.empty((it - 1) % S));
    if (it + 1 < n) {
      const int s1 = (it + 1) % S;
      mbar_wait(sm.full(s1), ((it + 1) / S) & 1);
      mbar_wait(sm.ready(s1), ((it + 1) / S) & 1);
      dequant_rs<kBits>(sm, s1, wg, warp, lane, gs, nxt);
    }
  };
  for (int it = 0; it < n; it += 2) {
    step(it, a0, a1);
    if (it + 1 < n) step(it + 1, a1, a0);
  }
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc);
  fence_regs(a0);
  fence_regs(a1);
  store_tile<kBits, true>(acc, ct, p, w);
}

// The two consumer warpgroups. Per k-block, warpgroup wg dequantizes its 64 x̂ columns of the
// next k-block into the x̂ ring while its 4 wgmma 64x256x16 on the current one run: issue the
// wgmmas of k-block i, dequantize k-block i + 1 (into the buffer k-block i - 2 used, whose
// wgmmas retired in the previous iteration), wait until at most the wgmmas of k-block i are in
// flight, release k-block i - 1's stage to the producer, fence the x̂ stores to the async proxy
// and synchronise the warpgroup's 128 threads (barrier 1 + wg), so that k-block i + 1's wgmmas
// may read what all of them wrote.
template <int kBits>
__device__ void consume(const Params& p, const Smem& sm, const std::uint8_t* smem_raw, const CtaWork& w) {
  const int ct = static_cast<int>(threadIdx.x) - kProducerThreads;  // 0..255
  const int wg = ct / 128, t = ct % 128;
  TiledMma mma;
  auto thr = mma.get_thread_slice(ct);
  const Bf16* dy = reinterpret_cast<const Bf16*>(smem_raw + (sm.a - smem_addr(smem_raw)));
  const Bf16* xhat = reinterpret_cast<const Bf16*>(smem_raw + (sm.x - smem_addr(smem_raw)));
  Tensor sDy = make_tensor(make_smem_ptr(dy), SmemLayoutA{});   // (BLK_M,BLK_K,PIPE)
  Tensor sX = make_tensor(make_smem_ptr(xhat), SmemLayoutX{});  // (BLK_N,BLK_K,XBUFS)
  Tensor tCrA = thr.make_fragment_A(thr.partition_A(sX));   // (MMA,1,MMA_K,XBUFS) descriptors: x̂ᵀ
  Tensor tCrB = thr.make_fragment_B(thr.partition_B(sDy));  // (MMA,1,MMA_K,PIPE) descriptors: dy
  Tensor acc = partition_fragment_C(mma, Shape<Int<kBlockN>, Int<kBlockM>>{});  // (MMA,1,1) fp32: dWᵀ tile

  const int n = w.kb_end - w.kb_begin;
  // The group of the thread's chunk (the last one for columns past CIN).
  const int g = min((w.nb * kBlockN + kChunkCols * (2 * wg + t / kBlockK)) / p.group, p.groups - 1);
  mbar_wait(sm.full(0), 0);
  dequantize<kBits>(p, sm, 0, w.kb_begin, g, sm.x, wg, t);
  fence_proxy_async_shared();
  consumer_barrier(wg);
  mma.accumulate_ = GMMA::ScaleOut::Zero;  // the first wgmmas overwrite the accumulators
  for (int it = 0; it < n; ++it) {
    const int s = it % kStages, xb = it % kXBufs;
    warpgroup_fence_operand(acc);
    warpgroup_arrive();
    CUTE_UNROLL
    for (int kk = 0; kk < size<2>(tCrA); ++kk) {  // 4 k16 steps, one wgmma 64x256x16 each
      gemm(mma, tCrA(_, _, kk, xb), tCrB(_, _, kk, s), acc);
      mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    if (it + 1 < n) {
      const int s1 = (it + 1) % kStages;
      mbar_wait(sm.full(s1), ((it + 1) / kStages) & 1);
      dequantize<kBits>(p, sm, s1, w.kb_begin + it + 1, g, sm.x + ((it + 1) % kXBufs) * kXBufBytes, wg, t);
    }
    warpgroup_wait<1>();  // k-block it - 1's wgmmas have retired: its stage and x̂ buffer are free
    warpgroup_fence_operand(acc);
    if (it > 0) mbar_arrive(sm.empty((it - 1) % kStages));
    if (it + 1 < n) {
      fence_proxy_async_shared();
      consumer_barrier(wg);
    }
  }
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc);
  store_tile<kBits>(acc, ct, p, w);
}

#endif  // FK_WGRAD_SM90

template <int kBits, bool kRs>
__global__ void __launch_bounds__(kThreads, 1)
    weight_grad_packed_kernel(const __grid_constant__ Params p, const __grid_constant__ CUtensorMap tmap_dy,
                              const __grid_constant__ CUtensorMap tmap_x) {
#if FK_WGRAD_SM90
  // The fix-up kernel may be launched now: it waits for this grid to finish before it reads.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  extern __shared__ std::uint8_t smem_raw[];
  const Smem sm = carve_smem<kBits, kRs>(smem_raw);
  constexpr int kTransposers = kProducerThreads - 32;  // RS: producer warps 1-3
  if (threadIdx.x == 0) {
    for (int s = 0; s < sm.stages; ++s) {
      mbar_init(sm.full(s), kRs ? 1 : kFullArrivals);
      mbar_init(sm.empty(s), kEmptyArrivals);
      if (kRs) mbar_init(sm.ready(s), kTransposers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const CtaWork w = cta_work(p);
  // RS: the groups the tile's columns fall in (the last one for columns past CIN).
  const int g_first = w.nb * kBlockN / p.group;
  const int slots = min((w.nb * kBlockN + kBlockN - 1) / p.group, p.groups - 1) - g_first + 1;
  if (threadIdx.x < kProducerThreads) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kProducerRegs));
    const int pt = static_cast<int>(threadIdx.x);
    if constexpr (kRs) {
      ProducerRs<kBits> producer{{p, &tmap_dy, &tmap_x, sm, w, pt}, g_first, slots};
      if (pt == 0) producer.load();
      else if (pt >= 32) producer.transpose_stats(pt - 32);
    } else {
      Producer<kBits>{p, &tmap_dy, &tmap_x, sm, w, pt}.run();
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kConsumerRegs));
    if constexpr (kRs) consume_rs<kBits>(p, sm, smem_raw, w, g_first);
    else consume<kBits>(p, sm, smem_raw, w);
  }
#else
  __trap();  // the launcher never starts this kernel off sm_90
#endif
}

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

// ---------------------------------------------------------------------------------------------
// Host side
// ---------------------------------------------------------------------------------------------


// A row-major [rows, cols] tensor as a TMA source of box_cols x box_rows boxes, zeros outside.
CUtensorMap tensor_map_2d(const char* what, const void* base, CUtensorMapDataType type, int elem_bytes,
                          std::int64_t rows, std::int64_t cols, int box_cols, int box_rows, CUtensorMapSwizzle swizzle) {
  return sm90::tensor_map<2>(kOp, what, type, base, {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)},
                             {static_cast<cuuint64_t>(cols) * elem_bytes},
                             {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows)}, swizzle);
}

// The fix-up as a programmatic dependent launch: it is scheduled while the main kernel runs and
// waits for it on the GPU (griddepcontrol.wait), so no launch gap separates the two.
template <int kBits, bool kRs>
void launch_fixup(const Params& p, unsigned tiles, cudaStream_t s) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(tiles, p.half_partials ? kBlockM / 16 : kBlockM / 8);  // (tile, rows)
  cfg.blockDim = dim3(kFixupThreads);
  cfg.stream = s;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  auto* kernel = p.half_partials ? weight_grad_fixup_f16_kernel<kBits, kRs> : weight_grad_fixup_kernel<kBits, kRs>;
  // The same shared-memory carveout as the main kernel's, so that an SM going from one kernel to
  // the other need not reconfigure its L1 / shared memory split.
  FK_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared));
  FK_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p));
}

template <int kBits, bool kRs = false>
void launch_main(const Params& p, unsigned ctas, const CUtensorMap& map_dy, const CUtensorMap& map_x, cudaStream_t s) {
  auto kernel = weight_grad_packed_kernel<kBits, kRs>;
  constexpr int smem = kSmemBytes<kBits, kRs>;
  FK_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<ctas, kThreads, smem, s>>>(p, map_dy, map_x);
  FK_CUDA_CHECK_LAUNCH("weight_grad_packed_kernel");
  if (p.splits > 1) launch_fixup<kBits, kRs>(p, ctas / static_cast<unsigned>(p.splits), s);
}


bool aligned(const void* ptr, std::uintptr_t a) { return reinterpret_cast<std::uintptr_t>(ptr) % a == 0; }

}  // namespace

void weight_grad_from_packed(const TensorView& dy, const PackedView& x, const TensorView& dw,
                             const WeightGradParams& wp, const Stream* stream) {
  const int device = dy.device().index;
  fk::detail::DeviceScope on_device(device);
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
  p.stats_bf16 = x.scale.dtype() == DType::bf16;
  p.dw_bf16 = dw.dtype() == DType::bf16;
  p.accumulate = wp.beta != 0.0f;
  // TMA needs 16-byte aligned bases and row strides.
  const std::int64_t row_bytes = static_cast<std::int64_t>(p.row_words) * 4;
  p.tma_a = cout % 8 == 0 && aligned(dy.data(), 16);
  p.tma_x = row_bytes % 16 == 0 && aligned(x.words.data(), 16);
  p.stats_bytes = p.stats_bf16 ? 2 : 4;
  p.tma_stats = aligned(p.scale, 16) && aligned(p.min, 16) && kBlockK * x.groups() * p.stats_bytes <= kStatsBytes;

  const int sms = multiprocessor_count();
  // One tile per CTA when the tiles fill the GPU; otherwise split K S ways, S = SMs / tiles (but
  // no fewer than kMinKBlocksPerCta k-blocks a CTA): CTA t * S + s takes k-blocks
  // [s KB / S, (s + 1) KB / S) of tile t. All CTAs run at once, and those of one k-range read the
  // same dy rows (6 n-tiles for CIN = 768) and packed rows (3 m-tiles) at about the same time, so
  // that both come from DRAM about once.
  const std::int64_t splits =
      tiles >= sms ? 1 : std::clamp<std::int64_t>(std::min<std::int64_t>(sms / tiles, p.kblocks / kMinKBlocksPerCta), 1, sms);
  p.splits = static_cast<int>(splits);
  const std::int64_t ctas = tiles * splits;
  FK_CHECK_ARG(ctas <= INT_MAX, kOp, "dw", "fewer than 2^31 tiles of 256x128", dw.shape().str());

  // Split partials: fp32 tiles, or fp16 tiles (half the bytes) followed by one exponent byte
  // per 8 values (see store_partial_f16).
  p.half_partials = splits > 1 && p.dw_bf16 && !wp.fp32_partials;
  fk::Tensor workspace;
  if (splits > 1) {
    const std::int64_t bytes = p.half_partials ? ctas * (kTileElems * 2 + kTileElems / 8) : ctas * kTileElems * 4;
    workspace = fk::Tensor::empty({bytes / 4}, DType::f32, dy.device(), stream);
    p.workspace = workspace.data_as<float>();
    if (p.half_partials)
      p.partial_exps = reinterpret_cast<std::uint8_t*>(p.workspace) + ctas * kTileElems * 2;
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
  // Register-sourced A (consume_rs) wherever its inputs allow: 2, 4 and 8 bits with bf16
  // statistics and every operand by TMA; else x̂ through shared memory (consume).
  const bool rs = x.bits != 1 && p.stats_bf16 && p.tma_a && p.tma_x && p.tma_stats;
  const unsigned grid = static_cast<unsigned>(ctas);
  switch (x.bits) {
    case 1: launch_main<1>(p, grid, map_dy, map_x, s); break;
    case 2: rs ? launch_main<2, true>(p, grid, map_dy, map_x, s) : launch_main<2>(p, grid, map_dy, map_x, s); break;
    case 4: rs ? launch_main<4, true>(p, grid, map_dy, map_x, s) : launch_main<4>(p, grid, map_dy, map_x, s); break;
    case 8: rs ? launch_main<8, true>(p, grid, map_dy, map_x, s) : launch_main<8>(p, grid, map_dy, map_x, s); break;
    default: throw_internal("weight_grad_from_packed: bits not checked by the caller");
  }
}

}  // namespace fk::cuda
