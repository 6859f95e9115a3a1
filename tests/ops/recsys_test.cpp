// Tests of the recsys family's spec and argument checks: the spec against small cases worked by
// hand (a 2-table, 3-sample batch; the dot interaction's pair order; one optimizer step on
// repeated rows; BCE), and every bad input. The CUDA kernels against the spec: recsys_gpu_test.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <tuple>
#include <vector>

#include "fusekit/fusekit.hpp"
#include "fusekit/ops/recsys.hpp"
#include "ops/common/stochastic_round.hpp"
#include "recsys_test_util.hpp"
#include "test_util.hpp"

namespace fk {
namespace {

using namespace recsys_test;

// ---------------------------------------------------------------------------------------------
// The hand-worked case: tables of 4 and 2 rows, D = 2, B = 3.
//   table 0: r0 [1, 2]   r1 [3, 4]   r2 [5, 6]   r3 [7, 8]    (global rows 0..3)
//   table 1: r0 [10, 20] r1 [30, 40]                          (global rows 4..5)
// CSR bags q = t * 3 + b: q0 {0, 2}, q1 {}, q2 {1, 1}, q3 {1}, q4 {0, 1}, q5 {0}.
// ---------------------------------------------------------------------------------------------

struct HandCase {
  TableLayout layout{{4, 2}};
  Tensor weights = f32({6, 2}, {1, 2, 3, 4, 5, 6, 7, 8, 10, 20, 30, 40});
  Tensor indices = i64({0, 2, 1, 1, 1, 0, 1, 0});
  Tensor offsets = i64({0, 2, 2, 4, 5, 7, 8});
  Tensor z = Tensor::empty({3, 3, 2}, DType::f32, kCpu);  // Z[b, 0] stays -7: not the op's
  Tensor keys = Tensor::empty({8}, DType::i32, kCpu), bags = Tensor::empty({8}, DType::i32, kCpu);
  HandCase() { fill(z, -7.0); }
  std::vector<float> pooled() const {  // Z[:, 1:] in order
    const std::vector<float> all = floats(z);
    std::vector<float> out;
    for (int b = 0; b < 3; ++b)
      for (int i = 2; i < 6; ++i) out.push_back(all[static_cast<std::size_t>(b * 6 + i)]);
    return out;
  }
  std::vector<float> z0() const {
    std::vector<float> all = floats(z);
    return {all[0], all[1], all[6], all[7], all[12], all[13]};
  }
};

TEST(RecsysSpec, TableLayoutBasesAndKeyBits) {
  const TableLayout l({4, 2, 1});
  EXPECT_EQ(l.num_tables(), 3);
  EXPECT_EQ(l.base(0), 0);
  EXPECT_EQ(l.base(1), 4);
  EXPECT_EQ(l.base(2), 6);
  EXPECT_EQ(l.total_rows(), 7);
  EXPECT_EQ(l.key_bits(), 3);
  EXPECT_EQ(TableLayout({1}).key_bits(), 1);
  EXPECT_EQ(TableLayout({1 << 20, 1}).key_bits(), 21);
}

TEST(RecsysSpec, ForwardSumByHand) {
  HandCase h;
  embedding_bag_forward(h.layout, {h.weights, h.indices.view(), h.offsets.view(), std::nullopt, pooled_in(h.z),
                                   h.keys.view(), h.bags.view()},
                        {Pooling::sum});
  // b0: t0 r0 + r2, t1 r1; b1: t0 empty, t1 r0 + r1; b2: t0 r1 + r1, t1 r0.
  EXPECT_EQ(h.pooled(), (std::vector<float>{6, 8, 30, 40, 0, 0, 40, 60, 6, 8, 10, 20}));
  EXPECT_EQ(h.z0(), (std::vector<float>{-7, -7, -7, -7, -7, -7}));
  EXPECT_EQ(ints(h.keys), (std::vector<std::int32_t>{0, 2, 1, 1, 5, 4, 5, 4}));
  EXPECT_EQ(ints(h.bags), (std::vector<std::int32_t>{0, 0, 2, 2, 3, 4, 4, 5}));
}

TEST(RecsysSpec, ForwardMeanByHand) {
  HandCase h;
  embedding_bag_forward(h.layout, {h.weights, h.indices.view(), h.offsets.view(), std::nullopt, pooled_in(h.z)},
                        {Pooling::mean});
  EXPECT_EQ(h.pooled(), (std::vector<float>{3, 4, 30, 40, 0, 0, 20, 30, 3, 4, 10, 20}));
}

TEST(RecsysSpec, ForwardRawBothHashesByHand) {
  // raw t0 = [4, 0, 7] (4 rows), t1 = [1, 2, 5] (2 rows).
  //   seed (v + 1) % rows:  t0 -> 1, 1, 0; t1 -> 0, 1, 0
  //   reference v % rows:   t0 -> 0, 0, 3; t1 -> 1, 0, 1
  EXPECT_EQ(reference::hash_row(4, 4, RowHash::seed), 1);
  EXPECT_EQ(reference::hash_row(7, 4, RowHash::reference), 3);
  EXPECT_EQ(reference::hash_row(0xffffffffu, 3, RowHash::seed), 0x100000000ll % 3);  // no 32-bit wrap
  {
    HandCase h;
    embedding_bag_forward(h.layout, {h.weights, std::nullopt, std::nullopt, i32({4, 0, 7, 1, 2, 5}).view(),
                                     pooled_in(h.z), h.keys.view().slice_rows(0, 6), h.bags.view().slice_rows(0, 6)},
                          {Pooling::sum, RowHash::seed});
    EXPECT_EQ(h.pooled(), (std::vector<float>{3, 4, 10, 20, 3, 4, 30, 40, 1, 2, 10, 20}));
    EXPECT_EQ(ints(h.keys.view().slice_rows(0, 6)), (std::vector<std::int32_t>{1, 1, 0, 4, 5, 4}));
    EXPECT_EQ(ints(h.bags.view().slice_rows(0, 6)), (std::vector<std::int32_t>{0, 1, 2, 3, 4, 5}));
  }
  {
    HandCase h;
    embedding_bag_forward(h.layout, {h.weights, std::nullopt, std::nullopt, i32({4, 0, 7, 1, 2, 5}).view(),
                                     pooled_in(h.z)},
                          {Pooling::mean, RowHash::reference});  // mean of one row: the row
    EXPECT_EQ(h.pooled(), (std::vector<float>{1, 2, 30, 40, 1, 2, 10, 20, 7, 8, 30, 40}));
  }
}

// dout[b, t] = [1, 2], [7, 8] (b0); [3, 4], [9, 10] (b1); [5, 6], [11, 12] (b2). Each row's gradient,
// sum pooling: g0 = [1, 2] (q0), g1 = 2 [5, 6] = [10, 12] (q2 twice), g2 = [1, 2] (q0), g3 none,
// g4 = [9, 10] + [11, 12] = [20, 22] (q4, q5), g5 = [7, 8] + [9, 10] = [16, 18] (q3, q4).
struct HandBackward : HandCase {
  Tensor dout = f32({3, 2, 2}, {1, 2, 7, 8, 3, 4, 9, 10, 5, 6, 11, 12});
  HandBackward() {
    embedding_bag_forward(layout, {weights, indices.view(), offsets.view(), std::nullopt, pooled_in(z), keys.view(),
                                   bags.view()},
                          {});
  }
  EmbeddingBagBackwardArgs args(std::optional<TensorView> state = std::nullopt) {
    return {keys, bags, dout, offsets.view(), weights, state, std::nullopt};
  }
};

void expect_rows_near(const TensorView& t, const std::vector<double>& want) {
  const std::vector<float> got = floats(t);
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 2e-6 * (1 + std::fabs(want[i]))) << "at " << i;
}

TEST(RecsysSpec, SgdStepOnRepeatedRowsByHand) {
  HandBackward h;
  embedding_bag_backward_update(h.layout, h.args(), {EmbeddingUpdate::sgd, 0.1f});
  expect_rows_near(h.weights, {1 - 0.1, 2 - 0.2, 3 - 1.0, 4 - 1.2, 5 - 0.1, 6 - 0.2, 7, 8,  // row 3 untouched
                               10 - 2.0, 20 - 2.2, 30 - 1.6, 40 - 1.8});
}

TEST(RecsysSpec, AdagradStepOnRepeatedRowsByHand) {
  HandBackward h;
  Tensor state = Tensor::empty({6, 2}, DType::f32, kCpu);
  fill(state, 1.0);
  embedding_bag_backward_update(h.layout, h.args(state.view()), {EmbeddingUpdate::adagrad, 0.1f, 0.0f});
  // state = 1 + g^2; w -= 0.1 g / sqrt(state).
  const double g[6][2] = {{1, 2}, {10, 12}, {1, 2}, {0, 0}, {20, 22}, {16, 18}};
  const double w0[6][2] = {{1, 2}, {3, 4}, {5, 6}, {7, 8}, {10, 20}, {30, 40}};
  std::vector<double> want_w, want_s;
  for (int r = 0; r < 6; ++r)
    for (int c = 0; c < 2; ++c) {
      const double s = 1 + g[r][c] * g[r][c];
      want_s.push_back(s);
      want_w.push_back(r == 3 ? w0[r][c] : w0[r][c] - 0.1 * g[r][c] / std::sqrt(s));
    }
  want_s[6] = want_s[7] = 1;  // row 3: not touched, its state neither
  expect_rows_near(h.weights, want_w);
  expect_rows_near(state, want_s);
}

TEST(RecsysSpec, RowwiseAdagradStepOnRepeatedRowsByHand) {
  HandBackward h;
  Tensor state = f32({6}, {0, 1, 2, 3, 4, 5});
  embedding_bag_backward_update(h.layout, h.args(state.view()), {EmbeddingUpdate::rowwise_adagrad, 0.1f, 0.0f});
  // Row 1: g = [10, 12], state = 1 + (100 + 144) / 2 = 123, w = [3, 4] - 0.1 / sqrt(123) [10, 12].
  // Row 5: g = [16, 18], state = 5 + (256 + 324) / 2 = 295.
  const std::vector<float> s = floats(state);
  EXPECT_FLOAT_EQ(s[0], 0 + 2.5f);
  EXPECT_FLOAT_EQ(s[1], 123.0f);
  EXPECT_FLOAT_EQ(s[3], 3.0f);  // untouched
  EXPECT_FLOAT_EQ(s[5], 295.0f);
  const double k1 = 0.1 / std::sqrt(123.0), k5 = 0.1 / std::sqrt(295.0), k0 = 0.1 / std::sqrt(2.5);
  const std::vector<float> w = floats(h.weights);
  EXPECT_NEAR(w[0], 1 - k0 * 1, 1e-6);
  EXPECT_NEAR(w[2], 3 - k1 * 10, 1e-6);
  EXPECT_NEAR(w[3], 4 - k1 * 12, 1e-6);
  EXPECT_EQ(w[6], 7.0f);
  EXPECT_NEAR(w[10], 30 - k5 * 16, 1e-5);
  EXPECT_NEAR(w[11], 40 - k5 * 18, 1e-5);
}

// ---------------------------------------------------------------------------------------------
// 16-bit tables: stochastic rounding (ops/common/stochastic_round.hpp) and the ops on bf16 / f16
// ---------------------------------------------------------------------------------------------

TEST(StochasticRounding, Bf16ByHand) {
  // 1 + 2^-9 is a quarter of bf16's step (2^-7) above 1: its dropped bits are 0x4000.
  const float x = 1.0f + 0x1p-9f;
  EXPECT_EQ(sround::to_bf16(x, 0x0000), 0x3f81);  // up when the draw is below 0x4000
  EXPECT_EQ(sround::to_bf16(x, 0x3fff), 0x3f81);
  EXPECT_EQ(sround::to_bf16(x, 0x4000), 0x3f80);
  EXPECT_EQ(sround::to_bf16(x, 0xffff), 0x3f80);
  EXPECT_EQ(sround::to_bf16(-x, 0x0000), 0xbf81);  // away from zero, the sign kept
  EXPECT_EQ(sround::to_bf16(-x, 0x8000), 0xbf80);
  EXPECT_EQ(sround::to_bf16(bits_float(0x7f7fffffu), 0x0000), 0x7f80);  // past the largest: infinity
  EXPECT_EQ(sround::to_bf16(bits_float(0x7f7fffffu), 0xffff), 0x7f7f);
  EXPECT_EQ(sround::to_bf16(std::numeric_limits<float>::infinity(), 0), 0x7f80);
  EXPECT_EQ(sround::to_bf16(std::numeric_limits<float>::quiet_NaN(), 0) & 0x7fc0, 0x7fc0);
}

TEST(StochasticRounding, F16ByHand) {
  // 1 + 2^-12: a quarter of f16's step (2^-10) above 1; the 13 dropped bits are 0x800.
  const float x = 1.0f + 0x1p-12f;
  EXPECT_EQ(sround::to_f16(x, 0x07ff), 0x3c01);
  EXPECT_EQ(sround::to_f16(x, 0x0800), 0x3c00);
  EXPECT_EQ(sround::to_f16(x, 0xe7ff), 0x3c01);  // only the low 13 bits of the draw count
  EXPECT_EQ(sround::to_f16(-x, 0x0000), 0xbc01);
  // Subnormal: 2.25 * 2^-24 between 2 and 3 of the least step; up when (h + 1/2) / 2^16 < 1/4.
  const float s = 2.25f * 0x1p-24f;
  EXPECT_EQ(sround::to_f16(s, 16383), 0x0003);
  EXPECT_EQ(sround::to_f16(s, 16384), 0x0002);
  // Just under the least normal (2^-14): up carries into it.
  EXPECT_EQ(sround::to_f16(0x1p-14f - 0x1p-26f, 0), 0x0400);
  // Halfway between 65504 and the next step (65536): infinity or 65504.
  EXPECT_EQ(sround::to_f16(65520.0f, 0x0000), 0x7c00);
  EXPECT_EQ(sround::to_f16(65520.0f, 0x1000), 0x7bff);
  EXPECT_EQ(sround::to_f16(70000.0f, 0xffff), 0x7c00);
  EXPECT_EQ(sround::to_f16(-std::numeric_limits<float>::infinity(), 0), 0xfc00);
  EXPECT_EQ(sround::to_f16(std::numeric_limits<float>::quiet_NaN(), 0) & 0x7e00, 0x7e00);
}

TEST(StochasticRounding, RepresentableValuesNeverMove) {
  // Every finite 16-bit value, widened to f32, comes back as itself whatever the draw.
  std::mt19937 rng(5);
  for (std::uint32_t b = 0; b < 0x10000u; ++b) {
    const std::uint32_t h = rng() & 0xffffu;
    if ((b & 0x7f80u) != 0x7f80u) {
      const float v = bits_float(b << 16);
      ASSERT_EQ(sround::to_bf16(v, h), b) << std::hex << b;
    }
    if ((b & 0x7c00u) != 0x7c00u) {
      f16 half;
      half.bits = static_cast<std::uint16_t>(b);
      ASSERT_EQ(sround::to_f16(static_cast<float>(half), h), b) << std::hex << b;
    }
  }
}

TEST(StochasticRounding, UnbiasedOverPhiloxDraws) {
  // The mean of 2^16 roundings of x, with the draws a table update makes, is x within a few
  // standard deviations (sigma = step sqrt(p (1 - p) / n) <= step / 512).
  const float xs[] = {1.0f + 0.3f * 0x1p-7f, -3.0f - 0.9f * 0x1p-6f, 1e-3f * 1.37f};
  for (const float x : xs) {
    for (const bool bf : {true, false}) {
      double sum = 0;
      const int n = 1 << 16;
      for (int i = 0; i < n; ++i) {
        const auto flat = static_cast<std::uint64_t>(i);
        const std::uint32_t h = sround::draw_bits(philox::random_block(9, 4, flat >> 3), flat);
        f16 half;
        half.bits = bf ? 0 : sround::to_f16(x, h);
        sum += bf ? static_cast<double>(bits_float(static_cast<std::uint32_t>(sround::to_bf16(x, h)) << 16))
                  : static_cast<double>(static_cast<float>(half));
      }
      const int e = std::ilogb(x);
      const double step = std::ldexp(1.0, e - (bf ? 7 : 10));
      EXPECT_NEAR(sum / n, x, 4 * step / 512) << x << (bf ? " bf16" : " f16");
    }
  }
}

// Widens a 16-bit host tensor to f32.
Tensor widened(const Tensor& t) {
  Tensor out = Tensor::empty(t.shape(), DType::f32, kCpu);
  const std::vector<float> v = test::to_floats(t);
  std::copy(v.begin(), v.end(), out.data_as<float>());
  return out;
}

TEST(RecsysSpec, SixteenBitTablesPoolAsTheirValues) {
  for (const DType dt : {DType::bf16, DType::f16}) {
    HandCase h;
    const Tensor w = test::random_tensor({6, 2}, dt, kCpu, 3);
    embedding_bag_forward(h.layout, {w, h.indices.view(), h.offsets.view(), std::nullopt, pooled_in(h.z)}, {});
    const std::vector<float> got = h.pooled();
    HandCase wide;
    embedding_bag_forward(wide.layout, {widened(w), wide.indices.view(), wide.offsets.view(), std::nullopt,
                                        pooled_in(wide.z)},
                          {});
    EXPECT_EQ(got, wide.pooled()) << dtype_name(dt);
  }
}

// The two 16-bit values around v (equal when v is one).
std::pair<float, float> neighbours(float v, DType dt) {
  const auto widen = [&](std::uint16_t b) {
    if (dt == DType::bf16) return bits_float(static_cast<std::uint32_t>(b) << 16);
    f16 half;
    half.bits = b;
    return static_cast<float>(half);
  };
  const std::uint16_t lo = dt == DType::bf16 ? sround::to_bf16(v, 0xffff) : sround::to_f16(v, 0xffff);
  const std::uint16_t hi = dt == DType::bf16 ? sround::to_bf16(v, 0) : sround::to_f16(v, 0);
  return {widen(lo), widen(hi)};
}

TEST(RecsysSpec, SixteenBitSgdStepRoundsStochastically) {
  // The hand-worked SGD step on bf16 / f16 tables: every element lands on one of the two 16-bit
  // values around its f32 result; the same (seed, offset) gives the same bits, and the counter
  // is added to the offset.
  for (const DType dt : {DType::bf16, DType::f16}) {
    SCOPED_TRACE(std::string(dtype_name(dt)));
    HandBackward h;
    embedding_bag_backward_update(h.layout, h.args(), {EmbeddingUpdate::sgd, 0.1f});
    const std::vector<float> want = floats(h.weights);  // the f32 step
    const auto step16 = [&](std::uint64_t offset, std::optional<std::uint64_t> counter) {
      HandBackward g;
      Tensor w = test::host_tensor({6, 2}, dt, floats(HandCase().weights));  // 1..40 are exact in both
      auto a = g.args();
      a.weights = w;
      EmbeddingOptimizerParams p{EmbeddingUpdate::sgd, 0.1f};
      p.seed = 11;
      p.offset = offset;
      Tensor c = i64({static_cast<std::int64_t>(counter.value_or(0))});
      if (counter) p.offset_counter = c.view();
      embedding_bag_backward_update(g.layout, a, p);
      return test::to_floats(w);
    };
    const std::vector<float> a = step16(3, std::nullopt);
    for (std::size_t i = 0; i < want.size(); ++i) {
      const auto [lo, hi] = neighbours(want[i], dt);
      EXPECT_TRUE(a[i] == lo || a[i] == hi) << i << ": " << a[i] << " not around " << want[i];
    }
    EXPECT_EQ(step16(3, std::nullopt), a);
    EXPECT_EQ(step16(1, 2), a);  // offset 1 + counter 2
    bool differs = false;
    for (std::uint64_t o = 4; o < 12 && !differs; ++o) differs = step16(o, std::nullopt) != a;
    EXPECT_TRUE(differs) << "other offsets never drew differently";
  }
}

TEST(RecsysSpec, SixteenBitDrawBasesRoundAsTheLargerLayout) {
  // Tables of 6, 5 and 7 rows (D 3) and a layout holding two pieces of them, table 2's rows
  // [2, 7) then table 0's rows [1, 4), whose draw bases are those rows' places in the larger
  // buffer (6 + 5 + 2 and 1). One SGD step of the same gradients on both: the pieces end with
  // exactly the larger layout's values of those rows; without the draw bases they round otherwise.
  constexpr std::int64_t kD = 3, kB = 4;
  const TableLayout whole({6, 5, 7});
  const std::vector<std::int64_t> piece_rows{5, 3}, piece_table{2, 0}, piece_first{2, 1};
  const TableLayout drawn(piece_rows, kCpu, {whole.base(2) + 2, whole.base(0) + 1}), plain(piece_rows);
  EXPECT_EQ(drawn.draw_base(0), 13);
  EXPECT_EQ(drawn.draw_base(1), 1);
  EXPECT_TRUE(drawn.draws_elsewhere());
  EXPECT_FALSE(plain.draws_elsewhere());
  EXPECT_EQ(plain.draw_base(1), plain.base(1));
  for (const DType dt : {DType::bf16, DType::f16}) {
    SCOPED_TRACE(std::string(dtype_name(dt)));
    // Entries (table, row within table, sample), every row of the pieces touched, some twice.
    struct Entry {
      std::int64_t t, r, b;
    };
    std::vector<Entry> entries;
    for (std::int64_t r = 0; r < 7; ++r) entries.push_back({2, r, r % kB});
    for (std::int64_t r = 0; r < 6; ++r) entries.push_back({0, r, (r + 1) % kB});
    entries.push_back({2, 3, 0});
    entries.push_back({0, 2, 3});
    const Tensor dout_whole = test::random_tensor({kB, 3, kD}, DType::f32, kCpu, 41);
    const Tensor start = test::random_tensor({whole.total_rows(), kD}, dt, kCpu, 42);
    EmbeddingOptimizerParams p{EmbeddingUpdate::sgd, 0.3f};
    p.seed = 5;
    p.offset = 9;
    // The larger layout.
    Tensor w_whole = start.clone();
    {
      std::vector<std::int32_t> k, q;
      for (const Entry& e : entries) {
        k.push_back(static_cast<std::int32_t>(whole.base(static_cast<int>(e.t)) + e.r));
        q.push_back(static_cast<std::int32_t>(e.t * kB + e.b));
      }
      Tensor keys = Tensor::empty({static_cast<std::int64_t>(k.size())}, DType::i32, kCpu);
      Tensor bags = Tensor::empty(keys.shape(), DType::i32, kCpu);
      std::copy(k.begin(), k.end(), keys.data_as<std::int32_t>());
      std::copy(q.begin(), q.end(), bags.data_as<std::int32_t>());
      embedding_bag_backward_update(whole, {keys, bags, dout_whole, std::nullopt, w_whole}, p);
    }
    // The pieces: their rows of the start, the entries that fall in them, dout's columns of their tables.
    const auto piece_update = [&](const TableLayout& layout) {
      Tensor w = Tensor::empty({layout.total_rows(), kD}, dt, kCpu);
      Tensor dout = Tensor::empty({kB, 2, kD}, DType::f32, kCpu);
      const auto bytes = static_cast<std::int64_t>(dtype_size(dt));
      for (int s = 0; s < 2; ++s) {
        std::memcpy(static_cast<char*>(w.data()) + layout.base(s) * kD * bytes,
                    static_cast<const char*>(start.data()) + (whole.base(static_cast<int>(piece_table[s])) + piece_first[s]) * kD * bytes,
                    static_cast<std::size_t>(piece_rows[s] * kD * bytes));
        for (std::int64_t b = 0; b < kB; ++b)
          for (std::int64_t c = 0; c < kD; ++c)
            dout.data_as<float>()[(b * 2 + s) * kD + c] = dout_whole.data_as<const float>()[(b * 3 + piece_table[s]) * kD + c];
      }
      std::vector<std::int32_t> k, q;
      for (const Entry& e : entries)
        for (int s = 0; s < 2; ++s)
          if (e.t == piece_table[s] && e.r >= piece_first[s] && e.r < piece_first[s] + piece_rows[s]) {
            k.push_back(static_cast<std::int32_t>(layout.base(s) + e.r - piece_first[s]));
            q.push_back(static_cast<std::int32_t>(s * kB + e.b));
          }
      Tensor keys = Tensor::empty({static_cast<std::int64_t>(k.size())}, DType::i32, kCpu);
      Tensor bags = Tensor::empty(keys.shape(), DType::i32, kCpu);
      std::copy(k.begin(), k.end(), keys.data_as<std::int32_t>());
      std::copy(q.begin(), q.end(), bags.data_as<std::int32_t>());
      embedding_bag_backward_update(layout, {keys, bags, dout, std::nullopt, w}, p);
      return test::to_floats(w);
    };
    const std::vector<float> all = test::to_floats(w_whole), got = piece_update(drawn), other = piece_update(plain);
    std::vector<float> want;
    for (int s = 0; s < 2; ++s) {
      const auto first = static_cast<std::size_t>((whole.base(static_cast<int>(piece_table[s])) + piece_first[s]) * kD);
      want.insert(want.end(), all.begin() + static_cast<std::ptrdiff_t>(first),
                  all.begin() + static_cast<std::ptrdiff_t>(first + static_cast<std::size_t>(piece_rows[s] * kD)));
    }
    EXPECT_EQ(got, want);
    EXPECT_NE(other, want) << "the pieces' own places drew as the larger layout's";
  }
}

TEST(RecsysSpec, SixteenBitUpdatesBelowHalfAStepMoveOnAverage) {
  // A row-wise Adagrad step of 0.5e-4 to 3e-4 on values near 0.5 (bf16's step there is 2^-8, so
  // rounding to nearest would leave every bf16 value as it was): over 512 offsets the mean of the
  // stored values is the f32 result within 4 sigma.
  const TableLayout layout({1});
  const Tensor keys = i32({0}), bags = i32({0});
  const Tensor dout = f32({1, 1, 4}, {1, -2, 3, 0.5f});
  for (const DType dt : {DType::bf16, DType::f16}) {
    SCOPED_TRACE(std::string(dtype_name(dt)));
    const std::vector<float> w0 = {0.5f, 0.5078125f, 0.49609375f, 0.5f};
    std::vector<double> sum(4, 0.0);
    std::vector<float> exact;
    const int n = 512;
    for (int o = 0; o < n; ++o) {
      Tensor w = test::host_tensor({1, 4}, dt, w0);
      Tensor state = f32({1}, {1e6f});
      EmbeddingOptimizerParams p{EmbeddingUpdate::rowwise_adagrad, 0.1f, 0.0f};
      p.seed = 2;
      p.offset = static_cast<std::uint64_t>(o);
      embedding_bag_backward_update(layout, {keys, bags, dout, std::nullopt, w, state.view()}, p);
      const std::vector<float> v = test::to_floats(w);
      for (int c = 0; c < 4; ++c) sum[static_cast<std::size_t>(c)] += v[static_cast<std::size_t>(c)];
      if (o == 0) {
        Tensor w32 = f32({1, 4}, w0), s32 = f32({1}, {1e6f});
        embedding_bag_backward_update(layout, {keys, bags, dout, std::nullopt, w32, s32.view()},
                                      {EmbeddingUpdate::rowwise_adagrad, 0.1f, 0.0f});
        exact = floats(w32);
      }
    }
    // A draw between two values a step apart has a standard deviation of at most step / 2 (the
    // step 2^-8 for bf16 and 2^-11 for f16 from 0.5 up, half that below).
    const double sigma = (dt == DType::bf16 ? 0x1p-8 : 0x1p-11) / 2 / std::sqrt(static_cast<double>(n));
    for (int c = 0; c < 4; ++c) {
      EXPECT_NE(exact[static_cast<std::size_t>(c)], w0[static_cast<std::size_t>(c)]) << "no update to see";
      EXPECT_NEAR(sum[static_cast<std::size_t>(c)] / n, exact[static_cast<std::size_t>(c)], 4 * sigma) << "column " << c;
    }
  }
}

TEST(RecsysSpec, StoreGradientAndMeanPoolingByHand) {
  {
    HandBackward h;
    Tensor grad = Tensor::empty({6, 2}, DType::f32, kCpu);
    fill(grad, 0.0);
    EmbeddingBagBackwardArgs a = h.args();
    a.weights = grad;
    embedding_bag_backward_update(h.layout, a, {EmbeddingUpdate::store_gradient});
    EXPECT_EQ(floats(grad), (std::vector<float>{1, 2, 10, 12, 1, 2, 0, 0, 20, 22, 16, 18}));
  }
  {
    // Mean: bag sizes q0 2, q2 2, q3 1, q4 2, q5 1: g0 = [1, 2] / 2, g1 = 2 [5, 6] / 2,
    // g4 = [9, 10] / 2 + [11, 12], g5 = [7, 8] + [9, 10] / 2.
    HandBackward h;
    Tensor grad = Tensor::empty({6, 2}, DType::f32, kCpu);
    fill(grad, 0.0);
    EmbeddingBagBackwardArgs a = h.args();
    a.weights = grad;
    embedding_bag_backward_update(h.layout, a, {EmbeddingUpdate::store_gradient, 0, 0, Pooling::mean});
    EXPECT_EQ(floats(grad), (std::vector<float>{0.5f, 1, 5, 6, 0.5f, 1, 0, 0, 15.5f, 17, 11.5f, 13}));
  }
}

// Z [1, 3, 2] = [[1, 2], [3, 4], [5, 6]]: <z1, z0> = 11, <z2, z0> = 17, <z2, z1> = 39; with the
// diagonal <z0, z0> = 5, <z1, z1> = 25, <z2, z2> = 61, in the order (0,0) (1,0) (1,1) (2,0) (2,1) (2,2).
TEST(RecsysSpec, DotPairOrderByHand) {
  const Tensor z = f32({1, 3, 2}, {1, 2, 3, 4, 5, 6});
  EXPECT_EQ(DotPairs(3, false).host(), (std::vector<std::uint32_t>{1 << 16 | 0, 2 << 16 | 0, 2 << 16 | 1}));
  {
    const DotPairs pairs(3, false);
    const InteractionParams p{InteractionKind::dot, false};
    EXPECT_EQ(interaction_size(p, 3, 2), 5);
    Tensor r = Tensor::empty({1, 8}, DType::f32, kCpu);
    test::poison(r);
    interaction_forward({z, r, &pairs}, p);
    EXPECT_EQ(floats(r), (std::vector<float>{1, 2, 11, 17, 39, 0, 0, 0}));  // padding zeroed
  }
  {
    const DotPairs pairs(3, true);
    const InteractionParams p{InteractionKind::dot, true};
    EXPECT_EQ(interaction_size(p, 3, 2), 8);
    Tensor r = Tensor::empty({1, 8}, DType::f32, kCpu);
    interaction_forward({z, r, &pairs}, p);
    EXPECT_EQ(floats(r), (std::vector<float>{1, 2, 5, 11, 25, 17, 39, 61}));
  }
}

TEST(RecsysSpec, DotBackwardByHand) {
  // dR = [1, -1 | g10 = 1, g20 = 2, g21 = 3 | padding 9]:
  //   dz0 = [1, -1] + 1 z1 + 2 z2 = [14, 15]; dz1 = 1 z0 + 3 z2 = [16, 20]; dz2 = 2 z0 + 3 z1 = [11, 16].
  const Tensor z = f32({1, 3, 2}, {1, 2, 3, 4, 5, 6});
  const Tensor dr = f32({1, 6}, {1, -1, 1, 2, 3, 9});
  const DotPairs pairs(3, false);
  Tensor dz = Tensor::empty({1, 3, 2}, DType::f32, kCpu);
  interaction_backward({z, dr, dz, &pairs}, {InteractionKind::dot});
  EXPECT_EQ(floats(dz), (std::vector<float>{14, 15, 16, 20, 11, 16}));
  // The diagonal pair (i, i) counts twice: z0 = [1, 2], g00 = 1 -> dz0 = 2 z0.
  const Tensor z1 = f32({1, 1, 2}, {1, 2}), dr1 = f32({1, 3}, {0, 0, 1});
  const DotPairs self(1, true);
  Tensor dz1 = Tensor::empty({1, 1, 2}, DType::f32, kCpu);
  interaction_backward({z1, dr1, dz1, &self}, {InteractionKind::dot, true});
  EXPECT_EQ(floats(dz1), (std::vector<float>{2, 4}));
  // relu_x: Z[b, 0] = [1, -2] is a ReLU output... its second column was not positive: masked.
  const Tensor zm = f32({1, 2, 2}, {1, -2, 3, 4}), drm = f32({1, 3}, {5, 6, 1});
  const DotPairs p2(2, false);
  Tensor dzm = Tensor::empty({1, 2, 2}, DType::f32, kCpu);
  interaction_backward({zm, drm, dzm, &p2, true}, {InteractionKind::dot});
  EXPECT_EQ(floats(dzm), (std::vector<float>{5 + 3, 0, 1, -2}));
}

TEST(RecsysSpec, CatAndOuterByHand) {
  const Tensor z = f32({1, 1, 2}, {1, 2});
  Tensor r = Tensor::empty({1, 4}, DType::f32, kCpu);
  interaction_forward({z, r}, {InteractionKind::outer});
  EXPECT_EQ(floats(r), (std::vector<float>{1, 2, 2, 4}));
  // dc_i = sum_j (g_ij + g_ji) c_j with g = [[1, 0], [5, 0]]: dc0 = 2 + 5 * 2 = 12, dc1 = 5 * 1 = 5.
  Tensor dz = Tensor::empty({1, 1, 2}, DType::f32, kCpu);
  interaction_backward({z, f32({1, 4}, {1, 0, 5, 0}), dz}, {InteractionKind::outer});
  EXPECT_EQ(floats(dz), (std::vector<float>{12, 5}));
  Tensor rc = Tensor::empty({1, 3}, DType::f32, kCpu);
  interaction_forward({z, rc}, {InteractionKind::cat});
  EXPECT_EQ(floats(rc), (std::vector<float>{1, 2, 0}));
  interaction_backward({z, f32({1, 3}, {7, 8, 9}), dz}, {InteractionKind::cat});
  EXPECT_EQ(floats(dz), (std::vector<float>{7, 8}));
}

TEST(RecsysSpec, SigmoidBceByHand) {
  // x = [0, 2], y = [1, 0]: losses ln 2 and 2 + log1p(e^-2); dlogits = [(0.5 - 1) / 2, sigmoid(2) / 2].
  const Tensor x = f32({2}, {0, 2}), y = f32({2}, {1, 0});
  Tensor dx = Tensor::empty({2}, DType::f32, kCpu);
  Tensor acc = Tensor::empty({8 * kSigmoidBceAccumulatorDoubles}, DType::u8, kCpu);
  fill(acc, 0.0);
  sigmoid_bce_forward_backward({x, y, dx, acc});
  sigmoid_bce_forward_backward({x, y, dx, acc});
  const double want = (std::log(2.0) + 2 + std::log1p(std::exp(-2.0))) / 2;
  EXPECT_NEAR(acc.data_as<double>()[0], 2 * want, 1e-14);
  EXPECT_EQ(acc.data_as<double>()[1], 2.0);
  EXPECT_FLOAT_EQ(floats(dx)[0], -0.25f);
  EXPECT_FLOAT_EQ(floats(dx)[1], static_cast<float>(0.5 / (1 + std::exp(-2.0))));
}

TEST(RecsysSpec, PerTableLaunchByHand) {
  // The same bags as ForwardSumByHand: the per-table baseline computes the same spec.
  HandCase h;
  EmbeddingBagParams p;
  p.per_table_launch = true;
  embedding_bag_forward(h.layout, {h.weights, h.indices.view(), h.offsets.view(), std::nullopt, pooled_in(h.z),
                                   h.keys.view(), h.bags.view()},
                        p);
  EXPECT_EQ(h.pooled(), (std::vector<float>{6, 8, 30, 40, 0, 0, 40, 60, 6, 8, 10, 20}));
  EXPECT_EQ(ints(h.keys), (std::vector<std::int32_t>{0, 2, 1, 1, 5, 4, 5, 4}));
  EXPECT_EQ(ints(h.bags), (std::vector<std::int32_t>{0, 0, 2, 2, 3, 4, 4, 5}));
}

TEST(RecsysSpec, DenseGradientByHand) {
  // The buffer starts as garbage: every row is written, row 3 (untouched) with zeros.
  HandBackward h;
  Tensor grad = Tensor::empty({6, 2}, DType::f32, kCpu);
  fill(grad, 5.0);
  EmbeddingBagBackwardArgs a = h.args();
  a.weights = grad;
  embedding_bag_backward_update(h.layout, a, {EmbeddingUpdate::dense_gradient});
  EXPECT_EQ(floats(grad), (std::vector<float>{1, 2, 10, 12, 1, 2, 0, 0, 20, 22, 16, 18}));
  // No entries at all: the gradient of every row is zero.
  fill(grad, 5.0);
  const Tensor none = Tensor::empty({0}, DType::i32, kCpu);
  a.keys = none;
  a.bags = none;
  embedding_bag_backward_update(h.layout, a, {EmbeddingUpdate::dense_gradient});
  EXPECT_EQ(floats(grad), std::vector<float>(12, 0.0f));
}

TEST(RecsysSpec, DenseOptimizerSgdByHand) {
  // p -= 0.5 g: [1, 2, 3] - 0.5 [0.5, -1, 2] = [0.75, 2.5, 2] (exact in float).
  Tensor param = f32({3}, {1, 2, 3});
  const Tensor grad = f32({3}, {0.5f, -1, 2});
  dense_optimizer_update({param, grad, std::nullopt}, {false, 0.5f});
  EXPECT_EQ(floats(param), (std::vector<float>{0.75f, 2.5f, 2}));
}

TEST(RecsysSpec, DenseOptimizerAdagradByHand) {
  // Any rank. state = [0, 9] + [3^2, 4^2] = [9, 25]; p = [1, 2] - 0.5 [3 / 3, 4 / 5] = [0.5, 1.6].
  Tensor param = f32({2, 1, 1}, {1, 2}), state = f32({2, 1, 1}, {0, 9});
  const Tensor grad = f32({2, 1, 1}, {3, 4});
  dense_optimizer_update({param, grad, state.view()}, {true, 0.5f, 0.0f});
  EXPECT_EQ(floats(state), (std::vector<float>{9, 25}));
  EXPECT_EQ(floats(param), (std::vector<float>{0.5f, 2.0f - 0.5f * 4.0f / 5.0f}));
  EXPECT_FLOAT_EQ(floats(param)[1], 1.6f);
  // eps is added to sqrt(state): state 0 + 0^2 with g = 0 gives p unchanged (0 / eps).
  Tensor p0 = f32({1}, {7}), s0 = f32({1}, {0});
  const Tensor g0 = f32({1}, {0});
  dense_optimizer_update({p0, g0, s0.view()}, {true, 0.5f, 1e-10f});
  EXPECT_EQ(floats(p0), (std::vector<float>{7}));
}

TEST(RecsysSpec, DotImplBmmIsTheSameSpec) {
  // The CPU has one implementation: impl bmm gives DotPairOrderByHand's values, no workspace needed.
  const Tensor z = f32({1, 3, 2}, {1, 2, 3, 4, 5, 6});
  const DotPairs pairs(3, false);
  InteractionParams p{InteractionKind::dot, false};
  p.impl = InteractionImpl::bmm;
  Tensor r = Tensor::empty({1, 6}, DType::f32, kCpu);
  interaction_forward({z, r, &pairs}, p);
  EXPECT_EQ(floats(r), (std::vector<float>{1, 2, 11, 17, 39, 0}));
  Tensor dz = Tensor::empty({1, 3, 2}, DType::f32, kCpu);
  interaction_backward({z, f32({1, 6}, {1, -1, 1, 2, 3, 9}), dz, &pairs}, p);
  EXPECT_EQ(floats(dz), (std::vector<float>{14, 15, 16, 20, 11, 16}));  // as in DotBackwardByHand
}

TEST(RecsysSpec, SigmoidBceUnfusedByHand) {
  // x = [0, 200, -1], y = [1, 0, 0]: p = [0.5, 1 (rounded), sigmoid(-1)]. Terms: -ln 0.5; the
  // clamp: -max(ln(1 - 1), -100) = 100 (the fused loss gives 200); -ln(1 - sigmoid(-1)) =
  // ln(1 + e^-1). dlogits = (p - y) / 3.
  const Tensor x = f32({3}, {0, 200, -1}), y = f32({3}, {1, 0, 0});
  Tensor dx = Tensor::empty({3}, DType::f32, kCpu), prob = Tensor::empty({3}, DType::f32, kCpu);
  Tensor acc = Tensor::empty({8 * kSigmoidBceAccumulatorDoubles}, DType::u8, kCpu);
  fill(acc, 0.0);
  SigmoidBceArgs a{x, y, dx, acc};
  a.probabilities = prob.view();
  sigmoid_bce_forward_backward(a, SigmoidBceParams{true});
  const double s1 = 1 / (1 + std::exp(1.0));
  // ln(1 - p) from the f32 p: about 1e-7 relative to ln(1 + e^-1).
  EXPECT_NEAR(acc.data_as<double>()[0], (std::log(2.0) + 100 + std::log1p(std::exp(-1.0))) / 3, 1e-7);
  EXPECT_EQ(acc.data_as<double>()[1], 1.0);
  EXPECT_EQ(floats(prob), (std::vector<float>{0.5f, 1.0f, static_cast<float>(s1)}));
  const std::vector<float> g = floats(dx);
  EXPECT_FLOAT_EQ(g[0], -0.5f / 3);
  EXPECT_FLOAT_EQ(g[1], 1.0f / 3);
  EXPECT_FLOAT_EQ(g[2], static_cast<float>(s1 / 3));
}

// ---------------------------------------------------------------------------------------------
// Bad inputs
// ---------------------------------------------------------------------------------------------

TEST(RecsysErrors, TableLayout) {
  test::expect_arg_error([] { TableLayout(std::vector<std::int64_t>{}); }, "TableLayout", "rows");
  test::expect_arg_error([] { TableLayout({3, 0}); }, "TableLayout", "rows");
  test::expect_arg_error([] { TableLayout({std::int64_t{1} << 31, std::int64_t{1} << 31}); }, "TableLayout", "rows");
  test::expect_arg_error([] { TableLayout({3, 4}, kCpu, {0}); }, "TableLayout", "draw_bases");
  test::expect_arg_error([] { TableLayout({3, 4}, kCpu, {0, -1}); }, "TableLayout", "draw_bases");
  test::expect_arg_error([] { TableLayout({3, 4}, kCpu, {0, (std::int64_t{1} << 56) - 2}); }, "TableLayout", "draw_bases");
}

TEST(RecsysErrors, EmbeddingForward) {
  constexpr const char* op = "embedding_bag_forward";
  HandCase h;
  const auto run = [&](EmbeddingBagForwardArgs a) { embedding_bag_forward(h.layout, a, {}); };
  const EmbeddingBagForwardArgs good{h.weights, h.indices.view(), h.offsets.view(), std::nullopt, pooled_in(h.z)};
  run(good);  // the baseline is accepted
  {
    Tensor wi = Tensor::empty({6, 2}, DType::i32, kCpu);
    auto a = good;
    a.weights = wi;
    test::expect_arg_error([&] { run(a); }, op, "weights");
    Tensor w5 = Tensor::empty({5, 2}, DType::f32, kCpu);
    a.weights = w5;
    test::expect_arg_error([&] { run(a); }, op, "weights");
  }
  {
    auto a = good;
    Tensor narrow = Tensor::empty({3, 2, 3}, DType::f32, kCpu);
    a.out = narrow;  // D = 3, not 2
    test::expect_arg_error([&] { run(a); }, op, "out");
    a.out = TensorView(h.z.data(), DType::f32, {3, 2, 2}, {3, 2, 1}, kCpu);  // rows overlap
    test::expect_arg_error([&] { run(a); }, op, "out");
  }
  {
    auto a = good;
    Tensor raw = i32({1, 2, 3, 4, 5, 6});
    a.raw = raw.view();  // and CSR
    test::expect_arg_error([&] { run(a); }, op, "raw");
    a.indices.reset();
    a.offsets.reset();
    Tensor raw64 = i64({1, 2, 3, 4, 5, 6});
    a.raw = raw64.view();
    test::expect_arg_error([&] { run(a); }, op, "raw");
    a.raw.reset();
    test::expect_arg_error([&] { run(a); }, op, "raw");  // neither
  }
  {
    auto a = good;
    Tensor bad = i64({0, 2, 1, 1, 1, 0, 2, 0});  // table 1 has 2 rows: index 2 is out of range
    a.indices = bad.view();
    test::expect_arg_error([&] { run(a); }, op, "indices");
    Tensor neg = i64({0, -1, 1, 1, 1, 0, 1, 0});
    a.indices = neg.view();
    test::expect_arg_error([&] { run(a); }, op, "indices");
  }
  {
    auto a = good;
    Tensor down = i64({0, 2, 1, 4, 5, 7, 8});  // not monotone
    a.offsets = down.view();
    test::expect_arg_error([&] { run(a); }, op, "offsets");
    Tensor last = i64({0, 2, 2, 4, 5, 7, 7});  // does not end at nnz
    a.offsets = last.view();
    test::expect_arg_error([&] { run(a); }, op, "offsets");
    Tensor shortened = i64({0, 2, 2, 4, 5, 8});
    a.offsets = shortened.view();
    test::expect_arg_error([&] { run(a); }, op, "offsets");
  }
  {
    auto a = good;
    Tensor keys = Tensor::empty({8}, DType::i32, kCpu);
    a.keys = keys.view();  // without bags
    test::expect_arg_error([&] { run(a); }, op, "bags");
    Tensor short_bags = Tensor::empty({7}, DType::i32, kCpu);
    a.bags = short_bags.view();
    test::expect_arg_error([&] { run(a); }, op, "bags");
  }
  {
    // The per-table baseline takes CSR input only.
    auto a = good;
    a.indices.reset();
    a.offsets.reset();
    Tensor raw = i32({1, 2, 3, 4, 5, 6});
    a.raw = raw.view();
    EmbeddingBagParams p;
    p.per_table_launch = true;
    test::expect_arg_error([&] { embedding_bag_forward(h.layout, a, p); }, op, "per_table_launch");
    // ... and f32 tables only.
    Tensor w16 = Tensor::empty({6, 2}, DType::bf16, kCpu);
    a = good;
    a.weights = w16;
    test::expect_arg_error([&] { embedding_bag_forward(h.layout, a, p); }, op, "per_table_launch");
  }
  {
    // A device mix: the output on a GPU, the tables on the host (refused before anything is read).
    auto a = good;
    float dummy[12];
    a.out = TensorView(dummy, DType::f32, {3, 2, 2}, Device::cuda(0));
    test::expect_arg_error([&] { run(a); }, op, "out");
  }
}

TEST(RecsysErrors, EmbeddingBackward) {
  constexpr const char* op = "embedding_bag_backward_update";
  HandBackward h;
  const auto run = [&](const EmbeddingBagBackwardArgs& a, EmbeddingOptimizerParams p) {
    embedding_bag_backward_update(h.layout, a, p);
  };
  Tensor ada = Tensor::empty({6, 2}, DType::f32, kCpu), row = Tensor::empty({6}, DType::f32, kCpu);
  fill(ada, 0.0);
  fill(row, 0.0);
  test::expect_arg_error([&] { run(h.args(), {EmbeddingUpdate::adagrad}); }, op, "state");
  test::expect_arg_error([&] { run(h.args(ada.view()), {EmbeddingUpdate::rowwise_adagrad}); }, op, "state");
  test::expect_arg_error([&] { run(h.args(row.view()), {EmbeddingUpdate::adagrad}); }, op, "state");
  test::expect_arg_error([&] { run(h.args(row.view()), {EmbeddingUpdate::sgd}); }, op, "state");
  test::expect_arg_error([&] { run(h.args(ada.view()), {EmbeddingUpdate::dense_gradient}); }, op, "state");
  {
    auto a = h.args();
    a.offsets.reset();
    test::expect_arg_error([&] { run(a, {EmbeddingUpdate::sgd, 0.1f, 0, Pooling::mean}); }, op, "offsets");
  }
  {
    auto a = h.args();
    Tensor keys = i32({0, 2, 1, 1, 6, 4, 5, 4});  // 6 rows in all
    a.keys = keys;
    test::expect_arg_error([&] { run(a, {}); }, op, "keys");
    Tensor bags = i32({0, 0, 2, 2, 3, 4, 4, 6});  // 6 bags
    a.keys = h.keys;
    a.bags = bags;
    test::expect_arg_error([&] { run(a, {}); }, op, "bags");
    Tensor bags64 = i64({0, 0, 2, 2, 3, 4, 4, 5});
    a.bags = bags64;
    test::expect_arg_error([&] { run(a, {}); }, op, "bags");
  }
  {
    auto a = h.args();
    Tensor d = Tensor::empty({3, 2, 3}, DType::f32, kCpu);
    a.dout = d;
    test::expect_arg_error([&] { run(a, {}); }, op, "dout");
  }
  {
    // 16-bit tables: the gradient stores want an f32 buffer, Adagrad an f32 state, the rounding
    // counter an i64 [1].
    Tensor w16 = Tensor::empty({6, 2}, DType::bf16, kCpu);
    fill(w16, 1.0);
    auto a = h.args();
    a.weights = w16;
    run(a, {EmbeddingUpdate::sgd});  // accepted
    test::expect_arg_error([&] { run(a, {EmbeddingUpdate::store_gradient}); }, op, "weights");
    test::expect_arg_error([&] { run(a, {EmbeddingUpdate::dense_gradient}); }, op, "weights");
    Tensor ada16 = Tensor::empty({6, 2}, DType::bf16, kCpu);
    fill(ada16, 0.0);
    a.state = ada16.view();
    test::expect_arg_error([&] { run(a, {EmbeddingUpdate::adagrad}); }, op, "state");
    a.state = ada.view();
    run(a, {EmbeddingUpdate::adagrad});  // an f32 state is accepted
    a.state.reset();
    EmbeddingOptimizerParams p;
    Tensor c32 = i32({0});
    p.offset_counter = c32.view();
    test::expect_arg_error([&] { run(a, p); }, op, "offset_counter");
    Tensor c2 = i64({0, 0});
    p.offset_counter = c2.view();
    test::expect_arg_error([&] { run(a, p); }, op, "offset_counter");
  }
}

TEST(RecsysErrors, DenseOptimizer) {
  constexpr const char* op = "dense_optimizer_update";
  Tensor p = f32({2, 3}, {1, 2, 3, 4, 5, 6}), g = f32({2, 3}, {1, 1, 1, 1, 1, 1}), st = f32({2, 3}, {0, 0, 0, 0, 0, 0});
  Tensor g6 = f32({6}, {1, 1, 1, 1, 1, 1}), st3 = f32({3}, {0, 0, 0});
  Tensor p16 = Tensor::empty({2, 3}, DType::f16, kCpu);
  const auto run = [](const DenseOptimizerArgs& a, DenseOptimizerParams prm) { dense_optimizer_update(a, prm); };
  test::expect_arg_error([&] { run({p, g, st.view()}, {false}); }, op, "state");  // SGD keeps no state
  test::expect_arg_error([&] { run({p, g, std::nullopt}, {true}); }, op, "state");  // Adagrad needs it
  test::expect_arg_error([&] { run({p, g, st3.view()}, {true}); }, op, "state");
  test::expect_arg_error([&] { run({p, g6, std::nullopt}, {false}); }, op, "grad");  // same numel, other shape
  test::expect_arg_error([&] { run({p16, g, std::nullopt}, {false}); }, op, "param");
  const TensorView strided(p.data(), DType::f32, {2, 2}, {3, 1}, kCpu);  // columns [0, 2): not contiguous
  const Tensor g22 = f32({2, 2}, {1, 1, 1, 1});
  test::expect_arg_error([&] { run({strided, g22, std::nullopt}, {false}); }, op, "param");
  run({p, g, st.view()}, {true});  // the good call
}

TEST(RecsysErrors, CheckEmbeddingInput) {
  const TableLayout l({4, 2});
  const Tensor idx = i64({0, 1}), off = i64({1, 1, 1, 2, 2});  // B = 2: offsets[0] must be 0
  test::expect_arg_error([&] { check_embedding_input(l, idx, off, 2, "op"); }, "op", "offsets");
  const Tensor off_ok = i64({0, 1, 1, 2, 2});
  check_embedding_input(l, idx, off_ok, 2, "op");
  const Tensor idx_bad = i64({0, 2});  // bag 2 is table 1's: 2 rows
  test::expect_arg_error([&] { check_embedding_input(l, idx_bad, off_ok, 2, "op"); }, "op", "indices");
}

TEST(RecsysInteraction, FusedDotFitsItsSharedMemory) {
  // 48 KB for 8 samples: 1536 floats a sample. Forward F (D + 4) for D % 4 == 0; backward
  // F ceil4(F) in registers (F <= 32, D in {8, 16, 32}), else F D + F^2.
  EXPECT_TRUE(interaction_dot_fused_fits(27, 16));   // DLRM Kaggle: 27 * 20 and 27 * 28
  EXPECT_TRUE(interaction_dot_fused_fits(27, 32));   // 27 * 36 = 972
  EXPECT_FALSE(interaction_dot_fused_fits(27, 128)); // forward 27 * 132 = 3564
  EXPECT_FALSE(interaction_dot_fused_fits(24, 60));  // forward 24 * 64 = 1536 fits; backward 1440 + 576 does not
  EXPECT_TRUE(interaction_dot_fused_fits(24, 32));   // backward in registers: 24 * 24
  EXPECT_FALSE(interaction_dot_fused_fits(33, 16));  // forward 660, backward 528 + 1089 = 1617
}

TEST(RecsysErrors, Interaction) {
  const Tensor z = f32({1, 3, 2}, {1, 2, 3, 4, 5, 6});
  const DotPairs pairs(3, false), pairs4(4, false);
  Tensor r = Tensor::empty({1, 4}, DType::f32, kCpu), r25 = Tensor::empty({1, 25}, DType::f32, kCpu);
  Tensor r36 = Tensor::empty({1, 36}, DType::f32, kCpu), r5 = Tensor::empty({1, 5}, DType::f32, kCpu);
  constexpr const char* fwd = "interaction_forward";
  constexpr const char* bwd = "interaction_backward";
  test::expect_arg_error([&] { interaction_forward({z, r, &pairs}, {}); }, fwd, "r");  // needs 5 columns
  test::expect_arg_error([&] { interaction_forward({z, r5, nullptr}, {}); }, fwd, "pairs");
  test::expect_arg_error([&] { interaction_forward({z, r5, &pairs4}, {}); }, fwd, "pairs");
  Tensor r8 = Tensor::empty({1, 8}, DType::f32, kCpu);
  test::expect_arg_error([&] { interaction_forward({z, r8, &pairs}, {InteractionKind::dot, true}); }, fwd, "pairs");
  test::expect_arg_error([&] { interaction_forward({z, r25}, {InteractionKind::outer}); }, fwd, "r");
  interaction_forward({z, r36}, {InteractionKind::outer});
  Tensor z16 = Tensor::empty({1, 3, 2}, DType::f16, kCpu);
  test::expect_arg_error([&] { interaction_forward({z16, r5, &pairs}, {}); }, fwd, "z");
  test::expect_arg_error([&] { interaction_forward({z.view().reshape({3, 2}), r5, &pairs}, {}); }, fwd, "z");
  Tensor dz = Tensor::empty({1, 3, 2}, DType::f32, kCpu), dz_bad = Tensor::empty({1, 2, 3}, DType::f32, kCpu);
  Tensor dr6 = Tensor::empty({1, 6}, DType::f32, kCpu);
  fill(dr6, 0.0);
  test::expect_arg_error([&] { interaction_backward({z, dr6, dz_bad, &pairs}, {}); }, bwd, "dz");
  test::expect_arg_error([&] { interaction_backward({z, dr6, dz, nullptr, true}, {InteractionKind::cat}); }, bwd,
                         "relu_x");
  test::expect_arg_error([&] { interaction_backward({z, r, dz, &pairs}, {}); }, bwd, "dr");
  // The unfused dot does not fuse the ReLU's backward (refused on every device).
  InteractionParams bmm{InteractionKind::dot, false};
  bmm.impl = InteractionImpl::bmm;
  test::expect_arg_error([&] { interaction_backward({z, dr6, dz, &pairs, true}, bmm); }, bwd, "relu_x");
}

TEST(RecsysErrors, SigmoidBce) {
  constexpr const char* op = "sigmoid_bce_forward_backward";
  const Tensor x = f32({2}, {0, 2}), y = f32({2}, {1, 0}), y3 = f32({3}, {1, 0, 1});
  Tensor dx = Tensor::empty({2}, DType::f32, kCpu);
  Tensor acc = Tensor::empty({8 * kSigmoidBceAccumulatorDoubles}, DType::u8, kCpu);
  Tensor acc_small = Tensor::empty({16}, DType::u8, kCpu);
  test::expect_arg_error([&] { sigmoid_bce_forward_backward({x, y3, dx, acc}); }, op, "labels");
  test::expect_arg_error([&] { sigmoid_bce_forward_backward({x, y, dx, acc_small}); }, op, "accumulator");
  const Tensor empty = Tensor::empty({0}, DType::f32, kCpu);
  test::expect_arg_error([&] { sigmoid_bce_forward_backward({empty, empty, empty, acc}); }, op, "logits");
  // The unfused loss writes its probabilities; the fused one has none to write.
  Tensor prob = Tensor::empty({2}, DType::f32, kCpu), prob3 = Tensor::empty({3}, DType::f32, kCpu);
  test::expect_arg_error([&] { sigmoid_bce_forward_backward({x, y, dx, acc}, SigmoidBceParams{true}); }, op,
                         "probabilities");
  test::expect_arg_error([&] { sigmoid_bce_forward_backward({x, y, dx, acc, prob3.view()}, SigmoidBceParams{true}); },
                         op, "probabilities");
  test::expect_arg_error([&] { sigmoid_bce_forward_backward({x, y, dx, acc, prob.view()}); }, op, "probabilities");
}

// Bags of 2, 0, 1 and 3 entries taken in the order 3, 0, 2, 1.
TEST(RecsysSpec, PermuteBagsByHand) {
  const Tensor lengths = i64({2, 0, 1, 3}), indices = i64({10, 11, 20, 30, 31, 32}), perm = i64({3, 0, 2, 1});
  Tensor off = Tensor::empty({5}, DType::i64, kCpu), out = Tensor::empty({6}, DType::i64, kCpu);
  permute_bags({lengths, indices, perm, off, out});
  const auto* o = off.data_as<std::int64_t>();
  EXPECT_EQ(std::vector<std::int64_t>(o, o + 5), (std::vector<std::int64_t>{0, 3, 5, 6, 6}));
  const auto* v = out.data_as<std::int64_t>();
  EXPECT_EQ(std::vector<std::int64_t>(v, v + 6), (std::vector<std::int64_t>{30, 31, 32, 10, 11, 20}));
  // No bags at all.
  Tensor off0 = Tensor::empty({1}, DType::i64, kCpu);
  const Tensor none = i64({});
  permute_bags({none, none, none, off0, none});
  EXPECT_EQ(off0.data_as<std::int64_t>()[0], 0);
}

TEST(RecsysErrors, PermuteBags) {
  constexpr const char* op = "permute_bags";
  const Tensor lengths = i64({2, 0, 1}), indices = i64({1, 2, 3}), perm = i64({2, 0, 1});
  Tensor off = Tensor::empty({4}, DType::i64, kCpu), out = Tensor::empty({3}, DType::i64, kCpu);
  permute_bags({lengths, indices, perm, off, out});
  test::expect_arg_error([&] { permute_bags({i64({2, 0, 2}), indices, perm, off, out}); }, op, "lengths");
  test::expect_arg_error([&] { permute_bags({i64({4, -1, 0}), indices, perm, off, out}); }, op, "lengths");
  test::expect_arg_error([&] { permute_bags({lengths, indices, i64({2, 0, 2}), off, out}); }, op, "permutation");
  test::expect_arg_error([&] { permute_bags({lengths, indices, i64({3, 0, 1}), off, out}); }, op, "permutation");
  test::expect_arg_error([&] { permute_bags({lengths, indices, i64({0, 1}), off, out}); }, op, "permutation");
  Tensor off3 = Tensor::empty({3}, DType::i64, kCpu), out2 = Tensor::empty({2}, DType::i64, kCpu);
  test::expect_arg_error([&] { permute_bags({lengths, indices, perm, off3, out}); }, op, "out_offsets");
  test::expect_arg_error([&] { permute_bags({lengths, indices, perm, off, out2}); }, op, "out_indices");
  test::expect_arg_error([&] { permute_bags({i32({2, 0, 1}), indices, perm, off, out}); }, op, "lengths");
  test::expect_arg_error([&] { permute_bags({lengths, indices, perm, off, indices}); }, op, "out_indices");
}

}  // namespace
}  // namespace fk
