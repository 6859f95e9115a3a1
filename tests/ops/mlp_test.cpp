// Tests of the mlp family: the spec against a hand-worked MLP, the fused CUDA kernel against the
// spec on random MLPs (every hidden width, input and output widths that are not multiples of 16,
// batches that are not multiples of the 16-row warp tile or the 128-row CTA), and every bad input.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "fusekit/fusekit.hpp"
#include "test_util.hpp"

namespace fk {
namespace {

const Device kCpu = Device::cpu();

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

const auto R = Activation::relu, S = Activation::sigmoid, I = Activation::identity;
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

}  // namespace
}  // namespace fk
