// fusekit: the command-line program.
//   fusekit info                      build configuration and CUDA devices
//   fusekit check                     the ops against their specs, on every device present
//   fusekit bench [--filter F] [--json PATH] [--json-dir DIR] [--breakdown]
//   fusekit train [--config FILE.json] [DLRM flags]   (apps/train.cpp)
//   fusekit eval --checkpoint PATH                     (apps/train.cpp)
//   fusekit data synth|convert                         (apps/train.cpp)
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cmath>
#include <cstdlib>
#include <iostream>

#include "apps/train.hpp"
#include "fusekit/fusekit.hpp"
#include "ops/pointwise/seed_example.hpp"

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

// Seed 003's 8x10 example through fk::bias_act_forward on `device`, printed as the seed prints it.
bool check_seed_example(fk::Device device) {
  using namespace fk::examples;
  const fk::Device cpu = fk::Device::cpu();
  auto host = [&](const float* p, fk::Dims shape) {
    return fk::TensorView(const_cast<float*>(p), fk::DType::f32, shape, cpu);
  };
  const fk::Tensor x = fk::Tensor::adopt(host(kSeedX, {kSeedRows, kSeedCols}), nullptr).copy_to(device);
  const fk::Tensor r = fk::Tensor::adopt(host(kSeedY, {kSeedRows, kSeedCols}), nullptr).copy_to(device);
  const fk::Tensor b = fk::Tensor::adopt(host(kSeedBias, {kSeedCols}), nullptr).copy_to(device);
  // In place, as the seed's in_out_ptr.
  fk::bias_act_forward({x, r.view(), b.view(), x, std::nullopt}, {fk::Activation::relu, kSeedMultiplier});
  const fk::Tensor out = x.copy_to(cpu);
  bool match = true;
  for (int i = 0; i < kSeedRows * kSeedCols; ++i)
    match &= std::fabs(out.data_as<float>()[i] - kSeedExpected[i]) <= kSeedTolerance;
  fmt::print("pointwise seed example on {}: y = relu(x + {} * r + b), [{}, {}]\n", device.str(), kSeedMultiplier,
             kSeedRows, kSeedCols);
  for (int i = 0; i < kSeedRows; ++i) {
    for (int j = 0; j < kSeedCols; ++j) fmt::print("{:8.4f}", out.data_as<float>()[i * kSeedCols + j]);
    fmt::print("\n");
  }
  fmt::print("All Match: {}\n", match);
  return match;
}

// Each op on random inputs against its spec on the CPU.
bool check_against_spec(fk::Device device) {
  bool ok = true;
  const fk::Device cpu = fk::Device::cpu();
  for (fk::DType dt : {fk::DType::f32, fk::DType::bf16}) {
    const std::int64_t rows = 257, cols = 1000;
    fk::Tensor x = fk::Tensor::empty({rows, cols}, dt, cpu), r = fk::Tensor::empty({rows, cols}, dt, cpu);
    fk::Tensor b = fk::Tensor::empty({cols}, dt, cpu);
    fk::fill_uniform(x, -2, 2, {1, 0});
    fk::fill_uniform(r, -2, 2, {2, 0});
    fk::fill_uniform(b, -1, 1, {3, 0});
    fk::Tensor want = fk::Tensor::empty({rows, cols}, dt, cpu);
    fk::reference::bias_act_forward({x, r.view(), b.view(), want, std::nullopt}, {fk::Activation::gelu_tanh, 0.5f});
    const fk::Tensor xd = x.copy_to(device), rd = r.copy_to(device), bd = b.copy_to(device);
    const fk::Tensor yd = fk::Tensor::empty({rows, cols}, dt, device);
    fk::bias_act_forward({xd, rd.view(), bd.view(), yd, std::nullopt}, {fk::Activation::gelu_tanh, 0.5f});
    const fk::Tensor got = yd.copy_to(cpu);
    double worst = 0;
    fk::visit_dtype(dt, [&](auto zero) {
      using T = decltype(zero);
      for (std::int64_t i = 0; i < rows * cols; ++i) {
        const double g = static_cast<float>(got.data_as<T>()[i]), w = static_cast<float>(want.data_as<T>()[i]);
        worst = std::max(worst, std::fabs(g - w) / (1.0 + std::fabs(w)));
      }
    });
    const double bound = dt == fk::DType::f32 ? 1e-5 : 1e-2;
    fmt::print("bias_act_forward gelu_tanh {} [{}, {}] on {} vs spec: max scaled error {:.2e} (bound {:.0e}) {}\n",
               fk::dtype_name(dt), rows, cols, device.str(), worst, bound, worst <= bound ? "ok" : "FAILED");
    ok &= worst <= bound;
  }
  return ok;
}

int check() {
  bool ok = check_seed_example(fk::Device::cpu());
  if (fk::cuda_device_count() > 0) {
    ok &= check_seed_example(fk::Device::cuda(0));
    ok &= check_against_spec(fk::Device::cuda(0));
  } else {
    fmt::print("GPU checks skipped: {}\n", fk::cuda_unavailable_reason());
  }
  fmt::print("{}\n", ok ? "check: all passed" : "check: FAILED");
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"fusekit: fused GPU kernels for deep-learning training and inference"};
  app.require_subcommand(1);
  auto* info_cmd = app.add_subcommand("info", "Build configuration and CUDA devices");
  auto* check_cmd = app.add_subcommand("check", "Run the ops against their CPU specs on every device present");
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
    if (*check_cmd) return check();
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
