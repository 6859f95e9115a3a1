// attention_forward on Hopper tensor cores (sm_90a): FlashAttention-style, bf16/f16, head_dim 64
// or 128, dense or packed (varlen) batches, grouped-query heads (q head h reads k/v head
// h / (H / Hk)), causal with either alignment or none. q, k, v and out are read and written once;
// the [Sq, Sk] scores live only in registers, one 64 x 128 tile a warpgroup at a time.
//
// A CTA owns 128 query rows of one (sequence, head) (192 at D = 64, AttentionForwardTile) and
// streams the keys of its k/v head in blocks of 128 with a producer and two (three) consumer
// warpgroups:
//   - producer (one thread): loads the CTA's Q tile once, then each key block's K and V tiles into
//     a 2-stage ring, by TMA with the 128-byte swizzle wgmma reads (4-D tensor maps over each
//     tensor's own strides, head_map in attention_sm90_common.cuh: dense (D, S, H, B), rows outside
//     [0, S) come back as zeros; packed (D, total, H, 1), rows outside a sequence come back as its
//     neighbours' tokens). out is written through its own strides too. K and V
//     have their own full barriers, so S = Q Kᵀ starts before V has landed.
//   - the consumers, 64 query rows each: S = Q Kᵀ with wgmma 64x128xD (both operands from shared
//     memory, fp32 accumulators), the mask (key tail, causal diagonal) on the blocks that need it,
//     the online softmax in registers (running max and sum a row, exp2 with the scale folded in
//     log2 units, O rescaled by exp2(m_old - m_new)), P rounded to the input dtype in registers and
//     O += P V with wgmma 64xDx16 register-sourced A (V K-blocks MN-major in shared memory).
//     Software-pipelined inside the warpgroup (as FlashAttention-3): S_n and P_{n-1} V_{n-1} are
//     issued back to back, the softmax of block n runs while P_{n-1} V_{n-1} is on the tensor
//     cores. Each consumer warp gives a K stage back as soon as S_n has retired and a V stage once
//     P V has, so the producer refills K a block and a half ahead.
// At D = 64 a 64 x 128 tile's 8192 exponentials take the SFU (16 a clock) as long as its two
// products take the tensor cores, so a third consumer warpgroup (FlashAttention-3's 192 x 128
// tile) keeps the tensor cores fed while the other two are in their softmax; 160 registers each
// hold S, O and P at D = 64 (not at D = 128).
// At the end each row's sum is reduced across its quad of threads, out = O / l is stored from
// registers and lse = (m + log2 l) ln 2. Rows outside the sequence's [0, Sq) are computed and not
// stored; keys past its Sk are masked like the
// causal ones, so the next sequence's keys never count. A row that sees no key (bottom-right with
// Sq > Sk, or Sk = 0) gets out = 0 and lse = -inf; a CTA whose rows see no key at all loads
// nothing and stores just that.
//
// Grid: one CTA per (sequence, head, query block), heads outer (packed: blocks of max_seqlen_q,
// those before their sequence's first query leave at once), so that the ~132 CTAs resident at
// a time cover about 4 heads whose K and V (2 MB a head at S = 4096, D = 128) stay in L2; with
// heads inner (64 heads in flight) K and V came from DRAM again and again and the kernel ran
// slower. The query blocks end at Sq, Sq - rows, ... (the first may
// start before query 0; those rows are computed on zeros, or packed on the previous sequence's
// queries, and not stored), so that with causal masking the rows that see the most keys fill whole
// blocks. Within a head these go first, so the tail of each head is short work. Causal CTAs stop
// at the diagonal block.
//
// Speed: docs/attention.md. Tried and dropped (docs/notes/primitives.md): the schedule without
// the intra-warpgroup overlap (slower), a ping-pong of the two consumer warpgroups (named-barrier
// turns for issuing wgmmas, FA3's inter-warpgroup overlap: no gain here), the scale folded into
// the exp2 FFMA and skipping O's rescale when no row max moved (no gain: the softmax is not the
// limit).
// The dense and packed kernels are two instantiations (kPacked, as attention_mma_bwd.cu): the dense
// one addresses out and lse with the dense formulas and compiles without the cu_seqlens reads.
// Not done: a persistent grid that overlaps one tile's epilogue with the next tile's loads, a
// TMA store of out.
//
// Numerics: fp32 scores, statistics and accumulators; P is rounded to bf16/f16 before P V (as in
// FlashAttention), so out carries about one unit roundoff of the dtype on top of its final
// rounding. GPUs other than sm_90, other dtypes or head dims go to attention_rowwise.cu.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <string>

#include <cute/tensor.hpp>  // first: the atom headers rely on what it includes before them
#include <cute/atom/mma_atom.hpp>

#include "attention_cuda.hpp"
#include "attention_layout.cuh"
#include "fusekit/core/cuda_check.hpp"
#include "fusekit/core/error.hpp"
#include "fusekit/core/tensor.hpp"
#include "ops/common/cuda_common.cuh"
#include "ops/common/sm90_async.cuh"
#include "attention_sm90_common.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FK_ATTN_SM90 1
#else
#define FK_ATTN_SM90 0
#endif

namespace fk::cuda {
namespace {

using namespace sm90;  // mbarriers, TMA (ops/common/sm90_async.cuh); exp2, pack2, maps (attention_sm90_common.cuh)

using namespace cute;
using cute::Tensor;  // fk declares Tensor too (and fk::cuda a Layout: CuTe's is written cute::Layout)

constexpr const char* kOp = "attention_forward";

constexpr int kBlockN = 128, kStages = 2, kProducerThreads = 128;

// NW consumer warpgroups, 64 query rows each: a CTA of 128 (NW = 2) or 192 (NW = 3) rows.
template <int NW>
struct Warps {
  static_assert(NW == 2 || NW == 3);
  static constexpr int kBlockM = 64 * NW;
  static constexpr int kConsumerThreads = 128 * NW, kThreads = kProducerThreads + kConsumerThreads;
  static constexpr int kConsumerWarps = kConsumerThreads / 32;  // each releases a stage once its wgmmas retired
  static_assert(kConsumerWarps == 4 * NW);
  // The 64K registers of the SM, moved from the producer (which needs few) to the consumers: with
  // two, S and O (64 floats each at D = 128) plus P in 240 each; with three (D = 64: S 64, O 32,
  // P 32) in 160 each.
  static constexpr int kProducerRegs = NW == 2 ? 24 : 32, kConsumerRegs = NW == 2 ? 240 : 160;
  static_assert(kProducerThreads * kProducerRegs + kConsumerThreads * kConsumerRegs <= 65536);
};

template <class T, int D, int NW>
struct Traits : Warps<NW> {
  static_assert(D == 64 || D == 128);
  static_assert(NW == 2 || D == 64, "three consumer warpgroups hold S, O and P in 160 registers only at D = 64");
  static constexpr int kBlockM = Warps<NW>::kBlockM;
  // Q and K rows are D-contiguous (K-major for both GEMM operands): 128-byte swizzled atoms of
  // 8 rows x 64 elements, rows adjacent, so that each 64-column slab of a tile is one TMA box.
  using SmemLayoutQ = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<T>{}, Shape<Int<kBlockM>, Int<D>>{}));  // (BLK_M,D)
  using SmemLayoutK = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<T>{},
                                             Shape<Int<kBlockN>, Int<D>, Int<kStages>>{}));  // (BLK_N,D,PIPE)
  // V is the B operand of P V with N = D contiguous (MN-major): atoms of 64 d x 8 keys, keys
  // adjacent, so that a 64-column slab of the V tile (all keys) is again one TMA box.
  using SmemLayoutV = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<T>{},
                                             Shape<Int<D>, Int<kBlockN>, Int<kStages>>{},
                                             Step<_2, _1, _3>{}));  // (D,BLK_N,PIPE)
  // The consumer warpgroups side by side in M: warpgroup w computes rows [64 w, 64 w + 64).
  using MmaS = decltype(make_tiled_mma(
      SM90::GMMA::ss_op_selector<T, T, float, Shape<_64, Int<kBlockN>, Int<D>>, GMMA::Major::K, GMMA::Major::K>(),
      cute::Layout<Shape<Int<NW>, _1, _1>>{}));
  using MmaO = decltype(make_tiled_mma(
      SM90::GMMA::rs_op_selector<T, T, float, Shape<_64, Int<D>, Int<kBlockN>>, GMMA::Major::K, GMMA::Major::MN>(),
      cute::Layout<Shape<Int<NW>, _1, _1>>{}));
  static constexpr int kBytesQ = kBlockM * D * 2;
  static constexpr int kBytesKV = kBlockN * D * 2;  // one stage of K (or of V)
  static constexpr int kOffK = kBytesQ, kOffV = kOffK + kStages * kBytesKV, kOffBars = kOffV + kStages * kBytesKV;
  static constexpr int kBarriers = 1 + 4 * kStages;  // q_full, k_full[s], v_full[s], k_empty[s], v_empty[s]
  static constexpr int kSmemBytes = kOffBars + 8 * kBarriers + 1024;  // + slack for the 1024-byte alignment
  static_assert(cosize_v<SmemLayoutQ> * 2 == kBytesQ && cosize_v<SmemLayoutK> * 2 == kStages * kBytesKV &&
                cosize_v<SmemLayoutV> * 2 == kStages * kBytesKV);
  static_assert(kSmemBytes <= 227 * 1024);
  static_assert(decltype(size(MmaS{}))::value == Warps<NW>::kConsumerThreads);
};

struct Params {
  void* out;               // T: dense [B, H, Sq, D]; packed [total_q, H, D]; any strides (out_st)
  HeadStrides out_st;      // out's, in elements
  float* lse;              // f32: dense [B, H, Sq]; packed [H, total_q]
  Layout layout;           // B, H, Hk, the lengths (packed: max_seqlens and cu_seqlens)
  int m_blocks;            // query blocks of a (sequence, head): of Sq, packed of max_seqlen_q
  float scale_log2;        // scale * log2(e): scores are kept in log2 units
  bool causal, bottom_right;
};

// What a CTA works on: its sequence's lengths, its query block, and the TMA coordinates of its
// rows (dense: row in the head, head h / kh, batch entry b; packed: token, head h / kh, 0).
struct Cta {
  int sq, sk;              // the sequence's query and key counts
  int offset;              // causal: key j visible to query i iff j <= i + offset (bottom-right Sk - Sq)
  int m0;                  // the block's first query (negative in a sequence's first block, see cta_of)
  int q_row0, kv_row0;     // TMA row of query 0 and key 0: dense 0, packed the sequence's first tokens
  int q_head, kv_head;     // TMA head coordinates of q and of k, v
  int batch;               // TMA batch coordinate (packed: 0)
  std::int64_t out0;       // out's element of (query 0, d 0) of this head
  std::int64_t out_stride; // elements from one query to the next
  std::int64_t lse0;       // lse's element of query 0 of this head (contiguous in the query)
};

#if FK_ATTN_SM90


struct Bars {
  std::uint32_t base;
  __device__ std::uint32_t q_full() const { return base; }
  __device__ std::uint32_t k_full(int s) const { return base + 8 * (1 + s); }
  __device__ std::uint32_t v_full(int s) const { return base + 8 * (1 + kStages + s); }
  __device__ std::uint32_t k_empty(int s) const { return base + 8 * (1 + 2 * kStages + s); }
  __device__ std::uint32_t v_empty(int s) const { return base + 8 * (1 + 3 * kStages + s); }
};

template <bool kPacked, int kBlockM>
__device__ Cta cta_of(const Params& p) {
  const Layout& L = p.layout;
  // Heads outer, query blocks inner: the CTAs running at once share a few heads, whose K and V
  // then stay in L2. Query blocks end at Sq, Sq - kBlockM, ... (the first one may start before
  // query 0: its rows there are computed and not stored), so that the rows a causal mask gives
  // the most keys fill whole blocks; within a head those heaviest blocks go first.
  const int bh = static_cast<int>(blockIdx.x / static_cast<unsigned>(p.m_blocks));
  const int m_from_end = static_cast<int>(blockIdx.x % static_cast<unsigned>(p.m_blocks));
  const int heads = static_cast<int>(L.heads), kv_heads = static_cast<int>(L.kv_heads);
  const int b = bh / heads, h = bh - b * heads, kh = h / (heads / kv_heads);
  const SeqRows<kPacked> seq = L.template seq<kPacked>(b);
  Cta c;
  c.sq = static_cast<int>(seq.sq);
  c.sk = static_cast<int>(seq.sk);
  c.offset = p.bottom_right ? c.sk - c.sq : 0;
  c.m0 = c.sq - (m_from_end + 1) * kBlockM;
  c.q_row0 = static_cast<int>(seq.q0);
  c.kv_row0 = static_cast<int>(seq.k0);
  c.q_head = h;
  c.kv_head = kh;
  c.batch = kPacked ? 0 : b;
  c.out0 = p.out_st.at(c.batch, h, seq.q0);
  c.out_stride = p.out_st.s;
  c.lse0 = seq.stat(h, 0);
  return c;
}

template <class T, int D, int NW>
__device__ void produce(const CUtensorMap* tq, const CUtensorMap* tk, const CUtensorMap* tv, std::uint32_t smem,
                        const Bars& bars, const Cta& c, int n_blocks) {
  using Tr = Traits<T, D, NW>;
  constexpr int kBlockM = Tr::kBlockM;
  if (n_blocks == 0) return;  // no key visible: the consumers load nothing either
  mbar_arrive_expect_tx(bars.q_full(), Tr::kBytesQ);
#pragma unroll
  for (int j = 0; j < D / 64; ++j)
    tma_load_4d(tq, bars.q_full(), smem + j * kBlockM * 128, 64 * j, c.q_row0 + c.m0, c.q_head, c.batch);
  for (int n = 0; n < n_blocks; ++n) {
    const int s = n % kStages, free_parity = ((n / kStages) & 1) ^ 1;
    const std::uint32_t k_dst = smem + Tr::kOffK + s * Tr::kBytesKV, v_dst = smem + Tr::kOffV + s * Tr::kBytesKV;
    mbar_wait(bars.k_empty(s), free_parity);
    mbar_arrive_expect_tx(bars.k_full(s), Tr::kBytesKV);
#pragma unroll
    for (int j = 0; j < D / 64; ++j)
      tma_load_4d(tk, bars.k_full(s), k_dst + j * kBlockN * 128, 64 * j, c.kv_row0 + n * kBlockN, c.kv_head, c.batch);
    mbar_wait(bars.v_empty(s), free_parity);
    mbar_arrive_expect_tx(bars.v_full(s), Tr::kBytesKV);
#pragma unroll
    for (int j = 0; j < D / 64; ++j)
      tma_load_4d(tv, bars.v_full(s), v_dst + j * kBlockN * 128, 64 * j, c.kv_row0 + n * kBlockN, c.kv_head, c.batch);
  }
}

template <class T, int D, int NW>
__device__ void consume(const Params& p, std::uint8_t* smem, const Bars& bars, const Cta& c, int n_blocks) {
  using Tr = Traits<T, D, NW>;
  constexpr int kBlockM = Tr::kBlockM;
  const int ct = static_cast<int>(threadIdx.x) - kProducerThreads;  // 0 .. 128 NW - 1
  typename Tr::MmaS mma_s;
  typename Tr::MmaO mma_o;
  auto thr_s = mma_s.get_thread_slice(ct);
  auto thr_s0 = mma_s.get_thread_slice(0);  // thread 0's fragment: the compile-time offsets of the mask
  auto thr_o = mma_o.get_thread_slice(ct);
  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<T*>(smem)), typename Tr::SmemLayoutQ{});  // (BLK_M,D)
  Tensor sK = make_tensor(make_smem_ptr(reinterpret_cast<T*>(smem + Tr::kOffK)),
                          typename Tr::SmemLayoutK{});  // (BLK_N,D,PIPE)
  Tensor sV = make_tensor(make_smem_ptr(reinterpret_cast<T*>(smem + Tr::kOffV)),
                          typename Tr::SmemLayoutV{});  // (D,BLK_N,PIPE)
  Tensor tSrQ = thr_s.make_fragment_A(thr_s.partition_A(sQ));  // (MMA,1,D/16) descriptors
  Tensor tSrK = thr_s.make_fragment_B(thr_s.partition_B(sK));  // (MMA,1,D/16,PIPE) descriptors
  Tensor tOrV = thr_o.make_fragment_B(thr_o.partition_B(sV));  // (MMA,1,BLK_N/16,PIPE) descriptors
  Tensor tSrS = partition_fragment_C(mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});  // ((2,2,BLK_N/8),1,1) fp32
  Tensor tOrO = partition_fragment_C(mma_o, Shape<Int<kBlockM>, Int<D>>{});        // ((2,2,D/8),1,1) fp32
  // P as the A operand of the 64xDx16 wgmmas: the accumulator's values (col pair, row + 8, col + 8)
  // of each 16 columns are exactly the A fragment's (k pair, row + 8, k + 8), so P keeps S's order.
  Tensor tOrP = make_tensor<T>(cute::Layout<Shape<Shape<_2, _2, _2>, _1, Int<kBlockN / 16>>,
                                      Stride<Stride<_1, _2, _4>, _0, _8>>{});  // ((2,2,2),1,BLK_N/16)
  static_assert(decltype(size(tOrP))::value == decltype(size(tSrS))::value);
  Tensor tScS = thr_s.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));  // (row, col) of tSrS
  Tensor tOcO = thr_o.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<D>>{}));        // (row, col) of tOrO
  // Value i of an accumulator lies in row (i / 2) % 2 of the thread's two rows (g and g + 8).
  auto half_of = [](int i) { return (i >> 1) & 1; };

  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // running max (log2 units) and this thread's partial sum
  clear(tOrO);
  mma_o.accumulate_ = GMMA::ScaleOut::One;
  // Issues S = Q K_n^T (zero-initialised) as one wgmma batch, once K_n has landed.
  auto issue_s = [&](int n) {
    const int s = n % kStages;
    mbar_wait(bars.k_full(s), (n / kStages) & 1);
    warpgroup_fence_operand(tSrS);
    warpgroup_arrive();
    mma_s.accumulate_ = GMMA::ScaleOut::Zero;
    CUTE_UNROLL
    for (int kk = 0; kk < size<2>(tSrQ); ++kk) {
      gemm(mma_s, tSrQ(_, _, kk), tSrK(_, _, kk, s), tSrS);
      mma_s.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
  };
  // Issues O += P V_n as one wgmma batch, once V_n has landed.
  auto issue_pv = [&](int n) {
    const int s = n % kStages;
    mbar_wait(bars.v_full(s), (n / kStages) & 1);
    warpgroup_fence_operand(tOrO);
    warpgroup_arrive();
    CUTE_UNROLL
    for (int kk = 0; kk < size<2>(tOrP); ++kk) gemm(mma_o, tOrP(_, _, kk), tOrV(_, _, kk, s), tOrO);
    warpgroup_commit_batch();
  };
  // Each warp gives a stage back once its wgmmas reading it have retired.
  auto release_k = [&](int n) {
    if (ct % 32 == 0) mbar_arrive(bars.k_empty(n % kStages));
  };
  auto release_v = [&](int n) {
    if (ct % 32 == 0) mbar_arrive(bars.v_empty(n % kStages));
  };
  auto rP = recast<std::uint32_t>(tOrP);  // (BLK_N/4) bf16/f16 pairs
  // After the wgmmas reading P retired: keeps P's registers live (unreused) until here.
  auto fence_p = [&] {
    CUTE_UNROLL
    for (int i = 0; i < size(rP); ++i) warpgroup_fence_operand(rP(i));
  };
  // The online softmax of block n on the retired S: masks, updates m and l, leaves the
  // unnormalised p = 2^(s - m) in tSrS (fp32) and the factor O must be scaled by in alpha.
  auto softmax = [&](int n, float (&alpha)[2]) {
    const int n0 = n * kBlockN;
    CUTE_UNROLL
    for (int i = 0; i < size(tSrS); ++i) tSrS(i) *= p.scale_log2;
    // Keys past Sk (zeros, or packed the next sequence's) and, causal, past each row's diagonal.
    // Element i's (row, col) is this thread's first one plus a constant of the fragment (thread
    // 0's coordinates, known at compile time, as in attention_sm90_bwd.cu), so each test compares
    // a constant with one of two per-thread bounds.
    if (n0 + kBlockN > c.sk || (p.causal && n0 + kBlockN - 1 > c.m0 + c.offset)) {
      const Tensor c0 = thr_s0.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
      const int row_t = get<0>(tScS(0)), col_t = get<1>(tScS(0));
      const int keys_left = c.sk - n0 - col_t;               // key visible iff dc < keys_left
      const int reach = c.m0 + row_t + c.offset - n0 - col_t;  // causal: visible iff dc - dr <= reach
      CUTE_UNROLL
      for (int i = 0; i < size(tSrS); ++i) {
        const int dr = get<0>(c0(i)) - get<0>(c0(0)), dc = get<1>(c0(i)) - get<1>(c0(0));
        if (dc >= keys_left || (p.causal && dc - dr > reach)) tSrS(i) = -INFINITY;
      }
    }
    float mx[2] = {m[0], m[1]}, base[2], sum[2] = {0.0f, 0.0f};
    CUTE_UNROLL
    for (int i = 0; i < size(tSrS); ++i) mx[half_of(i)] = fmaxf(mx[half_of(i)], tSrS(i));
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      base[r] = mx[r] == -INFINITY ? 0.0f : mx[r];  // a row that has seen only masked keys
      alpha[r] = fast_exp2(m[r] - base[r]);
      m[r] = mx[r];
    }
    CUTE_UNROLL
    for (int i = 0; i < size(tSrS); ++i) {
      tSrS(i) = fast_exp2(tSrS(i) - base[half_of(i)]);
      sum[half_of(i)] += tSrS(i);
    }
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) l[r] = l[r] * alpha[r] + sum[r];
  };
  auto rescale_o = [&](const float (&alpha)[2]) {
    CUTE_UNROLL
    for (int i = 0; i < size(tOrO); ++i) tOrO(i) *= alpha[half_of(i)];
  };
  auto to_p = [&] {
    CUTE_UNROLL
    for (int i = 0; i < size(rP); ++i) rP(i) = pack2<T>(tSrS(2 * i), tSrS(2 * i + 1));
  };

  // Software pipelining inside the warpgroup: the softmax of block n runs while the tensor cores
  // compute P_{n-1} V_{n-1}; O is rescaled once that product has retired. No key block (no key
  // visible to any row): O = 0, m = -inf, l = 0 as initialised.
  if (n_blocks > 0) {
    mbar_wait(bars.q_full(), 0);
    float alpha[2];
    issue_s(0);
    warpgroup_wait<0>();
    warpgroup_fence_operand(tSrS);
    release_k(0);
    softmax(0, alpha);
    to_p();
    for (int n = 1; n < n_blocks; ++n) {
      issue_s(n);
      issue_pv(n - 1);
      warpgroup_wait<1>();  // S_n is ready, P_{n-1} V_{n-1} may still run
      warpgroup_fence_operand(tSrS);
      release_k(n);
      softmax(n, alpha);
      warpgroup_wait<0>();
      warpgroup_fence_operand(tOrO);
      fence_p();
      release_v(n - 1);
      rescale_o(alpha);
      to_p();
    }
    issue_pv(n_blocks - 1);
    warpgroup_wait<0>();
    warpgroup_fence_operand(tOrO);
    fence_p();
    release_v(n_blocks - 1);
  }

  float inv[2];
  CUTE_UNROLL
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    inv[r] = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
  }
  T* out = static_cast<T*>(p.out) + c.out0;
  CUTE_UNROLL
  for (int i = 0; i < size(tOrO); i += 2) {
    const int row = c.m0 + get<0>(tOcO(i)), col = get<1>(tOcO(i));
    if (row >= 0 && row < c.sq)
      *reinterpret_cast<std::uint32_t*>(out + row * c.out_stride + col) =
          pack2<T>(tOrO(i) * inv[half_of(i)], tOrO(i + 1) * inv[half_of(i)]);
  }
  if (ct % 4 == 0) {
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      const int row = c.m0 + get<0>(tScS(2 * r));
      if (row >= 0 && row < c.sq) p.lse[c.lse0 + row] = (m[r] + log2f(l[r])) * 0.69314718055994531f;
    }
  }
}

#endif  // FK_ATTN_SM90

template <class T, int D, int NW, bool kPacked>
__global__ void __launch_bounds__(Warps<NW>::kThreads, 1)
    attention_sm90_kernel(const __grid_constant__ Params p, const __grid_constant__ CUtensorMap tq,
                          const __grid_constant__ CUtensorMap tk, const __grid_constant__ CUtensorMap tv) {
#if FK_ATTN_SM90
  using Tr = Traits<T, D, NW>;
  constexpr int kBlockM = Tr::kBlockM;
  extern __shared__ std::uint8_t smem_raw[];
  const std::uint32_t raw = smem_addr(smem_raw), base = (raw + 1023) & ~1023u;
  std::uint8_t* smem = smem_raw + (base - raw);
  const Bars bars{base + Tr::kOffBars};
  if (threadIdx.x == 0) {
    mbar_init(bars.q_full(), 1);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(bars.k_full(s), 1);
      mbar_init(bars.v_full(s), 1);
      mbar_init(bars.k_empty(s), Tr::kConsumerWarps);
      mbar_init(bars.v_empty(s), Tr::kConsumerWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const Cta c = cta_of<kPacked, kBlockM>(p);
  if constexpr (kPacked) {
    if (c.m0 + kBlockM <= 0) return;  // a block before its sequence's queries (the grid spans max_seqlen_q)
  }
  // Key blocks up to the last row's diagonal (causal): none where no row sees a key.
  int n_blocks = (c.sk + kBlockN - 1) / kBlockN;
  if (p.causal) n_blocks = min(n_blocks, max(0, (c.m0 + kBlockM + c.offset + kBlockN - 1) / kBlockN));
  if (threadIdx.x < kProducerThreads) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(Tr::kProducerRegs));
    if (threadIdx.x == 0) produce<T, D, NW>(&tq, &tk, &tv, base, bars, c, n_blocks);
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(Tr::kConsumerRegs));
    consume<T, D, NW>(p, smem, bars, c, n_blocks);
  }
#else
  __trap();  // the launcher never starts this kernel off sm_90
#endif
}


template <class T, int D, int NW, bool kPacked>
void launch(const Params& p, const CUtensorMap& tq, const CUtensorMap& tk, const CUtensorMap& tv, cudaStream_t s) {
  auto kernel = attention_sm90_kernel<T, D, NW, kPacked>;
  constexpr int smem = Traits<T, D, NW>::kSmemBytes;
  FK_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const auto ctas = static_cast<unsigned>(p.layout.batch * p.layout.heads * p.m_blocks);
  kernel<<<ctas, Warps<NW>::kThreads, smem, s>>>(p, tq, tk, tv);
  FK_CUDA_CHECK_LAUNCH("attention_sm90_kernel");
}

}  // namespace

bool attention_forward_sm90(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                            const TensorView& lse, const AttentionVarlen* varlen, const AttentionOptions& opt,
                            const Stream* stream) {
  const DType t = q.dtype();
  const std::int64_t d = varlen ? q.size(2) : q.size(3);
  if ((t != DType::bf16 && t != DType::f16) || (d != 64 && d != 128)) return false;
  if (opt.window_left >= 0 || (!opt.causal && opt.window_right >= 0) || opt.softcap != 0.0f) return false;
  const float scale_log2 = opt.scale * 1.4426950408889634f;
  if (!std::isfinite(scale_log2)) return false;  // the row-wise kernel scales in natural units
  const Layout L = layout_of(q, k, varlen);
  // 32-bit query and key indices, TMA coordinates (packed: tokens, up to a block past the last)
  // and a causal offset Sk - Sq; a key tensor to map (packed: a batch of sequences without keys
  // stays on the row-wise kernel, which writes their zeros).
  // Three consumer warpgroups (192 query rows a CTA) at D = 64, where the exponentials cost as
  // much as the products and a third warpgroup's softmax hides behind two others' wgmmas.
  using Tile = AttentionForwardTile;
  FK_CHECK_ARG(opt.forward_tile != Tile::rows_192 || d == 64, kOp, "forward_tile", "rows_192 only at head dim 64",
               "rows_192 at head dim " + std::to_string(d));
  const int nw = opt.forward_tile == Tile::rows_128 || d != 64 ? 2 : 3;
  const std::int64_t kBlockM = 64 * nw;
  constexpr std::int64_t kMaxLen = std::int64_t{1} << 30;
  if (L.sq < 1 || L.sk < 1 || L.sq >= kMaxLen || L.sk >= kMaxLen) return false;
  if (varlen && (q.size(0) > INT_MAX - 2 * kBlockM || k.size(0) > INT_MAX - 2 * kBlockN)) return false;
  const std::int64_t m_blocks = (L.sq + kBlockM - 1) / kBlockM;
  if (L.batch * L.heads * m_blocks > INT_MAX) return false;
  for (const TensorView* x : {&q, &k, &v, &out})
    if (!sm90_takes_layout(*x)) return false;
  const int device = q.device().index;
  fk::detail::DeviceScope on_device(device);
  if (!is_sm90(device)) return false;

  Params p{};
  p.out = out.data();
  p.out_st = head_strides(out);
  p.lse = lse.data_as<float>();
  p.layout = L;
  p.m_blocks = static_cast<int>(m_blocks);
  p.scale_log2 = scale_log2;
  p.causal = opt.causal;
  p.bottom_right = opt.causal && opt.bottom_right;
  const CUtensorMap tq = head_map(kOp, "q", q, static_cast<int>(kBlockM)), tk = head_map(kOp, "k", k, kBlockN),
                    tv = head_map(kOp, "v", v, kBlockN);
  const cudaStream_t s = fk::detail::cuda_stream(stream);
  auto run = [&]<class T, int D, int NW>() {
    if (varlen) launch<T, D, NW, true>(p, tq, tk, tv, s);
    else launch<T, D, NW, false>(p, tq, tk, tv, s);
  };
  if (t == DType::bf16) {
    if (d == 128) run.template operator()<cute::bfloat16_t, 128, 2>();
    else if (nw == 2) run.template operator()<cute::bfloat16_t, 64, 2>();
    else run.template operator()<cute::bfloat16_t, 64, 3>();
  } else {
    if (d == 128) run.template operator()<cute::half_t, 128, 2>();
    else if (nw == 2) run.template operator()<cute::half_t, 64, 2>();
    else run.template operator()<cute::half_t, 64, 3>();
  }
  return true;
}

}  // namespace fk::cuda
