#include "fusekit/core/event.hpp"

#include <utility>

#include "fusekit/core/error.hpp"
#include "fusekit/core/stream.hpp"

#if FUSEKIT_WITH_CUDA
#include "fusekit/core/cuda_check.hpp"
#endif

namespace fk {

#if FUSEKIT_WITH_CUDA
namespace {
cudaEvent_t ev(void* h) { return static_cast<cudaEvent_t>(h); }
cudaStream_t st(const Stream& s) { return static_cast<cudaStream_t>(s.handle()); }
}  // namespace

Event Event::create(Device device, bool timing) {
  FK_CHECK_ARG(device.is_cuda(), "Event::create", "device", "a CUDA device", device.str());
  const detail::DeviceScope on_device(device.index);
  cudaEvent_t e = nullptr;
  FK_CUDA_CHECK(cudaEventCreateWithFlags(&e, timing ? cudaEventDefault : cudaEventDisableTiming));
  Event out;
  out.handle_ = e;
  return out;
}

Event::~Event() {
  if (handle_) cudaEventDestroy(ev(handle_));
}
void Event::record(const Stream& stream) const { FK_CUDA_CHECK(cudaEventRecord(ev(handle_), st(stream))); }
void Event::wait_on(const Stream& stream) const { FK_CUDA_CHECK(cudaStreamWaitEvent(st(stream), ev(handle_), 0)); }
void Event::synchronize() const { FK_CUDA_CHECK(cudaEventSynchronize(ev(handle_))); }
float Event::elapsed_ms_since(const Event& start) const {
  float ms = 0;
  FK_CUDA_CHECK(cudaEventElapsedTime(&ms, ev(start.handle_), ev(handle_)));
  return ms;
}

Graph Graph::capture(const Stream& stream, const std::function<void()>& enqueue) {
  FK_CHECK_ARG(stream.handle() != nullptr, "Graph::capture", "stream", "a created stream", "the default stream");
  FK_CUDA_CHECK(cudaStreamBeginCapture(st(stream), cudaStreamCaptureModeThreadLocal));
  try {
    enqueue();
  } catch (...) {
    cudaGraph_t broken = nullptr;
    cudaStreamEndCapture(st(stream), &broken);  // leave the stream usable, then report the first error
    if (broken) cudaGraphDestroy(broken);
    throw;
  }
  cudaGraph_t graph = nullptr;
  FK_CUDA_CHECK(cudaStreamEndCapture(st(stream), &graph));
  cudaGraphExec_t exec = nullptr;
  const cudaError_t made = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  FK_CUDA_CHECK(made);
  Graph out;
  out.exec_ = exec;
  return out;
}

Graph::~Graph() {
  if (exec_) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec_));
}
void Graph::launch(const Stream& stream) const {
  FK_CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec_), st(stream)));
}
#else
Event Event::create(Device device, bool) {
  throw Error("Event::create", "device", "cpu (fusekit was built without CUDA)", device.str());
}
Event::~Event() = default;
void Event::record(const Stream&) const {}
void Event::wait_on(const Stream&) const {}
void Event::synchronize() const {}
float Event::elapsed_ms_since(const Event&) const { return 0.0f; }
Graph Graph::capture(const Stream&, const std::function<void()>&) {
  throw Error("Graph::capture", "stream", "a CUDA stream (fusekit was built without CUDA)", "none");
}
Graph::~Graph() = default;
void Graph::launch(const Stream&) const {}
#endif

Event::Event(Event&& o) noexcept : handle_(std::exchange(o.handle_, nullptr)) {}
Event& Event::operator=(Event&& o) noexcept {
  if (this != &o) {
    this->~Event();
    handle_ = std::exchange(o.handle_, nullptr);
  }
  return *this;
}
Graph::Graph(Graph&& o) noexcept : exec_(std::exchange(o.exec_, nullptr)) {}
Graph& Graph::operator=(Graph&& o) noexcept {
  if (this != &o) {
    this->~Graph();
    exec_ = std::exchange(o.exec_, nullptr);
  }
  return *this;
}

}  // namespace fk
