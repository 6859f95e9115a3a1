// Tests of DCNv2's low-rank cross layer (cross_layer_forward / backward): the spec on cases worked
// by hand, its gradients against central finite differences, strided views, every bad input; the
// GPU path (cuBLAS GEMMs + the fused elementwise passes) against the spec on random inputs of odd
// sizes, both with and without the first-layer aliasing.
#include <gtest/gtest.h>

#include <cmath>
#include <tuple>
#include <vector>

#include "fusekit/fusekit.hpp"
#include "fusekit/ops/recsys.hpp"
#include "recsys_test_util.hpp"
#include "test_util.hpp"

namespace fk {
namespace {

using namespace recsys_test;

// One layer's tensors on `dev`, random in [-1, 1) (x0, xl, u, v, bias, dy, dx0), from `seed`.
struct CrossCase {
  std::int64_t batch, n, rank;
  bool first;
  Device dev;
  Tensor x0, xl, u, v, bias, h, out, dy, dx0, du, dv, dbias, ws;
  CrossCase(std::int64_t b, std::int64_t n_, std::int64_t r, bool first_layer, Device d, std::uint64_t seed)
      : batch(b), n(n_), rank(r), first(first_layer), dev(d) {
    x0 = test::random_tensor({b, n}, DType::f32, d, seed);
    xl = first ? Tensor() : test::random_tensor({b, n}, DType::f32, d, seed + 1);
    u = test::random_tensor({n, r}, DType::f32, d, seed + 2);
    v = test::random_tensor({r, n}, DType::f32, d, seed + 3);
    bias = test::random_tensor({n}, DType::f32, d, seed + 4);
    dy = test::random_tensor({b, n}, DType::f32, d, seed + 5);
    dx0 = test::random_tensor({b, n}, DType::f32, d, seed + 6);
    h = Tensor::empty({b, r}, DType::f32, d);
    out = Tensor::empty({b, n}, DType::f32, d);
    du = Tensor::empty({n, r}, DType::f32, d);
    dv = Tensor::empty({r, n}, DType::f32, d);
    dbias = Tensor::empty({n}, DType::f32, d);
    ws = Tensor::empty({cross_layer_workspace_floats(b, n, r)}, DType::f32, d);  // [0] for an empty batch
    for (const Tensor* t : {&h, &out, &du, &dv, &dbias}) test::poison(*t);
  }
  TensorView x_l() const { return first ? x0.view() : xl.view(); }
  CrossLayerForwardArgs fwd() const { return {x0, x_l(), u, v, bias, h, out}; }
  CrossLayerBackwardArgs bwd() const { return {x0, x_l(), u, v, bias, h, dy, dx0, du, dv, dbias, first, ws.view()}; }
};

// ---- hand-worked -------------------------------------------------------------------------------
// B = 1, N = 2, r = 1: x0 = [1, 2], x_l = [1, -1], V = [1, 2], U = [2, -1]ᵀ, b = [0.5, 1].
//   h = V x_l = -1;  p = U h = [-2, 1];  p + b = [-1.5, 2];  out = x0 ⊙ (p + b) + x_l = [-0.5, 3]
// dy = [1, 0], dx0 = [10, 10]:
//   dp = dy ⊙ x0 = [1, 0];  db = [1, 0];  dU = dp hᵀ = [-1, 0]ᵀ;  dh = dp U = 2;  dV = dh x_lᵀ = [2, -2]
//   dL/dx_l = dy + dh V = [3, 4];  dx0 = [10, 10] + dy ⊙ (p + b) = [8.5, 10]
TEST(CrossLayerSpec, LayerByHand) {
  Tensor x0 = f32({1, 2}, {1, 2}), xl = f32({1, 2}, {1, -1}), v = f32({1, 2}, {1, 2}), u = f32({2, 1}, {2, -1});
  Tensor b = f32({2}, {0.5f, 1}), h = f32({1, 1}, {0}), out = f32({1, 2}, {0, 0});
  cross_layer_forward({x0, xl, u, v, b, h, out});
  EXPECT_EQ(floats(h), (std::vector<float>{-1}));
  EXPECT_EQ(floats(out), (std::vector<float>{-0.5f, 3}));
  Tensor dy = f32({1, 2}, {1, 0}), dx0 = f32({1, 2}, {10, 10});
  Tensor du = f32({2, 1}, {9, 9}), dv = f32({1, 2}, {9, 9}), db = f32({2}, {9, 9});
  cross_layer_backward({x0, xl, u, v, b, h, dy, dx0, du, dv, db, false});
  EXPECT_EQ(floats(db), (std::vector<float>{1, 0}));
  EXPECT_EQ(floats(du), (std::vector<float>{-1, 0}));
  EXPECT_EQ(floats(dv), (std::vector<float>{2, -2}));
  EXPECT_EQ(floats(dy), (std::vector<float>{3, 4}));
  EXPECT_EQ(floats(dx0), (std::vector<float>{8.5f, 10}));
}

// The first layer (x_l is x0 = [1, 2], V = [1, 1], U = [2, -1]ᵀ, b = [0.5, 1]):
//   h = 3;  p + b = [6.5, -2];  out = [1 * 6.5 + 1, 2 * -2 + 2] = [7.5, -2]
// dy = [1, 0], dx0 = [0, 0]: dp = [1, 0]; dh = 2; dV = 2 x0ᵀ = [2, 4]; dL/dx_l = [1, 0] + 2 [1, 1];
//   dx0 = dy ⊙ (p + b) + dL/dx_l = [6.5, 0] + [3, 2] = [9.5, 2]; dy is left as it was.
TEST(CrossLayerSpec, FirstLayerByHand) {
  Tensor x0 = f32({1, 2}, {1, 2}), v = f32({1, 2}, {1, 1}), u = f32({2, 1}, {2, -1});
  Tensor b = f32({2}, {0.5f, 1}), h = f32({1, 1}, {0}), out = f32({1, 2}, {0, 0});
  cross_layer_forward({x0, x0, u, v, b, h, out});
  EXPECT_EQ(floats(out), (std::vector<float>{7.5f, -2}));
  Tensor dy = f32({1, 2}, {1, 0}), dx0 = f32({1, 2}, {0, 0});
  Tensor du = f32({2, 1}, {9, 9}), dv = f32({1, 2}, {9, 9}), db = f32({2}, {9, 9});
  cross_layer_backward({x0, x0, u, v, b, h, dy, dx0, du, dv, db, true});
  EXPECT_EQ(floats(dv), (std::vector<float>{2, 4}));
  EXPECT_EQ(floats(du), (std::vector<float>{3, 0}));
  EXPECT_EQ(floats(dx0), (std::vector<float>{9.5f, 2}));
  EXPECT_EQ(floats(dy), (std::vector<float>{1, 0}));
}

// ---- finite differences -----------------------------------------------------------------------
// L = Σ w ⊙ x_{l+1} with w the case's dy. Each parameter and input enters x_{l+1} at most
// quadratically (x0 twice in the first layer), so a central difference is exact but for the f32
// rounding of the outputs: about 1e-7 * |L| / step, far inside the 2e-3 allowed.
class CrossLayerGradcheck : public ::testing::TestWithParam<bool> {};

TEST_P(CrossLayerGradcheck, MatchesFiniteDifferences) {
  const bool first = GetParam();
  CrossCase c(3, 5, 2, first, kCpu, 11);
  const std::vector<float> w = floats(c.dy);
  auto loss = [&] {
    cross_layer_forward(c.fwd());
    const std::vector<float> o = floats(c.out);
    double l = 0;
    for (std::size_t i = 0; i < o.size(); ++i) l += double{w[i]} * o[i];
    return l;
  };
  // Analytic gradients (dx0 from zero, so that it holds dL/dx0 alone; with first_layer it is the
  // whole gradient of x0, otherwise its x0 term and dy becomes dL/dx_l).
  cross_layer_forward(c.fwd());
  fill(c.dx0, 0.0);
  cross_layer_backward(c.bwd());
  const double step = 1e-2;
  auto check = [&](const Tensor& param, const std::vector<float>& grad, const char* name) {
    float* p = param.data_as<float>();
    for (std::int64_t i = 0; i < param.numel(); ++i) {
      const float keep = p[i];
      p[i] = static_cast<float>(keep + step);
      const double up = loss();
      p[i] = static_cast<float>(keep - step);
      const double down = loss();
      p[i] = keep;
      EXPECT_NEAR(grad[static_cast<std::size_t>(i)], (up - down) / (2 * step), 2e-3) << name << "[" << i << "]";
    }
  };
  check(c.u, floats(c.du), "u");
  check(c.v, floats(c.dv), "v");
  check(c.bias, floats(c.dbias), "bias");
  check(c.x0, floats(c.dx0), "x0");
  if (!first) check(c.xl, floats(c.dy), "xl");
}

INSTANTIATE_TEST_SUITE_P(Layers, CrossLayerGradcheck, ::testing::Values(false, true),
                         [](const auto& i) { return i.param ? "first_layer" : "later_layer"; });

// Padded rows (row strides above the row length) give the same numbers as contiguous tensors.
TEST(CrossLayerSpec, StridedViewsMatchContiguous) {
  CrossCase c(4, 7, 3, false, kCpu, 5);
  const Tensor dy0 = test::to_host(c.dy), dx00 = test::to_host(c.dx0);
  cross_layer_forward(c.fwd());
  cross_layer_backward(c.bwd());
  // The same, each [R, C] operand a view of a [R, C + 3] buffer.
  auto padded = [](const Tensor& t) {
    const std::int64_t r = t.size(0), cols = t.size(1);
    Tensor buf = Tensor::empty({r, cols + 3}, DType::f32, kCpu);
    test::poison(buf);
    TensorView v(buf.data(), DType::f32, {r, cols}, {cols + 3, 1}, kCpu);
    copy(v, t);
    return std::make_pair(std::move(buf), v);
  };
  auto [x0b, x0] = padded(c.x0);
  auto [xlb, xl] = padded(c.xl);
  auto [ub, u] = padded(c.u);
  auto [vb, v] = padded(c.v);
  auto [hb, h] = padded(c.h);
  auto [ob, out] = padded(c.out);
  auto [dyb, dy] = padded(dy0);
  auto [dxb, dx0] = padded(dx00);
  auto [dub, du] = padded(c.du);
  auto [dvb, dv] = padded(c.dv);
  Tensor db = Tensor::empty({c.n}, DType::f32, kCpu);
  cross_layer_forward({x0, xl, u, v, c.bias, h, out});
  cross_layer_backward({x0, xl, u, v, c.bias, h, dy, dx0, du, dv, db, false});
  auto same = [](const TensorView& got, const Tensor& want) {
    Tensor g = Tensor::empty(got.shape(), DType::f32, kCpu);
    copy(g, got);
    EXPECT_EQ(floats(g), floats(want));
  };
  same(out, c.out);
  same(h, c.h);
  same(dy, c.dy);
  same(dx0, c.dx0);
  same(du, c.du);
  same(dv, c.dv);
  EXPECT_EQ(floats(db), floats(c.dbias));
}

TEST(CrossLayerSpec, EmptyBatchGivesZeroGradients) {
  CrossCase c(0, 4, 2, false, kCpu, 1);
  cross_layer_forward(c.fwd());
  cross_layer_backward(c.bwd());
  for (const Tensor* g : {&c.du, &c.dv, &c.dbias})
    for (float x : floats(*g)) EXPECT_EQ(x, 0.0f);
}

TEST(CrossLayerSpec, BadInputsNameTheArgument) {
  CrossCase c(2, 6, 3, false, kCpu, 2);
  const char* f = "cross_layer_forward";
  const char* b = "cross_layer_backward";
  auto fwd_with = [&](auto edit) {
    CrossLayerForwardArgs a = c.fwd();
    edit(a);
    cross_layer_forward(a);
  };
  auto bwd_with = [&](auto edit) {
    CrossLayerBackwardArgs a = c.bwd();
    edit(a);
    cross_layer_backward(a);
  };
  Tensor wrong = Tensor::empty({3, 5}, DType::f32, kCpu), half = Tensor::empty({2, 6}, DType::f16, kCpu);
  Tensor col_major = Tensor::empty({6, 2}, DType::f32, kCpu);
  test::expect_arg_error([&] { fwd_with([&](auto& a) { a.v = wrong; }); }, f, "v");
  test::expect_arg_error([&] { fwd_with([&](auto& a) { a.u = Tensor::empty({6, 4}, DType::f32, kCpu); }); }, f, "v");
  test::expect_arg_error([&] { fwd_with([&](auto& a) { a.xl = half; }); }, f, "xl");
  test::expect_arg_error([&] { fwd_with([&](auto& a) { a.bias = Tensor::empty({5}, DType::f32, kCpu); }); }, f, "bias");
  test::expect_arg_error([&] { fwd_with([&](auto& a) { a.h = Tensor::empty({2, 2}, DType::f32, kCpu); }); }, f, "h");
  test::expect_arg_error([&] { fwd_with([&](auto& a) { a.out = c.xl; }); }, f, "out");
  test::expect_arg_error(
      [&] { fwd_with([&](auto& a) { a.out = TensorView(col_major.data(), DType::f32, {2, 6}, {1, 2}, kCpu); }); }, f,
      "out");
  test::expect_arg_error([&] { bwd_with([&](auto& a) { a.xl = c.x0; }); }, b, "xl");
  test::expect_arg_error([&] { bwd_with([&](auto& a) { a.dy = a.dx0; }); }, b, "dy");
  test::expect_arg_error([&] { bwd_with([&](auto& a) { a.dx0 = c.x0; }); }, b, "dx0");
  test::expect_arg_error([&] { bwd_with([&](auto& a) { a.du = Tensor::empty({3, 6}, DType::f32, kCpu); }); }, b, "du");
  test::expect_arg_error([&] { bwd_with([&](auto& a) { a.dbias = Tensor::empty({6, 1}, DType::f32, kCpu); }); }, b,
                         "dbias");
}

// ---- GPU against the spec -----------------------------------------------------------------------
// The GPU's GEMMs accumulate in fp32 (or TF32), the spec in double: held normwise to 1e-5 (fp32,
// a few roundings over sums of up to N terms: the gemm family's bound) and to 2e-3 with TF32
// (the gemm family's TF32 bound; the elementwise passes add one rounding).
using CrossShape = std::tuple<std::int64_t, std::int64_t, std::int64_t>;  // B, N, r
class CrossLayerGpu : public ::testing::TestWithParam<std::tuple<CrossShape, bool, bool>> {};

TEST_P(CrossLayerGpu, MatchesSpec) {
  FK_SKIP_WITHOUT_GPU();
  const auto [shape, first, tf32] = GetParam();
  const auto [batch, n, rank] = shape;
  const Device gpu = Device::cuda(0);
  CrossCase host(batch, n, rank, first, kCpu, 41), dev(batch, n, rank, first, gpu, 41);
  cross_layer_forward(host.fwd());
  cross_layer_backward(host.bwd());
  cross_layer_forward(dev.fwd(), {tf32});
  cross_layer_backward(dev.bwd(), {tf32});
  const double bound = tf32 ? 2e-3 : 1e-5;
  auto near = [&](const Tensor& got, const Tensor& want, const char* name) {
    EXPECT_LE(test::rel_err_normwise(got, want), bound) << name;
  };
  near(dev.h, host.h, "h");
  near(dev.out, host.out, "out");
  near(dev.dx0, host.dx0, "dx0");
  near(dev.dy, host.dy, "dy");
  near(dev.du, host.du, "du");
  near(dev.dv, host.dv, "dv");
  near(dev.dbias, host.dbias, "dbias");
}

INSTANTIATE_TEST_SUITE_P(Shapes, CrossLayerGpu,
                         ::testing::Combine(::testing::Values(CrossShape{1, 1, 1}, CrossShape{7, 33, 5},
                                                              CrossShape{130, 27, 16}, CrossShape{5, 3456, 512},
                                                              CrossShape{257, 416, 64}),
                                            ::testing::Bool(), ::testing::Bool()));

TEST(CrossLayerGpuArgs, BackwardNeedsItsWorkspace) {
  FK_SKIP_WITHOUT_GPU();
  CrossCase c(3, 8, 2, false, Device::cuda(0), 3);
  CrossLayerBackwardArgs a = c.bwd();
  a.workspace = std::nullopt;
  test::expect_arg_error([&] { cross_layer_backward(a); }, "cross_layer_backward", "workspace");
  a.workspace = Tensor::empty({5}, DType::f32, Device::cuda(0));
  test::expect_arg_error([&] { cross_layer_backward(a); }, "cross_layer_backward", "workspace");
}

TEST(CrossLayerGpuArgs, EmptyBatchGivesZeroGradients) {
  FK_SKIP_WITHOUT_GPU();
  CrossCase c(0, 8, 2, false, Device::cuda(0), 3);
  cross_layer_forward(c.fwd());
  cross_layer_backward(c.bwd());
  for (const Tensor* g : {&c.du, &c.dv, &c.dbias})
    for (float x : test::to_floats(*g)) EXPECT_EQ(x, 0.0f);
}

}  // namespace
}  // namespace fk
