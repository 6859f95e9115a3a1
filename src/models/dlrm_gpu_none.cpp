// GpuDlrm in a build without CUDA. Dlrm refuses CUDA devices there before it would construct
// one, so no GpuDlrm ever exists; its members are defined only so that dlrm.cpp links, and each
// refuses with the same error as the constructor.
#include "models/dlrm_gpu.hpp"

#include "fusekit/core/error.hpp"

namespace fk::models::gpu {

struct GpuDlrm::State {};

namespace {
[[noreturn]] void no_cuda() {
  throw Error("models::Dlrm", "device", "cpu (fusekit was built without CUDA)", "a CUDA device");
}
}  // namespace

GpuDlrm::GpuDlrm(const DlrmConfig&, DlrmImpl, int) { no_cuda(); }
GpuDlrm::~GpuDlrm() = default;
void GpuDlrm::forward(const DlrmInput&, const TensorView&) { no_cuda(); }
void GpuDlrm::backward(const TensorView&) { no_cuda(); }
void GpuDlrm::step(const OptimizerConfig&) { no_cuda(); }
void GpuDlrm::enqueue_train_step(const DlrmInput&, const TensorView&, const OptimizerConfig&) { no_cuda(); }
double GpuDlrm::drain_loss() { no_cuda(); }
void GpuDlrm::predict(const DlrmInput&, const TensorView&) { no_cuda(); }
std::vector<Dlrm::LinearParams> GpuDlrm::linear_layers() { no_cuda(); }
std::vector<Tensor*> GpuDlrm::tables() { no_cuda(); }
void GpuDlrm::save_state(std::ostream&) const { no_cuda(); }
void GpuDlrm::load_state(std::istream&) { no_cuda(); }
std::size_t GpuDlrm::peak_device_bytes() const { no_cuda(); }
void GpuDlrm::set_trace(TraceRecorder*) noexcept {}

}  // namespace fk::models::gpu
