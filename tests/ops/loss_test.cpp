// Tests of the loss family: the spec against a hand-worked 2 x 3 case and central differences
// (label smoothing, z-loss, bias, ignored rows), the GPU path against the spec on random shapes
// (one row, odd N, V = 5 / 999 / 1000 / 32000 / 32003, chunk boundaries, ignored rows, f32 / bf16 /
// f16, TF32, no dw), and every bad input.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "fusekit/fusekit.hpp"
#include "test_util.hpp"

namespace fk {
namespace {

const Device kCpu = Device::cpu();
constexpr const char* kOp = "linear_cross_entropy";

Tensor host_targets(const std::vector<std::int64_t>& t) {
  Tensor out = Tensor::empty({static_cast<std::int64_t>(t.size())}, DType::i64, kCpu);
  for (std::size_t i = 0; i < t.size(); ++i) out.data_as<std::int64_t>()[i] = t[i];
  return out;
}

float scalar(const Tensor& t) { return test::to_floats(t.view())[0]; }

// ---------------------------------------------------------------------------------------------
// The spec
// ---------------------------------------------------------------------------------------------

// h = I (2 x 2), w = [[1, 0], [0, 1], [0, 0]], b = 0: z = [[1, 0, 0], [0, 1, 0]], both rows with
// lse = log(e + 2).
struct TwoByThree {
  Tensor h = test::host_tensor({2, 2}, DType::f32, {1, 0, 0, 1});
  Tensor w = test::host_tensor({3, 2}, DType::f32, {1, 0, 0, 1, 0, 0});
  Tensor b = test::host_tensor({3}, DType::f32, {0, 0, 0});
  Tensor loss = Tensor::empty({}, DType::f32, kCpu);
  Tensor dh = Tensor::empty({2, 2}, DType::f32, kCpu);
  Tensor dw = Tensor::empty({3, 2}, DType::f32, kCpu);
  Tensor db = Tensor::empty({3}, DType::f32, kCpu);
  void run(const Tensor& targets, const LinearCrossEntropyParams& p) {
    linear_cross_entropy({h, w, b.view(), targets, loss, dh.view(), dw.view(), db.view()}, p);
  }
};

TEST(LossSpec, TwoByThreeByHand) {
  TwoByThree c;
  c.run(host_targets({0, 2}), {});
  const double e = std::exp(1.0), lse = std::log(e + 2.0);
  // Row 0: target 0 (z = 1), loss lse - 1; row 1: target 2 (z = 0), loss lse; mean over 2.
  EXPECT_NEAR(scalar(c.loss), (2 * lse - 1) / 2, 1e-6);
  // g0 = ([e, 1, 1] / (e + 2) - [1, 0, 0]) / 2, g1 = ([1, e, 1] / (e + 2) - [0, 0, 1]) / 2.
  const double s = e + 2.0;
  const double g0[3] = {(e / s - 1) / 2, (1 / s) / 2, (1 / s) / 2};
  const double g1[3] = {(1 / s) / 2, (e / s) / 2, (1 / s - 1) / 2};
  const std::vector<float> dh = test::to_floats(c.dh.view()), dw = test::to_floats(c.dw.view()),
                           db = test::to_floats(c.db.view());
  // dh_i = g_i w: the first two classes' entries.
  EXPECT_NEAR(dh[0], g0[0], 1e-6);
  EXPECT_NEAR(dh[1], g0[1], 1e-6);
  EXPECT_NEAR(dh[2], g1[0], 1e-6);
  EXPECT_NEAR(dh[3], g1[1], 1e-6);
  // dw_j = Σ_i g_ij h_i = [g0_j, g1_j] (h = I); dbias = g0 + g1.
  for (int j = 0; j < 3; ++j) {
    EXPECT_NEAR(dw[2 * j], g0[j], 1e-6);
    EXPECT_NEAR(dw[2 * j + 1], g1[j], 1e-6);
    EXPECT_NEAR(db[j], g0[j] + g1[j], 1e-6);
  }
}

TEST(LossSpec, TwoByThreeSmoothingZLossIgnoreSum) {
  TwoByThree c;
  LinearCrossEntropyParams p;
  p.label_smoothing = 0.25f;
  p.z_loss = 0.5f;
  p.reduction = LossReduction::sum;
  c.run(host_targets({-100, 1}), p);
  const double e = std::exp(1.0), lse = std::log(e + 2.0), s = e + 2.0;
  // Row 1 only: 0.75 (lse - 1) + 0.25 (lse - 1/3) + 0.5 lse².
  EXPECT_NEAR(scalar(c.loss), 0.75 * (lse - 1) + 0.25 * (lse - 1.0 / 3) + 0.5 * lse * lse, 1e-6);
  const double p1[3] = {1 / s, e / s, 1 / s};
  const std::vector<float> dh = test::to_floats(c.dh.view()), db = test::to_floats(c.db.view());
  EXPECT_EQ(dh[0], 0.0f);  // the ignored row
  EXPECT_EQ(dh[1], 0.0f);
  for (int j = 0; j < 3; ++j) {
    const double g = p1[j] * (1 + 2 * 0.5 * lse) - (j == 1 ? 0.75 : 0.0) - 0.25 / 3;
    EXPECT_NEAR(db[j], g, 1e-6);
    if (j < 2) {
      EXPECT_NEAR(dh[2 + j], g, 1e-6);
    }
  }
}

TEST(LossSpec, AllIgnoredMeanIsNaNSumIsZero) {
  TwoByThree c;
  c.run(host_targets({-100, -100}), {});
  EXPECT_TRUE(std::isnan(scalar(c.loss)));
  for (float g : test::to_floats(c.dw.view())) EXPECT_EQ(g, 0.0f);
  LinearCrossEntropyParams p;
  p.reduction = LossReduction::sum;
  c.run(host_targets({-100, -100}), p);
  EXPECT_EQ(scalar(c.loss), 0.0f);
}

TEST(LossSpec, GradientsMatchCentralDifferences) {
  const std::int64_t n = 5, hd = 4, v = 7;
  for (const auto& [eps, zeta] : {std::pair{0.0f, 0.0f}, std::pair{0.2f, 0.0f}, std::pair{0.1f, 1e-2f}}) {
    LinearCrossEntropyParams p;
    p.label_smoothing = eps;
    p.z_loss = zeta;
    p.ignore_index = 3;
    Tensor h = test::random_tensor({n, hd}, DType::f32, kCpu, 1);
    Tensor w = test::random_tensor({v, hd}, DType::f32, kCpu, 2);
    Tensor b = test::random_tensor({v}, DType::f32, kCpu, 3);
    const Tensor targets = host_targets({0, 3, 6, 2, 3});  // two rows ignored
    Tensor loss = Tensor::empty({}, DType::f32, kCpu), dh = Tensor::empty({n, hd}, DType::f32, kCpu),
           dw = Tensor::empty({v, hd}, DType::f32, kCpu), db = Tensor::empty({v}, DType::f32, kCpu);
    linear_cross_entropy({h, w, b.view(), targets, loss, dh.view(), dw.view(), db.view()}, p);
    auto value = [&] {
      Tensor l = Tensor::empty({1}, DType::f32, kCpu);
      linear_cross_entropy({h, w, b.view(), targets, l, std::nullopt, std::nullopt, std::nullopt}, p);
      return double(scalar(l));
    };
    auto check = [&](Tensor& param, const Tensor& grad, const char* name) {
      for (std::int64_t i = 0; i < param.numel(); ++i) {
        float* q = param.data_as<float>() + i;
        const float keep = *q, step = 1e-2f;
        *q = keep + step;
        const double up = value();
        *q = keep - step;
        const double down = value();
        *q = keep;
        EXPECT_NEAR(grad.data_as<float>()[i], (up - down) / (2 * step), 2e-4) << name << "[" << i << "] eps " << p.label_smoothing;
      }
    };
    check(h, dh, "dh");
    check(w, dw, "dw");
    check(b, db, "dbias");
  }
}

TEST(LossSpec, OptionalOutputsAndEmpty) {
  // N = 0: the mean is NaN, the sum 0, dw and dbias zero.
  const Tensor h = Tensor::empty({0, 3}, DType::f32, kCpu);
  const Tensor w = test::random_tensor({4, 3}, DType::f32, kCpu, 1);
  const Tensor b = test::random_tensor({4}, DType::f32, kCpu, 2);
  const Tensor t = Tensor::empty({0}, DType::i64, kCpu);
  Tensor loss = Tensor::empty({}, DType::f32, kCpu), dw = Tensor::empty({4, 3}, DType::f32, kCpu),
         db = Tensor::empty({4}, DType::f32, kCpu);
  test::poison(dw.view());
  linear_cross_entropy({h, w, b.view(), t, loss, std::nullopt, dw.view(), db.view()}, {});
  EXPECT_TRUE(std::isnan(scalar(loss)));
  for (float g : test::to_floats(dw.view())) EXPECT_EQ(g, 0.0f);
}

// ---------------------------------------------------------------------------------------------
// Bad input
// ---------------------------------------------------------------------------------------------

TEST(LossErrors, EveryBadArgumentIsNamed) {
  const Tensor h = test::random_tensor({2, 4}, DType::f32, kCpu, 1);
  const Tensor w = test::random_tensor({5, 4}, DType::f32, kCpu, 2);
  const Tensor b = test::random_tensor({5}, DType::f32, kCpu, 3);
  const Tensor t = host_targets({1, 4});
  Tensor loss = Tensor::empty({}, DType::f32, kCpu);
  Tensor dh = Tensor::empty({2, 4}, DType::f32, kCpu);
  auto run = [&](LinearCrossEntropyArgs a, LinearCrossEntropyParams p = {}) { linear_cross_entropy(a, p); };
  const LinearCrossEntropyArgs good{h, w, b.view(), t, loss, dh.view(), std::nullopt, std::nullopt};
  EXPECT_NO_THROW(run(good));

  const Tensor h16 = test::random_tensor({2, 4}, DType::bf16, kCpu, 1);
  const Tensor hi8 = Tensor::empty({2, 4}, DType::i8, kCpu);
  const Tensor w3 = test::random_tensor({5, 3}, DType::f32, kCpu, 2);
  const Tensor b4 = test::random_tensor({4}, DType::f32, kCpu, 3);
  const Tensor t32 = Tensor::empty({2}, DType::i32, kCpu);
  const Tensor t3 = host_targets({1, 2, 3});
  const Tensor loss16 = Tensor::empty({}, DType::bf16, kCpu);
  const Tensor loss2 = Tensor::empty({2}, DType::f32, kCpu);
  const Tensor dw_bad = Tensor::empty({5, 3}, DType::f32, kCpu);
  const Tensor db = Tensor::empty({5}, DType::f32, kCpu);
  auto with = [&](auto f) {
    LinearCrossEntropyArgs a = good;
    f(a);
    return a;
  };
  test::expect_arg_error([&] { run(with([&](auto& a) { a.h = hi8; })); }, kOp, "h");
  test::expect_arg_error([&] { run(with([&](auto& a) { a.w = h16; })); }, kOp, "w");      // dtype
  test::expect_arg_error([&] { run(with([&](auto& a) { a.w = w3; })); }, kOp, "w");       // H
  test::expect_arg_error([&] { run(with([&](auto& a) { a.bias = b4.view(); })); }, kOp, "bias");
  test::expect_arg_error([&] { run(with([&](auto& a) { a.targets = t32; })); }, kOp, "targets");
  test::expect_arg_error([&] { run(with([&](auto& a) { a.targets = t3; })); }, kOp, "targets");
  test::expect_arg_error([&] { run(with([&](auto& a) { a.loss = loss16; })); }, kOp, "loss");
  test::expect_arg_error([&] { run(with([&](auto& a) { a.loss = loss2; })); }, kOp, "loss");
  test::expect_arg_error([&] { run(with([&](auto& a) { a.dw = dw_bad.view(); })); }, kOp, "dw");
  test::expect_arg_error([&] { run(with([&](auto& a) { a.dh = h.view(); })); }, kOp, "dh");  // overlaps h
  test::expect_arg_error([&] { run(with([&](auto& a) { a.bias.reset(); a.dbias = db.view(); })); }, kOp, "dbias");
  test::expect_arg_error([&] { run(good, {.label_smoothing = 1.5f}); }, kOp, "label_smoothing");
  test::expect_arg_error([&] { run(good, {.label_smoothing = NAN}); }, kOp, "label_smoothing");
  test::expect_arg_error([&] { run(good, {.z_loss = -1.0f}); }, kOp, "z_loss");
  test::expect_arg_error([&] { run(good, {.chunk_rows = -1}); }, kOp, "chunk_rows");
  test::expect_arg_error([&] { (void)parse_loss_reduction("none", kOp); }, kOp, "reduction");
  // A target outside [0, V) that is not ignore_index, named with its row and value.
  const Tensor t_bad = host_targets({1, 5});
  test::expect_error_mentions([&] { run(with([&](auto& a) { a.targets = t_bad; })); }, {"targets", "5 at row 1"});
  const Tensor t_neg = host_targets({-1, 0});
  test::expect_arg_error([&] { run(with([&](auto& a) { a.targets = t_neg; })); }, kOp, "targets");
}

// Chunks of about 512 MiB of 16-bit logits (256 MiB of f32 ones), and of at least 4096 rows (the
// f32 dW accumulator's re-reads); 16-bit: one chunk up to 1 GiB of logits.
TEST(LossChunks, AutomaticChunkKeepsLogitsNearTheBudget) {
  EXPECT_EQ(linear_cross_entropy_chunk_rows(1, 32000), 1);
  EXPECT_EQ(linear_cross_entropy_chunk_rows(100, 32000), 100);
  EXPECT_EQ(linear_cross_entropy_chunk_rows(8192, 32000), 4096);           // f32: 2097 rows by bytes
  EXPECT_EQ(linear_cross_entropy_chunk_rows(8400, 32000), 2800);           // f32: 3 equal chunks
  EXPECT_EQ(linear_cross_entropy_chunk_rows(8192, 32000, 0, DType::bf16), 4096);   // bf16: 500 MiB, two chunks
  EXPECT_EQ(linear_cross_entropy_chunk_rows(4096, 32000, 0, DType::bf16), 4096);   // bf16: 250 MiB, one chunk
  EXPECT_EQ(linear_cross_entropy_chunk_rows(12288, 32000, 0, DType::bf16), 6144);  // bf16: 750 MiB, two chunks
  EXPECT_EQ(linear_cross_entropy_chunk_rows(16384, 32000, 0, DType::bf16), 16384); // bf16: 1000 MiB, one chunk
  EXPECT_EQ(linear_cross_entropy_chunk_rows(8192, 128256, 0, DType::bf16), 4096);  // bf16: 2093 by bytes
  EXPECT_EQ(linear_cross_entropy_chunk_rows(6000, 128256, 0, DType::bf16), 3000);  // equal chunks
  const std::int64_t c = linear_cross_entropy_chunk_rows(65536, 8000);
  EXPECT_LE(c * 8000 * 4, (std::int64_t{256} << 20) + 8 * 8000 * 4);
  EXPECT_GE(c * 8000 * 4, std::int64_t{128} << 20);
  EXPECT_EQ(c % 8, 0);
  const std::int64_t c16 = linear_cross_entropy_chunk_rows(65536, 32000, 0, DType::bf16);  // 2-byte logits
  EXPECT_EQ(c16, 8192);  // 8 chunks of 500 MiB
  EXPECT_EQ(linear_cross_entropy_chunk_rows(8192, 32000, 100), 100);
  EXPECT_EQ(linear_cross_entropy_chunk_rows(10, 32000, 100), 10);
  // One chunk where its logits fit in 1 GiB plus the f32 accumulators it does not need: V 128256,
  // H 2048 at 8192 rows (2004 MiB against 1024 + 1002), not at 8400.
  const std::int64_t acc = 4 * 128256 * 2048;
  EXPECT_EQ(linear_cross_entropy_chunk_rows(8192, 128256, 0, DType::bf16, acc), 8192);
  EXPECT_EQ(linear_cross_entropy_chunk_rows(8400, 128256, 0, DType::bf16, acc), 2800);  // 3 equal chunks
  EXPECT_EQ(linear_cross_entropy_chunk_rows(32768, 32000, 0, DType::bf16, 4 * 32000 * 2048), 8192);
  EXPECT_EQ(linear_cross_entropy_chunk_rows(8192, 128256, 100, DType::bf16, acc), 100);  // chunk_rows decides
}

// ---------------------------------------------------------------------------------------------
// The GPU path against the spec
// ---------------------------------------------------------------------------------------------

struct GpuCase {
  std::int64_t n, hd, v;
  DType dtype;
  bool bias;
  float smoothing, zeta;
  LossReduction reduction;
  std::int64_t chunk_rows;  // 0: automatic
  bool with_dw;
  bool tf32 = false;
};

std::string case_name(const GpuCase& c) {
  return fmt::format("N{}_H{}_V{}_{}{}_eps{}_z{}_{}_chunk{}{}{}", c.n, c.hd, c.v, dtype_name(c.dtype),
                     c.bias ? "_bias" : "", c.smoothing, c.zeta, loss_reduction_name(c.reduction), c.chunk_rows,
                     c.with_dw ? "" : "_nodw", c.tf32 ? "_tf32" : "");
}

double grad_bound(DType t, bool tf32) {
  // g rounded once to the dtype before two f32-accumulated GEMMs (one more rounding at the store).
  if (t == DType::bf16) return 1e-2;
  if (t == DType::f16) return 2e-3;
  return tf32 ? 5e-3 : 1e-4;
}

class LossGpu : public ::testing::TestWithParam<GpuCase> {};

TEST_P(LossGpu, MatchesSpec) {
  FK_SKIP_WITHOUT_GPU();
  const GpuCase c = GetParam();
  const Device gpu = Device::cuda(0);
  const float scale = 2.0f / std::sqrt(static_cast<float>(c.hd));  // logits of order a few units
  const Tensor h = test::random_tensor({c.n, c.hd}, c.dtype, kCpu, 11, -scale, scale);
  const Tensor w = test::random_tensor({c.v, c.hd}, c.dtype, kCpu, 12, -1.0f, 1.0f);
  const Tensor b = test::random_tensor({c.v}, c.dtype, kCpu, 13, -1.0f, 1.0f);
  Tensor targets = Tensor::empty({c.n}, DType::i64, kCpu);
  const std::vector<float> u = test::to_floats(test::random_tensor({c.n}, DType::f32, kCpu, 14, 0.0f, 1.0f).view());
  for (std::int64_t i = 0; i < c.n; ++i)  // about one row in five ignored
    targets.data_as<std::int64_t>()[i] =
        u[static_cast<std::size_t>(i)] < 0.2f ? -100 : std::min<std::int64_t>(c.v - 1, static_cast<std::int64_t>(u[static_cast<std::size_t>(i)] * c.v));
  LinearCrossEntropyParams p;
  p.label_smoothing = c.smoothing;
  p.z_loss = c.zeta;
  p.reduction = c.reduction;
  p.chunk_rows = c.chunk_rows;
  p.allow_tf32 = c.tf32;

  auto outputs = [&](Device d) {
    struct Out {
      Tensor loss, dh, dw, db;
    } o{Tensor::empty({}, DType::f32, d), Tensor::empty({c.n, c.hd}, c.dtype, d),
        Tensor::empty({c.v, c.hd}, c.dtype, d), Tensor::empty({c.v}, c.dtype, d)};
    test::poison(o.loss.view());
    test::poison(o.dh.view());
    test::poison(o.dw.view());
    test::poison(o.db.view());
    return o;
  };
  auto ref = outputs(kCpu);
  const std::optional<TensorView> ref_b = c.bias ? std::optional(b.view()) : std::nullopt;
  linear_cross_entropy({h, w, ref_b, targets, ref.loss, ref.dh.view(),
                        c.with_dw ? std::optional(ref.dw.view()) : std::nullopt,
                        c.bias && c.with_dw ? std::optional(ref.db.view()) : std::nullopt},
                       p);

  const Tensor hg = h.copy_to(gpu), wg = w.copy_to(gpu), bg = b.copy_to(gpu), tg = targets.copy_to(gpu);
  auto got = outputs(gpu);
  linear_cross_entropy({hg, wg, c.bias ? std::optional(bg.view()) : std::nullopt, tg, got.loss, got.dh.view(),
                        c.with_dw ? std::optional(got.dw.view()) : std::nullopt,
                        c.bias && c.with_dw ? std::optional(got.db.view()) : std::nullopt},
                       p);
  const double want = scalar(ref.loss), have = scalar(got.loss);
  if (std::isnan(want)) {  // every row ignored (N1's one row is): a mean over no rows, NaN as in the spec
    EXPECT_TRUE(std::isnan(have)) << case_name(c);
  } else {
    // 16-bit operands: the logits are rounded to the dtype once (as F.linear's are).
    const double rel = c.dtype == DType::bf16 ? 2e-2 : c.dtype == DType::f16 ? 4e-3 : c.tf32 ? 2e-3 : 1e-4;
    EXPECT_NEAR(have, want, rel * std::max(1.0, std::abs(want))) << case_name(c);
  }
  const double bound = grad_bound(c.dtype, c.tf32);
  EXPECT_LE(test::rel_err_normwise(got.dh.view(), ref.dh.view()), bound) << "dh " << case_name(c);
  if (c.with_dw) {
    EXPECT_LE(test::rel_err_normwise(got.dw.view(), ref.dw.view()), bound) << "dw " << case_name(c);
  }
  if (c.with_dw && c.bias) {
    EXPECT_LE(test::rel_err_normwise(got.db.view(), ref.db.view()), bound) << "dbias " << case_name(c);
  }
}

std::vector<GpuCase> gpu_cases() {
  using R = LossReduction;
  std::vector<GpuCase> out;
  for (DType t : {DType::f32, DType::bf16, DType::f16}) {
    out.push_back({1, 64, 1000, t, false, 0.0f, 0.0f, R::mean, 0, true});
    out.push_back({37, 96, 999, t, true, 0.0f, 0.0f, R::mean, 0, true});
    out.push_back({37, 96, 999, t, true, 0.1f, 1e-3f, R::sum, 8, true});   // chunks 8, 8, 8, 8, 5
    out.push_back({37, 40, 5, t, true, 0.3f, 1e-2f, R::mean, 1, true});    // one row a chunk, V < 8
    out.push_back({64, 64, 1000, t, false, 0.0f, 0.0f, R::mean, 16, false});
    out.push_back({17, 64, 32000, t, true, 0.1f, 1e-4f, R::mean, 0, true});
    out.push_back({21, 32, 32003, t, true, 0.0f, 0.0f, R::sum, 7, true});  // odd V, odd chunks
    // The row kernel's sizes: a row held in 256, 512 or 1024 threads' registers, or read twice.
    out.push_back({13, 32, 12001, t, false, 0.1f, 0.0f, R::mean, 0, true});
    out.push_back({11, 32, 40000, t, true, 0.0f, 1e-4f, R::mean, 0, true});
    out.push_back({9, 32, 66000, t, true, 0.1f, 1e-3f, R::mean, 0, true});
  }
  out.push_back({37, 96, 999, DType::f32, true, 0.1f, 0.0f, R::mean, 8, true, true});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Shapes, LossGpu, ::testing::ValuesIn(gpu_cases()),
                         [](const auto& info) {
                           std::string s = case_name(info.param);
                           for (char& ch : s)
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return s;
                         });

TEST(LossGpuTargets, BadTargetIsAnErrorOrNaN) {
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  const Tensor h = test::random_tensor({3, 8}, DType::bf16, gpu, 1);
  const Tensor w = test::random_tensor({10, 8}, DType::bf16, gpu, 2);
  const Tensor t = host_targets({1, 10, -100}).copy_to(gpu);
  Tensor loss = Tensor::empty({}, DType::f32, gpu), dh = Tensor::empty({3, 8}, DType::bf16, gpu);
  const LinearCrossEntropyArgs a{h, w, std::nullopt, t, loss, dh.view(), std::nullopt, std::nullopt};
  test::expect_error_mentions([&] { linear_cross_entropy(a, {}); }, {"targets", "10 at row 1"});
  LinearCrossEntropyParams p;
  p.check_targets = false;
  linear_cross_entropy(a, p);
  EXPECT_TRUE(std::isnan(scalar(loss)));
  const std::vector<float> g = test::to_floats(dh.view());
  EXPECT_TRUE(std::isnan(g[8]));  // row 1
  EXPECT_EQ(g[16], 0.0f);         // row 2, ignored
}

TEST(LossGpuTargets, AllIgnoredAndEmpty) {
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  const Tensor h = test::random_tensor({3, 8}, DType::f32, gpu, 1);
  const Tensor w = test::random_tensor({10, 8}, DType::f32, gpu, 2);
  const Tensor t = host_targets({-100, -100, -100}).copy_to(gpu);
  Tensor loss = Tensor::empty({}, DType::f32, gpu), dw = Tensor::empty({10, 8}, DType::f32, gpu);
  linear_cross_entropy({h, w, std::nullopt, t, loss, std::nullopt, dw.view(), std::nullopt}, {});
  EXPECT_TRUE(std::isnan(scalar(loss)));
  for (float g : test::to_floats(dw.view())) EXPECT_EQ(g, 0.0f);
  const Tensor h0 = Tensor::empty({0, 8}, DType::bf16, gpu);
  const Tensor w16 = test::random_tensor({10, 8}, DType::bf16, gpu, 2);
  const Tensor t0 = Tensor::empty({0}, DType::i64, gpu);
  Tensor dw16 = Tensor::empty({10, 8}, DType::bf16, gpu);
  test::poison(dw16.view());
  linear_cross_entropy({h0, w16, std::nullopt, t0, loss, std::nullopt, dw16.view(), std::nullopt},
                       {.reduction = LossReduction::sum});
  EXPECT_EQ(scalar(loss), 0.0f);
  for (float g : test::to_floats(dw16.view())) EXPECT_EQ(g, 0.0f);
}

}  // namespace
}  // namespace fk
