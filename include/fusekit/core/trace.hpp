// A Chrome trace-event recorder (chrome://tracing, Perfetto): complete events ("ph": "X") with
// microsecond timestamps on a steady clock, one track per thread. Phases of a training step are
// recorded through Scope objects; a null recorder costs one branch. Host time only: GPU phases
// must synchronise (or use CUDA events) before their scope ends to be meaningful.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <mutex>
#include <string>
#include <vector>

namespace fk {

class TraceRecorder {
 public:
  TraceRecorder();

  class Scope {
   public:
    Scope() = default;
    Scope(TraceRecorder* recorder, const char* name, const char* category);
    Scope(Scope&& other) noexcept;
    Scope& operator=(Scope&&) = delete;
    Scope(const Scope&) = delete;
    ~Scope();

   private:
    TraceRecorder* recorder_ = nullptr;
    const char* name_ = nullptr;
    const char* category_ = nullptr;
    double start_us_ = 0;
  };

  // Recording stops (silently) once `max_events` have been kept, so a long run cannot fill memory.
  void set_max_events(std::size_t n) { max_events_ = n; }
  std::size_t size() const;
  // Writes {"traceEvents": [...], "displayTimeUnit": "ms"} atomically (temp file + rename).
  void write(const std::filesystem::path& path) const;

  double now_us() const;
  void add(const char* name, const char* category, double start_us, double duration_us);
  // The same on an explicit track (e.g. kGpuTrack for phases timed with CUDA events).
  void add_on_track(const char* name, const char* category, double start_us, double duration_us, std::uint32_t tid);
  static constexpr std::uint32_t kGpuTrack = 0x1000000;

 private:
  struct Event {
    const char* name;
    const char* category;
    double start_us, duration_us;
    std::uint32_t tid;
  };
  std::chrono::steady_clock::time_point origin_;
  mutable std::mutex mutex_;
  std::vector<Event> events_;
  std::size_t max_events_ = 1u << 20;
};

// A scope on `recorder` when it is not null, nothing otherwise.
inline TraceRecorder::Scope trace_scope(TraceRecorder* recorder, const char* name, const char* category = "step") {
  return recorder ? TraceRecorder::Scope(recorder, name, category) : TraceRecorder::Scope();
}

}  // namespace fk
