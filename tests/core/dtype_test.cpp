#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "fusekit/core/dtype.hpp"
#include "fusekit/core/error.hpp"

namespace fk {
namespace {

TEST(DType, SizesAndNames) {
  EXPECT_EQ(dtype_size(DType::f32), 4u);
  EXPECT_EQ(dtype_size(DType::bf16), 2u);
  EXPECT_EQ(dtype_size(DType::f16), 2u);
  EXPECT_EQ(dtype_size(DType::i8), 1u);
  EXPECT_EQ(dtype_size(DType::u8), 1u);
  EXPECT_EQ(dtype_size(DType::i32), 4u);
  EXPECT_EQ(dtype_size(DType::i64), 8u);
  for (DType t : {DType::f32, DType::f16, DType::bf16, DType::i8, DType::u8, DType::i32, DType::i64})
    EXPECT_EQ(parse_dtype(dtype_name(t)), t);
  EXPECT_THROW(parse_dtype("float8"), Error);
}

TEST(DType, Bf16RoundsToNearestEven) {
  EXPECT_EQ(bf16(1.0f).bits, 0x3f80);
  EXPECT_EQ(bf16(-2.0f).bits, 0xc000);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1).
  EXPECT_EQ(bf16(1.0f + 0x1p-8f).bits, 0x3f80);
  // 1 + 3*2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties to even (1 + 2^-6).
  EXPECT_EQ(bf16(1.0f + 3 * 0x1p-8f).bits, 0x3f82);
  EXPECT_EQ(bf16(1.0f + 0x1p-8f + 0x1p-20f).bits, 0x3f81);
  EXPECT_TRUE(std::isnan(static_cast<float>(bf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(static_cast<float>(bf16(3.140625f)), 3.140625f);
}

TEST(DType, F16RoundTripsAndRounds) {
  EXPECT_EQ(f16(1.0f).bits, 0x3c00);
  EXPECT_EQ(f16(-2.0f).bits, 0xc000);
  EXPECT_EQ(f16(65504.0f).bits, 0x7bff);
  EXPECT_EQ(f16(65520.0f).bits, 0x7c00);          // rounds to infinity
  EXPECT_EQ(f16(0x1p-24f).bits, 0x0001);          // smallest subnormal
  EXPECT_EQ(f16(0x1p-25f).bits, 0x0000);          // tie to even: zero
  EXPECT_EQ(f16(3 * 0x1p-25f).bits, 0x0002);      // 1.5 steps: tie to even (2)
  EXPECT_EQ(f16(1.0f + 0x1p-11f).bits, 0x3c00);   // tie to even
  EXPECT_EQ(f16(1.0f + 3 * 0x1p-11f).bits, 0x3c02);
  EXPECT_EQ(f16(0x1p-14f).bits, 0x0400);          // smallest normal
  EXPECT_TRUE(std::isnan(static_cast<float>(f16(std::numeric_limits<float>::quiet_NaN()))));
  // Every finite half round-trips exactly.
  for (std::uint32_t b = 0; b < 0x10000; ++b) {
    f16 h;
    h.bits = static_cast<std::uint16_t>(b);
    const float f = static_cast<float>(h);
    if (std::isnan(f)) continue;
    ASSERT_EQ(f16(f).bits, h.bits) << "bits " << b;
  }
}

}  // namespace
}  // namespace fk
