// The LoRA forward's low-rank input t = s x Aᵀ [M, rb] on Hopper: one streaming pass over x
// [M, K] (the whole cost: 64 MiB at M = 8192, K = 4096, bf16), A zero-padded to rb = 16 ceil(r / 16)
// rows [rb, K] and read from L2.
//
// A CTA owns 64 rows of x and walks all of K in 64-deep k-blocks through an 8-stage ring filled by
// TMA (the x box and A's box of a k-block on the stage's full barrier, 128-byte swizzle): 80 KB in
// flight an SM, what ~28 GB/s an SM needs to cover a DRAM round trip under load. One warpgroup
// consumes: per k-block four wgmma 64 x rb x 16 (both operands K-major from shared memory), then
// it releases the stage of the k-block before (wgmmas retire in order). A fifth warp issues the
// TMA. The fp32 accumulators (64 x rb) are scaled, rounded and stored; t is small (M rb values).
//
// One CTA per 64 rows keeps the GPU full only from M ~ 64 SMs up; below that (and for anything
// TMA cannot take: K % 8 != 0, misaligned bases) the caller keeps cuBLAS. Rows past M and k past
// K are zeros from TMA (out-of-bounds fill), so tails need no special case; rows past M are not
// stored.
//
// Measured against cuBLAS's skinny GEMM for the same t: see docs/lora.md.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include <cute/tensor.hpp>  // first: the atom headers rely on what it includes before them
#include <cute/atom/mma_atom.hpp>

#include "fusekit/core/cuda_check.hpp"
#include "fusekit/core/error.hpp"
#include "fusekit/core/tensor.hpp"
#include "lora_cuda.hpp"
#include "ops/cuda_common.cuh"
#include "ops/sm90_async.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FK_LORA_T_SM90 1
#else
#define FK_LORA_T_SM90 0
#endif

namespace fk::cuda {
namespace {

using namespace sm90;
using namespace cute;
using cute::Tensor;  // fk declares Tensor too

constexpr const char* kOp = "lora_forward";
constexpr int kBM = 64, kBK = 64, kStages = 8;
constexpr int kConsumers = 128;                // one warpgroup
constexpr int kThreads = kConsumers + 32;      // + the TMA warp
constexpr int kXStageBytes = kBM * kBK * 2;    // 8 KB

template <class E, int RB>
struct Cfg {
  // K-major, 128-byte swizzle: rows of 64 k (128 B), the layout TMA writes for a 64-wide box.
  using SmemX = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<E>{}, Shape<Int<kBM>, Int<kBK>, Int<kStages>>{}));
  using SmemA = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<E>{}, Shape<Int<RB>, Int<kBK>, Int<kStages>>{}));
  using Mma = decltype(make_tiled_mma(
      GMMA::ss_op_selector<E, E, float, Shape<Int<kBM>, Int<RB>, Int<kBK>>, GMMA::Major::K, GMMA::Major::K>()));
  static constexpr int kAStageBytes = RB * kBK * 2;
  static constexpr int kStageBytes = kXStageBytes + kAStageBytes;
  // x ring, A ring, then the full and empty barriers; + 1 KB for the 1024-byte alignment.
  static constexpr int kSmemBytes = kStages * kStageBytes + 2 * kStages * 8 + 1024;
  static_assert(cosize_v<SmemX> * 2 == kStages * kXStageBytes && cosize_v<SmemA> * 2 == kStages * kAStageBytes);
};

struct TParams {
  void* t;           // [M, rb]
  std::int64_t m;
  int kblocks;
  float scale;
};

template <class E, int RB>
__global__ void __launch_bounds__(kThreads, 1)
    lora_t_kernel(const __grid_constant__ TParams p, const __grid_constant__ CUtensorMap tmap_x,
                  const __grid_constant__ CUtensorMap tmap_a) {
#if FK_LORA_T_SM90
  using C = Cfg<E, RB>;
  extern __shared__ std::uint8_t smem_raw[];
  const std::uint32_t base = (smem_addr(smem_raw) + 1023) & ~1023u;
  const std::uint32_t x_ring = base, a_ring = base + kStages * kXStageBytes;
  const std::uint32_t bars = a_ring + kStages * C::kAStageBytes;
  auto full = [&](int s) { return bars + 8 * s; };
  auto empty = [&](int s) { return bars + 8 * (kStages + s); };
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full(s), 1);
      mbar_init(empty(s), kConsumers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int m0 = static_cast<int>(blockIdx.x) * kBM;
  const int n = p.kblocks;

  if (threadIdx.x >= kConsumers) {  // the TMA warp: one thread fills the ring
    if (threadIdx.x == kConsumers) {
      for (int it = 0; it < n; ++it) {
        const int s = it % kStages;
        mbar_wait(empty(s), ((it / kStages) & 1) ^ 1);
        mbar_arrive_expect_tx(full(s), C::kStageBytes);  // the one arrival the full barrier counts, plus the bytes
        tma_load_2d(&tmap_x, full(s), x_ring + s * kXStageBytes, it * kBK, m0);
        tma_load_2d(&tmap_a, full(s), a_ring + s * C::kAStageBytes, it * kBK, 0);
      }
    }
    return;
  }

  typename C::Mma mma;
  auto thr = mma.get_thread_slice(threadIdx.x);
  const std::uint8_t* generic = smem_raw + (base - smem_addr(smem_raw));
  Tensor sX = make_tensor(make_smem_ptr(reinterpret_cast<const E*>(generic)), typename C::SmemX{});
  Tensor sA = make_tensor(make_smem_ptr(reinterpret_cast<const E*>(generic + kStages * kXStageBytes)),
                          typename C::SmemA{});
  Tensor tCrX = thr.make_fragment_A(thr.partition_A(sX));  // (MMA,1,MMA_K,PIPE) descriptors
  Tensor tCrA = thr.make_fragment_B(thr.partition_B(sA));  // (MMA,1,MMA_K,PIPE) descriptors
  Tensor acc = partition_fragment_C(mma, Shape<Int<kBM>, Int<RB>>{});
  clear(acc);
  mma.accumulate_ = GMMA::ScaleOut::One;
  for (int it = 0; it < n; ++it) {
    const int s = it % kStages;
    mbar_wait(full(s), (it / kStages) & 1);
    warpgroup_fence_operand(acc);
    warpgroup_arrive();
    CUTE_UNROLL
    for (int kk = 0; kk < size<2>(tCrX); ++kk) gemm(mma, tCrX(_, _, kk, s), tCrA(_, _, kk, s), acc);
    warpgroup_commit_batch();
    warpgroup_wait<1>();  // k-block it - 1's wgmmas have retired: its stage is free
    warpgroup_fence_operand(acc);
    if (it > 0) mbar_arrive(empty((it - 1) % kStages));
  }
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc);

  // (row, column) of each accumulator, then s * acc rounded into t.
  Tensor coord = thr.partition_C(make_identity_tensor(Shape<Int<kBM>, Int<RB>>{}));
  E* t = static_cast<E*>(p.t);
  CUTE_UNROLL
  for (int i = 0; i < size(acc); ++i) {
    const std::int64_t row = m0 + get<0>(coord(i));
    if (row < p.m) t[row * RB + get<1>(coord(i))] = static_cast<E>(p.scale * acc(i));
  }
#else
  __trap();  // the launcher never starts this kernel off sm_90
#endif
}

// A row-major [rows, cols] 16-bit tensor as a TMA source of 64-column x box_rows boxes with the
// 128-byte swizzle, zeros outside.
CUtensorMap tensor_map(const char* what, const void* base, bool bf16, std::int64_t rows, std::int64_t cols,
                       int box_rows) {
  CUtensorMap map{};
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols) * 2};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(kBK), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = tensor_map_encoder(kOp)(
      &map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, const_cast<void*>(base), dims,
      strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw Error(kOp, std::string("cuTensorMapEncodeTiled failed for ") + what + " (error " + std::to_string(r) + ")");
  return map;
}

template <class E, int RB>
void launch(const TensorView& x, const TensorView& a, const TensorView& t, float scale, unsigned ctas,
            cudaStream_t s) {
  using C = Cfg<E, RB>;
  const bool bf16 = std::is_same_v<E, cute::bfloat16_t>;
  const std::int64_t m = x.size(0), k = x.size(1);
  const CUtensorMap map_x = tensor_map("x", x.data(), bf16, m, k, kBM);
  const CUtensorMap map_a = tensor_map("a", a.data(), bf16, RB, k, RB);
  const TParams p{t.data(), m, static_cast<int>((k + kBK - 1) / kBK), scale};
  auto kernel = lora_t_kernel<E, RB>;
  FK_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes));
  kernel<<<ctas, kThreads, C::kSmemBytes, s>>>(p, map_x, map_a);
  FK_CUDA_CHECK_LAUNCH("lora_forward (t = s x Aᵀ)");
}

template <class E>
void launch_rank(const TensorView& x, const TensorView& a, const TensorView& t, float scale, unsigned ctas,
                 cudaStream_t s) {
  switch (a.size(0)) {
    case 16: return launch<E, 16>(x, a, t, scale, ctas, s);
    case 32: return launch<E, 32>(x, a, t, scale, ctas, s);
    case 48: return launch<E, 48>(x, a, t, scale, ctas, s);
    default: return launch<E, 64>(x, a, t, scale, ctas, s);
  }
}

}  // namespace

bool lora_lowrank_t(const TensorView& x, const TensorView& a, const TensorView& t, float scale, const Stream* stream) {
  const DType dt = x.dtype();
  if (dt != DType::bf16 && dt != DType::f16) return false;
  const std::int64_t m = x.size(0), k = x.size(1), rb = a.size(0);
  if (rb % 16 != 0 || rb < 16 || rb > 64 || k % 8 != 0 || k == 0) return false;
  if (!aligned16(x.data()) || !aligned16(a.data())) return false;
  const int device = x.device().index;
  if (!is_sm90(device)) return false;
  const std::int64_t ctas = (m + kBM - 1) / kBM;
  if (ctas < multiprocessor_count() / 2 || ctas > 0x7fffffff) return false;  // too few rows to fill the GPU
  const fk::detail::DeviceScope on_device(device);
  const cudaStream_t s = fk::detail::cuda_stream(stream);
  if (dt == DType::bf16) launch_rank<cute::bfloat16_t>(x, a, t, scale, static_cast<unsigned>(ctas), s);
  else launch_rank<cute::half_t>(x, a, t, scale, static_cast<unsigned>(ctas), s);
  return true;
}

}  // namespace fk::cuda
