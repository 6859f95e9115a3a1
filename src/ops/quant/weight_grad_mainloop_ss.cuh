// weight_grad_from_packed's SS mainloop (1 bit, f32 statistics, or an operand without TMA): the
// consumers dequantize x̂ into a shared-memory ring that wgmma reads beside dy.
#pragma once

#include "weight_grad_epilogue.cuh"
#include "weight_grad_producer.cuh"

namespace fk::cuda::wgrad {
namespace {

#if FK_WGRAD_SM90

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

}  // namespace
}  // namespace fk::cuda::wgrad
