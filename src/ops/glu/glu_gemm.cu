// The fused GLU GEMM on Hopper: C = x wᵀ (+ b) on the tensor cores, the gated activation applied
// to the accumulators in registers, C never written.
//
// Mainloop: CUTLASS 3's SM90 TMA warp-specialized cooperative GEMM (the collective builder's
// choice of swizzles, stage count and persistent tile scheduler): x is the K-major A operand
// [M, K], the prepared w the K-major B operand [2N, K] ("TN", the tensor cores' native layout), a
// CTA tile of 128 x 256 outputs with two consumer warpgroups, clusters of 2 along M sharing the w
// tile by TMA multicast.
//
// Epilogue (GluEpilogue below, in CUTLASS's no-shared-memory epilogue interface): a wgmma
// accumulator fragment holds, for every row a thread owns, columns in adjacent pairs (2j, 2j + 1).
// In the prepared layout those are L[m, j] and R[m, j], so each thread computes glu(l + b, r + b')
// from two of its own registers and stores one value: no shuffles, no shared memory, no [M, 2N]
// anything. The backward variant recomputes the same accumulators, reads dy[m, j] and stores the
// pair (dy dglu/dl, dy dglu/dr) to dC[m, 2j .. 2j + 1] with one 2-element store. The kind is a
// runtime argument dispatched once per tile (the branch is uniform), which keeps one kernel per
// dtype and direction instead of one per kind.
//
// f32 operands run as TF32 (the builder maps float to tfloat32_t: wgmma reads the top 19 bits).
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <string_view>
#include <type_traits>

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
#include "glu_cuda.hpp"
#include "glu_math.cuh"
#include "ops/cuda_common.cuh"

namespace fk::cuda {
namespace {

// The epilogue. Arguments: the prepared bias (or null), the output (out [M, N] forward, dC
// [M, 2N] backward), dy [M, N] (backward only, else null), the kind.
template <class Element>
class GluEpilogue {
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
    const Element* bias = nullptr;
    Element* out = nullptr;
    const Element* dy = nullptr;
    GluKind kind = GluKind::swiglu;
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
    return args.out != nullptr;
  }

  CUTLASS_HOST_DEVICE explicit GluEpilogue(Params const& params, SharedStorage const& = SharedStorage())
      : params_(params) {}

  CUTLASS_DEVICE bool is_source_needed() { return false; }

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_mnk,
                                 BlockCoordMNKL blk_coord_mnkl, cute::Tensor<FrgEngine, FrgLayout> const& acc,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
    using namespace cute;
    const int m_total = static_cast<int>(get<0>(problem_shape_mnkl));
    const int n2_total = static_cast<int>(get<1>(problem_shape_mnkl));  // 2N, even
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord_mnkl;
    // The (m, n) coordinate of every accumulator this thread holds.
    cute::Tensor coords = local_tile(make_identity_tensor(make_shape(m_total, n2_total)), take<0, 2>(blk_shape_mnk),
                               make_coord(m_coord, n_coord));
    cute::Tensor t_coords = tiled_mma.get_thread_slice(thread_idx).partition_C(coords);
    static_assert(is_static<FrgLayout>::value, "glu epilogue: the accumulator layout must be static");
    CUTE_STATIC_ASSERT_V(size(t_coords) == size(acc));

    switch (params_.kind) {
      case GluKind::sigmoid_tanh: return dispatch<GluKind::sigmoid_tanh>(acc, t_coords, m_total, n2_total);
      case GluKind::swiglu: return dispatch<GluKind::swiglu>(acc, t_coords, m_total, n2_total);
      case GluKind::geglu_tanh: return dispatch<GluKind::geglu_tanh>(acc, t_coords, m_total, n2_total);
      case GluKind::geglu_erf: return dispatch<GluKind::geglu_erf>(acc, t_coords, m_total, n2_total);
      case GluKind::reglu: return dispatch<GluKind::reglu>(acc, t_coords, m_total, n2_total);
    }
  }

 private:
  template <GluKind K, class Acc, class Coords>
  CUTLASS_DEVICE void dispatch(Acc const& acc, Coords const& t_coords, int m_total, int n2_total) {
    // One straight-line loop per direction: the branch stays outside the unrolled code.
    if (params_.dy == nullptr) apply<K, false>(acc, t_coords, m_total, n2_total);
    else apply<K, true>(acc, t_coords, m_total, n2_total);
  }

  template <GluKind K, bool Backward, class Acc, class Coords>
  CUTLASS_DEVICE void apply(Acc const& acc, Coords const& t_coords, int m_total, int n2_total) {
    const int n_total = n2_total / 2;
    const Element* bias = params_.bias;
    Element* out = params_.out;
    const Element* dy = params_.dy;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < cute::size(acc); i += 2) {
      // Even i and i + 1 are the columns 2j and 2j + 1 of one row: (L[m, j], R[m, j]).
      const int m = cute::get<0>(t_coords(i)), n = cute::get<1>(t_coords(i));
      if (m >= m_total || n >= n2_total) continue;
      float l = acc(i), r = acc(i + 1);
      if (bias != nullptr) {
        l += static_cast<float>(bias[n]);
        r += static_cast<float>(bias[n + 1]);
      }
      const int j = n / 2;
      if constexpr (!Backward) {
        out[static_cast<int64_t>(m) * n_total + j] = Element(fk::device::glu<K, true>(l, r));
      } else {
        float dl, dr;
        fk::device::glu_grad<K, true>(l, r, static_cast<float>(dy[static_cast<int64_t>(m) * n_total + j]), dl, dr);
        cutlass::Array<Element, 2> pair;
        pair[0] = Element(dl);
        pair[1] = Element(dr);
        *reinterpret_cast<cutlass::Array<Element, 2>*>(out + static_cast<int64_t>(m) * n2_total + n) = pair;
      }
    }
  }

  Params params_;
};

// Experiment configurations (tile M, tile N, cluster M, cluster N, pingpong).
template <int TM, int TN, int CM, int CN, bool PP>
struct Cfg {};
using Cooperative = Cfg<128, 256, 2, 1, false>;

template <class Element, class C>
struct GluGemmConfig;
template <class Element, int TM, int TN, int CM, int CN, bool PP>
struct GluGemmConfig<Element, Cfg<TM, TN, CM, CN, PP>> {
  // 64-deep k-blocks of 16-bit operands, 32-deep of TF32: 128-byte rows either way.
  static constexpr int kBlockK = sizeof(Element) == 2 ? 64 : 32;
  using TileShape = cute::Shape<cute::Int<TM>, cute::Int<TN>, cute::Int<kBlockK>>;
  using ClusterShape = cute::Shape<cute::Int<CM>, cute::Int<CN>, cute::_1>;
  using Epilogue = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<GluEpilogue<Element>>;
  static constexpr int kAlignment = 16 / sizeof(Element);
  using KernelSchedule = cute::conditional_t<!PP, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                                             cutlass::gemm::KernelTmaWarpSpecializedPingpong>;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, kAlignment, Element,
      cutlass::layout::ColumnMajor, kAlignment, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

template <class Element, class Schedule>
void run_fused(const TensorView& x, const TensorView& w, const TensorView* bias, const TensorView* dy,
               const TensorView& out, GluKind kind, const Stream* stream) {
  using Config = GluGemmConfig<Element, Schedule>;
  using Gemm = typename Config::Gemm;
  const int m = static_cast<int>(x.size(0)), k = static_cast<int>(x.size(1)), n2 = static_cast<int>(w.size(0));
  // Both operands K-major: (row stride, 1, batch stride).
  using StrideA = typename Gemm::GemmKernel::StrideA;
  using StrideB = typename Gemm::GemmKernel::StrideB;
  static_assert(cute::is_same_v<StrideA, cute::Stride<int64_t, cute::Int<1>, int64_t>> &&
                cute::is_same_v<StrideB, StrideA>, "glu: the fused GEMM expects K-major x and w");
  const StrideA stride_a = cute::make_stride(int64_t{k}, cute::Int<1>{}, int64_t{m} * k);
  const StrideB stride_b = cute::make_stride(int64_t{k}, cute::Int<1>{}, int64_t{n2} * k);
  cutlass::KernelHardwareInfo hw;
  hw.device_id = x.device().index;
  hw.sm_count = multiprocessor_count();
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {m, n2, k, 1},
      {static_cast<const Element*>(x.data()), stride_a, static_cast<const Element*>(w.data()), stride_b},
      {bias ? static_cast<const Element*>(bias->data()) : nullptr, static_cast<Element*>(out.data()),
       dy ? static_cast<const Element*>(dy->data()) : nullptr, kind},
      hw};
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess)
    throw_internal("glu: the fused GEMM rejected a shape the dispatch accepted");
  const std::size_t ws_bytes = Gemm::get_workspace_size(args);
  Tensor workspace;
  if (ws_bytes > 0)
    workspace = Tensor::empty({static_cast<std::int64_t>(ws_bytes)}, DType::u8, x.device(), stream);
  const cudaStream_t s = fk::detail::cuda_stream(stream);
  if (gemm.initialize(args, ws_bytes > 0 ? workspace.data() : nullptr, s) != cutlass::Status::kSuccess)
    throw_internal("glu: initializing the fused GEMM failed");
  if (gemm.run(s) != cutlass::Status::kSuccess) throw_internal("glu: launching the fused GEMM failed");
  FK_CUDA_CHECK_LAUNCH("glu_forward (fused GEMM)");
}

bool is_hopper(int device) {
  int major = 0, minor = 0;
  FK_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  FK_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  return major == 9 && minor == 0;
}

}  // namespace

bool glu_gemm_fused(const TensorView& x, const TensorView& w, const TensorView* bias, const TensorView* dy,
                    const TensorView& out, const GluOptions& opt, const Stream* stream) {
  const DType t = x.dtype();
  if (t == DType::f32 && !opt.allow_tf32) return false;
  const std::int64_t k = x.size(1), align = 16 / static_cast<std::int64_t>(dtype_size(t));
  if (k % align != 0 || k == 0) return false;  // TMA needs 16-byte rows
  for (const TensorView* p : {&x, &w, &out})
    if (reinterpret_cast<std::uintptr_t>(p->data()) % 16 != 0) return false;
  if (x.size(0) > INT32_MAX / 2 || w.size(0) > INT32_MAX / 2 || k > INT32_MAX / 2) return false;
  const fk::detail::DeviceScope on_device(x.device().index);
  if (!is_hopper(x.device().index)) return false;
  const char* cfg_env = std::getenv("FUSEKIT_GLU_CONFIG");  // experiment
  const int cfg = cfg_env ? std::atoi(cfg_env) : 0;
  switch (t) {
    case DType::bf16:
      switch (cfg) {
        case 1: run_fused<cutlass::bfloat16_t, Cfg<128, 256, 1, 1, false>>(x, w, bias, dy, out, opt.kind, stream); break;
        case 2: run_fused<cutlass::bfloat16_t, Cfg<128, 128, 1, 2, true>>(x, w, bias, dy, out, opt.kind, stream); break;
        case 3: run_fused<cutlass::bfloat16_t, Cfg<256, 128, 1, 2, false>>(x, w, bias, dy, out, opt.kind, stream); break;
        case 4: run_fused<cutlass::bfloat16_t, Cfg<128, 256, 1, 2, false>>(x, w, bias, dy, out, opt.kind, stream); break;
        default: run_fused<cutlass::bfloat16_t, Cooperative>(x, w, bias, dy, out, opt.kind, stream); break;
      }
      return true;
    case DType::f16: run_fused<cutlass::half_t, Cooperative>(x, w, bias, dy, out, opt.kind, stream); return true;
    case DType::f32: run_fused<float, Cooperative>(x, w, bias, dy, out, opt.kind, stream); return true;
    default: return false;
  }
}

}  // namespace fk::cuda
