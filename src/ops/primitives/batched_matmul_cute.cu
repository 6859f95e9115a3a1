// batched_matmul on the GPU (puzzle 11): c[i] = a[i] @ b[i] for every batch i, a [B, M, K] and
// b [B, K, N] row-major, fp32 accumulation, c [B, M, N] overwritten in f32 or the operands' dtype.
// Two implementations. impl=cublas: one cuBLAS strided-batched GEMM, f32/bf16/f16 operands, fp32
// compute (no TF32). impl=cute: fusekit's tensor-core kernels, bf16/f16 operands. On an sm_90 GPU
// the CUTLASS SM90 GEMM of batched_matmul_sm90.cu (TMA + wgmma) runs whenever TMA can take the
// tensors (K, N multiples of 8, a, b, c 16-byte aligned); otherwise, and on every other GPU, the
// SM80-style CuTe kernel below. Each CTA computes one 128x128 tile of one batch's c and walks K in 32-wide slices: a
// 3-stage cp.async pipeline brings the slices of a and b into swizzled shared memory, ldmatrix
// feeds SM80 16x8x16 MMAs (Hopper runs them too), and the epilogue rounds the fp32 accumulators
// to c's dtype and stores them straight from registers. Each element of a is read N/128 times and
// each of b M/128 times (mostly from L2); c is written once and never read. Any M, N, K is taken:
// loads past the matrix edges are zero-filled and stores past them are masked. Loads move 16
// bytes at a time when K % 8 == 0, N % 8 == 0 and a, b are 16-byte aligned, and one element at a
// time (same kernel, same pipeline, several times slower) otherwise. Assumes contiguous tensors, c overlapping neither
// operand, and every dimension at most 2^31 - 257 (checked here).
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include <cute/tensor.hpp>  // first: the atom headers rely on what it includes before them
#include <cute/atom/copy_atom.hpp>
#include <cute/atom/mma_atom.hpp>

#include "fusekit/core/cuda_check.hpp"
#include "fusekit/core/error.hpp"
#include "ops/common/cuda_common.cuh"
#include "primitives_cuda.hpp"

namespace fk::cuda {
namespace {

using namespace cute;
// fk declares Tensor and copy too: these using-declarations make the names here mean CuTe's.
using cute::copy;
using cute::Tensor;

constexpr const char* kOp = "batched_matmul";
// The CuTe kernel's CTA tile (M x N x K) and pipeline depth; see BatchedMatmulTraits.
constexpr int kTileM = 128, kTileN = 128, kTileK = 32, kStages = 3;

// ---------------------------------------------------------------------------------------------
// The CuTe kernel
// ---------------------------------------------------------------------------------------------

template <class Element> struct Sm80Mma;
template <> struct Sm80Mma<cute::bfloat16_t> { using type = SM80_16x8x16_F32BF16BF16F32_TN; };
template <> struct Sm80Mma<cute::half_t> { using type = SM80_16x8x16_F32F16F16F32_TN; };

// Every layout of the kernel, from the tile constants, the operand type and the load path.
// 128x128x32 with 4 warps is the classic SM80 shape: 128 fp32 accumulators a thread, enough MMAs per loaded byte to
// keep the tensor cores busy, and 3 stages of (128x32 + 32x128) bf16 = exactly 48 KB of shared
// memory, the most a block gets without an opt-in.
template <class Element_, bool kVectorized_>
struct BatchedMatmulTraits {
  using Element = Element_;
  static constexpr bool kVectorized = kVectorized_;
  using BlockM = Int<kTileM>;
  using BlockN = Int<kTileN>;
  using BlockK = Int<kTileK>;
  using Stages = Int<kStages>;
  static constexpr int kThreads = 128;

  // 2x2 warps; Tile<_32,_32,_16> gives each warp two 16x8 atoms side by side in N per k-step,
  // so that one ldmatrix.x4 loads a warp's B fragment just as one loads its A fragment.
  using TiledMma = decltype(make_tiled_mma(MMA_Atom<typename Sm80Mma<Element>::type>{},
                                           Layout<Shape<_2, _2, _1>>{}, Tile<_32, _32, _16>{}));
  static_assert(decltype(size(TiledMma{}))::value == kThreads);

  // a in shared memory, K-major: atoms of 8 rows x 32 k (64 bytes a row). The XOR swizzle moves
  // the 16-byte chunk c of row m to c ^ ((m / 2) % 4), so the 8 rows that one ldmatrix phase
  // reads fall in 8 different 16-byte bank groups.
  using SmemLayoutAtomA =
      decltype(composition(Swizzle<2, 3, 3>{}, Layout<Shape<_8, BlockK>, Stride<BlockK, _1>>{}));
  using SmemLayoutA =
      decltype(tile_to_shape(SmemLayoutAtomA{}, make_shape(BlockM{}, BlockK{}, Stages{})));  // (BLK_M,BLK_K,PIPE)
  // b in shared memory, N-major (b is [K, N] row-major): atoms of 64 n (128 bytes) x 8 k, chunk c
  // of row k moved to c ^ (k % 8), for the transposing ldmatrix that reads 8 k-rows at one n.
  using SmemLayoutAtomB =
      decltype(composition(Swizzle<3, 3, 3>{}, Layout<Shape<_64, _8>, Stride<_1, _64>>{}));
  using SmemLayoutB =
      decltype(tile_to_shape(SmemLayoutAtomB{}, make_shape(BlockN{}, BlockK{}, Stages{})));  // (BLK_N,BLK_K,PIPE)
  static constexpr int kSmemBytes =
      int(cosize(SmemLayoutA{}) + cosize(SmemLayoutB{})) * int(sizeof(Element));
  static_assert(kSmemBytes <= 48 * 1024, "more than 48 KB of shared memory needs cudaFuncSetAttribute");

  // global -> shared. Vectorized: one 16-byte cp.async per 8 elements along the contiguous
  // dimension, a 32x32 (a) or 128x8 (b) block per pass. Element path: one 2-byte load per element
  // through registers, each warp reading 32 consecutive elements of one row.
  using GmemCopyA = std::conditional_t<
      kVectorized,
      decltype(make_tiled_copy(Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL<uint128_t>, Element>{},
                               Layout<Shape<_32, _4>, Stride<_4, _1>>{},   // threads (m, k-chunk)
                               Layout<Shape<_1, _8>>{})),                  // 8 k a thread
      decltype(make_tiled_copy(Copy_Atom<UniversalCopy<Element>, Element>{},
                               Layout<Shape<_4, _32>, Stride<_32, _1>>{},  // threads (m, k)
                               Layout<Shape<_1, _1>>{}))>;
  using GmemCopyB = std::conditional_t<
      kVectorized,
      decltype(make_tiled_copy(Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL<uint128_t>, Element>{},
                               Layout<Shape<_16, _8>, Stride<_1, _16>>{},  // threads (n-chunk, k)
                               Layout<Shape<_8, _1>>{})),                  // 8 n a thread
      decltype(make_tiled_copy(Copy_Atom<UniversalCopy<Element>, Element>{},
                               Layout<Shape<_32, _4>, Stride<_1, _32>>{},  // threads (n, k)
                               Layout<Shape<_1, _1>>{}))>;

  // shared -> registers: ldmatrix, transposing for the N-major b.
  using SmemCopyAtomA = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomB = Copy_Atom<SM75_U16x8_LDSM_T, Element>;
};

struct GemmArgs {
  const void* a;  // (B,M,K) row-major
  const void* b;  // (B,K,N) row-major
  void* c;        // (B,M,N) row-major, f32 or the operand dtype
  int batch, m, n, k;
  bool c_is_f32;
};

// Rounds one CTA's accumulators to ElementC and stores those inside the (M,N) matrix.
template <class ElementC, class Accumulators, class ThrMma, class CtaTiler>
__device__ void store_tile(const Accumulators& acc, const ThrMma& thr_mma, const GemmArgs& args, int batch,
                           CtaTiler cta_tiler) {
  ElementC* c = static_cast<ElementC*>(args.c) + std::int64_t(batch) * args.m * args.n;
  Tensor mC = make_tensor(make_gmem_ptr(c), make_shape(args.m, args.n),
                          make_stride(std::int64_t(args.n), _1{}));                  // (M,N)
  const auto cta_coord = make_coord(int(blockIdx.x), int(blockIdx.y), _);
  Tensor gC = local_tile(mC, cta_tiler, cta_coord, Step<_1, _1, X>{});               // (BLK_M,BLK_N)
  Tensor cC = local_tile(make_identity_tensor(shape(mC)), cta_tiler, cta_coord,
                         Step<_1, _1, X>{});                                        // (BLK_M,BLK_N) -> (m,n)
  Tensor tCgC = thr_mma.partition_C(gC);                                             // (MMA,MMA_M,MMA_N)
  Tensor tCcC = thr_mma.partition_C(cC);                                             // (MMA,MMA_M,MMA_N) -> (m,n)
  CUTE_UNROLL
  for (int i = 0; i < size(acc); ++i)
    if (get<0>(tCcC(i)) < args.m && get<1>(tCcC(i)) < args.n) tCgC(i) = static_cast<ElementC>(acc(i));
}

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads) batched_matmul_cute_kernel(GemmArgs args) {
  using Element = typename Traits::Element;
  using BlockM = typename Traits::BlockM;
  using BlockN = typename Traits::BlockN;
  using BlockK = typename Traits::BlockK;

  extern __shared__ __align__(128) unsigned char smem[];
  Element* smem_a = reinterpret_cast<Element*>(smem);
  Element* smem_b = smem_a + cosize(typename Traits::SmemLayoutA{});
  Tensor sA = make_tensor(make_smem_ptr(smem_a), typename Traits::SmemLayoutA{});  // (BLK_M,BLK_K,PIPE)
  Tensor sB = make_tensor(make_smem_ptr(smem_b), typename Traits::SmemLayoutB{});  // (BLK_N,BLK_K,PIPE)

  typename Traits::GmemCopyA gmem_copy_a;
  typename Traits::GmemCopyB gmem_copy_b;
  auto gmem_thr_a = gmem_copy_a.get_slice(threadIdx.x);
  auto gmem_thr_b = gmem_copy_b.get_slice(threadIdx.x);
  Tensor tAsA = gmem_thr_a.partition_D(sA);  // (ACPY,ACPY_M,ACPY_K,PIPE)
  Tensor tBsB = gmem_thr_b.partition_D(sB);  // (BCPY,BCPY_N,BCPY_K,PIPE)

  typename Traits::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_slice(threadIdx.x);
  Tensor tCrA = thr_mma.partition_fragment_A(sA(_, _, 0));                  // (MMA,MMA_M,MMA_K)
  Tensor tCrB = thr_mma.partition_fragment_B(sB(_, _, 0));                  // (MMA,MMA_N,MMA_K)
  Tensor acc = partition_fragment_C(tiled_mma, Shape<BlockM, BlockN>{});    // (MMA,MMA_M,MMA_N) fp32

  auto smem_copy_a = make_tiled_copy_A(typename Traits::SmemCopyAtomA{}, tiled_mma);
  auto smem_copy_b = make_tiled_copy_B(typename Traits::SmemCopyAtomB{}, tiled_mma);
  auto smem_thr_a = smem_copy_a.get_slice(threadIdx.x);
  auto smem_thr_b = smem_copy_b.get_slice(threadIdx.x);
  Tensor tXsA = smem_thr_a.partition_S(sA);  // (CPY,CPY_M,CPY_K,PIPE)
  Tensor tXrA = smem_thr_a.retile_D(tCrA);   // (CPY,CPY_M,CPY_K)
  Tensor tXsB = smem_thr_b.partition_S(sB);  // (CPY,CPY_N,CPY_K,PIPE)
  Tensor tXrB = smem_thr_b.retile_D(tCrB);   // (CPY,CPY_N,CPY_K)
  static_assert(decltype(size<2>(tXsA))::value == decltype(size<2>(tCrA))::value);
  static_assert(decltype(size<2>(tXsB))::value == decltype(size<2>(tCrB))::value);

  const auto cta_tiler = Shape<BlockM, BlockN, BlockK>{};
  const auto cta_coord = make_coord(int(blockIdx.x), int(blockIdx.y), _);
  const int k_tiles = args.k / BlockK::value + (args.k % BlockK::value != 0);

  // gridDim.z is capped at 65535, so a CTA may own the same tile of several batches.
  for (int batch = blockIdx.z; batch < args.batch; batch += gridDim.z) {
    const Element* a = static_cast<const Element*>(args.a) + std::int64_t(batch) * args.m * args.k;
    const Element* b = static_cast<const Element*>(args.b) + std::int64_t(batch) * args.k * args.n;
    Tensor mA = make_tensor(make_gmem_ptr(a), make_shape(args.m, args.k),
                            make_stride(std::int64_t(args.k), _1{}));                   // (M,K)
    Tensor mB = make_tensor(make_gmem_ptr(b), make_shape(args.n, args.k),
                            make_stride(_1{}, std::int64_t(args.n)));                   // (N,K)
    Tensor gA = local_tile(mA, cta_tiler, cta_coord, Step<_1, X, _1>{});                // (BLK_M,BLK_K,k)
    Tensor gB = local_tile(mB, cta_tiler, cta_coord, Step<X, _1, _1>{});                // (BLK_N,BLK_K,k)
    Tensor cA = local_tile(make_identity_tensor(shape(mA)), cta_tiler, cta_coord,
                           Step<_1, X, _1>{});                                         // (BLK_M,BLK_K,k) -> (m,k)
    Tensor cB = local_tile(make_identity_tensor(shape(mB)), cta_tiler, cta_coord,
                           Step<X, _1, _1>{});                                         // (BLK_N,BLK_K,k) -> (n,k)
    Tensor tAgA = gmem_thr_a.partition_S(gA);  // (ACPY,ACPY_M,ACPY_K,k)
    Tensor tAcA = gmem_thr_a.partition_S(cA);  // (ACPY,ACPY_M,ACPY_K,k) -> (m,k)
    Tensor tBgB = gmem_thr_b.partition_S(gB);  // (BCPY,BCPY_N,BCPY_K,k)
    Tensor tBcB = gmem_thr_b.partition_S(cB);  // (BCPY,BCPY_N,BCPY_K,k) -> (n,k)

    // Starts loading k-tile kt into pipeline stage `stage`. A copy vector (8 elements along the
    // contiguous dimension, or 1) lies wholly inside or wholly outside the matrix, since K or N
    // is a multiple of 8 on the vectorized path, so its first element decides; vectors outside
    // become zeros, which add nothing to the dot products.
    auto load_tile = [&](int kt, int stage) {
      CUTE_UNROLL
      for (int i = 0; i < size<1>(tAsA); ++i) {
        CUTE_UNROLL
        for (int j = 0; j < size<2>(tAsA); ++j) {
          const auto mk = tAcA(0, i, j, kt);
          if (get<0>(mk) < args.m && get<1>(mk) < args.k)
            copy(gmem_copy_a, tAgA(_, i, j, kt), tAsA(_, i, j, stage));
          else
            clear(tAsA(_, i, j, stage));
        }
      }
      CUTE_UNROLL
      for (int i = 0; i < size<1>(tBsB); ++i) {
        CUTE_UNROLL
        for (int j = 0; j < size<2>(tBsB); ++j) {
          const auto nk = tBcB(0, i, j, kt);
          if (get<0>(nk) < args.n && get<1>(nk) < args.k)
            copy(gmem_copy_b, tBgB(_, i, j, kt), tBsB(_, i, j, stage));
          else
            clear(tBsB(_, i, j, stage));
        }
      }
    };

    clear(acc);
    // One commit group per k-tile, empty ones included, so that "k-tile kt has landed" is always
    // "all but the newest kStages-2 groups are complete".
    CUTE_UNROLL
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < k_tiles) load_tile(s, s);
      cp_async_fence();
    }
    for (int kt = 0; kt < k_tiles; ++kt) {
      cp_async_wait<kStages - 2>();  // this thread's copies of k-tile kt have landed
      __syncthreads();               // everyone's have, and everyone is done with k-tile kt-1
      const int next = kt + kStages - 1;
      if (next < k_tiles) load_tile(next, next % kStages);  // into the stage k-tile kt-1 used
      cp_async_fence();

      const int stage = kt % kStages;
      CUTE_UNROLL
      for (int kb = 0; kb < size<2>(tCrA); ++kb) {
        copy(smem_copy_a, tXsA(_, _, kb, stage), tXrA(_, _, kb));
        copy(smem_copy_b, tXsB(_, _, kb, stage), tXrB(_, _, kb));
        gemm(tiled_mma, acc, tCrA(_, _, kb), tCrB(_, _, kb), acc);
      }
    }

    if (args.c_is_f32)
      store_tile<float>(acc, thr_mma, args, batch, cta_tiler);
    else
      store_tile<Element>(acc, thr_mma, args, batch, cta_tiler);
    // The next batch's prologue refills stages that slower warps may still be reading.
    __syncthreads();
  }
}

template <class Element, bool kVectorized>
void launch_cute(const GemmArgs& args, cudaStream_t stream) {
  using Traits = BatchedMatmulTraits<Element, kVectorized>;
  const auto tiles = [](int extent, int tile) { return static_cast<unsigned>((std::int64_t(extent) + tile - 1) / tile); };
  const dim3 grid(tiles(args.m, kTileM), tiles(args.n, kTileN), static_cast<unsigned>(std::min(args.batch, 65535)));
  batched_matmul_cute_kernel<Traits><<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(args);
  FK_CUDA_CHECK_LAUNCH("batched_matmul_cute_kernel");
}

// ---------------------------------------------------------------------------------------------
// Host side
// ---------------------------------------------------------------------------------------------

// The kernels index within one matrix in int; the CuTe kernel's coordinates reach one tile past
// a dimension's end, hence the margin below 2^31.
constexpr std::int64_t kMaxDim = INT_MAX - 256;

GemmArgs make_args(const TensorView& a, const TensorView& b, const TensorView& c) {
  const std::int64_t batch = a.size(0), m = a.size(1), k = a.size(2), n = b.size(2);
  FK_CHECK_ARG(batch <= kMaxDim && m <= kMaxDim && k <= kMaxDim, kOp, "a",
               "every dimension at most 2^31 - 257 on CUDA", a.shape().str());
  FK_CHECK_ARG(n <= kMaxDim, kOp, "b", "every dimension at most 2^31 - 257 on CUDA", b.shape().str());
  return GemmArgs{a.data(), b.data(), c.data(), int(batch), int(m), int(n), int(k), c.dtype() == DType::f32};
}

}  // namespace

void batched_matmul_cute(const TensorView& a, const TensorView& b, const TensorView& c, const Stream* stream) {
  const int device = a.device().index;
  fk::detail::DeviceScope on_device(device);
  int major = 0, minor = 0;
  FK_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  FK_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  FK_CHECK_ARG(major >= 8, kOp, "impl", "cublas on GPUs before sm_80 (the CuTe kernel uses SM80 MMA)",
               "cute on sm_" + std::to_string(major * 10 + minor));

  const GemmArgs args = make_args(a, b, c);
  if (batched_matmul_sm90(a, b, c, stream)) return;

  constexpr int kMaxGridY = 65535;  // the grid's y dimension counts column tiles
  FK_CHECK_ARG(args.n <= std::int64_t(kMaxGridY) * kTileN, kOp, "b",
               "at most " + std::to_string(kMaxGridY * kTileN) + " columns with impl=cute", b.shape().str());
  const bool vectorized = args.k % 8 == 0 && args.n % 8 == 0 && aligned16(args.a) && aligned16(args.b);
  const cudaStream_t s = fk::detail::cuda_stream(stream);
  switch (a.dtype()) {
    case DType::bf16:
      return vectorized ? launch_cute<cute::bfloat16_t, true>(args, s) : launch_cute<cute::bfloat16_t, false>(args, s);
    case DType::f16:
      return vectorized ? launch_cute<cute::half_t, true>(args, s) : launch_cute<cute::half_t, false>(args, s);
    default: throw_internal("batched_matmul_cute: dtype not checked by the caller");
  }
}

}  // namespace fk::cuda
