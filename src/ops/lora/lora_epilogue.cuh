// The per-tile work of the fused LoRA GEMM's epilogues (lora_gemm.cu: the no-shared-memory
// epilogue; lora_gemm_tma.cu: CUTLASS's TMA warp-specialized epilogue), on the fp32 accumulator
// fragment of one consumer warpgroup: the rank-r term L Rᵀ by mma.sync, then bias and activation.
//
// A wgmma accumulator fragment is, per warp, a stack of m16n8 tiles laid out exactly like the C
// fragment of mma.sync.m16n8k16: lane (g = lane / 4, q = lane % 4) holds (row g, cols 2q, 2q + 1)
// and (row g + 8, same cols) of every 8-column chunk. So each warp adds its slice of L Rᵀ with
// rb / 16 mma.sync per chunk straight onto the accumulators: the A fragment is rows of L, the B
// fragment rows of R, both read from global memory (L2) 8 bytes at a time, zero outside the
// problem. L and R come zero-padded to rb = 16 ceil(r / 16) columns (lora.cpp), so the fragments
// need no checks along r.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/numeric_types.h>

#include "fusekit/ops/pointwise.hpp"
#include "ops/common/activations.cuh"

namespace fk::cuda::lora_detail {

template <class Element>
struct LowRankParams {
  const Element* left = nullptr;   // L [M, rank], row-major
  const Element* right = nullptr;  // R [N, rank], row-major
  int rank = 0;                    // a multiple of 16 (the adapter's r, zero-padded); 0: no term
  const Element* bias = nullptr;   // [N] or null
  Activation act = Activation::identity;
};

// The (m, n) coordinate of every accumulator this thread holds: (MMA, MMA_M, MMA_N).
template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class TiledMma>
CUTLASS_DEVICE auto accumulator_coords(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_mnk,
                                       BlockCoordMNKL blk_coord_mnkl, TiledMma tiled_mma, int thread_idx) {
  using namespace cute;
  const int m_total = static_cast<int>(get<0>(problem_shape_mnkl));
  const int n_total = static_cast<int>(get<1>(problem_shape_mnkl));
  auto coords = local_tile(make_identity_tensor(make_shape(m_total, n_total)), take<0, 2>(blk_shape_mnk),
                           make_coord(get<0>(blk_coord_mnkl), get<1>(blk_coord_mnkl)));  // (BLK_M, BLK_N)
  return tiled_mma.get_thread_slice(thread_idx).partition_C(coords);                    // (MMA, MMA_M, MMA_N)
}

// acc += L Rᵀ. The accumulator fragment is (V, MMA_M, MMA_N), V = (2, 2, chunks): values
// 4c .. 4c + 3 of mode V are one m16n8 C fragment of this thread's warp, (row, col),
// (row, col + 1), (row + 8, col), (row + 8, col + 1), with row = g and col = 2q within the warp's
// 16-row, 8-column block. Rows depend on MMA_M only, columns on (chunk, MMA_N) only: the A
// fragments (rows of L) are loaded once per MMA_M block, the B fragments (rows of R) once per
// chunk. The contraction over j may run in any order, so lane q takes j = 4q .. 4q + 3 of each
// 16 as its k indices (2q, 2q + 1, 2q + 8, 2q + 9): one 8-byte load per fragment row.
template <class Element, class Acc, class Coords>
CUTLASS_DEVICE void add_low_rank(LowRankParams<Element> const& p, Acc& acc, Coords const& t_coords, int m_total,
                                 int n_total) {
  using namespace cute;
  constexpr int kChunks = decltype(size<0>(acc))::value / 4;
  constexpr int kBlocksM = decltype(size<1>(acc))::value;
  constexpr int kBlocksN = decltype(size<2>(acc))::value;
  static_assert(decltype(rank(acc))::value == 3, "lora epilogue: expected a (V, MMA_M, MMA_N) fragment");
  static_assert(decltype(size<0>(acc))::value % 4 == 0, "lora epilogue: accumulators come in m16n8 quads");
  const uint2* left = reinterpret_cast<const uint2*>(p.left);
  const uint2* right = reinterpret_cast<const uint2*>(p.right);
  const int quads = p.rank / 4;  // 8-byte words per row of L and R
  const int g = get<0>(t_coords(0, 0, 0)) & 7, q = (get<1>(t_coords(0, 0, 0)) & 7) >> 1;
  for (int kb = 0; kb < quads; kb += 4) {
    uint2 a0[kBlocksM], a8[kBlocksM];  // rows m and m + 8: (a0, a2) and (a1, a3)
    CUTLASS_PRAGMA_UNROLL
    for (int mb = 0; mb < kBlocksM; ++mb) {
      const int m = get<0>(t_coords(0, mb, 0));
      const int64_t w = static_cast<int64_t>(m) * quads + kb + q;
      a0[mb] = m < m_total ? __ldg(left + w) : make_uint2(0u, 0u);
      a8[mb] = m + 8 < m_total ? __ldg(left + w + 8 * quads) : make_uint2(0u, 0u);
    }
    CUTLASS_PRAGMA_UNROLL
    for (int nb = 0; nb < kBlocksN; ++nb) {
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < kChunks; ++c) {
        const int col = (get<1>(t_coords(4 * c, 0, nb)) & ~7) + g;  // the row of R this lane feeds
        const uint2 b = col < n_total ? __ldg(right + static_cast<int64_t>(col) * quads + kb + q) : make_uint2(0u, 0u);
        CUTLASS_PRAGMA_UNROLL
        for (int mb = 0; mb < kBlocksM; ++mb) {
          float& c0 = acc(4 * c, mb, nb);
          float& c1 = acc(4 * c + 1, mb, nb);
          float& c2 = acc(4 * c + 2, mb, nb);
          float& c3 = acc(4 * c + 3, mb, nb);
          if constexpr (cute::is_same_v<Element, cutlass::bfloat16_t>) {
            asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                "{%8, %9}, {%0, %1, %2, %3};\n"
                : "+f"(c0), "+f"(c1), "+f"(c2), "+f"(c3)
                : "r"(a0[mb].x), "r"(a8[mb].x), "r"(a0[mb].y), "r"(a8[mb].y), "r"(b.x), "r"(b.y));
          } else {
            asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                "{%8, %9}, {%0, %1, %2, %3};\n"
                : "+f"(c0), "+f"(c1), "+f"(c2), "+f"(c3)
                : "r"(a0[mb].x), "r"(a8[mb].x), "r"(a0[mb].y), "r"(a8[mb].y), "r"(b.x), "r"(b.y));
          }
        }
      }
    }
  }
}

// acc = act(acc + bias) in place (the TMA epilogue then only converts and stores). The bias
// pair of each column pair is loaded once per (chunk, MMA_N) and serves every MMA_M block. N is
// a multiple of 8 on this path (TMA rows), so a pair is either inside or past the problem.
template <Activation A, class Element, class Acc, class Coords>
CUTLASS_DEVICE void bias_act_in_place(const Element* bias, Acc& acc, Coords const& t_coords, int n_total) {
  using namespace cute;
  constexpr int kChunks = decltype(size<0>(acc))::value / 4;
  constexpr int kBlocksM = decltype(size<1>(acc))::value;
  constexpr int kBlocksN = decltype(size<2>(acc))::value;
  using Pair = cutlass::Array<Element, 2>;
  CUTLASS_PRAGMA_UNROLL
  for (int nb = 0; nb < kBlocksN; ++nb) {
    CUTLASS_PRAGMA_UNROLL
    for (int c = 0; c < kChunks; ++c) {
      float b0 = 0.f, b1 = 0.f;
      if (bias != nullptr) {
        const int n = get<1>(t_coords(4 * c, 0, nb));
        if (n < n_total) {
          const Pair b = *reinterpret_cast<const Pair*>(bias + n);
          b0 = static_cast<float>(b[0]);
          b1 = static_cast<float>(b[1]);
        }
      }
      CUTLASS_PRAGMA_UNROLL
      for (int mb = 0; mb < kBlocksM; ++mb)
        CUTLASS_PRAGMA_UNROLL
        for (int e = 0; e < 4; ++e) {
          float& z = acc(4 * c + e, mb, nb);
          z = fk::device::activation<A>(z + ((e & 1) ? b1 : b0));
        }
    }
  }
}

template <class Element, class Acc, class Coords>
CUTLASS_DEVICE void bias_act_in_place(LowRankParams<Element> const& p, Acc& acc, Coords const& t_coords, int n_total) {
  if (p.bias == nullptr && p.act == Activation::identity) return;
  switch (p.act) {
    case Activation::identity: return bias_act_in_place<Activation::identity>(p.bias, acc, t_coords, n_total);
    case Activation::relu: return bias_act_in_place<Activation::relu>(p.bias, acc, t_coords, n_total);
    case Activation::sigmoid: return bias_act_in_place<Activation::sigmoid>(p.bias, acc, t_coords, n_total);
    case Activation::tanh: return bias_act_in_place<Activation::tanh>(p.bias, acc, t_coords, n_total);
    case Activation::gelu_tanh: return bias_act_in_place<Activation::gelu_tanh>(p.bias, acc, t_coords, n_total);
    case Activation::gelu_erf: return bias_act_in_place<Activation::gelu_erf>(p.bias, acc, t_coords, n_total);
    case Activation::silu: return bias_act_in_place<Activation::silu>(p.bias, acc, t_coords, n_total);
  }
}

}  // namespace fk::cuda::lora_detail

#include "lora_cuda.hpp"
#include "ops/common/cuda_common.cuh"
#include "ops/common/sm90_epilogue.cuh"

namespace fk::cuda::lora_detail {

template <class Element>
LowRankParams<Element> lowrank_params(const LoraGemmArgs& a) {
  return {static_cast<const Element*>(a.lowrank_left.data()), static_cast<const Element*>(a.lowrank_right.data()),
          static_cast<int>(a.lowrank_left.size(1)), a.bias ? static_cast<const Element*>(a.bias->data()) : nullptr,
          a.act};
}

// The arguments of an epilogue derived from CUTLASS's TMA epilogue for a plain D = acc:
// D = out [M, N] row-major, no C, and the rank-r, bias and activation parameters.
template <class Element, class Epilogue>
typename Epilogue::Arguments tma_epilogue_args(const LoraGemmArgs& a, std::int64_t m, std::int64_t n) {
  using StrideD = typename Epilogue::StrideD;
  const StrideD stride_d = cute::make_stride(n, cute::Int<1>{}, m * n);
  typename Epilogue::Arguments epi{};
  epi.thread.alpha = 1.0f;
  epi.thread.beta = 0.0f;
  epi.ptr_C = nullptr;
  epi.dC = stride_d;
  epi.ptr_D = static_cast<Element*>(a.out.data());
  epi.dD = stride_d;
  epi.lowrank = lowrank_params<Element>(a);
  return epi;
}

// The mainloop every fused LoRA GEMM uses: CUTLASS's SM90 TMA warp-specialized ping-pong, 128 x 128
// x 64 tiles (the two warpgroups on alternate tiles), clusters of 2 along N, as many stages as fit
// beside the epilogue's shared storage. RhsNByK: rhs is [N, Kg] (K-major, the forward); else
// [Kg, N] (N-major, the backward's dx).
using TileShape = cute::Shape<cute::_128, cute::_128, cute::_64>;
using ClusterShape = cute::Shape<cute::_1, cute::_2, cute::_1>;
template <class Element, bool RhsNByK, class Epilogue>
using PingpongMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, 16 / sizeof(Element),
    Element, cute::conditional_t<RhsNByK, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>,
    16 / sizeof(Element), float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
    cutlass::gemm::KernelTmaWarpSpecializedPingpong>::CollectiveOp;

// The strides of lhs [M, Kg] and rhs ([N, Kg] or [Kg, N]) in CUTLASS's (row, k, batch) form.
template <bool RhsNByK, class StrideA, class StrideB>
void operand_strides(std::int64_t m, std::int64_t n, std::int64_t kg, StrideA& a, StrideB& b) {
  a = cute::make_stride(kg, cute::Int<1>{}, m * kg);
  if constexpr (RhsNByK) b = cute::make_stride(kg, cute::Int<1>{}, n * kg);
  else b = cute::make_stride(cute::Int<1>{}, n, n * kg);
}

// The persistent tile scheduler's arguments: swizzle and raster order from the args (lora_test
// runs a few), else CUTLASS's defaults.
template <class SchedulerArgs>
SchedulerArgs scheduler_args(const LoraGemmArgs& a) {
  SchedulerArgs s{};
  if (a.swizzle > 0) s.max_swizzle_size = a.swizzle;
  using Raster = decltype(s.raster_order);
  if (a.raster == 1) s.raster_order = Raster::AlongM;
  else if (a.raster == 2) s.raster_order = Raster::AlongN;
  return s;
}

// Runs `Gemm` (a GemmUniversalAdapter over PingpongMainloop, plain TMA operands) for
// out [M, N] = lhs · op(rhs) with the epilogue arguments `epi`.
template <class Gemm, bool RhsNByK, class Element, class EpilogueArgs>
void run_plain_mainloop(const LoraGemmArgs& a, const EpilogueArgs& epi, const Stream* stream, const char* what) {
  const int m = static_cast<int>(a.lhs.size(0)), kg = static_cast<int>(a.lhs.size(1));
  const int n = static_cast<int>(a.out.size(1));
  typename Gemm::GemmKernel::StrideA stride_a;
  typename Gemm::GemmKernel::StrideB stride_b;
  operand_strides<RhsNByK>(m, n, kg, stride_a, stride_b);
  cutlass::KernelHardwareInfo hw;
  hw.device_id = a.out.device().index;
  hw.sm_count = multiprocessor_count();
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {m, n, kg, 1},
      {static_cast<const Element*>(a.lhs.data()), stride_a, static_cast<const Element*>(a.rhs.data()), stride_b},
      epi,
      hw,
      scheduler_args<typename Gemm::GemmKernel::TileSchedulerArguments>(a)};
  sm90::run_gemm<Gemm>(args, a.out.device(), stream, what);
}

}  // namespace fk::cuda::lora_detail
