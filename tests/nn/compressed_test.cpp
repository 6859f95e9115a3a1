// CompressedLinear / CompressedReLU: memory kept for backward, gradients against the
// uncompressed layer, and a small CPU training run: at 8 bits the loss tracks the uncompressed
// loss, at 2 bits it still falls.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "fusekit/fusekit.hpp"
#include "test_util.hpp"

namespace fk::nn {
namespace {

const Device kCpu = Device::cpu();

TEST(CompressedLinear, TwoBitsKeepsOverSevenTimesFewerBytesThanBf16) {
  // The bytes that matter on the GPU: a bf16 x [4096, 768] against its 2-bit pack with bf16
  // statistics at group 256 (7.5x); the CPU layer (f32) packs the same way.
  CompressedLinear layer(768, 16, PackParams{.bits = 2, .group = 256}, DType::f32, kCpu, 1);
  Tensor x = test::random_tensor({4096, 768}, DType::f32, kCpu, 2);
  Tensor y = Tensor::empty({4096, 16}, DType::f32, kCpu);
  layer.forward(x, y);
  const std::size_t bf16_bytes = static_cast<std::size_t>(x.numel()) * 2;
  EXPECT_EQ(layer.uncompressed_bytes(), x.nbytes());
  EXPECT_LE(layer.saved_bytes() * 7, bf16_bytes) << "saved " << layer.saved_bytes();
  CompressedReLU relu;
  Tensor r = Tensor::empty({4096, 768}, DType::f32, kCpu);
  relu.forward(x, r);
  EXPECT_EQ(relu.saved_bytes(), static_cast<std::size_t>(x.numel()) / 8);
}

TEST(CompressedLinear, EightBitGradientsAreCloseToTheUncompressedOnes) {
  CompressedLinear exact(40, 24, std::nullopt, DType::f32, kCpu, 3);
  CompressedLinear packed(40, 24, PackParams{.bits = 8, .group = 32}, DType::f32, kCpu, 3);
  Tensor x = test::random_tensor({50, 40}, DType::f32, kCpu, 4), dy = test::random_tensor({50, 24}, DType::f32, kCpu, 5);
  Tensor y1 = Tensor::empty({50, 24}, DType::f32, kCpu), y2 = Tensor::empty({50, 24}, DType::f32, kCpu);
  Tensor dx1 = Tensor::empty({50, 40}, DType::f32, kCpu), dx2 = Tensor::empty({50, 40}, DType::f32, kCpu);
  exact.forward(x, y1);
  packed.forward(x, y2);
  EXPECT_TRUE(test::all_close(y2, y1, {0, 0}));  // the forward never sees the compression
  exact.backward(dy, dx1.view());
  packed.backward(dy, dx2.view());
  EXPECT_TRUE(test::all_close(dx2, dx1, {0, 0}));  // dx = dy W needs no activation
  EXPECT_TRUE(test::all_close(packed.bias_grad, exact.bias_grad, {0, 0}));
  // dW from 8-bit x: each x̂ within scale / 2 = range / 510 (range < 2) of x, times |dy| < 1,
  // summed over 50 rows: at most 50 / 255 apart.
  EXPECT_TRUE(test::all_close(packed.weight_grad, exact.weight_grad, {50.0 / 255, 0}));
  const auto a = test::to_doubles(packed.weight_grad), b = test::to_doubles(exact.weight_grad);
  EXPECT_NE(a, b);  // and it did use the packed x
}

// A 16-64-1 MLP on y = tanh(x·v), full-batch SGD on the mean squared error; returns the loss of
// every step.
std::vector<double> train(std::optional<PackParams> compress, int steps) {
  const std::int64_t n = 256, d = 16, h = 64;
  Tensor x = test::random_tensor({n, d}, DType::f32, kCpu, 10), v = test::random_tensor({d}, DType::f32, kCpu, 11);
  std::vector<float> target(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) {
    double s = 0;
    for (std::int64_t j = 0; j < d; ++j) s += x.data_as<float>()[i * d + j] * v.data_as<float>()[j];
    target[static_cast<std::size_t>(i)] = static_cast<float>(std::tanh(s));
  }
  CompressedLinear l1(d, h, compress, DType::f32, kCpu, 20), l2(h, 1, compress, DType::f32, kCpu, 21);
  CompressedReLU relu;
  Tensor z = Tensor::empty({n, h}, DType::f32, kCpu), a = Tensor::empty({n, h}, DType::f32, kCpu);
  Tensor y = Tensor::empty({n, 1}, DType::f32, kCpu), dy = Tensor::empty({n, 1}, DType::f32, kCpu);
  Tensor da = Tensor::empty({n, h}, DType::f32, kCpu), dz = Tensor::empty({n, h}, DType::f32, kCpu);
  std::vector<double> losses;
  for (int step = 0; step < steps; ++step) {
    l1.forward(x, z);
    relu.forward(z, a);
    l2.forward(a, y);
    double loss = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      const double e = y.data_as<float>()[i] - target[static_cast<std::size_t>(i)];
      loss += e * e / n;
      dy.data_as<float>()[i] = static_cast<float>(2 * e / n);
    }
    losses.push_back(loss);
    l2.backward(dy, da.view());
    relu.backward(da, dz);
    l1.backward(dz, std::nullopt);
    for (CompressedLinear* l : {&l1, &l2}) {
      sgd_step(l->weight, l->weight_grad, 0.1f);
      sgd_step(l->bias, l->bias_grad, 0.1f);
    }
  }
  return losses;
}

TEST(CompressedTraining, EightBitsTracksTheUncompressedLossAndTwoBitsStillLearns) {
  const int steps = 300;
  const auto exact = train(std::nullopt, steps);
  const auto b8 = train(PackParams{.bits = 8, .group = 16}, steps);
  const auto b2 = train(PackParams{.bits = 2, .group = 16}, steps);
  ASSERT_LT(exact.back(), 0.3 * exact.front()) << "the uncompressed model must learn for the comparison to mean anything";
  for (int s = 0; s < steps; s += 50)
    EXPECT_NEAR(b8[s], exact[s], 0.05 * exact[s] + 1e-4) << "step " << s;
  EXPECT_NEAR(b8.back(), exact.back(), 0.05 * exact.back());
  EXPECT_LT(b2.back(), 0.5 * b2.front());
  std::printf("loss first -> last: uncompressed %.4f -> %.4f, 8 bits %.4f -> %.4f, 2 bits %.4f -> %.4f\n", exact.front(),
              exact.back(), b8.front(), b8.back(), b2.front(), b2.back());
}

TEST(CompressedLinear, BadInputs) {
  EXPECT_THROW(CompressedLinear(8, 4, std::nullopt, DType::bf16, kCpu, 1), Error);  // f32 on the CPU
  CompressedLinear l(8, 4, std::nullopt, DType::f32, kCpu, 1);
  Tensor x = Tensor::empty({3, 7}, DType::f32, kCpu), y = Tensor::empty({3, 4}, DType::f32, kCpu);
  test::expect_arg_error([&] { l.forward(x, y); }, "CompressedLinear::forward", "x");
  Tensor dy = Tensor::empty({3, 4}, DType::f32, kCpu);
  EXPECT_THROW(l.backward(dy, std::nullopt), Error);  // no forward yet
}

TEST(CompressedLinearGpu, MatchesTheCpuLayerInBf16) {
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  const PackParams p{.bits = 4, .group = 64};
  CompressedLinear g(128, 96, p, DType::bf16, gpu, 7);
  CompressedLinear c(128, 96, p, DType::f32, kCpu, 7);
  // The same weights: the GPU's bf16 values, widened.
  auto widen = [](const TensorView& t) {
    Tensor h = test::to_host(t), f = Tensor::empty(t.shape(), DType::f32, Device::cpu());
    for (std::int64_t i = 0; i < h.numel(); ++i) f.data_as<float>()[i] = static_cast<float>(h.data_as<bf16>()[i]);
    return f;
  };
  copy(c.weight, widen(g.weight));
  copy(c.bias, widen(g.bias));
  Tensor xh = test::random_tensor({200, 128}, DType::bf16, kCpu, 8), dyh = test::random_tensor({200, 96}, DType::bf16, kCpu, 9);
  Tensor x = xh.copy_to(gpu), dy = dyh.copy_to(gpu);
  Tensor y = Tensor::empty({200, 96}, DType::bf16, gpu), dx = Tensor::empty({200, 128}, DType::bf16, gpu);
  g.forward(x, y);
  g.backward(dy, dx.view());
  Tensor yc = Tensor::empty({200, 96}, DType::f32, kCpu), dxc = Tensor::empty({200, 128}, DType::f32, kCpu);
  Tensor xf = widen(xh), dyf = widen(dyh);
  c.forward(xf, yc);
  c.backward(dyf, dxc.view());
  // bf16 outputs of fp32 sums over 128 (forward) and 96 (dx) products of values in [-1, 1), and
  // over 200 rows for dW (whose x̂ the GPU rounds to bf16 before the tensor cores).
  EXPECT_TRUE(test::all_close(y, yc, {0.05, 0.01}));
  EXPECT_TRUE(test::all_close(dx, dxc, {0.05, 0.01}));
  EXPECT_TRUE(test::all_close(g.bias_grad, c.bias_grad, {0.1, 0.01}));
  EXPECT_TRUE(test::all_close(g.weight_grad, c.weight_grad, {0.2, 0.02}));
}

}  // namespace
}  // namespace fk::nn
