// Event and Graph: owning, move-only wrappers of a CUDA event and of an instantiated CUDA graph,
// destroyed with their owner (RAII), so that no code outside core creates or destroys either by
// hand. Handles are opaque pointers: this header needs no CUDA headers. In a CPU-only build they
// exist and refuse to be created.
#pragma once

#include <functional>

#include "fusekit/core/device.hpp"

namespace fk {

class Stream;

class Event {
 public:
  // An event on `device`; timing events can measure elapsed time, the others only order work.
  static Event create(Device device, bool timing = true);
  Event() = default;
  Event(Event&& o) noexcept;
  Event& operator=(Event&& o) noexcept;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  ~Event();

  void record(const Stream& stream) const;
  // Work queued on `stream` after this call waits for the event.
  void wait_on(const Stream& stream) const;
  void synchronize() const;
  // Milliseconds from `start` to this event (both recorded and complete).
  float elapsed_ms_since(const Event& start) const;
  void* handle() const noexcept { return handle_; }
  explicit operator bool() const noexcept { return handle_ != nullptr; }

 private:
  void* handle_ = nullptr;
};

class Graph {
 public:
  // Captures what `enqueue` queues on `stream` (which must be a created, non-default stream) and
  // instantiates it; nothing runs until launch().
  static Graph capture(const Stream& stream, const std::function<void()>& enqueue);
  Graph() = default;
  Graph(Graph&& o) noexcept;
  Graph& operator=(Graph&& o) noexcept;
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  ~Graph();

  void launch(const Stream& stream) const;
  explicit operator bool() const noexcept { return exec_ != nullptr; }

 private:
  void* exec_ = nullptr;
};

}  // namespace fk
