// nn::Linear and nn::MLP: a hand-worked layer, gradients against finite differences of the
// forward on the CPU, the GPU against the CPU from the same initialisation, and bad arguments.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "fusekit/fusekit.hpp"
#include "fusekit/nn/linear.hpp"
#include "test_util.hpp"

namespace fk {
namespace {

const Device kCpu = Device::cpu();

void set(const Tensor& t, const std::vector<float>& v) { copy(t, test::host_tensor(t.shape(), t.dtype(), v)); }

TEST(Linear, ReluLayerByHand) {
  nn::Linear l(2, 1, {Activation::relu, false}, DType::f32, kCpu, {1, 0});
  set(l.weight, {1, -1});
  set(l.bias, {0.5f});
  const Tensor x = test::host_tensor({2, 2}, DType::f32, {2, 1, 0, 3});
  Tensor y = Tensor::empty({2, 1}, DType::f32, kCpu);
  l.forward(x, y);
  EXPECT_EQ(test::to_floats(y), (std::vector<float>{1.5f, 0.0f}));  // relu(2 - 1 + 0.5), relu(0 - 3 + 0.5)
  Tensor dy = test::host_tensor({2, 1}, DType::f32, {1, 1}), dx = Tensor::empty({2, 2}, DType::f32, kCpu);
  l.backward(x, y, dy, dx.view());
  EXPECT_EQ(test::to_floats(dy), (std::vector<float>{1, 0}));  // dz: the second sample is past the ReLU's knee
  EXPECT_EQ(test::to_floats(l.bias_grad), (std::vector<float>{1}));
  EXPECT_EQ(test::to_floats(l.weight_grad), (std::vector<float>{2, 1}));
  EXPECT_EQ(test::to_floats(dx), (std::vector<float>{1, -1, 0, 0}));
}

// loss = sum(r ⊙ mlp(x)); its gradients against central differences, for each activation.
TEST(MLP, GradientsMatchFiniteDifferences) {
  for (Activation act : {Activation::identity, Activation::relu, Activation::gelu_tanh}) {
    nn::MLP mlp({5, 7, 3}, act, false, false, DType::f32, kCpu, {7, 0});
    const std::int64_t b = 4;
    const Tensor x = test::random_tensor({b, 5}, DType::f32, kCpu, 1);
    const Tensor r = test::random_tensor({b, 3}, DType::f32, kCpu, 2);
    Tensor y = Tensor::empty({b, 3}, DType::f32, kCpu);
    const auto loss = [&] {
      mlp.forward(x, y);
      double s = 0;
      const std::vector<double> yv = test::to_doubles(y), rv = test::to_doubles(r);
      for (std::size_t i = 0; i < yv.size(); ++i) s += yv[i] * rv[i];
      return s;
    };
    loss();
    Tensor dy = r.copy_to(kCpu), dx = Tensor::empty({b, 5}, DType::f32, kCpu);
    mlp.backward(y, dy, dx.view());
    const auto check = [&](const Tensor& param, const Tensor& grad, const char* what) {
      const std::vector<double> g = test::to_doubles(grad);
      for (std::int64_t i = 0; i < param.numel(); ++i) {
        float* p = param.data_as<float>() + i;
        const float keep = *p, h = 1e-3f;
        *p = keep + h;
        const double up = loss();
        *p = keep - h;
        const double down = loss();
        *p = keep;
        EXPECT_NEAR(g[static_cast<std::size_t>(i)], (up - down) / (2 * h), 2e-3) << activation_name(act) << " " << what << i;
      }
    };
    check(mlp.layers[0].weight, mlp.layers[0].weight_grad, "W0 ");
    check(mlp.layers[0].bias, mlp.layers[0].bias_grad, "b0 ");
    check(mlp.layers[1].weight, mlp.layers[1].weight_grad, "W1 ");
    check(x, dx, "x ");
  }
}

TEST(MLP, GpuMatchesCpuFromTheSameInitialisation) {
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  for (DType dt : {DType::f32, DType::bf16})
    for (Activation act : {Activation::relu, Activation::gelu_tanh}) {
      const std::int64_t b = 300;
      const std::vector<std::int64_t> sizes{40, 64, 24, 8};
      nn::MLP cpu(sizes, act, false, false, DType::f32, kCpu, {3, 0});
      nn::MLP gpu_mlp(sizes, act, false, false, dt, gpu, {3, 0});
      // The CPU model runs on the GPU model's (rounded) parameters.
      for (std::size_t l = 0; l < cpu.layers.size(); ++l) {
        set(cpu.layers[l].weight, test::to_floats(gpu_mlp.layers[l].weight));
        set(cpu.layers[l].bias, test::to_floats(gpu_mlp.layers[l].bias));
      }
      const Tensor xh = test::random_tensor({b, 40}, dt, kCpu, 1), rh = test::random_tensor({b, 8}, dt, kCpu, 2);
      const Tensor x32 = test::host_tensor({b, 40}, DType::f32, test::to_floats(xh)), r32 = test::host_tensor({b, 8}, DType::f32, test::to_floats(rh));
      Tensor y32 = Tensor::empty({b, 8}, DType::f32, kCpu), dy32 = r32.copy_to(kCpu), dx32 = Tensor::empty({b, 40}, DType::f32, kCpu);
      cpu.forward(x32, y32);
      cpu.backward(y32, dy32, dx32.view());
      const Tensor xg = xh.copy_to(gpu);
      Tensor yg = Tensor::empty({b, 8}, dt, gpu), dyg = rh.copy_to(gpu), dxg = Tensor::empty({b, 40}, dt, gpu);
      gpu_mlp.forward(xg, yg);
      gpu_mlp.backward(yg, dyg, dxg.view());
      // f32: cuBLASLt GELU's fast tanh (1e-4). bf16: the GPU model rounds every activation and
      // every gradient to 8 bits (2^-8 each) and the rounding compounds through three layers of
      // backward; the f32 CPU model does not round (measured on the H100: 3.3e-2 at worst, db1).
      const double tol = dt == DType::f32 ? 1e-4 : 6e-2;
      const auto close = [&](const TensorView& got, const TensorView& want, const std::string& what) {
        EXPECT_LE(test::rel_err_normwise(test::host_tensor(want.shape(), DType::f32, test::to_floats(got)), want), tol)
            << dtype_name(dt) << " " << activation_name(act) << " " << what;
      };
      close(yg, y32, "y");
      close(dxg, dx32, "dx");
      for (std::size_t l = 0; l < cpu.layers.size(); ++l) {
        close(gpu_mlp.layers[l].weight_grad, cpu.layers[l].weight_grad, "dW" + std::to_string(l));
        close(gpu_mlp.layers[l].bias_grad, cpu.layers[l].bias_grad, "db" + std::to_string(l));
      }
    }
}

TEST(LinearErrors, BadArgumentsNameTheArgument) {
  using test::expect_arg_error;
  expect_arg_error([] { nn::Linear(3, 2, {Activation::sigmoid, false}, DType::f32, kCpu, {}); }, "nn::Linear", "act");
  expect_arg_error([] { nn::Linear(0, 2, {}, DType::f32, kCpu, {}); }, "nn::Linear", "in/out");
  nn::Linear l(3, 2, {}, DType::f32, kCpu, {});
  Tensor y = Tensor::empty({4, 2}, DType::f32, kCpu);
  expect_arg_error([&] { l.forward(Tensor::empty({4, 5}, DType::f32, kCpu), y); }, "nn::Linear::forward", "x");
  expect_arg_error([&] { l.forward(Tensor::empty({4, 3}, DType::f32, kCpu), Tensor::empty({4, 3}, DType::f32, kCpu)); },
                   "nn::Linear::forward", "y");
  const Tensor x = Tensor::empty({4, 3}, DType::f32, kCpu);
  Tensor dy = Tensor::empty({4, 2}, DType::f32, kCpu);
  expect_arg_error([&] { l.backward(x, y, dy, Tensor::empty({4, 2}, DType::f32, kCpu).view()); }, "nn::Linear::backward",
                   "dx");
}

}  // namespace
}  // namespace fk
