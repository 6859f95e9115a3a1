// The members CUTLASS's sm90 GEMM kernels (GemmUniversal + GemmUniversalAdapter) look up on a
// collective epilogue, for hand-written epilogues that keep no shared memory and store straight
// from the accumulator registers (NoSmemWarpSpecialized): glu_gemm.cu and lora_gemm.cu derive
// their epilogues from it and add Arguments (= Params), can_implement and the per-tile work.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include <string>

#include <cute/tensor.hpp>
#include <cutlass/cuda_host_adapter.hpp>
#include <cutlass/epilogue/dispatch_policy.hpp>

#include "fusekit/core/cuda_check.hpp"
#include "fusekit/core/error.hpp"
#include "fusekit/core/tensor.hpp"

namespace fk::cuda::sm90 {

template <class Element>
struct NoSmemEpilogueBase {
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
  struct ThreadEpilogueOp {  // what GemmUniversalAdapter looks up; the epilogue's work is elsewhere
    using ElementOutput = Element;
    using ElementAccumulator = float;
    using ElementCompute = float;
  };

  // The host side of an epilogue whose Params are its Arguments and that needs no workspace.
  template <class ProblemShape, class Args>
  static constexpr Args to_underlying_arguments(ProblemShape const&, Args const& args, void*) {
    return args;
  }
  template <class ProblemShape, class Args>
  static size_t get_workspace_size(ProblemShape const&, Args const&) {
    return 0;
  }
  template <class ProblemShape, class Args>
  static cutlass::Status initialize_workspace(ProblemShape const&, Args const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
};

// Runs a CUTLASS GemmUniversalAdapter `Gemm` on `args` (its workspace, if any, from fusekit's
// allocator on `device`); a CUTLASS status other than success is an internal error naming `what`.
template <class Gemm>
void run_gemm(const typename Gemm::Arguments& args, Device device, const Stream* stream, const char* what) {
  Gemm gemm;
  const auto fail = [&](const char* step) { throw_internal((std::string(what) + ": " + step).c_str()); };
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) fail("the GEMM rejected a shape the dispatch accepted");
  const std::size_t ws_bytes = Gemm::get_workspace_size(args);
  Tensor workspace;
  if (ws_bytes > 0) workspace = Tensor::empty({static_cast<std::int64_t>(ws_bytes)}, DType::u8, device, stream);
  const cudaStream_t s = fk::detail::cuda_stream(stream);
  if (gemm.initialize(args, ws_bytes > 0 ? workspace.data() : nullptr, s) != cutlass::Status::kSuccess)
    fail("initializing the GEMM failed");
  if (gemm.run(s) != cutlass::Status::kSuccess) fail("launching the GEMM failed");
  FK_CUDA_CHECK_LAUNCH(what);
}

}  // namespace fk::cuda::sm90
