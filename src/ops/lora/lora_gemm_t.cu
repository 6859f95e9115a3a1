// The fused LoRA forward GEMM with t = s x Aᵀ computed inside it (rank 16):
//   t = s x Aᵀ [M, 16],   y = act(x Wᵀ + b + t Bᵀ)
// in one CUTLASS 3 SM90 TMA warp-specialized ping-pong GEMM, with no pass of its own over x.
//
// Who computes t. The tile scheduler is CUTLASS's static persistent one: every tile (m, n) of a
// row block m comes after the tiles (m, 0) and (m, 1) in its order, or shares their cluster (for
// either raster and any swizzle, N-blocks 0 and 1 are the first cluster of their row block's first
// band), and CTAs take tiles in that order. Those two tiles, the "owners" (one cluster of 2 along
// N: always resident together), compute t for their 128 rows alongside their own x Wᵀ, 8 of its
// 16 columns each: every k-block an owner's consumer warpgroup issues, besides the 64 x 128 x 16
// wgmmas of the GEMM, 64 x 8 x 16 wgmmas of the same x tile against A's 8 x 64 slice, which the
// producer loads by TMA into the owner's stages (1 KiB more a stage, expected on the stage's
// barrier on top of x's and W's bytes). After its mainloop the owner scales its columns by s,
// rounds them to the operand dtype, stores them to t [M, 16] (the forward's t, kept for the
// backward) and adds 1 to ready[m] (a gpu-scope fence and a relaxed add after a barrier of the
// warpgroup). 1/16 more tensor-core work for two tiles in N / 128 (N > 128 on this path), and no
// other tile waits for them but in its epilogue.
//
// The epilogue of every tile (m, n) then loads its 16 x 128 slice of B into shared memory, waits
// for ready[m] = 2 (acquire), loads its rows of t as the register A operand of one more wgmma
// (64 x 128 x 16 per 64 rows: z += t Bᵀ on the accumulators), adds the bias, applies the
// activation, and hands the tile to CUTLASS's TMA epilogue. The wait sits in the epilogue, which
// runs while the other consumer warpgroup of the CTA computes its mainloop: the owners finish
// their mainloops a few microseconds after the other tiles of their row block, which is hidden.
//
// Progress: a tile waits only for owners that precede it in the scheduler's order or share its
// cluster, and owners never wait before they publish; so as long as every CTA of the grid is resident at once no wait
// is circular. The grid is sized by cudaOccupancyMaxActiveClusters for this kernel's clusters and
// shared memory, so that holds when the GPU is not shared with another kernel; when it is, the
// other kernel ends and the waiting CTAs' peers start.
//
// The producer hands each consumer warpgroup its tile's (m, n) through shared memory: ping-pong
// gives tiles to the two warpgroups alternately, so the producer writes the coordinates of its
// i-th tile into slot i % 2 before the first k-block's barrier arrive (release), and the
// warpgroup reads them after waiting on that barrier (acquire); the slot's previous reader, the
// same warpgroup two tiles earlier, read it before the tile in between could start.
#include <cuda_runtime.h>

#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
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

constexpr int kRank = 16;  // t's columns: r <= 16, A and B zero-padded to 16
// Owners per row block: N-blocks 0 and 1 (one cluster), each computing 8 of t's 16 columns, so
// that each does 1/16 more MMA rather than one 1/8, which measured faster than one owner
// (docs/notes/lora.md).
constexpr int kOwners = 2;
constexpr int kOwnerCols = kRank / kOwners;
constexpr int kBlockM = 128, kBlockN = 128, kBlockK = 64;
// Named barriers of one consumer warpgroup (ids past CUTLASS's reserved ones). These and the
// helpers below serve the sm_90a kernel only, so the sm_80 pass of this file never uses them.
[[maybe_unused]] constexpr uint32_t kPublishBarrier = 0;
[[maybe_unused]] constexpr uint32_t kEpilogueBarrier = 1;

[[maybe_unused]] CUTLASS_DEVICE void publish_ready(int* flag) {
  asm volatile("fence.acq_rel.gpu;\n\tred.relaxed.gpu.global.add.s32 [%0], 1;" ::"l"(flag) : "memory");
}

[[maybe_unused]] CUTLASS_DEVICE uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

[[maybe_unused]] CUTLASS_DEVICE int load_acquire(const int* flag) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(flag) : "memory");
  return v;
}

// ---------------------------------------------------------------------------------------------
// The mainloop: CUTLASS's ping-pong collective (Base) with A's k-slice in every stage, the tile's
// coordinates handed to its consumer, and the owner's t.
template <class Base>
struct LoraTMainloop : Base {
  using Element = typename Base::ElementA;          // cutlass::bfloat16_t / half_t
  using TmaElement = typename Base::InternalElementA;  // the same bits, as CUTLASS's TMA copies see them
  using typename Base::SmemLayoutA;
  using typename Base::TiledMma;
  using typename Base::MainloopPipeline;
  using typename Base::PipelineState;
  using ClusterShape = typename Base::DispatchPolicy::ClusterShape;
  static constexpr int kStages = Base::DispatchPolicy::Stages;
  static_assert(cute::size<0>(typename Base::TileShape{}) == kBlockM && cute::size<1>(typename Base::TileShape{}) == kBlockN &&
                cute::size<2>(typename Base::TileShape{}) == kBlockK, "lora (in-GEMM t): 128 x 128 x 64 tiles");

  // A's slice of a k-block, [16, 64], as the B operand of the t wgmma (K-major, 128-byte swizzle).
  using SmemLayoutAL = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<Element>{},
                                                    cute::make_shape(cute::Int<kOwnerCols>{}, cute::Int<kBlockK>{},
                                                                     cute::Int<kStages>{})));
  using TiledMmaT = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, cute::Shape<cute::_64, cute::Int<kOwnerCols>, cute::_64>>()));

  struct TensorStorage : Base::TensorStorage {
    alignas(128) cute::array_aligned<Element, cute::cosize_v<SmemLayoutAL>> smem_AL;
    alignas(16) int tile_mn[2][2];  // (m, n) of the producer's tiles 0, 1 mod 2
  };

  struct Arguments : Base::Arguments {
    Element const* ptr_AL = nullptr;  // A zero-padded to [16, K], row-major
    Element* ptr_t = nullptr;         // t [M, 16], written by the owners
    int* ready = nullptr;             // [ceil(M / 128)], zero at launch
    float scale = 1.0f;
  };

  using TMA_AL = decltype(cute::make_tma_copy(
      cute::SM90_TMA_LOAD{},
      cute::make_tensor(static_cast<TmaElement const*>(nullptr),
                        cute::make_layout(cute::make_shape(int32_t(0), int32_t(0)),
                                          cute::make_stride(int64_t(0), cute::Int<1>{}))),
      SmemLayoutAL{}(cute::_, cute::_, cute::Int<0>{})));

  struct Params : Base::Params {
    TMA_AL tma_load_al;
    Element* t;
    int* ready;
    float scale;
    int m, k;
  };

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args,
                                                  void* workspace) {
    using namespace cute;
    auto [M, N, K, L] = problem_shape;
    Params p;
    static_cast<typename Base::Params&>(p) = Base::to_underlying_arguments(problem_shape, args, workspace);
    auto tensor_al = make_tensor(reinterpret_cast<TmaElement const*>(args.ptr_AL), make_layout(make_shape(int32_t(kRank), int32_t(K)),
                                                          make_stride(int64_t(K), Int<1>{})));
    p.tma_load_al = make_tma_copy(SM90_TMA_LOAD{}, tensor_al, SmemLayoutAL{}(_, _, Int<0>{}));
    p.t = args.ptr_t;
    p.ready = args.ready;
    p.scale = args.scale;
    p.m = static_cast<int>(M);
    p.k = static_cast<int>(K);
    return p;
  }

  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem_shape, Arguments const& args) {
    return Base::can_implement(problem_shape, args) && args.ptr_AL != nullptr && args.ptr_t != nullptr &&
           args.ready != nullptr;
  }

  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const& params) {
    Base::prefetch_tma_descriptors(params);
    cute::prefetch_tma_descriptor(params.tma_load_al.get_tma_descriptor());
  }

  // The producer: CUTLASS's loop over the k-blocks of lhs and rhs, plus A's slice into every stage.
  template <class TensorA, class TensorB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& params, MainloopPipeline pipeline, PipelineState smem_pipe_write,
                           cute::tuple<TensorA, TensorB> const& load_inputs, BlockCoord const& blk_coord,
                           KTileIterator k_tile_iter, int k_tile_count, int thread_idx, uint32_t block_rank_in_cluster,
                           TensorStorage& shared_tensors) {
    using namespace cute;
    const int parity = producer_tiles_ & 1;
    ++producer_tiles_;
    if (!elect_one_sync()) return;
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
    // Before this tile's first barrier arrive: its consumer reads the slot after that phase.
    shared_tensors.tile_mn[parity][0] = static_cast<int>(m_coord);
    shared_tensors.tile_mn[parity][1] = static_cast<int>(n_coord);

    cute::Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});
    cute::Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), typename Base::SmemLayoutB{});
    cute::Tensor sAL = make_tensor(make_smem_ptr(shared_tensors.smem_AL.data()), SmemLayoutAL{});
    constexpr uint32_t cluster_x = get<0>(ClusterShape{});
    const uint2 cluster_id = {block_rank_in_cluster % cluster_x, block_rank_in_cluster / cluster_x};
    cute::Tensor gA = get<0>(load_inputs)(_, _, m_coord, _, l_coord);  // (BLK_M, BLK_K, k)
    cute::Tensor gB = get<1>(load_inputs)(_, _, n_coord, _, l_coord);  // (BLK_N, BLK_K, k)
    const int owner_half = static_cast<int>(n_coord) < kOwners ? static_cast<int>(n_coord) : 0;
    cute::Tensor gAL = local_tile(params.tma_load_al.get_tma_tensor(make_shape(int32_t(kRank), params.k)),
                                  Shape<Int<kOwnerCols>, Int<kBlockK>>{}, make_coord(owner_half, _));
    auto block_tma_a = params.tma_load_a.get_slice(cluster_id.y);
    auto block_tma_b = params.tma_load_b.get_slice(cluster_id.x);
    auto tma_al = params.tma_load_al.get_slice(0);
    cute::Tensor tAgA = block_tma_a.partition_S(gA);
    cute::Tensor tAsA = block_tma_a.partition_D(sA);
    cute::Tensor tBgB = block_tma_b.partition_S(gB);
    cute::Tensor tBsB = block_tma_b.partition_D(sB);
    cute::Tensor tLgL = tma_al.partition_S(gAL);
    cute::Tensor tLsL = tma_al.partition_D(sAL);
    uint16_t mcast_mask_a = 0, mcast_mask_b = 0;
    auto block_layout = Layout<ClusterShape>{};  // (m, n) -> block id
    if constexpr (is_same_v<typename Base::GmemTiledCopyA, SM90_TMA_LOAD_MULTICAST>)
      for (int n = 0; n < size<1>(block_layout); ++n) mcast_mask_a |= uint16_t(1) << block_layout(cluster_id.x, n, Int<0>{});
    if constexpr (is_same_v<typename Base::GmemTiledCopyB, SM90_TMA_LOAD_MULTICAST>)
      for (int m = 0; m < size<0>(block_layout); ++m) mcast_mask_b |= uint16_t(1) << block_layout(m, cluster_id.y, Int<0>{});
    // Only the owner's stages carry A's slice: their barrier expects its bytes on top of x's and W's.
    const bool owner = static_cast<int>(n_coord) < kOwners;
    constexpr uint32_t al_bytes = kOwnerCols * kBlockK * sizeof(Element);
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      pipeline.producer_acquire(smem_pipe_write);
      if (owner) pipeline.producer_expect_transaction(smem_pipe_write, al_bytes);
      auto* barrier = pipeline.producer_get_barrier(smem_pipe_write);
      const int stage = smem_pipe_write.index();
      const int k = *k_tile_iter;
      copy(params.tma_load_a.with(*barrier, mcast_mask_a), tAgA(_, _, _, k), tAsA(_, _, _, stage));
      copy(params.tma_load_b.with(*barrier, mcast_mask_b), tBgB(_, _, _, k), tBsB(_, _, _, stage));
      if (owner) copy(params.tma_load_al.with(*barrier), tLgL(_, _, _, k), tLsL(_, _, _, stage));
      ++k_tile_iter;
      ++smem_pipe_write;
    }
  }

  // A consumer warpgroup: CUTLASS's pipelined wgmma loop; the owner also accumulates x Aᵀ and
  // publishes t when the loop is done.
  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read, FrgTensorC& accum, int k_tile_count,
                          int thread_idx, TensorStorage& shared_tensors, Params const& params) {
    using namespace cute;
    constexpr int kPipeMmas = 1;  // wgmma batches in flight (CUTLASS's K_PIPE_MMAS)
    cute::Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});
    cute::Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), typename Base::SmemLayoutB{});
    cute::Tensor sAL = make_tensor(make_smem_ptr(shared_tensors.smem_AL.data()), SmemLayoutAL{});
    TiledMma tiled_mma;
    auto thread_mma = tiled_mma.get_slice(thread_idx);
    cute::Tensor tCrA = thread_mma.make_fragment_A(thread_mma.partition_A(sA));  // (MMA, MMA_M, MMA_K, PIPE)
    cute::Tensor tCrB = thread_mma.make_fragment_B(thread_mma.partition_B(sB));  // (MMA, MMA_N, MMA_K, PIPE)
    TiledMmaT tiled_t;
    auto thread_t = tiled_t.get_slice(thread_idx);
    cute::Tensor tTrA = thread_t.make_fragment_A(thread_t.partition_A(sA));
    cute::Tensor tTrB = thread_t.make_fragment_B(thread_t.partition_B(sAL));
    cute::Tensor acc_t = partition_fragment_C(tiled_t, Shape<Int<kBlockM>, Int<kOwnerCols>>{});  // (MMA, 2, 1)

    // The tile's coordinates, once its first k-block has landed.
    const int parity = cutlass::canonical_warp_group_idx() - 1;  // consumer 0 or 1
    {
      auto token = pipeline.consumer_try_wait(smem_pipe_read);
      pipeline.consumer_wait(smem_pipe_read, token);
    }
    const int m_blk = shared_tensors.tile_mn[parity][0];
    const int n_blk = shared_tensors.tile_mn[parity][1];
    const bool owner = n_blk < kOwners;

    PipelineState smem_pipe_release = smem_pipe_read;
    // CUTLASS's loop shape: the first k-tile (zeroing the accumulators) peeled, then wait for the
    // previous k-tile's batch and release its stage after issuing each next one. The owner's x Aᵀ
    // is a batch of its own after the GEMM's (a branch inside a batch makes ptxas serialize the
    // wgmmas), so the owner keeps two batches in flight.
    tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
    tiled_t.accumulate_ = GMMA::ScaleOut::Zero;
    for (int kt = 0; kt < k_tile_count; ++kt) {
      if (kt > 0) {
        auto token = pipeline.consumer_try_wait(smem_pipe_read);
        pipeline.consumer_wait(smem_pipe_read, token);
      }
      const int stage = smem_pipe_read.index();
      warpgroup_fence_operand(accum);
      warpgroup_arrive();
      CUTLASS_PRAGMA_UNROLL
      for (int kb = 0; kb < size<2>(tCrA); ++kb) {  // per k-block: the first one zeroes
        cute::gemm(tiled_mma, tCrA(_, _, kb, stage), tCrB(_, _, kb, stage), accum);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      if (owner) {
        warpgroup_fence_operand(acc_t);
        warpgroup_arrive();
        CUTLASS_PRAGMA_UNROLL
        for (int kb = 0; kb < size<2>(tTrA); ++kb) {
          cute::gemm(tiled_t, tTrA(_, _, kb, stage), tTrB(_, _, kb, stage), acc_t);
          tiled_t.accumulate_ = GMMA::ScaleOut::One;
        }
        warpgroup_commit_batch();
      }
      ++smem_pipe_read;
      if (kt >= kPipeMmas) {
        if (owner) warpgroup_wait<2 * kPipeMmas>();
        else warpgroup_wait<kPipeMmas>();
        warpgroup_fence_operand(accum);
        pipeline.consumer_release(smem_pipe_release);  // the previous k-tile's batches are done
        ++smem_pipe_release;
      }
    }
    warpgroup_fence_operand(accum);
    if (!owner || m_blk * kBlockM >= params.m) return;  // past M (see the epilogue): no rows, no flag

    // The owner: t = s x Aᵀ for its rows, rounded to the operand dtype, then ready[m].
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_t);
    cute::Tensor coords = thread_t.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kOwnerCols>>{}));
    const int row0 = m_blk * kBlockM, col0 = n_blk * kOwnerCols;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(acc_t); ++i) {
      const int row = row0 + get<0>(coords(i));
      if (row < params.m)
        params.t[static_cast<int64_t>(row) * kRank + col0 + get<1>(coords(i))] = Element(acc_t(i) * params.scale);
    }
    cutlass::arch::NamedBarrier::arrive_and_wait(cutlass::NumThreadsPerWarpGroup, kPublishBarrier);
    if (thread_idx == 0) publish_ready(params.ready + m_blk);
  }

  // mma() released all but the last kPipeMmas stages: CUTLASS's mma_tail releases those.

 private:
  int producer_tiles_ = 0;
};

// ---------------------------------------------------------------------------------------------
// The epilogue: CUTLASS's TMA epilogue for D = acc (Base), after z += t Bᵀ, bias and activation.
template <class Base, class Element>
class LoraTEpilogue : public Base {
 public:
  // B's 128 x 16 slice of the tile, the shared-memory operand of the rank-16 wgmma.
  using SmemLayoutBL = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW32_Atom<Element>{},
                                                    cute::Shape<cute::Int<kBlockN>, cute::Int<kRank>>{}));
  using TiledMmaRS = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<Element, Element, float, cute::Shape<cute::_64, cute::Int<kBlockN>, cute::Int<kRank>>>()));

  struct TensorStorage : Base::TensorStorage {
    alignas(128) cute::array_aligned<Element, cute::cosize_v<SmemLayoutBL>> lora_b;
  };
  struct SharedStorage {
    TensorStorage tensors;
    typename Base::PipelineStorage pipeline;
  };

  struct Arguments : Base::Arguments {
    lora_detail::LowRankParams<Element> lowrank;  // left: t [M, 16]; right: B [N, 16]; bias; act
    const int* ready = nullptr;  // null: L is given, no wait
  };
  struct Params : Base::Params {
    lora_detail::LowRankParams<Element> lowrank;
    const int* ready;
  };

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args,
                                                  void* workspace) {
    Params p;
    static_cast<typename Base::Params&>(p) = Base::to_underlying_arguments(problem_shape, args, workspace);
    p.lowrank = args.lowrank;
    p.ready = args.ready;
    return p;
  }

  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem_shape, Arguments const& args) {
    return Base::can_implement(problem_shape, args) && args.lowrank.rank == kRank;
  }

  CUTLASS_HOST_DEVICE LoraTEpilogue(Params const& params, TensorStorage& shared_tensors)
      : Base(params, shared_tensors), lowrank_(params.lowrank), ready_(params.ready) {}

  template <class ProblemShapeMNKL, class TileShapeMNK, class TileCoordMNKL, class AccEngine, class AccLayout,
            class TiledMma>
  CUTLASS_DEVICE auto store(typename Base::LoadPipeline load_pipeline,
                            typename Base::LoadPipelineState load_pipe_consumer_state,
                            typename Base::StorePipeline store_pipeline,
                            typename Base::StorePipelineState store_pipe_producer_state,
                            ProblemShapeMNKL problem_shape_mnkl, TileShapeMNK tile_shape_MNK,
                            TileCoordMNKL tile_coord_mnkl, cute::Tensor<AccEngine, AccLayout> accumulators,
                            TiledMma tiled_mma, int thread_idx, TensorStorage& shared_tensors, int subtile_idx = -1) {
    using namespace cute;
    const int m_total = static_cast<int>(get<0>(problem_shape_mnkl));
    const int n_total = static_cast<int>(get<1>(problem_shape_mnkl));
    const int m_blk = static_cast<int>(get<0>(tile_coord_mnkl));
    const int n0 = static_cast<int>(get<1>(tile_coord_mnkl)) * kBlockN;
    const int m0 = m_blk * kBlockM;

    // B's rows n0 .. n0 + 127 (16-byte chunks: 2 per row, 2 per thread; zero past N).
    cute::Tensor sBL = make_tensor(make_smem_ptr(shared_tensors.lora_b.data()), SmemLayoutBL{});
    CUTLASS_PRAGMA_UNROLL
    for (int c = thread_idx; c < kBlockN * 2; c += cutlass::NumThreadsPerWarpGroup) {
      const int row = c >> 1, half = c & 1;
      uint4 v = make_uint4(0u, 0u, 0u, 0u);
      if (n0 + row < n_total)
        v = *reinterpret_cast<const uint4*>(lowrank_.right + static_cast<int64_t>(n0 + row) * kRank + half * 8);
      *reinterpret_cast<uint4*>(&sBL(row, half * 8)) = v;
    }
    // t's rows: published by the owner of this row block (no flags: L was computed before).
    // The scheduler also hands out tiles past M (its grid is rounded up to the swizzle and the
    // cluster): they have no rows, no owner and no flag, and nothing to wait for. A wait that
    // outlives any owner's mainloop by far (20 s) traps: an error, not a hang.
    if (ready_ != nullptr && thread_idx == 0 && m0 < m_total) {
      const uint64_t start = global_timer_ns();
      while (load_acquire(ready_ + m_blk) < kOwners)
        if (global_timer_ns() - start > 20'000'000'000ull) asm volatile("trap;");
    }
    cutlass::arch::fence_view_async_shared();  // B's stores, before the wgmma reads them
    cutlass::arch::NamedBarrier::arrive_and_wait(cutlass::NumThreadsPerWarpGroup, kEpilogueBarrier);

    TiledMmaRS tiled_rs;
    auto thread_rs = tiled_rs.get_slice(thread_idx);
    cute::Tensor tCsB = thread_rs.partition_B(sBL);
    cute::Tensor tCrB = thread_rs.make_fragment_B(tCsB);
    cute::Tensor t_coords = thread_rs.partition_A(make_identity_tensor(Shape<Int<kBlockM>, Int<kRank>>{}));
    cute::Tensor tCrT = make_tensor<Element>(shape(t_coords));  // the register A operand, in t_coords' order
    CUTE_STATIC_ASSERT_V(size(tCrT) == size(t_coords));
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(tCrT); ++i) {
      const int row = m0 + get<0>(t_coords(i));
      tCrT(i) = row < m_total ? lowrank_.left[static_cast<int64_t>(row) * kRank + get<1>(t_coords(i))] : Element(0);
    }
    cute::Tensor t_words = recast<uint32_t>(tCrT);  // packed before the wgmma batch starts
    warpgroup_fence_operand(t_words);
    warpgroup_fence_operand(accumulators);
    warpgroup_arrive();
    tiled_rs.accumulate_ = GMMA::ScaleOut::One;
    cute::gemm(tiled_rs, tCrT, tCrB, accumulators);
    warpgroup_commit_batch();
    warpgroup_wait<0>();
    warpgroup_fence_operand(accumulators);

    auto acc_coords =
        lora_detail::accumulator_coords(problem_shape_mnkl, tile_shape_MNK, tile_coord_mnkl, tiled_mma, thread_idx);
    lora_detail::bias_act_in_place(lowrank_, accumulators, acc_coords, n_total);
    return Base::store(load_pipeline, load_pipe_consumer_state, store_pipeline, store_pipe_producer_state,
                       problem_shape_mnkl, tile_shape_MNK, tile_coord_mnkl, accumulators, tiled_mma, thread_idx,
                       shared_tensors, subtile_idx);
  }

 private:
  lora_detail::LowRankParams<Element> lowrank_;
  const int* ready_;
};

template <class Element>
struct LoraTConfig {
  using TileShape = lora_detail::TileShape;
  using ClusterShape = lora_detail::ClusterShape;
  static constexpr int kAlignment = 16 / sizeof(Element);
  using BaseEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, cutlass::layout::RowMajor, kAlignment,
      Element, cutlass::layout::RowMajor, kAlignment, cutlass::epilogue::TmaWarpSpecialized>::CollectiveOp;
  using Epilogue = LoraTEpilogue<BaseEpilogue, Element>;
  // The stage count leaves room for the epilogue and for A's slice in every stage (at most 8).
  static constexpr int kCarveout = static_cast<int>(sizeof(typename Epilogue::SharedStorage)) + 8 * kOwnerCols * kBlockK *
                                                                                                    static_cast<int>(sizeof(Element)) + 128;
  using BaseMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, kAlignment, Element,
      cutlass::layout::ColumnMajor, kAlignment, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<kCarveout>,
      cutlass::gemm::KernelTmaWarpSpecializedPingpong>::CollectiveOp;
  using Mainloop = LoraTMainloop<BaseMainloop>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  static_assert(Kernel::SharedStorageSize <= 227 * 1024, "lora (in-GEMM t): shared memory past the sm_90 limit");
};

// Clusters of this kernel resident at once: every CTA of the persistent grid must be (see the top).
template <class Kernel>
int max_active_clusters(int device) {
  static int cached = -1;  // one device kind per process in practice; recomputed if it fails
  if (cached > 0) return cached;
  const void* kernel = reinterpret_cast<const void*>(cutlass::device_kernel<Kernel>);
  FK_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Kernel::SharedStorageSize));
  cudaLaunchConfig_t config{};
  const dim3 cluster(cute::size<0>(typename Kernel::ClusterShape{}), cute::size<1>(typename Kernel::ClusterShape{}), 1);
  config.gridDim = cluster;
  config.blockDim = dim3(Kernel::MaxThreadsPerBlock, 1, 1);
  config.dynamicSmemBytes = Kernel::SharedStorageSize;
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = cluster.x;
  attribute.val.clusterDim.y = cluster.y;
  attribute.val.clusterDim.z = 1;
  config.attrs = &attribute;
  config.numAttrs = 1;
  int clusters = 0;
  FK_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &config));
  (void)device;
  cached = clusters;
  return clusters;
}

template <class Element>
void run_t(const LoraGemmArgs& a, const Stream* stream) {
  using Config = LoraTConfig<Element>;
  using Gemm = typename Config::Gemm;
  using Mainloop = typename Config::Mainloop;
  using Epilogue = typename Config::Epilogue;
  const int m = static_cast<int>(a.lhs.size(0)), k = static_cast<int>(a.lhs.size(1));
  const int n = static_cast<int>(a.out.size(1));
  const int m_blocks = (m + kBlockM - 1) / kBlockM;
  Tensor ready = Tensor::empty({m_blocks}, DType::i32, a.out.device(), stream);
  FK_CUDA_CHECK(cudaMemsetAsync(ready.data(), 0, ready.nbytes(), fk::detail::cuda_stream(stream)));

  typename Mainloop::Arguments ml{};
  ml.ptr_A = static_cast<const Element*>(a.lhs.data());
  ml.ptr_B = static_cast<const Element*>(a.rhs.data());
  lora_detail::operand_strides<true>(m, n, k, ml.dA, ml.dB);
  ml.ptr_AL = static_cast<const Element*>(a.lowrank_a.data());
  ml.ptr_t = static_cast<Element*>(a.lowrank_left.data());
  ml.ready = static_cast<int*>(ready.data());
  ml.scale = a.lowrank_scale;

  auto epi = lora_detail::tma_epilogue_args<Element, Epilogue>(a, m, n);
  epi.ready = static_cast<const int*>(ready.data());

  cutlass::KernelHardwareInfo hw;
  hw.device_id = a.out.device().index;
  hw.sm_count = multiprocessor_count();
  hw.max_active_clusters = max_active_clusters<typename Gemm::GemmKernel>(hw.device_id);
  typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                {m, n, k, 1},
                                ml,
                                epi,
                                hw,
                                lora_detail::scheduler_args<typename Gemm::GemmKernel::TileSchedulerArguments>(a)};
  sm90::run_gemm<Gemm>(args, a.out.device(), stream, "lora (fused GEMM, t in the GEMM)");
}

// L given (t in the forward, s u in the backward's dx), rb = 16: CUTLASS's mainloop unchanged
// (lora_detail::PingpongMainloop) and the epilogue above without the wait: L Rᵀ by one
// register-sourced wgmma per 64 rows instead of mma.sync on the accumulators.
template <class Element, bool RhsNByK>
void run_rs(const LoraGemmArgs& a, const Stream* stream) {
  using BaseEpilogue = typename LoraTConfig<Element>::BaseEpilogue;
  using Epilogue = LoraTEpilogue<BaseEpilogue, Element>;
  using Mainloop = lora_detail::PingpongMainloop<Element, RhsNByK, Epilogue>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  auto epi = lora_detail::tma_epilogue_args<Element, Epilogue>(a, a.lhs.size(0), a.out.size(1));
  epi.ready = nullptr;
  lora_detail::run_plain_mainloop<Gemm, RhsNByK, Element>(a, epi, stream, "lora (fused GEMM, rank-16 wgmma epilogue)");
}

}  // namespace

void lora_gemm_tma_rs(const LoraGemmArgs& args, const Stream* stream) {
  LoraGemmArgs a = args;
  if (a.swizzle == 0 && a.raster == 0) {
    a.swizzle = 4;
    a.raster = 1;
  }
  using cutlass::bfloat16_t, cutlass::half_t;
  const bool bf16 = a.lhs.dtype() == DType::bf16;
  if (a.rhs_is_n_by_k) bf16 ? run_rs<bfloat16_t, true>(a, stream) : run_rs<half_t, true>(a, stream);
  else bf16 ? run_rs<bfloat16_t, false>(a, stream) : run_rs<half_t, false>(a, stream);
}

void lora_gemm_tma_t(const LoraGemmArgs& args, const Stream* stream) {
  // The tile order the k-tile kernel measured fastest: along M in groups of 4 (docs/notes/lora.md).
  LoraGemmArgs a = args;
  if (a.swizzle == 0 && a.raster == 0) {
    a.swizzle = 4;
    a.raster = 1;
  }
  if (a.lhs.dtype() == DType::bf16) run_t<cutlass::bfloat16_t>(a, stream);
  else run_t<cutlass::half_t>(a, stream);
}

}  // namespace fk::cuda
