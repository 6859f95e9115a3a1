// The benchmark harness behind `fusekit bench`.
//
// A case builds its inputs (random, never zero), runs the fused implementation and its baseline
// once on the same inputs and compares them (a case whose results disagree fails the run before
// anything is timed), then times each one: CUDA events around every run, after a warm-up, with
// the stream held by a spinning kernel while the runs are enqueued so that host launch overhead
// does not leak into GPU time, over enough rotating input sets that L2 holds none of them. The
// figure is the median of at least 50 runs.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "fusekit/core/tensor.hpp"

namespace fk::bench {

struct Record {
  std::string family, name, impl, baseline;
  double median_us = 0, speedup_vs_baseline = 0, tflops = 0, gbps = 0, rel_err = 0;
  std::optional<double> gemm_only_us;
  // Per call in a CUDA graph of back-to-back calls (Context::graph_us): what a decoder replaying
  // its layers pays, without one call's launch and event overhead.
  std::optional<double> graph_us;
  std::optional<double> pct_of_copy;  // gbps over the copy ceiling of the same run
  std::optional<double> pct_of_gemm;  // tflops over the gemm_bf16 ceiling of the same run
  std::vector<std::pair<std::string, double>> extra;  // case-specific figures, written as they are
};

struct Options {
  std::string filter;     // substring of "family/case"; empty: all
  int min_runs = 50;
  double min_ms = 100.0;  // keep running past min_runs until this much GPU time was measured
  // Also time where a fused path's time goes (its parts alone, or the fused kernel with a
  // non-default option): records whose impl is neither the fused path, its baseline nor a
  // ceiling, for kernel work rather than for the figures a user reads.
  bool breakdown = false;
};

class Context {
 public:
  explicit Context(Options opt);
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  cudaStream_t stream() const { return stream_; }
  // Device tensors for a case: allocated, and filled, in the order of the bench stream, so that
  // nothing a timed run touches is still being written by another stream.
  Tensor empty(Dims shape, DType dtype) const;
  // Uniform random values in [lo, hi), a fresh Philox seed per call.
  Tensor random(Dims shape, DType dtype, float lo = -1.f, float hi = 1.f) const;
  // ||a - b|| / ||b|| over every element (any float dtype), once the bench stream is idle.
  // Infinite when either holds a NaN or an infinity.
  double rel_err(const TensorView& a, const TensorView& b) const;
  const Stream& fk_stream() const { return *fk_stream_; }
  cublasHandle_t cublas() const { return cublas_; }
  const std::string& device_name() const { return device_name_; }
  std::size_t l2_bytes() const { return l2_bytes_; }
  bool selected(const std::string& family, const std::string& name) const;
  // Options::breakdown: whether a case also times its breakdown and variant records.
  bool breakdown() const { return opt_.breakdown; }

  // How many copies of a working set of `bytes` (inputs and outputs of one run) must be cycled
  // through so that L2 holds none of them when a run starts: together they span 4x L2.
  int rotations_for(std::size_t bytes) const;
  // Median GPU time in microseconds of run(i), i cycling over [0, rotations).
  double time_us(const std::function<void(int)>& run, int rotations);
  // GPU time per call of run(i), i cycling over [0, rotations), with `calls` calls captured back to
  // back in one CUDA graph and the graph replayed (events around each replay, the median replay
  // divided by calls): for latency-bound cases (under about 50 µs a call), which a decoder runs
  // as graphs. nullopt, with a note on stderr, where run() cannot be captured (a host
  // synchronisation or a non-stream-ordered allocation inside it).
  std::optional<double> graph_us(const std::function<void(int)>& run, int rotations, int calls = 32);
  // The medians of several implementations timed in alternation (run 1 of each, then run 2 of
  // each, ...), so that all of them see the same clocks and temperature: for ratios between
  // GEMM-bound kernels, whose clocks drift by several percent over a run. Each call takes the next
  // of the `rotations` input sets in turn.
  std::vector<double> time_us_interleaved(const std::vector<std::function<void(int)>>& runs, int rotations);

  // Records; speedup and pct_of_copy are filled in when the run is written out.
  void add(Record r) { records_.push_back(std::move(r)); }
  const std::vector<Record>& records() const { return records_; }
  std::optional<double> copy_gbps() const;
  std::optional<double> gemm_tflops() const;

 private:
  Options opt_;
  cudaStream_t stream_ = nullptr;
  Stream* fk_stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  std::string device_name_;
  std::size_t l2_bytes_ = 0;
  std::vector<Record> records_;
};

// The record of a device-to-device copy moving `bytes` in total (read + write), impl
// "copy_same_bytes": what a memory-bound case's traffic costs at copy speed, in the same run.
Record copy_record(Context& ctx, const std::string& family, const std::string& name, double bytes);

// Throws fk::Error naming the case when err > bound: a case never times a wrong result.
void require_close(const std::string& what, double err, double bound);

// Holds `stream` for `ns` nanoseconds (a spinning kernel), so that the host can enqueue a batch
// of runs behind it and the GPU then executes them back to back.
void hold_stream(cudaStream_t stream, std::uint64_t ns);

// Launches a kernel that does nothing (one CTA of 32 threads): the `launch` ceiling.
void launch_empty(cudaStream_t stream);

// "65536x1024"
std::string shape_str(std::int64_t rows, std::int64_t cols);

struct Case {
  const char* family;
  const char* name;  // the case name's prefix; the case fills in shapes (a filter naming it selects the case)
  void (*run)(Context&);
};
int register_case(Case c);
const std::vector<Case>& cases();

// Runs every selected case; writes the records to `json_path` (if not empty) and one file per
// family, with the ceiling records of the run, into `json_dir` (if not empty). Returns the exit code.
int run(const Options& opt, const std::string& json_path, const std::string& json_dir);

#define FK_BENCH_CASE(family, name, fn) \
  static const int fk_bench_case_##fn = ::fk::bench::register_case({family, name, fn})

}  // namespace fk::bench
