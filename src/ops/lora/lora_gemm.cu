// The fused LoRA GEMM on Hopper: z = lhs · op(rhs) + bias + L Rᵀ on the tensor cores, with the
// rank-r term L Rᵀ (r <= 64) added to the fp32 accumulators in the epilogue, then act(z) stored.
// Forward: lhs = x, rhs = W [N, K], L = t = s x Aᵀ [M, r], R = B [N, r]. Backward (dx): lhs = g
// [M, N], rhs = W used as [K_g, N_out], L = s u [M, r], R = Aᵀ.
//
// Mainloop: CUTLASS 3's SM90 TMA warp-specialized ping-pong GEMM, 128 x 128 tiles, clusters of 2
// along N sharing the lhs tile by multicast (glu_gemm.cu measured this configuration at 0.97-0.98x
// the cuBLAS GEMM alone for large problems). Both operands are read once per tile by TMA; L and
// R are small (t: 256 KiB at M = 8192, r = 16) and come from L2.
//
// Epilogue (LoraEpilogue, CUTLASS's no-shared-memory epilogue interface). A wgmma accumulator
// fragment is, per warp, a stack of m16n8 tiles laid out exactly like the C fragment of
// mma.sync.m16n8k16: lane (g = lane / 4, q = lane % 4) holds (row g, cols 2q, 2q + 1) and
// (row g + 8, same cols) of every 8-column chunk. So each warp adds its slice of L Rᵀ with
// ceil(r / 16) mma.sync per chunk straight onto the accumulators: the A fragment is rows of L,
// the B fragment rows of R, both loaded from global memory (zero outside the problem and past
// r). Then bias, activation and one 2-element store per (row, chunk); z is also stored when the
// caller keeps it. Nothing of shape [M, N] besides the output is read or written.
#include <cuda_runtime.h>

#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/detail.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/kernel_hardware_info.h>

#include "fusekit/core/cuda_check.hpp"
#include "fusekit/core/error.hpp"
#include "fusekit/core/tensor.hpp"
#include "lora_cuda.hpp"
#include "ops/cuda_common.cuh"
#include "ops/pointwise/activations.cuh"

namespace fk::cuda {
namespace {

template <class Element>
class LoraEpilogue {
 public:
  using EpilogueSchedule = cutlass::epilogue::NoSmemWarpSpecialized;
  using DispatchPolicy = EpilogueSchedule;
  using ElementC = Element;
  using ElementD = Element;
  using ElementOutput = Element;
  using ElementAccumulator = float;
  using ElementCompute = float;
  using ElementScalar = float;
  using StrideC = cute::Stride<int64_t, cute::Int<1>, int64_t>;
  using StrideD = StrideC;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;

  struct SharedStorage {};
  using TensorStorage = SharedStorage;
  struct ThreadEpilogueOp {  // what GemmUniversalAdapter looks up; the epilogue's work is below
    using ElementOutput = Element;
    using ElementAccumulator = float;
    using ElementCompute = float;
  };

  struct Arguments {
    const Element* left = nullptr;   // L [M, r], row-major
    const Element* right = nullptr;  // R(n, j) at right[n * ld_n + j * ld_j]
    int64_t ld_n = 0, ld_j = 0;
    int rank = 0;
    const Element* bias = nullptr;   // [N] or null
    Element* out = nullptr;          // [M, N]
    Element* preact = nullptr;       // [M, N] or null
    Activation act = Activation::identity;
    bool pairs = false;              // N even and out, preact 4-byte aligned: 2-element stores
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    return args.out != nullptr && args.rank >= 0 && args.rank <= 64;
  }

  CUTLASS_HOST_DEVICE explicit LoraEpilogue(Params const& params, SharedStorage const& = SharedStorage())
      : params_(params) {}

  CUTLASS_DEVICE bool is_source_needed() { return false; }

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_mnk,
                                 BlockCoordMNKL blk_coord_mnkl, cute::Tensor<FrgEngine, FrgLayout> acc,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
    using namespace cute;
    const int m_total = static_cast<int>(get<0>(problem_shape_mnkl));
    const int n_total = static_cast<int>(get<1>(problem_shape_mnkl));
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord_mnkl;
    // The (m, n) coordinate of every accumulator this thread holds.
    cute::Tensor coords = local_tile(make_identity_tensor(make_shape(m_total, n_total)), take<0, 2>(blk_shape_mnk),
                                     make_coord(m_coord, n_coord));  // (BLK_M, BLK_N)
    cute::Tensor t_coords = tiled_mma.get_thread_slice(thread_idx).partition_C(coords);  // (MMA, MMA_M, MMA_N)
    static_assert(is_static<FrgLayout>::value, "lora epilogue: the accumulator layout must be static");
    static_assert(decltype(size(acc))::value % 4 == 0, "lora epilogue: accumulators come in m16n8 quads");
    CUTE_STATIC_ASSERT_V(size(t_coords) == size(acc));

    add_low_rank(acc, t_coords, m_total, n_total);
    switch (params_.act) {
      case Activation::identity: return store<Activation::identity>(acc, t_coords, m_total, n_total);
      case Activation::relu: return store<Activation::relu>(acc, t_coords, m_total, n_total);
      case Activation::sigmoid: return store<Activation::sigmoid>(acc, t_coords, m_total, n_total);
      case Activation::tanh: return store<Activation::tanh>(acc, t_coords, m_total, n_total);
      case Activation::gelu_tanh: return store<Activation::gelu_tanh>(acc, t_coords, m_total, n_total);
      case Activation::gelu_erf: return store<Activation::gelu_erf>(acc, t_coords, m_total, n_total);
      case Activation::silu: return store<Activation::silu>(acc, t_coords, m_total, n_total);
    }
  }

 private:
  CUTLASS_DEVICE static uint32_t bits(const Element* p, int64_t i, bool ok) {
    return ok ? static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) : 0u;
  }

  // acc += L Rᵀ. Accumulators 4i .. 4i + 3 are one m16n8 C fragment of this thread's warp:
  // (row, col), (row, col + 1), (row + 8, col), (row + 8, col + 1), with row = 16w' + g and
  // col = 8c + 2q inside the tile.
  template <class Acc, class Coords>
  CUTLASS_DEVICE void add_low_rank(Acc& acc, Coords const& t_coords, int m_total, int n_total) {
    constexpr int kQuads = decltype(cute::size(acc))::value / 4;
    const Element* left = params_.left;
    const Element* right = params_.right;
    const int rank = params_.rank;
    if (rank == 0) return;
    for (int kb = 0; kb < rank; kb += 16) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kQuads; ++i) {
        const int m = cute::get<0>(t_coords(4 * i));   // row g of the fragment
        const int n = cute::get<1>(t_coords(4 * i));   // col 2q of the fragment
        const int q = (n & 7) >> 1, g = m & 7;
        const int nb = (n & ~7) + g;                   // the column of R this lane feeds: chunk + g
        const int j0 = kb + 2 * q, j1 = j0 + 8;
        // A fragment (L rows m, m + 8; k = j0, j0 + 1, j1, j1 + 1).
        const int64_t r0 = static_cast<int64_t>(m) * rank, r8 = static_cast<int64_t>(m + 8) * rank;
        const bool m0ok = m < m_total, m8ok = m + 8 < m_total;
        uint32_t a[4];
        a[0] = bits(left, r0 + j0, m0ok && j0 < rank) | bits(left, r0 + j0 + 1, m0ok && j0 + 1 < rank) << 16;
        a[1] = bits(left, r8 + j0, m8ok && j0 < rank) | bits(left, r8 + j0 + 1, m8ok && j0 + 1 < rank) << 16;
        a[2] = bits(left, r0 + j1, m0ok && j1 < rank) | bits(left, r0 + j1 + 1, m0ok && j1 + 1 < rank) << 16;
        a[3] = bits(left, r8 + j1, m8ok && j1 < rank) | bits(left, r8 + j1 + 1, m8ok && j1 + 1 < rank) << 16;
        // B fragment (k = j0, j0 + 1 and j1, j1 + 1; column nb).
        const bool nok = nb < n_total;
        const int64_t rn = static_cast<int64_t>(nb) * params_.ld_n;
        const int64_t lj = params_.ld_j;
        uint32_t b[2];
        b[0] = bits(right, rn + j0 * lj, nok && j0 < rank) | bits(right, rn + (j0 + 1) * lj, nok && j0 + 1 < rank) << 16;
        b[1] = bits(right, rn + j1 * lj, nok && j1 < rank) | bits(right, rn + (j1 + 1) * lj, nok && j1 + 1 < rank) << 16;
        float& c0 = acc(4 * i);
        float& c1 = acc(4 * i + 1);
        float& c2 = acc(4 * i + 2);
        float& c3 = acc(4 * i + 3);
        if constexpr (cute::is_same_v<Element, cutlass::bfloat16_t>) {
          asm volatile(
              "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
              "{%0, %1, %2, %3};\n"
              : "+f"(c0), "+f"(c1), "+f"(c2), "+f"(c3)
              : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
        } else {
          asm volatile(
              "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
              "{%0, %1, %2, %3};\n"
              : "+f"(c0), "+f"(c1), "+f"(c2), "+f"(c3)
              : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
        }
      }
    }
  }

  CUTLASS_DEVICE void put(Element* base, int64_t i, float v0, float v1, bool both, bool pairs) {
    if (pairs && both) {
      cutlass::Array<Element, 2> p;
      p[0] = Element(v0);
      p[1] = Element(v1);
      *reinterpret_cast<cutlass::Array<Element, 2>*>(base + i) = p;
    } else {
      base[i] = Element(v0);
      if (both) base[i + 1] = Element(v1);
    }
  }

  template <Activation A, class Acc, class Coords>
  CUTLASS_DEVICE void store(Acc const& acc, Coords const& t_coords, int m_total, int n_total) {
    constexpr int kPairs = decltype(cute::size(acc))::value / 2;
    const bool pairs = params_.pairs;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kPairs; ++i) {
      const int m = cute::get<0>(t_coords(2 * i));
      const int n = cute::get<1>(t_coords(2 * i));
      if (m >= m_total || n >= n_total) continue;
      const bool both = n + 1 < n_total;
      float z0 = acc(2 * i), z1 = acc(2 * i + 1);
      if (params_.bias != nullptr) {
        z0 += static_cast<float>(params_.bias[n]);
        if (both) z1 += static_cast<float>(params_.bias[n + 1]);
      }
      const int64_t at = static_cast<int64_t>(m) * n_total + n;
      if (params_.preact != nullptr) put(params_.preact, at, z0, z1, both, pairs);
      put(params_.out, at, fk::device::activation<A>(z0), fk::device::activation<A>(z1), both, pairs);
    }
  }

  Params params_;
};

// RhsNByK: rhs is [N, Kg] (K-major, the forward); else [Kg, N] (N-major, the backward's dx).
template <class Element, bool RhsNByK>
struct LoraGemmConfig {
  using TileShape = cute::Shape<cute::_128, cute::_128, cute::_64>;
  using ClusterShape = cute::Shape<cute::_1, cute::_2, cute::_1>;
  using Epilogue = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<LoraEpilogue<Element>>;
  static constexpr int kAlignment = 16 / sizeof(Element);
  using LayoutB = cute::conditional_t<RhsNByK, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, kAlignment, Element,
      LayoutB, kAlignment, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedPingpong>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

template <class Element, bool RhsNByK>
void run_fused(const LoraGemmArgs& a, const Stream* stream) {
  using Gemm = typename LoraGemmConfig<Element, RhsNByK>::Gemm;
  const int m = static_cast<int>(a.lhs.size(0)), kg = static_cast<int>(a.lhs.size(1));
  const int n = static_cast<int>(a.out.size(1));
  using StrideA = typename Gemm::GemmKernel::StrideA;
  using StrideB = typename Gemm::GemmKernel::StrideB;
  const StrideA stride_a = cute::make_stride(int64_t{kg}, cute::Int<1>{}, int64_t{m} * kg);
  StrideB stride_b;
  if constexpr (RhsNByK) stride_b = cute::make_stride(int64_t{kg}, cute::Int<1>{}, int64_t{n} * kg);
  else stride_b = cute::make_stride(cute::Int<1>{}, int64_t{n}, int64_t{n} * kg);
  cutlass::KernelHardwareInfo hw;
  hw.device_id = a.out.device().index;
  hw.sm_count = multiprocessor_count();
  const bool pairs = n % 2 == 0 && reinterpret_cast<std::uintptr_t>(a.out.data()) % 4 == 0 &&
                     (a.preact == nullptr || reinterpret_cast<std::uintptr_t>(a.preact->data()) % 4 == 0);
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {m, n, kg, 1},
      {static_cast<const Element*>(a.lhs.data()), stride_a, static_cast<const Element*>(a.rhs.data()), stride_b},
      {static_cast<const Element*>(a.lowrank_left.data()), static_cast<const Element*>(a.lowrank_right), a.ld_n,
       a.ld_j, static_cast<int>(a.rank), a.bias ? static_cast<const Element*>(a.bias->data()) : nullptr,
       static_cast<Element*>(a.out.data()), a.preact ? static_cast<Element*>(a.preact->data()) : nullptr, a.act,
       pairs},
      hw};
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess)
    throw_internal("lora: the fused GEMM rejected a shape the dispatch accepted");
  const std::size_t ws_bytes = Gemm::get_workspace_size(args);
  Tensor workspace;
  if (ws_bytes > 0)
    workspace = Tensor::empty({static_cast<std::int64_t>(ws_bytes)}, DType::u8, a.out.device(), stream);
  const cudaStream_t s = fk::detail::cuda_stream(stream);
  if (gemm.initialize(args, ws_bytes > 0 ? workspace.data() : nullptr, s) != cutlass::Status::kSuccess)
    throw_internal("lora: initializing the fused GEMM failed");
  if (gemm.run(s) != cutlass::Status::kSuccess) throw_internal("lora: launching the fused GEMM failed");
  FK_CUDA_CHECK_LAUNCH("lora (fused GEMM)");
}

bool is_hopper(int device) {
  int major = 0, minor = 0;
  FK_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  FK_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  return major == 9 && minor == 0;
}

template <class Element>
void run_layout(const LoraGemmArgs& a, const Stream* stream) {
  if (a.rhs_is_n_by_k) run_fused<Element, true>(a, stream);
  else run_fused<Element, false>(a, stream);
}

}  // namespace

bool lora_gemm_fused(const LoraGemmArgs& a, const Stream* stream) {
  const DType t = a.lhs.dtype();
  if (t != DType::bf16 && t != DType::f16) return false;
  const std::int64_t m = a.lhs.size(0), kg = a.lhs.size(1), n = a.out.size(1);
  if (kg % 8 != 0 || n % 8 != 0 || kg == 0 || m == 0 || n == 0) return false;  // TMA: 16-byte rows
  if (m > INT32_MAX / 2 || n > INT32_MAX / 2 || kg > INT32_MAX / 2 || a.rank > 64) return false;
  if (!aligned16(a.lhs.data()) || !aligned16(a.rhs.data())) return false;
  const fk::detail::DeviceScope on_device(a.out.device().index);
  if (!is_hopper(a.out.device().index)) return false;
  if (t == DType::bf16) run_layout<cutlass::bfloat16_t>(a, stream);
  else run_layout<cutlass::half_t>(a, stream);
  return true;
}

}  // namespace fk::cuda
