// The Triton puzzles 1-8, 10 and 11, as tests of fusekit's primitives. Each puzzle's
// spec is written here again as the notebook states it (plain loops over std::vector<float>,
// independent of fk::reference), at the notebook's exact shapes and then at larger random ones
// with tails; the ops run on the CPU (fusekit's own spec) and on the GPU, and must match the
// puzzle's spec with rtol = atol = 1e-3, as the notebook's harness asks. Under compute-sanitizer
// these tests are the notebook's "invalid memory access" check.
// Puzzle 9 (scalar FlashAttention) is attention_forward's: tests/ops/attention_test.cpp
// (AttentionPuzzle9.*) runs the notebook's spec at T = 200 on the CPU and the GPU.
// Puzzle 12 (4-bit weight matmul) is the qgemm family's.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "fusekit/fusekit.hpp"
#include "test_util.hpp"

namespace fk {
namespace {

using Vec = std::vector<float>;
const Device kCpu = Device::cpu();
constexpr test::Tolerance kNotebook{1e-3, 1e-3};

// The devices a puzzle runs on: the CPU always, the GPU when there is one.
std::vector<Device> devices() {
  std::vector<Device> d{kCpu};
  if (cuda_device_count() > 0) d.push_back(Device::cuda(0));
  return d;
}

Vec random_values(std::size_t n, std::uint64_t seed, float lo = -1.f, float hi = 1.f) {
  const Tensor t = test::random_tensor({static_cast<std::int64_t>(n)}, DType::f32, kCpu, seed, lo, hi);
  return Vec(t.data_as<float>(), t.data_as<float>() + n);
}

Tensor make(const Vec& v, Dims shape, Device dev) {
  Tensor h = Tensor::empty(shape, DType::f32, kCpu);
  std::copy(v.begin(), v.end(), h.data_as<float>());
  return dev.is_cpu() ? std::move(h) : h.copy_to(dev);
}

Tensor out(Dims shape, Device dev) {
  Tensor t = Tensor::empty(shape, DType::f32, dev);
  test::poison(t);
  return t;
}

::testing::AssertionResult matches(const TensorView& got, const Vec& want) {
  return test::all_close(got, make(want, got.shape(), kCpu), kNotebook);
}

// ---------------------------------------------------------------------------------------------
// Puzzles 1 and 2: constant add, z_i = 10 + x_i (N0 = 32; N0 = 200)
// ---------------------------------------------------------------------------------------------

Vec add_spec(const Vec& x) {
  Vec z(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) z[i] = x[i] + 10.f;
  return z;
}

void constant_add(std::int64_t n0, std::uint64_t seed) {
  const Vec x = random_values(static_cast<std::size_t>(n0), seed);
  for (Device dev : devices()) {
    SCOPED_TRACE(dev.str() + " N0=" + std::to_string(n0));
    const Tensor xt = make(x, {n0}, dev), ten = make({10.f}, {1}, dev), z = out({n0}, dev);
    broadcast_binary(BinaryOp::add, xt, ten, z);
    EXPECT_TRUE(matches(z, add_spec(x)));
  }
}

TEST(Puzzles, P01_ConstantAdd_N32) { constant_add(32, 101); }
TEST(Puzzles, P02_ConstantAddBlock_N200) { constant_add(200, 102); }
TEST(Puzzles, P02_ConstantAddBlock_RandomLarger) {
  for (std::int64_t n : {1, 7, 1000, 65537}) constant_add(n, 103 + static_cast<std::uint64_t>(n));
}

// ---------------------------------------------------------------------------------------------
// Puzzles 3, 4 and 5: outer ops z[i, j] = f(x[j], y[i]), x [N0], y [N1], z [N1, N0]
// ---------------------------------------------------------------------------------------------

template <class F>
Vec outer_spec(const Vec& x, const Vec& y, F f) {
  Vec z(x.size() * y.size());
  for (std::size_t i = 0; i < y.size(); ++i)
    for (std::size_t j = 0; j < x.size(); ++j) z[i * x.size() + j] = f(x[j], y[i]);
  return z;
}

float add(float a, float b) { return a + b; }
float mul_relu(float a, float b) { return std::max(a * b, 0.f); }  // torch.relu(x[None, :] * y[:, None])

void outer_puzzle(BinaryOp op, std::int64_t n0, std::int64_t n1, std::uint64_t seed) {
  const Vec x = random_values(static_cast<std::size_t>(n0), seed), y = random_values(static_cast<std::size_t>(n1), seed + 1);
  const Vec want = op == BinaryOp::add ? outer_spec(x, y, add) : outer_spec(x, y, mul_relu);
  for (Device dev : devices()) {
    SCOPED_TRACE(dev.str() + " N0=" + std::to_string(n0) + " N1=" + std::to_string(n1));
    const Tensor xt = make(x, {n0}, dev), yt = make(y, {n1}, dev), z = out({n1, n0}, dev);
    outer(op, xt, yt, z);
    EXPECT_TRUE(matches(z, want));
    // The same through broadcast_binary: x as a row [1, N0], y as a column [N1, 1].
    const Tensor z2 = out({n1, n0}, dev);
    broadcast_binary(op, xt.view().reshape({1, n0}), yt.view().reshape({n1, 1}), z2);
    EXPECT_TRUE(matches(z2, want));
  }
}

TEST(Puzzles, P03_OuterVectorAdd_32x32) { outer_puzzle(BinaryOp::add, 32, 32, 301); }
TEST(Puzzles, P04_OuterVectorAddBlock_100x90) { outer_puzzle(BinaryOp::add, 100, 90, 401); }
TEST(Puzzles, P05_FusedOuterMulRelu_100x90) { outer_puzzle(BinaryOp::mul_relu, 100, 90, 501); }
TEST(Puzzles, P03_05_RandomLarger) {
  for (BinaryOp op : {BinaryOp::add, BinaryOp::mul_relu}) {
    outer_puzzle(op, 1, 1, 511);
    outer_puzzle(op, 1000, 3, 512);
    outer_puzzle(op, 257, 511, 513);
    outer_puzzle(op, 1024, 96, 514);  // 16-byte accesses along x
  }
}

// ---------------------------------------------------------------------------------------------
// Puzzle 6: backward of z = relu(x * y[:, None]), x [N1, N0] = [90, 100], y [N1]:
// dx[i, j] = dz[i, j] * y[i] if x[i, j] * y[i] > 0 else 0 (torch's relu gradient at 0 is 0)
// ---------------------------------------------------------------------------------------------

Vec mul_relu_back_spec(const Vec& x, const Vec& y, const Vec& dz, std::size_t n0) {
  Vec dx(x.size());
  for (std::size_t i = 0; i < y.size(); ++i)
    for (std::size_t j = 0; j < n0; ++j) {
      const std::size_t k = i * n0 + j;
      dx[k] = x[k] * y[i] > 0.f ? dz[k] * y[i] : 0.f;
    }
  return dx;
}

void mul_relu_backward_puzzle(std::int64_t n0, std::int64_t n1, std::uint64_t seed) {
  const auto nz = static_cast<std::size_t>(n0 * n1);
  const Vec x = random_values(nz, seed), y = random_values(static_cast<std::size_t>(n1), seed + 1);
  const Vec dz = random_values(nz, seed + 2);
  const Vec want = mul_relu_back_spec(x, y, dz, static_cast<std::size_t>(n0));
  for (Device dev : devices()) {
    SCOPED_TRACE(dev.str() + " N0=" + std::to_string(n0) + " N1=" + std::to_string(n1));
    const Tensor xt = make(x, {n1, n0}, dev), yt = make(y, {n1, 1}, dev), dzt = make(dz, {n1, n0}, dev);
    const Tensor dx = out({n1, n0}, dev);
    broadcast_binary_backward(BinaryOp::mul_relu, xt, yt, dzt, dx.view(), std::nullopt);
    EXPECT_TRUE(matches(dx, want));
  }
}

TEST(Puzzles, P06_FusedOuterMulReluBackward_90x100) { mul_relu_backward_puzzle(100, 90, 601); }
TEST(Puzzles, P06_RandomLarger) {
  mul_relu_backward_puzzle(1, 1, 611);
  mul_relu_backward_puzzle(333, 17, 612);
  mul_relu_backward_puzzle(2048, 64, 613);
}

// ---------------------------------------------------------------------------------------------
// Puzzle 7: long sum, z_i = sum_j x[i, j], x [4, 200]
// ---------------------------------------------------------------------------------------------

Vec sum_spec(const Vec& x, std::size_t t) {
  Vec z(x.size() / t, 0.f);
  for (std::size_t i = 0; i < z.size(); ++i) {
    double acc = 0;  // the notebook's torch sum is fp32 with pairwise blocks; double is the truth
    for (std::size_t j = 0; j < t; ++j) acc += x[i * t + j];
    z[i] = static_cast<float>(acc);
  }
  return z;
}

void long_sum(std::int64_t n0, std::int64_t t, std::uint64_t seed) {
  const Vec x = random_values(static_cast<std::size_t>(n0 * t), seed);
  const Vec want = sum_spec(x, static_cast<std::size_t>(t));
  for (Device dev : devices()) {
    SCOPED_TRACE(dev.str() + " N0=" + std::to_string(n0) + " T=" + std::to_string(t));
    const Tensor xt = make(x, {n0, t}, dev), z = out({n0}, dev);
    row_sum(xt, z);
    EXPECT_TRUE(matches(z, want));
  }
}

TEST(Puzzles, P07_LongSum_4x200) { long_sum(4, 200, 701); }
TEST(Puzzles, P07_RandomLarger) {
  long_sum(1, 1, 711);
  long_sum(37, 1001, 712);
  long_sum(3, 100003, 713);  // split across CTAs
}

// ---------------------------------------------------------------------------------------------
// Puzzle 8: long softmax over rows of x [4, 200], numerically stable
// ---------------------------------------------------------------------------------------------

Vec softmax_spec(const Vec& x, std::size_t t) {
  Vec z(x.size());
  for (std::size_t i = 0; i < x.size() / t; ++i) {
    const float* row = x.data() + i * t;
    const float m = *std::max_element(row, row + t);
    double denom = 0;
    for (std::size_t j = 0; j < t; ++j) denom += std::exp(double(row[j]) - m);
    for (std::size_t j = 0; j < t; ++j) z[i * t + j] = static_cast<float>(std::exp(double(row[j]) - m) / denom);
  }
  return z;
}

void long_softmax(std::int64_t n0, std::int64_t t, std::uint64_t seed, float scale) {
  const Vec x = random_values(static_cast<std::size_t>(n0 * t), seed, -scale, scale);
  const Vec want = softmax_spec(x, static_cast<std::size_t>(t));
  for (Device dev : devices()) {
    SCOPED_TRACE(dev.str() + " N0=" + std::to_string(n0) + " T=" + std::to_string(t));
    const Tensor xt = make(x, {n0, t}, dev), z = out({n0, t}, dev);
    softmax(xt, z);
    EXPECT_TRUE(matches(z, want));
  }
}

TEST(Puzzles, P08_LongSoftmax_4x200) { long_softmax(4, 200, 801, 1.f); }
TEST(Puzzles, P08_RandomLarger) {
  long_softmax(1, 1, 811, 1.f);
  long_softmax(9, 333, 812, 30.f);
  long_softmax(2, 40001, 813, 5.f);  // split across CTAs
}

// ---------------------------------------------------------------------------------------------
// Puzzle 10: batched single-channel 2-D correlation, x [4, 8, 8], k [4, 4], zero padding at the
// bottom and right: z[n, i, j] = sum_{a, b} k[a, b] * x[n, i + a, j + b]
// ---------------------------------------------------------------------------------------------

Vec conv2d_spec(const Vec& x, const Vec& k, std::size_t n, std::size_t h, std::size_t w, std::size_t kh,
                std::size_t kw) {
  Vec z(n * h * w, 0.f);
  for (std::size_t b = 0; b < n; ++b)
    for (std::size_t i = 0; i < h; ++i)
      for (std::size_t j = 0; j < w; ++j) {
        double acc = 0;
        for (std::size_t a = 0; a < kh; ++a)
          for (std::size_t c = 0; c < kw; ++c)
            if (i + a < h && j + c < w) acc += double(k[a * kw + c]) * x[(b * h + i + a) * w + j + c];
        z[(b * h + i) * w + j] = static_cast<float>(acc);
      }
  return z;
}

void conv_puzzle(std::int64_t n, std::int64_t h, std::int64_t w, std::int64_t kh, std::int64_t kw, std::uint64_t seed) {
  const Vec x = random_values(static_cast<std::size_t>(n * h * w), seed), k = random_values(static_cast<std::size_t>(kh * kw), seed + 1);
  const Vec want = conv2d_spec(x, k, static_cast<std::size_t>(n), static_cast<std::size_t>(h), static_cast<std::size_t>(w),
                               static_cast<std::size_t>(kh), static_cast<std::size_t>(kw));
  for (Device dev : devices()) {
    SCOPED_TRACE(dev.str() + " " + std::to_string(n) + "x" + std::to_string(h) + "x" + std::to_string(w));
    const Tensor xt = make(x, {n, 1, h, w}, dev), kt = make(k, {1, 1, kh, kw}, dev), z = out({n, 1, h, w}, dev);
    conv2d(xt, kt, z, Conv2dPadding::same_end);
    EXPECT_TRUE(matches(z, want));
  }
}

TEST(Puzzles, P10_Conv2d_4x8x8_Kernel4x4) { conv_puzzle(4, 8, 8, 4, 4, 1001); }
TEST(Puzzles, P10_RandomLarger) {
  conv_puzzle(1, 1, 1, 1, 1, 1011);
  conv_puzzle(3, 37, 21, 5, 3, 1012);
  conv_puzzle(2, 64, 70, 7, 7, 1013);
}

// ---------------------------------------------------------------------------------------------
// Puzzle 11: batched matmul, z[b] = x[b] @ y[b], x, y [4, 32, 32]
// ---------------------------------------------------------------------------------------------

Vec dot_spec(const Vec& x, const Vec& y, std::size_t batch, std::size_t m, std::size_t k, std::size_t n) {
  Vec z(batch * m * n);
  for (std::size_t b = 0; b < batch; ++b)
    for (std::size_t i = 0; i < m; ++i)
      for (std::size_t j = 0; j < n; ++j) {
        double acc = 0;
        for (std::size_t l = 0; l < k; ++l) acc += double(x[(b * m + i) * k + l]) * y[(b * k + l) * n + j];
        z[(b * m + i) * n + j] = static_cast<float>(acc);
      }
  return z;
}

void matmul_puzzle(std::int64_t batch, std::int64_t m, std::int64_t k, std::int64_t n, std::uint64_t seed) {
  const Vec x = random_values(static_cast<std::size_t>(batch * m * k), seed);
  const Vec y = random_values(static_cast<std::size_t>(batch * k * n), seed + 1);
  const Vec want = dot_spec(x, y, static_cast<std::size_t>(batch), static_cast<std::size_t>(m), static_cast<std::size_t>(k),
                            static_cast<std::size_t>(n));
  for (Device dev : devices()) {
    SCOPED_TRACE(dev.str() + " " + std::to_string(batch) + "x" + std::to_string(m) + "x" + std::to_string(k) + "x" +
                 std::to_string(n));
    const Tensor xt = make(x, {batch, m, k}, dev), yt = make(y, {batch, k, n}, dev), z = out({batch, m, n}, dev);
    batched_matmul(xt, yt, z);  // f32 operands: cuBLAS, fp32 arithmetic (no TF32)
    EXPECT_TRUE(matches(z, want));
  }
}

TEST(Puzzles, P11_BatchedMatmul_4x32x32) { matmul_puzzle(4, 32, 32, 32, 1101); }
TEST(Puzzles, P11_RandomLarger) {
  matmul_puzzle(1, 1, 1, 1, 1111);
  matmul_puzzle(3, 77, 45, 133, 1112);
}

// The CuTe kernel takes bf16 operands: the puzzle's shape with the inputs rounded to bf16 first
// (the spec then sees the same values), fp32 out.
TEST(Puzzles, P11_BatchedMatmul_4x32x32_CuteKernel) {
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  Tensor x = test::random_tensor({4, 32, 32}, DType::bf16, gpu, 1121), y = test::random_tensor({4, 32, 32}, DType::bf16, gpu, 1122);
  const std::vector<double> xd = test::to_doubles(x), yd = test::to_doubles(y);
  const Vec want = dot_spec(Vec(xd.begin(), xd.end()), Vec(yd.begin(), yd.end()), 4, 32, 32, 32);
  const Tensor z = out({4, 32, 32}, gpu);
  batched_matmul(x, y, z, BatchedMatmulImpl::cute);
  EXPECT_TRUE(matches(z, want));
}

}  // namespace
}  // namespace fk
