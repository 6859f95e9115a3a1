// Tests of the mlp family: the spec against a hand-worked MLP, the fused CUDA kernel against the
// spec on random MLPs (every hidden width, input and output widths that are not multiples of 16,
// batches that are not multiples of the 16-row warp tile or the 128-row CTA), and every bad input.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "fusekit/fusekit.hpp"
#include "test_util.hpp"

namespace fk {
namespace {

const Device kCpu = Device::cpu();
const auto R = Activation::relu, S = Activation::sigmoid, I = Activation::identity;

// An MLP's tensors, owned, on one device.
struct Net {
  Tensor x, y;
  std::vector<Tensor> w, b;
  std::vector<Activation> act;
  FusedMlpForwardArgs args() const {
    FusedMlpForwardArgs a{x, {}, y};
    for (std::size_t l = 0; l < w.size(); ++l) a.layers.push_back({w[l], b[l], act[l]});
    return a;
  }
  Net to(Device d) const {
    Net n{x.copy_to(d), y.copy_to(d), {}, {}, act};
    for (std::size_t l = 0; l < w.size(); ++l) {
      n.w.push_back(w[l].copy_to(d));
      n.b.push_back(b[l].copy_to(d));
    }
    return n;
  }
};

// widths: in, hidden..., out (one entry per layer boundary). Weights ~ U(±1.7/sqrt(fan_in)) keep
// activations of order 1 through the layers.
Net random_net(DType dt, std::int64_t batch, const std::vector<std::int64_t>& widths, const std::vector<Activation>& act,
               std::uint64_t seed) {
  Net n;
  n.x = test::random_tensor({batch, widths.front()}, dt, kCpu, seed++, -2.f, 2.f);
  n.y = Tensor::empty({batch, widths.back()}, dt, kCpu);
  for (std::size_t l = 0; l + 1 < widths.size(); ++l) {
    const float s = 1.7f / std::sqrt(static_cast<float>(widths[l]));
    n.w.push_back(test::random_tensor({widths[l + 1], widths[l]}, dt, kCpu, seed++, -s, s));
    n.b.push_back(test::random_tensor({widths[l + 1]}, dt, kCpu, seed++, -0.5f, 0.5f));
  }
  n.act = act;
  return n;
}

// ---------------------------------------------------------------------------------------------
// The spec against a hand-worked MLP
// ---------------------------------------------------------------------------------------------

TEST(MlpSpec, HandWorkedTwoLayers) {
  // x = [1, 2]; W0 = [[1, 0], [-1, 1]], b0 = [0.5, -4], relu: z = [1.5, -3] -> h = [1.5, 0];
  // W1 = [[2, 3]], b1 = [1], identity: y = 4. Sigmoid at the output: sigmoid(4).
  const Tensor x = test::host_tensor({1, 2}, DType::bf16, {1, 2});
  const Tensor w0 = test::host_tensor({2, 2}, DType::bf16, {1, 0, -1, 1});
  const Tensor b0 = test::host_tensor({2}, DType::bf16, {0.5f, -4});
  const Tensor w1 = test::host_tensor({1, 2}, DType::bf16, {2, 3});
  const Tensor b1 = test::host_tensor({1}, DType::bf16, {1});
  Tensor y = Tensor::empty({1, 1}, DType::bf16, kCpu);
  reference::fused_mlp_forward({x, {{w0, b0, Activation::relu}, {w1, b1, Activation::identity}}, y});
  EXPECT_EQ(test::to_doubles(y)[0], 4.0);
  reference::fused_mlp_forward({x, {{w0, b0, Activation::relu}, {w1, b1, Activation::sigmoid}}, y});
  EXPECT_EQ(test::to_doubles(y)[0], static_cast<float>(bf16(static_cast<float>(1.0 / (1.0 + std::exp(-4.0))))));
}

TEST(MlpSpec, HiddenLayersAreRoundedToTheDtype) {
  // h = 1 + 2^-9 is not a bf16: it rounds to 1 before layer 1 doubles it, so y = 2, not 2 + 2^-8.
  const Tensor x = test::host_tensor({1, 1}, DType::bf16, {1});
  const Tensor w0 = test::host_tensor({1, 1}, DType::bf16, {1});
  const Tensor b0 = test::host_tensor({1}, DType::bf16, {1.0f / 512});
  const Tensor w1 = test::host_tensor({1, 1}, DType::bf16, {2});
  const Tensor b1 = test::host_tensor({1}, DType::bf16, {0});
  Tensor y = Tensor::empty({1, 1}, DType::f16, kCpu);  // f16 holds 2 + 2^-8 exactly
  reference::fused_mlp_forward({x, {{w0, b0, Activation::identity}, {w1, b1, Activation::identity}}, y});
  // y's dtype rounds the hidden layer here (f16: 1 + 2^-9 is exact), so the result shows the rule.
  EXPECT_EQ(test::to_doubles(y)[0], 2.0 + 2.0 / 512);
  Tensor yb = Tensor::empty({1, 1}, DType::bf16, kCpu);
  reference::fused_mlp_forward({x, {{w0, b0, Activation::identity}, {w1, b1, Activation::identity}}, yb});
  EXPECT_EQ(test::to_doubles(yb)[0], 2.0);
}

TEST(MlpSpec, DispatchOnCpuRunsTheSpec) {
  const Net n = random_net(DType::bf16, 5, {7, 16, 16, 3}, {Activation::relu, Activation::sigmoid, Activation::identity}, 1);
  Tensor want = Tensor::empty({5, 3}, DType::bf16, kCpu);
  FusedMlpForwardArgs a = n.args();
  fused_mlp_forward(a);
  a.y = want;
  reference::fused_mlp_forward(a);
  EXPECT_TRUE(test::all_close(n.y, want, {0, 0}));
}

// ---------------------------------------------------------------------------------------------
// Bad input
// ---------------------------------------------------------------------------------------------

TEST(MlpArgs, BadInputRaises) {
  const std::string op = "fused_mlp_forward";
  const auto relu = Activation::relu, id = Activation::identity;
  auto base = [&] { return random_net(DType::bf16, 4, {8, 32, 32, 4}, {relu, relu, id}, 7); };
  {
    Net n = base();
    n.act[1] = Activation::tanh;
    test::expect_arg_error([&] { fused_mlp_forward(n.args()); }, op, "layers[1].act");
  }
  {
    const Net n = random_net(DType::bf16, 4, {8, 24, 4}, {relu, id}, 8);  // hidden 24
    test::expect_arg_error([&] { fused_mlp_forward(n.args()); }, op, "layers[0].weight");
  }
  {
    const Net n = random_net(DType::bf16, 4, {129, 32, 4}, {relu, id}, 9);
    test::expect_arg_error([&] { fused_mlp_forward(n.args()); }, op, "x");
  }
  {
    const Net n = random_net(DType::bf16, 4, {8, 32, 129}, {relu, id}, 10);
    test::expect_arg_error([&] { fused_mlp_forward(n.args()); }, op, "layers.back().weight");
  }
  {
    const Net n = random_net(DType::bf16, 4, {8, 32}, {relu}, 11);  // one layer
    test::expect_arg_error([&] { fused_mlp_forward(n.args()); }, op, "layers");
  }
  {
    const Net n = random_net(DType::bf16, 4, {8, 32, 64, 4}, {relu, relu, id}, 12);  // hidden widths differ
    test::expect_arg_error([&] { fused_mlp_forward(n.args()); }, op, "layers[1].weight");
  }
  {
    Net n = base();
    n.b[1] = Tensor::empty({16}, DType::bf16, kCpu);
    test::expect_arg_error([&] { fused_mlp_forward(n.args()); }, op, "layers[1].bias");
  }
  {
    Net n = base();
    n.w[2] = Tensor::empty({4, 32}, DType::f16, kCpu);
    test::expect_arg_error([&] { fused_mlp_forward(n.args()); }, op, "layers[2].weight");
  }
  {
    const Net n = random_net(DType::f32, 4, {8, 32, 4}, {relu, id}, 13);
    test::expect_arg_error([&] { fused_mlp_forward(n.args()); }, op, "x");
  }
  {
    Net n = base();
    n.y = Tensor::empty({5, 4}, DType::bf16, kCpu);
    test::expect_arg_error([&] { fused_mlp_forward(n.args()); }, op, "y");
  }
  {
    Net n = base();
    FusedMlpForwardArgs a = n.args();
    a.y = TensorView(n.x.data(), DType::bf16, {4, 4}, kCpu);  // y over x's memory
    test::expect_arg_error([&] { fused_mlp_forward(a); }, op, "y");
  }
}

// ---------------------------------------------------------------------------------------------
// The fused kernel against the spec
// ---------------------------------------------------------------------------------------------

struct MlpCase {
  DType dt;
  std::int64_t batch;
  std::vector<std::int64_t> widths;
  std::vector<Activation> act;
};

std::string case_name(const ::testing::TestParamInfo<MlpCase>& info) {
  const MlpCase& c = info.param;
  std::string s = std::string(dtype_name(c.dt)) + "_B" + std::to_string(c.batch) + "_w";
  for (std::int64_t w : c.widths) s += std::to_string(w) + "x";
  s.pop_back();
  return s;
}

class MlpGpu : public ::testing::TestWithParam<MlpCase> {};

TEST_P(MlpGpu, ForwardMatchesSpec) {
  FK_SKIP_WITHOUT_GPU();
  const MlpCase& c = GetParam();
  const Net host = random_net(c.dt, c.batch, c.widths, c.act, 1000 + static_cast<std::uint64_t>(c.batch));
  reference::fused_mlp_forward(host.args());
  const Net dev = host.to(Device::cuda(0));
  test::poison(dev.y);
  fused_mlp_forward(dev.args());
  // The kernel sums in fp32 in another order than the double spec; where a hidden value lies at a
  // rounding boundary of the dtype the two round it to neighbouring values, and that one-ulp
  // difference travels through the remaining layers (weights ~ 1/sqrt(fan_in) keep it of order
  // one ulp per layer): four times the one-rounding tolerance.
  test::Tolerance tol = test::tolerance_for(c.dt);
  tol = {4 * tol.atol, 4 * tol.rtol};
  EXPECT_TRUE(test::all_close(dev.y, host.y, tol));
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, MlpGpu,
    ::testing::Values(MlpCase{DType::bf16, 1, {3, 16, 1}, {R, I}},
                      MlpCase{DType::bf16, 1000, {64, 32, 32, 32, 16}, {R, R, R, I}},
                      MlpCase{DType::f16, 4133, {64, 64, 64, 64, 64, 16}, {R, R, R, R, I}},
                      MlpCase{DType::bf16, 300, {128, 128, 128, 128}, {R, S, I}},
                      MlpCase{DType::f16, 257, {27, 128, 128, 5}, {S, R, S}},
                      MlpCase{DType::bf16, 129, {40, 64, 64, 10}, {R, I, R}},
                      MlpCase{DType::f16, 17, {128, 16, 16, 16, 16, 128}, {R, R, R, R, I}},
                      MlpCase{DType::bf16, 50, {1, 32, 3}, {S, S}},
                      MlpCase{DType::bf16, 20000, {64, 64, 64, 64, 64, 16}, {R, R, R, R, I}}),
    case_name);

TEST(MlpGpuArgs, TooLargeForSharedMemoryRaises) {
  FK_SKIP_WITHOUT_GPU();
  // 12 layers of 128 x 128 bf16 weights: 12 * 128 * 136 * 2 bytes, more than any GPU's 227 KB.
  std::vector<std::int64_t> widths(13, 128);
  const Net n = random_net(DType::bf16, 4, widths, std::vector<Activation>(12, Activation::relu), 3).to(Device::cuda(0));
  test::expect_arg_error([&] { fused_mlp_forward(n.args()); }, "fused_mlp_forward", "layers");
}

TEST(MlpGpuArgs, EmptyBatchIsANoOp) {
  FK_SKIP_WITHOUT_GPU();
  const Net n = random_net(DType::bf16, 0, {8, 16, 4}, {Activation::relu, Activation::identity}, 4).to(Device::cuda(0));
  fused_mlp_forward(n.args());
}

// ---------------------------------------------------------------------------------------------
// Training: the forward that saves the hidden layers, and the backward
// ---------------------------------------------------------------------------------------------

// The backward's tensors for an MLP: hidden [L-1, batch, H], y and dy, dx, f32 gradients.
struct Grads {
  Tensor hidden, y, dy, dx;
  std::vector<Tensor> dw, db;
  FusedMlpBackwardArgs args(const Net& n, bool with_dx) const {
    FusedMlpBackwardArgs a{dy, n.x, hidden, y, n.args().layers, std::nullopt, {}, {}};
    if (with_dx) a.dx = dx.view();
    for (std::size_t l = 0; l < dw.size(); ++l) {
      a.dweight.push_back(dw[l]);
      a.dbias.push_back(db[l]);
    }
    return a;
  }
};

Grads make_grads(const Net& n, Device d, std::uint64_t seed) {
  const std::int64_t batch = n.x.size(0), hidden = n.w[0].size(0);
  const DType dt = n.x.dtype();
  Grads g{Tensor::empty({static_cast<std::int64_t>(n.w.size()) - 1, batch, hidden}, dt, d),
          Tensor::empty(n.y.shape(), dt, d), test::random_tensor(n.y.shape(), dt, d, seed), Tensor::empty(n.x.shape(), dt, d),
          {}, {}};
  for (std::size_t l = 0; l < n.w.size(); ++l) {
    g.dw.push_back(Tensor::empty(n.w[l].shape(), DType::f32, d));
    g.db.push_back(Tensor::empty(n.b[l].shape(), DType::f32, d));
  }
  return g;
}

TEST(MlpSpec, HandWorkedBackward) {
  // The two-layer MLP of HandWorkedTwoLayers: h = relu([1.5, -3]) = [1.5, 0], y = 4; dy = 1.
  // g_1 = 1: dW_1 = g_1 h = [1.5, 0], db_1 = 1; dh = g_1 W_1 = [2, 3], g_0 = dh ⊙ relu'(h) = [2, 0]:
  // dW_0 = g_0ᵀ x = [[2, 4], [0, 0]], db_0 = [2, 0], dx = g_0 W_0 = [2, 0].
  Net n;
  n.x = test::host_tensor({1, 2}, DType::bf16, {1, 2});
  n.y = Tensor::empty({1, 1}, DType::bf16, kCpu);
  n.w.push_back(test::host_tensor({2, 2}, DType::bf16, {1, 0, -1, 1}));
  n.b.push_back(test::host_tensor({2}, DType::bf16, {0.5f, -4}));
  n.w.push_back(test::host_tensor({1, 2}, DType::bf16, {2, 3}));
  n.b.push_back(test::host_tensor({1}, DType::bf16, {1}));
  n.act = {Activation::relu, Activation::identity};
  Grads g = make_grads(n, kCpu, 1);
  g.dy = test::host_tensor({1, 1}, DType::bf16, {1});
  reference::fused_mlp_forward_train({n.x, n.args().layers, g.y, g.hidden});
  EXPECT_EQ(test::to_doubles(g.hidden), (std::vector<double>{1.5, 0}));
  EXPECT_EQ(test::to_doubles(g.y)[0], 4.0);
  reference::fused_mlp_backward(g.args(n, true));
  EXPECT_EQ(test::to_doubles(g.dw[1]), (std::vector<double>{1.5, 0}));
  EXPECT_EQ(test::to_doubles(g.db[1]), (std::vector<double>{1}));
  EXPECT_EQ(test::to_doubles(g.dw[0]), (std::vector<double>{2, 4, 0, 0}));
  EXPECT_EQ(test::to_doubles(g.db[0]), (std::vector<double>{2, 0}));
  EXPECT_EQ(test::to_doubles(g.dx), (std::vector<double>{2, 0}));
  // A sigmoid output: g_1 = dy · y(1 - y) with y = sigmoid(4) rounded to bf16.
  n.act[1] = Activation::sigmoid;
  reference::fused_mlp_forward_train({n.x, n.args().layers, g.y, g.hidden});
  reference::fused_mlp_backward(g.args(n, true));
  const double y = test::to_doubles(g.y)[0];
  EXPECT_EQ(test::to_doubles(g.db[1])[0], static_cast<float>(bf16(static_cast<float>(y * (1 - y)))));
}

// Σ y ⊙ r of the spec, the loss whose gradients the finite differences estimate.
double loss_of(const Net& n, const Tensor& r) {
  reference::fused_mlp_forward(n.args());
  const auto y = test::to_doubles(n.y), w = test::to_doubles(r);
  double s = 0;
  for (std::size_t i = 0; i < y.size(); ++i) s += y[i] * w[i];
  return s;
}

TEST(MlpSpec, BackwardMatchesFiniteDifferences) {
  // In f32 (the spec takes it), where a central difference with h = 1e-2 is accurate to about
  // h^2 |f'''| ~ 1e-4 and the f32 rounding of the forward adds ~1e-7 / h = 1e-5. No relu here: a
  // kink inside [w - h, w + h] would make the difference meaningless.
  Net n = random_net(DType::f32, 6, {5, 16, 16, 3}, {S, I, S}, 77);
  Grads g = make_grads(n, kCpu, 78);
  reference::fused_mlp_forward_train({n.x, n.args().layers, g.y, g.hidden});
  reference::fused_mlp_backward(g.args(n, true));
  const double h = 1e-2;
  const auto close = [](double fd, double an) { return std::abs(fd - an) <= 1e-3 + 1e-3 * std::abs(an); };
  auto check = [&](const Tensor& param, const Tensor& grad, const char* what) {
    const auto an = test::to_doubles(grad);
    float* p = param.data_as<float>();
    for (std::int64_t i = 0; i < param.numel(); ++i) {
      const float keep = p[i];
      p[i] = keep + static_cast<float>(h);
      const double up = loss_of(n, g.dy);
      p[i] = keep - static_cast<float>(h);
      const double down = loss_of(n, g.dy);
      p[i] = keep;
      const double fd = (up - down) / (2 * h);
      const double a = an[static_cast<std::size_t>(i)];
      EXPECT_TRUE(close(fd, a)) << what << "[" << i << "]: " << fd << " vs " << a;
    }
  };
  for (std::size_t l = 0; l < n.w.size(); ++l) {
    check(n.w[l], g.dw[l], "dW");
    check(n.b[l], g.db[l], "db");
  }
  check(n.x, g.dx, "dx");
}

TEST(MlpSpec, TrainForwardSavesTheHiddenLayers) {
  const Net n = random_net(DType::bf16, 9, {7, 32, 32, 32, 5}, {R, S, R, I}, 5);
  Grads g = make_grads(n, kCpu, 6);
  reference::fused_mlp_forward(n.args());
  fused_mlp_forward_train({n.x, n.args().layers, g.y, g.hidden});  // dispatch on the CPU: the spec
  EXPECT_TRUE(test::all_close(g.y, n.y, {0, 0}));
  // The last hidden layer fed through the output layer alone (after an identity layer) gives y.
  Tensor h2 = Tensor::empty({9, 32}, DType::bf16, kCpu);
  std::memcpy(h2.data(), static_cast<const char*>(g.hidden.data()) + 2 * 9 * 32 * 2, 9 * 32 * 2);
  std::vector<float> eye(32 * 32, 0.f);
  for (int i = 0; i < 32; ++i) eye[static_cast<std::size_t>(i * 33)] = 1.f;
  const Tensor w_eye = test::host_tensor({32, 32}, DType::bf16, eye);
  const Tensor b0 = test::host_tensor({32}, DType::bf16, std::vector<float>(32, 0.f));
  Tensor y2 = Tensor::empty({9, 5}, DType::bf16, kCpu);
  reference::fused_mlp_forward({h2, {{w_eye, b0, I}, {n.w[3], n.b[3], I}}, y2});
  EXPECT_TRUE(test::all_close(y2, n.y, {0, 0}));
}

TEST(MlpArgs, TrainingBadInputRaises) {
  const Net n = random_net(DType::bf16, 4, {8, 32, 32, 4}, {R, R, I}, 7);
  {
    Grads g = make_grads(n, kCpu, 1);
    g.hidden = Tensor::empty({1, 4, 32}, DType::bf16, kCpu);  // 2 hidden layers, not 1
    test::expect_arg_error([&] { fused_mlp_forward_train({n.x, n.args().layers, g.y, g.hidden}); },
                           "fused_mlp_forward_train", "hidden");
    test::expect_arg_error([&] { fused_mlp_backward(g.args(n, true)); }, "fused_mlp_backward", "hidden");
  }
  {
    Grads g = make_grads(n, kCpu, 1);
    const TensorView over_y(g.y.data(), DType::bf16, {2, 4, 32}, kCpu);  // hidden over y's memory
    test::expect_arg_error([&] { fused_mlp_forward_train({n.x, n.args().layers, g.y, over_y}); },
                           "fused_mlp_forward_train", "hidden");
  }
  const std::string op = "fused_mlp_backward";
  {
    Grads g = make_grads(n, kCpu, 1);
    g.dw[1] = Tensor::empty({32, 32}, DType::bf16, kCpu);
    test::expect_arg_error([&] { fused_mlp_backward(g.args(n, true)); }, op, "dweight[1]");
  }
  {
    Grads g = make_grads(n, kCpu, 1);
    g.db[2] = Tensor::empty({5}, DType::f32, kCpu);
    test::expect_arg_error([&] { fused_mlp_backward(g.args(n, true)); }, op, "dbias[2]");
  }
  {
    Grads g = make_grads(n, kCpu, 1);
    g.db.pop_back();
    g.dw.pop_back();
    test::expect_arg_error([&] { fused_mlp_backward(g.args(n, true)); }, op, "dweight");
  }
  {
    Grads g = make_grads(n, kCpu, 1);
    g.dy = Tensor::empty({4, 5}, DType::bf16, kCpu);
    test::expect_arg_error([&] { fused_mlp_backward(g.args(n, true)); }, op, "dy");
  }
  {
    Grads g = make_grads(n, kCpu, 1);
    g.dx = Tensor::empty({4, 7}, DType::bf16, kCpu);
    test::expect_arg_error([&] { fused_mlp_backward(g.args(n, true)); }, op, "dx");
  }
  {
    Grads g = make_grads(n, kCpu, 1);
    FusedMlpBackwardArgs a = g.args(n, true);
    a.dx = TensorView(g.hidden.data(), DType::bf16, {4, 8}, kCpu);  // dx over hidden's memory
    test::expect_arg_error([&] { fused_mlp_backward(a); }, op, "dx");
  }
  {
    Grads g = make_grads(n, kCpu, 1);
    g.y = Tensor::empty({4, 4}, DType::f16, kCpu);
    test::expect_arg_error([&] { fused_mlp_backward(g.args(n, true)); }, op, "y");
  }
}

struct TrainCase {
  DType dt;
  std::int64_t batch;
  std::vector<std::int64_t> widths;
  std::vector<Activation> act;
  bool with_dx;
};

std::string train_case_name(const ::testing::TestParamInfo<TrainCase>& info) {
  const TrainCase& c = info.param;
  std::string s = std::string(dtype_name(c.dt)) + "_B" + std::to_string(c.batch) + "_w";
  for (std::int64_t w : c.widths) s += std::to_string(w) + "x";
  s.pop_back();
  return s + (c.with_dx ? "" : "_nodx");
}

class MlpTrainGpu : public ::testing::TestWithParam<TrainCase> {};

TEST_P(MlpTrainGpu, ForwardTrainAndBackwardMatchSpec) {
  FK_SKIP_WITHOUT_GPU();
  const TrainCase& c = GetParam();
  const std::uint64_t seed = 3000 + static_cast<std::uint64_t>(c.batch);
  const Net host = random_net(c.dt, c.batch, c.widths, c.act, seed);
  Grads hg = make_grads(host, kCpu, seed + 100);
  reference::fused_mlp_forward_train({host.x, host.args().layers, hg.y, hg.hidden});
  reference::fused_mlp_backward(hg.args(host, c.with_dx));

  const Device gpu = Device::cuda(0);
  const Net dev = host.to(gpu);
  Grads dg = make_grads(dev, gpu, seed + 100);  // the same dy
  test::poison(dg.y);
  test::poison(dg.hidden);
  fused_mlp_forward_train({dev.x, dev.args().layers, dg.y, dg.hidden});
  test::Tolerance tol = test::tolerance_for(c.dt);
  tol = {4 * tol.atol, 4 * tol.rtol};  // as ForwardMatchesSpec
  EXPECT_TRUE(test::all_close(dg.y, hg.y, tol));
  EXPECT_TRUE(test::all_close(dg.hidden, hg.hidden, tol));
  // The inference forward gives the same y, bit for bit.
  test::poison(dev.y);
  fused_mlp_forward(dev.args());
  EXPECT_TRUE(test::all_close(dev.y, dg.y, {0, 0}));

  // The backward from the spec's saved tensors, so that both sides see the same inputs.
  dg.hidden = hg.hidden.copy_to(gpu);
  dg.y = hg.y.copy_to(gpu);
  test::poison(dg.dx);
  for (const Tensor& t : dg.dw) test::poison(t);
  for (const Tensor& t : dg.db) test::poison(t);
  fused_mlp_backward(dg.args(dev, c.with_dx));
  // Normwise, as for GEMMs: the kernel sums dh in fp32 in another order than the double spec, so
  // a g at a rounding boundary of the dtype can round to the neighbouring value (one ulp, carried
  // into the layers below); 4x the dtype's one-rounding bound.
  const double bound = 4 * test::tolerance_for(c.dt).rtol;
  if (c.with_dx) {
    EXPECT_LE(test::rel_err_normwise(dg.dx, hg.dx), bound) << "dx";
  }
  for (std::size_t l = 0; l < dg.dw.size(); ++l) {
    EXPECT_LE(test::rel_err_normwise(dg.dw[l], hg.dw[l]), bound) << "dW" << l;
    EXPECT_LE(test::rel_err_normwise(dg.db[l], hg.db[l]), bound) << "db" << l;
  }
  // Deterministic: a second backward gives the same bits.
  Grads again = make_grads(dev, gpu, seed + 100);
  FusedMlpBackwardArgs a2 = dg.args(dev, false);
  const FusedMlpBackwardArgs into = again.args(dev, false);
  a2.dweight = into.dweight;
  a2.dbias = into.dbias;
  fused_mlp_backward(a2);
  for (std::size_t l = 0; l < dg.dw.size(); ++l) {
    EXPECT_TRUE(test::all_close(again.dw[l], dg.dw[l], {0, 0})) << "dW" << l;
    EXPECT_TRUE(test::all_close(again.db[l], dg.db[l], {0, 0})) << "db" << l;
  }
}

// The backward keeps dW on chip where its buffers and fp32 accumulators fit in shared memory;
// the 27-128-128-5, 128-128-128-128 and 128-16-16-16-16-128 MLPs here do not, and take the path
// with cuBLAS dW GEMMs.
INSTANTIATE_TEST_SUITE_P(
    Shapes, MlpTrainGpu,
    ::testing::Values(TrainCase{DType::bf16, 1, {3, 16, 1}, {R, I}, true},
                      TrainCase{DType::bf16, 1000, {64, 32, 32, 32, 16}, {R, R, R, I}, true},
                      TrainCase{DType::f16, 4133, {64, 64, 64, 64, 64, 16}, {R, R, R, R, I}, true},
                      TrainCase{DType::bf16, 300, {128, 128, 128, 128}, {R, S, I}, true},
                      TrainCase{DType::f16, 257, {27, 128, 128, 5}, {S, R, S}, true},
                      TrainCase{DType::bf16, 129, {40, 64, 64, 10}, {R, I, R}, false},
                      TrainCase{DType::f16, 17, {128, 16, 16, 16, 16, 128}, {R, R, R, R, I}, true},
                      TrainCase{DType::bf16, 50, {1, 32, 3}, {S, S}, true},
                      TrainCase{DType::f16, 3001, {16, 128, 16}, {R, S}, true},
                      TrainCase{DType::bf16, 20000, {64, 64, 64, 64, 64, 16}, {R, R, R, R, I}, true}),
    train_case_name);

TEST(MlpGpuArgs, TrainingEmptyBatchZeroesTheGradients) {
  FK_SKIP_WITHOUT_GPU();
  const Net n = random_net(DType::bf16, 0, {8, 16, 4}, {R, I}, 4).to(Device::cuda(0));
  Grads g = make_grads(n, Device::cuda(0), 5);
  fused_mlp_forward_train({n.x, n.args().layers, g.y, g.hidden});
  for (const Tensor& t : g.dw) test::poison(t);
  for (const Tensor& t : g.db) test::poison(t);
  fused_mlp_backward(g.args(n, true));
  for (const Tensor& t : g.dw)
    for (double v : test::to_doubles(t)) EXPECT_EQ(v, 0.0);
  for (const Tensor& t : g.db)
    for (double v : test::to_doubles(t)) EXPECT_EQ(v, 0.0);
}

}  // namespace
}  // namespace fk
