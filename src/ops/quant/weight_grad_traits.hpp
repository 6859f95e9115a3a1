// weight_grad_from_packed's kernel traits: tile shape, pipeline depths, warp roles, register
// split and shared-memory budget, the parameter block, and the launchers the per-bit-width
// translation units define (weight_grad_from_packed_b*.cu). The design: docs/quant.md.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace fk::cuda::wgrad {

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

// The main kernel on CTAs [0, ctas) and, when K is split (p.splits > 1), its fix-up kernel:
// x̂ through shared memory (kRs = false) or straight into registers (kRs = true). Defined for
// bits 1 (kRs = false only), 2, 4 and 8, one bit width per translation unit.
template <int kBits, bool kRs = false>
void launch_main(const Params& p, unsigned ctas, const CUtensorMap& map_dy, const CUtensorMap& map_x, cudaStream_t s);
template <> void launch_main<1, false>(const Params&, unsigned, const CUtensorMap&, const CUtensorMap&, cudaStream_t);
template <> void launch_main<2, false>(const Params&, unsigned, const CUtensorMap&, const CUtensorMap&, cudaStream_t);
template <> void launch_main<2, true>(const Params&, unsigned, const CUtensorMap&, const CUtensorMap&, cudaStream_t);
template <> void launch_main<4, false>(const Params&, unsigned, const CUtensorMap&, const CUtensorMap&, cudaStream_t);
template <> void launch_main<4, true>(const Params&, unsigned, const CUtensorMap&, const CUtensorMap&, cudaStream_t);
template <> void launch_main<8, false>(const Params&, unsigned, const CUtensorMap&, const CUtensorMap&, cudaStream_t);
template <> void launch_main<8, true>(const Params&, unsigned, const CUtensorMap&, const CUtensorMap&, cudaStream_t);

}  // namespace fk::cuda::wgrad
