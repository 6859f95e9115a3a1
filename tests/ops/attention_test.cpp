// Tests of attention_forward (puzzle 9, FlashAttention-style): the spec against hand-worked
// values; puzzle 9's scalar spec at the notebook's shape (T = 200) through the spec and the GPU;
// the CUDA kernels (sm_90 wgmma kernel and the warp-per-row fallback) against the spec on random
// shapes (sequence lengths that are not multiples of the 128 tile, one query row, Sq != Sk,
// causal, head_dim 64/128 and others, bf16/f16/f32, several heads); logits of large magnitude;
// every bad input.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "fusekit/fusekit.hpp"
#include "test_util.hpp"

namespace fk {
namespace {

const Device kCpu = Device::cpu();
const Device kGpu = Device::cuda(0);

using test::host_tensor;

// ---------------------------------------------------------------------------------------------
// The spec against hand-worked values
// ---------------------------------------------------------------------------------------------

// One head, D = 2, scale 1. Query 0 = (1, 0) scores the keys (0, 5) and (ln 3, 7) as 0 and ln 3:
// weights 1/4 and 3/4, out = 4/4 + 3 * 8/4 = 7 (v = 4, 8 in column 0; 1, -1 in column 1: 1/4 - 3/4),
// lse = ln(1 + 3). Query 1 = (0, 0) scores both 0: out = (6, 0), lse = ln 2. Causal: query 0 sees
// key 0 only (out = v0, lse = 0); query 1 sees both.
TEST(AttentionSpec, HandWorkedTwoByTwo) {
  const float ln3 = std::log(3.0f);
  Tensor q = host_tensor({1, 1, 2, 2}, DType::f32, {1, 0, 0, 0});
  Tensor k = host_tensor({1, 1, 2, 2}, DType::f32, {0, 5, ln3, 7});
  Tensor v = host_tensor({1, 1, 2, 2}, DType::f32, {4, 1, 8, -1});
  Tensor out = Tensor::empty({1, 1, 2, 2}, DType::f32, kCpu), lse = Tensor::empty({1, 1, 2}, DType::f32, kCpu);
  test::poison(out);
  attention_forward(q, k, v, out, lse, false, 1.0f);
  const std::vector<double> o = test::to_doubles(out), l = test::to_doubles(lse);
  const std::vector<double> want_o{7, -0.5, 6, 0}, want_l{std::log(4.0), std::log(2.0)};
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(o[i], want_o[i], 1e-6) << i;
  for (int i = 0; i < 2; ++i) EXPECT_NEAR(l[i], want_l[i], 1e-6) << i;

  attention_forward(q, k, v, out, lse, true, 1.0f);
  const std::vector<double> oc = test::to_doubles(out), lc = test::to_doubles(lse);
  const std::vector<double> want_oc{4, 1, 6, 0}, want_lc{0.0, std::log(2.0)};
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(oc[i], want_oc[i], 1e-6) << i;
  for (int i = 0; i < 2; ++i) EXPECT_NEAR(lc[i], want_lc[i], 1e-6) << i;
}

TEST(AttentionSpec, ScaleMultipliesTheScores) {
  // Scores 0 and 2 * ln 3 / 2 = ln 3 with scale 1/2: the same weights as above.
  const float ln3 = std::log(3.0f);
  Tensor q = host_tensor({1, 1, 1, 1}, DType::f32, {2});
  Tensor k = host_tensor({1, 1, 2, 1}, DType::f32, {0, ln3});
  Tensor v = host_tensor({1, 1, 2, 1}, DType::f32, {4, 8});
  Tensor out = Tensor::empty({1, 1, 1, 1}, DType::f32, kCpu), lse = Tensor::empty({1, 1, 1}, DType::f32, kCpu);
  attention_forward(q, k, v, out, lse, false, 0.5f);
  EXPECT_NEAR(test::to_doubles(out)[0], 7.0, 1e-6);
  EXPECT_NEAR(test::to_doubles(lse)[0], std::log(4.0), 1e-6);
}

// No keys: every row is 0 and its log-sum-exp -inf, on every device.
void expect_no_keys_result(Device dev) {
  Tensor q = test::random_tensor({2, 1, 3, 64}, DType::bf16, dev, 1);
  const TensorView k(nullptr, DType::bf16, {2, 1, 0, 64}, dev), v(nullptr, DType::bf16, {2, 1, 0, 64}, dev);
  Tensor out = Tensor::empty({2, 1, 3, 64}, DType::bf16, dev), lse = Tensor::empty({2, 1, 3}, DType::f32, dev);
  test::poison(out);
  test::poison(lse);
  attention_forward(q, k, v, out, lse, false, 0.125f);
  EXPECT_EQ(test::to_doubles(out), std::vector<double>(2 * 3 * 64, 0.0));
  for (double l : test::to_doubles(lse)) EXPECT_EQ(l, -std::numeric_limits<double>::infinity());
}

TEST(AttentionSpec, NoKeysGivesZerosAndMinusInfinity) { expect_no_keys_result(kCpu); }

TEST(AttentionGpu, NoKeysGivesZerosAndMinusInfinity) {
  FK_SKIP_WITHOUT_GPU();
  expect_no_keys_result(kGpu);
}

// ---------------------------------------------------------------------------------------------
// Puzzle 9 (the notebook's flashatt_spec): z_i = sum_j softmax(q_i k_1, ..., q_i k_T)_j v_j, T = 200
// ---------------------------------------------------------------------------------------------

std::vector<float> puzzle9_spec(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v) {
  // x = q[:, None] * k[None, :]; x -= x.max(1); soft = exp(x) / exp(x).sum(1); z = (v[None, :] * soft).sum(1)
  const std::size_t t = q.size();
  std::vector<float> z(t);
  for (std::size_t i = 0; i < t; ++i) {
    float mx = -INFINITY;
    for (std::size_t j = 0; j < t; ++j) mx = std::max(mx, q[i] * k[j]);
    float den = 0, num = 0;
    for (std::size_t j = 0; j < t; ++j) den += std::exp(q[i] * k[j] - mx);
    for (std::size_t j = 0; j < t; ++j) num += v[j] * (std::exp(q[i] * k[j] - mx) / den);
    z[i] = num;
  }
  return z;
}

void check_puzzle9(Device dev) {
  const std::int64_t t = 200;
  // The notebook draws its inputs with torch.randn-like magnitudes; [-3, 3) gives peaked rows too.
  Tensor q = test::random_tensor({1, 1, t, 1}, DType::f32, kCpu, 91, -3, 3);
  Tensor k = test::random_tensor({1, 1, t, 1}, DType::f32, kCpu, 92, -3, 3);
  Tensor v = test::random_tensor({1, 1, t, 1}, DType::f32, kCpu, 93, -3, 3);
  auto vec = [](const Tensor& x) { return std::vector<float>(x.data_as<float>(), x.data_as<float>() + x.numel()); };
  const std::vector<float> want = puzzle9_spec(vec(q), vec(k), vec(v));
  Tensor out = Tensor::empty({1, 1, t, 1}, DType::f32, dev), lse = Tensor::empty({1, 1, t}, DType::f32, dev);
  test::poison(out);
  attention_forward(q.copy_to(dev), k.copy_to(dev), v.copy_to(dev), out, lse, /*causal=*/false, /*scale=*/1.0f);
  const std::vector<double> got = test::to_doubles(out);
  for (std::int64_t i = 0; i < t; ++i) EXPECT_NEAR(got[i], want[i], 1e-3 + 1e-3 * std::fabs(want[i])) << "z[" << i << "]";
}

TEST(AttentionPuzzle9, SpecMatchesTheNotebook) { check_puzzle9(kCpu); }

TEST(AttentionPuzzle9, GpuMatchesTheNotebook) {
  FK_SKIP_WITHOUT_GPU();
  check_puzzle9(kGpu);
}

// ---------------------------------------------------------------------------------------------
// GPU against the spec
// ---------------------------------------------------------------------------------------------

struct Shape4 {
  std::int64_t b, h, sq, sk, d;
};
using GpuCase = std::tuple<DType, Shape4, bool>;

// out: P is rounded to the dtype before P v on the tensor cores and out once more at the store;
// with |v| <= 1 the error stays within a few units of the dtype's roundoff: 4 u absolute and
// relative (bf16 u = 2^-8, f16 2^-11). The fp32 row-wise kernel: its fp32 dot products differ
// from the spec's double ones by up to D * 2^-24 * |q||k| in the exponent, 1e-4. lse is an fp32 log of fp32
// sums of exp2 over fp32 scores: 1e-4 absolute + 1e-5 relative.
test::Tolerance out_tolerance(DType t) {
  if (t == DType::bf16) return {0x1p-6, 0x1p-6};
  if (t == DType::f16) return {0x1p-9, 0x1p-9};
  return {1e-4, 1e-4};
}

void check_against_spec(DType dt, Shape4 s, bool causal, float q_range, float scale, std::uint64_t seed,
                        test::Tolerance lse_tol) {
  Tensor q = test::random_tensor({s.b, s.h, s.sq, s.d}, dt, kCpu, seed, -q_range, q_range);
  Tensor k = test::random_tensor({s.b, s.h, s.sk, s.d}, dt, kCpu, seed + 1, -q_range, q_range);
  Tensor v = test::random_tensor({s.b, s.h, s.sk, s.d}, dt, kCpu, seed + 2);
  Tensor ref = Tensor::empty({s.b, s.h, s.sq, s.d}, dt, kCpu), ref_lse = Tensor::empty({s.b, s.h, s.sq}, DType::f32, kCpu);
  attention_forward(q, k, v, ref, ref_lse, causal, scale);
  Tensor out = Tensor::empty({s.b, s.h, s.sq, s.d}, dt, kGpu), lse = Tensor::empty({s.b, s.h, s.sq}, DType::f32, kGpu);
  test::poison(out);
  test::poison(lse);
  attention_forward(q.copy_to(kGpu), k.copy_to(kGpu), v.copy_to(kGpu), out, lse, causal, scale);
  EXPECT_TRUE(test::all_close(out, ref, out_tolerance(dt)));
  EXPECT_TRUE(test::all_close(lse, ref_lse, lse_tol));
}

class AttentionGpuVsSpec : public ::testing::TestWithParam<GpuCase> {};

TEST_P(AttentionGpuVsSpec, MatchesSpec) {
  FK_SKIP_WITHOUT_GPU();
  const auto [dt, s, causal] = GetParam();
  check_against_spec(dt, s, causal, 3.0f, 1.0f / std::sqrt(static_cast<float>(s.d)), 1000 + s.sq * 7 + s.sk + s.d,
                     {1e-4, 1e-5});
}

std::string case_name(const ::testing::TestParamInfo<GpuCase>& info) {
  const auto& [dt, s, causal] = info.param;
  return std::string(dtype_name(dt)) + "_b" + std::to_string(s.b) + "_h" + std::to_string(s.h) + "_sq" +
         std::to_string(s.sq) + "_sk" + std::to_string(s.sk) + "_d" + std::to_string(s.d) + (causal ? "_causal" : "");
}

// Tensor-core path (sm_90, bf16/f16, D 64/128): tails of the 128-row tiles in queries and keys,
// one query row, one key, Sq != Sk both ways, several heads and batches.
INSTANTIATE_TEST_SUITE_P(
    TensorCorePath, AttentionGpuVsSpec,
    ::testing::Values(GpuCase{DType::bf16, {1, 1, 128, 128, 64}, false}, GpuCase{DType::bf16, {1, 1, 128, 128, 128}, true},
                      GpuCase{DType::bf16, {2, 3, 200, 200, 128}, false}, GpuCase{DType::bf16, {2, 3, 200, 200, 128}, true},
                      GpuCase{DType::f16, {2, 3, 200, 200, 64}, false}, GpuCase{DType::f16, {1, 2, 383, 383, 64}, true},
                      GpuCase{DType::f16, {1, 2, 300, 300, 128}, true}, GpuCase{DType::bf16, {1, 2, 1, 1, 128}, false},
                      GpuCase{DType::bf16, {3, 1, 1, 257, 64}, false}, GpuCase{DType::bf16, {1, 1, 1, 257, 64}, true},
                      GpuCase{DType::bf16, {1, 2, 257, 100, 128}, false}, GpuCase{DType::f16, {1, 2, 257, 100, 128}, true},
                      GpuCase{DType::bf16, {1, 2, 100, 300, 64}, true}, GpuCase{DType::bf16, {1, 1, 640, 1000, 128}, true},
                      GpuCase{DType::f16, {1, 1, 1000, 640, 128}, false}),
    case_name);

// Row-wise fallback: f32, head dims other than 64/128.
INSTANTIATE_TEST_SUITE_P(
    RowwisePath, AttentionGpuVsSpec,
    ::testing::Values(GpuCase{DType::f32, {2, 2, 77, 77, 64}, true}, GpuCase{DType::f32, {1, 2, 40, 90, 1}, false},
                      GpuCase{DType::bf16, {1, 2, 65, 33, 32}, false}, GpuCase{DType::f16, {2, 1, 50, 50, 256}, true},
                      GpuCase{DType::f32, {1, 1, 1, 1, 3}, false}),
    case_name);

// Grouped-query heads (q head h reads k/v head h / (H / Hk)) and bottom-right causal masks, which
// the sm_90 kernel takes since it maps heads and offsets the diagonal by Sk - Sq (on another GPU
// these run the row-wise kernel, against the same spec): groups of 2, 4 and 8, Sq != Sk both ways
// (bottom-right with Sq > Sk leaves the first Sq - Sk rows without a key: out 0, lse -inf, and
// whole query blocks without one), tails of the 128-row tiles, bf16 and f16, D 64 and 128.
struct Sm90FwdCase {
  std::string name;
  DType dt;
  std::int64_t b, h, hk, sq, sk, d;
  AttentionOptions opt;
};

void PrintTo(const Sm90FwdCase& c, std::ostream* os) { *os << c.name; }

class AttentionSm90ForwardVsSpec : public ::testing::TestWithParam<Sm90FwdCase> {};

TEST_P(AttentionSm90ForwardVsSpec, MatchesSpec) {
  FK_SKIP_WITHOUT_GPU();
  const Sm90FwdCase& c = GetParam();
  const std::uint64_t seed = 2000 + static_cast<std::uint64_t>(c.sq * 7 + c.sk + c.d + c.hk);
  Tensor q = test::random_tensor({c.b, c.h, c.sq, c.d}, c.dt, kCpu, seed, -3.0f, 3.0f);
  Tensor k = test::random_tensor({c.b, c.hk, c.sk, c.d}, c.dt, kCpu, seed + 1, -3.0f, 3.0f);
  Tensor v = test::random_tensor({c.b, c.hk, c.sk, c.d}, c.dt, kCpu, seed + 2);
  Tensor ref = Tensor::empty(q.shape(), c.dt, kCpu), ref_lse = Tensor::empty({c.b, c.h, c.sq}, DType::f32, kCpu);
  attention_forward(q, k, v, ref, ref_lse, c.opt);
  const std::vector<double> want = test::to_doubles(ref_lse);
  const Tensor qg = q.copy_to(kGpu), kg = k.copy_to(kGpu), vg = v.copy_to(kGpu);
  // At D 64 both tiles: 192 query rows a CTA (automatic) and 128.
  std::vector<AttentionForwardTile> tiles{AttentionForwardTile::automatic};
  if (c.d == 64) tiles.push_back(AttentionForwardTile::rows_128);
  for (const AttentionForwardTile tile : tiles) {
    SCOPED_TRACE(tile == AttentionForwardTile::automatic ? "automatic tile" : "rows_128");
    AttentionOptions opt = c.opt;
    opt.forward_tile = tile;
    Tensor out = Tensor::empty(q.shape(), c.dt, kGpu), lse = Tensor::empty({c.b, c.h, c.sq}, DType::f32, kGpu);
    test::poison(out);
    test::poison(lse);
    attention_forward(qg, kg, vg, out, lse, opt);
    EXPECT_TRUE(test::all_close(out, ref, out_tolerance(c.dt)));
    // lse: -inf exactly where the spec has it (rows without a key), else the tolerance above.
    const std::vector<double> got = test::to_doubles(lse);
    std::size_t bad = 0, first = 0;
    for (std::size_t i = 0; i < got.size(); ++i) {
      const bool ok =
          std::isinf(want[i]) ? got[i] == want[i] : std::abs(got[i] - want[i]) <= 1e-4 + 1e-5 * std::abs(want[i]);
      if (!ok && bad++ == 0) first = i;
    }
    EXPECT_EQ(bad, 0u) << "lse elements off, first at flat index " << first << ": got " << (bad ? got[first] : 0.0)
                       << ", want " << (bad ? want[first] : 0.0);
  }
}

// rows_192 is a D 64 tile: asked for at D 128 on the sm_90 kernel, an error naming forward_tile.
TEST(AttentionGpu, Rows192OnlyAtHeadDim64) {
  FK_SKIP_WITHOUT_GPU();
  const Tensor q = test::random_tensor({1, 2, 64, 128}, DType::bf16, kGpu, 5);
  const Tensor out = Tensor::empty(q.shape(), DType::bf16, kGpu), lse = Tensor::empty({1, 2, 64}, DType::f32, kGpu);
  const AttentionOptions opt{.scale = 0.088f, .forward_tile = AttentionForwardTile::rows_192};
  if (!test::on_sm90()) GTEST_SKIP() << "the sm_90 forward only (other GPUs ignore forward_tile)";
  EXPECT_THROW(
      {
        try {
          attention_forward(q, q, q, out, lse, opt);
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("forward_tile"), std::string::npos) << e.what();
          throw;
        }
      },
      Error);
}

INSTANTIATE_TEST_SUITE_P(
    Sm90, AttentionSm90ForwardVsSpec,
    ::testing::Values(
        Sm90FwdCase{"bf16_d128_gqa_2_s200", DType::bf16, 2, 8, 4, 200, 200, 128, {.scale = 0.088f}},
        Sm90FwdCase{"f16_d64_gqa_4_s300_causal", DType::f16, 1, 8, 2, 300, 300, 64, {.causal = true, .scale = 0.125f}},
        Sm90FwdCase{"bf16_d64_gqa_8_q129_k1000_causal_top_left", DType::bf16, 2, 8, 1, 129, 1000, 64,
                    {.causal = true, .scale = 0.125f}},
        Sm90FwdCase{"f16_d128_gqa_8_q1_k1000", DType::f16, 1, 16, 2, 1, 1000, 128, {.scale = 0.088f}},
        Sm90FwdCase{"bf16_d128_q1000_k129_causal_bottom_right", DType::bf16, 1, 4, 4, 1000, 129, 128,
                    {.causal = true, .bottom_right = true, .scale = 0.088f}},
        Sm90FwdCase{"f16_d128_gqa_8_q1_k1000_causal_bottom_right", DType::f16, 2, 8, 1, 1, 1000, 128,
                    {.causal = true, .bottom_right = true, .scale = 0.088f}},
        Sm90FwdCase{"bf16_d64_gqa_2_q129_k1000_causal_bottom_right", DType::bf16, 2, 4, 2, 129, 1000, 64,
                    {.causal = true, .bottom_right = true, .scale = 0.125f}},
        Sm90FwdCase{"f16_d64_q383_k383_causal_bottom_right", DType::f16, 1, 2, 2, 383, 383, 64,
                    {.causal = true, .bottom_right = true, .scale = 0.125f}},
        Sm90FwdCase{"bf16_d128_gqa_8_q17_k2048_causal_bottom_right", DType::bf16, 1, 16, 2, 17, 2048, 128,
                    {.causal = true, .bottom_right = true, .scale = 0.088f}},
        Sm90FwdCase{"f16_d64_gqa_4_q2048_k1000_causal_bottom_right", DType::f16, 1, 4, 1, 2048, 1000, 64,
                    {.causal = true, .bottom_right = true, .scale = 0.125f}},
        Sm90FwdCase{"bf16_d64_q300_k5_causal_bottom_right", DType::bf16, 1, 2, 1, 300, 5, 64,
                    {.causal = true, .bottom_right = true, .scale = 0.125f}},
        // The 192-row tile's edges: one block short of query 0 by 191 rows, a multiple of 192
        // that is not one of 128, a block and a row.
        Sm90FwdCase{"f16_d64_q1_k700", DType::f16, 2, 4, 4, 1, 700, 64, {.scale = 0.125f}},
        Sm90FwdCase{"bf16_d64_gqa_2_q576_k576_causal", DType::bf16, 1, 4, 2, 576, 576, 64,
                    {.causal = true, .scale = 0.125f}},
        Sm90FwdCase{"bf16_d64_q193_k193_causal", DType::bf16, 2, 2, 2, 193, 193, 64, {.causal = true, .scale = 0.125f}},
        Sm90FwdCase{"f16_d64_q193_k450", DType::f16, 1, 3, 3, 193, 450, 64, {.scale = 0.125f}}),
    [](const auto& info) { return info.param.name; });

// Scores of order 1e4 (q and k entries up to 40 in bf16 at D = 64, up to 20 in f16 at D = 128,
// scale 1): the running max keeps every exponent <= 0, so out and lse stay finite and agree with
// the spec.
TEST(AttentionGpu, LargeLogitsStayFinite) {
  FK_SKIP_WITHOUT_GPU();
  for (const bool causal : {false, true}) {
    check_against_spec(DType::bf16, {1, 2, 200, 200, 64}, causal, 40.0f, 1.0f, 77, {1e-2, 1e-5});
    check_against_spec(DType::f16, {1, 1, 130, 130, 128}, causal, 20.0f, 1.0f, 78, {1e-2, 1e-5});
  }
}

// A zero or negative scale is valid (the tensor-core kernel leaves it to the row-wise one).
TEST(AttentionGpu, ZeroAndNegativeScale) {
  FK_SKIP_WITHOUT_GPU();
  for (const float scale : {0.0f, -0.25f}) {
    check_against_spec(DType::bf16, {1, 2, 150, 150, 64}, true, 3.0f, scale, 55, {1e-4, 1e-5});
    check_against_spec(DType::f16, {1, 1, 70, 190, 128}, false, 3.0f, scale, 56, {1e-4, 1e-5});
  }
}

TEST(AttentionSpec, LargeLogitsStayFinite) {
  Tensor q = host_tensor({1, 1, 2, 1}, DType::f32, {1e4f, -1e4f});
  Tensor k = host_tensor({1, 1, 3, 1}, DType::f32, {10, 9, -10});
  Tensor v = host_tensor({1, 1, 3, 1}, DType::f32, {1, 2, 3});
  Tensor out = Tensor::empty({1, 1, 2, 1}, DType::f32, kCpu), lse = Tensor::empty({1, 1, 2}, DType::f32, kCpu);
  attention_forward(q, k, v, out, lse, false, 1.0f);
  // Row 0: 1e5 beats 9e4 by 1e4 (weight e^-1e4 = 0): out = v0. Row 1: key 2 wins, out = v2.
  EXPECT_EQ(test::to_doubles(out), (std::vector<double>{1, 3}));
  EXPECT_EQ(test::to_doubles(lse), (std::vector<double>{1e5, 1e5}));
}

// ---------------------------------------------------------------------------------------------
// Bad inputs
// ---------------------------------------------------------------------------------------------

TEST(AttentionErrors, EachBadInputNamesItsArgument) {
  auto t = [](Dims s, DType d = DType::bf16) { return Tensor::empty(s, d, kCpu); };
  Tensor q = t({2, 4, 16, 64}), k = t({2, 4, 24, 64}), v = t({2, 4, 24, 64}), out = t({2, 4, 16, 64});
  Tensor lse = t({2, 4, 16}, DType::f32);
  const std::string op = "attention_forward";
  auto call = [&](const TensorView& q_, const TensorView& k_, const TensorView& v_, const TensorView& o_,
                  const TensorView& l_, float scale = 0.125f) {
    return [=] { attention_forward(q_, k_, v_, o_, l_, false, scale); };
  };
  EXPECT_NO_THROW(call(q, k, v, out, lse)());
  test::expect_arg_error(call(t({4, 16, 64}), k, v, out, lse), op, "q");                   // wrong rank
  test::expect_arg_error(call(t({2, 4, 16, 64}, DType::i32), k, v, out, lse), op, "q");    // not a float dtype
  Tensor q300 = t({2, 4, 16, 300}), k300 = t({2, 4, 24, 300});
  test::expect_arg_error(call(q300, k300, k300, q300, lse), op, "q");                      // head_dim > 256
  test::expect_arg_error(call(q, t({2, 4, 24, 64}, DType::f16), v, out, lse), op, "k");    // dtype mismatch
  test::expect_arg_error(call(q, t({2, 4, 24, 32}), v, out, lse), op, "k");                // head_dim mismatch
  test::expect_arg_error(call(q, t({2, 3, 24, 64}), v, out, lse), op, "k");                // heads mismatch
  test::expect_arg_error(call(q, k, t({2, 4, 23, 64}), out, lse), op, "v");                // Sk mismatch
  test::expect_arg_error(call(q, k, t({2, 4, 24, 64}, DType::f16), out, lse), op, "v");    // dtype mismatch
  test::expect_arg_error(call(q, k, v, t({2, 4, 16, 64}, DType::f32), lse), op, "out");    // dtype mismatch
  test::expect_arg_error(call(q, k, v, t({2, 4, 17, 64}), lse), op, "out");                // shape
  test::expect_arg_error(call(q, k, v, q, lse), op, "out");                                // aliases q
  test::expect_arg_error(call(q, k, v, out, t({2, 4, 16})), op, "lse");                    // bf16 lse
  test::expect_arg_error(call(q, k, v, out, t({2, 4, 16, 1}, DType::f32)), op, "lse");     // rank
  test::expect_arg_error(call(q, k, v, out, t({2, 4, 15}, DType::f32)), op, "lse");        // shape
  test::expect_arg_error(call(q, k, v, out, lse, NAN), op, "scale");
  test::expect_arg_error(call(q, k, v, out, lse, INFINITY), op, "scale");
  const TensorView every_other(q.data(), DType::bf16, {2, 4, 16, 32}, {4 * 16 * 64, 16 * 64, 64, 2}, kCpu);
  test::expect_arg_error(call(every_other, k, v, out, lse), op, "q");                      // last stride 2
  const TensorView overlapping(out.data(), DType::bf16, {2, 4, 16, 64}, {64, 64, 64, 1}, kCpu);
  test::expect_arg_error(call(q, k, v, overlapping, lse), op, "out");                      // elements share memory
}

}  // namespace
}  // namespace fk
