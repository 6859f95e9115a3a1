#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "fusekit/core/philox.hpp"
#include "fusekit/fusekit.hpp"
#include "test_util.hpp"

namespace fk {
namespace {

// Known-answer vectors of Philox4x32-10 published with Random123 (kat_vectors).
TEST(Philox, KnownAnswers) {
  struct Kat {
    philox::U32x4 ctr;
    std::uint32_t k0, k1;
    philox::U32x4 out;
  };
  const Kat kats[] = {
      {{{0, 0, 0, 0}}, 0, 0, {{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}}},
      {{{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}}, 0xffffffffu, 0xffffffffu,
       {{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}}},
      {{{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}}, 0xa4093822u, 0x299f31d0u,
       {{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}}},
  };
  for (const Kat& k : kats) {
    const philox::U32x4 got = philox::philox4x32_10(k.ctr, k.k0, k.k1);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(got.v[i], k.out.v[i]) << "word " << i;
  }
}

TEST(Random, UniformIsInRangeAndReproducible) {
  Tensor a = Tensor::empty({1001}, DType::f32, Device::cpu()), b = Tensor::empty({1001}, DType::f32, Device::cpu());
  fill_uniform(a, -2.f, 3.f, {42, 0});
  fill_uniform(b, -2.f, 3.f, {42, 0});
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.nbytes()), 0);
  double mean = 0;
  for (double v : test::to_doubles(a)) {
    ASSERT_GE(v, -2.0);
    ASSERT_LT(v, 3.0);
    mean += v / 1001;
  }
  EXPECT_NEAR(mean, 0.5, 0.15);  // 5 sigma of the mean of 1001 uniforms on a width-5 range
  fill_uniform(b, -2.f, 3.f, {42, 1});
  EXPECT_NE(std::memcmp(a.data(), b.data(), a.nbytes()), 0);
}

TEST(Random, NormalMoments) {
  Tensor a = Tensor::empty({100000}, DType::f32, Device::cpu());
  fill_normal(a, 1.f, 2.f, {3, 0});
  double m = 0, v = 0;
  const auto xs = test::to_doubles(a);
  for (double x : xs) m += x / xs.size();
  for (double x : xs) v += (x - m) * (x - m) / xs.size();
  EXPECT_NEAR(m, 1.0, 0.03);  // 5 sigma: 5 * 2 / sqrt(1e5)
  EXPECT_NEAR(std::sqrt(v), 2.0, 0.03);
}

TEST(Random, RejectsIntegerTensors) {
  Tensor a = Tensor::empty({4}, DType::i32, Device::cpu());
  EXPECT_THROW(fill_uniform(a, 0, 1, {}), Error);
}

class RandomOnGpu : public ::testing::TestWithParam<DType> {};

TEST_P(RandomOnGpu, SameNumbersAsTheCpu) {
  FK_SKIP_WITHOUT_GPU();
  const DType dt = GetParam();
  for (std::int64_t n : {1, 3, 4, 5, 1000, 65537}) {
    Tensor h = Tensor::empty({n}, dt, Device::cpu());
    Tensor d = Tensor::empty({n}, dt, Device::cuda(0));
    fill_uniform(h, -1.f, 4.f, {9, 2});
    fill_uniform(d, -1.f, 4.f, {9, 2});
    Tensor back = d.copy_to(Device::cpu());
    EXPECT_EQ(std::memcmp(back.data(), h.data(), h.nbytes()), 0) << "uniform, n = " << n;
    fill_normal(h, 0.f, 1.f, {9, 3});
    fill_normal(d, 0.f, 1.f, {9, 3});
    // log/sin/cos differ by an ulp or two between the host and device libraries.
    EXPECT_TRUE(test::all_close(d, h, {1e-5, test::tolerance_for(dt).rtol})) << "normal, n = " << n;
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, RandomOnGpu, ::testing::Values(DType::f32, DType::bf16, DType::f16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

}  // namespace
}  // namespace fk
