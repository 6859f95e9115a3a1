// weight_grad_from_packed's producer warpgroup (SS path, and the base of the RS path's): dy, the
// packed words and the statistics of each k-block into the shared-memory ring, by TMA or by the
// producer threads themselves.
#pragma once

#include "weight_grad_device.cuh"

namespace fk::cuda::wgrad {
namespace {

#if FK_WGRAD_SM90

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

#endif  // FK_WGRAD_SM90

}  // namespace
}  // namespace fk::cuda::wgrad
