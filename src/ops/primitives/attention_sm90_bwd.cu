// attention_backward on Hopper tensor cores (sm_90a): FlashAttention-3's dk/dv kernel, bf16/f16,
// head_dim 64 or 128, dense or packed (varlen) batches, causal (either alignment) or not,
// grouped-query heads. The [Sq, Sk] matrices live only in registers (and one BLK_M x 128 tile of
// dS in shared memory).
//
// Three launches around it (attention_mma_bwd.cu's): delta = rowsum(dout ⊙ out) and dq_accum = 0
// before, dq_accum rounded into dq after. A CTA owns 128 keys of one (sequence, k/v head) and
// walks every BLK_M-query block (block_m: 128 at D 64, 64 at D 128) of every q head of its group
// that sees one of its keys (causal: the heaviest CTAs, the first key blocks of every head, start
// first: cta_place), with three warpgroups:
//   - producer (warp 0 of the first warpgroup): K and V of the CTA's keys once, then each step's Q
//     and dO into a 2-stage ring by TMA (128-byte swizzle, 4-D maps over each tensor's own strides
//     from head_map: dense (D, S, H, B), rows past S read as zeros; packed (D, total, H, 1), rows
//     past a sequence's end are the next sequence's tokens), and the step's lse (in log2 units)
//     and delta into shared memory by plain stores, handed over by named barriers (per stage: the
//     producer warp's bar.arrive on
//     "stats full" after its stores, the consumers' bar.sync before reading; the consumers'
//     bar.arrive on "stats empty" after reading, the producer's bar.sync before the next stores):
//     generic stores ordered by barriers compute-sanitizer's racecheck follows.
//   - two consumers, 64 keys each (warpgroup w: keys [64 w, 64 w + 64)), per step:
//       Sᵀ = K Qᵀ and dPᵀ = V dOᵀ          wgmma 64x64x16, both operands K-major in shared memory
//       Pᵀ = exp2(s·scale·log2 e - lse₂), dSᵀ = Pᵀ ⊙ (dPᵀ - delta) · scale   in registers (fp32)
//       dV += Pᵀ dO and dK += dSᵀ Q          wgmma 64xDx16, A = Pᵀ / dSᵀ rounded to the dtype in
//                                            registers, B = dO / Q MN-major (the same shared tile);
//                                            dV issued once Pᵀ is rounded, dK once dSᵀ is, so that
//                                            they run under dSᵀ's arithmetic and dS's stores
//       dSᵀ -> shared memory as dS (64 queries x 128 keys, MN-major), then
//       dQ (64 x D) = dS K                   wgmma 64x(D/2)x16, warpgroup w takes columns
//                                            [w D/2, w D/2 + D/2), K MN-major, added to dq_accum
//                                            by f32 atomics (not bitwise reproducible), or (TmaDq,
//                                            AttentionBackwardKernel::wgmma_sm90_tma_dq) staged
//                                            in a swizzled fp32 buffer and added by one thread's
//                                            TMA reduce-adds (cp.reduce.async.bulk.tensor), the
//                                            buffer reused once they read it (wait_group.read,
//                                            then the dS barrier below).
//     A stage goes back to the producer (a barrier of the 8 consumer warps) once every wgmma
//     reading it retired. Two named barriers order the dS tile: written after both warpgroups'
//     previous dQ retired, read after both wrote it.
//   dK and dV (summed over the group's q heads in registers) are written once at the end.
// The register operands: a 64xN fp32 accumulator's values (column pair, row + 8, column + 8) of
// each 16 columns are a 64x16 A fragment's (k pair, row + 8, k + 8), as attention_sm90.cu uses for
// P; so Pᵀ and dSᵀ keep Sᵀ's and dPᵀ's order. The K-major view of a tile (rows, D) and the
// MN-major view (D, rows) of the same bytes are the same function of (row, d) (checked below), so
// Q, dO and K are loaded once and read both ways.
//
// Packed batches (kPacked, a second instantiation; the dense one keeps the dense formulas): the
// grid spans max_seqlen_k, and a CTA whose keys start past its sequence's Sk leaves at once. The
// tiles that run past a sequence hold the next sequence's tokens, and the masks make them count for
// nothing: P and dS are 0 at keys past Sk and at queries past Sq (so are lse and delta, stored as 0
// there), hence dV = Pᵀ dO and dK = dSᵀ Q get nothing from those query rows, and dQ = dS K is
// exactly 0 on them: the atomics skip them, the TMA reduces add those zeros into the next
// sequence's dq_accum rows (or clip them past total_q), which leaves the sums unchanged. dK and dV
// rows past Sk are not stored.
//
// Numerics: fp32 scores, P, dS and accumulators; P and dS rounded to the dtype before their GEMMs
// (as FlashAttention and the mma.sync backward). Everything else (deterministic, windows, softcap,
// D 96/256, other GPUs) stays on attention_mma_bwd.cu / attention_rowwise.cu.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>

#include <cute/tensor.hpp>  // first: the atom headers rely on what it includes before them
#include <cute/atom/mma_atom.hpp>

#include "attention_cuda.hpp"
#include "attention_layout.cuh"
#include "attention_sm90_common.cuh"
#include "fusekit/core/cuda_check.hpp"
#include "fusekit/core/error.hpp"
#include "fusekit/core/tensor.hpp"
#include "ops/common/cuda_common.cuh"
#include "ops/common/sm90_async.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FK_ATTN_BWD_SM90 1
#else
#define FK_ATTN_BWD_SM90 0
#endif

namespace fk::cuda {
namespace {

using namespace sm90;  // mbarriers, TMA; exp2, pack2, named barriers, head maps
using namespace cute;
using cute::Tensor;  // fk declares Tensor too

constexpr const char* kOp = "attention_backward";

constexpr int kBlockN = 128;  // keys of a CTA
// Queries of a step: 128 at D = 64 (twice the GEMM work a step for the same barriers and waits;
// the registers allow it there), 64 at D = 128.
constexpr int block_m(int d) { return d == 64 ? 128 : 64; }
constexpr int kStages = 2;
constexpr int kProducerThreads = 128, kConsumerThreads = 256, kThreads = kProducerThreads + kConsumerThreads;
// Named barriers of the lse/delta stages (1 and 2 order the dS tile): the producer warp and the
// consumers.
[[maybe_unused]] constexpr int kStatsFullBarrier = 3, kStatsEmptyBarrier = 3 + kStages, kStatsThreads = 32 + kConsumerThreads;
// TMA-reduce dq: named barrier kdQBarrier + w (one warpgroup's 128 threads) orders its dQ tile's
// shared-memory stores before the reduce that reads them.
[[maybe_unused]] constexpr int kdQBarrier = 3 + 2 * kStages, kWarpgroupThreads = 128;
// Register budget of a consumer thread at D = 128: dK and dV accumulators 2 x 64 fp32, Sᵀ and dPᵀ
// 2 x 32, Pᵀ and dSᵀ rounded 2 x 16, dQ's 32 (once Sᵀ and dPᵀ are dead): about 224 at the peak,
// hence 240 for the consumers and 24 for the producer (128 x 24 + 256 x 240 <= 384 x 168).
constexpr int kProducerRegs = 24, kConsumerRegs = 240;
static_assert(kProducerThreads * kProducerRegs + kConsumerThreads * kConsumerRegs <= kThreads * 168);
[[maybe_unused]] constexpr int kConsumerWarps = kConsumerThreads / 32;  // each releases a stage once its wgmmas retired
[[maybe_unused]] constexpr int kProducerLanes = 32;                    // the producer warp: all arrive on a full barrier
constexpr float kLog2e = 1.4426950408889634f;

template <class T, int D>
struct Traits {
  static_assert(D == 64 || D == 128);
  static constexpr int kBlockM = block_m(D);
  // K and V (BLK_N, D), Q and dO (BLK_M, D, PIPE): D-contiguous rows in 128-byte swizzled atoms of
  // 8 rows x 64 elements, rows adjacent, so that each 64-column slab of a tile is one TMA box.
  using SmemLayoutK = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<T>{}, Shape<Int<kBlockN>, Int<D>>{}));
  using SmemLayoutQ = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<T>{},
                                             Shape<Int<kBlockM>, Int<D>, Int<kStages>>{}));  // (BLK_M,D,PIPE)
  // The same bytes as MN-major B operands (N = D contiguous): atoms of 64 d x 8 rows, rows
  // adjacent first, then the 64-column slabs, as attention_sm90.cu reads V.
  using SmemLayoutKt = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<T>{}, Shape<Int<D>, Int<kBlockN>>{},
                                              Step<_2, _1>{}));  // (D,BLK_N)
  using SmemLayoutQt = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<T>{},
                                              Shape<Int<D>, Int<kBlockM>, Int<kStages>>{},
                                              Step<_2, _1, _3>{}));  // (D,BLK_M,PIPE)
  // dS (BLK_M queries, BLK_N keys), queries contiguous: the MN-major A operand of dQ = dS K.
  using SmemLayoutdS = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<T>{},
                                              Shape<Int<kBlockM>, Int<kBlockN>>{}));  // (BLK_M,BLK_N)
  // Sᵀ, dPᵀ (BLK_N, BLK_M): two warpgroups side by side in M (keys).
  using MmaSdP = decltype(make_tiled_mma(
      SM90::GMMA::ss_op_selector<T, T, float, Shape<_64, Int<kBlockM>, Int<D>>, GMMA::Major::K, GMMA::Major::K>(),
      cute::Layout<Shape<_2, _1, _1>>{}));
  // dV, dK (BLK_N, D) += Pᵀ / dSᵀ (BLK_N, BLK_M, registers) x dO / Q (D, BLK_M, MN-major).
  using MmadKV = decltype(make_tiled_mma(
      SM90::GMMA::rs_op_selector<T, T, float, Shape<_64, Int<D>, Int<kBlockM>>, GMMA::Major::K, GMMA::Major::MN>(),
      cute::Layout<Shape<_2, _1, _1>>{}));
  // dQ (BLK_M, D) = dS (BLK_M, BLK_N) x K (D, BLK_N): two warpgroups side by side in N (columns).
  using MmadQ = decltype(make_tiled_mma(
      SM90::GMMA::ss_op_selector<T, T, float, Shape<_64, Int<D / 2>, Int<kBlockN>>, GMMA::Major::MN,
                                 GMMA::Major::MN>(),
      cute::Layout<Shape<_1, _2, _1>>{}));

  static constexpr int kBytesKV = kBlockN * D * 2;  // K (or V)
  static constexpr int kBytesQ = kBlockM * D * 2;   // one stage of Q (or of dO)
  static constexpr int kBytesdS = kBlockM * kBlockN * 2;
  // dQ (BLK_M, D) fp32 for the TMA reduce (the tma_dq variant; reserved by both): warpgroup w's
  // D/2 columns at w * kBytesdQ / 2, in slabs of 32 columns (BLK_M rows of 128 bytes, 128-byte
  // swizzle: the 16-byte chunk c of row r at chunk c ^ (r % 8)), one TMA box each.
  static constexpr int kBytesdQ = kBlockM * D * 4;
  static constexpr int kOffV = kBytesKV, kOffQ = 2 * kBytesKV, kOffdO = kOffQ + kStages * kBytesQ,
                       kOffdS = kOffdO + kStages * kBytesQ, kOffdQ = kOffdS + kBytesdS, kOffLse = kOffdQ + kBytesdQ,
                       kOffDelta = kOffLse + kStages * kBlockM * 4, kOffBars = kOffDelta + kStages * kBlockM * 4;
  static constexpr int kBarriers = 1 + 2 * kStages;  // kv_full, full[s], empty[s]
  // packed: the CTA's sequence {Sq, Sk, first query token, first key token} (Cta::seq_s)
  static constexpr int kOffSeq = kOffBars + 8 * kBarriers;
  static constexpr int kSmemBytes = kOffSeq + 16 + 1024;  // + slack for the 1024-byte alignment
  static_assert(cosize_v<SmemLayoutK> * 2 == kBytesKV && cosize_v<SmemLayoutQ> * 2 == kStages * kBytesQ &&
                cosize_v<SmemLayoutKt> * 2 == kBytesKV && cosize_v<SmemLayoutQt> * 2 == kStages * kBytesQ &&
                cosize_v<SmemLayoutdS> * 2 == kBytesdS);
  static_assert(kOffV % 1024 == 0 && kOffQ % 1024 == 0 && kOffdO % 1024 == 0 && kOffdS % 1024 == 0 &&
                    kOffdQ % 1024 == 0 && (kBytesdQ / 2) % 1024 == 0,
                "the 128-byte swizzle repeats every 1024 bytes: each tile starts on a repeat");
  static_assert(kSmemBytes <= 227 * 1024);
  static_assert(decltype(size(MmaSdP{}))::value == kConsumerThreads &&
                decltype(size(MmadKV{}))::value == kConsumerThreads &&
                decltype(size(MmadQ{}))::value == kConsumerThreads);
};

// The K-major view (rows, D[, PIPE]) and the MN-major view (D, rows[, PIPE]) name the same
// element for every (row, d[, stage]): the TMA box layout (slab j of 64 columns at j * rows * 128
// bytes, 128-byte rows) is what both read. Checked at compile time on rows 0..16 (two swizzle
// repeats and the next atom) and the last row, and every 7th column (all residues modulo the
// 8-element swizzle unit, both slabs at D = 128): the whole tile is past the compiler's constexpr
// budget.
template <class KMajor, class MNMajor, int Rows, int D, int Pipe>
constexpr bool same_bytes() {
  for (int s = 0; s < Pipe; ++s)
    for (int r = 0; r <= 17; ++r)
      for (int d = 0; d < D; d += 7) {
        const int row = r == 17 ? Rows - 1 : r;
        if constexpr (Pipe == 1) {
          if (KMajor{}(row, d) != MNMajor{}(d, row)) return false;
        } else {
          if (KMajor{}(row, d, s) != MNMajor{}(d, row, s)) return false;
        }
      }
  return true;
}

struct Params {
  float* dq_accum;    // f32 like q (dense [B, H, Sq, D], packed [total_q, H, D]), zeroed
  void* dk;           // T like k: dense [B, Hk, Sk, D], packed [total_k, Hk, D]; any strides (dk_st)
  void* dv;           // T like k (dv_st)
  HeadStrides dk_st, dv_st;  // in elements
  const float* lse;   // dense [B, H, Sq], packed [H, total_q]; natural log
  const float* delta; // like lse
  Layout layout;      // B, H, Hk, the lengths (packed: max_seqlens and cu_seqlens)
  int sq, sk, offset; // dense: Sq, Sk and the causal offset (Cta's, as parameters rather than registers)
  float scale, scale_log2;
  bool causal, bottom_right;
};

// Which key block and (b Hk + kh) a CTA takes. CTAs start in the order of their linear index in
// the grid (key blocks, B Hk). Causal: key blocks outer, heads inner, so that the heaviest CTAs
// (a causal key block sees the queries from its own on: the first blocks see the most) start first
// over all heads and the last wave holds the lightest; with grouped-query heads (4x fewer, 4x
// longer CTAs) the heads-outer order ended on the heavy blocks of the last heads. Otherwise (every
// CTA the same work) heads outer, as the grid is, so that the CTAs running at once share a few
// heads' Q and dO in L2.
[[maybe_unused]] __device__ __forceinline__ void cta_place(bool causal, int& key_block, int& bkh) {
  if (!causal) {
    key_block = static_cast<int>(blockIdx.x);
    bkh = static_cast<int>(blockIdx.y);
    return;
  }
  const unsigned linear = blockIdx.y * gridDim.x + blockIdx.x;
  key_block = static_cast<int>(linear / gridDim.y);
  bkh = static_cast<int>(linear % gridDim.y);
}

// The sequence of the CTA (bkh = b Hk + kh) and where its rows are (rows():
// attention_layout.cuh's formulas); TMA coordinates of q, k, v, dout are dense (row in the head, h,
// b), packed (token, h, 0); of dq_accum (contiguous, 3-D) dense (row, b H + h), packed (token, h).
// The consumers' registers are scarce, so the lengths are read where they are used:
// dense from the kernel parameters (as this kernel always did), packed from four ints in shared
// memory that thread 0 stores before the CTA's first barrier (volatile reads: loaded again at
// each use rather than held in registers).
template <bool kPacked>
struct Cta {
  int b, kh, h0, group;       // q heads h0 .. h0 + group - 1 read k/v head kh
  const volatile int* seq_s;  // packed: {Sq, Sk, first query token, first key token}
  __device__ Cta(const Params& p, int bkh, const int* seq_smem) : seq_s(seq_smem) {
    const int kv_heads = static_cast<int>(p.layout.kv_heads);
    b = bkh / kv_heads;
    kh = bkh - b * kv_heads;
    group = static_cast<int>(p.layout.heads) / kv_heads;
    h0 = kh * group;
  }
  // Thread 0, packed, before the first __syncthreads: the sequence into shared memory.
  __device__ static void store_seq(const Params& p, int bkh, int* seq_smem) {
    const int b = bkh / static_cast<int>(p.layout.kv_heads);
    const SeqRows<kPacked> seq = p.layout.template seq<kPacked>(b);
    seq_smem[0] = static_cast<int>(seq.sq);
    seq_smem[1] = static_cast<int>(seq.sk);
    seq_smem[2] = static_cast<int>(seq.q0);
    seq_smem[3] = static_cast<int>(seq.k0);
  }
  // (if constexpr, not ?:, which would make the dense read of p.sq a volatile one)
  __device__ int sq(const Params& p) const {
    if constexpr (kPacked) return seq_s[0];
    else return p.sq;
  }
  __device__ int sk(const Params& p) const {
    if constexpr (kPacked) return seq_s[1];
    else return p.sk;
  }
  __device__ int q0() const {
    if constexpr (kPacked) return seq_s[2];
    else return 0;
  }
  __device__ int k0() const {
    if constexpr (kPacked) return seq_s[3];
    else return 0;
  }
  // causal: key j visible to query i iff j <= i + offset (bottom-right: Sk - Sq)
  __device__ int offset(const Params& p) const {
    if constexpr (kPacked) return p.bottom_right ? seq_s[1] - seq_s[0] : 0;
    else return p.offset;
  }
  __device__ SeqRows<kPacked> rows(const Params& p) const {
    return {sq(p), sk(p), b, q0(), k0(), p.layout.heads, p.layout.kv_heads, p.layout.total_q};
  }
  // TMA coordinates: the row of query i0 (key j0) and the head of q head h (of the k/v head).
  __device__ int q_row(int i0) const { return q0() + i0; }
  __device__ int kv_row(int j0) const { return k0() + j0; }
  __device__ int batch() const { return kPacked ? 0 : b; }
  __device__ int dq_head(const Params& p, int h) const {
    return kPacked ? h : b * static_cast<int>(p.layout.heads) + h;
  }
};

#if FK_ATTN_BWD_SM90

// The steps of the CTA for keys [j0, j0 + BLK_N): step n is q head h0 + n / per_head, queries from
// (qb0 + n % per_head) BLK_M.
struct Steps {
  int qb0, per_head, count, rows;  // rows: BLK_M
  __device__ Steps(bool causal, int sq, int offset, int j0, int group, int block_rows) : rows(block_rows) {
    int q_begin = 0;
    if (causal) q_begin = min(max(j0 - offset, 0), sq);
    qb0 = q_begin / rows;
    per_head = q_begin < sq ? (sq + rows - 1) / rows - qb0 : 0;
    count = group * per_head;
  }
  __device__ int head(int n, int h0) const { return h0 + n / per_head; }
  __device__ int i0(int n) const { return (qb0 + n % per_head) * rows; }
};


struct Bars {
  std::uint32_t base;
  __device__ std::uint32_t kv_full() const { return base; }
  __device__ std::uint32_t full(int s) const { return base + 8 * (1 + s); }
  __device__ std::uint32_t empty(int s) const { return base + 8 * (1 + kStages + s); }
};

// The TMA reduce of the tma_dq variant (PTX ISA 8.0, sm_90; CUTLASS's SM90_TMA_REDUCE_ADD_3D):
// the box of `map` at (c0, c1, c2) += the shared-memory tile at `src` (f32 add, elements outside
// the tensor not written), completing in this thread's bulk async-group.
__device__ __forceinline__ void tma_reduce_add_3d(const CUtensorMap* map, std::uint32_t src, int c0, int c1, int c2) {
  asm volatile("cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4}], [%1];" ::"l"(
                   reinterpret_cast<std::uint64_t>(map)),
               "r"(src), "r"(c0), "r"(c1), "r"(c2)
               : "memory");
}
// Closes this thread's bulk async-group of the copies issued since the last one.
__device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Waits until this thread's bulk async-groups have read their shared-memory sources (the
// buffers may be written again) / have completed (their global writes performed).
__device__ __forceinline__ void bulk_wait_group_read_all() {
  asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}
__device__ __forceinline__ void bulk_wait_group_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// Warp 0 of the producer warpgroup (all 32 lanes; lane 0 issues the TMA).
template <class T, int D, bool kPacked>
__device__ void produce(const Params& p, const CUtensorMap* tq, const CUtensorMap* tk, const CUtensorMap* tv,
                        const CUtensorMap* tdo, std::uint8_t* smem, std::uint32_t base, const Bars& bars, int j0,
                        const Cta<kPacked>& c, const Steps& st) {
  using Tr = Traits<T, D>;
  constexpr int kBlockM = Tr::kBlockM;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  if (st.count == 0) return;  // no loads: the CTA must not exit with a TMA in flight
  if (lane == 0) {
    mbar_arrive_expect_tx(bars.kv_full(), 2 * Tr::kBytesKV);
#pragma unroll
    for (int j = 0; j < D / 64; ++j) {
      tma_load_4d(tk, bars.kv_full(), base + j * kBlockN * 128, 64 * j, c.kv_row(j0), c.kh, c.batch());
      tma_load_4d(tv, bars.kv_full(), base + Tr::kOffV + j * kBlockN * 128, 64 * j, c.kv_row(j0), c.kh, c.batch());
    }
  }
  float* lse_s = reinterpret_cast<float*>(smem + Tr::kOffLse);      // (PIPE, BLK_M)
  float* delta_s = reinterpret_cast<float*>(smem + Tr::kOffDelta);  // (PIPE, BLK_M)
  for (int n = 0; n < st.count; ++n) {
    const int s = n % kStages, free_parity = ((n / kStages) & 1) ^ 1;
    const int i0 = st.i0(n), h = st.head(n, c.h0);
    mbar_wait(bars.empty(s), free_parity);
    if (n >= kStages) named_barrier_sync(kStatsEmptyBarrier + s, kStatsThreads);  // step n - kStages read them
    const std::int64_t stat0 = c.rows(p).stat(h, i0);
#pragma unroll
    for (int r = lane; r < kBlockM; r += 32) {
      const bool ok = i0 + r < c.sq(p);  // rows past Sq: P is masked to 0 there, any finite value does
      lse_s[s * kBlockM + r] = ok ? p.lse[stat0 + r] * kLog2e : 0.0f;
      delta_s[s * kBlockM + r] = ok ? p.delta[stat0 + r] : 0.0f;
    }
    named_barrier_arrive(kStatsFullBarrier + s, kStatsThreads);
    if (lane == 0) {
      // Arrives after this lane's stores and adds the TMA bytes; the other 31 lanes arrive below.
      mbar_arrive_expect_tx(bars.full(s), 2 * Tr::kBytesQ);
#pragma unroll
      for (int j = 0; j < D / 64; ++j) {
        tma_load_4d(tq, bars.full(s), base + Tr::kOffQ + s * Tr::kBytesQ + j * kBlockM * 128, 64 * j, c.q_row(i0), h,
                    c.batch());
        tma_load_4d(tdo, bars.full(s), base + Tr::kOffdO + s * Tr::kBytesQ + j * kBlockM * 128, 64 * j,
                    c.q_row(i0), h, c.batch());
      }
    } else {
      mbar_arrive(bars.full(s));
    }
  }
}

// TmaDq: dq added by TMA reduces of each warpgroup's dQ tile staged in shared memory (map tdq over
// dq_accum), else by f32 atomics from registers.
template <class T, int D, bool TmaDq, bool kPacked>
__device__ void consume(const Params& p, const CUtensorMap* tdq, std::uint8_t* smem, const Bars& bars, int j0,
                        const Cta<kPacked>& c, const Steps& st) {
  using Tr = Traits<T, D>;
  constexpr int kBlockM = Tr::kBlockM;
  constexpr bool kEarlyDv = D == 128;
  const int ct = static_cast<int>(threadIdx.x) - kProducerThreads;  // 0..255
  typename Tr::MmaSdP mma_sdp;
  typename Tr::MmadKV mma_dkv;
  typename Tr::MmadQ mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(ct);
  auto thr_dkv = mma_dkv.get_thread_slice(ct);
  auto thr_dq = mma_dq.get_thread_slice(ct);
  T* base = reinterpret_cast<T*>(smem);
  Tensor sK = make_tensor(make_smem_ptr(base), typename Tr::SmemLayoutK{});                           // (BLK_N,D)
  Tensor sV = make_tensor(make_smem_ptr(base + Tr::kOffV / 2), typename Tr::SmemLayoutK{});           // (BLK_N,D)
  Tensor sKt = make_tensor(make_smem_ptr(base), typename Tr::SmemLayoutKt{});                         // (D,BLK_N)
  Tensor sQ = make_tensor(make_smem_ptr(base + Tr::kOffQ / 2), typename Tr::SmemLayoutQ{});           // (BLK_M,D,PIPE)
  Tensor sdO = make_tensor(make_smem_ptr(base + Tr::kOffdO / 2), typename Tr::SmemLayoutQ{});         // (BLK_M,D,PIPE)
  Tensor sQt = make_tensor(make_smem_ptr(base + Tr::kOffQ / 2), typename Tr::SmemLayoutQt{});         // (D,BLK_M,PIPE)
  Tensor sdOt = make_tensor(make_smem_ptr(base + Tr::kOffdO / 2), typename Tr::SmemLayoutQt{});       // (D,BLK_M,PIPE)
  Tensor sdS = make_tensor(make_smem_ptr(base + Tr::kOffdS / 2), typename Tr::SmemLayoutdS{});        // (BLK_M,BLK_N)
  const float* lse_s = reinterpret_cast<const float*>(smem + Tr::kOffLse);      // (PIPE, BLK_M)
  const float* delta_s = reinterpret_cast<const float*>(smem + Tr::kOffDelta);  // (PIPE, BLK_M)

  Tensor tSrK = thr_sdp.make_fragment_A(thr_sdp.partition_A(sK));      // (MMA,1,D/16) descriptors
  Tensor tSrV = thr_sdp.make_fragment_A(thr_sdp.partition_A(sV));      // (MMA,1,D/16)
  Tensor tSrQ = thr_sdp.make_fragment_B(thr_sdp.partition_B(sQ));      // (MMA,1,D/16,PIPE)
  Tensor tSrdO = thr_sdp.make_fragment_B(thr_sdp.partition_B(sdO));    // (MMA,1,D/16,PIPE)
  Tensor tdVrdO = thr_dkv.make_fragment_B(thr_dkv.partition_B(sdOt));  // (MMA,1,BLK_M/16,PIPE)
  Tensor tdKrQ = thr_dkv.make_fragment_B(thr_dkv.partition_B(sQt));    // (MMA,1,BLK_M/16,PIPE)
  Tensor tdQrdS = thr_dq.make_fragment_A(thr_dq.partition_A(sdS));     // (MMA,1,BLK_N/16)
  Tensor tdQrK = thr_dq.make_fragment_B(thr_dq.partition_B(sKt));      // (MMA,1,BLK_N/16)

  Tensor tSrS = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});    // ((2,2,BLK_M/8),1,1) fp32
  Tensor tSrdP = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});   // ((2,2,BLK_M/8),1,1)
  Tensor tdVrdV = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<D>>{});        // ((2,2,D/8),1,1)
  Tensor tdKrdK = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<D>>{});        // ((2,2,D/8),1,1)
  Tensor tdQrdQ = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<D>>{});         // ((2,2,D/16),1,1)
  // Pᵀ and dSᵀ as A operands of the 64xDx16 wgmmas (the accumulator-to-A order above).
  using RegA = cute::Layout<Shape<Shape<_2, _2, _2>, _1, Int<kBlockM / 16>>, Stride<Stride<_1, _2, _4>, _0, _8>>;
  Tensor tdVrP = make_tensor<T>(RegA{});   // ((2,2,2),1,BLK_M/16)
  Tensor tdKrdS = make_tensor<T>(RegA{});  // ((2,2,2),1,BLK_M/16)
  static_assert(decltype(size(tdVrP))::value == decltype(size(tSrS))::value);
  static_assert(decltype(size<2>(tdVrP))::value == decltype(size<2>(tdVrdO))::value);
  Tensor tdKVc = thr_dkv.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<D>>{}));  // (key, d)
  auto rP = recast<std::uint32_t>(tdVrP);   // (BLK_M/4) pairs
  auto rdS = recast<std::uint32_t>(tdKrdS);
  static_assert(decltype(size(rP))::value * 2 == decltype(size(tSrS))::value);

  clear(tdVrdV);
  clear(tdKrdK);
  mma_dkv.accumulate_ = GMMA::ScaleOut::One;
  // Sᵀ = K Qᵀ, then dPᵀ = V dOᵀ of stage s: two batches.
  auto issue_sdp = [&](int s) {
    warpgroup_fence_operand(tSrS);
    warpgroup_fence_operand(tSrdP);
    warpgroup_arrive();
    mma_sdp.accumulate_ = GMMA::ScaleOut::Zero;
    CUTE_UNROLL
    for (int kk = 0; kk < size<2>(tSrK); ++kk) {
      gemm(mma_sdp, tSrK(_, _, kk), tSrQ(_, _, kk, s), tSrS);
      mma_sdp.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    mma_sdp.accumulate_ = GMMA::ScaleOut::Zero;
    CUTE_UNROLL
    for (int kk = 0; kk < size<2>(tSrV); ++kk) {
      gemm(mma_sdp, tSrV(_, _, kk), tSrdO(_, _, kk, s), tSrdP);
      mma_sdp.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
  };
  if (st.count > 0) mbar_wait(bars.kv_full(), 0);

  for (int n = 0; n < st.count; ++n) {
    const int s = n % kStages;
    const int i0 = st.i0(n), h = st.head(n, c.h0);
    // The element coordinates (and with them the lse/delta, dS and dq addresses) from a thread
    // index the compiler cannot see through, so that it recomputes them each step (a few integer
    // instructions) rather than keeping some 80 loop-invariant offsets in registers.
    int ct_step = ct;
    asm volatile("" : "+r"(ct_step));
    Tensor tScS = mma_sdp.get_thread_slice(ct_step).partition_C(
        make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockM>>{}));  // (key, query) of tSrS's values
    Tensor tdQc = mma_dq.get_thread_slice(ct_step).partition_C(
        make_identity_tensor(Shape<Int<kBlockM>, Int<D>>{}));  // (query, d) of tdQrdQ's values
    mbar_wait(bars.full(s), (n / kStages) & 1);
    issue_sdp(s);

    // Pᵀ while dPᵀ is on the tensor cores.
    warpgroup_wait<1>();
    warpgroup_fence_operand(tSrS);
    named_barrier_sync(kStatsFullBarrier + s, kStatsThreads);
    const float* lse_t = lse_s + s * kBlockM;
    const float* delta_t = delta_s + s * kBlockM;
    const bool masked = i0 + kBlockM > c.sq(p) || j0 + kBlockN > c.sk(p) || (p.causal && j0 + kBlockN - 1 > i0 + c.offset(p));
    if (masked) {
      // Element i's (key, query) is this thread's first one plus a constant of the fragment
      // (thread 0's coordinates, known at compile time), so that each test compares a constant
      // with one of three per-thread bounds instead of keeping 64 coordinates in registers.
      const Tensor c0 =
          mma_sdp.get_thread_slice(0).partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockM>>{}));
      const int key_t = get<0>(tScS(0)), q_t = get<1>(tScS(0));
      const int rows_left = c.sq(p) - i0 - q_t, keys_left = c.sk(p) - j0 - key_t;
      const int reach = i0 + q_t + c.offset(p) - j0 - key_t;  // causal: visible iff dk - dq <= reach
      CUTE_UNROLL
      for (int i = 0; i < size(tSrS); ++i) {
        const int dk = get<0>(c0(i)) - get<0>(c0(0)), dq = get<1>(c0(i)) - get<1>(c0(0));
        const bool visible = dq < rows_left && dk < keys_left && (!p.causal || dk - dq <= reach);
        tSrS(i) = visible ? fast_exp2(tSrS(i) * p.scale_log2 - lse_t[get<1>(tScS(i))]) : 0.0f;
      }
    } else {
      CUTE_UNROLL
      for (int i = 0; i < size(tSrS); ++i) tSrS(i) = fast_exp2(tSrS(i) * p.scale_log2 - lse_t[get<1>(tScS(i))]);
    }
    // kEarlyDv (D = 128): dV += Pᵀ dO on the tensor cores while dSᵀ is computed, dK += dSᵀ Q while
    // dS goes to shared memory. Otherwise (D = 64, 128 queries a step: Pᵀ's rounded registers
    // cannot stay live beside Sᵀ, dPᵀ and dSᵀ) both once dSᵀ is rounded, one batch.
    if constexpr (kEarlyDv) {
      CUTE_UNROLL
      for (int i = 0; i < size(rP); ++i) rP(i) = pack2<T>(tSrS(2 * i), tSrS(2 * i + 1));
      warpgroup_fence_operand(tdVrdV);
      warpgroup_arrive();
      CUTE_UNROLL
      for (int kk = 0; kk < size<2>(tdVrP); ++kk) gemm(mma_dkv, tdVrP(_, _, kk), tdVrdO(_, _, kk, s), tdVrdV);
      warpgroup_commit_batch();
      warpgroup_wait<1>();  // dPᵀ
    } else {
      warpgroup_wait<0>();  // dPᵀ
    }
    warpgroup_fence_operand(tSrdP);
    // dSᵀ, rounded as it is made (with Pᵀ where not rounded yet): each pair's fp32 values die here.
    CUTE_UNROLL
    for (int i = 0; i < size(rdS); ++i) {
      const float ds0 = tSrS(2 * i) * (tSrdP(2 * i) - delta_t[get<1>(tScS(2 * i))]) * p.scale;
      const float ds1 = tSrS(2 * i + 1) * (tSrdP(2 * i + 1) - delta_t[get<1>(tScS(2 * i + 1))]) * p.scale;
      if constexpr (!kEarlyDv) rP(i) = pack2<T>(tSrS(2 * i), tSrS(2 * i + 1));
      rdS(i) = pack2<T>(ds0, ds1);
    }
    // lse and delta of stage s are read; the producer waits for this only where it stores again
    if (n + kStages < st.count) named_barrier_arrive(kStatsEmptyBarrier + s, kStatsThreads);

    if constexpr (!kEarlyDv) warpgroup_fence_operand(tdVrdV);
    warpgroup_fence_operand(tdKrdK);
    warpgroup_arrive();
    if constexpr (!kEarlyDv) {
      CUTE_UNROLL
      for (int kk = 0; kk < size<2>(tdVrP); ++kk) gemm(mma_dkv, tdVrP(_, _, kk), tdVrdO(_, _, kk, s), tdVrdV);
    }
    CUTE_UNROLL
    for (int kk = 0; kk < size<2>(tdKrdS); ++kk) gemm(mma_dkv, tdKrdS(_, _, kk), tdKrQ(_, _, kk, s), tdKrdK);
    warpgroup_commit_batch();

    // dS into shared memory once both warpgroups' previous dQ wgmmas retired; read once both wrote.
    // TmaDq: the barrier also hands the dQ buffer back, once each warpgroup's issuing thread saw
    // its previous reduce read it.
    if constexpr (TmaDq) {
      if (ct % kWarpgroupThreads == 0) bulk_wait_group_read_all();
    }
    named_barrier_sync(1, kConsumerThreads);
    CUTE_UNROLL
    for (int i = 0; i < size(tdKrdS); ++i) sdS(get<1>(tScS(i)), get<0>(tScS(i))) = tdKrdS(i);
    fence_proxy_async_shared();  // the generic-proxy stores, visible to wgmma
    named_barrier_sync(2, kConsumerThreads);

    // dQ = dS K, this warpgroup's D/2 columns.
    warpgroup_fence_operand(tdQrdQ);
    warpgroup_arrive();
    mma_dq.accumulate_ = GMMA::ScaleOut::Zero;
    CUTE_UNROLL
    for (int kk = 0; kk < size<2>(tdQrdS); ++kk) {
      gemm(mma_dq, tdQrdS(_, _, kk), tdQrK(_, _, kk), tdQrdQ);
      mma_dq.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    warpgroup_wait<0>();
    warpgroup_fence_operand(tdVrdV);
    warpgroup_fence_operand(tdKrdK);
    warpgroup_fence_operand(tdQrdQ);
    CUTE_UNROLL
    for (int i = 0; i < size(rP); ++i) {  // P and dS registers live (unreused) until their wgmmas retired
      warpgroup_fence_operand(rP(i));
      warpgroup_fence_operand(rdS(i));
    }
    if (ct % 32 == 0) mbar_arrive(bars.empty(s));  // Q, dO of stage s are read

    if constexpr (TmaDq) {
      // This warpgroup's 64 x D/2 tile into its swizzled buffer (pairs of adjacent columns), then
      // one thread adds it to dq_accum, a box per 32 columns; rows past Sq are clipped by the map
      // (dense) or are zeros added to the next sequence's rows (packed).
      const int wg = ct / kWarpgroupThreads;
      float* dq_s = reinterpret_cast<float*>(smem + Tr::kOffdQ + wg * (Tr::kBytesdQ / 2));
      CUTE_UNROLL
      for (int i = 0; i < size(tdQrdQ); i += 2) {
        const int r = get<0>(tdQc(i)), c = get<1>(tdQc(i)) - wg * (D / 2);
        const int at = (c / 32) * (kBlockM * 32) + r * 32 + ((((c % 32) / 4) ^ (r % 8)) * 4) + c % 4;
        *reinterpret_cast<float2*>(dq_s + at) = make_float2(tdQrdQ(i), tdQrdQ(i + 1));
      }
      fence_proxy_async_shared();  // the generic-proxy stores, visible to the TMA
      named_barrier_sync(kdQBarrier + wg, kWarpgroupThreads);
      if (ct % kWarpgroupThreads == 0) {
        const std::uint32_t src = smem_addr(dq_s);
        CUTE_UNROLL
        for (int j = 0; j < D / 64; ++j)
          tma_reduce_add_3d(tdq, src + j * kBlockM * 128, wg * (D / 2) + 32 * j, c.q_row(i0), c.dq_head(p, h));
        bulk_commit_group();
      }
    } else {
      const SeqRows<kPacked> rows = c.rows(p);
      float* dqa = p.dq_accum + rows.q_row(h, 0) * D;
      CUTE_UNROLL
      for (int i = 0; i < size(tdQrdQ); ++i) {
        const int row = i0 + get<0>(tdQc(i)), col = get<1>(tdQc(i));
        if (row < c.sq(p)) atomicAdd(dqa + row * (rows.q_tok() * D) + col, tdQrdQ(i));
      }
    }
  }
  if constexpr (TmaDq) {
    if (ct % kWarpgroupThreads == 0) bulk_wait_group_all();  // no exit with a reduce in flight
  }

  // dK and dV, keys j0 + key: pairs of adjacent columns.
  T* dk = static_cast<T*>(p.dk) + p.dk_st.at(c.batch(), c.kh, c.k0());
  T* dv = static_cast<T*>(p.dv) + p.dv_st.at(c.batch(), c.kh, c.k0());
  CUTE_UNROLL
  for (int i = 0; i < size(tdKrdK); i += 2) {
    const int key = j0 + get<0>(tdKVc(i)), col = get<1>(tdKVc(i));
    if (key < c.sk(p)) {
      *reinterpret_cast<std::uint32_t*>(dk + key * p.dk_st.s + col) = pack2<T>(tdKrdK(i), tdKrdK(i + 1));
      *reinterpret_cast<std::uint32_t*>(dv + key * p.dv_st.s + col) = pack2<T>(tdVrdV(i), tdVrdV(i + 1));
    }
  }
}

#endif  // FK_ATTN_BWD_SM90

template <class T, int D, bool TmaDq, bool kPacked>
__global__ void __launch_bounds__(kThreads, 1)
    attention_sm90_bwd_kernel(const __grid_constant__ Params p, const __grid_constant__ CUtensorMap tq,
                              const __grid_constant__ CUtensorMap tk, const __grid_constant__ CUtensorMap tv,
                              const __grid_constant__ CUtensorMap tdo, const __grid_constant__ CUtensorMap tdq) {
#if FK_ATTN_BWD_SM90
  using Tr = Traits<T, D>;
  extern __shared__ std::uint8_t smem_raw[];
  const std::uint32_t raw = smem_addr(smem_raw), base = (raw + 1023) & ~1023u;
  std::uint8_t* smem = smem_raw + (base - raw);
  const Bars bars{base + Tr::kOffBars};
  int key_block, bkh;
  cta_place(p.causal, key_block, bkh);
  if (threadIdx.x == 0) {
    mbar_init(bars.kv_full(), 1);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(bars.full(s), kProducerLanes);
      mbar_init(bars.empty(s), kConsumerWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    if constexpr (kPacked) Cta<kPacked>::store_seq(p, bkh, reinterpret_cast<int*>(smem + Tr::kOffSeq));
  }
  __syncthreads();
  const int j0 = key_block * kBlockN;
  const Cta<kPacked> c(p, bkh, reinterpret_cast<const int*>(smem + Tr::kOffSeq));
  if constexpr (kPacked) {
    if (j0 >= c.sk(p)) return;  // keys past the sequence's (the grid spans max_seqlen_k): nothing to write
  }
  const Steps st(p.causal, c.sq(p), c.offset(p), j0, c.group, Tr::kBlockM);
  if (threadIdx.x < kProducerThreads) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kProducerRegs));
    if (threadIdx.x < 32) produce<T, D, kPacked>(p, &tq, &tk, &tv, &tdo, smem, base, bars, j0, c, st);
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kConsumerRegs));
    consume<T, D, TmaDq, kPacked>(p, &tdq, smem, bars, j0, c, st);
  }
#else
  __trap();  // the launcher never starts this kernel off sm_90
#endif
}

template <class T, int D, bool TmaDq, bool kPacked>
void launch(const Params& p, const CUtensorMap& tq, const CUtensorMap& tk, const CUtensorMap& tv,
            const CUtensorMap& tdo, const CUtensorMap& tdq, cudaStream_t s) {
  using Tr = Traits<T, D>;
  constexpr int kBlockM = Tr::kBlockM;
  static_assert(same_bytes<typename Tr::SmemLayoutK, typename Tr::SmemLayoutKt, kBlockN, D, 1>(),
                "K's K-major and MN-major views differ");
  static_assert(same_bytes<typename Tr::SmemLayoutQ, typename Tr::SmemLayoutQt, kBlockM, D, kStages>(),
                "Q's and dO's K-major and MN-major views differ");
  auto kernel = attention_sm90_bwd_kernel<T, D, TmaDq, kPacked>;
  constexpr int smem = Tr::kSmemBytes;
  FK_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const Layout& L = p.layout;
  const dim3 grid(static_cast<unsigned>((L.sk + kBlockN - 1) / kBlockN), static_cast<unsigned>(L.batch * L.kv_heads));
  kernel<<<grid, kThreads, smem, s>>>(p, tq, tk, tv, tdo, tdq);
  FK_CUDA_CHECK_LAUNCH("attention_sm90_bwd_kernel");
}

// The map of dq_accum f32 that the tma_dq variant reduces into, head_map's dimensions (dense
// (D, Sq, B*H): rows past Sq are outside the tensor, so a reduce never writes them nor the next
// head's; packed (D, total_q, H)): boxes of {32, BLK_M, 1} (128 bytes a row) with the 128-byte
// swizzle of the dQ buffer.
CUtensorMap dq_accum_map(const TensorView& t, int box_rows) {
  const bool packed = t.rank() == 3;
  const std::int64_t d = packed ? t.size(2) : t.size(3);
  const std::int64_t rows = packed ? t.size(0) : t.size(2), heads = packed ? t.size(1) : t.size(0) * t.size(1);
  const std::int64_t row_stride = packed ? heads * d : d, head_stride = packed ? d : rows * d;  // elements
  return tensor_map<3>(kOp, "dq_accum", CU_TENSOR_MAP_DATA_TYPE_FLOAT32, t.data(),
                       {static_cast<cuuint64_t>(d), static_cast<cuuint64_t>(rows), static_cast<cuuint64_t>(heads)},
                       {static_cast<cuuint64_t>(row_stride) * 4, static_cast<cuuint64_t>(head_stride) * 4},
                       {32, static_cast<cuuint32_t>(box_rows), 1}, CU_TENSOR_MAP_SWIZZLE_128B);
}

}  // namespace

bool attention_backward_sm90_supports(const TensorView& q, const TensorView& k, const TensorView& v,
                                      const TensorView& out, const TensorView& dout, const TensorView& dq,
                                      const TensorView& dk, const TensorView& dv, const AttentionVarlen* varlen,
                                      const AttentionOptions& opt) {
  const DType t = q.dtype();
  if ((t != DType::bf16 && t != DType::f16) || q.numel() == 0 || k.numel() == 0) return false;
  const std::int64_t d = varlen ? q.size(2) : q.size(3);
  const Layout L = layout_of(q, k, varlen);
  const std::int64_t bkh = L.batch * L.kv_heads;
  if ((d != 64 && d != 128) || L.sq < 1 || L.sk < 1 || L.sq >= (1 << 30) || L.sk >= (1 << 30) || bkh < 1 ||
      bkh > 65535)
    return false;
  // Packed: TMA coordinates (tokens, up to a block past the last) in 32 bits.
  if (varlen && (q.size(0) > INT_MAX - 2 * kBlockN || k.size(0) > INT_MAX - 2 * kBlockN)) return false;
  if (opt.window_left >= 0 || (!opt.causal && opt.window_right >= 0) || opt.softcap != 0.0f || opt.deterministic)
    return false;
  if (!std::isfinite(opt.scale * kLog2e)) return false;
  for (const TensorView* x : {&q, &k, &v, &out, &dout, &dq, &dk, &dv})
    if (!sm90_takes_layout(*x)) return false;
  const int device = q.device().index;
  fk::detail::DeviceScope on_device(device);
  return is_sm90(device);
}

void attention_backward_sm90(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                             const TensorView& dout, const TensorView& lse, const TensorView& dq, const TensorView& dk,
                             const TensorView& dv, const TensorView& delta, const TensorView& dq_accum,
                             const AttentionVarlen* varlen, const AttentionOptions& opt, const Stream* stream) {
  const int device = q.device().index;
  fk::detail::DeviceScope on_device(device);
  const cudaStream_t s = fk::detail::cuda_stream(stream);
  attention_backward_prologue(out, dout, delta, dq_accum, stream);

  Params p{};
  p.dq_accum = dq_accum.data_as<float>();
  p.dk = dk.data();
  p.dv = dv.data();
  p.dk_st = head_strides(dk);
  p.dv_st = head_strides(dv);
  p.lse = lse.data_as<float>();
  p.delta = delta.data_as<float>();
  p.layout = layout_of(q, k, varlen);
  if (!varlen) {
    p.sq = static_cast<int>(p.layout.sq);
    p.sk = static_cast<int>(p.layout.sk);
    p.offset = opt.bottom_right ? p.sk - p.sq : 0;
  }
  p.scale = opt.scale;
  p.scale_log2 = opt.scale * kLog2e;
  p.causal = opt.causal;
  p.bottom_right = opt.causal && opt.bottom_right;
  const int d = static_cast<int>(varlen ? q.size(2) : q.size(3));
  const int bm = block_m(d);
  const CUtensorMap tq = head_map(kOp, "q", q, bm), tdo = head_map(kOp, "dout", dout, bm);
  const CUtensorMap tk = head_map(kOp, "k", k, kBlockN), tv = head_map(kOp, "v", v, kBlockN);
  const bool tma_dq = opt.backward_kernel != AttentionBackwardKernel::wgmma_sm90;
  const CUtensorMap tdq = tma_dq ? dq_accum_map(dq_accum, bm) : CUtensorMap{};
  const bool bf16 = q.dtype() == DType::bf16;
  auto run = [&]<int D, bool TmaDq>() {
    auto with_layout = [&]<bool kPacked>() {
      if (bf16) launch<cute::bfloat16_t, D, TmaDq, kPacked>(p, tq, tk, tv, tdo, tdq, s);
      else launch<cute::half_t, D, TmaDq, kPacked>(p, tq, tk, tv, tdo, tdq, s);
    };
    if (varlen) with_layout.template operator()<true>();
    else with_layout.template operator()<false>();
  };
  if (d == 64) {
    if (tma_dq) run.template operator()<64, true>();
    else run.template operator()<64, false>();
  } else {
    if (tma_dq) run.template operator()<128, true>();
    else run.template operator()<128, false>();
  }
  attention_backward_dq_from_accum(dq_accum, dq, stream);
}

}  // namespace fk::cuda
