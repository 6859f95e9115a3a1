// Tests of the glu family: the spec against hand-worked values and finite differences, the weight
// layout conversions, the GPU (fused Hopper GEMM and the unfused path) against the spec on many
// shapes, the forward keeping its pre-activations and the backward from them (against the spec and
// the recomputing backward), the fused forward's memory, and every bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "fusekit/fusekit.hpp"
#include "ops/common/reference_io.hpp"
#if FUSEKIT_WITH_CUDA
#include "ops/glu/glu_cuda.hpp"
#endif
#include "test_util.hpp"

namespace fk {
namespace {

const Device kCpu = Device::cpu();
constexpr GluKind kKinds[] = {GluKind::sigmoid_tanh, GluKind::swiglu, GluKind::geglu_tanh, GluKind::geglu_erf,
                              GluKind::reglu};

Tensor host_tensor(const std::vector<float>& v, Dims shape) { return test::host_tensor(shape, DType::f32, v); }

// The op's stated relative error: normwise, as `fusekit bench` reports it.
const auto rel_err = test::rel_err_normwise;

// Maps a host tensor to {-v, 0, v}: -v below -threshold, v above, 0 between (threshold 0: +-v).
// With x and w in {-1, 0, 1} and a bias of +-0.5, C = x wᵀ + b is exact or rounded away from 0 in
// every dtype and path, never within 0.5 of 0, so relu'(C) is the same for the GPU and the spec.
void ternary(const TensorView& t, double threshold, double v) {
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    const double a = reference::load(t, i);
    reference::store(t, i, a > threshold ? v : (a < -threshold ? -v : (threshold == 0 ? v : 0.0)));
  }
}

// ---------------------------------------------------------------------------------------------
// The spec
// ---------------------------------------------------------------------------------------------

TEST(GluSpec, HandWorkedValues) {
  using reference::glu;
  EXPECT_NEAR(glu(GluKind::sigmoid_tanh, 1.0, 0.5), 0.33783471214704114, 1e-15);  // sigmoid(1) tanh(0.5)
  EXPECT_EQ(glu(GluKind::sigmoid_tanh, 3.0, 0.0), 0.0);
  EXPECT_NEAR(glu(GluKind::swiglu, 2.0, 3.0), 2.0 * 0.8807970779778823 * 3.0, 1e-14);
  EXPECT_NEAR(glu(GluKind::geglu_erf, 2.0, 1.0), 2.0 * 0.8413447460685429, 1e-14);   // 2 * Phi(1)
  EXPECT_NEAR(glu(GluKind::geglu_tanh, 2.0, 1.0), 2.0 * 0.8411919906082768, 1e-14);
  EXPECT_EQ(glu(GluKind::reglu, -1.0, 5.0), 0.0);
  EXPECT_EQ(glu(GluKind::reglu, 2.0, -3.0), -6.0);
}

TEST(GluSpec, DerivativesMatchCentralDifferences) {
  for (GluKind k : kKinds)
    for (double l : {-2.3, -0.4, 0.6, 1.7})
      for (double r : {-1.9, 0.2, 2.2}) {
        const double h = 1e-6;
        const double fl = (reference::glu(k, l + h, r) - reference::glu(k, l - h, r)) / (2 * h);
        const double fr = (reference::glu(k, l, r + h) - reference::glu(k, l, r - h)) / (2 * h);
        EXPECT_NEAR(reference::glu_dl(k, l, r), fl, 1e-7) << glu_kind_name(k) << " l=" << l << " r=" << r;
        EXPECT_NEAR(reference::glu_dr(k, l, r), fr, 1e-7) << glu_kind_name(k) << " l=" << l << " r=" << r;
      }
}

TEST(GluSpec, TinyForwardByHand) {
  // x = [1, 2], w = [[1, 0], [0, 1]] (left row, right row), b = [0.5, -0.5]: L = 1.5, R = 1.5.
  const Tensor x = host_tensor({1, 2}, {1, 2});
  const Tensor w = host_tensor({1, 0, 0, 1}, {2, 2});
  const Tensor b = host_tensor({0.5f, -0.5f}, {2});
  Tensor out = Tensor::empty({1, 1}, DType::f32, kCpu);
  reference::glu_forward({x, w, b.view(), out}, {.kind = GluKind::swiglu});
  EXPECT_NEAR(out.data_as<float>()[0], 1.839542571435698, 1e-6);  // silu(1.5) * 1.5
  // The same through the public op, which takes the prepared layout (here identical: N = 1).
  reference::glu_forward({x, w, std::nullopt, out}, {.kind = GluKind::sigmoid_tanh});
  EXPECT_NEAR(out.data_as<float>()[0], 1.0 / (1.0 + std::exp(-1.0)) * std::tanh(2.0), 1e-6);
}

TEST(GluSpec, BackwardMatchesFiniteDifferencesOfForward) {
  // loss = sum(out * G); its gradients through glu_backward against central differences, f32 on
  // the CPU (the spec in double underneath, rounded once at the store).
  const std::int64_t m = 3, n = 2, k = 4;
  for (GluKind kind : kKinds) {
    const GluOptions opt{.kind = kind};
    Tensor x = test::random_tensor({m, k}, DType::f32, kCpu, 1, -1.f, 1.f);
    Tensor w = test::random_tensor({2 * n, k}, DType::f32, kCpu, 2, -1.f, 1.f);
    Tensor b = test::random_tensor({2 * n}, DType::f32, kCpu, 3, -0.5f, 0.5f);
    const Tensor g = test::random_tensor({m, n}, DType::f32, kCpu, 4, -1.f, 1.f);
    Tensor dx = Tensor::empty({m, k}, DType::f32, kCpu), dw = Tensor::empty({2 * n, k}, DType::f32, kCpu),
           db = Tensor::empty({2 * n}, DType::f32, kCpu);
    reference::glu_backward({g, x, w, b.view(), dx.view(), dw.view(), db.view()}, opt);
    auto loss = [&] {
      Tensor out = Tensor::empty({m, n}, DType::f32, kCpu);
      reference::glu_forward({x, w, b.view(), out}, opt);
      double s = 0;
      for (std::int64_t i = 0; i < m * n; ++i) s += double(out.data_as<float>()[i]) * g.data_as<float>()[i];
      return s;
    };
    auto check = [&](Tensor& param, const Tensor& grad, const char* name) {
      for (std::int64_t i = 0; i < param.numel(); ++i) {
        float* p = param.data_as<float>() + i;
        const float keep = *p, h = 1e-2f;
        *p = keep + h;
        const double up = loss();
        *p = keep - h;
        const double down = loss();
        *p = keep;
        // reglu's kink at 0 is not differentiable: skip points within h of it.
        EXPECT_NEAR(grad.data_as<float>()[i], (up - down) / (2.0 * h), 2e-3)
            << glu_kind_name(kind) << " d" << name << "[" << i << "]";
      }
    };
    if (kind != GluKind::reglu) {
      check(x, dx, "x");
      check(w, dw, "w");
      check(b, db, "b");
    }
  }
}

TEST(GluSpec, KeptPreactivationsAreCAndTheBackwardFromThemIsTheRecomputingOne) {
  const std::int64_t m = 4, n = 3, k = 5;
  for (GluKind kind : kKinds) {
    const GluOptions opt{.kind = kind};
    const Tensor x = test::random_tensor({m, k}, DType::f32, kCpu, 41);
    const Tensor w = test::random_tensor({2 * n, k}, DType::f32, kCpu, 42);
    const Tensor b = test::random_tensor({2 * n}, DType::f32, kCpu, 43);
    const Tensor dy = test::random_tensor({m, n}, DType::f32, kCpu, 44);
    Tensor out = Tensor::empty({m, n}, DType::f32, kCpu), c = Tensor::empty({m, 2 * n}, DType::f32, kCpu);
    reference::glu_forward({x, w, b.view(), out, c.view()}, opt);
    for (std::int64_t i = 0; i < m; ++i)
      for (std::int64_t j = 0; j < 2 * n; ++j) {
        double want = b.data_as<float>()[j];
        for (std::int64_t kk = 0; kk < k; ++kk) want += double(x.data_as<float>()[i * k + kk]) * w.data_as<float>()[j * k + kk];
        EXPECT_NEAR(c.data_as<float>()[i * 2 * n + j], want, 1e-6) << i << "," << j;
      }
    Tensor dx = Tensor::empty({m, k}, DType::f32, kCpu), dw = Tensor::empty({2 * n, k}, DType::f32, kCpu),
           db = Tensor::empty({2 * n}, DType::f32, kCpu);
    Tensor dx2 = Tensor::empty({m, k}, DType::f32, kCpu), dw2 = Tensor::empty({2 * n, k}, DType::f32, kCpu),
           db2 = Tensor::empty({2 * n}, DType::f32, kCpu);
    reference::glu_backward({dy, x, w, b.view(), dx.view(), dw.view(), db.view()}, opt);
    reference::glu_backward_from_preact({dy, x, w, c.view(), dx2.view(), dw2.view(), db2.view()}, opt);
    // C rounded once to f32 is the only difference.
    EXPECT_LE(rel_err(dx2, dx), 1e-6) << glu_kind_name(kind);
    EXPECT_LE(rel_err(dw2, dw), 1e-6) << glu_kind_name(kind);
    EXPECT_LE(rel_err(db2, db), 1e-6) << glu_kind_name(kind);
  }
}

TEST(GluLayout, PrepareInterleavesHalvesAndUnprepareInverts) {
  // Rows r0..r3 of a [2N = 4, K = 3] weight: prepared order r0, r2, r1, r3.
  std::vector<float> v(12);
  for (int i = 0; i < 12; ++i) v[i] = float(i);
  const Tensor w = host_tensor(v, {4, 3});
  const Tensor p = glu_prepare_weight(w);
  const std::vector<float> want = {0, 1, 2, 6, 7, 8, 3, 4, 5, 9, 10, 11};
  for (int i = 0; i < 12; ++i) EXPECT_EQ(p.data_as<float>()[i], want[i]) << i;
  const Tensor back = glu_unprepare_weight(p);
  for (int i = 0; i < 12; ++i) EXPECT_EQ(back.data_as<float>()[i], v[i]) << i;
  const Tensor b = host_tensor({10, 11, 20, 21}, {4});
  const Tensor bp = glu_prepare_weight(b);
  EXPECT_EQ(bp.data_as<float>()[1], 20.f);
  EXPECT_EQ(bp.data_as<float>()[2], 11.f);
}

TEST(GluLayout, CpuOpTakesThePreparedLayout) {
  const std::int64_t m = 5, n = 3, k = 7;
  const Tensor x = test::random_tensor({m, k}, DType::f32, kCpu, 11);
  const Tensor w = test::random_tensor({2 * n, k}, DType::f32, kCpu, 12);
  const Tensor b = test::random_tensor({2 * n}, DType::f32, kCpu, 13);
  Tensor want = Tensor::empty({m, n}, DType::f32, kCpu), got = Tensor::empty({m, n}, DType::f32, kCpu);
  reference::glu_forward({x, w, b.view(), want}, {.kind = GluKind::geglu_erf});
  const Tensor wp = glu_prepare_weight(w), bp = glu_prepare_weight(b);
  glu_forward({x, wp, bp.view(), got}, {.kind = GluKind::geglu_erf});
  EXPECT_TRUE(test::all_close(got, want, {1e-6, 1e-6}));
}

TEST(GluLayout, CpuOpKeepsPreactivationsInThePreparedColumnOrder) {
  const std::int64_t m = 3, n = 4, k = 6;
  const GluOptions opt{.kind = GluKind::swiglu};
  const Tensor x = test::random_tensor({m, k}, DType::f32, kCpu, 51);
  const Tensor w = test::random_tensor({2 * n, k}, DType::f32, kCpu, 52);
  const Tensor b = test::random_tensor({2 * n}, DType::f32, kCpu, 53);
  const Tensor dy = test::random_tensor({m, n}, DType::f32, kCpu, 54);
  Tensor out = Tensor::empty({m, n}, DType::f32, kCpu), c = Tensor::empty({m, 2 * n}, DType::f32, kCpu);
  reference::glu_forward({x, w, b.view(), out, c.view()}, opt);
  const Tensor wp = glu_prepare_weight(w), bp = glu_prepare_weight(b);
  Tensor got = Tensor::empty({m, n}, DType::f32, kCpu), cp = Tensor::empty({m, 2 * n}, DType::f32, kCpu);
  glu_forward({x, wp, bp.view(), got, cp.view()}, opt);
  EXPECT_TRUE(test::all_close(got, out, {1e-6, 1e-6}));
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      EXPECT_EQ(cp.data_as<float>()[i * 2 * n + 2 * j], c.data_as<float>()[i * 2 * n + j]) << i << "," << j;
      EXPECT_EQ(cp.data_as<float>()[i * 2 * n + 2 * j + 1], c.data_as<float>()[i * 2 * n + n + j]) << i << "," << j;
    }
  // The backward from it, with the prepared weight, gives glu_backward's prepared gradients.
  Tensor dx = Tensor::empty({m, k}, DType::f32, kCpu), dw = Tensor::empty({2 * n, k}, DType::f32, kCpu),
         db = Tensor::empty({2 * n}, DType::f32, kCpu);
  glu_backward({dy, x, wp, bp.view(), dx.view(), dw.view(), db.view()}, opt);
  for (bool overwrite : {false, true}) {
    Tensor dx2 = Tensor::empty({m, k}, DType::f32, kCpu), dw2 = Tensor::empty({2 * n, k}, DType::f32, kCpu),
           db2 = Tensor::empty({2 * n}, DType::f32, kCpu);
    glu_backward_from_preact({dy, x, wp, cp.view(), dx2.view(), dw2.view(), db2.view(), overwrite}, opt);
    EXPECT_LE(rel_err(dx2, dx), 1e-6);
    EXPECT_LE(rel_err(dw2, dw), 1e-6);
    EXPECT_LE(rel_err(db2, db), 1e-6);
  }
}

// glu_activate on the prepared C = [l0, r0, l1, r1] = [1, 2, -1, 3], swiglu: out = [silu(1) * 2,
// silu(-1) * 3] = [2 / (1 + e^-1), -3 / (1 + e)].
TEST(GluSpec, ActivateByHand) {
  const Tensor c = test::host_tensor({1, 4}, DType::f32, {1.0f, 2.0f, -1.0f, 3.0f});
  Tensor out = Tensor::empty({1, 2}, DType::f32, kCpu);
  glu_activate({c, out}, {.kind = GluKind::swiglu});
  EXPECT_NEAR(out.data_as<float>()[0], 2.0 / (1.0 + std::exp(-1.0)), 1e-6);
  EXPECT_NEAR(out.data_as<float>()[1], -3.0 / (1.0 + std::exp(1.0)), 1e-6);
}

// glu_forward (CPU, f32) of a random x [m, k] and prepared w [2n, k] (seeds seed, seed + 1),
// keeping C: x, the prepared w, out and C.
struct KeptForward {
  Tensor x, wp, out, c;
};

KeptForward kept_forward(std::int64_t m, std::int64_t n, std::int64_t k, const GluOptions& opt, std::uint64_t seed) {
  KeptForward f{test::random_tensor({m, k}, DType::f32, kCpu, seed),
                glu_prepare_weight(test::random_tensor({2 * n, k}, DType::f32, kCpu, seed + 1)),
                Tensor::empty({m, n}, DType::f32, kCpu), Tensor::empty({m, 2 * n}, DType::f32, kCpu)};
  glu_forward({f.x, f.wp, std::nullopt, f.out, f.c.view()}, opt);
  return f;
}

// glu_activate of the kept C is the forward's out (the CPU op, prepared layout, every kind).
TEST(GluLayout, ActivateOfTheKeptPreactivationsIsTheForwardsOut) {
  const std::int64_t m = 4, n = 5;
  for (GluKind kind : {GluKind::sigmoid_tanh, GluKind::swiglu, GluKind::geglu_tanh, GluKind::geglu_erf, GluKind::reglu}) {
    const GluOptions opt{.kind = kind};
    const auto [x, wp, out, c] = kept_forward(m, n, 6, opt, 71);
    Tensor again = Tensor::empty({m, n}, DType::f32, kCpu);
    glu_activate({c, again}, opt);
    EXPECT_LE(rel_err(again, out), 1e-6) << glu_kind_name(kind);
  }
}

TEST(GluErrors, ActivateNamesItsArgument) {
  const Tensor c = Tensor::empty({3, 8}, DType::bf16, kCpu), odd = Tensor::empty({3, 7}, DType::bf16, kCpu);
  Tensor out = Tensor::empty({3, 4}, DType::bf16, kCpu), out32 = Tensor::empty({3, 4}, DType::f32, kCpu);
  Tensor wide = Tensor::empty({3, 5}, DType::bf16, kCpu);
  test::expect_arg_error([&] { glu_activate({odd, out}, {}); }, "glu_activate", "preact");
  test::expect_arg_error([&] { glu_activate({c, out32}, {}); }, "glu_activate", "out");
  test::expect_arg_error([&] { glu_activate({c, wide}, {}); }, "glu_activate", "out");
  const TensorView strided(c.data(), DType::bf16, {3, 4}, {8, 1}, kCpu);  // rows 8 apart: not contiguous
  test::expect_arg_error([&] { glu_activate({c, strided}, {}); }, "glu_activate", "out");
  EXPECT_NO_THROW(glu_activate({c, out}, {}));
}

// glu_preact_grad on the prepared C = [l0, r0] = [1, 2], dy = 3, swiglu (silu(l) r):
// dC = [3 r silu'(1), 3 silu(1)], silu'(l) = s(l) (1 + l (1 - s(l))), s the logistic function.
TEST(GluSpec, PreactGradByHand) {
  const Tensor c = test::host_tensor({1, 2}, DType::f32, {1.0f, 2.0f}), dy = test::host_tensor({1, 1}, DType::f32, {3.0f});
  Tensor dc = Tensor::empty({1, 2}, DType::f32, kCpu);
  glu_preact_grad({dy, c, dc}, {.kind = GluKind::swiglu});
  const double s = 1.0 / (1.0 + std::exp(-1.0));
  EXPECT_NEAR(dc.data_as<float>()[0], 3.0 * 2.0 * s * (1.0 + (1.0 - s)), 1e-5);
  EXPECT_NEAR(dc.data_as<float>()[1], 3.0 * s, 1e-6);
}

// dC from the kept C, multiplied out (dx = dC w, dw = dCᵀ x), is glu_backward_from_preact's (the CPU
// op, prepared layout, every kind), and written over C gives the same dC.
TEST(GluLayout, PreactGradIsTheBackwardsDc) {
  const std::int64_t m = 5, n = 3, k = 4;
  for (GluKind kind : {GluKind::sigmoid_tanh, GluKind::swiglu, GluKind::geglu_tanh, GluKind::geglu_erf, GluKind::reglu}) {
    const GluOptions opt{.kind = kind};
    const auto [x, wp, out, c] = kept_forward(m, n, k, opt, 81);
    const Tensor dy = test::random_tensor({m, n}, DType::f32, kCpu, 83);
    Tensor dc = Tensor::empty({m, 2 * n}, DType::f32, kCpu);
    glu_preact_grad({dy, c, dc}, opt);
    Tensor dx = Tensor::empty({m, k}, DType::f32, kCpu), dw = Tensor::empty({2 * n, k}, DType::f32, kCpu);
    glu_backward_from_preact({dy, x, wp, c, dx.view(), dw.view(), std::nullopt, false}, opt);
    Tensor dx2 = Tensor::empty({m, k}, DType::f32, kCpu), dw2 = Tensor::empty({2 * n, k}, DType::f32, kCpu);
    matmul(dc, wp, dx2, Trans::n, Trans::n);
    matmul(dc, x, dw2, Trans::t, Trans::n);
    EXPECT_LE(rel_err(dx2, dx), 1e-6) << glu_kind_name(kind);
    EXPECT_LE(rel_err(dw2, dw), 1e-6) << glu_kind_name(kind);
    // The optional out of either op is glu_activate's.
    Tensor act = Tensor::empty({m, n}, DType::f32, kCpu), out1 = Tensor::empty({m, n}, DType::f32, kCpu),
           out2 = Tensor::empty({m, n}, DType::f32, kCpu), dc2 = Tensor::empty({m, 2 * n}, DType::f32, kCpu);
    glu_activate({c, act}, opt);
    glu_preact_grad({dy, c, dc2, out1.view()}, opt);
    glu_backward_from_preact({dy, x, wp, c, dx.view(), std::nullopt, std::nullopt, false, out2.view()}, opt);
    EXPECT_EQ(rel_err(out1, act), 0.0) << glu_kind_name(kind);
    EXPECT_EQ(rel_err(out2, act), 0.0) << glu_kind_name(kind);
    EXPECT_EQ(rel_err(dc2, dc), 0.0) << glu_kind_name(kind);
    glu_preact_grad({dy, c, c}, opt);  // over C
    EXPECT_EQ(rel_err(c, dc), 0.0) << glu_kind_name(kind);
  }
}

// With down_w [K', N], dy [M, K'] is the down projection's output gradient: the op is itself given
// dh = dy down_w (the CPU op, every kind; its outputs equal element for element), and its
// arguments are checked against down_w's shape.
TEST(GluLayout, DownProjectionGradientIsFormedInsideTheOp) {
  const std::int64_t m = 5, n = 3, k = 4, kd = 6;
  for (GluKind kind : kKinds) {
    const GluOptions opt{.kind = kind};
    const auto [x, wp, out, c] = kept_forward(m, n, k, opt, 91);
    const Tensor dy = test::random_tensor({m, kd}, DType::f32, kCpu, 93), down_w = test::random_tensor({kd, n}, DType::f32, kCpu, 95);
    Tensor dh = Tensor::empty({m, n}, DType::f32, kCpu);
    matmul(dy, down_w, dh);
    Tensor dx = Tensor::empty({m, k}, DType::f32, kCpu), dw = Tensor::empty({2 * n, k}, DType::f32, kCpu),
           act = Tensor::empty({m, n}, DType::f32, kCpu);
    glu_backward_from_preact({dh, x, wp, c, dx.view(), dw.view(), std::nullopt, false, act.view()}, opt);
    Tensor dx2 = Tensor::empty({m, k}, DType::f32, kCpu), dw2 = Tensor::empty({2 * n, k}, DType::f32, kCpu),
           act2 = Tensor::empty({m, n}, DType::f32, kCpu);
    glu_backward_from_preact({dy, x, wp, c, dx2.view(), dw2.view(), std::nullopt, false, act2.view(), down_w.view()},
                             opt);
    EXPECT_EQ(test::to_doubles(dx2), test::to_doubles(dx)) << glu_kind_name(kind);
    EXPECT_EQ(test::to_doubles(dw2), test::to_doubles(dw)) << glu_kind_name(kind);
    EXPECT_EQ(test::to_doubles(act2), test::to_doubles(act)) << glu_kind_name(kind);
  }
  const auto [x0, wp0, out0, c0] = kept_forward(m, n, k, {}, 97);
  const Tensor &x = x0, &wp = wp0, &c = c0;  // named, so that the lambda below may capture them
  const Tensor dy = Tensor::empty({m, kd}, DType::f32, kCpu);
  Tensor dx = Tensor::empty({m, k}, DType::f32, kCpu);
  const Tensor wide = Tensor::empty({kd, n + 1}, DType::f32, kCpu), tall = Tensor::empty({kd + 1, n}, DType::f32, kCpu),
               half = Tensor::empty({kd, n}, DType::bf16, kCpu), flat = Tensor::empty({kd * n}, DType::f32, kCpu);
  const auto call = [&](const Tensor& d) {
    glu_backward_from_preact({dy, x, wp, c, dx.view(), std::nullopt, std::nullopt, false, std::nullopt, d.view()}, {});
  };
  test::expect_arg_error([&] { call(wide); }, "glu_backward_from_preact", "down_w");
  test::expect_arg_error([&] { call(half); }, "glu_backward_from_preact", "down_w");
  test::expect_arg_error([&] { call(flat); }, "glu_backward_from_preact", "down_w");
  test::expect_arg_error([&] { call(tall); }, "glu_backward_from_preact", "dy");
}

TEST(GluErrors, PreactGradNamesItsArgument) {
  const Tensor c = Tensor::empty({3, 8}, DType::bf16, kCpu), odd = Tensor::empty({3, 7}, DType::bf16, kCpu);
  const Tensor dy = Tensor::empty({3, 4}, DType::bf16, kCpu), dy32 = Tensor::empty({3, 4}, DType::f32, kCpu);
  Tensor dc = Tensor::empty({3, 8}, DType::bf16, kCpu), narrow = Tensor::empty({3, 4}, DType::bf16, kCpu);
  test::expect_arg_error([&] { glu_preact_grad({dy, odd, dc}, {}); }, "glu_preact_grad", "preact");
  test::expect_arg_error([&] { glu_preact_grad({dy32, c, dc}, {}); }, "glu_preact_grad", "dy");
  test::expect_arg_error([&] { glu_preact_grad({dy, c, narrow}, {}); }, "glu_preact_grad", "dpreact");
  test::expect_arg_error([&] { glu_preact_grad({dy, c, dc, dc.view()}, {}); }, "glu_preact_grad", "out");
  test::expect_arg_error([&] { glu_preact_grad({dy, c, dc, dy.view()}, {}); }, "glu_preact_grad", "out");
  EXPECT_NO_THROW(glu_preact_grad({dy, c, dc, narrow.view()}, {}));
  EXPECT_NO_THROW(glu_preact_grad({dy, c, dc}, {}));
}

// ---------------------------------------------------------------------------------------------
// GPU against the spec
// ---------------------------------------------------------------------------------------------

struct GpuCase {
  std::int64_t m, n, k;
  DType dtype;
  bool tf32;
};

double tolerance(const GpuCase& c) { return c.dtype == DType::f32 ? (c.tf32 ? 2e-3 : 1e-5) : 1e-2; }

std::vector<GpuCase> gpu_cases() {
  std::vector<GpuCase> cases;
  // Tails of every tile dimension, N odd, K = 8, M = 1, unaligned K (the unfused path).
  const std::int64_t shapes[][3] = {{1, 1, 8},    {1, 7, 16},    {3, 5, 8},     {17, 33, 24},   {128, 128, 64},
                                    {130, 257, 72}, {255, 129, 200}, {64, 300, 13}, {200, 96, 264}, {2, 3, 1}};
  for (const auto& s : shapes) {
    cases.push_back({s[0], s[1], s[2], DType::bf16, false});
    cases.push_back({s[0], s[1], s[2], DType::f16, false});
    cases.push_back({s[0], s[1], s[2], DType::f32, true});
  }
  cases.push_back({33, 65, 40, DType::f32, false});  // full fp32 (unfused)
  return cases;
}

TEST(GluGpu, ForwardMatchesSpec) {
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  int seed = 100;
  for (const GpuCase& c : gpu_cases())
    for (GluKind kind : kKinds)
      for (bool with_bias : {true, false}) {
        ++seed;
        if (!with_bias && kind != GluKind::swiglu && kind != GluKind::sigmoid_tanh) continue;
        const GluOptions opt{.kind = kind, .allow_tf32 = c.tf32};
        const Tensor x = test::random_tensor({c.m, c.k}, c.dtype, kCpu, seed, -1.f, 1.f);
        const Tensor w = test::random_tensor({2 * c.n, c.k}, c.dtype, kCpu, seed + 1000, -0.5f, 0.5f);
        const Tensor b = test::random_tensor({2 * c.n}, c.dtype, kCpu, seed + 2000, -0.5f, 0.5f);
        Tensor want = Tensor::empty({c.m, c.n}, c.dtype, kCpu);
        reference::glu_forward({x, w, with_bias ? std::optional(b.view()) : std::nullopt, want}, opt);
        const Tensor xg = x.copy_to(gpu), wg = glu_prepare_weight(w.copy_to(gpu)), bg = glu_prepare_weight(b.copy_to(gpu));
        Tensor out = Tensor::empty({c.m, c.n}, c.dtype, gpu);
        test::poison(out);
        glu_forward({xg, wg, with_bias ? std::optional(bg.view()) : std::nullopt, out}, opt);
        EXPECT_LE(rel_err(out, want), tolerance(c))
            << glu_kind_name(kind) << " " << dtype_name(c.dtype) << (c.tf32 ? " tf32" : "") << " M" << c.m << " N"
            << c.n << " K" << c.k << (with_bias ? " bias" : "");
      }
}

TEST(GluGpu, BackwardMatchesSpec) {
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  int seed = 5000;
  for (const GpuCase& c : gpu_cases())
    for (GluKind kind : {GluKind::sigmoid_tanh, GluKind::swiglu, GluKind::geglu_erf, GluKind::reglu}) {
      ++seed;
      const GluOptions opt{.kind = kind, .allow_tf32 = c.tf32};
      const Tensor x = test::random_tensor({c.m, c.k}, c.dtype, kCpu, seed, -1.f, 1.f);
      const Tensor w = test::random_tensor({2 * c.n, c.k}, c.dtype, kCpu, seed + 1000, -0.5f, 0.5f);
      const Tensor b = test::random_tensor({2 * c.n}, c.dtype, kCpu, seed + 2000, -0.5f, 0.5f);
      const Tensor dy = test::random_tensor({c.m, c.n}, c.dtype, kCpu, seed + 3000, -1.f, 1.f);
      if (kind == GluKind::reglu) {
        // relu' jumps at 0: rounding differences in C (TF32 operands, a C rounded before the bias
        // on the unfused path) would flip it for C near 0. Exact operands keep C off 0.
        ternary(x, 0.33, 1.0);
        ternary(w, 0.17, 1.0);
        ternary(b, 0.0, 0.5);
      }
      Tensor dx = Tensor::empty({c.m, c.k}, c.dtype, kCpu), dw = Tensor::empty({2 * c.n, c.k}, c.dtype, kCpu),
             db = Tensor::empty({2 * c.n}, c.dtype, kCpu);
      reference::glu_backward({dy, x, w, b.view(), dx.view(), dw.view(), db.view()}, opt);
      const Tensor xg = x.copy_to(gpu), wg = glu_prepare_weight(w.copy_to(gpu)), bg = glu_prepare_weight(b.copy_to(gpu));
      const Tensor dyg = dy.copy_to(gpu);
      Tensor gdx = Tensor::empty({c.m, c.k}, c.dtype, gpu), gdw = Tensor::empty({2 * c.n, c.k}, c.dtype, gpu),
             gdb = Tensor::empty({2 * c.n}, c.dtype, gpu);
      test::poison(gdx);
      test::poison(gdw);
      test::poison(gdb);
      glu_backward({dyg, xg, wg, bg.view(), gdx.view(), gdw.view(), gdb.view()}, opt);
      const std::string what = std::string(glu_kind_name(kind)) + " " + std::string(dtype_name(c.dtype)) +
                               (c.tf32 ? " tf32" : "") + " M" + std::to_string(c.m) + " N" + std::to_string(c.n) +
                               " K" + std::to_string(c.k);
      // dC is rounded to the operand dtype before the two GEMMs: one more rounding than the spec.
      const double tol = 2 * tolerance(c);
      EXPECT_LE(rel_err(gdx, dx), tol) << "dx " << what;
      EXPECT_LE(rel_err(glu_unprepare_weight(gdw), dw), tol) << "dw " << what;
      EXPECT_LE(rel_err(glu_unprepare_weight(gdb), db), tol) << "db " << what;
    }
}

// The spec's pre-activations [M, 2N] in the prepared column order (what the op keeps).
Tensor spec_preact(const Tensor& x, const Tensor& w, const Tensor& b, bool with_bias, GluKind kind) {
  Tensor out = Tensor::empty({x.size(0), w.size(0) / 2}, x.dtype(), kCpu);
  Tensor c = Tensor::empty({x.size(0), w.size(0)}, x.dtype(), kCpu);
  const Tensor bp = glu_prepare_weight(b);
  glu_forward({x, glu_prepare_weight(w).view(), with_bias ? std::optional(bp.view()) : std::nullopt, out, c.view()},
              {.kind = kind});
  return c;
}

TEST(GluGpu, ForwardKeepingPreactivationsMatchesSpec) {
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  int seed = 300;
  for (const GpuCase& c : gpu_cases())
    for (GluKind kind : {GluKind::sigmoid_tanh, GluKind::swiglu, GluKind::geglu_tanh})
      for (bool with_bias : {true, false}) {
        ++seed;
        const GluOptions opt{.kind = kind, .allow_tf32 = c.tf32};
        const Tensor x = test::random_tensor({c.m, c.k}, c.dtype, kCpu, seed, -1.f, 1.f);
        const Tensor w = test::random_tensor({2 * c.n, c.k}, c.dtype, kCpu, seed + 1000, -0.5f, 0.5f);
        const Tensor b = test::random_tensor({2 * c.n}, c.dtype, kCpu, seed + 2000, -0.5f, 0.5f);
        Tensor want = Tensor::empty({c.m, c.n}, c.dtype, kCpu);
        reference::glu_forward({x, w, with_bias ? std::optional(b.view()) : std::nullopt, want}, opt);
        const Tensor want_c = spec_preact(x, w, b, with_bias, kind);
        const Tensor xg = x.copy_to(gpu), wg = glu_prepare_weight(w.copy_to(gpu)), bg = glu_prepare_weight(b.copy_to(gpu));
        Tensor out = Tensor::empty({c.m, c.n}, c.dtype, gpu), cg = Tensor::empty({c.m, 2 * c.n}, c.dtype, gpu);
        test::poison(out);
        test::poison(cg);
        glu_forward({xg, wg, with_bias ? std::optional(bg.view()) : std::nullopt, out, cg.view()}, opt);
        const std::string what = std::string(glu_kind_name(kind)) + " " + std::string(dtype_name(c.dtype)) +
                                 (c.tf32 ? " tf32" : "") + " M" + std::to_string(c.m) + " N" + std::to_string(c.n) +
                                 " K" + std::to_string(c.k) + (with_bias ? " bias" : "");
        // out as the forward that keeps nothing computes it (ForwardMatchesSpec holds that one to the
        // spec), within the spec's bound: where the keeping path activates C after its rounding to
        // the operand dtype (a GEMM, then the pairs kernel), the two differ by that rounding. Against
        // the spec only where TF32's rounding of K products cannot swamp a single small output (M1
        // N1 K8: one value, whose norm is the error's denominator).
        Tensor plain = Tensor::empty({c.m, c.n}, c.dtype, gpu);
        glu_forward({xg, wg, with_bias ? std::optional(bg.view()) : std::nullopt, plain}, opt);
        EXPECT_LE(rel_err(out, plain), tolerance(c)) << "out vs the plain forward " << what;
        if (!c.tf32 || c.m * c.n >= 16) {
          EXPECT_LE(rel_err(out, want), tolerance(c)) << "out " << what;
        }
        EXPECT_LE(rel_err(cg, want_c), tolerance(c)) << "preact " << what;
      }
}

// Every elementwise case the GPU's pair pass takes: shapes (one row, odd widths, many rows) x
// dtypes x kinds, each with its own seed; f(m, n, dtype, kind, seed).
template <class F>
void for_each_pairs_case(int seed, F&& f) {
  const std::int64_t shapes[][2] = {{1, 1}, {3, 5}, {64, 300}, {130, 257}, {1000, 4096}};
  for (const auto& sh : shapes)
    for (DType dt : {DType::bf16, DType::f16, DType::f32})
      for (GluKind kind : {GluKind::sigmoid_tanh, GluKind::swiglu, GluKind::geglu_tanh, GluKind::geglu_erf,
                           GluKind::reglu}) {
        f(sh[0], sh[1], dt, kind, seed);
        seed += 2;
      }
}

TEST(GluGpu, ActivateMatchesTheCpuOp) {
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  for_each_pairs_case(700, [&](std::int64_t m, std::int64_t n, DType dt, GluKind kind, int seed) {
    const Tensor c = test::random_tensor({m, 2 * n}, dt, kCpu, seed, -3.f, 3.f);
    Tensor want = Tensor::empty({m, n}, dt, kCpu);
    glu_activate({c, want}, {.kind = kind});
    Tensor got = Tensor::empty({m, n}, dt, gpu);
    test::poison(got);
    glu_activate({c.copy_to(gpu), got}, {.kind = kind});
    const double tol = dt == DType::f32 ? 1e-6 : 1e-2;
    EXPECT_LE(rel_err(got, want), tol) << glu_kind_name(kind) << " " << dtype_name(dt) << " M" << m << " N" << n;
  });
}

TEST(GluGpu, PreactGradMatchesTheCpuOp) {
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  for_each_pairs_case(800, [&](std::int64_t m, std::int64_t n, DType dt, GluKind kind, int seed) {
    const Tensor c = test::random_tensor({m, 2 * n}, dt, kCpu, seed, -3.f, 3.f);
    const Tensor dy = test::random_tensor({m, n}, dt, kCpu, seed + 1);
    Tensor want = Tensor::empty({m, 2 * n}, dt, kCpu);
    glu_preact_grad({dy, c, want}, {.kind = kind});
    const Tensor cg = c.copy_to(gpu), dyg = dy.copy_to(gpu);
    Tensor got = Tensor::empty({m, 2 * n}, dt, gpu);
    test::poison(got);
    glu_preact_grad({dyg, cg, got}, {.kind = kind});
    // f32: erf's gradient sums erff and expf terms (a few ulp each in CUDA's math library); at
    // M1 N1 one element carries them whole.
    const double tol = dt == DType::f32 ? 5e-6 : 1e-2;
    const std::string what = std::string(glu_kind_name(kind)) + " " + std::string(dtype_name(dt)) + " M" +
                             std::to_string(m) + " N" + std::to_string(n);
    EXPECT_LE(rel_err(got, want), tol) << what;
    // With out: the same dC, and out is glu_activate's, element for element.
    Tensor got2 = Tensor::empty({m, 2 * n}, dt, gpu), out = Tensor::empty({m, n}, dt, gpu),
           act = Tensor::empty({m, n}, dt, gpu);
    test::poison(got2);
    test::poison(out);
    glu_preact_grad({dyg, cg, got2, out.view()}, {.kind = kind});
    glu_activate({cg, act}, {.kind = kind});
    EXPECT_EQ(test::to_doubles(got2), test::to_doubles(got)) << what;
    EXPECT_EQ(test::to_doubles(out), test::to_doubles(act)) << what;
  });
}

TEST(GluGpu, BackwardFromPreactivationsMatchesSpecAndRecompute) {
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  int seed = 7000;
  for (const GpuCase& c : gpu_cases())
    for (GluKind kind : {GluKind::sigmoid_tanh, GluKind::swiglu, GluKind::geglu_erf, GluKind::reglu}) {
      ++seed;
      const GluOptions opt{.kind = kind, .allow_tf32 = c.tf32};
      const Tensor x = test::random_tensor({c.m, c.k}, c.dtype, kCpu, seed, -1.f, 1.f);
      const Tensor w = test::random_tensor({2 * c.n, c.k}, c.dtype, kCpu, seed + 1000, -0.5f, 0.5f);
      const Tensor b = test::random_tensor({2 * c.n}, c.dtype, kCpu, seed + 2000, -0.5f, 0.5f);
      const Tensor dy = test::random_tensor({c.m, c.n}, c.dtype, kCpu, seed + 3000, -1.f, 1.f);
      if (kind == GluKind::reglu) {  // C kept off relu's jump, as in BackwardMatchesSpec
        ternary(x, 0.33, 1.0);
        ternary(w, 0.17, 1.0);
        ternary(b, 0.0, 0.5);
      }
      Tensor dx = Tensor::empty({c.m, c.k}, c.dtype, kCpu), dw = Tensor::empty({2 * c.n, c.k}, c.dtype, kCpu),
             db = Tensor::empty({2 * c.n}, c.dtype, kCpu);
      reference::glu_backward({dy, x, w, b.view(), dx.view(), dw.view(), db.view()}, opt);
      const Tensor xg = x.copy_to(gpu), wg = glu_prepare_weight(w.copy_to(gpu)), bg = glu_prepare_weight(b.copy_to(gpu));
      const Tensor dyg = dy.copy_to(gpu);
      Tensor out = Tensor::empty({c.m, c.n}, c.dtype, gpu), cg = Tensor::empty({c.m, 2 * c.n}, c.dtype, gpu);
      glu_forward({xg, wg, bg.view(), out, cg.view()}, opt);
      const std::vector<double> kept = test::to_doubles(cg);
      // The recomputing backward on the GPU, for comparison.
      Tensor rdx = Tensor::empty({c.m, c.k}, c.dtype, gpu), rdw = Tensor::empty({2 * c.n, c.k}, c.dtype, gpu),
             rdb = Tensor::empty({2 * c.n}, c.dtype, gpu);
      glu_backward({dyg, xg, wg, bg.view(), rdx.view(), rdw.view(), rdb.view()}, opt);
      const std::string what = std::string(glu_kind_name(kind)) + " " + std::string(dtype_name(c.dtype)) +
                               (c.tf32 ? " tf32" : "") + " M" + std::to_string(c.m) + " N" + std::to_string(c.n) +
                               " K" + std::to_string(c.k);
      for (bool overwrite : {false, true}) {
        Tensor gdx = Tensor::empty({c.m, c.k}, c.dtype, gpu), gdw = Tensor::empty({2 * c.n, c.k}, c.dtype, gpu),
               gdb = Tensor::empty({2 * c.n}, c.dtype, gpu);
        test::poison(gdx);
        test::poison(gdw);
        test::poison(gdb);
        // In place, with out: glu(C) from the same read, before dC replaces C.
        Tensor act = Tensor::empty({c.m, c.n}, c.dtype, gpu), want_act = Tensor::empty({c.m, c.n}, c.dtype, gpu);
        test::poison(act);
        if (overwrite) glu_activate({cg, want_act}, opt);
        glu_backward_from_preact({dyg, xg, wg, cg.view(), gdx.view(), gdw.view(), gdb.view(), overwrite,
                                  overwrite ? std::optional<TensorView>(act.view()) : std::nullopt},
                                 opt);
        const std::string w2 = what + (overwrite ? " in place" : "");
        if (overwrite) {
          EXPECT_EQ(test::to_doubles(act), test::to_doubles(want_act)) << "out " << w2;
        }
        // dC rounded to the operand dtype before the two GEMMs, and C rounded once before dC: the
        // recomputing backward's bound holds (C's rounding moves dC by under one rounding of it).
        const double tol = 2 * tolerance(c);
        EXPECT_LE(rel_err(gdx, dx), tol) << "dx " << w2;
        EXPECT_LE(rel_err(glu_unprepare_weight(gdw), dw), tol) << "dw " << w2;
        EXPECT_LE(rel_err(glu_unprepare_weight(gdb), db), tol) << "db " << w2;
        EXPECT_LE(rel_err(gdx, rdx), tol) << "dx vs recompute " << w2;
        EXPECT_LE(rel_err(gdw, rdw), tol) << "dw vs recompute " << w2;
        EXPECT_LE(rel_err(gdb, rdb), tol) << "db vs recompute " << w2;
        if (!overwrite) {
          EXPECT_EQ(test::to_doubles(cg), kept) << "preact changed " << w2;
        }
      }
    }
}

// A thread that has made no CUDA call yet (as PyTorch's autograd threads are when a fusekit op
// comes first in a backward) has no current context: the fused GEMM, whose TMA descriptors are
// encoded by the driver before its first launch, must run there and give the main thread's result.
TEST(GluGpu, FusedGemmRunsOnAThreadWithNoCudaCallsYet) {
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  const std::int64_t m = 256, n = 128, k = 64;
  const GluOptions opt{.kind = GluKind::swiglu};
  const Tensor x = test::random_tensor({m, k}, DType::bf16, kCpu, 501).copy_to(gpu);
  const Tensor w = test::random_tensor({2 * n, k}, DType::bf16, kCpu, 502, -0.2f, 0.2f).copy_to(gpu);
  Tensor want = Tensor::empty({m, n}, DType::bf16, gpu), got = Tensor::empty({m, n}, DType::bf16, gpu);
  test::poison(got);
  glu_forward({x, w, std::nullopt, want}, opt);
  std::string error;
  std::thread worker([&] {
    try {
      glu_forward({x, w, std::nullopt, got}, opt);
      Stream::default_stream().synchronize();
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  worker.join();
  EXPECT_EQ(error, "");
  EXPECT_EQ(test::to_doubles(got), test::to_doubles(want));
}

// The backward through the down projection (down_w given), with and without out, against the CPU
// op on the same inputs. Below 128 output tiles of 128 x 128 (all shapes but M 2500 N 1032), or in
// f32, the op forms dh by cuBLAS, rounded, before the pass over C, and out is glu_activate's bit
// for bit; from 128 tiles up on Hopper the fused GEMM forms out with the fast activations.
TEST(GluGpu, BackwardThroughTheDownProjectionMatchesTheCpuOp) {
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  struct Shape { std::int64_t m, n, k, kd; };
  const Shape shapes[] = {{1, 8, 16, 8},      {7, 24, 8, 64},      {130, 136, 32, 72},   {300, 256, 16, 128},
                          {1000, 264, 24, 40}, {4099, 128, 16, 768}, {2500, 1032, 8, 16}, {33, 12, 16, 8}};
  int seed = 9100;
  for (const Shape& sh : shapes)
    for (DType dt : {DType::bf16, DType::f16, DType::f32})
      for (GluKind kind : kKinds) {
        seed += 7;
        const GluOptions opt{.kind = kind};
        const Tensor x = test::random_tensor({sh.m, sh.k}, dt, kCpu, seed, -1.f, 1.f);
        const Tensor wp = test::random_tensor({2 * sh.n, sh.k}, dt, kCpu, seed + 1, -0.5f, 0.5f);
        const Tensor c = test::random_tensor({sh.m, 2 * sh.n}, dt, kCpu, seed + 2, -3.f, 3.f);
        const Tensor dy = test::random_tensor({sh.m, sh.kd}, dt, kCpu, seed + 3, -1.f, 1.f);
        const Tensor down_w = test::random_tensor({sh.kd, sh.n}, dt, kCpu, seed + 4, -0.3f, 0.3f);
        Tensor dx = Tensor::empty({sh.m, sh.k}, dt, kCpu), dw = Tensor::empty({2 * sh.n, sh.k}, dt, kCpu),
               act = Tensor::empty({sh.m, sh.n}, dt, kCpu);
        glu_backward_from_preact({dy, x, wp, c, dx.view(), dw.view(), std::nullopt, false, act.view(), down_w.view()},
                                 opt);
        const Tensor xg = x.copy_to(gpu), wg = wp.copy_to(gpu), cg = c.copy_to(gpu), dyg = dy.copy_to(gpu),
                     dg = down_w.copy_to(gpu);
        Tensor gdx = Tensor::empty({sh.m, sh.k}, dt, gpu), gdw = Tensor::empty({2 * sh.n, sh.k}, dt, gpu),
               gact = Tensor::empty({sh.m, sh.n}, dt, gpu);
        test::poison(gdx);
        test::poison(gdw);
        test::poison(gact);
        glu_backward_from_preact({dyg, xg, wg, cg, gdx.view(), gdw.view(), std::nullopt, false, gact.view(), dg.view()},
                                 opt);
        const std::string what = std::string(glu_kind_name(kind)) + " " + std::string(dtype_name(dt)) + " M" +
                                 std::to_string(sh.m) + " N" + std::to_string(sh.n) + " K'" + std::to_string(sh.kd);
        const double tol = dt == DType::f32 ? 1e-5 : 2e-2;
        EXPECT_LE(rel_err(gdx, dx), tol) << "dx " << what;
        EXPECT_LE(rel_err(gdw, dw), tol) << "dw " << what;
        EXPECT_LE(rel_err(gact, act), dt == DType::f32 ? 1e-6 : 1e-2) << "out " << what;
        Tensor want_act = Tensor::empty({sh.m, sh.n}, dt, gpu);
        glu_activate({cg, want_act}, opt);
        const bool fused = test::on_sm90() && dt != DType::f32 && ((sh.m + 127) / 128) * ((sh.n + 127) / 128) >= 128;
        if (fused) EXPECT_LE(rel_err(gact, want_act), 1e-2) << "out " << what;
        else EXPECT_EQ(test::to_doubles(gact), test::to_doubles(want_act)) << "out " << what;
        EXPECT_EQ(test::to_doubles(cg), test::to_doubles(c)) << "preact changed " << what;
        // Without out (the fused kernel's D), the unfused path: dh rounded, then the pass over C.
        Tensor ndx = Tensor::empty({sh.m, sh.k}, dt, gpu), ndw = Tensor::empty({2 * sh.n, sh.k}, dt, gpu);
        glu_backward_from_preact({dyg, xg, wg, cg, ndx.view(), ndw.view(), std::nullopt, false, std::nullopt, dg.view()},
                                 opt);
        EXPECT_LE(rel_err(ndx, dx), tol) << "dx without out " << what;
        EXPECT_LE(rel_err(ndw, dw), tol) << "dw without out " << what;
      }
}

#if FUSEKIT_WITH_CUDA
// The fused down-projection GEMM itself (cuda::glu_dgrad_fused, which the op calls from 128
// tiles up), on Hopper with 16-bit operands: row and column tails, N a multiple of 8 from 8 to
// past two 128-column tiles, one to many tiles, every kind. dC against the pass over C from dh
// rounded to the operand dtype (one rounding of dh apart), out within the fast activations' error
// of glu_activate's (docs/glu.md).
TEST(GluGpu, FusedDownProjectionGemmMatchesThePassOverC) {
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  if (!test::on_sm90()) GTEST_SKIP() << "the fused down-projection GEMM runs on sm_90 (H100/H200) only";
  struct Shape { std::int64_t m, n, kd; };
  const Shape shapes[] = {{1, 8, 8}, {7, 24, 64}, {130, 136, 72}, {300, 256, 128}, {1000, 264, 40}, {4099, 128, 768},
                          {2500, 1032, 16}};
  int seed = 9700;
  for (const Shape& sh : shapes)
    for (DType dt : {DType::bf16, DType::f16})
      for (GluKind kind : kKinds) {
        seed += 5;
        const Tensor c = test::random_tensor({sh.m, 2 * sh.n}, dt, kCpu, seed, -3.f, 3.f).copy_to(gpu);
        const Tensor dy = test::random_tensor({sh.m, sh.kd}, dt, kCpu, seed + 1, -1.f, 1.f).copy_to(gpu);
        const Tensor down_w = test::random_tensor({sh.kd, sh.n}, dt, kCpu, seed + 2, -0.3f, 0.3f).copy_to(gpu);
        Tensor dc = Tensor::empty({sh.m, 2 * sh.n}, dt, gpu), act = Tensor::empty({sh.m, sh.n}, dt, gpu);
        test::poison(dc);
        test::poison(act);
        const TensorView act_view = act.view();
        ASSERT_TRUE(cuda::glu_dgrad_fused(dy, down_w, c, dc, &act_view, kind, nullptr));
        Tensor dh = Tensor::empty({sh.m, sh.n}, dt, gpu), want_dc = Tensor::empty({sh.m, 2 * sh.n}, dt, gpu),
               want_act = Tensor::empty({sh.m, sh.n}, dt, gpu);
        matmul(dy, down_w, dh.view(), Trans::n, Trans::n);
        const TensorView dh_view = dh.view(), want_act_view = want_act.view();
        cuda::glu_pairs(c, nullptr, &dh_view, want_dc, kind, nullptr, &want_act_view);
        const std::string what = std::string(glu_kind_name(kind)) + " " + std::string(dtype_name(dt)) + " M" +
                                 std::to_string(sh.m) + " N" + std::to_string(sh.n) + " K'" + std::to_string(sh.kd);
        EXPECT_LE(rel_err(dc, want_dc), 2e-2) << "dC " << what;
        EXPECT_LE(rel_err(act, want_act), 1e-2) << "out " << what;
      }
  // Without out, or with f32 or N % 8 != 0 operands, it declines and writes nothing.
  const Tensor c = test::random_tensor({16, 32}, DType::bf16, kCpu, 9990).copy_to(gpu);
  const Tensor dy = test::random_tensor({16, 8}, DType::bf16, kCpu, 9991).copy_to(gpu);
  const Tensor down_w = test::random_tensor({8, 16}, DType::bf16, kCpu, 9992).copy_to(gpu);
  Tensor dc = Tensor::empty({16, 32}, DType::bf16, gpu);
  EXPECT_FALSE(cuda::glu_dgrad_fused(dy, down_w, c, dc, nullptr, GluKind::swiglu, nullptr));
}
#endif

// The op at a size where it takes the fused GEMM (M 16384, N 2048: 2048 tiles), against the op
// given dh = dy down_w rounded (the unfused path): dx, dw one rounding of dh apart, out within the
// fast activations' error.
TEST(GluGpu, BackwardThroughTheDownProjectionTakesTheFusedGemmWhereItPays) {
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  const std::int64_t m = 16384, n = 2048, k = 16, kd = 64;
  const DType dt = DType::bf16;
  const GluOptions opt{.kind = GluKind::swiglu};
  const Tensor x = test::random_tensor({m, k}, dt, kCpu, 9801, -1.f, 1.f).copy_to(gpu);
  const Tensor wp = test::random_tensor({2 * n, k}, dt, kCpu, 9802, -0.5f, 0.5f).copy_to(gpu);
  const Tensor c = test::random_tensor({m, 2 * n}, dt, kCpu, 9803, -3.f, 3.f).copy_to(gpu);
  const Tensor dy = test::random_tensor({m, kd}, dt, kCpu, 9804, -1.f, 1.f).copy_to(gpu);
  const Tensor down_w = test::random_tensor({kd, n}, dt, kCpu, 9805, -0.3f, 0.3f).copy_to(gpu);
  Tensor dx = Tensor::empty({m, k}, dt, gpu), dw = Tensor::empty({2 * n, k}, dt, gpu), act = Tensor::empty({m, n}, dt, gpu);
  glu_backward_from_preact({dy, x, wp, c, dx.view(), dw.view(), std::nullopt, false, act.view(), down_w.view()}, opt);
  Tensor dh = Tensor::empty({m, n}, dt, gpu);
  matmul(dy, down_w, dh.view(), Trans::n, Trans::n);
  Tensor rdx = Tensor::empty({m, k}, dt, gpu), rdw = Tensor::empty({2 * n, k}, dt, gpu),
         ract = Tensor::empty({m, n}, dt, gpu);
  glu_backward_from_preact({dh, x, wp, c, rdx.view(), rdw.view(), std::nullopt, false, ract.view()}, opt);
  EXPECT_LE(rel_err(dx, rdx), 2e-2);
  EXPECT_LE(rel_err(dw, rdw), 2e-2);
  EXPECT_LE(rel_err(act, ract), 1e-2);
}

// Shapes of many tiles (H100: 132 SMs). 16-bit, more than two waves of 128 x 256 tiles (> 264):
// the fused GEMM's ping-pong configuration, whose backward epilogue also writes db's slab sums;
// M and 2N with tails; 2N % 8 != 0 takes the scalar epilogue stores, 2N % 8 == 0 the vector ones.
// Up to two waves, and TF32 at any size: the cooperative configuration with several tiles a CTA,
// each of whose accumulators start at the bias of the tile its mainloop works out from the tile
// scheduler (GluBiasMainloop).
TEST(GluGpu, ManyTilesMatchSpec) {
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  struct Case {
    std::int64_t m, n, k;
    GluKind kind;
    DType t = DType::bf16;
  };
  int seed = 9000;
  for (const Case& c : {Case{2176, 2048, 64, GluKind::swiglu}, Case{2100, 2101, 72, GluKind::sigmoid_tanh},
                        Case{2048, 2048, 64, GluKind::geglu_tanh},
                        Case{1000, 2060, 40, GluKind::sigmoid_tanh, DType::f32},
                        Case{2176, 2052, 40, GluKind::swiglu, DType::f32}}) {
    ++seed;
    const GluOptions opt{.kind = c.kind, .allow_tf32 = true};
    const DType t = c.t;
    const double tol = t == DType::f32 ? 2e-3 : 1e-2;
    const Tensor x = test::random_tensor({c.m, c.k}, t, kCpu, seed, -1.f, 1.f);
    const Tensor w = test::random_tensor({2 * c.n, c.k}, t, kCpu, seed + 1000, -0.5f, 0.5f);
    const Tensor b = test::random_tensor({2 * c.n}, t, kCpu, seed + 2000, -0.5f, 0.5f);
    const Tensor dy = test::random_tensor({c.m, c.n}, t, kCpu, seed + 3000, -1.f, 1.f);
    Tensor out = Tensor::empty({c.m, c.n}, t, kCpu), dx = Tensor::empty({c.m, c.k}, t, kCpu),
           dw = Tensor::empty({2 * c.n, c.k}, t, kCpu), db = Tensor::empty({2 * c.n}, t, kCpu);
    reference::glu_forward({x, w, b.view(), out}, opt);
    reference::glu_backward({dy, x, w, b.view(), dx.view(), dw.view(), db.view()}, opt);
    const Tensor xg = x.copy_to(gpu), wg = glu_prepare_weight(w.copy_to(gpu)), bg = glu_prepare_weight(b.copy_to(gpu));
    const Tensor dyg = dy.copy_to(gpu);
    Tensor gout = Tensor::empty({c.m, c.n}, t, gpu), gdx = Tensor::empty({c.m, c.k}, t, gpu),
           gdw = Tensor::empty({2 * c.n, c.k}, t, gpu), gdb = Tensor::empty({2 * c.n}, t, gpu);
    for (const Tensor* p : {&gout, &gdx, &gdw, &gdb}) test::poison(*p);
    glu_forward({xg, wg, bg.view(), gout}, opt);
    glu_backward({dyg, xg, wg, bg.view(), gdx.view(), gdw.view(), gdb.view()}, opt);
    const std::string what = std::string(glu_kind_name(c.kind)) + " " + std::string(dtype_name(t)) + " M" +
                             std::to_string(c.m) + " N" + std::to_string(c.n) + " K" + std::to_string(c.k);
    EXPECT_LE(rel_err(gout, out), tol) << "out " << what;
    EXPECT_LE(rel_err(gdx, dx), 2 * tol) << "dx " << what;
    EXPECT_LE(rel_err(glu_unprepare_weight(gdw), dw), 2 * tol) << "dw " << what;
    EXPECT_LE(rel_err(glu_unprepare_weight(gdb), db), 2 * tol) << "db " << what;
    // The forward keeping C (the ping-pong and the multi-tile cooperative epilogues' stores of
    // it), and the backward from C.
    Tensor kout = Tensor::empty({c.m, c.n}, t, gpu), cg = Tensor::empty({c.m, 2 * c.n}, t, gpu);
    for (const Tensor* p : {&kout, &cg, &gdx, &gdw, &gdb}) test::poison(*p);
    glu_forward({xg, wg, bg.view(), kout, cg.view()}, opt);
    EXPECT_LE(rel_err(kout, out), tol) << "out keeping C " << what;
    EXPECT_LE(rel_err(cg, spec_preact(x, w, b, true, c.kind)), tol) << "preact " << what;
    glu_backward_from_preact({dyg, xg, wg, cg.view(), gdx.view(), gdw.view(), gdb.view(), true}, opt);
    EXPECT_LE(rel_err(gdx, dx), 2 * tol) << "dx from preact " << what;
    EXPECT_LE(rel_err(glu_unprepare_weight(gdw), dw), 2 * tol) << "dw from preact " << what;
    EXPECT_LE(rel_err(glu_unprepare_weight(gdb), db), 2 * tol) << "db from preact " << what;
  }
}

TEST(GluGpu, FusedForwardAllocatesNoPreactivations) {
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  const std::int64_t m = 4096, n = 4096, k = 64;  // C would be 64 MiB of bf16
  const Tensor x = test::random_tensor({m, k}, DType::bf16, gpu, 1);
  const Tensor w = test::random_tensor({2 * n, k}, DType::bf16, gpu, 2, -0.1f, 0.1f);
  Tensor out = Tensor::empty({m, n}, DType::bf16, gpu);
  Stream::default_stream().synchronize();
  allocator::reset_peak(gpu);  // a peak left by an earlier test would hide this call's
  const AllocatorStats before = allocator::stats(gpu);
  glu_forward({x, w, std::nullopt, out}, {.kind = GluKind::swiglu});
  Stream::default_stream().synchronize();
  const AllocatorStats after = allocator::stats(gpu);
  const std::size_t c_bytes = static_cast<std::size_t>(m * 2 * n * 2);
  EXPECT_LT(after.peak_allocated_bytes, before.allocated_bytes + c_bytes / 2)
      << "the forward allocated a buffer the size of C [M, 2N] (an unfused path ran?)";
  // Keeping C: the caller's buffer, nothing more; and the backward from it in place allocates no
  // dC either.
  Tensor c = Tensor::empty({m, 2 * n}, DType::bf16, gpu);
  const Tensor dy = test::random_tensor({m, n}, DType::bf16, gpu, 3);
  Tensor dx = Tensor::empty({m, k}, DType::bf16, gpu), dw = Tensor::empty({2 * n, k}, DType::bf16, gpu);
  Stream::default_stream().synchronize();
  allocator::reset_peak(gpu);
  const AllocatorStats before_keep = allocator::stats(gpu);
  glu_forward({x, w, std::nullopt, out, c.view()}, {.kind = GluKind::swiglu});
  glu_backward_from_preact({dy, x, w, c.view(), dx.view(), dw.view(), std::nullopt, true}, {.kind = GluKind::swiglu});
  Stream::default_stream().synchronize();
  EXPECT_LT(allocator::stats(gpu).peak_allocated_bytes, before_keep.allocated_bytes + c_bytes / 2)
      << "the forward keeping C, or the backward over it, allocated a buffer the size of C";
}

TEST(GluGpu, ZeroSizedProblems) {
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  const Tensor x = Tensor::empty({0, 16}, DType::bf16, gpu);
  const Tensor w = test::random_tensor({8, 16}, DType::bf16, gpu, 3);
  Tensor out = Tensor::empty({0, 4}, DType::bf16, gpu);
  glu_forward({x, w, std::nullopt, out}, {});
  Tensor dw = Tensor::empty({8, 16}, DType::bf16, gpu), db = Tensor::empty({8}, DType::bf16, gpu);
  glu_backward({out, x, w, std::nullopt, std::nullopt, dw.view(), db.view()}, {});
  for (double v : test::to_doubles(dw)) EXPECT_EQ(v, 0.0);
  for (double v : test::to_doubles(db)) EXPECT_EQ(v, 0.0);
  Tensor c = Tensor::empty({0, 8}, DType::bf16, gpu);
  glu_forward({x, w, std::nullopt, out, c.view()}, {});
  test::poison(dw);
  test::poison(db);
  glu_backward_from_preact({out, x, w, c.view(), std::nullopt, dw.view(), db.view()}, {});
  for (double v : test::to_doubles(dw)) EXPECT_EQ(v, 0.0);
  for (double v : test::to_doubles(db)) EXPECT_EQ(v, 0.0);
}

// ---------------------------------------------------------------------------------------------
// nn::GLUFeedForward
// ---------------------------------------------------------------------------------------------

TEST(GluFeedForward, GradientsMatchFiniteDifferencesOnCpu) {
  const std::int64_t t = 3, d_in = 4, hidden = 3, d_out = 2;
  nn::GLUFeedForward ff(d_in, hidden, d_out, {.kind = GluKind::geglu_tanh}, DType::f32, kCpu, 7);
  Tensor x = test::random_tensor({t, d_in}, DType::f32, kCpu, 8);
  const Tensor g = test::random_tensor({t, d_out}, DType::f32, kCpu, 9);
  Tensor y = Tensor::empty({t, d_out}, DType::f32, kCpu), dx = Tensor::empty({t, d_in}, DType::f32, kCpu);
  ff.forward(x, y);
  ff.backward(g, dx.view());
  auto loss = [&] {
    Tensor yy = Tensor::empty({t, d_out}, DType::f32, kCpu);
    ff.forward(x, yy);
    double s = 0;
    for (std::int64_t i = 0; i < t * d_out; ++i) s += double(yy.data_as<float>()[i]) * g.data_as<float>()[i];
    return s;
  };
  auto check = [&](const Tensor& param, const Tensor& grad, const char* name) {
    for (std::int64_t i = 0; i < param.numel(); ++i) {
      float* p = param.data_as<float>() + i;
      const float keep = *p, h = 1e-2f;
      *p = keep + h;
      const double up = loss();
      *p = keep - h;
      const double down = loss();
      *p = keep;
      EXPECT_NEAR(grad.data_as<float>()[i], (up - down) / (2.0 * h), 2e-3) << name << "[" << i << "]";
    }
  };
  // The gradients were taken before any probe; the probes leave every parameter as it was.
  const Tensor dw1 = ff.weight1_grad.clone(), db1 = ff.bias1_grad.clone(), dw2 = ff.weight2_grad.clone(),
               db2 = ff.bias2_grad.clone();
  check(x, dx, "x");
  check(ff.weight1, dw1, "w1 (prepared)");
  check(ff.bias1, db1, "b1 (prepared)");
  check(ff.weight2, dw2, "w2");
  check(ff.bias2, db2, "b2");
}

TEST(GluFeedForward, GpuMatchesCpu) {
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  const std::int64_t t = 70, d_in = 64, hidden = 96, d_out = 40;
  for (DType dt : {DType::bf16, DType::f32}) {
    const GluOptions opt{.kind = GluKind::swiglu, .allow_tf32 = dt == DType::f32};
    nn::GLUFeedForward cpu(d_in, hidden, d_out, opt, DType::f32, kCpu, 21);
    nn::GLUFeedForward dev(d_in, hidden, d_out, opt, dt, gpu, 21);
    // Same seed: the GPU layer's parameters are the CPU layer's rounded to dt; use exactly those.
    for (auto [c, d] : {std::pair{&cpu.weight1, &dev.weight1}, {&cpu.bias1, &dev.bias1}, {&cpu.weight2, &dev.weight2},
                        {&cpu.bias2, &dev.bias2}}) {
      const std::vector<double> v = test::to_doubles(*d);
      for (std::int64_t i = 0; i < c->numel(); ++i) c->data_as<float>()[i] = static_cast<float>(v[i]);
    }
    const Tensor x = test::random_tensor({t, d_in}, dt, kCpu, 22);
    const Tensor dy = test::random_tensor({t, d_out}, dt, kCpu, 23);
    Tensor xf = Tensor::empty({t, d_in}, DType::f32, kCpu), dyf = Tensor::empty({t, d_out}, DType::f32, kCpu);
    const std::vector<double> xv = test::to_doubles(x), dyv = test::to_doubles(dy);
    for (std::int64_t i = 0; i < xf.numel(); ++i) xf.data_as<float>()[i] = static_cast<float>(xv[i]);
    for (std::int64_t i = 0; i < dyf.numel(); ++i) dyf.data_as<float>()[i] = static_cast<float>(dyv[i]);
    Tensor y = Tensor::empty({t, d_out}, DType::f32, kCpu), dx = Tensor::empty({t, d_in}, DType::f32, kCpu);
    cpu.forward(xf, y);
    cpu.backward(dyf, dx.view());
    Tensor yg = Tensor::empty({t, d_out}, dt, gpu), dxg = Tensor::empty({t, d_in}, dt, gpu);
    dev.forward(x.copy_to(gpu), yg);
    dev.backward(dy.copy_to(gpu), dxg.view());
    const double tol = dt == DType::f32 ? 4e-3 : 3e-2;  // bf16: h and dh rounded between the GEMMs
    EXPECT_LE(rel_err(yg, y), tol) << dtype_name(dt);
    EXPECT_LE(rel_err(dxg, dx), tol) << dtype_name(dt);
    EXPECT_LE(rel_err(dev.weight1_grad, cpu.weight1_grad), tol) << dtype_name(dt);
    EXPECT_LE(rel_err(dev.bias1_grad, cpu.bias1_grad), tol) << dtype_name(dt);
    EXPECT_LE(rel_err(dev.weight2_grad, cpu.weight2_grad), tol) << dtype_name(dt);
    EXPECT_LE(rel_err(dev.bias2_grad, cpu.bias2_grad), tol) << dtype_name(dt);
  }
}

// ---------------------------------------------------------------------------------------------
// Bad input
// ---------------------------------------------------------------------------------------------

TEST(GluErrors, BadArgumentsNameTheArgument) {
  const Tensor x = Tensor::empty({4, 8}, DType::f32, kCpu);
  const Tensor w = Tensor::empty({6, 8}, DType::f32, kCpu);
  Tensor out = Tensor::empty({4, 3}, DType::f32, kCpu);
  const Tensor w_odd = Tensor::empty({5, 8}, DType::f32, kCpu);
  const Tensor w_k = Tensor::empty({6, 9}, DType::f32, kCpu);
  const Tensor w_bf16 = Tensor::empty({6, 8}, DType::bf16, kCpu);
  const Tensor x_int = Tensor::empty({4, 8}, DType::i32, kCpu);
  const Tensor bias_bad = Tensor::empty({5}, DType::f32, kCpu);
  Tensor out_bad = Tensor::empty({4, 4}, DType::f32, kCpu);
  test::expect_arg_error([&] { glu_forward({x, w_odd, std::nullopt, out}, {}); }, "glu_forward", "w");
  test::expect_arg_error([&] { glu_forward({x, w_k, std::nullopt, out}, {}); }, "glu_forward", "w");
  test::expect_arg_error([&] { glu_forward({x, w_bf16, std::nullopt, out}, {}); }, "glu_forward", "w");
  test::expect_arg_error([&] { glu_forward({x_int, w, std::nullopt, out}, {}); }, "glu_forward", "x");
  test::expect_arg_error([&] { glu_forward({x, w, bias_bad.view(), out}, {}); }, "glu_forward", "bias");
  test::expect_arg_error([&] { glu_forward({x, w, std::nullopt, out_bad}, {}); }, "glu_forward", "out");
  Tensor dx_bad = Tensor::empty({4, 9}, DType::f32, kCpu);
  test::expect_arg_error([&] { glu_backward({out, x, w, std::nullopt, dx_bad.view(), std::nullopt, std::nullopt}, {}); },
                         "glu_backward", "dx");
  test::expect_arg_error([&] { glu_backward({out_bad, x, w, std::nullopt, std::nullopt, std::nullopt, std::nullopt}, {}); },
                         "glu_backward", "dy");
  Tensor c = Tensor::empty({4, 6}, DType::f32, kCpu), c_bad = Tensor::empty({4, 3}, DType::f32, kCpu);
  const Tensor c_bf16 = Tensor::empty({4, 6}, DType::bf16, kCpu);
  Tensor wide = Tensor::empty({4, 6}, DType::f32, kCpu);
  test::expect_arg_error([&] { glu_forward({x, w, std::nullopt, out, c_bad.view()}, {}); }, "glu_forward", "preact");
  test::expect_arg_error([&] { glu_forward({x, w, std::nullopt, out, c_bf16.view()}, {}); }, "glu_forward", "preact");
  // preact and out in one buffer.
  const TensorView out_in_wide(wide.data(), DType::f32, Dims{4, 3}, kCpu);
  test::expect_arg_error([&] { glu_forward({x, w, std::nullopt, out_in_wide, wide.view()}, {}); }, "glu_forward",
                         "preact");
  using FromPreact = GluBackwardFromPreactArgs;
  test::expect_arg_error([&] { glu_backward_from_preact(FromPreact{out_bad, x, w, c.view()}, {}); },
                         "glu_backward_from_preact", "dy");
  test::expect_arg_error([&] { glu_backward_from_preact(FromPreact{out, x, w, c_bad.view()}, {}); },
                         "glu_backward_from_preact", "preact");
  test::expect_arg_error([&] { glu_backward_from_preact(FromPreact{out, x, w_odd, c.view()}, {}); },
                         "glu_backward_from_preact", "w");
  test::expect_arg_error([&] { glu_backward_from_preact(FromPreact{out, x, w, c.view(), dx_bad.view()}, {}); },
                         "glu_backward_from_preact", "dx");
  Tensor dx_over_c = Tensor::empty({4, 8}, DType::f32, kCpu);
  const TensorView c_in_dx(dx_over_c.data(), DType::f32, Dims{4, 6}, kCpu);
  test::expect_arg_error([&] { glu_backward_from_preact(FromPreact{out, x, w, c_in_dx, dx_over_c.view()}, {}); },
                         "glu_backward_from_preact", "dx");
  test::expect_arg_error([&] { (void)glu_prepare_weight(w_odd); }, "glu_prepare_weight", "w");
  test::expect_arg_error([&] { (void)parse_glu_kind("swish"); }, "parse_glu_kind", "name");
  EXPECT_EQ(parse_glu_kind("geglu_tanh"), GluKind::geglu_tanh);
}

}  // namespace
}  // namespace fk
