// The fused LoRA GEMM on Hopper: z = lhs · op(rhs) + bias + L Rᵀ on the tensor cores (r <= 64),
// then act(z) stored.
// Forward: lhs = x, rhs = W [N, K], L = t = s x Aᵀ [M, r], R = B [N, r]. Backward (dx): lhs = g
// [M, N], rhs = W used as [K_g, N_out], L = s u [M, r], R = Aᵀ (A itself for the k-tile path).
//
// Mainloop: CUTLASS 3's SM90 TMA warp-specialized ping-pong GEMM, 128 x 128 tiles, clusters of 2
// along N sharing the lhs tile by multicast (with the TMA epilogue and no rank-r term it runs at
// the cuBLAS GEMM's speed: docs/notes/lora.md). Both operands are read once per tile by TMA; L and
// R are small (t: 256 KiB at M = 8192, r = 16) and come from L2.
//
// Three ways to finish the tile (lora_cuda.hpp, LoraEpilogueKind), all on the same mainloop:
//  - registers (this file, LoraEpilogue, CUTLASS's no-shared-memory epilogue interface): the
//    rank-r term by mma.sync on the accumulators (lora_epilogue.cuh), then bias, activation and
//    one 2-element store per (row, column pair); the only one that also writes z (preact);
//  - tma (lora_gemm_tma.cu): the same register work, then CUTLASS's TMA warp-specialized
//    collective epilogue (smem staging, TMA stores);
//  - tma_ktile (lora_gemm_tma.cu): the rank-r term as one more mainloop k-tile, then the TMA
//    epilogue with bias and activation only.
// lora_gemm_fused picks (automatic): registers when preact is asked for, else the TMA kernels.
// Nothing of shape [M, N] besides the output is read or written.
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
#include "ops/common/sm90_epilogue.cuh"
#include "ops/common/cuda_common.cuh"
#include "ops/common/activations.cuh"
#include "lora_epilogue.cuh"

namespace fk::cuda {
namespace {

template <class Element>
class LoraEpilogue : public sm90::NoSmemEpilogueBase<Element> {
 public:
  using Base = sm90::NoSmemEpilogueBase<Element>;
  using typename Base::ElementAccumulator;
  using typename Base::StrideC;
  using typename Base::StrideD;
  using typename Base::SharedStorage;

  struct Arguments {
    lora_detail::LowRankParams<Element> lowrank;
    Element* out = nullptr;     // [M, N]
    Element* preact = nullptr;  // [M, N] or null
  };
  using Params = Arguments;

  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    return args.out != nullptr && args.lowrank.rank >= 0 && args.lowrank.rank <= 64 && args.lowrank.rank % 16 == 0;
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
    auto t_coords = lora_detail::accumulator_coords(problem_shape_mnkl, blk_shape_mnk, blk_coord_mnkl, tiled_mma,
                                                    thread_idx);
    static_assert(is_static<FrgLayout>::value, "lora epilogue: the accumulator layout must be static");
    CUTE_STATIC_ASSERT_V(size(t_coords) == size(acc));
    lora_detail::add_low_rank(params_.lowrank, acc, t_coords, m_total, n_total);
    switch (params_.lowrank.act) {
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
  // Bias, activation and one 2-element store per (row, column pair); N is even and out, preact,
  // bias 4-byte aligned (lora_gemm_fused checks).
  template <Activation A, class Acc, class Coords>
  CUTLASS_DEVICE void store(Acc const& acc, Coords const& t_coords, int m_total, int n_total) {
    using Pair = cutlass::Array<Element, 2>;
    constexpr int kPairs = decltype(cute::size(acc))::value / 2;
    const Element* bias = params_.lowrank.bias;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kPairs; ++i) {
      const int m = cute::get<0>(t_coords(2 * i));
      const int n = cute::get<1>(t_coords(2 * i));
      if (m >= m_total || n >= n_total) continue;
      float z0 = acc(2 * i), z1 = acc(2 * i + 1);
      if (bias != nullptr) {
        const Pair b = *reinterpret_cast<const Pair*>(bias + n);
        z0 += static_cast<float>(b[0]);
        z1 += static_cast<float>(b[1]);
      }
      const int64_t at = static_cast<int64_t>(m) * n_total + n;
      Pair v;
      if (params_.preact != nullptr) {
        v[0] = Element(z0);
        v[1] = Element(z1);
        *reinterpret_cast<Pair*>(params_.preact + at) = v;
      }
      v[0] = Element(fk::device::activation<A>(z0));
      v[1] = Element(fk::device::activation<A>(z1));
      *reinterpret_cast<Pair*>(params_.out + at) = v;
    }
  }

  Params params_;
};

// The register-store epilogue (LoraEpilogue above) on lora_detail::PingpongMainloop. (The
// cooperative schedule, 128 x 256 tiles, measured slower in every case on the H100 and was
// dropped: docs/notes/lora.md.)
template <class Element, bool RhsNByK>
struct LoraGemmConfig {
  using Epilogue = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<LoraEpilogue<Element>>;
  using Mainloop = lora_detail::PingpongMainloop<Element, RhsNByK, Epilogue>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

template <class Element, bool RhsNByK>
void run_fused(const LoraGemmArgs& a, const Stream* stream) {
  using Gemm = typename LoraGemmConfig<Element, RhsNByK>::Gemm;
  const typename LoraEpilogue<Element>::Arguments epi{
      lora_detail::lowrank_params<Element>(a), static_cast<Element*>(a.out.data()),
      a.preact ? static_cast<Element*>(a.preact->data()) : nullptr};
  lora_detail::run_plain_mainloop<Gemm, RhsNByK, Element>(a, epi, stream, "lora (fused GEMM)");
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
  if (m > INT32_MAX / 2 || n > INT32_MAX / 2 || kg > INT32_MAX / 2) return false;
  if (!aligned16(a.lhs.data()) || !aligned16(a.rhs.data())) return false;
  // 8-byte fragment loads of L and R; 2-element stores and bias loads; TMA stores of out.
  for (const TensorView* v : {&a.lowrank_left, &a.lowrank_right, &a.out, a.preact, a.bias})
    if (v != nullptr && !aligned16(v->data())) return false;
  if (a.lowrank_left.size(1) == 0 || a.lowrank_left.size(1) % 16 != 0 ||
      a.lowrank_right.size(1) != a.lowrank_left.size(1))
    return false;
  if (a.lowrank_left.size(1) > 64) return false;
  const bool in_gemm_t = a.lowrank_a.data() != nullptr;
  // t inside the GEMM: its two owners per row block are N-blocks 0 and 1, so N > 128.
  if (in_gemm_t && (!a.rhs_is_n_by_k || a.preact != nullptr || a.lowrank_left.size(1) != 16 || n <= 128 ||
                    a.lowrank_a.size(0) != 16 || a.lowrank_a.size(1) != kg || !aligned16(a.lowrank_a.data())))
    return false;
  const fk::detail::DeviceScope on_device(a.out.device().index);
  if (!is_sm90(a.out.device().index)) return false;
  if (in_gemm_t) {
    lora_gemm_tma_t(a, stream);
    return true;
  }
  // The TMA epilogue stores one output; the registers one also writes preact.
  const bool tma = a.preact == nullptr && a.epilogue != LoraEpilogueKind::registers;
  if (tma) {
    lora_gemm_tma(a, stream);
    return true;
  }
  if (t == DType::bf16) run_layout<cutlass::bfloat16_t>(a, stream);
  else run_layout<cutlass::half_t>(a, stream);
  return true;
}

}  // namespace fk::cuda
