// The gated MLP's backward from kept pre-activations on Hopper: the down projection's input
// gradient dh = dy down_w formed by the tensor cores, and the GLU's derivative applied to it in the
// epilogue, so dh [M, N] never reaches memory.
//
// Mainloop: CUTLASS 3's SM90 TMA warp-specialized ping-pong GEMM, dy the K-major A operand
// [M, K'], down_w [K', N] the N-major B operand (the tensor cores read it transposed), 128 x 128
// tiles, clusters of 2 along N sharing dy by multicast; each consumer warpgroup's epilogue runs
// under the other's mainloop.
//
// Epilogue: CUTLASS's TMA warp-specialized epilogue with a visitor tree. Its producer warp streams
// the source tile by TMA into shared memory while the mainloop runs; the source is C [M, 2N] viewed
// as [M, N] 32-bit words, each the (L, R) pair of one column of dh in the prepared order (L in the
// low half). The words travel as `float` so that CUTLASS's conversions, all float to float, copy
// their bits; only the two functors below read them as pairs. The tree:
//
//   D   [M, N]  = Act(Aux, C)          glu(L, R), the activation (the down projection's weight
//                                      gradient's operand), stored by the epilogue's TMA store
//   Aux [M, N]  = Grad(acc, C)         the (dL, dR) pairs of dC = dh * glu'(L, R), 32-bit words
//                                      stored by TMA (Sm90AuxStore) into dC [M, 2N]
//
// Arithmetic in fp32 from dh's fp32 accumulators, dC and glu(C) rounded once, with the fused forward's
// fast activations (glu_math.cuh, Fast = true; see docs/glu.md for why and their accuracy).
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>
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

// The two visitor functors. Sm90Compute hands them Arrays of float; a word of C is the bits of one
// (L, R) pair of Element.
template <class Element, GluKind Kind>
struct PairOps {
  CUTLASS_DEVICE static float half_of(float word, int hi) {
    const uint32_t w = __float_as_uint(word);
    const uint16_t bits = static_cast<uint16_t>(hi ? w >> 16 : w & 0xffffu);
    return static_cast<float>(reinterpret_cast<Element const&>(bits));
  }
  CUTLASS_DEVICE static float pack2(float lo, float hi) {
    cutlass::Array<Element, 2> p;
    p[0] = Element(lo);
    p[1] = Element(hi);
    return __uint_as_float(reinterpret_cast<uint32_t const&>(p));
  }

  // (dh, C) -> the (dL, dR) pair's bits.
  template <class Frag>
  struct Grad {
    CUTLASS_DEVICE Frag operator()(Frag const& dh, Frag const& c) const {
      Frag out;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < Frag::kElements; ++i) {
        float dl, dr;
        fk::device::glu_grad<Kind, true>(half_of(c[i], 0), half_of(c[i], 1), dh[i], dl, dr);
        out[i] = pack2(dl, dr);
      }
      return out;
    }
  };

  // (anything, C) -> glu(L, R): the first operand only orders the tree (dC's store before D).
  template <class Frag>
  struct Act {
    CUTLASS_DEVICE Frag operator()(Frag const&, Frag const& c) const {
      Frag out;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < Frag::kElements; ++i)
        out[i] = fk::device::glu<Kind, true>(half_of(c[i], 0), half_of(c[i], 1));
      return out;
    }
  };
};

template <class Element, GluKind Kind>
struct DgradConfig {
  using TileShape = cute::Shape<cute::_128, cute::_128, cute::_64>;
  using ClusterShape = cute::Shape<cute::_1, cute::_2, cute::_1>;
  using KernelSchedule = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
  using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecialized;
  using Word = float;  // one (L, R) pair of C or dC
  static constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;
  static constexpr int kAlignment = 16 / sizeof(Element);

  using EpiDesc = cutlass::epilogue::collective::detail::EpilogueDescriptor<
      TileShape, cutlass::epilogue::collective::EpilogueTileAuto, Word, Element, EpilogueSchedule>;
  using AuxDesc = cutlass::epilogue::collective::detail::AuxStoreDescriptor<EpiDesc, cutlass::layout::RowMajor, Word>;
  using Ops = PairOps<Element, Kind>;
  using GradNode = cutlass::epilogue::fusion::Sm90EVT<
      cutlass::epilogue::fusion::Sm90Compute<Ops::template Grad, Word, float, kRound>,
      cutlass::epilogue::fusion::Sm90AccFetch, cutlass::epilogue::fusion::Sm90SrcFetch<Word>>;
  using AuxNode = cutlass::epilogue::fusion::Sm90EVT<
      cutlass::epilogue::fusion::Sm90AuxStore<AuxDesc::Stages, typename EpiDesc::EpilogueTile, Word, kRound,
                                              typename AuxDesc::Stride, typename AuxDesc::SmemLayoutAtom,
                                              typename AuxDesc::CopyOpR2S>,
      GradNode>;
  using Tree = cutlass::epilogue::fusion::Sm90EVT<
      cutlass::epilogue::fusion::Sm90Compute<Ops::template Act, Element, float, kRound>, AuxNode,
      cutlass::epilogue::fusion::Sm90SrcFetch<Word>>;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, Word, cutlass::layout::RowMajor,
      16 / sizeof(Word), Element, cutlass::layout::RowMajor, kAlignment, EpilogueSchedule, Tree>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, kAlignment, Element,
      cutlass::layout::RowMajor, kAlignment, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

template <class Element, GluKind Kind>
void run_dgrad(const TensorView& dy, const TensorView& down_w, const TensorView& preact, const TensorView& dpreact,
               const TensorView& act, const Stream* stream) {
  using Config = DgradConfig<Element, Kind>;
  using Gemm = typename Config::Gemm;
  using Word = typename Config::Word;
  const int m = static_cast<int>(dy.size(0)), k = static_cast<int>(dy.size(1)), n = static_cast<int>(down_w.size(1));
  using StrideA = typename Gemm::GemmKernel::StrideA;
  using StrideB = typename Gemm::GemmKernel::StrideB;
  using StrideC = typename Gemm::GemmKernel::StrideC;
  using StrideD = typename Gemm::GemmKernel::StrideD;
  using StrideAux = typename Config::AuxDesc::Stride;
  static_assert(cute::is_same_v<StrideA, cute::Stride<int64_t, cute::Int<1>, int64_t>>,
                "glu dgrad: the GEMM expects a K-major dy");
  static_assert(cute::is_same_v<StrideB, cute::Stride<cute::Int<1>, int64_t, int64_t>>,
                "glu dgrad: the GEMM expects an N-major down_w");
  const StrideA stride_a = cute::make_stride(int64_t{k}, cute::Int<1>{}, int64_t{m} * k);
  const StrideB stride_b = cute::make_stride(cute::Int<1>{}, int64_t{n}, int64_t{n} * k);
  // C, dC ([M, 2N] of Element) and D ([M, N]) are all [M, N] row-major in their own units.
  StrideC stride_c{};
  cute::get<0>(stride_c) = int64_t{n};
  cute::get<2>(stride_c) = int64_t{m} * n;
  StrideD stride_d{};
  cute::get<0>(stride_d) = int64_t{n};
  cute::get<2>(stride_d) = int64_t{m} * n;
  StrideAux stride_aux{};
  cute::get<0>(stride_aux) = int64_t{n};
  cute::get<2>(stride_aux) = int64_t{m} * n;
  cutlass::KernelHardwareInfo hw;
  hw.device_id = dy.device().index;
  hw.sm_count = multiprocessor_count();
  typename Config::Tree::Arguments tree{
      {                                              // AuxNode
       {{}, {}, {}},                                 //   GradNode: accumulator, source, compute
       {static_cast<Word*>(dpreact.data()), stride_aux}},  //   the aux store: dC
      {},                                            // the source
      {}};                                           // Act
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {m, n, k, 1},
      {static_cast<const Element*>(dy.data()), stride_a, static_cast<const Element*>(down_w.data()), stride_b},
      {tree, static_cast<const Word*>(preact.data()), stride_c, static_cast<Element*>(act.data()), stride_d},
      hw};
  sm90::run_gemm<Gemm>(args, dy.device(), stream, "glu_backward_from_preact (fused down-projection GEMM)");
}

template <class Element>
void run_kind(GluKind kind, const TensorView& dy, const TensorView& down_w, const TensorView& preact,
              const TensorView& dpreact, const TensorView& act, const Stream* stream) {
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
  if (act == nullptr) return false;  // the activation is the epilogue's D: without it, the unfused pass
  const std::int64_t m = dy.size(0), k = dy.size(1), n = down_w.size(1);
  // TMA needs 16-byte rows and 16-byte aligned bases of dy, down_w, C, dC and out.
  if (k % 8 != 0 || n % 8 != 0 || m == 0 || k == 0) return false;
  for (const TensorView* p : {&dy, &down_w, &preact, &dpreact, act})
    if (!aligned16(p->data())) return false;
  if (m > INT32_MAX / 2 || 2 * n > INT32_MAX / 2 || k > INT32_MAX / 2) return false;
  const fk::detail::DeviceScope on_device(dy.device().index);
  if (!is_sm90(dy.device().index)) return false;
  if (t == DType::bf16) run_kind<cutlass::bfloat16_t>(kind, dy, down_w, preact, dpreact, *act, stream);
  else run_kind<cutlass::half_t>(kind, dy, down_w, preact, dpreact, *act, stream);
  return true;
}

}  // namespace fk::cuda
