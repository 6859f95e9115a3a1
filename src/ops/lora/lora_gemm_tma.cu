// The fused LoRA GEMM on Hopper with CUTLASS's TMA warp-specialized collective epilogue:
// z = lhs · op(rhs) + L Rᵀ + bias, out = act(z), the tile staged in shared memory and written by
// TMA stores (lora_gemm.cu's no-shared-memory epilogue stores 2 elements per thread and
// instruction straight from the registers; it remains for preact).
//
// LoraTmaEpilogue derives from the collective CUTLASS's epilogue CollectiveBuilder makes for a
// plain D = acc (no C operand) and overrides `store`, the member the sm90 GEMM kernels call with
// the tile's fp32 accumulators: it first adds the rank-r term by mma.sync, then the bias and the
// activation, in registers (lora_epilogue.cuh), and forwards the accumulators to the base store,
// which converts, stages and stores them. Everything else (pipelines, TMA descriptors, shared
// storage, can_implement) is the base's; its Arguments and Params gain the rank-r operands.
#include <cuda_runtime.h>

#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/kernel_hardware_info.h>

#include "fusekit/core/cuda_check.hpp"
#include "fusekit/core/error.hpp"
#include "fusekit/core/tensor.hpp"
#include "lora_cuda.hpp"
#include "lora_epilogue.cuh"
#include "ops/common/cuda_common.cuh"
#include "ops/common/sm90_epilogue.cuh"

namespace fk::cuda {
namespace {

// kLowRank: the epilogue adds L Rᵀ (false: the mainloop already did, LoraMainloop below).
template <class Base, class Element, bool kLowRank = true>
class LoraTmaEpilogue : public Base {
 public:
  struct Arguments : Base::Arguments {
    lora_detail::LowRankParams<Element> lowrank;
  };
  struct Params : Base::Params {
    lora_detail::LowRankParams<Element> lowrank;
  };

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args,
                                                  void* workspace) {
    Params p;
    static_cast<typename Base::Params&>(p) = Base::to_underlying_arguments(problem_shape, args, workspace);
    p.lowrank = args.lowrank;
    return p;
  }

  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem_shape, Arguments const& args) {
    return Base::can_implement(problem_shape, args) && args.lowrank.rank >= 0 && args.lowrank.rank <= 64 &&
           args.lowrank.rank % 16 == 0;
  }

  CUTLASS_HOST_DEVICE LoraTmaEpilogue(Params const& params, typename Base::TensorStorage& shared_tensors)
      : Base(params, shared_tensors), lowrank_(params.lowrank) {}

  template <class ProblemShapeMNKL, class TileShapeMNK, class TileCoordMNKL, class AccEngine, class AccLayout,
            class TiledMma>
  CUTLASS_DEVICE auto store(typename Base::LoadPipeline load_pipeline,
                            typename Base::LoadPipelineState load_pipe_consumer_state,
                            typename Base::StorePipeline store_pipeline,
                            typename Base::StorePipelineState store_pipe_producer_state,
                            ProblemShapeMNKL problem_shape_mnkl, TileShapeMNK tile_shape_MNK,
                            TileCoordMNKL tile_coord_mnkl, cute::Tensor<AccEngine, AccLayout> accumulators,
                            TiledMma tiled_mma, int thread_idx, typename Base::TensorStorage& shared_tensors,
                            int subtile_idx = -1) {
    const int m_total = static_cast<int>(cute::get<0>(problem_shape_mnkl));
    const int n_total = static_cast<int>(cute::get<1>(problem_shape_mnkl));
    auto t_coords =
        lora_detail::accumulator_coords(problem_shape_mnkl, tile_shape_MNK, tile_coord_mnkl, tiled_mma, thread_idx);
    CUTE_STATIC_ASSERT_V(cute::size(t_coords) == cute::size(accumulators));
    if constexpr (kLowRank) lora_detail::add_low_rank(lowrank_, accumulators, t_coords, m_total, n_total);
    lora_detail::bias_act_in_place(lowrank_, accumulators, t_coords, n_total);
    return Base::store(load_pipeline, load_pipe_consumer_state, store_pipeline, store_pipe_producer_state,
                       problem_shape_mnkl, tile_shape_MNK, tile_coord_mnkl, accumulators, tiled_mma, thread_idx,
                       shared_tensors, subtile_idx);
  }

 private:
  lora_detail::LowRankParams<Element> lowrank_;
};


// The rank-r term as one more k-tile of the mainloop: z = [lhs | L] · [rhs | R]ᵀ, K' = K rounded
// up to the k-tile + one k-tile. The producer loads the first ceil(K / 64) k-tiles from lhs and
// rhs as CUTLASS's does and the last one from L [M, rb] and R [N, rb] through two more TMA
// descriptors (the box is 64 wide, rb <= 64: TMA fills the columns past rb, and those past K in
// lhs's last tile, with zeros). The consumer warpgroups run K' / 64 wgmma k-tiles unchanged: the
// rank-r term costs one k-tile of tensor-core work and no epilogue instruction.
template <class Base>
struct LoraMainloop : Base {
  using typename Base::InternalElementA;
  using typename Base::InternalElementB;
  using typename Base::SmemLayoutA;
  using typename Base::SmemLayoutB;
  using typename Base::TileShape;
  using typename Base::StrideA;
  using typename Base::StrideB;
  using ClusterShape = typename Base::DispatchPolicy::ClusterShape;

  struct Arguments : Base::Arguments {
    typename Base::ElementA const* ptr_L = nullptr;  // [M, rb], row-major
    typename Base::ElementB const* ptr_R = nullptr;  // [N, rb] (rhs K-major) or [rb, N] (N-major), row-major
    int rank = 0;                                     // rb: a multiple of 16, at most 64
    int k_real = 0;                                   // K of lhs and rhs
  };
  struct Params : Base::Params {
    typename Base::Params::TMA_A tma_load_l;
    typename Base::Params::TMA_B tma_load_r;
    int rank, m, n;
  };

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args,
                                                  void* workspace) {
    using namespace cute;
    auto [M, N, K, L] = problem_shape;
    Params p;
    static_cast<typename Base::Params&>(p) =
        Base::to_underlying_arguments(make_shape(M, N, args.k_real, L), args, workspace);
    const int rb = args.rank;
    auto tensor_l = make_tensor(reinterpret_cast<InternalElementA const*>(args.ptr_L),
                                make_layout(make_shape(M, rb, L), StrideA{int64_t{rb}, Int<1>{}, int64_t{M} * rb}));
    // R as the rhs's (n, k) view: [N, rb] row-major (rhs K-major) or [rb, N] row-major (N-major).
    StrideB stride_r;
    if constexpr (is_static<decltype(get<0>(StrideB{}))>::value)
      stride_r = StrideB{Int<1>{}, int64_t{N}, int64_t{N} * rb};
    else
      stride_r = StrideB{int64_t{rb}, Int<1>{}, int64_t{N} * rb};
    auto tensor_r =
        make_tensor(reinterpret_cast<InternalElementB const*>(args.ptr_R), make_layout(make_shape(N, rb, L), stride_r));
    p.tma_load_l = make_tma_copy_A_sm90(typename Base::GmemTiledCopyA{}, tensor_l,
                                        SmemLayoutA{}(cute::_, cute::_, Int<0>{}), TileShape{}, ClusterShape{});
    p.tma_load_r = make_tma_copy_B_sm90(typename Base::GmemTiledCopyB{}, tensor_r,
                                        SmemLayoutB{}(cute::_, cute::_, Int<0>{}), TileShape{}, ClusterShape{});
    p.rank = rb;
    p.m = static_cast<int>(M);
    p.n = static_cast<int>(N);
    return p;
  }

  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem_shape, Arguments const& args) {
    return Base::can_implement(problem_shape, args) && args.rank % 16 == 0 && args.rank > 0 && args.rank <= 64;
  }

  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const& params) {
    Base::prefetch_tma_descriptors(params);
    cute::prefetch_tma_descriptor(params.tma_load_l.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_load_r.get_tma_descriptor());
  }

  // The producer: CUTLASS's load for the lhs / rhs k-tiles, then the (L, R) k-tile.
  template <class TensorA, class TensorB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& params, typename Base::MainloopPipeline pipeline,
                           typename Base::PipelineState smem_pipe_write,
                           cute::tuple<TensorA, TensorB> const& load_inputs, BlockCoord const& blk_coord,
                           KTileIterator k_tile_iter, int k_tile_count, int thread_idx, uint32_t block_rank_in_cluster,
                           typename Base::TensorStorage& shared_tensors) {
    using namespace cute;
    // The (L, R) tile goes into the stage after the last lhs / rhs tile.
    auto last_write = smem_pipe_write;
    for (int i = 0; i < k_tile_count - 1; ++i) ++last_write;
    Base::load(params, pipeline, smem_pipe_write, load_inputs, blk_coord, k_tile_iter, k_tile_count - 1, thread_idx,
               block_rank_in_cluster, shared_tensors);
    if (!cute::elect_one_sync()) return;
    cute::Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});  // (BLK_M, BLK_K, PIPE)
    cute::Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});  // (BLK_N, BLK_K, PIPE)
    constexpr uint32_t cluster_x = get<0>(ClusterShape{});
    const uint2 cluster_id = {block_rank_in_cluster % cluster_x, block_rank_in_cluster / cluster_x};
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
    // k-tile 0 of L and R (one tile: rb <= 64).
    cute::Tensor gL = local_tile(params.tma_load_l.get_tma_tensor(make_shape(params.m, params.rank, 1)), TileShape{},
                                 make_coord(cute::_, cute::_, cute::_),
                                 Step<_1, Underscore, _1>{})(cute::_, cute::_, m_coord, 0, l_coord);
    cute::Tensor gR = local_tile(params.tma_load_r.get_tma_tensor(make_shape(params.n, params.rank, 1)), TileShape{},
                                 make_coord(cute::_, cute::_, cute::_),
                                 Step<Underscore, _1, _1>{})(cute::_, cute::_, n_coord, 0, l_coord);
    auto block_tma_l = params.tma_load_l.get_slice(cluster_id.y);
    auto block_tma_r = params.tma_load_r.get_slice(cluster_id.x);
    cute::Tensor tLgL = block_tma_l.partition_S(gL);  // (TMA, TMA_M, TMA_K)
    cute::Tensor tLsL = block_tma_l.partition_D(sA);  // (TMA, TMA_M, TMA_K, PIPE)
    cute::Tensor tRgR = block_tma_r.partition_S(gR);
    cute::Tensor tRsR = block_tma_r.partition_D(sB);
    uint16_t mcast_mask_a = 0, mcast_mask_b = 0;
    auto block_layout = Layout<ClusterShape>{};  // (m, n) -> block id
    if constexpr (cute::is_same_v<typename Base::GmemTiledCopyA, SM90_TMA_LOAD_MULTICAST>)
      for (int n = 0; n < size<1>(block_layout); ++n)
        mcast_mask_a |= uint16_t(1) << block_layout(cluster_id.x, n, Int<0>{});
    if constexpr (cute::is_same_v<typename Base::GmemTiledCopyB, SM90_TMA_LOAD_MULTICAST>)
      for (int m = 0; m < size<0>(block_layout); ++m)
        mcast_mask_b |= uint16_t(1) << block_layout(m, cluster_id.y, Int<0>{});
    pipeline.producer_acquire(last_write);
    auto* barrier = pipeline.producer_get_barrier(last_write);
    const int stage = last_write.index();
    cute::copy(params.tma_load_l.with(*barrier, mcast_mask_a), tLgL, tLsL(cute::_, cute::_, cute::_, stage));
    cute::copy(params.tma_load_r.with(*barrier, mcast_mask_b), tRgR, tRsR(cute::_, cute::_, cute::_, stage));
  }
};

// CUTLASS's TMA epilogue for a plain D = acc (no C), derived as LoraTmaEpilogue, on
// lora_detail::PingpongMainloop (ping-pong, 128 x 128 tiles, clusters of 2 along N; the
// cooperative schedule measured slower in every case: docs/notes/lora.md).
template <class Element, bool RhsNByK>
struct LoraTmaConfig {
  using TileShape = lora_detail::TileShape;
  static constexpr int kAlignment = 16 / sizeof(Element);
  using BaseEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, lora_detail::ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, cutlass::layout::RowMajor, kAlignment,
      Element, cutlass::layout::RowMajor, kAlignment, cutlass::epilogue::TmaWarpSpecialized>::CollectiveOp;
  using Epilogue = LoraTmaEpilogue<BaseEpilogue, Element>;
  using Mainloop = lora_detail::PingpongMainloop<Element, RhsNByK, Epilogue>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

template <class Element, bool RhsNByK>
void run_tma(const LoraGemmArgs& a, const Stream* stream) {
  using Config = LoraTmaConfig<Element, RhsNByK>;
  const std::int64_t m = a.lhs.size(0), n = a.out.size(1);
  lora_detail::run_plain_mainloop<typename Config::Gemm, RhsNByK, Element>(
      a, lora_detail::tma_epilogue_args<Element, typename Config::Epilogue>(a, m, n), stream, "lora (fused GEMM, TMA epilogue)");
}

// Ping-pong with the rank-r term as the mainloop's last k-tile.
template <class Element, bool RhsNByK>
void run_ktile(const LoraGemmArgs& a, const Stream* stream) {
  using Tma = LoraTmaConfig<Element, RhsNByK>;
  using Epilogue = LoraTmaEpilogue<typename Tma::BaseEpilogue, Element, false>;
  using Mainloop = LoraMainloop<typename Tma::Mainloop>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  const int m = static_cast<int>(a.lhs.size(0)), kg = static_cast<int>(a.lhs.size(1));
  const int n = static_cast<int>(a.out.size(1));
  constexpr int kBlockK = cute::size<2>(typename Tma::TileShape{});
  const int kp = (kg + kBlockK - 1) / kBlockK * kBlockK + kBlockK;  // one more k-tile: (L, R)
  typename Mainloop::Arguments ml{};
  ml.ptr_A = static_cast<const Element*>(a.lhs.data());
  ml.ptr_B = static_cast<const Element*>(a.rhs.data());
  lora_detail::operand_strides<RhsNByK>(m, n, kg, ml.dA, ml.dB);
  ml.ptr_L = static_cast<const Element*>(a.lowrank_left.data());
  ml.ptr_R = static_cast<const Element*>(RhsNByK ? a.lowrank_right.data() : a.lowrank_right_t.data());
  ml.rank = static_cast<int>(a.lowrank_left.size(1));
  ml.k_real = kg;
  cutlass::KernelHardwareInfo hw;
  hw.device_id = a.out.device().index;
  hw.sm_count = multiprocessor_count();
  typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                {m, n, kp, 1},
                                ml,
                                lora_detail::tma_epilogue_args<Element, Epilogue>(a, m, n),
                                hw,
                                lora_detail::scheduler_args<typename Gemm::GemmKernel::TileSchedulerArguments>(a)};
  sm90::run_gemm<Gemm>(args, a.out.device(), stream, "lora (fused GEMM, rank-r k-tile)");
}

template <class Element>
void run_tma_layout(const LoraGemmArgs& a, const Stream* stream) {
  if (a.rhs_is_n_by_k) run_tma<Element, true>(a, stream);
  else run_tma<Element, false>(a, stream);
}

}  // namespace

void lora_gemm_tma(const LoraGemmArgs& args, const Stream* stream) {
  // Automatic tile order: along M in groups of 4, measured faster than CUTLASS's default (swizzle
  // 1 along N) and the other orders tried (docs/notes/lora.md).
  LoraGemmArgs a = args;
  if (a.swizzle == 0 && a.raster == 0) {
    a.swizzle = 4;
    a.raster = 1;
  }
  // Automatic above rb = 16 (rb = 16 takes the wgmma epilogue below): the rank-r term as a k-tile,
  // whose cost does not grow with r, where mma.sync in the epilogue does (docs/notes/lora.md).
  const bool ktile = a.epilogue == LoraEpilogueKind::tma_ktile ||
                     (a.epilogue == LoraEpilogueKind::automatic && (a.rhs_is_n_by_k || a.lowrank_left.size(1) > 16));
  const bool has_rt = a.lowrank_right_t.data() != nullptr && a.lowrank_right_t.rank() == 2 &&
                      a.lowrank_right_t.size(0) == a.lowrank_left.size(1) &&
                      a.lowrank_right_t.size(1) == a.out.size(1) && aligned16(a.lowrank_right_t.data());
  // rb = 16: the rank-16 wgmma epilogue, unless asked otherwise: it measured faster than mma.sync
  // and than the k-tile, close to no rank-r term at all (docs/notes/lora.md).
  const bool rs = a.lowrank_left.size(1) == 16 &&
                  (a.epilogue == LoraEpilogueKind::tma_rs || a.epilogue == LoraEpilogueKind::automatic);
  if (rs) {
    lora_gemm_tma_rs(a, stream);
    return;
  }
  if (ktile && (a.rhs_is_n_by_k || has_rt)) {
    using cutlass::bfloat16_t, cutlass::half_t;
    const bool bf16 = a.lhs.dtype() == DType::bf16;
    if (a.rhs_is_n_by_k) bf16 ? run_ktile<bfloat16_t, true>(a, stream) : run_ktile<half_t, true>(a, stream);
    else bf16 ? run_ktile<bfloat16_t, false>(a, stream) : run_ktile<half_t, false>(a, stream);
    return;
  }
  if (a.lhs.dtype() == DType::bf16) run_tma_layout<cutlass::bfloat16_t>(a, stream);
  else run_tma_layout<cutlass::half_t>(a, stream);
}

}  // namespace fk::cuda
