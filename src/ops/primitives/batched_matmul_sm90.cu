// batched_matmul's Hopper kernel (impl=cute on sm_90): c[i] = a[i] @ b[i] for every batch i with
// CUTLASS 3's SM90 GEMM, the batch as the L mode of the problem shape (M, N, K, L = B).
//
// Operands: a [B, M, K] row-major is CUTLASS's K-major A, b [B, K, N] row-major its N-major B
// (16-bit wgmma reads either major order from shared memory, so b is never transposed); c
// [B, M, N] row-major, f32 or the operands' dtype, fp32 accumulation rounded once.
//
// Mainloop: the collective builder's TMA warp-specialized kernel: a producer warp streams 64-deep
// k-blocks of a and b into swizzled shared memory through TMA (as many stages as fit beside the
// epilogue's buffer), consumer warpgroups run wgmma on them; the persistent tile scheduler walks
// all B * ceil(M/TM) * ceil(N/TN) tiles with one CTA per SM. Epilogue: the builder's TMA epilogue
// (accumulators -> registers rounded to c's dtype -> shared memory -> TMA store), c written once
// and never read. TMA zero-fills loads past the matrix edges and clips stores, so any M, N, K > 0
// is taken; what TMA needs is checked by the caller and answered with `false` (the SM80 CuTe
// kernel then runs): K and N multiples of 8 (16-byte rows), a, b, c 16-byte aligned.
//
// Why this schedule for the benchmarked case (64 x 512^3, bf16): K = 512 is only 8 k-blocks, so the
// epilogue is a large share of a tile's time. The ping-pong kernel gives each of its two
// consumer warpgroups a whole 128x128 tile and lets one run its mainloop while the other stores,
// which hides the epilogue; 512 tiles over 132 SMs is 3.9 waves. Of the schedules measured on the
// H100 (docs/notes/primitives.md) it was the fastest, cooperative 128x128 close behind; clusters
// lost (our reading, not profiled: the operands are L2-resident, so multicast saves only L2
// traffic). One schedule for every dtype pair keeps the file at four instantiations (bf16/f16
// operands x c in f32 or the operand dtype).
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

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
#include "ops/common/cuda_common.cuh"
#include "primitives_cuda.hpp"

namespace fk::cuda {
namespace {

// A kernel configuration: CTA tile (TM x TN, 64-deep k-blocks), cluster of CM CTAs along M
// (sharing each b tile by TMA multicast), ping-pong or cooperative consumer warpgroups.
template <int TM, int TN, int CM, bool kPingpong>
struct Sm90Schedule {};

template <class Element, class ElementC, class Schedule>
struct Sm90BatchedGemm;
template <class Element, class ElementC, int TM, int TN, int CM, bool kPingpong>
struct Sm90BatchedGemm<Element, ElementC, Sm90Schedule<TM, TN, CM, kPingpong>> {
  using TileShape = cute::Shape<cute::Int<TM>, cute::Int<TN>, cute::_64>;  // 64 k of 16 bits: 128-byte rows
  using ClusterShape = cute::Shape<cute::Int<CM>, cute::_1, cute::_1>;
  static constexpr int kAlignAB = 16 / sizeof(Element);  // elements in the 16 bytes TMA moves at least
  static constexpr int kAlignC = 16 / sizeof(ElementC);
  using KernelSchedule = std::conditional_t<kPingpong, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                                            cutlass::gemm::KernelTmaWarpSpecializedCooperative>;
  using EpilogueSchedule = std::conditional_t<kPingpong, cutlass::epilogue::TmaWarpSpecialized,
                                              cutlass::epilogue::TmaWarpSpecializedCooperative>;
  // No source matrix (ElementC void): D = 1 * acc, rounded to ElementC.
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, cutlass::layout::RowMajor, kAlignC,
      ElementC, cutlass::layout::RowMajor, kAlignC, EpilogueSchedule>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, kAlignAB, Element,
      cutlass::layout::RowMajor, kAlignAB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

using DefaultSchedule = Sm90Schedule<128, 128, 1, true>;

// True when this binary holds sm_90a machine code for Gemm's kernel: a library built without
// 90a in FUSEKIT_CUDA_ARCHS would otherwise launch the stub CUTLASS compiles for other targets.
template <class Gemm>
bool has_sm90a_code() {
  static const bool ok = [] {
    cudaFuncAttributes attr{};
    if (cudaFuncGetAttributes(&attr, cutlass::device_kernel<typename Gemm::GemmKernel>) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return attr.binaryVersion == 90;
  }();
  return ok;
}

template <class Element, class ElementC, class Schedule>
bool run_sm90(const TensorView& a, const TensorView& b, const TensorView& c, const Stream* stream) {
  using Gemm = typename Sm90BatchedGemm<Element, ElementC, Schedule>::Gemm;
  if (!has_sm90a_code<Gemm>()) return false;
  const int batch = static_cast<int>(a.size(0)), m = static_cast<int>(a.size(1)), k = static_cast<int>(a.size(2));
  const int n = static_cast<int>(b.size(2));
  using StrideA = typename Gemm::GemmKernel::StrideA;  // (M,K,L)
  using StrideB = typename Gemm::GemmKernel::StrideB;  // (N,K,L)
  using StrideD = typename Gemm::GemmKernel::StrideD;  // (M,N,L)
  using I64 = std::int64_t;
  using cute::_1;
  static_assert(std::is_same_v<StrideA, cute::Stride<I64, _1, I64>>, "a must be K-major");
  static_assert(std::is_same_v<StrideB, cute::Stride<_1, I64, I64>>, "b must be N-major");
  static_assert(std::is_same_v<StrideD, cute::Stride<I64, _1, I64>>, "c must be row-major");
  const StrideA stride_a = cute::make_stride(I64{k}, _1{}, I64{m} * k);
  const StrideB stride_b = cute::make_stride(_1{}, I64{n}, I64{k} * n);
  const StrideD stride_d = cute::make_stride(I64{n}, _1{}, I64{m} * n);
  cutlass::KernelHardwareInfo hw;
  hw.device_id = a.device().index;
  hw.sm_count = multiprocessor_count();
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {m, n, k, batch},
      {static_cast<const Element*>(a.data()), stride_a, static_cast<const Element*>(b.data()), stride_b},
      {{}, nullptr, stride_d, static_cast<ElementC*>(c.data()), stride_d},  // alpha 1, beta 0, no source
      hw};
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return false;
  const std::size_t ws_bytes = Gemm::get_workspace_size(args);
  Tensor workspace;
  if (ws_bytes > 0)
    workspace = Tensor::empty({static_cast<std::int64_t>(ws_bytes)}, DType::u8, a.device(), stream);
  const cudaStream_t s = fk::detail::cuda_stream(stream);
  if (gemm.initialize(args, ws_bytes > 0 ? workspace.data() : nullptr, s) != cutlass::Status::kSuccess)
    throw_internal("batched_matmul: initializing the SM90 GEMM failed");
  if (gemm.run(s) != cutlass::Status::kSuccess) throw_internal("batched_matmul: launching the SM90 GEMM failed");
  FK_CUDA_CHECK_LAUNCH("batched_matmul (SM90 GEMM)");
  return true;
}

template <class Element, class Schedule>
bool run_sm90_for_c(const TensorView& a, const TensorView& b, const TensorView& c, const Stream* stream) {
  return c.dtype() == DType::f32 ? run_sm90<Element, float, Schedule>(a, b, c, stream)
                                 : run_sm90<Element, Element, Schedule>(a, b, c, stream);
}

}  // namespace

bool batched_matmul_sm90(const TensorView& a, const TensorView& b, const TensorView& c, const Stream* stream) {
  const std::int64_t m = a.size(1), k = a.size(2), n = b.size(2);
  if (m == 0 || k == 0 || n == 0) return false;
  if (k % 8 != 0 || n % 8 != 0) return false;  // TMA: every row and matrix starts 16-byte aligned
  for (const TensorView* t : {&a, &b, &c})
    if (reinterpret_cast<std::uintptr_t>(t->data()) % 16 != 0) return false;
  const int device = a.device().index;
  if (!is_sm90(device)) return false;  // sm_90a code runs on sm_90 only

  switch (a.dtype()) {
    case DType::bf16: return run_sm90_for_c<cutlass::bfloat16_t, DefaultSchedule>(a, b, c, stream);
    case DType::f16: return run_sm90_for_c<cutlass::half_t, DefaultSchedule>(a, b, c, stream);
    default: return false;
  }
}

}  // namespace fk::cuda
