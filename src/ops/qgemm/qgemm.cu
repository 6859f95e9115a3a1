// qgemm: y [M, N] = x [M, K] · w̃ᵀ with w̃ dequantized in registers from 4-bit words.
//
// M <= 16 goes to the weight-streaming kernel (qgemm_small_m.cu) when its chunk of x fits shared
// memory. Otherwise one kernel template, two tile shapes picked by M:
//   M <= 64      64 x 256 tiles (8 warps side by side, 64 x 32 each), 4 stages;
//   M >  64      128 x 128 tiles (2 x 4 warps, 64 x 32 each), 4 stages.
// Per k-tile a CTA copies x [BM, 64] (zero-filled beyond M and K) and the words of its rows
// (contiguous in the packed layout, qgemm_layout.hpp) into shared memory with cp.async; each thread
// then reads one 16-byte vector of words per 16 rows, turns every word into four f16x2/bf16x2
// B-fragment registers (mask 0x000F000F | magic exponent, subtract magic + zero point — exact —,
// multiply by the scale: one rounding, the same as dequantize_weights) and issues mma.sync
// m16n8k16 with fp32 accumulators against A fragments from ldmatrix. Scales and zero points come
// in the same cp.async stages ([2][BN] scales, [2][BN / 8] zero words). Split-K partials go to an
// fp32 workspace [splits, M, N] that a second kernel sums in a fixed order (deterministic), rounds.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>

#include "fusekit/core/cuda_check.hpp"
#include "ops/common/cuda_common.cuh"
#include "ops/common/activations.cuh"
#include "qgemm_cuda.hpp"
#include "qgemm_device.cuh"
#include "qgemm_layout.hpp"
#include "ops/common/sm90_async.cuh"

namespace fk::cuda {
namespace {

using namespace sm90;            // mbarriers and bulk copies (ops/common/sm90_async.cuh)
using namespace qgemm_device;    // dequant_word, mma_16816, cp.async (qgemm_device.cuh)

constexpr int kThreads = 256;
constexpr int kBK = 64;  // K per stage: two 32-wide word columns

__device__ __forceinline__ void ldmatrix_x4(std::uint32_t (&a)[4], std::uint32_t smem_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
               : "r"(smem_addr));
}

// sm_90: the words, scales and zero points of a stage (contiguous runs of the packed layout) come
// by bulk copies (cp.async.bulk, the TMA engine without a tensor map), issued by one thread and
// counted on one mbarrier per stage, so that many kilobytes per SM are in flight at the cost of a
// few instructions; x keeps per-thread cp.async (swizzled, zero-filled). sm_80: all cp.async.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define FK_QGEMM_BULK 1
#else
#define FK_QGEMM_BULK 0
#endif


template <class T>
struct Params {
  const T* x;                 // [m, k]
  const int4* words;          // packed: [k_pad / 64][n_pad / 16][32 lanes] of 16 bytes
  const unsigned short* scale;  // [groups, n_pad], T's bits
  const std::uint32_t* zero;  // [groups, n_pad / 8]
  T* y;                       // [m, n]
  float* partial;             // [splits, m, n] when split-K, else null
  int m, n, k, n_pad, groups, group;  // group: k_pad when there is one group per row
  int k_tiles, tiles_per_split;
};

// Tile constants derived from the warp grid and the warp tile (WM m16 tiles x WN n8 tiles).
template <int WARPS_M_, int WARPS_N_, int WM_, int WN_, int STAGES_, int MIN_CTAS_>
struct Tiles {
  static constexpr int WARPS_M = WARPS_M_, WARPS_N = WARPS_N_, WM = WM_, WN = WN_, STAGES = STAGES_;
  static constexpr int MIN_CTAS = MIN_CTAS_;  // resident CTAs an SM must hold (register budget)
  static constexpr int BM = WARPS_M * WM * 16, BN = WARPS_N * WN * 8;
  static constexpr int X_STAGE = BM * kBK * 2;  // bytes: BM rows of 8 16-byte chunks
  static constexpr int W_STAGE = BN * 32;       // bytes: BN / 16 tiles of 512
  // Scales and zero points of the CTA's rows for both 32-wide halves of the k-tile: [2][BN] scales
  // then [2][BN / 8] zero words, copied as 16-byte chunks.
  static constexpr int S_CHUNKS = BN / 8 + BN / 32;  // per half
  static constexpr int S_STAGE = 2 * S_CHUNKS * 16;
  static constexpr int SMEM = STAGES * (X_STAGE + W_STAGE + S_STAGE);
  static_assert(WARPS_M * WARPS_N * 32 == kThreads);
  static_assert(WN % 2 == 0, "a warp reads whole 16-row word tiles");
  static_assert(kQgemmRowPad % BN == 0, "a CTA's rows never pass the padded rows");
};

using MidM = Tiles<1, 8, 4, 4, 4, 2>;     // 64 x 256
using LargeM = Tiles<2, 4, 4, 4, 4, 2>;   // 128 x 128

template <class T, class C>
__global__ void __launch_bounds__(kThreads, C::MIN_CTAS) qgemm_kernel(const Params<T> p) {
  constexpr int BM = C::BM, BN = C::BN, WM = C::WM, WN = C::WN, STAGES = C::STAGES;
  extern __shared__ int4 smem[];
  const std::uint32_t sx = static_cast<std::uint32_t>(__cvta_generic_to_shared(smem));  // x stages
  const std::uint32_t sw = sx + STAGES * C::X_STAGE;                                   // word stages
  const std::uint32_t ss = sw + STAGES * C::W_STAGE;                                  // scale stages
  const int4* sw_ptr = smem + STAGES * C::X_STAGE / 16;
  const char* ss_ptr = reinterpret_cast<const char*>(smem) + STAGES * (C::X_STAGE + C::W_STAGE);

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int warp_m = warp / C::WARPS_N, warp_n = warp % C::WARPS_N;
  const int g = lane / 4, t = lane % 4;
  const int n_cta = blockIdx.x * BN, m_cta = blockIdx.y * BM;
  const int kt_begin = blockIdx.z * p.tiles_per_split;
  const int nk = min(p.k_tiles, kt_begin + p.tiles_per_split) - kt_begin;

#if FK_QGEMM_BULK
  __shared__ alignas(8) std::uint64_t full[STAGES];  // one per stage: the bulk copies landed
  const std::uint32_t full_bar = static_cast<std::uint32_t>(__cvta_generic_to_shared(full));
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) mbar_init(full_bar + s * 8, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
#endif

  auto load_stage = [&](int stage, int kt) {
    for (int c = tid; c < BM * 8; c += kThreads) {
      const int row = c / 8, ch = c % 8, gm = m_cta + row, gk = kt * kBK + ch * 8;
      const bool in = gm < p.m && gk < p.k;
      const T* src = in ? p.x + static_cast<std::int64_t>(gm) * p.k + gk : p.x;
      cp_async_16(sx + stage * C::X_STAGE + row * 128 + ((ch ^ (row & 7)) * 16), src, in ? 16 : 0);
    }
    const int4* src = p.words + (static_cast<std::int64_t>(kt) * (p.n_pad / 16) + n_cta / 16) * 32;
    // Scales and zero points; alignment: n_pad % 256 == 0 and n_cta % 128 == 0.
#if FK_QGEMM_BULK
    if (tid == 0) {
      const std::uint32_t bar = full_bar + stage * 8;
      mbar_arrive_expect_tx(bar, C::W_STAGE + C::S_STAGE);
      bulk_copy(sw + stage * C::W_STAGE, src, C::W_STAGE, bar);
      for (int b = 0; b < 2; ++b) {
        const std::int64_t grp = min((kt * kBK + b * 32) / p.group, p.groups - 1);
        bulk_copy(ss + stage * C::S_STAGE + b * BN * 2, p.scale + grp * p.n_pad + n_cta, BN * 2, bar);
        bulk_copy(ss + stage * C::S_STAGE + 2 * BN * 2 + b * (BN / 2), p.zero + grp * (p.n_pad / 8) + n_cta / 8,
                  BN / 2, bar);
      }
    }
#else
    for (int c = tid; c < BN * 2; c += kThreads) cp_async_16(sw + stage * C::W_STAGE + c * 16, src + c, 16);
    for (int c = tid; c < 2 * C::S_CHUNKS; c += kThreads) {
      const int b = c / C::S_CHUNKS, r = c % C::S_CHUNKS;
      const std::int64_t grp = min((kt * kBK + b * 32) / p.group, p.groups - 1);
      const char* from = r < BN / 8
                             ? reinterpret_cast<const char*>(p.scale + grp * p.n_pad + n_cta) + r * 16
                             : reinterpret_cast<const char*>(p.zero + grp * (p.n_pad / 8) + n_cta / 8) + (r - BN / 8) * 16;
      const int to = r < BN / 8 ? b * BN * 2 + r * 16 : 2 * BN * 2 + b * (BN / 2) + (r - BN / 8) * 16;
      cp_async_16(ss + stage * C::S_STAGE + to, from, 16);
    }
#endif
  };

  float acc[WM][WN][4];
#pragma unroll
  for (int i = 0; i < WM; ++i)
#pragma unroll
    for (int j = 0; j < WN; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[i][j][r] = 0.0f;

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < nk) load_stage(s, kt_begin + s);
    cp_async_commit();
  }

  for (int it = 0; it < nk; ++it) {
    cp_async_wait<STAGES - 2>();
#if FK_QGEMM_BULK
    mbar_wait(full_bar + (it % STAGES) * 8, static_cast<std::uint32_t>(it / STAGES) & 1u);
#endif
    __syncthreads();  // stage `it` landed for every thread; stage it - 1 is free to refill
    if (it + STAGES - 1 < nk) load_stage((it + STAGES - 1) % STAGES, kt_begin + it + STAGES - 1);
    cp_async_commit();

    const int stage = it % STAGES;
    const auto* s_stage = reinterpret_cast<const unsigned short*>(ss_ptr + stage * C::S_STAGE);  // [2][BN]
    const auto* z_stage = reinterpret_cast<const std::uint32_t*>(s_stage + 2 * BN);              // [2][BN / 8]
    int4 words[WN / 2];
#pragma unroll
    for (int i = 0; i < WN / 2; ++i) words[i] = sw_ptr[stage * (C::W_STAGE / 16) + (warp_n * WN / 2 + i) * 32 + lane];
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      std::uint32_t bf[WN][4];
#pragma unroll
      for (int j = 0; j < WN; ++j) {
        const int4 v = words[j / 2];
        const int slot = (j % 2) * 2 + b;
        const int q = slot == 0 ? v.x : slot == 1 ? v.y : slot == 2 ? v.z : v.w;
        const int row = (warp_n * WN + j) * 8 + g;  // within the CTA's rows
        const std::uint32_t z = (z_stage[b * (BN / 8) + row / 8] >> (4 * g)) & 0xFu;
        dequant_word<T>(static_cast<std::uint32_t>(q), s_stage[b * BN + row], z, bf[j]);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int ks = b * 2 + h;  // k16 step within the k-tile
        std::uint32_t a[WM][4];
#pragma unroll
        for (int i = 0; i < WM; ++i) {
          const int row = warp_m * WM * 16 + i * 16 + lane % 16, ch = ks * 2 + lane / 16;
          ldmatrix_x4(a[i], sx + stage * C::X_STAGE + row * 128 + ((ch ^ (row & 7)) * 16));
        }
#pragma unroll
        for (int i = 0; i < WM; ++i)
#pragma unroll
          for (int j = 0; j < WN; ++j) mma_16816<T>(acc[i][j], a[i], bf[j][h * 2], bf[j][h * 2 + 1]);
      }
    }
  }
  cp_async_wait<0>();

#pragma unroll
  for (int i = 0; i < WM; ++i)
#pragma unroll
    for (int j = 0; j < WN; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int m = m_cta + warp_m * WM * 16 + i * 16 + g + (r / 2) * 8;
        const int n = n_cta + (warp_n * WN + j) * 8 + 2 * t + r % 2;
        if (m >= p.m || n >= p.n) continue;
        const std::int64_t at = static_cast<std::int64_t>(m) * p.n + n;
        if (p.partial)
          p.partial[static_cast<std::int64_t>(blockIdx.z) * p.m * p.n + at] = acc[i][j][r];
        else
          p.y[at] = device::from_float<T>(acc[i][j][r]);
      }
}

// y = the sum of the split-K partials [splits, count], in split order.
template <class T>
__global__ void __launch_bounds__(256) sum_partials_kernel(const float* __restrict__ partial, T* __restrict__ y,
                                                           std::int64_t count, int splits) {
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    // Eight loads in flight before the adds (still summed in split order): a loop of dependent
    // load-add pairs would pay one L2 round trip per split.
    float s = 0.0f;
    for (int z0 = 0; z0 < splits; z0 += 8) {
      float v[8];
#pragma unroll
      for (int d = 0; d < 8; ++d) v[d] = z0 + d < splits ? partial[(z0 + d) * count + i] : 0.0f;
#pragma unroll
      for (int d = 0; d < 8; ++d) s += v[d];
    }
    y[i] = device::from_float<T>(s);
  }
}

// CTAs of qgemm_kernel<T, C> the device holds at once (resident per SM x SMs), after opting in to
// its shared memory; once per kernel and device, since decoding calls qgemm at a high rate.
template <class T, class C>
int resident_slots(int device) {
  static std::mutex mutex;
  static std::map<int, int> slots;  // per device
  const std::lock_guard<std::mutex> lock(mutex);
  if (const auto it = slots.find(device); it != slots.end()) return it->second;
  const auto kernel = qgemm_kernel<T, C>;
  FK_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM));
  // All of the unified L1/shared memory as shared memory, so that the residency the occupancy
  // query reports (and the split-K below counts on) is the residency the launch gets.
  FK_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                     cudaSharedmemCarveoutMaxShared));
  int per_sm = 0;
  FK_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, C::SMEM));
  return slots[device] = std::max(1, per_sm) * multiprocessor_count();
}

template <class T, class C>
void launch(const TensorView& x, const QuantizedWeight& qw, const TensorView& y, const Stream* stream) {
  const cudaStream_t st = fk::detail::cuda_stream(stream);
  const int m = static_cast<int>(x.size(0)), n = static_cast<int>(qw.n);
  Params<T> p{};
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
  p.group = qw.groups() == 1 ? static_cast<int>(qw.k_pad()) : qw.group;
  p.k_tiles = static_cast<int>(qw.k_pad() / kBK);

  const auto kernel = qgemm_kernel<T, C>;
  const int slots = resident_slots<T, C>(y.device().index);
  const int n_tiles = (n + C::BN - 1) / C::BN, m_tiles = (m + C::BM - 1) / C::BM;
  const int tiles = n_tiles * m_tiles;
  // Split K so that the CTAs fill the resident slots in one wave (never more: a partial second wave
  // costs a whole tile's time), keeping 4 k-tiles (256 of K) per split and the fp32 partials
  // (splits * M * N * 4 bytes, written and read back through L2) under twice the bytes of the
  // weight (N * K / 2).
  const int most = std::max(1, std::min(p.k_tiles / 4, p.k / (4 * m)));
  int splits = std::clamp(slots / tiles, 1, most);
  p.tiles_per_split = (p.k_tiles + splits - 1) / splits;
  splits = (p.k_tiles + p.tiles_per_split - 1) / p.tiles_per_split;  // no empty split

  Tensor partial;
  if (splits > 1) {
    partial = Tensor::empty({splits, m, n}, DType::f32, y.device(), stream);
    p.partial = partial.data_as<float>();
  }
  kernel<<<dim3(n_tiles, m_tiles, splits), kThreads, C::SMEM, st>>>(p);
  FK_CUDA_CHECK_LAUNCH("qgemm_kernel");
  if (splits > 1) {
    const std::int64_t count = static_cast<std::int64_t>(m) * n;
    const int blocks = static_cast<int>(std::min<std::int64_t>((count + 255) / 256, 2048));
    sum_partials_kernel<T><<<blocks, 256, 0, st>>>(p.partial, p.y, count, splits);
    FK_CUDA_CHECK_LAUNCH("qgemm sum_partials_kernel");
  }
}

// w̃ [n, k] from the words, one thread per word: s * (q - z), exact in fp32, rounded once (as the
// spec does). Any group: the zero point and scale are looked up per value.
template <class T>
__global__ void __launch_bounds__(256) dequantize_kernel(const std::uint32_t* __restrict__ words,
                                                         const T* __restrict__ scale,
                                                         const std::uint32_t* __restrict__ zero, T* __restrict__ out,
                                                         std::int64_t n_words, int n, int k, int n_pad, int groups,
                                                         int group) {
  for (std::int64_t w = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; w < n_words;
       w += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::uint32_t q = words[w];
#pragma unroll
    for (int nib = 0; nib < 8; ++nib) {
      std::int64_t row = 0, col = 0;
      qgemm_layout::coords_of(w, nib, n_pad, row, col);
      if (row >= n || col >= k) continue;
      const std::int64_t grp = min(col / group, static_cast<std::int64_t>(groups - 1));
      const int z = static_cast<int>((zero[grp * (n_pad / 8) + row / 8] >> (4 * (row % 8))) & 0xFu);
      const float s = device::to_float(scale[grp * n_pad + row]);
      out[row * k + col] = device::from_float<T>(s * static_cast<float>(static_cast<int>((q >> (4 * nib)) & 0xFu) - z));
    }
  }
}

}  // namespace

void qgemm(const TensorView& x, const QuantizedWeight& qw, const TensorView& y, const Stream* stream,
           QgemmPath path, const QgemmOptions& options) {
  const fk::detail::DeviceScope on_device(y.device().index);
  with_float_type(qw.dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, float>) {
      throw_internal("qgemm: f32 weights are not packed");
    } else {
      const std::int64_t m = x.size(0);
      if (path == QgemmPath::automatic) {
        if (m <= 16 && qgemm_small_m(x, qw, y, stream, options)) return;  // qgemm_small_m.cu
        if (qgemm_wgmma(x, qw, y, stream)) return;                // qgemm_wgmma.cu: sm_90
      }
      if (m <= MidM::BM) return launch<T, MidM>(x, qw, y, stream);
      return launch<T, LargeM>(x, qw, y, stream);
    }
  });
}

void dequantize_weights(const QuantizedWeight& qw, const TensorView& out, const Stream* stream) {
  const fk::detail::DeviceScope on_device(out.device().index);
  with_float_type(qw.dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, float>) {
      throw_internal("dequantize_weights: f32 weights are not packed");
    } else {
      const std::int64_t n_words = qw.packed.numel();
      const int blocks = static_cast<int>(std::min<std::int64_t>((n_words + 255) / 256, 8 * multiprocessor_count()));
      const int group = qw.groups() == 1 ? static_cast<int>(qw.k_pad()) : qw.group;
      dequantize_kernel<T><<<blocks, 256, 0, fk::detail::cuda_stream(stream)>>>(
          qw.packed.data_as<const std::uint32_t>(), qw.scale.data_as<const T>(),
          qw.zero.data_as<const std::uint32_t>(), out.data_as<T>(), n_words, static_cast<int>(qw.n),
          static_cast<int>(qw.k), static_cast<int>(qw.n_pad()), static_cast<int>(qw.groups()), group);
      FK_CUDA_CHECK_LAUNCH("dequantize_kernel");
    }
  });
}

}  // namespace fk::cuda
