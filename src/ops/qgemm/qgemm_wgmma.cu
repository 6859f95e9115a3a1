// qgemm on Hopper tensor cores (sm_90a) for M > 16: yᵀ [N, M] = w̃ [N, K] · xᵀ with wgmma, the
// dequantized weights as the register-sourced A operand and x as the shared-memory B operand.
//
// Why this orientation: wgmma reads only A from registers, and the weights are the operand that
// must be transformed after the load. With the weights as A, the packed layout (qgemm_layout.hpp)
// is already what each thread needs: the A fragment of a 64 x 16 wgmma slice is, per warp, the
// fragment of mma.sync m16n8k16 (rows g, g + 8; k = 2t, 2t+1, 2t+8, 2t+9), which is what one word
// slot of the layout holds. So a thread turns one 16-byte shared-memory load per 16 rows and
// k-tile into its A fragments for four k16 steps, and x's rows become wgmma's N (64 or 128).
//
// A CTA is three or four warpgroups:
//   - producer: per k-tile of 64, into a ring of stages counted on one mbarrier each: the CTA's
//     words (BN / 16 tiles of 512 bytes, one contiguous run) by per-thread cp.async from all 128
//     threads, each thread's completion an arrival on the stage's barrier; from thread 0, x
//     [BMX rows, 64] by TMA with the 128-byte swizzle wgmma reads (zero-filled past M and K) and
//     the scales and zero words of the CTA's rows (bulk copies; one entry a k-tile when the group
//     is a multiple of 64, else one per 32-wide half);
//   - two consumers with RW = 64 MW rows of N each (MW m64 blocks), or three with 64 rows each
//     (so that N = 11008 makes 58 row blocks of 192 rather than 43 of 256): per k-tile each thread
//     loads its words, dequantizes them to s (q - z) in f16/bf16 (exact q - z, one rounding by the
//     scale: bit-identical to dequantize_weights) and issues MW x 4 wgmmas 64 x BMX x 16 into fp32
//     accumulators. The A registers are double-buffered: the k-tile after the one on the tensor
//     cores is dequantized while it runs; a stage goes back to the producer once its wgmmas have
//     retired.
// The tile of yᵀ is staged in shared memory and stored as rows of y (coalesced). Split-K (grid z)
// fills the GPU when N / BN blocks are too few: the `splits` CTAs of one output tile are one
// thread-block cluster and reduce through distributed shared memory in rank order (deterministic,
// no workspace, no second kernel). The host picks the consumers, MW and the splits (plan()).
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include <cute/tensor.hpp>  // first: the atom headers rely on what it includes before them
#include <cute/atom/mma_atom.hpp>

#include "fusekit/core/cuda_check.hpp"
#include "fusekit/core/error.hpp"
#include "ops/common/cuda_common.cuh"
#include "ops/common/activations.cuh"
#include "ops/common/sm90_async.cuh"
#include "qgemm_cuda.hpp"
#include "qgemm_device.cuh"
#include "qgemm_layout.hpp"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FK_QGEMM_SM90 1
#else
#define FK_QGEMM_SM90 0
#endif

namespace fk::cuda {
namespace {

using namespace sm90;          // mbarriers, TMA, bulk copies
using namespace qgemm_device;  // centered_word, Half2
using namespace cute;
using cute::Tensor;  // fk declares Tensor too

constexpr int kBK = 64;  // K per stage
constexpr int kProducerThreads = 128;
constexpr int kProducerRegs = 40;
constexpr int kMaxSplits = 8;  // splits of K: one cluster, at most the portable cluster size

template <class T> struct CuteType;
template <> struct CuteType<__half> { using type = cute::half_t; };
template <> struct CuteType<__nv_bfloat16> { using type = cute::bfloat16_t; };

template <class T, int MW_, int BMX_, int NC_ = 2>
struct Cfg {
  static constexpr int MW = MW_, BMX = BMX_, NC = NC_;  // NC consumer warpgroups
  static constexpr int RW = 64 * MW;  // rows of N a consumer warpgroup owns
  static constexpr int BN = NC * RW;  // rows of N a CTA owns
  static constexpr int kConsumerThreads = 128 * NC, kThreads = kProducerThreads + kConsumerThreads;
  // The CTA starts with 65536 / kThreads registers a thread; the producer needs few, the consumers
  // hold MW x BMX / 2 accumulators and two buffers of A fragments: 128 x 40 + 256 x 232 or
  // 128 x 40 + 384 x 152 <= 65536.
  static constexpr int kConsumerRegs = NC == 2 ? 232 : 152;
  static_assert(NC == 2 || (NC == 3 && MW == 1), "three consumer warpgroups hold one m64 block each");
  static_assert(kProducerThreads * kProducerRegs + kConsumerThreads * kConsumerRegs <= 65536);
  using CT = typename CuteType<T>::type;
  static constexpr int kX = BMX * kBK * 2;  // bytes of one stage's x tile (a multiple of 1024)
  static constexpr int kW = BN * 32;        // words: BN / 16 tiles of 512 bytes
  static constexpr int kS = BN * 2;         // scales of the CTA's rows, per half of the k-tile
  static constexpr int kZ = BN / 2;         // zero words of the CTA's rows, per half
  static constexpr int kStageBytes = kX + kW + 2 * kS + 2 * kZ;
  static constexpr int kStages = std::min(8, (200 * 1024) / kStageBytes);
  static constexpr int kOffW = kStages * kX, kOffS = kOffW + kStages * kW, kOffZ = kOffS + kStages * 2 * kS;
  static constexpr int kOffBars = kOffZ + kStages * 2 * kZ;
  static constexpr int kSmemBytes = kOffBars + 16 * kStages + 1024;  // + slack for the 1024-byte alignment
  static_assert(kSmemBytes <= 227 * 1024);
  // A CTA's rows may pass the padded rows (BN = 192): the last one loads only those below n_pad.
  static_assert(BN % 64 == 0 && kQgemmRowPad % 64 == 0);
  using SmemLayoutX = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<CT>{},
                                             Shape<Int<BMX>, Int<kBK>, Int<kStages>>{}));  // (BMX, 64, PIPE)
  // One consumer warpgroup: 64 rows of N x BMX rows of x per wgmma.
  using Mma = decltype(make_tiled_mma(SM90::GMMA::rs_op_selector<CT, CT, float, Shape<_64, Int<BMX>, Int<kBK>>,
                                                                 GMMA::Major::K, GMMA::Major::K>()));
  static_assert(cosize_v<SmemLayoutX> * 2 == kStages * kX);
  static_assert(BMX * (BN + 4) * 4 <= kOffBars, "the output tile fits in the stages");
};

struct Params {
  const char* words;           // packed words, [k_pad / 64][n_pad / 16][32 lanes][16 bytes]
  const unsigned short* scale; // [groups, n_pad]
  const std::uint32_t* zero;   // [groups, n_pad / 8]
  void* y;                     // [m, n] in T
  int m, n, n_pad, groups, group;  // group: k_pad when there is one group per row
  int k_tiles, tiles_per_split;
  bool vec;  // rows of y and of the partials allow 4-element vector stores
};

#if FK_QGEMM_SM90

struct Bars {
  std::uint32_t base;
  __device__ std::uint32_t full(int s) const { return base + 8 * s; }
  __device__ std::uint32_t empty(int s, int stages) const { return base + 8 * (stages + s); }
};

// All 128 producer threads: the words by per-thread cp.async (16 bytes each, kW / 2048 a thread),
// each thread's completion counted on the stage's full barrier (cp.async.mbarrier.arrive.noinc);
// thread 0 also issues x by TMA and the scales and zero words by bulk copies on the same barrier.
// (Bulk copies of the words streamed at ~1.1 TB/s over the GPU in a measurement with nothing else
// running; the words are what small M is bound by.)
template <class C, bool G64>
__device__ void produce(const Params& p, const CUtensorMap* tx, std::uint32_t smem, const Bars& bars, int n0,
                        int m0, int kt0, int nk) {
  const int pt = static_cast<int>(threadIdx.x);  // 0..127
  const int tiles_n = p.n_pad / 16;
  constexpr int kChunks = C::kW / 16 / kProducerThreads;  // 16-byte chunks of words a thread
  static_assert(C::kW % (16 * kProducerThreads) == 0);
  const char* wsrc = p.words + (static_cast<std::int64_t>(kt0) * tiles_n + n0 / 16) * 512 + 16 * pt;
  const std::int64_t wstep = static_cast<std::int64_t>(tiles_n) * 512;
  // Rows of the CTA below n_pad (a multiple of 64): the words, scales and zero words beyond are
  // not loaded (their consumers compute rows of y that are never stored).
  const int rows = min(C::BN, p.n_pad - n0);
  const std::uint32_t s_bytes = 2 * rows, z_bytes = rows / 2;
  int s = 0, parity = 1;
  for (int i = 0; i < nk; ++i) {
    const int kt = kt0 + i;
    mbar_wait(bars.empty(s, C::kStages), parity);
    const std::uint32_t wdst = smem + C::kOffW + s * C::kW + 16 * pt;
#pragma unroll
    for (int c = 0; c < kChunks; ++c)
      if (kQgemmRowPad % C::BN == 0 || (c * 16 * kProducerThreads + 16 * pt) / 32 < rows)  // 32 bytes a row
        cp_async_16(wdst + c * 16 * kProducerThreads, wsrc + c * 16 * kProducerThreads, 16);
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bars.full(s)) : "memory");
    wsrc += wstep;
    if (pt == 0) {
      mbar_arrive_expect_tx(bars.full(s), C::kX + (G64 ? 1 : 2) * (s_bytes + z_bytes));
      tma_load_2d(tx, bars.full(s), smem + s * C::kX, kt * kBK, m0);
#pragma unroll
      for (int b = 0; b < (G64 ? 1 : 2); ++b) {  // groups of 64+: one entry for the k-tile
        const int grp = min((kt * kBK + 32 * b) / p.group, p.groups - 1);
        bulk_copy(smem + C::kOffS + (2 * s + b) * C::kS, p.scale + static_cast<std::int64_t>(grp) * p.n_pad + n0,
                  s_bytes, bars.full(s));
        bulk_copy(smem + C::kOffZ + (2 * s + b) * C::kZ,
                  p.zero + static_cast<std::int64_t>(grp) * (p.n_pad / 8) + n0 / 8, z_bytes, bars.full(s));
      }
    }
    if (++s == C::kStages) {
      s = 0;
      parity ^= 1;
    }
  }
}

template <class T, class C, bool G64>
__device__ void consume(const Params& p, std::uint8_t* smem, const Bars& bars, int n0, int m0, int nk, int splits) {
  using CT = typename C::CT;
  constexpr int kConsumerThreads = C::kConsumerThreads;
  const int ct = static_cast<int>(threadIdx.x) - kProducerThreads;  // 0..kConsumerThreads - 1
  const int wg = ct / 128, w = (ct % 128) / 32, lane = ct % 32, g = lane / 4;
  typename C::Mma mma;
  auto thr = mma.get_thread_slice(ct % 128);
  Tensor sX = make_tensor(make_smem_ptr(reinterpret_cast<CT*>(smem)), typename C::SmemLayoutX{});  // (BMX,64,PIPE)
  Tensor tB = thr.make_fragment_B(thr.partition_B(sX));  // (MMA,1,4,PIPE) descriptors
  // Per m64 block: the accumulator (64 rows of N x BMX) and two buffers of A fragments for the 4
  // k16 steps of a k-tile, in mma.sync order (k pair, row + 8, k + 8).
  using AccT = decltype(partition_fragment_C(mma, Shape<_64, Int<C::BMX>>{}));
  AccT acc[C::MW];
  using FragLayout = Layout<Shape<Shape<_2, _2, _2>, _1, _4>, Stride<Stride<_1, _2, _4>, _0, _8>>;
  using FragT = decltype(make_tensor<CT>(FragLayout{}));
  FragT frag[2][C::MW];
  CUTE_UNROLL
  for (int i = 0; i < C::MW; ++i) {
    acc[i] = partition_fragment_C(mma, Shape<_64, Int<C::BMX>>{});
    clear(acc[i]);
    frag[0][i] = make_tensor<CT>(FragLayout{});
    frag[1][i] = make_tensor<CT>(FragLayout{});
  }
  mma.accumulate_ = GMMA::ScaleOut::One;
  // The two consumer warpgroups only (the producer may have left).
  auto named_barrier_sync = [] { asm volatile("bar.sync 1, %0;" ::"n"(kConsumerThreads) : "memory"); };

  // Keeps a buffer's registers in place around the wgmmas that read them.
  auto fence_frag = [](auto& f) {
    auto r = recast<std::uint32_t>(f);
    CUTE_UNROLL
    for (int i = 0; i < size(r); ++i) warpgroup_fence_operand(r(i));
  };
  // This thread's rows (within the CTA) in m64 block i: row0(i) + g and + 8; its 16 bytes of words
  // there, and the offsets of its scales (u16) and zero words (u32) within a half's entries.
  auto row0 = [&](int i) { return wg * C::RW + 64 * i + 16 * w + g; };
  // Stage bookkeeping without divisions: the next stage to dequantize, and its phase.
  int ds = 0, dphase = 0;
  // Dequantizes the next k-tile (its stage has landed) into frag[B].
  auto dequant = [&](auto buf) {
    constexpr int B = decltype(buf)::value;
    mbar_wait(bars.full(ds), dphase);
    const std::uint8_t* ws = smem + C::kOffW + ds * C::kW + 16 * lane;
    const auto* ss = reinterpret_cast<const unsigned short*>(smem + C::kOffS + 2 * ds * C::kS);
    const auto* zs = reinterpret_cast<const std::uint32_t*>(smem + C::kOffZ + 2 * ds * C::kZ);
    if (++ds == C::kStages) {
      ds = 0;
      dphase ^= 1;
    }
    using T2 = typename Half2<T>::type;
    CUTE_UNROLL
    for (int i = 0; i < C::MW; ++i) {
      const uint4 v = *reinterpret_cast<const uint4*>(ws + ((row0(i) - g) / 16) * 512);
      auto f = recast<std::uint32_t>(frag[B][i]);  // 16 registers: index r + 2 c + 4 kk
      // Per half b (one entry for both when the group is a multiple of 64) and 8-row half j:
      // the centering constants of the row's zero point and its scale, both halves of a pair.
      constexpr int H = G64 ? 1 : 2;
      std::uint32_t c0[H][2], c1[H][2];
      T2 s2[H][2];
      CUTE_UNROLL
      for (int b = 0; b < H; ++b)
        CUTE_UNROLL
        for (int j = 0; j < 2; ++j) {
          const int r = row0(i) + 8 * j;
          centering_constants<T>((zs[b * (C::kZ / 4) + r / 8] >> (4 * g)) & 0xFu, c0[b][j], c1[b][j]);
          s2[b][j] = bits_as<T2>(static_cast<std::uint32_t>(ss[b * C::BN + r]) * 0x10001u);
        }
      CUTE_UNROLL
      for (int b = 0; b < 2; ++b) {
        CUTE_UNROLL
        for (int j = 0; j < 2; ++j) {
          const int slot = 2 * j + b, e = G64 ? 0 : b;
          const std::uint32_t q = slot == 0 ? v.x : slot == 1 ? v.y : slot == 2 ? v.z : v.w;
          std::uint32_t d[4];
          centered_word<T>(q, c0[e][j], c1[e][j], d);
          // register 2h + c of the word: k16 step kk = 2b + h, k + 8c; row + 8j
          CUTE_UNROLL
          for (int h = 0; h < 2; ++h)
            CUTE_UNROLL
            for (int c = 0; c < 2; ++c)
              f(j + 2 * c + 4 * (2 * b + h)) = bits_as<std::uint32_t>(__hmul2(bits_as<T2>(d[2 * h + c]), s2[e][j]));
        }
      }
    }
  };
  int is = 0;  // the stage of the next k-tile to issue
  auto issue = [&](auto buf) {
    constexpr int B = decltype(buf)::value;
    CUTE_UNROLL
    for (int i = 0; i < C::MW; ++i) {
      warpgroup_fence_operand(acc[i]);
      fence_frag(frag[B][i]);
    }
    warpgroup_arrive();
    CUTE_UNROLL
    for (int i = 0; i < C::MW; ++i)
      CUTE_UNROLL
      for (int kk = 0; kk < 4; ++kk) gemm(mma, frag[B][i](_, _, kk), tB(_, _, kk, is), acc[i]);
    warpgroup_commit_batch();
    if (++is == C::kStages) is = 0;
  };
  int rs = 0;  // the stage the next release gives back
  // A stage goes back once the wgmmas reading it have retired; every consumer thread arrives, each
  // after its own loads of the stage's words, scales and zero points.
  auto release = [&] {
    mbar_arrive(bars.empty(rs, C::kStages));
    if (++rs == C::kStages) rs = 0;
  };
  // k-tile it goes to the tensor cores; it - 1 retires; it + 1 is dequantized meanwhile.
  auto step = [&](auto buf, int it) {
    constexpr int B = decltype(buf)::value;
    issue(buf);
    warpgroup_wait<1>();
    CUTE_UNROLL
    for (int i = 0; i < C::MW; ++i) fence_frag(frag[1 - B][i]);
    if (it > 0) release();
    if (it + 1 < nk) dequant(Int<1 - B>{});
  };
  dequant(Int<0>{});
  int it = 0;
  for (; it + 1 < nk; it += 2) {
    step(Int<0>{}, it);
    step(Int<1>{}, it + 1);
  }
  if (it < nk) step(Int<0>{}, it);
  warpgroup_wait<0>();
  CUTE_UNROLL
  for (int i = 0; i < C::MW; ++i) warpgroup_fence_operand(acc[i]);

  // The CTA's tile of yᵀ goes through shared memory (the stages, all consumed once both
  // warpgroups are here) as [BMX][BN + 4] fp32 (conflict-free: the 4 lanes of a row quad write
  // rows 8 apart mod 32 banks), then out in rows of y with 16-byte loads and coalesced stores.
  named_barrier_sync();
  float* tile = reinterpret_cast<float*>(smem);
  constexpr int LD = C::BN + 4, kChunks = C::BMX * C::BN / 4;  // 4 floats a chunk
  Tensor cC = thr.partition_C(make_identity_tensor(Shape<_64, Int<C::BMX>>{}));  // (n, m) within the block
  CUTE_UNROLL
  for (int i = 0; i < C::MW; ++i)
    CUTE_UNROLL
    for (int e = 0; e < size(acc[i]); ++e)
      tile[get<1>(cC(e)) * LD + wg * C::RW + 64 * i + get<0>(cC(e))] = acc[i](e);
  named_barrier_sync();
  // Rounds 4 values of y's row m0 + ml from column n0 + nl on and stores them.
  auto store = [&](int chunk, float4 v) {
    const int ml = chunk / (C::BN / 4), nl = (chunk % (C::BN / 4)) * 4, m = m0 + ml, n = n0 + nl;
    if (m >= p.m || n >= p.n) return;
    T* y = static_cast<T*>(p.y) + static_cast<std::int64_t>(m) * p.n + n;
    const T o[4] = {fk::device::from_float<T>(v.x), fk::device::from_float<T>(v.y), fk::device::from_float<T>(v.z),
                    fk::device::from_float<T>(v.w)};
    if (p.vec) {
      *reinterpret_cast<uint2*>(y) = *reinterpret_cast<const uint2*>(o);
    } else {
      for (int q = 0; q < 4 && n + q < p.n; ++q) y[q] = o[q];
    }
  };
  auto at = [&](int chunk) { return tile + (chunk / (C::BN / 4)) * LD + (chunk % (C::BN / 4)) * 4; };
  if (splits == 1) {
    for (int c = ct; c < kChunks; c += kConsumerThreads) store(c, *reinterpret_cast<const float4*>(at(c)));
    return;
  }
  // Split K: the CTAs of one output tile are one cluster (1 x 1 x splits). Once every CTA's tile is
  // staged (cluster barrier: release / acquire), rank r sums chunks [r, r + 1) x kChunks / splits
  // of all the tiles through distributed shared memory, always in rank order (deterministic),
  // kU chunks' loads in flight before their sums; a last cluster barrier keeps every CTA (and its
  // shared memory) alive until no peer reads it any more. No workspace, no second kernel.
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
  std::uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
  const int per = (kChunks + splits - 1) / splits, c_end = min(kChunks, (static_cast<int>(rank) + 1) * per);
  constexpr int kU = 4;
  for (int c0 = static_cast<int>(rank) * per + ct; c0 < c_end; c0 += kU * kConsumerThreads) {
    float4 v[kU][kMaxSplits];
    CUTE_UNROLL
    for (int u = 0; u < kU; ++u) {
      const std::uint32_t local = smem_addr(at(min(c0 + u * kConsumerThreads, kChunks - 1)));
      CUTE_UNROLL
      for (int q = 0; q < kMaxSplits; ++q) {
        if (q >= splits) break;
        std::uint32_t remote;
        asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(local), "r"(q));
        asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                     : "=f"(v[u][q].x), "=f"(v[u][q].y), "=f"(v[u][q].z), "=f"(v[u][q].w)
                     : "r"(remote));
      }
    }
    CUTE_UNROLL
    for (int u = 0; u < kU; ++u) {
      const int c = c0 + u * kConsumerThreads;
      if (c >= c_end) break;
      float4 sum = v[u][0];
      CUTE_UNROLL
      for (int q = 1; q < kMaxSplits; ++q) {
        if (q >= splits) break;
        sum.x += v[u][q].x;
        sum.y += v[u][q].y;
        sum.z += v[u][q].z;
        sum.w += v[u][q].w;
      }
      store(c, sum);
    }
  }
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

#endif  // FK_QGEMM_SM90

template <class T, class C, bool G64>
__global__ void __launch_bounds__(C::kThreads, 1)
    qgemm_wgmma_kernel(const __grid_constant__ Params p, const __grid_constant__ CUtensorMap tx) {
#if FK_QGEMM_SM90
  extern __shared__ std::uint8_t smem_raw[];
  const std::uint32_t raw = smem_addr(smem_raw), base = (raw + 1023) & ~1023u;
  std::uint8_t* smem = smem_raw + (base - raw);
  const Bars bars{base + C::kOffBars};
  if (threadIdx.x == 0) {
    for (int s = 0; s < C::kStages; ++s) {
      mbar_init(bars.full(s), 1 + kProducerThreads);  // thread 0's expect_tx + every producer thread's cp.async
      mbar_init(bars.empty(s, C::kStages), C::kConsumerThreads);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int n0 = static_cast<int>(blockIdx.x) * C::BN, m0 = static_cast<int>(blockIdx.y) * C::BMX;
  const int split = static_cast<int>(blockIdx.z), kt0 = split * p.tiles_per_split;
  const int nk = min(p.k_tiles, kt0 + p.tiles_per_split) - kt0;  // >= 1: the launcher makes no empty split
  if (threadIdx.x < kProducerThreads) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kProducerRegs));
    produce<C, G64>(p, &tx, base, bars, n0, m0, kt0, nk);
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(C::kConsumerRegs));
    consume<T, C, G64>(p, smem, bars, n0, m0, nk, static_cast<int>(gridDim.z));
  }
#else
  __trap();  // the launcher never starts this kernel off sm_90
#endif
}

// x [M, K] as a (K, M) map, boxes of {64, BMX} with the 128-byte swizzle; rows past M and columns
// past K come back as zeros.
CUtensorMap x_map(const TensorView& x, int bmx) {
  const CUtensorMapDataType type =
      x.dtype() == DType::bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  return sm90::tensor_map<2>("qgemm", "x", type, x.data(),
                             {static_cast<cuuint64_t>(x.size(1)), static_cast<cuuint64_t>(x.size(0))},
                             {static_cast<cuuint64_t>(x.size(1)) * 2},
                             {static_cast<cuuint32_t>(kBK), static_cast<cuuint32_t>(bmx)}, CU_TENSOR_MAP_SWIZZLE_128B);
}

// Clusters of `splits` CTAs of qgemm_wgmma_kernel<T, C> the device runs at once (a cluster lives
// in one GPC, so this is less than SMs / splits), per device, cached: decoding calls qgemm often.
template <class T, class C>
int resident_clusters(int device, int splits) {
  static std::mutex mutex;
  static std::map<std::pair<int, int>, int> cache;
  const std::lock_guard<std::mutex> lock(mutex);
  if (const auto it = cache.find({device, splits}); it != cache.end()) return it->second;
  const auto kernel = qgemm_wgmma_kernel<T, C, true>;  // the same resources as <T, C, false>
  for (const auto k : {qgemm_wgmma_kernel<T, C, true>, qgemm_wgmma_kernel<T, C, false>})
    FK_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes));
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(1, 1, static_cast<unsigned>(splits));
  cfg.blockDim = dim3(C::kThreads);
  cfg.dynamicSmemBytes = C::kSmemBytes;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim = {1, 1, static_cast<unsigned>(splits)};
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  int clusters = 0;
  FK_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg));
  return cache[{device, splits}] = clusters;
}

template <class T, class C>
void launch(const TensorView& x, const QuantizedWeight& qw, const TensorView& y, int splits_wanted,
            const Stream* stream) {
  Params p{};
  p.words = qw.packed.data_as<const char>();
  p.scale = qw.scale.data_as<const unsigned short>();
  p.zero = qw.zero.data_as<const std::uint32_t>();
  p.y = y.data();
  p.m = static_cast<int>(x.size(0));
  p.n = static_cast<int>(qw.n);
  p.n_pad = static_cast<int>(qw.n_pad());
  p.groups = static_cast<int>(qw.groups());
  p.group = qw.groups() == 1 ? static_cast<int>(qw.k_pad()) : qw.group;
  p.k_tiles = static_cast<int>(qw.k_pad() / kBK);
  p.vec = p.n % 4 == 0 && reinterpret_cast<std::uintptr_t>(y.data()) % 8 == 0;
  p.tiles_per_split = (p.k_tiles + splits_wanted - 1) / splits_wanted;
  const int splits = (p.k_tiles + p.tiles_per_split - 1) / p.tiles_per_split;  // no empty split
  const CUtensorMap tx = x_map(x, C::BMX);
  const auto kernel = p.group % 64 == 0 ? qgemm_wgmma_kernel<T, C, true>  // a k-tile lies in one group
                                        : qgemm_wgmma_kernel<T, C, false>;
  resident_clusters<T, C>(y.device().index, splits);  // sets the kernels' shared-memory attribute once
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>((p.n + C::BN - 1) / C::BN), static_cast<unsigned>((p.m + C::BMX - 1) / C::BMX),
                     static_cast<unsigned>(splits));
  cfg.blockDim = dim3(C::kThreads);
  cfg.dynamicSmemBytes = C::kSmemBytes;
  cfg.stream = fk::detail::cuda_stream(stream);
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim = {1, 1, static_cast<unsigned>(splits)};  // the CTAs of one output tile
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  FK_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p, tx));
}

// The configuration (two consumers of 256 or 128 rows, or three of 192) and the splits of K: among
// the plans whose clusters all run in one wave, the least
// estimated time, in units of one row-k-tile of a CTA (rows x k-tiles a CTA: the weights it
// streams) + kTileCost per k-tile a CTA (x's tile, the loop) + kSplitCost per split (the cluster
// reduction and barrier, the skew of more CTAs). Fitted to H100 sweeps of every (MW, splits) at
// M = 64 and 128 on the bench's shapes (~1.1 ns a row-k-tile, ~0.12 us a k-tile, ~1.3 us a split
// over a fixed ~7 us); it picks the fastest measured plan in 5 of the 6 (M, shape) pairs and one
// 0.6 us slower in the sixth. The same costs pick three consumers (192 rows, 2 splits: 116 CTAs
// against 86) for N = 11008, as measured fastest there. Nothing fits one wave (large M): 256 rows,
// no split.
constexpr long kTileCost = 110, kSplitCost = 1230;
template <class T, int BMX>
QgemmWgmmaPlan plan(int device, int n, int m, int k_tiles) {
  const int m_blocks = (m + BMX - 1) / BMX;
  QgemmWgmmaPlan best{2, 2, 1};
  long best_work = -1;
  for (const auto& [nc, mw] : {std::pair{2, 2}, std::pair{2, 1}, std::pair{3, 1}}) {
    const int bn = 64 * nc * mw, tiles = (n + bn - 1) / bn * m_blocks;
    for (int s = 1; s <= std::min(kMaxSplits, k_tiles); ++s) {
      const int per = (k_tiles + s - 1) / s, splits = (k_tiles + per - 1) / per;
      if (splits != s) continue;  // the same plan as fewer splits
      const int resident = nc == 3    ? resident_clusters<T, Cfg<T, 1, BMX, 3>>(device, s)
                           : mw == 2 ? resident_clusters<T, Cfg<T, 2, BMX>>(device, s)
                                     : resident_clusters<T, Cfg<T, 1, BMX>>(device, s);
      if (tiles > resident) continue;  // a second wave
      const long work = (bn + kTileCost) * per + kSplitCost * s;
      if (best_work < 0 || work < best_work) {
        best = {nc, mw, s};
        best_work = work;
      }
    }
  }
  return best;
}

template <class T, int BMX>
void dispatch(const TensorView& x, const QuantizedWeight& qw, const TensorView& y, const Stream* stream,
              const QgemmWgmmaPlan* forced) {
  const QgemmWgmmaPlan pl =
      forced != nullptr ? *forced
                        : plan<T, BMX>(y.device().index, static_cast<int>(qw.n), static_cast<int>(x.size(0)),
                                       static_cast<int>(qw.k_pad() / kBK));
  if (pl.nc == 3)
    launch<T, Cfg<T, 1, BMX, 3>>(x, qw, y, pl.splits, stream);
  else if (pl.mw == 2)
    launch<T, Cfg<T, 2, BMX>>(x, qw, y, pl.splits, stream);
  else
    launch<T, Cfg<T, 1, BMX>>(x, qw, y, pl.splits, stream);
}

}  // namespace

bool qgemm_wgmma(const TensorView& x, const QuantizedWeight& qw, const TensorView& y, const Stream* stream,
                 const QgemmWgmmaPlan* forced) {
  if (forced != nullptr) {
    const bool config =
        (forced->nc == 2 && (forced->mw == 1 || forced->mw == 2)) || (forced->nc == 3 && forced->mw == 1);
    if (!config || forced->splits < 1 || forced->splits > kMaxSplits)
      throw_internal("qgemm_wgmma: a forced plan is (2, 2), (2, 1) or (3, 1) with 1 to 8 splits");
  }
  const int device = y.device().index;
  if (!is_sm90(device)) return false;
  if (x.size(0) > 65535LL * 128) return false;
  const bool small = x.size(0) <= 64;
  if (qw.dtype == DType::bf16) {
    if (small) dispatch<__nv_bfloat16, 64>(x, qw, y, stream, forced);
    else dispatch<__nv_bfloat16, 128>(x, qw, y, stream, forced);
  } else {
    if (small) dispatch<__half, 64>(x, qw, y, stream, forced);
    else dispatch<__half, 128>(x, qw, y, stream, forced);
  }
  return true;
}

}  // namespace fk::cuda
