// Tests of the row ops row_sum and softmax: the spec against hand-worked values, the CUDA
// kernels against the spec over row lengths that take every path (one row per warp, per block,
// split across CTAs; 16-byte and element accesses; tails; length-1 rows; a million elements),
// large magnitudes (softmax of values near +-1e4), in-place softmax, and every bad input.
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

// ---------------------------------------------------------------------------------------------
// The spec against hand-worked values
// ---------------------------------------------------------------------------------------------

TEST(RowSumSpec, HandWorked) {
  const Tensor x = host_tensor({2, 3}, DType::f32, {1, 2, 3, 4, 5, -6});
  Tensor out = Tensor::empty({2}, DType::f32, kCpu);
  row_sum(x, out);
  EXPECT_EQ(test::to_doubles(out), (std::vector<double>{6, 3}));
  Tensor none = Tensor::empty({3}, DType::f32, kCpu);
  test::poison(none);
  row_sum(TensorView(nullptr, DType::f32, {3, 0}, kCpu), none);  // a sum over nothing is 0
  EXPECT_EQ(test::to_doubles(none), (std::vector<double>{0, 0, 0}));
}

TEST(SoftmaxSpec, HandWorked) {
  // [0, ln 3] -> [1/4, 3/4]; [5, 5] -> [1/2, 1/2]; shifted by 1e4 the same (f32 holds 1e4 + ln 3
  // to within 2^-10, so 1e-3).
  const float ln3 = std::log(3.0f);
  const Tensor x = host_tensor({3, 2}, DType::f32, {0, ln3, 5, 5, 1e4f, 1e4f + ln3});
  Tensor y = Tensor::empty({3, 2}, DType::f32, kCpu);
  softmax(x, y);
  const std::vector<double> got = test::to_doubles(y);
  const std::vector<double> want{0.25, 0.75, 0.5, 0.5, 0.25, 0.75};
  for (std::size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], i < 4 ? 1e-7 : 1e-3) << i;
}

TEST(SoftmaxSpec, RowOfMinusInfinityIsNaN) {
  const float inf = std::numeric_limits<float>::infinity();
  const Tensor x = host_tensor({2, 2}, DType::f32, {-inf, -inf, -inf, 0});
  Tensor y = Tensor::empty({2, 2}, DType::f32, kCpu);
  softmax(x, y);
  const std::vector<double> got = test::to_doubles(y);
  EXPECT_TRUE(std::isnan(got[0]) && std::isnan(got[1]));
  EXPECT_EQ(got[2], 0.0);
  EXPECT_EQ(got[3], 1.0);
}

// ---------------------------------------------------------------------------------------------
// Bad inputs
// ---------------------------------------------------------------------------------------------

TEST(RowOpsErrors, EachBadInputNamesItsArgument) {
  auto t = [](Dims s, DType d = DType::f32) { return Tensor::empty(s, d, kCpu); };
  Tensor x = t({4, 8});
  test::expect_arg_error([&] { row_sum(t({32}), t({4})); }, "row_sum", "x");
  test::expect_arg_error([&] { row_sum(t({4, 8}, DType::i32), t({4})); }, "row_sum", "x");
  test::expect_arg_error([&] { row_sum(x, t({8})); }, "row_sum", "out");
  test::expect_arg_error([&] { row_sum(x, t({4}, DType::bf16)); }, "row_sum", "out");  // f32 in: f32 out
  test::expect_arg_error([&] { row_sum(t({4, 8}, DType::bf16), t({4}, DType::f16)); }, "row_sum", "out");
  test::expect_arg_error([&] { row_sum(x, TensorView(x.data(), DType::f32, {4}, kCpu)); }, "row_sum", "out");
  const TensorView strided(x.data(), DType::f32, {4, 4}, {8, 2}, kCpu);
  test::expect_arg_error([&] { row_sum(strided, t({4})); }, "row_sum", "x");

  test::expect_arg_error([&] { softmax(t({2, 2, 8}), t({2, 2, 8})); }, "softmax", "x");
  test::expect_arg_error([&] { softmax(x, t({4, 9})); }, "softmax", "y");
  test::expect_arg_error([&] { softmax(x, t({4, 8}, DType::bf16)); }, "softmax", "y");
  test::expect_arg_error([&] { softmax(t({4, 8}, DType::u8), t({4, 8}, DType::u8)); }, "softmax", "x");
  const TensorView shifted(static_cast<float*>(x.data()) + 8, DType::f32, {3, 8}, kCpu);
  test::expect_arg_error([&] { softmax(x.view().slice_rows(0, 3), shifted); }, "softmax", "y");
  test::expect_arg_error([&] { softmax(TensorView(nullptr, DType::f32, {2, 2}, kCpu), t({2, 2})); }, "softmax", "x");
  void* nowhere = reinterpret_cast<void*>(std::uintptr_t{256});
  test::expect_arg_error([&] { softmax(x, TensorView(nowhere, DType::f32, {4, 8}, Device::cuda(0))); }, "softmax", "y");
}

// ---------------------------------------------------------------------------------------------
// CUDA against the spec
// ---------------------------------------------------------------------------------------------

struct RowCase {
  std::int64_t rows, cols;
};

// Every path: a warp per row (<= 1024), a block per row held in registers (<= 32768), split
// rows (> 32768); widths that allow 16-byte accesses and odd ones; 1-element rows; a million.
const RowCase kRowCases[] = {
    {1, 1},     {5, 1},     {4, 200},    {3, 7},      {1000, 33},   {17, 1024}, {9, 1025},
    {6, 4096},  {2, 8191},  {3, 32768},  {2, 32767},  {2, 32776},   {130, 40000},
    {3, 1 << 20}, {1, 1000003},
};

std::string row_case_name(const RowCase& c) { return std::to_string(c.rows) + "x" + std::to_string(c.cols); }

// Row sums of values in [-1, 1): each fp32 addition rounds by at most 2^-24 of a running sum, and
// running sums of n random signs stay within a few sqrt(n) (3 sqrt(n) / sqrt(3) for uniform
// values); the errors of n additions add like a random walk: about 2^-24 * sqrt(n) * 3 sqrt(n).
// n * 2^-20 is five times that, plus the rounding to out's dtype.
test::Tolerance sum_tolerance(DType out, std::int64_t cols) {
  const test::Tolerance t = test::tolerance_for(out);
  return {t.atol + static_cast<double>(cols) * 0x1p-20, t.rtol};
}

// Softmax outputs against the spec: exp2 of the hardware (about 2^-22 relative), x - max rounded
// in fp32 (2^-24 * |x - max| in the exponent; outputs that do not underflow have |x - max| < 104,
// so 6e-6 relative), and the sum of positive terms (relative error below 2^-20 for these
// reduction trees): 2^-16 covers all, plus one rounding to the dtype. atol: the dtype's smallest
// subnormal (f16 outputs of long rows are subnormal), or 1e-37 for f32 / bf16.
test::Tolerance softmax_tolerance(DType t) {
  const double unit = t == DType::bf16 ? 0x1p-8 : t == DType::f16 ? 0x1p-11 : 0x1p-24;
  return {t == DType::f16 ? 0x1p-24 : 1e-37, 0x1p-16 + 2 * unit};
}

class RowOpsGpu : public ::testing::TestWithParam<std::tuple<int, DType>> {};

TEST_P(RowOpsGpu, RowSumMatchesSpec) {
  FK_SKIP_WITHOUT_GPU();
  const auto [index, dtype] = GetParam();
  const RowCase c = kRowCases[index];
  const Device gpu = Device::cuda(0);
  const Tensor x = test::random_tensor({c.rows, c.cols}, dtype, gpu, static_cast<std::uint64_t>(index) * 31 + 1);
  const Tensor hx = test::to_host(x);
  for (DType out_dtype : {DType::f32, dtype}) {
    Tensor out = Tensor::empty({c.rows}, out_dtype, gpu), want = Tensor::empty({c.rows}, out_dtype, kCpu);
    test::poison(out);
    row_sum(x, out);
    row_sum(hx, want);
    EXPECT_TRUE(test::all_close(out, want, sum_tolerance(out_dtype, c.cols))) << dtype_name(out_dtype) << " out";
    // The same bits on a second run (fixed summation order).
    Tensor again = Tensor::empty({c.rows}, out_dtype, gpu);
    row_sum(x, again);
    EXPECT_TRUE(test::all_close(again, out, {0.0, 0.0}));
  }
}

TEST_P(RowOpsGpu, SoftmaxMatchesSpec) {
  FK_SKIP_WITHOUT_GPU();
  const auto [index, dtype] = GetParam();
  const RowCase c = kRowCases[index];
  const Device gpu = Device::cuda(0);
  const Tensor x = test::random_tensor({c.rows, c.cols}, dtype, gpu, static_cast<std::uint64_t>(index) * 31 + 2, -8, 8);
  Tensor y = Tensor::empty({c.rows, c.cols}, dtype, gpu), want = Tensor::empty({c.rows, c.cols}, dtype, kCpu);
  test::poison(y);
  softmax(x, y);
  softmax(test::to_host(x), want);
  EXPECT_TRUE(test::all_close(y, want, softmax_tolerance(dtype)));
}

INSTANTIATE_TEST_SUITE_P(Shapes, RowOpsGpu,
                         ::testing::Combine(::testing::Range(0, static_cast<int>(std::size(kRowCases))),
                                            ::testing::Values(DType::f32, DType::bf16, DType::f16)),
                         [](const auto& info) {
                           return row_case_name(kRowCases[std::get<0>(info.param)]) + "_" +
                                  std::string(dtype_name(std::get<1>(info.param)));
                         });

TEST(RowOpsGpuExact, RowSumOfAMillionOnes) {
  // Integers below 2^24 are exact in fp32 whatever the order: 2^20 ones sum to 2^20 exactly.
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  Tensor x = Tensor::empty({3, 1 << 20}, DType::bf16, gpu);
  fill(x, 1.0);
  Tensor out = Tensor::empty({3}, DType::f32, gpu);
  row_sum(x, out);
  EXPECT_EQ(test::to_doubles(out), (std::vector<double>(3, 1 << 20)));
}

TEST(RowOpsGpuExact, SoftmaxOfLargeMagnitudes) {
  // Values near +1e4 and near -1e4 (exp would overflow / underflow without the max shift): the
  // outputs are finite, each row sums to 1, and they match the spec.
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  for (std::int64_t cols : {200, 5000, 100000}) {
    for (float center : {1e4f, -1e4f}) {
      SCOPED_TRACE(std::to_string(cols) + " around " + std::to_string(center));
      const Tensor x = test::random_tensor({3, cols}, DType::f32, gpu, static_cast<std::uint64_t>(cols), center - 10, center + 10);
      Tensor y = Tensor::empty({3, cols}, DType::f32, gpu), want = Tensor::empty({3, cols}, DType::f32, kCpu);
      softmax(x, y);
      softmax(test::to_host(x), want);
      EXPECT_TRUE(test::all_close(y, want, softmax_tolerance(DType::f32)));
      const std::vector<double> got = test::to_doubles(y);
      for (std::int64_t r = 0; r < 3; ++r) {
        double sum = 0;
        for (std::int64_t i = 0; i < cols; ++i) {
          ASSERT_TRUE(std::isfinite(got[static_cast<std::size_t>(r * cols + i)]));
          sum += got[static_cast<std::size_t>(r * cols + i)];
        }
        EXPECT_NEAR(sum, 1.0, 1e-4);
      }
    }
  }
}

TEST(RowOpsGpuExact, SoftmaxMinusInfinity) {
  // A row of -inf gives NaN (as the spec); -inf entries beside finite ones give exactly 0, also
  // when a whole thread's or CTA's share of the row is -inf.
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  for (std::int64_t cols : {64, 4096, 100000}) {
    std::vector<float> v(static_cast<std::size_t>(2 * cols), -std::numeric_limits<float>::infinity());
    v[static_cast<std::size_t>(cols + cols - 1)] = 3.0f;  // row 1: one finite value at the end
    const Tensor hx = host_tensor({2, cols}, DType::f32, v);
    Tensor y = Tensor::empty({2, cols}, DType::f32, gpu);
    softmax(hx.copy_to(gpu), y);
    const std::vector<double> got = test::to_doubles(y);
    for (std::int64_t i = 0; i < cols; ++i) ASSERT_TRUE(std::isnan(got[static_cast<std::size_t>(i)])) << cols;
    for (std::int64_t i = 0; i + 1 < cols; ++i) ASSERT_EQ(got[static_cast<std::size_t>(cols + i)], 0.0) << cols;
    EXPECT_EQ(got[static_cast<std::size_t>(2 * cols - 1)], 1.0);
  }
}

TEST(RowOpsGpuExact, SoftmaxInPlaceAndMisaligned) {
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  for (std::int64_t cols : {1000, 50000}) {
    Tensor x = test::random_tensor({3, cols}, DType::bf16, gpu, 77, -4, 4);
    Tensor want = Tensor::empty({3, cols}, DType::bf16, kCpu);
    softmax(test::to_host(x), want);
    softmax(x, x);
    EXPECT_TRUE(test::all_close(x, want, softmax_tolerance(DType::bf16))) << cols;
    // 2 bytes past a 16-byte boundary: element accesses
    Tensor buf = test::random_tensor({1 + 3 * cols}, DType::bf16, gpu, 78, -4, 4);
    const TensorView a(static_cast<std::uint16_t*>(buf.data()) + 1, DType::bf16, {3, cols}, gpu);
    Tensor y = Tensor::empty({3, cols}, DType::bf16, gpu), want2 = Tensor::empty({3, cols}, DType::bf16, kCpu);
    softmax(a, y);
    softmax(test::to_host(a), want2);
    EXPECT_TRUE(test::all_close(y, want2, softmax_tolerance(DType::bf16))) << cols;
    Tensor s = Tensor::empty({3}, DType::f32, gpu), ws = Tensor::empty({3}, DType::f32, kCpu);
    row_sum(a, s);
    row_sum(test::to_host(a), ws);
    EXPECT_TRUE(test::all_close(s, ws, sum_tolerance(DType::f32, cols))) << cols;
  }
}

}  // namespace
}  // namespace fk
