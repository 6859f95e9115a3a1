// Tests of conv2d: the spec against hand-worked values for each padding, the CUDA kernel against
// the spec over shapes (the puzzle's, multi-channel, even and odd kernels, kernel as large as the
// image, 1x1, output-channel counts that are not a multiple of the kernel's 4), and bad inputs.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "fusekit/fusekit.hpp"
#include "test_util.hpp"

namespace fk {
namespace {

const Device kCpu = Device::cpu();

Tensor host_f32(Dims shape, const std::vector<float>& values) {
  Tensor t = Tensor::empty(shape, DType::f32, kCpu);
  for (std::size_t i = 0; i < values.size(); ++i) t.data_as<float>()[i] = values[i];
  return t;
}

TEST(Conv2dSpec, HandWorkedPaddings) {
  // x = [[1, 2, 3], [4, 5, 6], [7, 8, 9]], k = [[1, 0], [0, -1]]: z[i, j] = x[i+a-t, j+b-l] terms
  // k[0,0] * x[i-t, j-l] - x[i+1-t, j+1-l].
  const Tensor x = host_f32({1, 1, 3, 3}, {1, 2, 3, 4, 5, 6, 7, 8, 9});
  const Tensor k = host_f32({1, 1, 2, 2}, {1, 0, 0, -1});
  Tensor valid = Tensor::empty({1, 1, 2, 2}, DType::f32, kCpu);
  conv2d(x, k, valid, Conv2dPadding::valid);
  EXPECT_EQ(test::to_doubles(valid), (std::vector<double>{-4, -4, -4, -4}));
  // same_end (the puzzle's): zeros after the image; z[2, j] and z[i, 2] lose the -x term.
  Tensor end = Tensor::empty({1, 1, 3, 3}, DType::f32, kCpu);
  conv2d(x, k, end, Conv2dPadding::same_end);
  EXPECT_EQ(test::to_doubles(end), (std::vector<double>{-4, -4, 3, -4, -4, 6, 7, 8, 9}));
  // same with a 2x2 kernel: (2-1)/2 = 0 rows before, so it equals same_end.
  Tensor same = Tensor::empty({1, 1, 3, 3}, DType::f32, kCpu);
  conv2d(x, k, same, Conv2dPadding::same);
  EXPECT_EQ(test::to_doubles(same), test::to_doubles(end));
  // same with a 3x3 kernel picking the centre's upper-left neighbour: one zero row/column before.
  const Tensor k3 = host_f32({1, 1, 3, 3}, {1, 0, 0, 0, 0, 0, 0, 0, 0});
  Tensor same3 = Tensor::empty({1, 1, 3, 3}, DType::f32, kCpu);
  conv2d(x, k3, same3, Conv2dPadding::same);
  EXPECT_EQ(test::to_doubles(same3), (std::vector<double>{0, 0, 0, 0, 1, 2, 0, 4, 5}));
}

TEST(Conv2dSpec, SumsOverChannels) {
  // Two input channels, 1x1 kernels [2, -1] for output 0 and [0, 1] for output 1.
  const Tensor x = host_f32({1, 2, 1, 2}, {1, 2, 10, 20});
  const Tensor w = host_f32({2, 2, 1, 1}, {2, -1, 0, 1});
  Tensor y = Tensor::empty({1, 2, 1, 2}, DType::f32, kCpu);
  conv2d(x, w, y, Conv2dPadding::valid);
  EXPECT_EQ(test::to_doubles(y), (std::vector<double>{-8, -16, 10, 20}));
}

TEST(Conv2dErrors, EachBadInputNamesItsArgument) {
  auto t = [](Dims s, DType d = DType::f32) { return Tensor::empty(s, d, kCpu); };
  Tensor x = t({2, 3, 8, 8}), w = t({4, 3, 3, 3}), y = t({2, 4, 8, 8});
  test::expect_arg_error([&] { conv2d(t({3, 8, 8}), w, y, Conv2dPadding::same); }, "conv2d", "x");
  test::expect_arg_error([&] { conv2d(x, t({4, 2, 3, 3}), y, Conv2dPadding::same); }, "conv2d", "w");
  test::expect_arg_error([&] { conv2d(x, t({4, 3, 0, 3}), y, Conv2dPadding::same); }, "conv2d", "w");
  test::expect_arg_error([&] { conv2d(x, t({4, 3, 9, 3}), t({2, 4, 0, 6}), Conv2dPadding::valid); }, "conv2d", "w");
  test::expect_arg_error([&] { conv2d(x, w, y, Conv2dPadding::valid); }, "conv2d", "y");  // wants [2, 4, 6, 6]
  test::expect_arg_error([&] { conv2d(x, t({4, 3, 3, 3}, DType::bf16), y, Conv2dPadding::same); }, "conv2d", "w");
  test::expect_arg_error([&] { conv2d(x, w, t({2, 4, 8, 8}, DType::f16), Conv2dPadding::same); }, "conv2d", "y");
  test::expect_arg_error([&] { conv2d(x, w, TensorView(x.data(), DType::f32, {2, 4, 8, 8}, kCpu), Conv2dPadding::same); },
                         "conv2d", "y");
}

struct ConvCase {
  std::int64_t n, c, h, w, o, kh, kw;
  Conv2dPadding padding;
};

const ConvCase kConvCases[] = {
    {4, 1, 8, 8, 1, 4, 4, Conv2dPadding::same_end},  // the puzzle
    {2, 3, 17, 23, 5, 3, 3, Conv2dPadding::same},
    {2, 3, 17, 23, 5, 3, 3, Conv2dPadding::valid},
    {3, 4, 9, 6, 6, 4, 2, Conv2dPadding::same},      // even kernel: more padding after
    {1, 2, 5, 7, 3, 1, 1, Conv2dPadding::valid},
    {1, 1, 1, 1, 1, 1, 1, Conv2dPadding::same},
    {2, 2, 7, 5, 2, 7, 5, Conv2dPadding::valid},     // kernel as large as the image: 1x1 out
    {1, 8, 40, 33, 9, 5, 5, Conv2dPadding::same_end},
};

class Conv2dGpu : public ::testing::TestWithParam<std::tuple<int, DType>> {};

TEST_P(Conv2dGpu, MatchesSpec) {
  FK_SKIP_WITHOUT_GPU();
  const auto [index, dtype] = GetParam();
  const ConvCase& c = kConvCases[index];
  const Device gpu = Device::cuda(0);
  const std::int64_t ho = c.padding == Conv2dPadding::valid ? c.h - c.kh + 1 : c.h;
  const std::int64_t wo = c.padding == Conv2dPadding::valid ? c.w - c.kw + 1 : c.w;
  const auto seed = static_cast<std::uint64_t>(index) * 13 + 3;
  const Tensor x = test::random_tensor({c.n, c.c, c.h, c.w}, dtype, gpu, seed);
  const Tensor w = test::random_tensor({c.o, c.c, c.kh, c.kw}, dtype, gpu, seed + 1);
  Tensor y = Tensor::empty({c.n, c.o, ho, wo}, dtype, gpu), want = Tensor::empty({c.n, c.o, ho, wo}, dtype, kCpu);
  test::poison(y);
  conv2d(x, w, y, c.padding);
  conv2d(test::to_host(x), test::to_host(w), want, c.padding);
  // fp32 sums of C*KH*KW products of values in [-1, 1) against double: at most 2^-24 of a
  // partial sum (below the number of terms) per addition; plus the dtype's rounding.
  const double terms = static_cast<double>(c.c * c.kh * c.kw);
  const test::Tolerance t = test::tolerance_for(dtype);
  EXPECT_TRUE(test::all_close(y, want, {t.atol + terms * terms * 0x1p-24, t.rtol}));
}

INSTANTIATE_TEST_SUITE_P(Shapes, Conv2dGpu,
                         ::testing::Combine(::testing::Range(0, static_cast<int>(std::size(kConvCases))),
                                            ::testing::Values(DType::f32, DType::bf16, DType::f16)),
                         [](const auto& info) {
                           const ConvCase& c = kConvCases[std::get<0>(info.param)];
                           return "N" + std::to_string(c.n) + "C" + std::to_string(c.c) + "H" + std::to_string(c.h) + "W" +
                                  std::to_string(c.w) + "O" + std::to_string(c.o) + "K" + std::to_string(c.kh) + "x" +
                                  std::to_string(c.kw) + "_" + std::string(conv2d_padding_name(c.padding)) + "_" +
                                  std::string(dtype_name(std::get<1>(info.param)));
                         });

}  // namespace
}  // namespace fk
