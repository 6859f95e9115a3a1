// The gated MLP's backward from kept pre-activations on Hopper: the down projection's input
// gradient dh = dy down_w formed by the tensor cores, and the GLU's derivative applied to it in the
// epilogue, so dh [M, N] never reaches memory.
//
// Mainloop: CUTLASS 3's SM90 TMA warp-specialized ping-pong GEMM, dy the K-major A operand
// [M, K'], down_w [K', N] the N-major B operand (the tensor cores read it transposed), 128 x 128
// tiles, clusters of 2 along N sharing dy by multicast; each consumer warpgroup's epilogue runs
// under the other's mainloop. The producer warp, as it starts loading a tile's operands, asks L2
// for the tile's pre-activations (PreactPrefetchMainloop: one bulk prefetch per row, 512 bytes),
// so that the epilogue a tile later reads them from L2 rather than from DRAM.
//
// Epilogue (GluDgradEpilogue, CUTLASS's no-shared-memory interface): a wgmma accumulator fragment
// holds columns in adjacent pairs (n, n + 1) of dh; C's pairs for them, (L, R) at prepared columns
// 2n .. 2n + 3, are one 8-byte load; the thread stores the two (dL, dR) pairs to dC with one
// 8-byte store and glu(L, R) of both to out (the activation, the down projection's weight
// gradient's operand) with one 4-byte store. Per quad of lanes, 32 contiguous bytes of C and dC a
// row. Arithmetic as glu_pairs (accurate activations, fp32; dC rounded once), from dh's fp32
// accumulators rather than dh rounded to the operand dtype.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
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
#include "fusekit/core/tensor.hpp"
#include "glu_cuda.hpp"
#include "glu_math.cuh"
#include "ops/common/cuda_common.cuh"
#include "ops/common/sm90_epilogue.cuh"

namespace fk::cuda {
namespace {

template <class Element, GluKind Kind>
class GluDgradEpilogue : public sm90::NoSmemEpilogueBase<Element> {
 public:
  using Base = sm90::NoSmemEpilogueBase<Element>;
  using typename Base::SharedStorage;

  struct Arguments {
    const Element* preact = nullptr;  // C [M, 2N], prepared
    Element* dpreact = nullptr;       // dC [M, 2N], prepared
    Element* act = nullptr;           // glu(C) [M, N], or null
  };
  using Params = Arguments;

  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    return args.preact != nullptr && args.dpreact != nullptr;
  }

  CUTLASS_HOST_DEVICE explicit GluDgradEpilogue(Params const& params, SharedStorage const& = SharedStorage())
      : params_(params) {}

  CUTLASS_DEVICE bool is_source_needed() { return false; }

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_mnk,
                                 BlockCoordMNKL blk_coord_mnkl, cute::Tensor<FrgEngine, FrgLayout> const& acc,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
    using namespace cute;
    const int m_total = static_cast<int>(get<0>(problem_shape_mnkl));
    const int n_total = static_cast<int>(get<1>(problem_shape_mnkl));
    const int64_t ld = 2 * static_cast<int64_t>(n_total);
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord_mnkl;
    cute::Tensor coords = local_tile(make_identity_tensor(make_shape(m_total, n_total)), take<0, 2>(blk_shape_mnk),
                                     make_coord(m_coord, n_coord));
    cute::Tensor t_coords = tiled_mma.get_thread_slice(thread_idx).partition_C(coords);
    static_assert(is_static<FrgLayout>::value, "glu dgrad epilogue: the accumulator layout must be static");
    constexpr int kPairs = decltype(size(acc))::value / 2;
    constexpr int kBatch = 16;  // pairs whose C loads are in flight together
    static_assert(kPairs % kBatch == 0, "glu dgrad epilogue: unexpected accumulator fragment");
    CUTLASS_PRAGMA_UNROLL
    for (int b = 0; b < kPairs; b += kBatch) {
      uint2 c[kBatch];
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kBatch; ++j) {
        const int i = 2 * (b + j);
        const int m = get<0>(t_coords(i)), n = get<1>(t_coords(i));
        c[j] = m < m_total && n < n_total
                   ? *reinterpret_cast<const uint2*>(params_.preact + m * ld + 2 * static_cast<int64_t>(n))
                   : make_uint2(0u, 0u);
      }
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kBatch; ++j) {
        const int i = 2 * (b + j);
        const int m = get<0>(t_coords(i)), n = get<1>(t_coords(i));
        if (m >= m_total || n >= n_total) continue;  // N is even: the pair is in or out together
        const float l0 = half_of(c[j].x, 0), r0 = half_of(c[j].x, 1), l1 = half_of(c[j].y, 0), r1 = half_of(c[j].y, 1);
        float dl0, dr0, dl1, dr1;
        fk::device::glu_grad<Kind>(l0, r0, acc(i), dl0, dr0);
        fk::device::glu_grad<Kind>(l1, r1, acc(i + 1), dl1, dr1);
        *reinterpret_cast<uint2*>(params_.dpreact + m * ld + 2 * static_cast<int64_t>(n)) =
            make_uint2(pack2(dl0, dr0), pack2(dl1, dr1));
        if (params_.act != nullptr)
          *reinterpret_cast<uint32_t*>(params_.act + m * static_cast<int64_t>(n_total) + n) =
              pack2(fk::device::glu<Kind>(l0, r0), fk::device::glu<Kind>(l1, r1));
      }
    }
  }

 private:
  CUTLASS_DEVICE static uint32_t pack2(float a, float b) {  // a in the low half
    cutlass::Array<Element, 2> p;
    p[0] = Element(a);
    p[1] = Element(b);
    return reinterpret_cast<uint32_t const&>(p);
  }
  CUTLASS_DEVICE static float half_of(uint32_t w, int hi) {
    const uint16_t bits = static_cast<uint16_t>(hi ? w >> 16 : w & 0xffffu);
    return static_cast<float>(reinterpret_cast<Element const&>(bits));
  }

  Params params_;
};

// CUTLASS's collective (Base), except that the producer warp, before it loads a tile's first
// k-block, prefetches the tile's rows of C [M, 2N] into L2: TM rows of 2 TN elements, one
// cp.async.bulk.prefetch a row, spread over the warp's lanes. The producer runs a pipeline's depth
// ahead of the consumers, and in the ping-pong schedule a whole tile ahead of that tile's
// epilogue.
template <class Base, class Element>
struct PreactPrefetchMainloop : Base {
  using typename Base::MainloopPipeline;
  using typename Base::PipelineState;
  using typename Base::TensorStorage;
  using TileShape = typename Base::TileShape;

  struct Arguments : Base::Arguments {
    const Element* preact = nullptr;
  };
  struct Params : Base::Params {
    const Element* preact;
    int64_t ld;  // 2N
    int rows;    // M
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args, void* workspace) {
    Params p;
    static_cast<typename Base::Params&>(p) = Base::to_underlying_arguments(problem_shape, args, workspace);
    p.preact = args.preact;
    p.ld = 2 * static_cast<int64_t>(cute::get<1>(problem_shape));
    p.rows = static_cast<int>(cute::get<0>(problem_shape));
    return p;
  }

  template <class TensorA, class TensorB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& params, MainloopPipeline pipeline, PipelineState smem_pipe_write,
                           cute::tuple<TensorA, TensorB> const& load_inputs, BlockCoord const& blk_coord,
                           KTileIterator k_tile_iter, int k_tile_count, int thread_idx,
                           uint32_t block_rank_in_cluster, TensorStorage& shared_tensors) {
    constexpr int kTM = cute::size<0>(TileShape{}), kTN = cute::size<1>(TileShape{});
    const int m0 = static_cast<int>(cute::get<0>(blk_coord)) * kTM;
    const int64_t c0 = static_cast<int64_t>(cute::get<1>(blk_coord)) * kTN * 2;
    const int64_t cols = std::min<int64_t>(2 * kTN, params.ld - c0);  // a multiple of 8: N % 8 == 0
    if (cols > 0) {
      const uint32_t bytes = static_cast<uint32_t>(cols * sizeof(Element));
      for (int r = thread_idx % 32; r < kTM && m0 + r < params.rows; r += 32) {
        const Element* row = params.preact + (m0 + r) * params.ld + c0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(row), "r"(bytes) : "memory");
#else
        (void)row;
        (void)bytes;
#endif
      }
    }
    Base::load(params, pipeline, smem_pipe_write, load_inputs, blk_coord, k_tile_iter, k_tile_count, thread_idx,
               block_rank_in_cluster, shared_tensors);
  }
};

template <class Element, GluKind Kind>
struct DgradConfig {
  using TileShape = cute::Shape<cute::_128, cute::_128, cute::_64>;
  using ClusterShape = cute::Shape<cute::_1, cute::_2, cute::_1>;
  using Epilogue = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<GluDgradEpilogue<Element, Kind>>;
  static constexpr int kAlignment = 16 / sizeof(Element);
  using BuiltMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, kAlignment, Element,
      cutlass::layout::RowMajor, kAlignment, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedPingpong>::CollectiveOp;
  using Mainloop = PreactPrefetchMainloop<BuiltMainloop, Element>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

template <class Element, GluKind Kind>
void run_dgrad(const TensorView& dy, const TensorView& down_w, const TensorView& preact, const TensorView& dpreact,
               const TensorView* act, const Stream* stream) {
  using Config = DgradConfig<Element, Kind>;
  using Gemm = typename Config::Gemm;
  const int m = static_cast<int>(dy.size(0)), k = static_cast<int>(dy.size(1)), n = static_cast<int>(down_w.size(1));
  using StrideA = typename Gemm::GemmKernel::StrideA;
  using StrideB = typename Gemm::GemmKernel::StrideB;
  static_assert(cute::is_same_v<StrideA, cute::Stride<int64_t, cute::Int<1>, int64_t>>,
                "glu dgrad: the GEMM expects a K-major dy");
  static_assert(cute::is_same_v<StrideB, cute::Stride<cute::Int<1>, int64_t, int64_t>>,
                "glu dgrad: the GEMM expects an N-major down_w");
  const StrideA stride_a = cute::make_stride(int64_t{k}, cute::Int<1>{}, int64_t{m} * k);
  const StrideB stride_b = cute::make_stride(cute::Int<1>{}, int64_t{n}, int64_t{n} * k);
  cutlass::KernelHardwareInfo hw;
  hw.device_id = dy.device().index;
  hw.sm_count = multiprocessor_count();
  typename Config::Mainloop::Arguments mainloop{};
  static_cast<typename Config::BuiltMainloop::Arguments&>(mainloop) = {
      static_cast<const Element*>(dy.data()), stride_a, static_cast<const Element*>(down_w.data()), stride_b};
  mainloop.preact = static_cast<const Element*>(preact.data());
  typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                {m, n, k, 1},
                                mainloop,
                                {static_cast<const Element*>(preact.data()), static_cast<Element*>(dpreact.data()),
                                 act ? static_cast<Element*>(act->data()) : nullptr},
                                hw};
  sm90::run_gemm<Gemm>(args, dy.device(), stream, "glu_backward_from_preact (fused down-projection GEMM)");
}

template <class Element>
void run_kind(GluKind kind, const TensorView& dy, const TensorView& down_w, const TensorView& preact,
              const TensorView& dpreact, const TensorView* act, const Stream* stream) {
  switch (kind) {
    case GluKind::sigmoid_tanh: run_dgrad<Element, GluKind::sigmoid_tanh>(dy, down_w, preact, dpreact, act, stream); return;
    case GluKind::swiglu: run_dgrad<Element, GluKind::swiglu>(dy, down_w, preact, dpreact, act, stream); return;
    case GluKind::geglu_tanh: run_dgrad<Element, GluKind::geglu_tanh>(dy, down_w, preact, dpreact, act, stream); return;
    case GluKind::geglu_erf: run_dgrad<Element, GluKind::geglu_erf>(dy, down_w, preact, dpreact, act, stream); return;
    case GluKind::reglu: run_dgrad<Element, GluKind::reglu>(dy, down_w, preact, dpreact, act, stream); return;
  }
}

}  // namespace

bool glu_dgrad_fused(const TensorView& dy, const TensorView& down_w, const TensorView& preact,
                     const TensorView& dpreact, const TensorView* act, GluKind kind, const Stream* stream) {
  const DType t = dy.dtype();
  if (t != DType::bf16 && t != DType::f16) return false;
  const std::int64_t m = dy.size(0), k = dy.size(1), n = down_w.size(1);
  // TMA needs 16-byte rows of dy and down_w; the epilogue's 8-byte accesses need 16-byte rows of C.
  if (k % 8 != 0 || n % 8 != 0 || m == 0 || k == 0) return false;
  for (const TensorView* p : {&dy, &down_w, &preact, &dpreact, act})
    if (p != nullptr && !aligned16(p->data())) return false;
  if (m > INT32_MAX / 2 || 2 * n > INT32_MAX / 2 || k > INT32_MAX / 2) return false;
  const fk::detail::DeviceScope on_device(dy.device().index);
  if (!is_sm90(dy.device().index)) return false;
  if (t == DType::bf16) run_kind<cutlass::bfloat16_t>(kind, dy, down_w, preact, dpreact, act, stream);
  else run_kind<cutlass::half_t>(kind, dy, down_w, preact, dpreact, act, stream);
  return true;
}

}  // namespace fk::cuda
