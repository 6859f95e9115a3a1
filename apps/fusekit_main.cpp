// fusekit: the command-line program.
//   fusekit info                      build configuration and CUDA devices
//   fusekit check                     one short case per op family against its spec, on every device (apps/check.cpp)
//   fusekit bench [--filter F] [--json PATH] [--json-dir DIR] [--breakdown]
//   fusekit train [--config FILE.json] [DLRM flags]   (apps/train.cpp)
//   fusekit eval --checkpoint PATH [--predictions FILE] (apps/train.cpp)
//   fusekit data synth|convert                         (apps/train.cpp)
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <iostream>

#include "apps/check.hpp"
#include "apps/train.hpp"
#include "fusekit/fusekit.hpp"

#if FUSEKIT_WITH_CUDA
#include <cuda_runtime.h>

#include "bench/harness.hpp"
#endif

namespace {

int info() {
  const fk::BuildInfo b = fk::build_info();
  fmt::print("fusekit {} (commit {}, {} build)\n", b.version, b.commit, b.build_type);
  if (!b.cuda) {
    fmt::print("CUDA: not built (CPU-only library; the specs are the backend)\n");
    return 0;
  }
  fmt::print("CUDA: built with nvcc {} for targets {}\n", b.cuda_compiler, b.cuda_targets);
#if FUSEKIT_WITH_CUDA
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  fmt::print("CUDA driver {}.{}, runtime {}.{}\n", driver / 1000, driver % 1000 / 10, runtime / 1000,
             runtime % 1000 / 10);
  const int n = fk::cuda_device_count();
  if (n == 0) fmt::print("devices: none ({})\n", fk::cuda_unavailable_reason());
  for (int i = 0; i < n; ++i) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, i) != cudaSuccess) continue;
    fmt::print("cuda:{}: {}, compute capability {}.{}, {} SMs, {:.1f} GiB, L2 {} MiB, {} KiB shared memory per block (opt-in)\n",
               i, p.name, p.major, p.minor, p.multiProcessorCount,
               static_cast<double>(p.totalGlobalMem) / (1 << 30), p.l2CacheSize >> 20, p.sharedMemPerBlockOptin >> 10);
  }
#endif
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"fusekit: fused GPU kernels for deep-learning training and inference"};
  app.require_subcommand(1);
  auto* info_cmd = app.add_subcommand("info", "Build configuration and CUDA devices");
  auto* check_cmd = app.add_subcommand("check", "One short case per op family against its spec, on every device present");
  auto* bench_cmd = app.add_subcommand("bench", "Time fused kernels against their unfused baselines (GPU)");
  std::string filter, json, json_dir;
  int min_runs = 50;
  bool breakdown = false;
  bench_cmd->add_option("--filter", filter, "Only cases whose 'family/case' contains this text");
  bench_cmd->add_option("--json", json, "Write all records as one JSON array to this file");
  bench_cmd->add_option("--json-dir", json_dir, "Write <family>.json per family (with the run's ceilings) here");
  bench_cmd->add_option("--min-runs", min_runs, "Timed runs per measurement, at least")->check(CLI::Range(5, 100000));
  bench_cmd->add_flag("--breakdown", breakdown,
                      "Also time where the fused paths' time goes (their parts alone; kernel work)");
  fk::app::TrainFlags train_flags;
  auto* train_cmd = fk::app::add_train_command(app, train_flags);
  fk::app::EvalFlags eval_flags;
  auto* eval_cmd = fk::app::add_eval_command(app, eval_flags);
  fk::app::DataFlags data_flags;
  auto* data_cmd = fk::app::add_data_command(app, data_flags);
  CLI11_PARSE(app, argc, argv);
  try {
    if (*train_cmd) return fk::app::run_train(train_flags);
    if (*eval_cmd) return fk::app::run_eval(eval_flags);
    if (*data_cmd) return fk::app::run_data(*data_cmd, data_flags);
    if (*info_cmd) return info();
    if (*check_cmd) return fk::app::run_check();
    if (*bench_cmd) {
#if FUSEKIT_WITH_CUDA
      fk::bench::Options opt;
      opt.filter = filter;
      opt.min_runs = min_runs;
      opt.breakdown = breakdown;
      return fk::bench::run(opt, json, json_dir);
#else
      std::cerr << "fusekit bench: this build has no CUDA kernels (FUSEKIT_CUDA=OFF or no toolkit); nothing to time\n";
      return 2;
#endif
    }
  } catch (const std::exception& e) {
    std::cerr << "fusekit: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
