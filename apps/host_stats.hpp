// What the programs report about the host while they run: CPU time, memory, a progress bar.
#pragma once

#include <sys/resource.h>
#include <time.h>

#include <cstdlib>
#include <fstream>
#include <string>

namespace fk::app {

// CPU time of the calling thread: on a shared machine, samples per CPU-second of the training
// thread says what the code does when wall-clock samples/s says what the machine allowed.
inline double thread_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

inline double peak_host_mb() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;  // Linux: KiB
}

// The process's resident anonymous memory now, in MB (/proc/self/status RssAnon; 0 where there is
// none): its own memory, without the mapped data files' pages, which belong to the page cache.
inline double anonymous_host_mb() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.starts_with("RssAnon:")) return std::strtod(line.c_str() + 8, nullptr) / 1024.0;
  return 0.0;
}

inline std::string progress_bar(double fraction, int width = 24) {
  const int filled = static_cast<int>(fraction * width);
  std::string s(static_cast<std::size_t>(width), ' ');
  for (int i = 0; i < filled && i < width; ++i) s[static_cast<std::size_t>(i)] = '=';
  if (filled < width) s[static_cast<std::size_t>(filled)] = '>';
  return "[" + s + "]";
}

}  // namespace fk::app
