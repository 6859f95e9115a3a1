// nn::FusedMLP: the layer runs the mlp ops on what it saved (CPU: the spec), the GPU layer agrees
// with the CPU layer built from the same seed, and a few SGD steps on the CPU lower the loss.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "fusekit/fusekit.hpp"
#include "fusekit/nn/fused_mlp.hpp"
#include "test_util.hpp"

namespace fk::nn {
namespace {

const Device kCpu = Device::cpu();
const auto R = Activation::relu, S = Activation::sigmoid;

TEST(FusedMLP, ForwardAndBackwardAreTheOpsOnWhatTheLayerSaved) {
  FusedMLP mlp(12, 32, 3, 5, R, S, DType::bf16, kCpu, 1);
  ASSERT_EQ(mlp.weight.size(), 4u);
  EXPECT_EQ(mlp.params().size(), 8u);
  EXPECT_EQ(mlp.grads().size(), 8u);
  Tensor x = test::random_tensor({21, 12}, DType::bf16, kCpu, 2, -2.f, 2.f);
  Tensor dy = test::random_tensor({21, 5}, DType::bf16, kCpu, 3);
  Tensor y = Tensor::empty({21, 5}, DType::bf16, kCpu), dx = Tensor::empty({21, 12}, DType::bf16, kCpu);
  mlp.forward(x, y);
  mlp.backward(dy, dx.view());
  // x, three hidden layers, and y (the sigmoid's derivative needs it).
  EXPECT_EQ(mlp.saved_bytes(), x.nbytes() + 3u * 21 * 32 * 2 + y.nbytes());

  Tensor want_y = Tensor::empty({21, 5}, DType::bf16, kCpu), hidden = Tensor::empty({3, 21, 32}, DType::bf16, kCpu);
  reference::fused_mlp_forward_train({x, mlp.layers(), want_y, hidden});
  EXPECT_TRUE(test::all_close(y, want_y, {0, 0}));
  Tensor want_dx = Tensor::empty({21, 12}, DType::bf16, kCpu);
  std::vector<Tensor> dw, db;
  std::vector<TensorView> dwv, dbv;
  for (std::size_t l = 0; l < 4; ++l) {
    dw.push_back(Tensor::empty(mlp.weight[l].shape(), DType::f32, kCpu));
    db.push_back(Tensor::empty(mlp.bias[l].shape(), DType::f32, kCpu));
    dwv.push_back(dw.back());
    dbv.push_back(db.back());
  }
  reference::fused_mlp_backward({dy, x, hidden, want_y, mlp.layers(), want_dx.view(), dwv, dbv});
  EXPECT_TRUE(test::all_close(dx, want_dx, {0, 0}));
  for (std::size_t l = 0; l < 4; ++l) {
    EXPECT_TRUE(test::all_close(mlp.weight_grad[l], dw[l], {0, 0})) << l;
    EXPECT_TRUE(test::all_close(mlp.bias_grad[l], db[l], {0, 0})) << l;
  }
}

TEST(FusedMLP, BadInputRaises) {
  EXPECT_THROW(FusedMLP(8, 32, 0, 4, R, R, DType::bf16, kCpu, 1), Error);
  EXPECT_THROW(FusedMLP(8, 32, 1, 4, R, R, DType::f32, kCpu, 1), Error);
  FusedMLP mlp(8, 16, 1, 4, R, R, DType::bf16, kCpu, 1);
  Tensor dy = Tensor::empty({3, 4}, DType::bf16, kCpu);
  test::expect_arg_error([&] { mlp.backward(dy, std::nullopt); }, "FusedMLP::backward", "this");
  Tensor x = test::random_tensor({3, 9}, DType::bf16, kCpu, 1), y = Tensor::empty({3, 4}, DType::bf16, kCpu);
  test::expect_arg_error([&] { mlp.forward(x, y); }, "FusedMLP::forward", "x");
  Tensor x8 = test::random_tensor({3, 8}, DType::bf16, kCpu, 1);
  mlp.forward(x8, y);
  Tensor dy_bad = Tensor::empty({2, 4}, DType::bf16, kCpu);
  test::expect_arg_error([&] { mlp.backward(dy_bad, std::nullopt); }, "FusedMLP::backward", "dy");
}

// Full-batch SGD on the mean squared error to y = sin(x·v) with bf16 weights updated in f32 and
// rounded back: the loss falls.
TEST(FusedMLP, SgdLowersTheLoss) {
  const std::int64_t n = 128, d = 8;
  FusedMLP mlp(d, 16, 2, 1, R, Activation::identity, DType::bf16, kCpu, 4);
  Tensor x = test::random_tensor({n, d}, DType::bf16, kCpu, 5, -1.f, 1.f);
  const auto xs = test::to_doubles(x);
  std::vector<double> target(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) {
    double s = 0;
    for (std::int64_t j = 0; j < d; ++j) s += xs[static_cast<std::size_t>(i * d + j)] * (j % 2 ? 1.0 : -0.5);
    target[static_cast<std::size_t>(i)] = std::sin(s);
  }
  Tensor y = Tensor::empty({n, 1}, DType::bf16, kCpu), dy = Tensor::empty({n, 1}, DType::bf16, kCpu);
  std::vector<double> losses;
  for (int step = 0; step < 60; ++step) {
    mlp.forward(x, y);
    const auto ys = test::to_doubles(y);
    double loss = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      const double e = ys[static_cast<std::size_t>(i)] - target[static_cast<std::size_t>(i)];
      loss += e * e / n;
      dy.data_as<bf16>()[i] = bf16(static_cast<float>(2 * e));  // the 1/n goes into the step
    }
    losses.push_back(loss);
    mlp.backward(dy, std::nullopt);
    const auto params = mlp.params(), grads = mlp.grads();
    for (std::size_t p = 0; p < params.size(); ++p)
      for (std::int64_t i = 0; i < params[p].numel(); ++i) {
        bf16& w = params[p].data_as<bf16>()[i];
        w = bf16(static_cast<float>(w) - 0.2f / n * grads[p].data_as<float>()[i]);
      }
  }
  EXPECT_LT(losses.back(), 0.5 * losses.front()) << losses.front() << " -> " << losses.back();
}

TEST(FusedMLP, GpuMatchesCpu) {
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  for (DType dt : {DType::bf16, DType::f16}) {
    FusedMLP cpu(40, 64, 3, 10, R, S, dt, kCpu, 9), dev(40, 64, 3, 10, R, S, dt, gpu, 9);
    Tensor x = test::random_tensor({777, 40}, dt, kCpu, 10, -2.f, 2.f), dy = test::random_tensor({777, 10}, dt, kCpu, 11);
    Tensor y = Tensor::empty({777, 10}, dt, kCpu), dx = Tensor::empty({777, 40}, dt, kCpu);
    Tensor xd = x.copy_to(gpu), dyd = dy.copy_to(gpu);
    Tensor yd = Tensor::empty({777, 10}, dt, gpu), dxd = Tensor::empty({777, 40}, dt, gpu);
    cpu.forward(x, y);
    cpu.backward(dy, dx.view());
    dev.forward(xd, yd);
    dev.backward(dyd, dxd.view());
    test::Tolerance tol = test::tolerance_for(dt);
    tol = {4 * tol.atol, 4 * tol.rtol};  // as the op tests
    EXPECT_TRUE(test::all_close(yd, y, tol));
    const double bound = 4 * test::tolerance_for(dt).rtol;
    EXPECT_LE(test::rel_err_normwise(dxd, dx), bound);
    for (std::size_t l = 0; l < cpu.weight.size(); ++l) {
      EXPECT_LE(test::rel_err_normwise(dev.weight_grad[l], cpu.weight_grad[l]), bound) << l;
      EXPECT_LE(test::rel_err_normwise(dev.bias_grad[l], cpu.bias_grad[l]), bound) << l;
    }
  }
}

}  // namespace
}  // namespace fk::nn
