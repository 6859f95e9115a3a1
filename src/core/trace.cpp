#include "fusekit/core/trace.hpp"

#include <fmt/format.h>

#include <fstream>
#include <functional>
#include <thread>
#include <unistd.h>

#include "fusekit/core/error.hpp"

namespace fk {

TraceRecorder::TraceRecorder() : origin_(std::chrono::steady_clock::now()) {}

double TraceRecorder::now_us() const {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - origin_).count();
}

void TraceRecorder::add(const char* name, const char* category, double start_us, double duration_us) {
  add_on_track(name, category, start_us, duration_us,
               static_cast<std::uint32_t>(std::hash<std::thread::id>{}(std::this_thread::get_id()) & 0xffffff));
}

void TraceRecorder::add_on_track(const char* name, const char* category, double start_us, double duration_us,
                                 std::uint32_t tid) {
  std::lock_guard lock(mutex_);
  if (events_.size() < max_events_) events_.push_back({name, category, start_us, duration_us, tid});
}

std::size_t TraceRecorder::size() const {
  std::lock_guard lock(mutex_);
  return events_.size();
}

void TraceRecorder::write(const std::filesystem::path& path) const {
  const std::filesystem::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp);
    if (!out) throw Error("TraceRecorder::write", "path", "a writable file", path.string());
    std::lock_guard lock(mutex_);
    out << "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n";
    const int pid = static_cast<int>(::getpid());
    for (std::size_t i = 0; i < events_.size(); ++i) {
      const Event& e = events_[i];
      out << fmt::format(R"({{"name": "{}", "cat": "{}", "ph": "X", "ts": {:.3f}, "dur": {:.3f}, "pid": {}, "tid": {}}}{})",
                         e.name, e.category, e.start_us, e.duration_us, pid, e.tid, i + 1 < events_.size() ? ",\n" : "\n");
    }
    out << "]}\n";
    if (!out) throw Error("TraceRecorder::write", "path", "a complete write", path.string());
  }
  std::filesystem::rename(tmp, path);
}

TraceRecorder::Scope::Scope(TraceRecorder* recorder, const char* name, const char* category)
    : recorder_(recorder), name_(name), category_(category), start_us_(recorder->now_us()) {}

TraceRecorder::Scope::Scope(Scope&& other) noexcept
    : recorder_(other.recorder_), name_(other.name_), category_(other.category_), start_us_(other.start_us_) {
  other.recorder_ = nullptr;
}

TraceRecorder::Scope::~Scope() {
  if (recorder_) recorder_->add(name_, category_, start_us_, recorder_->now_us() - start_us_);
}

}  // namespace fk
