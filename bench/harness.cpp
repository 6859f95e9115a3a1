#include "bench/harness.hpp"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>

#include "fusekit/core/cuda_check.hpp"
#include "fusekit/core/random.hpp"
#include "fusekit/core/stream.hpp"
#include "fusekit/fusekit.hpp"

namespace fk::bench {
namespace {

std::vector<Case>& case_list() {
  static std::vector<Case> v;
  return v;
}

}  // namespace

int register_case(Case c) {
  case_list().push_back(c);
  return static_cast<int>(case_list().size());
}

const std::vector<Case>& cases() { return case_list(); }

Context::Context(Options opt) : opt_(std::move(opt)) {
  int dev = 0;
  FK_CUDA_CHECK(cudaGetDevice(&dev));
  cudaDeviceProp prop{};
  FK_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  device_name_ = prop.name;
  l2_bytes_ = static_cast<std::size_t>(prop.l2CacheSize);
  fk_stream_ = new Stream(Stream::create(Device::cuda(dev)));
  stream_ = static_cast<cudaStream_t>(fk_stream_->handle());
  FK_CUBLAS_CHECK(cublasCreate(&cublas_));
  FK_CUBLAS_CHECK(cublasSetStream(cublas_, stream_));
}

Context::~Context() {
  cublasDestroy(cublas_);
  delete fk_stream_;
}

bool Context::selected(const std::string& family, const std::string& name) const {
  if (opt_.filter.empty()) return true;
  return (family + "/" + name).find(opt_.filter) != std::string::npos;
}

int Context::rotations_for(std::size_t bytes) const {
  const std::size_t span = 4 * l2_bytes_;
  return static_cast<int>(std::clamp<std::size_t>((span + bytes - 1) / std::max<std::size_t>(bytes, 1), 1, 4096));
}

double Context::time_us(const std::function<void(int)>& run, int rotations) {
  // Warm-up: module load, allocator, cuBLAS heuristics; also estimates one run's time.
  cudaEvent_t a, b;
  FK_CUDA_CHECK(cudaEventCreate(&a));
  FK_CUDA_CHECK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) run(i % rotations);
  FK_CUDA_CHECK(cudaEventRecord(a, stream_));
  const int probe = 5;
  for (int i = 0; i < probe; ++i) run(i % rotations);
  FK_CUDA_CHECK(cudaEventRecord(b, stream_));
  FK_CUDA_CHECK(cudaEventSynchronize(b));
  float probe_ms = 0;
  FK_CUDA_CHECK(cudaEventElapsedTime(&probe_ms, a, b));
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  const double est_ms = std::max(1e-3, static_cast<double>(probe_ms) / probe);
  const int runs = static_cast<int>(std::clamp(std::ceil(opt_.min_ms / est_ms), double(opt_.min_runs), 2000.0));

  std::vector<cudaEvent_t> ev(2 * static_cast<std::size_t>(runs));
  for (auto& e : ev) FK_CUDA_CHECK(cudaEventCreate(&e));
  std::vector<float> ms;
  ms.reserve(static_cast<std::size_t>(runs));
  // Batches of at most 64 runs behind one spin, sized so that enqueueing ends before the spin.
  for (int done = 0; done < runs;) {
    const int batch = std::min(64, runs - done);
    hold_stream(stream_, static_cast<std::uint64_t>(batch) * 60'000 + 2'000'000);
    for (int i = 0; i < batch; ++i) {
      const int k = done + i;
      FK_CUDA_CHECK(cudaEventRecord(ev[2 * k], stream_));
      run(k % rotations);
      FK_CUDA_CHECK(cudaEventRecord(ev[2 * k + 1], stream_));
    }
    done += batch;
  }
  FK_CUDA_CHECK(cudaStreamSynchronize(stream_));
  for (int k = 0; k < runs; ++k) {
    float t = 0;
    FK_CUDA_CHECK(cudaEventElapsedTime(&t, ev[2 * k], ev[2 * k + 1]));
    ms.push_back(t);
  }
  for (auto& e : ev) cudaEventDestroy(e);
  std::nth_element(ms.begin(), ms.begin() + ms.size() / 2, ms.end());
  return 1000.0 * ms[ms.size() / 2];
}

std::optional<double> Context::graph_us(const std::function<void(int)>& run, int rotations, int calls) {
  for (int i = 0; i < 3; ++i) run(i % rotations);  // warm-up outside the capture: allocations, heuristics
  FK_CUDA_CHECK(cudaStreamSynchronize(stream_));
  cudaGraph_t graph = nullptr;
  FK_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  bool captured = true;
  try {
    for (int i = 0; i < calls; ++i) run(i % rotations);
  } catch (const std::exception& e) {
    captured = false;
    fmt::print(stderr, "graph_us: the run cannot be captured ({})\n", e.what());
  }
  const cudaError_t end = cudaStreamEndCapture(stream_, &graph);
  if (!captured || end != cudaSuccess || graph == nullptr) {
    if (captured) fmt::print(stderr, "graph_us: capture failed: {}\n", cudaGetErrorString(end));
    if (graph) cudaGraphDestroy(graph);
    (void)cudaGetLastError();  // the capture's error is ours to clear, not the next case's
    return std::nullopt;
  }
  cudaGraphExec_t exec = nullptr;
  FK_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  cudaGraphDestroy(graph);
  FK_CUDA_CHECK(cudaGraphLaunch(exec, stream_));  // warm-up replay, which also estimates one
  cudaEvent_t a, b;
  FK_CUDA_CHECK(cudaEventCreate(&a));
  FK_CUDA_CHECK(cudaEventCreate(&b));
  auto replay_ms = [&] {  // one replay between two events
    FK_CUDA_CHECK(cudaEventRecord(a, stream_));
    FK_CUDA_CHECK(cudaGraphLaunch(exec, stream_));
    FK_CUDA_CHECK(cudaEventRecord(b, stream_));
    FK_CUDA_CHECK(cudaEventSynchronize(b));
    float t = 0;
    FK_CUDA_CHECK(cudaEventElapsedTime(&t, a, b));
    return t;
  };
  const float est = replay_ms();
  const int replays = static_cast<int>(std::clamp(std::ceil(opt_.min_ms / std::max(1e-3, double(est))), 20.0, 500.0));
  std::vector<float> ms;
  ms.reserve(static_cast<std::size_t>(replays));
  for (int r = 0; r < replays; ++r) ms.push_back(replay_ms());
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  cudaGraphExecDestroy(exec);
  std::nth_element(ms.begin(), ms.begin() + ms.size() / 2, ms.end());
  return 1000.0 * ms[ms.size() / 2] / calls;
}

std::vector<double> Context::time_us_interleaved(const std::vector<std::function<void(int)>>& fns, int rotations) {
  const std::size_t n = fns.size();
  cudaEvent_t a, b;
  FK_CUDA_CHECK(cudaEventCreate(&a));
  FK_CUDA_CHECK(cudaEventCreate(&b));
  double longest_ms = 1e-3;
  for (const auto& f : fns) {
    for (int i = 0; i < 3; ++i) f(i % rotations);
    FK_CUDA_CHECK(cudaEventRecord(a, stream_));
    for (int i = 0; i < 5; ++i) f(i % rotations);
    FK_CUDA_CHECK(cudaEventRecord(b, stream_));
    FK_CUDA_CHECK(cudaEventSynchronize(b));
    float probe_ms = 0;
    FK_CUDA_CHECK(cudaEventElapsedTime(&probe_ms, a, b));
    longest_ms = std::max(longest_ms, static_cast<double>(probe_ms) / 5);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  const int rounds = static_cast<int>(std::clamp(std::ceil(opt_.min_ms / longest_ms), double(opt_.min_runs), 2000.0));
  std::vector<cudaEvent_t> ev(2 * n * static_cast<std::size_t>(rounds));
  for (auto& e : ev) FK_CUDA_CHECK(cudaEventCreate(&e));
  for (int done = 0; done < rounds;) {
    const int batch = std::min(64, rounds - done);
    hold_stream(stream_, static_cast<std::uint64_t>(batch) * n * 60'000 + 2'000'000);
    for (int i = 0; i < batch; ++i)
      for (std::size_t f = 0; f < n; ++f) {
        const std::size_t e = 2 * ((static_cast<std::size_t>(done) + i) * n + f);
        FK_CUDA_CHECK(cudaEventRecord(ev[e], stream_));
        // Every call takes the next input set, so that each finds its inputs out of L2 as in
        // time_us (calls on the set the previous one just read would run from a warm L2).
        fns[f](static_cast<int>(((static_cast<std::size_t>(done) + i) * n + f) % static_cast<std::size_t>(rotations)));
        FK_CUDA_CHECK(cudaEventRecord(ev[e + 1], stream_));
      }
    done += batch;
  }
  FK_CUDA_CHECK(cudaStreamSynchronize(stream_));
  std::vector<double> medians;
  for (std::size_t f = 0; f < n; ++f) {
    std::vector<float> ms;
    for (int k = 0; k < rounds; ++k) {
      const std::size_t e = 2 * (static_cast<std::size_t>(k) * n + f);
      float t = 0;
      FK_CUDA_CHECK(cudaEventElapsedTime(&t, ev[e], ev[e + 1]));
      ms.push_back(t);
    }
    std::nth_element(ms.begin(), ms.begin() + ms.size() / 2, ms.end());
    medians.push_back(1000.0 * ms[ms.size() / 2]);
  }
  for (auto& e : ev) cudaEventDestroy(e);
  return medians;
}

Record copy_record(Context& ctx, const std::string& family, const std::string& name, double bytes) {
  const std::int64_t half = static_cast<std::int64_t>(bytes / 2) / 16 * 16;
  const Tensor src = ctx.random({half / 4}, DType::f32), dst = ctx.empty({half / 4}, DType::f32);
  Record r{family, name, "copy_same_bytes", "copy_same_bytes"};
  r.median_us = ctx.time_us(
      [&](int) {
        FK_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), static_cast<std::size_t>(half), cudaMemcpyDeviceToDevice,
                                      ctx.stream()));
      },
      1);
  r.gbps = bytes / (r.median_us * 1e3);
  return r;
}

std::optional<double> Context::copy_gbps() const {
  for (const Record& r : records_)
    if (r.family == "ceiling" && r.name == "copy") return r.gbps;
  return std::nullopt;
}

std::optional<double> Context::gemm_tflops() const {
  for (const Record& r : records_)
    if (r.family == "ceiling" && r.name == "gemm_bf16") return r.tflops;
  return std::nullopt;
}

double Context::rel_err(const TensorView& a, const TensorView& b) const {
  FK_CUDA_CHECK(cudaStreamSynchronize(stream_));
  FK_CHECK_ARG(a.shape() == b.shape(), "bench::rel_err", "a", fmt::format("shape {}", b.shape().str()),
               a.shape().str());
  auto doubles = [](const TensorView& t) {
    Tensor h = Tensor::empty(t.shape(), t.dtype(), Device::cpu());
    copy(h, t);
    std::vector<double> v(static_cast<std::size_t>(h.numel()));
    visit_dtype(h.dtype(), [&](auto zero) {
      using T = decltype(zero);
      for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(h.data_as<T>()[i]);
    });
    return v;
  };
  const std::vector<double> x = doubles(a), y = doubles(b);
  double num = 0, den = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    num += (x[i] - y[i]) * (x[i] - y[i]);
    den += y[i] * y[i];
  }
  if (!std::isfinite(num) || !std::isfinite(den)) return std::numeric_limits<double>::infinity();
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

void require_close(const std::string& what, double err, double bound) {
  if (!(err <= bound))
    throw Error("bench", fmt::format("{}: results differ from the baseline: rel_err {:.3g} > {:.3g}", what, err, bound));
}

std::string shape_str(std::int64_t rows, std::int64_t cols) { return fmt::format("{}x{}", rows, cols); }

Tensor Context::empty(Dims shape, DType dtype) const {
  return Tensor::empty(shape, dtype, fk_stream_->device(), fk_stream_);
}

Tensor Context::random(Dims shape, DType dtype, float lo, float hi) const {
  static std::atomic<std::uint64_t> seed{20261122};
  Tensor t = empty(shape, dtype);
  fill_uniform(t, lo, hi, RandomParams{seed++, 0}, fk_stream_);
  return t;
}

namespace {

nlohmann::json to_json(const Record& r, const std::string& device, const std::string& commit) {
  nlohmann::json j{{"family", r.family},   {"case", r.name},
                   {"impl", r.impl},       {"baseline", r.baseline},
                   {"median_us", r.median_us}, {"speedup_vs_baseline", r.speedup_vs_baseline},
                   {"tflops", r.tflops},   {"gbps", r.gbps},
                   {"rel_err", r.rel_err}, {"device", device},
                   {"commit", commit}};
  if (r.gemm_only_us) j["gemm_only_us"] = *r.gemm_only_us;
  if (r.graph_us) j["graph_us"] = *r.graph_us;
  if (r.pct_of_copy) j["pct_of_copy"] = *r.pct_of_copy;
  if (r.pct_of_gemm) j["pct_of_gemm"] = *r.pct_of_gemm;
  for (const auto& [key, value] : r.extra) j[key] = value;
  return j;
}

// Fills in each record's speedup against the record of its baseline impl in the same case, and
// its share of the copy and GEMM ceilings.
void finish(std::vector<Record>& recs, std::optional<double> copy, std::optional<double> gemm) {
  for (Record& r : recs) {
    for (const Record& b : recs)
      if (b.family == r.family && b.name == r.name && b.impl == r.baseline && b.median_us > 0)
        r.speedup_vs_baseline = b.median_us / r.median_us;
    if (r.impl == r.baseline) r.speedup_vs_baseline = 1.0;
    if (copy && r.gbps > 0 && r.family != "ceiling") r.pct_of_copy = 100.0 * r.gbps / *copy;
    if (gemm && r.tflops > 0 && r.family != "ceiling") r.pct_of_gemm = 100.0 * r.tflops / *gemm;
  }
}

}  // namespace

int run(const Options& opt, const std::string& json_path, const std::string& json_dir) {
  if (cuda_device_count() == 0) {
    std::cerr << "fusekit bench: " << cuda_unavailable_reason() << "; nothing to time\n";
    return 2;
  }
  Context ctx(opt);
  const std::string commit = build_info().commit;
  fmt::print("fusekit bench on {} (commit {})\n", ctx.device_name(), commit);
  int failures = 0;
  // Ceilings first: every other record is read against them.
  std::vector<Case> order = cases();
  std::stable_partition(order.begin(), order.end(), [](const Case& c) { return std::string(c.family) == "ceiling"; });
  for (const Case& c : order) {
    // Cases filter their own records (a registered case covers several record names).
    // A filter selects a case by its family ("primitives/...") or by its registered name
    // ("attention_fwd/..."), whose records start with that name.
    const std::string head = opt.filter.substr(0, opt.filter.find('/'));
    if (std::string(c.family) != "ceiling" && !opt.filter.empty() && std::string(c.family).find(head) == std::string::npos &&
        std::string(c.name).find(head) == std::string::npos)
      continue;
    try {
      c.run(ctx);
    } catch (const std::exception& e) {
      ++failures;
      fmt::print(stderr, "FAILED {}/{}: {}\n", c.family, c.name, e.what());
    }
  }
  std::vector<Record> recs = ctx.records();
  finish(recs, ctx.copy_gbps(), ctx.gemm_tflops());

  fmt::print("\n{:<10} {:<44} {:<16} {:>11} {:>8} {:>9} {:>8} {:>7} {:>7} {:>9}\n", "family", "case", "impl",
             "median_us", "speedup", "GB/s", "%copy", "TFLOP/s", "%gemm", "rel_err");
  for (const Record& r : recs)
    fmt::print("{:<10} {:<44} {:<16} {:>11.2f} {:>8.2f} {:>9.1f} {:>8} {:>7.1f} {:>7} {:>9.2e}\n", r.family, r.name,
               r.impl, r.median_us, r.speedup_vs_baseline, r.gbps,
               r.pct_of_copy ? fmt::format("{:.1f}", *r.pct_of_copy) : "", r.tflops,
               r.pct_of_gemm ? fmt::format("{:.1f}", *r.pct_of_gemm) : "", r.rel_err);

  if (!json_path.empty()) {
    nlohmann::json all = nlohmann::json::array();
    for (const Record& r : recs) all.push_back(to_json(r, ctx.device_name(), commit));
    std::ofstream(json_path) << all.dump(2) << "\n";
  }
  if (!json_dir.empty()) {
    std::filesystem::create_directories(json_dir);
    std::map<std::string, nlohmann::json> by_family;
    for (const Record& r : recs)
      if (r.family != "ceiling") by_family[r.family].push_back(to_json(r, ctx.device_name(), commit));
    for (auto& [family, list] : by_family) {
      for (const Record& r : recs)
        if (r.family == "ceiling") list.push_back(to_json(r, ctx.device_name(), commit));
      std::ofstream(std::filesystem::path(json_dir) / (family + ".json")) << list.dump(2) << "\n";
    }
  }
  if (failures) fmt::print(stderr, "{} case(s) failed\n", failures);
  return failures ? 1 : 0;
}

}  // namespace fk::bench
