// Tests of the broadcast binary ops (broadcast_binary, outer, broadcast_binary_backward): the
// spec against hand-worked values, the CUDA kernels against the spec over broadcast patterns and
// dtypes (tails of the 16-byte path, scalars, both operands broadcast, rank 4, misaligned data),
// aliasing, and every bad input.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "fusekit/fusekit.hpp"
#include "test_util.hpp"

namespace fk {
namespace {

const Device kCpu = Device::cpu();

using test::host_tensor;

Tensor cpu_f32(Dims shape) {
  Tensor t = Tensor::empty(shape, DType::f32, kCpu);
  test::poison(t);
  return t;
}

// ---------------------------------------------------------------------------------------------
// The spec against hand-worked values
// ---------------------------------------------------------------------------------------------

TEST(BroadcastBinarySpec, OuterAddMulRelu) {
  // x = [1, -2, 3] (a row), y = [10, -1] (a column): z[i, j] = f(x[j], y[i]).
  const Tensor x = host_tensor({3}, DType::f32, {1, -2, 3}), y = host_tensor({2}, DType::f32, {10, -1});
  Tensor z = cpu_f32({2, 3});
  outer(BinaryOp::add, x, y, z);
  EXPECT_EQ(test::to_doubles(z), (std::vector<double>{11, 8, 13, 0, -3, 2}));
  outer(BinaryOp::mul, x, y, z);
  EXPECT_EQ(test::to_doubles(z), (std::vector<double>{10, -20, 30, -1, 2, -3}));
  outer(BinaryOp::mul_relu, x, y, z);
  EXPECT_EQ(test::to_doubles(z), (std::vector<double>{10, 0, 30, 0, 2, 0}));
}

TEST(BroadcastBinarySpec, ScalarAndMiddleDimension) {
  const Tensor x = host_tensor({2, 1, 2}, DType::f32, {1, 2, 3, 4}), y = host_tensor({3, 1}, DType::f32, {0, 10, 20});
  Tensor z = cpu_f32({2, 3, 2});
  broadcast_binary(BinaryOp::add, x, y, z);  // z[a, b, c] = x[a, 0, c] + y[b, 0]
  EXPECT_EQ(test::to_doubles(z), (std::vector<double>{1, 2, 11, 12, 21, 22, 3, 4, 13, 14, 23, 24}));
  const Tensor ten = host_tensor({1}, DType::f32, {10});
  Tensor w = cpu_f32({2, 1, 2});
  broadcast_binary(BinaryOp::add, x, ten, w);
  EXPECT_EQ(test::to_doubles(w), (std::vector<double>{11, 12, 13, 14}));
}

TEST(BroadcastBinarySpec, ReluPropagatesNaN) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const Tensor x = host_tensor({2}, DType::f32, {nan, -1}), y = host_tensor({1}, DType::f32, {2});
  Tensor z = cpu_f32({2});
  broadcast_binary(BinaryOp::mul_relu, x, y, z);
  const std::vector<double> got = test::to_doubles(z);
  EXPECT_TRUE(std::isnan(got[0]));
  EXPECT_EQ(got[1], 0.0);
}

TEST(BroadcastBinarySpec, BackwardReducesOverBroadcastDimensions) {
  // z = relu(x[j] * y[i]) with x = [1, -2, 3], y = [2, -1], dz = [[1, 1, 1], [10, 20, 30]].
  // Positive products: (i=0: j=0, j=2), (i=1: j=1).
  // dx[j] = sum_i dz[i, j] * y[i] * [x_j y_i > 0] = [1*2, 20*-1, 1*2] = [2, -20, 2]
  // dy[i] = sum_j dz[i, j] * x[j] * [..]        = [1*1 + 1*3, 20*-2] = [4, -40]
  const Tensor x = host_tensor({1, 3}, DType::f32, {1, -2, 3}), y = host_tensor({2, 1}, DType::f32, {2, -1});
  const Tensor dz = host_tensor({2, 3}, DType::f32, {1, 1, 1, 10, 20, 30});
  Tensor dx = cpu_f32({1, 3}), dy = cpu_f32({2, 1});
  broadcast_binary_backward(BinaryOp::mul_relu, x, y, dz, dx.view(), dy.view());
  EXPECT_EQ(test::to_doubles(dx), (std::vector<double>{2, -20, 2}));
  EXPECT_EQ(test::to_doubles(dy), (std::vector<double>{4, -40}));
  broadcast_binary_backward(BinaryOp::mul, x, y, dz, dx.view(), dy.view());
  EXPECT_EQ(test::to_doubles(dx), (std::vector<double>{2 - 10, 2 - 20, 2 - 30}));
  EXPECT_EQ(test::to_doubles(dy), (std::vector<double>{1 - 2 + 3, 10 - 40 + 90}));
  broadcast_binary_backward(BinaryOp::add, x, y, dz, dx.view(), std::nullopt);
  EXPECT_EQ(test::to_doubles(dx), (std::vector<double>{11, 21, 31}));
}

// ---------------------------------------------------------------------------------------------
// Bad inputs
// ---------------------------------------------------------------------------------------------

TEST(BroadcastBinaryErrors, EachBadInputNamesItsArgument) {
  auto f32 = [](Dims s) { return Tensor::empty(s, DType::f32, kCpu); };
  const std::string op = "broadcast_binary";
  Tensor x = f32({3, 4}), y = f32({4}), z = f32({3, 4});
  // shapes that do not broadcast, z not the broadcast shape
  test::expect_arg_error([&] { broadcast_binary(BinaryOp::add, x, f32({3}), z); }, op, "y");
  test::expect_arg_error([&] { broadcast_binary(BinaryOp::add, x, y, f32({2, 3, 4})); }, op, "z");
  test::expect_arg_error([&] { broadcast_binary(BinaryOp::add, x, y, f32({3, 1})); }, op, "z");
  // dtypes
  test::expect_arg_error([&] { broadcast_binary(BinaryOp::add, Tensor::empty({3, 4}, DType::i32, kCpu), y, z); }, op, "x");
  test::expect_arg_error([&] { broadcast_binary(BinaryOp::add, x, Tensor::empty({4}, DType::bf16, kCpu), z); }, op, "y");
  test::expect_arg_error([&] { broadcast_binary(BinaryOp::add, x, y, Tensor::empty({3, 4}, DType::f16, kCpu)); }, op, "z");
  // layout and aliasing: strided x, null data, z overlapping y partly
  const TensorView strided(x.data(), DType::f32, {3, 2}, {4, 2}, kCpu);
  test::expect_arg_error([&] { broadcast_binary(BinaryOp::add, strided, f32({2}), f32({3, 2})); }, op, "x");
  test::expect_arg_error([&] { broadcast_binary(BinaryOp::add, TensorView(nullptr, DType::f32, {4}, kCpu), y, f32({4})); }, op, "x");
  const TensorView shifted(static_cast<float*>(x.data()) + 1, DType::f32, {2, 4}, kCpu);
  test::expect_arg_error([&] { broadcast_binary(BinaryOp::add, x.view().slice_rows(0, 2), f32({4}), shifted); }, op, "z");
  // devices
  void* nowhere = reinterpret_cast<void*>(std::uintptr_t{256});
  test::expect_arg_error([&] { broadcast_binary(BinaryOp::add, x, TensorView(nowhere, DType::f32, {4}, Device::cuda(0)), z); },
                         op, "y");
  // outer: ranks and z's shape
  test::expect_arg_error([&] { outer(BinaryOp::add, x, y, z); }, "outer", "x");
  test::expect_arg_error([&] { outer(BinaryOp::add, y, f32({3}), f32({4, 3})); }, "outer", "z");
}

TEST(BroadcastBinaryErrors, BackwardArguments) {
  auto f32 = [](Dims s) { return Tensor::empty(s, DType::f32, kCpu); };
  const std::string op = "broadcast_binary_backward";
  Tensor x = f32({3, 4}), y = f32({3, 1}), dz = f32({3, 4}), dx = f32({3, 4}), dy = f32({3, 1});
  test::expect_arg_error([&] { broadcast_binary_backward(BinaryOp::mul, x, y, f32({3, 5}), dx.view(), dy.view()); }, op, "dz");
  test::expect_arg_error([&] { broadcast_binary_backward(BinaryOp::mul, x, y, dz, f32({3, 1}).view(), dy.view()); }, op, "dx");
  test::expect_arg_error([&] { broadcast_binary_backward(BinaryOp::mul, x, y, dz, dx.view(), f32({3, 4}).view()); }, op, "dy");
  test::expect_arg_error([&] { broadcast_binary_backward(BinaryOp::mul, x, y, dz, dz.view(), dy.view()); }, op, "dx");
  test::expect_arg_error(
      [&] { broadcast_binary_backward(BinaryOp::mul, x, y, dz, Tensor::empty({3, 4}, DType::bf16, kCpu).view(), std::nullopt); },
      op, "dx");
}

// ---------------------------------------------------------------------------------------------
// CUDA against the spec
// ---------------------------------------------------------------------------------------------

struct BroadcastCase {
  std::vector<std::int64_t> x, y;  // shapes; z is their broadcast
};

Dims dims(const std::vector<std::int64_t>& v) { return Dims(std::span<const std::int64_t>(v)); }

Dims broadcast_of(const std::vector<std::int64_t>& a, const std::vector<std::int64_t>& b) {
  const std::size_t r = std::max(a.size(), b.size());
  std::vector<std::int64_t> z(r);
  for (std::size_t i = 0; i < r; ++i) {
    const std::int64_t p = i + a.size() >= r ? a[i + a.size() - r] : 1, q = i + b.size() >= r ? b[i + b.size() - r] : 1;
    z[i] = p == 1 ? q : p;
  }
  return dims(z);
}

const BroadcastCase kCases[] = {
    {{200}, {1}},                 // puzzle 2: a constant
    {{1, 100}, {90, 1}},          // puzzles 4-5: outer
    {{90, 100}, {90, 1}},         // puzzle 6: matrix times a column
    {{1024, 64}, {1024, 64}},     // plain elementwise, 16-byte path
    {{1027, 13}, {13}},           // a row vector, odd widths
    {{7, 1, 5, 8}, {3, 1, 1}},    // rank 4, both operands broadcast
    {{1}, {1}},
    {{0, 5}, {5}},                // empty
    {{3, 4, 5}, {3, 4, 5}},
    {{2, 1, 16}, {1, 9, 16}},     // both broadcast along different dimensions, 16-byte rows
};

class BroadcastBinaryGpu : public ::testing::TestWithParam<std::tuple<int, DType, BinaryOp>> {};

TEST_P(BroadcastBinaryGpu, ForwardAndBackwardMatchSpec) {
  FK_SKIP_WITHOUT_GPU();
  const auto [index, dtype, op] = GetParam();
  const BroadcastCase& c = kCases[index];
  const Device gpu = Device::cuda(0);
  const Dims zs = broadcast_of(c.x, c.y);
  const auto seed = static_cast<std::uint64_t>(index * 97 + static_cast<int>(op) * 7 + static_cast<int>(dtype));
  const Tensor x = test::random_tensor(dims(c.x), dtype, gpu, seed), y = test::random_tensor(dims(c.y), dtype, gpu, seed + 1);
  const Tensor dz = test::random_tensor(zs, dtype, gpu, seed + 2);
  const Tensor hx = test::to_host(x), hy = test::to_host(y), hdz = test::to_host(dz);

  // Forward: one fp32 operation rounded once, the same in both: equal bits.
  Tensor z = Tensor::empty(zs, dtype, gpu), want = Tensor::empty(zs, dtype, kCpu);
  test::poison(z);
  broadcast_binary(op, x, y, z);
  broadcast_binary(op, hx, hy, want);
  EXPECT_TRUE(test::all_close(z, want, {0.0, 0.0}));

  // Backward: sums over up to `terms` products of values in [-1, 1), fp32 against double: each
  // addition rounds by at most 2^-24 of a partial sum no larger than `terms`, so terms^2 * 2^-24
  // bounds the difference, plus the dtype's rounding of the result.
  Tensor dx = Tensor::empty(dims(c.x), dtype, gpu), dy = Tensor::empty(dims(c.y), dtype, gpu);
  Tensor wdx = Tensor::empty(dims(c.x), dtype, kCpu), wdy = Tensor::empty(dims(c.y), dtype, kCpu);
  test::poison(dx);
  test::poison(dy);
  broadcast_binary_backward(op, x, y, dz, dx.view(), dy.view());
  broadcast_binary_backward(op, hx, hy, hdz, wdx.view(), wdy.view());
  const test::Tolerance t = test::tolerance_for(dtype);
  const auto tol = [&](const Tensor& g) {
    const double terms = g.numel() ? static_cast<double>(zs.numel()) / static_cast<double>(g.numel()) : 1.0;
    return test::Tolerance{t.atol * std::max(1.0, terms) + terms * terms * 0x1p-24, t.rtol};
  };
  EXPECT_TRUE(test::all_close(dx, wdx, tol(dx)));
  EXPECT_TRUE(test::all_close(dy, wdy, tol(dy)));
}

INSTANTIATE_TEST_SUITE_P(
    Cases, BroadcastBinaryGpu,
    ::testing::Combine(::testing::Range(0, static_cast<int>(std::size(kCases))),
                       ::testing::Values(DType::f32, DType::bf16, DType::f16),
                       ::testing::Values(BinaryOp::add, BinaryOp::mul, BinaryOp::mul_relu)),
    [](const auto& info) {
      return "case" + std::to_string(std::get<0>(info.param)) + "_" + std::string(dtype_name(std::get<1>(info.param))) + "_" +
             std::string(binary_op_name(std::get<2>(info.param)));
    });

TEST(BroadcastBinaryGpu, InPlaceAndMisaligned) {
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  // z = x in place, x + column vector
  Tensor x = test::random_tensor({33, 64}, DType::bf16, gpu, 5), y = test::random_tensor({33, 1}, DType::bf16, gpu, 6);
  Tensor want = Tensor::empty({33, 64}, DType::bf16, kCpu);
  broadcast_binary(BinaryOp::mul_relu, test::to_host(x), test::to_host(y), want);
  broadcast_binary(BinaryOp::mul_relu, x, y, x);
  EXPECT_TRUE(test::all_close(x, want, {0.0, 0.0}));
  // operands 2 bytes past a 16-byte boundary: the element path
  Tensor buf = test::random_tensor({1 + 40 * 64}, DType::f16, gpu, 7);
  const TensorView a(static_cast<std::uint16_t*>(buf.data()) + 1, DType::f16, {40, 64}, gpu);
  Tensor b = test::random_tensor({64}, DType::f16, gpu, 8), z = Tensor::empty({40, 64}, DType::f16, gpu);
  Tensor want2 = Tensor::empty({40, 64}, DType::f16, kCpu);
  broadcast_binary(BinaryOp::add, test::to_host(a), test::to_host(b), want2);
  broadcast_binary(BinaryOp::add, a, b, z);
  EXPECT_TRUE(test::all_close(z, want2, {0.0, 0.0}));
}

}  // namespace
}  // namespace fk
