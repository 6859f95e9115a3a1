// Tests of the quant family's memory-bound ops (pack, unpack, ReLU with a bit mask): the spec
// against hand-worked packs, properties of the format on random data, stochastic rounding's
// unbiasedness, the CUDA kernels bit-exact against the spec, and every bad input.
// weight_grad_from_packed has its own file, quant_weight_grad_test.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>

#include "fusekit/fusekit.hpp"
#include "test_util.hpp"

namespace fk {
namespace {

const Device kCpu = Device::cpu();

Tensor host_f32(std::vector<float> v, Dims shape) {
  Tensor t = Tensor::empty(shape, DType::f32, kCpu);
  std::memcpy(t.data(), v.data(), v.size() * 4);
  return t;
}

std::vector<std::uint32_t> words_of(const PackedTensor& p) {
  const Tensor h = test::to_host(p.words);
  const auto* w = h.data_as<std::uint32_t>();
  return std::vector<std::uint32_t>(w, w + h.numel());
}

// ---------------------------------------------------------------------------------------------
// Hand-worked packs
// ---------------------------------------------------------------------------------------------

TEST(QuantSpec, TwoBitsByHandWithTiesToEven) {
  // min -3, max 3: scale 6 / 3 = 2 exactly; level = (x + 3) / 2, ties to even (1.5 -> 2, 2.5 -> 2).
  Tensor x = host_f32({-3, -1, 1, 3, 3, 1, -1, -3, 0, 2, -2, -3, -3, -3, -3, 3}, {1, 16});
  const PackedTensor p = pack(x, {.bits = 2, .group = 16, .stats_dtype = DType::f32});
  EXPECT_EQ(words_of(p), std::vector<std::uint32_t>{0xc00a1be4u});  // levels 0,1,2,3,3,2,1,0,2,2,0,0,0,0,0,3
  EXPECT_EQ(test::to_doubles(p.scale), std::vector<double>{2.0});
  EXPECT_EQ(test::to_doubles(p.min), std::vector<double>{-3.0});
  const std::vector<double> back = test::to_doubles(unpack(p.view(), DType::f32));
  EXPECT_EQ(back, (std::vector<double>{-3, -1, 1, 3, 3, 1, -1, -3, 1, 1, -3, -3, -3, -3, -3, 3}));
}

TEST(QuantSpec, OneBitPositionsAndATailGroupWithMaxEqualMin) {
  // Group 32 at 1 bit: bit j of the word is value j. Row of 40: the second group holds 8 values,
  // all 5: max == min, so scale is 1, every level 0, the padding bits stay 0.
  std::vector<float> v = {0, 1, 1, 0};
  v.resize(32, 1.0f);
  v.resize(40, 5.0f);
  const PackedTensor p = pack(host_f32(v, {1, 40}), {.bits = 1, .group = 32, .stats_dtype = DType::f32});
  EXPECT_EQ(p.words.shape(), (Dims{1, 2, 1}));
  EXPECT_EQ(words_of(p), (std::vector<std::uint32_t>{0xfffffff6u, 0u}));
  EXPECT_EQ(test::to_doubles(p.scale), (std::vector<double>{1.0, 1.0}));
  EXPECT_EQ(test::to_doubles(p.min), (std::vector<double>{0.0, 5.0}));
  std::vector<double> want(v.begin(), v.end());
  EXPECT_EQ(test::to_doubles(unpack(p.view(), DType::f32)), want);
}

TEST(QuantSpec, EightBitsTwoWordsPerEightValuesAndNegativeRange) {
  // min -255, max 0 at 8 bits: scale 1, level = x + 255.
  std::vector<float> v(8);
  for (int i = 0; i < 8; ++i) v[i] = -255.0f + 36.0f * i;  // -255, -219, ..., -3
  v[7] = 0.0f;
  const PackedTensor p = pack(host_f32(v, {1, 8}), {.bits = 8, .group = 8, .stats_dtype = DType::f32});
  EXPECT_EQ(words_of(p), (std::vector<std::uint32_t>{0x6c482400u, 0xffd8b490u}));  // levels 0,36,72,108 | 144,180,216,255
}

TEST(QuantSpec, Bf16StatisticsCoverTheRange) {
  // 100.3 .. 100.4 cannot be bounded by bf16 values nearer than 0.5 apart: the minimum rounds down
  // to 100 and the scale up so that min + 3 * scale >= max; every value stays within scale / 2.
  Tensor x = host_f32({100.3f, 100.35f, 100.4f, 100.33f, 100.3f, 100.31f, 100.32f, 100.39f,
                       100.3f, 100.35f, 100.4f, 100.33f, 100.3f, 100.31f, 100.32f, 100.39f}, {1, 16});
  const PackedTensor p = pack(x, {.bits = 2, .group = 16, .stats_dtype = DType::bf16});
  const double scale = test::to_doubles(p.scale)[0], mn = test::to_doubles(p.min)[0];
  EXPECT_EQ(mn, 100.0);
  EXPECT_GE(mn + 3 * scale, 100.4f);
  const auto back = test::to_doubles(unpack(p.view(), DType::f32));
  const auto orig = test::to_doubles(x);
  for (int i = 0; i < 16; ++i) EXPECT_LE(std::fabs(back[i] - orig[i]), scale * (0.5 + 0x1p-22 * 255) + 1e-5) << i;
}

TEST(QuantSpec, NonFiniteValuesPoisonTheirGroupOnly) {
  std::vector<float> v(64, 0.5f);
  v[3] = std::numeric_limits<float>::quiet_NaN();
  v[40] = std::numeric_limits<float>::infinity();
  std::vector<float> w(32, 0.25f);
  v.insert(v.end(), w.begin(), w.end());  // a third, finite group
  const PackedTensor p = pack(host_f32(v, {1, 96}), {.bits = 4, .group = 32});
  const auto back = test::to_doubles(unpack(p.view(), DType::f32));
  for (int i = 0; i < 64; ++i) EXPECT_TRUE(std::isnan(back[i])) << i;
  for (int i = 64; i < 96; ++i) EXPECT_EQ(back[i], 0.25) << i;
}

// ---------------------------------------------------------------------------------------------
// Properties on random data (spec)
// ---------------------------------------------------------------------------------------------

using FormatCase = std::tuple<int, int, DType>;  // bits, group, stats dtype

class QuantFormat : public ::testing::TestWithParam<FormatCase> {};

TEST_P(QuantFormat, NearestKeepsEveryValueWithinHalfAScale) {
  const auto [bits, group, stats] = GetParam();
  const std::int64_t rows = 7, cols = 3 * group + 5;  // a partial last group
  Tensor x = test::random_tensor({rows, cols}, DType::f32, kCpu, 11, -4, 6);
  const PackedTensor p = pack(x, {.bits = bits, .group = group, .stats_dtype = stats});
  const auto back = test::to_doubles(unpack(p.view(), DType::f32));
  const auto orig = test::to_doubles(x), scale = test::to_doubles(p.scale);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) {
      const double s = scale[static_cast<std::size_t>(r * p.view().groups() + c / group)];
      // scale / 2 (plus 2^-22 * 255 scale where a value sits on a tie: quant_math.hpp), plus the
      // fp32 rounding of the fma that dequantizes.
      ASSERT_LE(std::fabs(back[r * cols + c] - orig[r * cols + c]),
                s * (0.5 + 0x1p-22 * 255) + 1e-6 * std::fabs(orig[r * cols + c]))
          << "row " << r << " col " << c;
    }
}

TEST_P(QuantFormat, StochasticRoundingIsUnbiasedAndReproducible) {
  const auto [bits, group, stats] = GetParam();
  const std::int64_t cols = group;
  Tensor x = test::random_tensor({1, cols}, DType::f32, kCpu, 12, -1, 1);
  const int draws = 4000;
  std::vector<double> mean(static_cast<std::size_t>(cols), 0.0);
  double scale = 0;
  for (int d = 0; d < draws; ++d) {
    const PackedTensor p = pack(x, {.bits = bits, .group = group, .rounding = Rounding::stochastic,
                                    .seed = 5, .offset = static_cast<std::uint64_t>(d), .stats_dtype = stats});
    scale = test::to_doubles(p.scale)[0];
    const auto back = test::to_doubles(unpack(p.view(), DType::f32));
    for (std::int64_t c = 0; c < cols; ++c) mean[c] += back[c] / draws;
  }
  // Each draw lands on one of the two levels around x: the mean's standard deviation is at most
  // scale / (2 sqrt(draws)). 6 sigma per element; and the average |bias| over the row must be
  // under 1 sigma, which a biased rounding (e.g. nearest: scale / 4 on average) fails by far.
  const double sigma = scale / (2 * std::sqrt(double(draws)));
  const auto orig = test::to_doubles(x);
  double total = 0;
  for (std::int64_t c = 0; c < cols; ++c) {
    EXPECT_LE(std::fabs(mean[c] - orig[c]), 6 * sigma) << "col " << c;
    total += std::fabs(mean[c] - orig[c]) / cols;
  }
  EXPECT_LE(total, sigma);

  const PackParams sp{.bits = bits, .group = group, .rounding = Rounding::stochastic, .seed = 9, .offset = 1,
                      .stats_dtype = stats};
  EXPECT_EQ(words_of(pack(x, sp)), words_of(pack(x, sp)));
}

// The offset counter is read when the pack runs: a pack given a counter holding c is the pack at
// offset + c, and advancing the counter moves the next pack to the next offset.
TEST(QuantSpec, OffsetCounterAddsItsValueWhenThePackRuns) {
  Tensor x = test::random_tensor({3, 70}, DType::f32, kCpu, 31, -2, 2);
  Tensor counter = Tensor::empty({1}, DType::i64, kCpu);
  *counter.data_as<std::int64_t>() = 40;
  const PackParams with{.bits = 4, .group = 32, .rounding = Rounding::stochastic, .seed = 8, .offset = 2,
                        .offset_counter = counter};
  PackParams plain = with;
  plain.offset_counter = TensorView();
  plain.offset = 42;
  EXPECT_EQ(words_of(pack(x, with)), words_of(pack(x, plain)));
  advance_offset(counter, 1);
  EXPECT_EQ(*counter.data_as<std::int64_t>(), 41);
  plain.offset = 43;
  EXPECT_EQ(words_of(pack(x, with)), words_of(pack(x, plain)));
  plain.offset = 42;
  EXPECT_NE(words_of(pack(x, with)), words_of(pack(x, plain)));
}

INSTANTIATE_TEST_SUITE_P(Formats, QuantFormat,
                         ::testing::Values(FormatCase{1, 32, DType::bf16}, FormatCase{2, 256, DType::bf16},
                                           FormatCase{2, 16, DType::f32}, FormatCase{4, 48, DType::bf16},
                                           FormatCase{4, 256, DType::f32}, FormatCase{8, 256, DType::bf16},
                                           FormatCase{8, 4, DType::f32}),
                         [](const auto& info) {
                           return "b" + std::to_string(std::get<0>(info.param)) + "_g" +
                                  std::to_string(std::get<1>(info.param)) + "_" +
                                  std::string(dtype_name(std::get<2>(info.param)));
                         });

TEST(QuantSpec, TheUnbiasednessCriterionRejectsNearestRounding) {
  // The statistic of StochasticRoundingIsUnbiasedAndReproducible, applied to nearest rounding:
  // the average |bias| is about scale / 4, far above the bound (here scale / 126).
  Tensor x = test::random_tensor({1, 256}, DType::f32, kCpu, 12, -1, 1);
  const PackedTensor p = pack(x, {.bits = 2, .group = 256, .stats_dtype = DType::f32});
  const double scale = test::to_doubles(p.scale)[0];
  const auto back = test::to_doubles(unpack(p.view(), DType::f32)), orig = test::to_doubles(x);
  double total = 0;
  for (int c = 0; c < 256; ++c) total += std::fabs(back[c] - orig[c]) / 256;
  EXPECT_GT(total, scale / (2 * std::sqrt(4000.0)));
}

TEST(QuantSpec, ReluMaskByHand) {
  Tensor x = host_f32({-1, 2, 0, 3, std::numeric_limits<float>::quiet_NaN(), -0.5f, 7, 1, 1, 1, 1, 1, 1, 1, 1, 1,
                       1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, -2, 4},
                      {34});
  Tensor y = Tensor::empty({34}, DType::f32, kCpu), mask = Tensor::empty({2}, DType::i32, kCpu);
  relu_forward_packed(x, y, mask);
  const auto m = test::to_doubles(mask);
  EXPECT_EQ(static_cast<std::uint32_t>(static_cast<std::int64_t>(m[0])), 0xffffffcau);  // bits 1, 3, 6, 7..31
  EXPECT_EQ(m[1], 2.0);                                                                  // element 33
  const auto yv = test::to_doubles(y);
  EXPECT_EQ(yv[0], 0.0);
  EXPECT_EQ(yv[1], 2.0);
  EXPECT_TRUE(std::isnan(yv[4]));
  Tensor dy = test::random_tensor({34}, DType::f32, kCpu, 3), dx = Tensor::empty({34}, DType::f32, kCpu);
  relu_backward_packed(dy, mask, dx);
  const auto g = test::to_doubles(dy), d = test::to_doubles(dx);
  for (int i = 0; i < 34; ++i) EXPECT_EQ(d[i], (i == 1 || i == 3 || (i >= 6 && i <= 31) || i == 33) ? g[i] : 0.0) << i;
}

// ---------------------------------------------------------------------------------------------
// Bad inputs
// ---------------------------------------------------------------------------------------------

TEST(QuantErrors, EachBadInputNamesItsArgument) {
  Tensor x = Tensor::empty({4, 64}, DType::f32, kCpu);
  test::expect_arg_error([&] { pack(x, {.bits = 3}); }, "pack", "bits");
  test::expect_arg_error([&] { pack(x, {.bits = 2, .group = 24}); }, "pack", "group");
  test::expect_arg_error([&] { pack(x, {.bits = 2, .stats_dtype = DType::f16}); }, "pack", "stats_dtype");
  Tensor xi = Tensor::empty({4, 64}, DType::i32, kCpu);
  const PackedTensor p = PackedTensor::empty(4, 64, DType::f32, {.bits = 2, .group = 32}, kCpu);
  test::expect_arg_error([&] { pack(xi, p.view(), {.bits = 2, .group = 32}); }, "pack", "x");
  test::expect_arg_error([&] { pack(x, p.view(), {.bits = 4, .group = 32}); }, "pack", "out");
  Tensor x5 = Tensor::empty({5, 64}, DType::f32, kCpu);
  test::expect_arg_error([&] { pack(x5, p.view(), {.bits = 2, .group = 32}); }, "pack", "out");
  Tensor counter32 = Tensor::empty({1}, DType::i32, kCpu), counter2 = Tensor::empty({2}, DType::i64, kCpu);
  test::expect_arg_error([&] { pack(x, p.view(), {.bits = 2, .group = 32, .offset_counter = counter32}); }, "pack",
                         "offset_counter");
  test::expect_arg_error([&] { pack(x, p.view(), {.bits = 2, .group = 32, .offset_counter = counter2}); }, "pack",
                         "offset_counter");
  test::expect_arg_error([&] { advance_offset(counter32, 1); }, "advance_offset", "counter");
  Tensor out_bad = Tensor::empty({4, 63}, DType::f32, kCpu);
  test::expect_arg_error([&] { unpack(p.view(), out_bad); }, "unpack", "out");
  PackedView broken = p.view();
  broken.words = broken.words.reshape({4, 4});
  test::expect_arg_error([&] { unpack(broken, DType::f32); }, "unpack", "packed.words");

  Tensor y = Tensor::empty({4, 64}, DType::f32, kCpu), mask7 = Tensor::empty({7}, DType::i32, kCpu);
  test::expect_arg_error([&] { relu_forward_packed(x, y, mask7); }, "relu_forward_packed", "mask");
  Tensor yb = Tensor::empty({4, 64}, DType::bf16, kCpu), mask8 = Tensor::empty({8}, DType::i32, kCpu);
  test::expect_arg_error([&] { relu_forward_packed(x, yb, mask8); }, "relu_forward_packed", "y");
  test::expect_arg_error([&] { relu_backward_packed(x, mask7, y); }, "relu_backward_packed", "mask");

  Tensor dy = Tensor::empty({5, 16}, DType::bf16, kCpu), dw = Tensor::empty({16, 64}, DType::f32, kCpu);
  test::expect_arg_error([&] { weight_grad_from_packed(dy, p.view(), dw); }, "weight_grad_from_packed", "dy");
  Tensor dy4 = Tensor::empty({4, 16}, DType::bf16, kCpu), dw_bad = Tensor::empty({16, 60}, DType::f32, kCpu);
  test::expect_arg_error([&] { weight_grad_from_packed(dy4, p.view(), dw_bad); }, "weight_grad_from_packed", "dw");
  Tensor dw_i = Tensor::empty({16, 64}, DType::i32, kCpu);
  test::expect_arg_error([&] { weight_grad_from_packed(dy4, p.view(), dw_i); }, "weight_grad_from_packed", "dw");
  test::expect_arg_error([&] { weight_grad_from_packed(dy4, p.view(), dw, {.beta = 0.5f}); },
                         "weight_grad_from_packed", "beta");
  // dw may not alias its inputs (issue 27 item 11): here it is laid over dy's bytes.
  Tensor big = Tensor::empty({16, 64}, DType::f32, kCpu);
  const TensorView dy_in_big(big.data(), DType::bf16, {4, 16}, kCpu);
  test::expect_arg_error([&] { weight_grad_from_packed(dy_in_big, p.view(), big); }, "weight_grad_from_packed", "dw");
}

// ---------------------------------------------------------------------------------------------
// CUDA against the spec: bit-exact
// ---------------------------------------------------------------------------------------------

struct PackGpuCase {
  int bits, group;
  DType x_dtype, stats;
  std::int64_t rows, cols;
};

class QuantPackGpu : public ::testing::TestWithParam<PackGpuCase> {};

// Bit-exact, except that any NaN matches any NaN: the host and the device write different NaN
// payloads (the device's conversions produce the canonical NaN).
void expect_same_bits(const TensorView& a, const TensorView& b, const char* what) {
  const Tensor ha = test::to_host(a), hb = test::to_host(b);
  ASSERT_EQ(ha.nbytes(), hb.nbytes());
  if (std::memcmp(ha.data(), hb.data(), ha.nbytes()) == 0) return;
  std::int64_t bad = 0, first = -1;
  visit_dtype(ha.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const T* x = ha.data_as<T>();
    const T* y = hb.data_as<T>();
    for (std::int64_t i = 0; i < ha.numel(); ++i) {
      bool same = std::memcmp(&x[i], &y[i], sizeof(T)) == 0;
      if constexpr (!std::is_integral_v<T>) {
        same |= std::isnan(static_cast<float>(x[i])) && std::isnan(static_cast<float>(y[i]));
      }
      if (!same && bad++ == 0) first = i;
    }
  });
  EXPECT_EQ(bad, 0) << what << " differ; first at flat index " << first;
}

TEST_P(QuantPackGpu, PackAndUnpackAreBitExact) {
  FK_SKIP_WITHOUT_GPU();
  const PackGpuCase c = GetParam();
  const Device gpu = Device::cuda(0);
  Tensor x = test::random_tensor({c.rows, c.cols}, c.x_dtype, kCpu, 21, -3, 5);
  if (c.rows * c.cols > 3) {  // a non-finite group must be poisoned identically
    Tensor nan_host = Tensor::empty({1}, c.x_dtype, kCpu);
    fill(nan_host, std::numeric_limits<double>::quiet_NaN());
    std::memcpy(static_cast<char*>(x.data()) + 3 * dtype_size(c.x_dtype), nan_host.data(), dtype_size(c.x_dtype));
  }
  Tensor xd = x.copy_to(gpu);
  for (Rounding rounding : {Rounding::nearest, Rounding::stochastic}) {
    const PackParams p{.bits = c.bits, .group = c.group, .rounding = rounding, .seed = 77, .offset = 3,
                       .stats_dtype = c.stats};
    const PackedTensor want = pack(x, p);
    PackedTensor got = PackedTensor::empty(c.rows, c.cols, c.x_dtype, p, gpu);
    test::poison(got.scale);
    test::poison(got.min);
    fill(got.words, -1.0);
    pack(xd, got.view(), p);
    expect_same_bits(got.words, want.words, "words");
    expect_same_bits(got.scale, want.scale, "scales");
    expect_same_bits(got.min, want.min, "minimums");
    for (DType out : {DType::bf16, DType::f32}) {
      Tensor u = Tensor::empty({c.rows, c.cols}, out, gpu);
      test::poison(u);
      unpack(got.view(), u);
      expect_same_bits(u, unpack(want.view(), out), "unpacked values");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, QuantPackGpu,
    ::testing::Values(PackGpuCase{2, 256, DType::bf16, DType::bf16, 1, 1}, PackGpuCase{2, 256, DType::bf16, DType::bf16, 3, 1000},
                      PackGpuCase{1, 256, DType::bf16, DType::bf16, 64, 768}, PackGpuCase{4, 256, DType::f32, DType::f32, 17, 256},
                      PackGpuCase{8, 256, DType::f16, DType::bf16, 33, 777}, PackGpuCase{8, 128, DType::bf16, DType::f32, 9, 130},
                      PackGpuCase{4, 48, DType::bf16, DType::bf16, 5, 100}, PackGpuCase{2, 1024, DType::f32, DType::bf16, 4, 2050},
                      PackGpuCase{1, 32, DType::bf16, DType::bf16, 100, 33}, PackGpuCase{2, 256, DType::bf16, DType::bf16, 1024, 4096},
                      // Rows without padding (cols a multiple of group) at every width, and groups
                      // whose words per group are not powers of two.
                      PackGpuCase{8, 64, DType::f16, DType::bf16, 7, 320}, PackGpuCase{2, 96, DType::bf16, DType::f32, 13, 288},
                      PackGpuCase{1, 160, DType::bf16, DType::bf16, 5, 480}, PackGpuCase{4, 40, DType::bf16, DType::bf16, 3, 120}),
    [](const auto& info) {
      const PackGpuCase c = info.param;
      return "b" + std::to_string(c.bits) + "_g" + std::to_string(c.group) + "_" + std::string(dtype_name(c.x_dtype)) +
             "_" + std::string(dtype_name(c.stats)) + "_" + std::to_string(c.rows) + "x" + std::to_string(c.cols);
    });

// A pack with an offset counter, captured in a CUDA graph with the counter's advance: each replay
// packs at the next offset, bit-exact with the spec packing at that offset.
TEST(QuantPackGpuGraph, ReplaysDrawAtTheCounterOfEachReplay) {
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  const Stream stream = Stream::create(gpu);
  const Tensor x = test::random_tensor({33, 200}, DType::f32, kCpu, 5, -3, 3);
  const Tensor xd = x.copy_to(gpu);
  Tensor counter = Tensor::empty({1}, DType::i64, gpu);
  zero_async(counter, stream);
  const PackParams p{.bits = 2, .group = 64, .rounding = Rounding::stochastic, .seed = 3, .offset = 100,
                     .offset_counter = counter};
  PackedTensor got = PackedTensor::empty(33, 200, DType::f32, p, gpu, &stream);
  const Graph graph = Graph::capture(stream, [&] {
    pack(xd, got.view(), p, &stream);
    advance_offset(counter, 1, &stream);
  });
  for (std::uint64_t replay = 0; replay < 3; ++replay) {
    graph.launch(stream);
    stream.synchronize();
    PackParams at = p;
    at.offset_counter = TensorView();
    at.offset = 100 + replay;
    EXPECT_EQ(words_of(got), words_of(pack(x, at))) << "replay " << replay;
  }
}

class QuantReluGpu : public ::testing::TestWithParam<std::tuple<DType, std::int64_t>> {};

TEST_P(QuantReluGpu, ForwardAndBackwardAreExact) {
  FK_SKIP_WITHOUT_GPU();
  const auto [dt, n] = GetParam();
  const Device gpu = Device::cuda(0);
  Tensor x = test::random_tensor({n}, dt, kCpu, 31), dy = test::random_tensor({n}, dt, kCpu, 32);
  Tensor y = Tensor::empty({n}, dt, kCpu), mask = Tensor::empty({relu_mask_words(n)}, DType::i32, kCpu);
  Tensor dx = Tensor::empty({n}, dt, kCpu);
  relu_forward_packed(x, y, mask);
  relu_backward_packed(dy, mask, dx);
  for (bool in_place : {false, true}) {
    Tensor xd = x.copy_to(gpu), dyd = dy.copy_to(gpu);
    Tensor yd = Tensor::empty({n}, dt, gpu), md = Tensor::empty({relu_mask_words(n)}, DType::i32, gpu);
    Tensor dxd = Tensor::empty({n}, dt, gpu);
    test::poison(yd);
    test::poison(dxd);
    fill(md, -1.0);
    const TensorView y_out = in_place ? xd.view() : yd.view(), dx_out = in_place ? dyd.view() : dxd.view();
    relu_forward_packed(xd, y_out, md);
    relu_backward_packed(dyd, md, dx_out);
    expect_same_bits(y_out, y, "y");
    expect_same_bits(md, mask, "mask");
    expect_same_bits(dx_out, dx, "dx");
  }
}

INSTANTIATE_TEST_SUITE_P(Sizes, QuantReluGpu,
                         ::testing::Combine(::testing::Values(DType::f32, DType::bf16, DType::f16),
                                            ::testing::Values(1, 7, 31, 33, 256, 1000, 4099, 65536 * 3 + 5)),
                         [](const auto& info) {
                           return std::string(dtype_name(std::get<0>(info.param))) + "_" +
                                  std::to_string(std::get<1>(info.param));
                         });

}  // namespace
}  // namespace fk
