// The two CUDA implementations of DLRM behind fk::models::Dlrm (see docs/dlrm.md):
//
//   reference  what a plain PyTorch port runs: cuBLAS GEMM, then separate bias and ReLU kernels;
//              one embedding launch per table; dense table gradients (a [rows, D] gradient per
//              table, zeroed and scattered into every step, then a dense optimizer pass); the dot
//              interaction as cat + cuBLAS bmm + gather (its backward: scatter + bmm); sigmoid,
//              BCE and its gradient as three kernels; no graph.
//   fused      cuBLASLt GEMMs with the bias + ReLU epilogue; the ReLU derivative fused with the
//              bias gradient (one pass); all tables in one embedding launch with the hash fused
//              in; the embedding backward fused with the optimizer (sort by row, deterministic
//              segmented sums, update in place: no table gradient exists); one-kernel dot
//              interaction forward and backward; one-kernel sigmoid + BCE + gradient; one
//              optimizer launch for every MLP parameter; the whole training step replayed as a
//              CUDA graph.
//
// Both keep fp32 parameters; the MLP GEMMs run on TF32 tensor cores when DlrmConfig::allow_tf32.
#pragma once

#include <cstddef>
#include <iosfwd>
#include <memory>
#include <vector>

#include "fusekit/core/trace.hpp"
#include "fusekit/models/dlrm.hpp"

namespace fk::models::gpu {

class GpuDlrm {
 public:
  GpuDlrm(const DlrmConfig& config, DlrmImpl impl, int device);
  ~GpuDlrm();
  GpuDlrm(const GpuDlrm&) = delete;
  GpuDlrm& operator=(const GpuDlrm&) = delete;

  void forward(const DlrmInput& input, const TensorView& logits);
  void backward(const TensorView& dlogits);
  void step(const OptimizerConfig& opt);
  void enqueue_train_step(const DlrmInput& input, const TensorView& labels, const OptimizerConfig& opt);
  double drain_loss();
  void predict(const DlrmInput& input, const TensorView& probabilities);

  std::vector<Dlrm::LinearParams> linear_layers();
  std::vector<Tensor*> tables();
  void save_state(std::ostream& out) const;
  void load_state(std::istream& in);
  std::size_t peak_device_bytes() const;
  // While set, training steps run without the graph and each phase is timed with CUDA events and
  // added to `trace` on its GPU track (names as the CPU model's phases).
  void set_trace(TraceRecorder* trace) noexcept;

 private:
  struct State;
  std::unique_ptr<State> s_;
};

}  // namespace fk::models::gpu
