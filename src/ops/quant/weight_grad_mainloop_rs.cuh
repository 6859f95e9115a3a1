// weight_grad_from_packed's RS mainloop (2, 4 and 8 bits, bf16 statistics, every operand by TMA):
// the consumers dequantize x̂ straight into the A fragments of register-sourced wgmma.
#pragma once

#include "weight_grad_epilogue.cuh"
#include "weight_grad_producer.cuh"

namespace fk::cuda::wgrad {
namespace {

#if FK_WGRAD_SM90

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

#endif  // FK_WGRAD_SM90

}  // namespace
}  // namespace fk::cuda::wgrad
