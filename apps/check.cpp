// `fusekit check`: one short case per op family on each device present, against the family's spec.
//
// On each CUDA device the family's kernels run on random inputs (odd sizes, the dtypes the family
// is built for) and are compared with its CPU spec (fk::reference) under the bounds its GPU tests
// hold them to (tests/ops/<family>_test.cpp; each bound below gives the tests' reason). On the CPU
// the public ops run the spec itself, so comparing them with the spec would prove nothing: there
// each family is checked against hand-worked values instead, the ones its spec tests use.
//
// This is a smoke test of an installed build on a given machine, not the test suite: the tests
// cover many shapes, dtypes, kernel paths and every bad input; this covers one case of each family.
//
// One line per (family, device): of the family's comparisons, the one nearest its bound, with its
// error and that bound. A comparison is elementwise (|got - want| and atol + rtol |want| at the
// element nearest its bound; NaN matches NaN), normwise (||got - want|| / ||want||, for
// GEMM-shaped outputs) or exact (elements whose bits differ, NaN payloads aside; bound 0).
#include "apps/check.hpp"

#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <iterator>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "apps/check_families.hpp"
#include "fusekit/fusekit.hpp"
#include "ops/pointwise/bias_act_example.hpp"

#if FUSEKIT_WITH_CUDA
#include "fusekit/core/cuda_check.hpp"
#endif

namespace fk::app {
namespace {

using namespace check;

// ---------------------------------------------------------------------------------------------
// pointwise
// ---------------------------------------------------------------------------------------------

std::vector<Measure> pointwise_by_hand() {
  using namespace examples;
  std::vector<Measure> out;
  auto vec = [](const float* p, int n) { return std::vector<double>(p, p + n); };
  const int n = kBiasActRows * kBiasActCols;
  Tensor x = host({kBiasActRows, kBiasActCols}, DType::f32, vec(kBiasActX, n));
  const Tensor r = host({kBiasActRows, kBiasActCols}, DType::f32, vec(kBiasActR, n));
  const Tensor b = host({kBiasActCols}, DType::f32, vec(kBiasActBias, kBiasActCols));
  bias_act_forward({x, r.view(), b.view(), x, std::nullopt}, {Activation::relu, kBiasActAlpha});
  // The worked example's expected values are printed to 4 decimals.
  out.push_back(close("bias_act_forward relu(x + 2.3 r + b), f32 [8, 10]: the worked example",
                      values(x), vec(kBiasActExpected, n), {kBiasActTolerance, 0}));

  // z = [[-1, 2], [3, -4]], relu, alpha 2: dz = dy [z > 0]; dx = dz, dr = 2 dz, db = column sums.
  // Small integers: exact.
  const Tensor y = host({2, 2}, DType::f32, {0, 2, 3, 0}), dy = host({2, 2}, DType::f32, {10, 20, 30, 40});
  Tensor dx = Tensor::empty({2, 2}, DType::f32, kCpu), dr = Tensor::empty({2, 2}, DType::f32, kCpu),
         db = Tensor::empty({2}, DType::f32, kCpu);
  bias_act_backward({dy, y, SavedForBackward::output, dx, dr.view(), db.view()}, {Activation::relu, 2.0f});
  out.push_back(close("bias_act_backward dx, relu f32 [2, 2] by hand", values(dx), {0, 20, 30, 0}, kExact));
  out.push_back(close("bias_act_backward dr, relu f32 [2, 2] by hand", values(dr), {0, 40, 60, 0}, kExact));
  out.push_back(close("bias_act_backward dbias, relu f32 [2, 2] by hand", values(db), {30, 20}, kExact));
  return out;
}

// pointwise_test.cpp's PointwiseGpu: forward with r, bias and the pre-activation, then the
// backward from the spec's pre-activation (gelu needs z), f32 with a row tail.
std::vector<Measure> pointwise_against_spec(Device gpu) {
  std::vector<Measure> out;
  const DType dt = DType::f32;
  const std::int64_t rows = 257, cols = 1000;
  const Dims s{rows, cols};
  const BiasActParams p{Activation::gelu_tanh, 0.75f};
  const std::string c = fmt::format("{} {} {}", activation_name(p.act), dtype_name(dt), s.str());
  // The kernels compute in fp32 with fma and the device math library, the spec in double with one
  // rounding: a few fp32 ulps apart.
  const Tol tol{1e-5, 1e-5};

  const Tensor x = random(s, dt, 101, -3, 3), r = random(s, dt, 102, -3, 3), b = random({cols}, dt, 103);
  Tensor want_y = Tensor::empty(s, dt, kCpu), want_z = Tensor::empty(s, dt, kCpu);
  reference::bias_act_forward({x, r.view(), b.view(), want_y, want_z.view()}, p);
  const Tensor xd = x.copy_to(gpu), rd = r.copy_to(gpu), bd = b.copy_to(gpu);
  Tensor y = Tensor::empty(s, dt, gpu), z = Tensor::empty(s, dt, gpu);
  poison(y);
  poison(z);
  bias_act_forward({xd, rd.view(), bd.view(), y, z.view()}, p);
  out.push_back(close("bias_act_forward y, " + c, y, want_y, tol));
  out.push_back(close("bias_act_forward preact, " + c, z, want_z, tol));

  const Tensor dy = random(s, dt, 104);
  Tensor want_dx = Tensor::empty(s, dt, kCpu), want_dr = Tensor::empty(s, dt, kCpu),
         want_db = Tensor::empty({cols}, DType::f32, kCpu);
  reference::bias_act_backward({dy, want_z, SavedForBackward::preactivation, want_dx, want_dr.view(), want_db.view()},
                               p);
  const Tensor dyd = dy.copy_to(gpu), zd = want_z.copy_to(gpu);
  Tensor dx = Tensor::empty(s, dt, gpu), dr = Tensor::empty(s, dt, gpu), db = Tensor::empty({cols}, DType::f32, gpu);
  poison(dx);
  poison(dr);
  poison(db);
  bias_act_backward({dyd, zd, SavedForBackward::preactivation, dx, dr.view(), db.view()}, p);
  out.push_back(close("bias_act_backward dx, " + c, dx, want_dx, tol));
  out.push_back(close("bias_act_backward dr, " + c, dr, want_dr, tol));
  // db sums `rows` fp32 values of size <= ~2 in another order than the spec's double sum: the
  // error grows like sqrt(rows) fp32 roundings; plus one rounding to db's dtype.
  const Tol f32 = one_rounding(DType::f32);
  const double accum = 8.0 * std::sqrt(static_cast<double>(rows)) * 2.0 * 0x1p-24;
  out.push_back(close("bias_act_backward dbias, " + c, db, want_db, {f32.atol + accum, f32.rtol}));
  return out;
}

// ---------------------------------------------------------------------------------------------
// The families
// ---------------------------------------------------------------------------------------------

struct Family {
  const char* name;
  std::vector<Measure> (*by_hand)();             // on the CPU
  std::vector<Measure> (*against_spec)(Device);  // on a CUDA device
};

const Family kFamilies[] = {
    {"pointwise", pointwise_by_hand, pointwise_against_spec},
    {"gemm", gemm_by_hand, gemm_against_spec},
    {"primitives", primitives_by_hand, primitives_against_spec},
    {"quant", quant_by_hand, quant_against_spec},
    {"glu", glu_by_hand, glu_against_spec},
    {"qgemm", qgemm_by_hand, qgemm_against_spec},
    {"mlp", mlp_by_hand, mlp_against_spec},
    {"lora", lora_by_hand, lora_against_spec},
    {"recsys", recsys_by_hand, recsys_against_spec},
    {"norm", norm_by_hand, norm_against_spec},
};

std::string number(double v) { return v == 0 ? "0" : fmt::format("{:.1e}", v); }

// Runs one family on one device and prints its line; false when a comparison is past its bound
// or the family threw.
bool run_family(const Family& f, Device device) {
  const std::string head = fmt::format("{:<11} {:<7}", f.name, device.str());
  std::vector<Measure> ms;
  try {
#if FUSEKIT_WITH_CUDA
    // Launches, cuBLAS handles and the legacy default stream belong to the current device.
    std::optional<detail::DeviceScope> on_device;
    if (device.is_cuda()) on_device.emplace(device.index);
#endif
    ms = device.is_cpu() ? f.by_hand() : f.against_spec(device);
  } catch (const std::exception& e) {
    fmt::print("{} FAILED  error: {}\n", head, e.what());
    return false;
  }
  if (ms.empty()) {
    fmt::print("{} FAILED  no comparison made\n", head);
    return false;
  }
  std::size_t nearest = 0, failed = 0;
  for (std::size_t i = 0; i < ms.size(); ++i) {
    failed += !ms[i].ok();
    if (ms[i].nearness() > ms[nearest].nearness()) nearest = i;
  }
  const Measure& m = ms[nearest];
  fmt::print("{} {:<7} {:<8}  {:<8}  {} ({}; {})\n", head, failed ? "FAILED" : "ok", number(m.err), number(m.bound),
             m.what, m.kind,
             failed ? fmt::format("{} of {} comparisons failed", failed, ms.size())
                    : fmt::format("nearest of {} comparisons", ms.size()));
  return failed == 0;
}

}  // namespace

int run_check() {
  fmt::print("fusekit check: one case per op family and device. The CPU: hand-worked values. A CUDA device:\n"
             "the kernels on random inputs against the CPU spec, within the bounds of the GPU tests. Shown: the\n"
             "comparison nearest its bound (elementwise |got - want| <= atol + rtol |want|; normwise\n"
             "||got - want|| / ||want||; exact: elements whose bits differ).\n");
  fmt::print("{:<11} {:<7} {:<7} {:<8}  {:<8}  {}\n", "family", "device", "result", "error", "bound", "comparison");
  std::vector<Device> devices{kCpu};
  const int gpus = cuda_device_count();
  for (int i = 0; i < gpus; ++i) devices.push_back(Device::cuda(i));
  int failed = 0, run = 0;
  for (const Device& d : devices)
    for (const Family& f : kFamilies) {
      ++run;
      failed += !run_family(f, d);
    }
  if (gpus == 0) fmt::print("GPU checks skipped: {}\n", cuda_unavailable_reason());
  if (failed == 0) {
    fmt::print("check: all passed ({} families on {} device{})\n", std::size(kFamilies), devices.size(),
               devices.size() > 1 ? "s" : "");
    return 0;
  }
  fmt::print("check: FAILED ({} of {} family/device checks)\n", failed, run);
  return 1;
}

}  // namespace fk::app

