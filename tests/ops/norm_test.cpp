// Tests of the norm family: the spec against hand-worked values and against finite differences of
// itself, every bad input's error, and the CUDA kernels against the spec on random inputs of many
// shapes (tails, one row, long rows, padded and misaligned rows), every dtype pair.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "fusekit/fusekit.hpp"
#include "test_util.hpp"

namespace fk {
namespace {

const Device kCpu = Device::cpu();

TensorView host_view(const float* p, Dims shape) { return TensorView(const_cast<float*>(p), DType::f32, shape, kCpu); }

std::vector<float> values(const TensorView& t) { return test::to_floats(t); }

// ---------------------------------------------------------------------------------------------
// The spec against hand-worked values
// ---------------------------------------------------------------------------------------------

// Rows [2, -2, 2, -2] (mean square 4, rstd 1/2, x^ = [1, -1, 1, -1]) and [1, 1, 1, 1] (rstd 1),
// weight [1, 2, 3, 4], offset 1 (Gemma's): out = x^ * [2, 3, 4, 5].
TEST(NormSpec, ForwardByHand) {
  const float x[] = {2, -2, 2, -2, 1, 1, 1, 1}, w[] = {1, 2, 3, 4};
  float out[8], rstd[2];
  rms_norm_forward({host_view(x, {2, 4}), std::nullopt, host_view(w, {4}), host_view(out, {2, 4}), std::nullopt,
                    host_view(rstd, {2})},
                   {0.0f, 1.0f});
  EXPECT_EQ(std::vector<float>(rstd, rstd + 2), (std::vector<float>{0.5f, 1.0f}));
  EXPECT_EQ(std::vector<float>(out, out + 8), (std::vector<float>{2, -3, 4, -5, 2, 3, 4, 5}));
  // offset 0 (LLaMA's): out = x^ * w.
  rms_norm_forward({host_view(x, {2, 4}), std::nullopt, host_view(w, {4}), host_view(out, {2, 4}), std::nullopt,
                    host_view(rstd, {2})},
                   {0.0f, 0.0f});
  EXPECT_EQ(std::vector<float>(out, out + 8), (std::vector<float>{1, -2, 3, -4, 1, 2, 3, 4}));
}

TEST(NormSpec, EpsByHand) {
  // A zero row: rstd = 1 / sqrt(eps) = 2 for eps 1/4, out 0. [3, 4]: mean square 12.5, + 3.5 = 16.
  const float x[] = {0, 0, 3, 4}, w[] = {1, 1};
  float out[4], rstd[2];
  rms_norm_forward({host_view(x, {2, 2}), std::nullopt, host_view(w, {2}), host_view(out, {2, 2}), std::nullopt,
                    host_view(rstd, {2})},
                   {0.25f, 0.0f});
  EXPECT_EQ(rstd[0], 2.0f);
  EXPECT_EQ(std::vector<float>(out, out + 2), (std::vector<float>{0, 0}));
  rms_norm_forward({host_view(x + 2, {1, 2}), std::nullopt, host_view(w, {2}), host_view(out, {1, 2}), std::nullopt,
                    host_view(rstd, {1})},
                   {3.5f, 0.0f});
  EXPECT_EQ(rstd[0], 0.25f);
  EXPECT_EQ(std::vector<float>(out, out + 2), (std::vector<float>{0.75f, 1.0f}));
}

TEST(NormSpec, AddForwardByHand) {
  // s = x + residual = the rows of ForwardByHand.
  const float x[] = {1, -1, 3, -2, 0.5f, 0.5f, 0.5f, 0.5f}, r[] = {1, -1, -1, 0, 0.5f, 0.5f, 0.5f, 0.5f};
  const float w[] = {1, 2, 3, 4};
  float out[8], rout[8], rstd[2];
  rms_norm_forward({host_view(x, {2, 4}), host_view(r, {2, 4}), host_view(w, {4}), host_view(out, {2, 4}),
                    host_view(rout, {2, 4}), host_view(rstd, {2})},
                   {0.0f, 1.0f});
  EXPECT_EQ(std::vector<float>(rout, rout + 8), (std::vector<float>{2, -2, 2, -2, 1, 1, 1, 1}));
  EXPECT_EQ(std::vector<float>(rstd, rstd + 2), (std::vector<float>{0.5f, 1.0f}));
  EXPECT_EQ(std::vector<float>(out, out + 8), (std::vector<float>{2, -3, 4, -5, 2, 3, 4, 5}));
}

TEST(NormSpec, AddRoundsTheSumToXsDtype) {
  // bf16: 1 + 2^-9 rounds to 1 before it is normalized, as PyTorch's bf16 add does.
  Tensor x = test::host_tensor({1, 2}, DType::bf16, {1.0f, 1.0f});
  Tensor r = test::host_tensor({1, 2}, DType::bf16, {0x1p-9f, 0x1p-9f});
  Tensor w = test::host_tensor({2}, DType::bf16, {1.0f, 1.0f});
  Tensor out = Tensor::empty({1, 2}, DType::bf16, kCpu), rout = Tensor::empty({1, 2}, DType::bf16, kCpu);
  Tensor rstd = Tensor::empty({1}, DType::f32, kCpu);
  rms_norm_forward({x, r.view(), w, out, rout.view(), rstd}, {0.0f, 0.0f});
  EXPECT_EQ(values(rout), (std::vector<float>{1, 1}));
  EXPECT_EQ(values(rstd), (std::vector<float>{1}));
}

// f32 rows with a 16-bit out (what autocast's GEMM reads): the f32 result rounded once. Rows
// [1, 1 + 2^-10] with weight [1, 1]: out = s * rstd; 1 + 2^-10 is not a bf16, so out's second
// element rounds.
TEST(NormSpec, SixteenBitOutOfF32RowsIsTheF32ResultRounded) {
  Tensor x = test::host_tensor({1, 2}, DType::f32, {1.0f, 1.0f + 0x1p-10f});
  Tensor w = test::host_tensor({2}, DType::f32, {1.0f, 1.0f});
  Tensor out32 = Tensor::empty({1, 2}, DType::f32, kCpu), rstd = Tensor::empty({1}, DType::f32, kCpu);
  rms_norm_forward({x, std::nullopt, w, out32, std::nullopt, rstd}, {0.0f, 0.0f});
  for (DType dt : {DType::bf16, DType::f16}) {
    Tensor out = Tensor::empty({1, 2}, dt, kCpu), want = Tensor::empty({1, 2}, dt, kCpu);
    rms_norm_forward({x, std::nullopt, w, out, std::nullopt, rstd}, {0.0f, 0.0f});
    convert(out32, want);
    EXPECT_EQ(values(out), values(want)) << dtype_name(dt);
  }
  EXPECT_TRUE(rms_norm_out_dtype_allowed(DType::f32, DType::f32, DType::bf16));
  EXPECT_FALSE(rms_norm_out_dtype_allowed(DType::bf16, DType::f32, DType::bf16));  // bf16 rows: out is f32
  EXPECT_FALSE(rms_norm_out_dtype_allowed(DType::bf16, DType::bf16, DType::f32));
}

// A bf16 x added to f32 rows: s = x + residual in f32 (PyTorch's bf16 + f32), no rounding to bf16.
TEST(NormSpec, SixteenBitXAddsToF32RowsInF32) {
  Tensor x = test::host_tensor({1, 2}, DType::bf16, {1.0f, -2.0f});
  Tensor r = test::host_tensor({1, 2}, DType::f32, {0x1p-20f, 0x1p-20f});
  Tensor w = test::host_tensor({2}, DType::f32, {1.0f, 1.0f});
  Tensor out = Tensor::empty({1, 2}, DType::bf16, kCpu), rout = Tensor::empty({1, 2}, DType::f32, kCpu);
  Tensor rstd = Tensor::empty({1}, DType::f32, kCpu);
  rms_norm_forward({x, r.view(), w, out, rout.view(), rstd}, {0.0f, 0.0f});
  EXPECT_EQ(values(rout), (std::vector<float>{1.0f + 0x1p-20f, -2.0f + 0x1p-20f}));
}

// s = [2, -2, 2, -2], rstd 1/2 (x^ = [1, -1, 1, -1]), weight + 1 = [2, 3, 4, 5], dout = 1:
// g = [2, 3, 4, 5], mean(g x^) = -2 / 4, ds = (g + x^ / 2) / 2 = [1.25, 1.25, 2.25, 2.25];
// dweight = dout x^; with dresidual_out [1, 2, 3, 4] added to ds.
TEST(NormSpec, BackwardByHand) {
  const float s[] = {2, -2, 2, -2}, w[] = {1, 2, 3, 4}, rstd[] = {0.5f}, dout[] = {1, 1, 1, 1}, dr[] = {1, 2, 3, 4};
  float dx[4], dw[4];
  rms_norm_backward({host_view(dout, {1, 4}), std::nullopt, host_view(s, {1, 4}), host_view(w, {4}),
                     host_view(rstd, {1}), host_view(dx, {1, 4}), host_view(dw, {4})},
                    {0.0f, 1.0f});
  EXPECT_EQ(std::vector<float>(dx, dx + 4), (std::vector<float>{1.25f, 1.25f, 2.25f, 2.25f}));
  EXPECT_EQ(std::vector<float>(dw, dw + 4), (std::vector<float>{1, -1, 1, -1}));
  rms_norm_backward({host_view(dout, {1, 4}), host_view(dr, {1, 4}), host_view(s, {1, 4}), host_view(w, {4}),
                     host_view(rstd, {1}), host_view(dx, {1, 4}), std::nullopt},
                    {0.0f, 1.0f});
  EXPECT_EQ(std::vector<float>(dx, dx + 4), (std::vector<float>{2.25f, 3.25f, 5.25f, 6.25f}));
}

// The backward spec is the gradient of the forward spec: central differences of
// L = sum(out * G) with respect to x and weight, in f32 (h = 1e-2: truncation ~1e-4).
TEST(NormSpec, BackwardIsTheForwardsGradient) {
  const std::int64_t rows = 3, cols = 5;
  Tensor x = test::random_tensor({rows, cols}, DType::f32, kCpu, 1, -2, 2);
  Tensor w = test::random_tensor({cols}, DType::f32, kCpu, 2);
  Tensor g = test::random_tensor({rows, cols}, DType::f32, kCpu, 3);
  const RmsNormParams p{0.1f, 0.5f};
  auto loss = [&](const Tensor& xv, const Tensor& wv) {
    Tensor out = Tensor::empty({rows, cols}, DType::f32, kCpu), rstd = Tensor::empty({rows}, DType::f32, kCpu);
    rms_norm_forward({xv, std::nullopt, wv, out, std::nullopt, rstd}, p);
    double l = 0;
    for (std::int64_t i = 0; i < rows * cols; ++i) l += double{out.data_as<float>()[i]} * g.data_as<float>()[i];
    return l;
  };
  Tensor out = Tensor::empty({rows, cols}, DType::f32, kCpu), rstd = Tensor::empty({rows}, DType::f32, kCpu);
  rms_norm_forward({x, std::nullopt, w, out, std::nullopt, rstd}, p);
  Tensor dx = Tensor::empty({rows, cols}, DType::f32, kCpu), dw = Tensor::empty({cols}, DType::f32, kCpu);
  rms_norm_backward({g, std::nullopt, x, w, rstd, dx, dw.view()}, p);
  const double h = 1e-2;
  for (std::int64_t i = 0; i < rows * cols; ++i) {
    Tensor xp = x.clone(), xm = x.clone();
    xp.data_as<float>()[i] += static_cast<float>(h);
    xm.data_as<float>()[i] -= static_cast<float>(h);
    EXPECT_NEAR(dx.data_as<float>()[i], (loss(xp, w) - loss(xm, w)) / (2 * h), 2e-3) << "dx at " << i;
  }
  for (std::int64_t j = 0; j < cols; ++j) {
    Tensor wp = w.clone(), wm = w.clone();
    wp.data_as<float>()[j] += static_cast<float>(h);
    wm.data_as<float>()[j] -= static_cast<float>(h);
    EXPECT_NEAR(dw.data_as<float>()[j], (loss(x, wp) - loss(x, wm)) / (2 * h), 2e-3) << "dweight at " << j;
  }
}

TEST(NormSpec, MixedWeightGivesF32Out) {
  EXPECT_EQ(rms_norm_out_dtype(DType::bf16, DType::bf16), DType::bf16);
  EXPECT_EQ(rms_norm_out_dtype(DType::bf16, DType::f32), DType::f32);
  EXPECT_EQ(rms_norm_out_dtype(DType::f16, DType::f32), DType::f32);
  EXPECT_EQ(rms_norm_out_dtype(DType::f32, DType::f32), DType::f32);
  // bf16 x [3, 4] with an f32 weight of 1/3: out = x^ / 3 in f32, not rounded to bf16.
  Tensor x = test::host_tensor({1, 2}, DType::bf16, {3, 4});
  const float w[] = {1.0f / 3, 1.0f / 3};
  Tensor out = Tensor::empty({1, 2}, DType::f32, kCpu), rstd = Tensor::empty({1}, DType::f32, kCpu);
  rms_norm_forward({x, std::nullopt, host_view(w, {2}), out, std::nullopt, rstd}, {0.0f, 0.0f});
  const double r = static_cast<float>(1.0 / std::sqrt(12.5));
  EXPECT_FLOAT_EQ(out.data_as<float>()[0], static_cast<float>(3 * r * (1.0f / 3)));
  EXPECT_FLOAT_EQ(out.data_as<float>()[1], static_cast<float>(4 * r * (1.0f / 3)));
}

TEST(NormSpec, RowStridedByHand) {
  // x rows of stride 5 in a padded buffer; out rows of stride 6: the padding (99) stays.
  constexpr float P = 99;
  const float x[] = {2, -2, 2, -2, P, 1, 1, 1, 1, P}, w[] = {1, 1, 1, 1};
  float out[12], rstd[2];
  std::fill(std::begin(out), std::end(out), P);
  const auto rows = [](const float* p, std::int64_t ld) {
    return TensorView(const_cast<float*>(p), DType::f32, {2, 4}, {ld, 1}, kCpu);
  };
  rms_norm_forward({rows(x, 5), std::nullopt, host_view(w, {4}), rows(out, 6), std::nullopt, host_view(rstd, {2})},
                   {0.0f, 0.0f});
  EXPECT_EQ(std::vector<float>(out, out + 12), (std::vector<float>{1, -1, 1, -1, P, P, 1, 1, 1, 1, P, P}));
}

TEST(NormSpec, EmptyBackwardZeroesDweight) {
  float dw[3] = {1, 2, 3};
  const float w[] = {1, 1, 1};
  const TensorView empty(nullptr, DType::f32, {0, 3}, kCpu), no_rows(nullptr, DType::f32, {0}, kCpu);
  rms_norm_backward({empty, std::nullopt, empty, host_view(w, {3}), no_rows, empty, host_view(dw, {3})}, {});
  EXPECT_EQ(std::vector<float>(dw, dw + 3), (std::vector<float>{0, 0, 0}));
}

// ---------------------------------------------------------------------------------------------
// Bad inputs
// ---------------------------------------------------------------------------------------------

TEST(NormErrors, EachBadForwardInputNamesItsArgument) {
  const auto none = std::nullopt;
  Tensor x = Tensor::empty({4, 6}, DType::bf16, kCpu), r = Tensor::empty({4, 6}, DType::bf16, kCpu);
  Tensor w = Tensor::empty({6}, DType::bf16, kCpu), w32 = Tensor::empty({6}, DType::f32, kCpu);
  Tensor out = Tensor::empty({4, 6}, DType::bf16, kCpu), out32 = Tensor::empty({4, 6}, DType::f32, kCpu);
  Tensor rout = Tensor::empty({4, 6}, DType::bf16, kCpu), rstd = Tensor::empty({4}, DType::f32, kCpu);
  Tensor w16 = Tensor::empty({6}, DType::f16, kCpu), w5 = Tensor::empty({5}, DType::bf16, kCpu);
  Tensor xi = Tensor::empty({4, 6}, DType::i32, kCpu), r16 = Tensor::empty({4, 6}, DType::f16, kCpu);
  Tensor r5 = Tensor::empty({4, 5}, DType::bf16, kCpu), rstd3 = Tensor::empty({3}, DType::f32, kCpu);
  Tensor rstd16 = Tensor::empty({4}, DType::bf16, kCpu);
  const RmsNormParams ok{};
  auto expect = [&](const RmsNormForwardArgs& a, const std::string& arg, const RmsNormParams& p = {}) {
    test::expect_arg_error([&] { rms_norm_forward(a, p); }, a.residual ? "add_rms_norm_forward" : "rms_norm_forward",
                           arg);
  };
  expect({xi, none, w, out, none, rstd}, "x");                                        // integer x
  expect({x.view().reshape({2, 2, 6}), none, w, out, none, rstd}, "x");               // rank 3
  expect({TensorView(x.data(), DType::bf16, {4, 3}, {6, 2}, kCpu), none, w, out, none, rstd}, "x");  // inner stride 2
  expect({TensorView(x.data(), DType::bf16, {4, 6}, {5, 1}, kCpu), none, w, out, none, rstd}, "x");  // row stride < cols
  expect({TensorView(nullptr, DType::bf16, {4, 6}, kCpu), none, w, out, none, rstd}, "x");            // null data
  expect({Tensor::empty({4, 0}, DType::bf16, kCpu), none, Tensor::empty({0}, DType::bf16, kCpu),
          Tensor::empty({4, 0}, DType::bf16, kCpu), none, rstd},
         "x");                                                                        // rows of no columns
  expect({x, none, w16, out, none, rstd}, "weight");                                  // f16 weight, bf16 x
  expect({x, none, w5, out, none, rstd}, "weight");                                   // length != cols
  expect({x, none, w32, out, none, rstd}, "out");                                     // f32 weight: out is f32
  expect({x, none, w, out32, none, rstd}, "out");                                     // bf16 weight: out is bf16
  expect({x, none, w, r5, none, rstd}, "out");                                        // shape
  expect({x, none, w, out, none, rstd3}, "rstd");
  expect({x, none, w, out, none, rstd16}, "rstd");
  expect({x, none, w, out, rout.view(), rstd}, "residual_out");                       // without residual
  expect({x, r.view(), w, out, none, rstd}, "residual_out");                          // missing
  expect({x, r16.view(), w, out, rout.view(), rstd}, "residual");                     // dtype
  {
    Tensor x32 = Tensor::empty({4, 6}, DType::f32, kCpu), out16 = Tensor::empty({4, 6}, DType::f16, kCpu);
    expect({x32, r.view(), w32, out32, out32.view(), rstd}, "residual");              // f32 x, bf16 residual
    expect({x, none, w32, out16, none, rstd}, "out");   // a 16-bit out only for f32 rows (here bf16)
    expect({x32, none, w32, Tensor::empty({4, 6}, DType::i32, kCpu), none, rstd}, "out");
    EXPECT_NO_THROW(rms_norm_forward({x32, none, w32, out16, none, rstd}, ok));
    EXPECT_NO_THROW(rms_norm_forward({x, x32.view(), w32, out, out32.view(), rstd}, ok));  // bf16 x + f32 rows
  }
  expect({x, r5.view(), w, out, rout.view(), rstd}, "residual");                      // shape
  expect({x, r.view(), w, out, r16.view(), rstd}, "residual_out");                    // dtype
  expect({x, none, w, x, none, rstd}, "out");                                         // out is x
  expect({x, r.view(), w, out, r.view(), rstd}, "residual_out");                      // in place over residual
  expect({x, none, w, out, none, rstd}, "eps", {-1.0f, 0.0f});
  expect({x, none, w, out, none, rstd}, "eps", {NAN, 0.0f});
  expect({x, none, w, out, none, rstd}, "offset", {1e-6f, INFINITY});
  EXPECT_NO_THROW(rms_norm_forward({x, none, w, out, none, rstd}, ok));
}

TEST(NormErrors, EachBadBackwardInputNamesItsArgument) {
  const auto none = std::nullopt;
  Tensor s = Tensor::empty({4, 6}, DType::f16, kCpu), dout = Tensor::empty({4, 6}, DType::f16, kCpu);
  Tensor w = Tensor::empty({6}, DType::f16, kCpu), w32 = Tensor::empty({6}, DType::f32, kCpu);
  Tensor rstd = Tensor::empty({4}, DType::f32, kCpu), dx = Tensor::empty({4, 6}, DType::f16, kCpu);
  Tensor dw = Tensor::empty({6}, DType::f16, kCpu), dw32 = Tensor::empty({6}, DType::f32, kCpu);
  Tensor dout32 = Tensor::empty({4, 6}, DType::f32, kCpu), bad_shape = Tensor::empty({4, 5}, DType::f16, kCpu);
  Tensor rstd5 = Tensor::empty({5}, DType::f32, kCpu), dw7 = Tensor::empty({7}, DType::f16, kCpu);
  auto expect = [&](const RmsNormBackwardArgs& a, const std::string& arg) {
    test::expect_arg_error([&] { rms_norm_backward(a, {}); }, "rms_norm_backward", arg);
  };
  expect({dout, none, Tensor::empty({4, 6}, DType::i8, kCpu), w, rstd, dx, none}, "s");
  expect({dout, none, TensorView(s.data(), DType::f16, {4, 3}, {6, 2}, kCpu), w, rstd, dx, none}, "s");
  expect({dout, none, s, Tensor::empty({6}, DType::bf16, kCpu), rstd, dx, none}, "weight");
  expect({dout32, none, s, w, rstd, dx, none}, "dout");   // f16 weight: dout is f16
  expect({dout, none, s, w32, rstd, dx, none}, "dout");   // f32 weight: dout is f32
  expect({bad_shape, none, s, w, rstd, dx, none}, "dout");
  expect({dout, bad_shape.view(), s, w, rstd, dx, none}, "dresidual_out");
  expect({dout, dout32.view(), s, w, rstd, dx, none}, "dresidual_out");
  expect({dout, none, s, w, rstd5, dx, none}, "rstd");
  expect({dout, none, s, w, rstd, bad_shape, none}, "dx");
  expect({dout, none, s, w, rstd, dout32, none}, "dx");
  expect({dout, none, s, w, rstd, dx, dw32.view()}, "dweight");  // f16 weight: dweight is f16
  expect({dout, none, s, w, rstd, dx, dw7.view()}, "dweight");
  expect({dout, none, s, w, rstd, dout, none}, "dx");            // dx over dout
  expect({dout, none, s, w, rstd, dx, dx.view().reshape({24}).slice_rows(0, 6)}, "dx");  // dweight over dx
  EXPECT_NO_THROW(rms_norm_backward({dout, none, s, w, rstd, dx, dw.view()}, {}));
  EXPECT_NO_THROW(rms_norm_backward({dout32, none, s, w32, rstd, dx, dw32.view()}, {}));
}

TEST(NormErrors, MixedDevices) {
  FK_SKIP_WITHOUT_GPU();
  Tensor x = Tensor::empty({4, 6}, DType::f32, Device::cuda(0)), w = Tensor::empty({6}, DType::f32, kCpu);
  Tensor out = Tensor::empty({4, 6}, DType::f32, Device::cuda(0)), rstd = Tensor::empty({4}, DType::f32, Device::cuda(0));
  test::expect_arg_error([&] { rms_norm_forward({x, std::nullopt, w, out, std::nullopt, rstd}, {}); },
                         "rms_norm_forward", "weight");
}

// ---------------------------------------------------------------------------------------------
// CUDA against the spec
// ---------------------------------------------------------------------------------------------

struct Shape {
  std::int64_t rows, cols;
};

// How the [rows, cols] operands sit in memory: contiguous, rows padded to a multiple of 8
// elements plus 8 (the vector kernels still apply), or one element past an aligned address (the
// elementwise kernels).
enum class Layout { contiguous, padded, misaligned };

using Case = std::tuple<DType, bool, Shape, Layout>;  // x's dtype, f32 weight, shape, layout

class NormGpu : public ::testing::TestWithParam<Case> {};

// A device [rows, cols] view in the given layout holding host tensor h's values; `keep` owns the
// memory.
TensorView device_rows(const Tensor& h, Layout layout, std::vector<Tensor>& keep) {
  const std::int64_t rows = h.size(0), cols = h.size(1);
  const std::int64_t ld = layout == Layout::padded ? (cols + 7) / 8 * 8 + 8 : cols;
  const std::int64_t lead = layout == Layout::misaligned ? 1 : 0;
  keep.push_back(Tensor::empty({rows * ld + lead}, h.dtype(), Device::cuda(0)));
  test::poison(keep.back());
  auto* base = static_cast<unsigned char*>(keep.back().data()) + lead * static_cast<std::int64_t>(dtype_size(h.dtype()));
  const TensorView v(base, h.dtype(), {rows, cols}, {ld, 1}, Device::cuda(0));
  copy(v, h);
  return v;
}

TensorView device_out(Dims shape, DType dt, Layout layout, std::vector<Tensor>& keep) {
  Tensor h = Tensor::empty(shape, dt, kCpu);
  test::poison(h);
  return device_rows(h, layout, keep);
}

// fp32 sums in another order than the spec's double ones: rtol a few fp32 roundings per sqrt(cols)
// on top of one rounding to the dtype.
test::Tolerance out_tolerance(DType dt, std::int64_t cols) {
  test::Tolerance t = test::tolerance_for(dt);
  const double accum = 4.0 * std::sqrt(static_cast<double>(cols)) * 0x1p-24;
  return {t.atol + accum, t.rtol + accum};
}

TEST_P(NormGpu, ForwardMatchesSpec) {
  FK_SKIP_WITHOUT_GPU();
  const auto [dt, f32_weight, shape, layout] = GetParam();
  const DType wt = f32_weight ? DType::f32 : dt, ot = rms_norm_out_dtype(dt, wt);
  const Dims s{shape.rows, shape.cols};
  int seed = 10;
  for (bool add : {false, true})
    for (float offset : {0.0f, 1.0f}) {
      const RmsNormParams p{1e-5f, offset};
      Tensor x = test::random_tensor(s, dt, kCpu, ++seed, -2, 2), r = test::random_tensor(s, dt, kCpu, ++seed, -2, 2);
      Tensor w = test::random_tensor({shape.cols}, wt, kCpu, ++seed, -1.5f, 1.5f);
      Tensor want = Tensor::empty(s, ot, kCpu), want_rout = Tensor::empty(s, dt, kCpu);
      Tensor want_rstd = Tensor::empty({shape.rows}, DType::f32, kCpu);
      auto opt = [&](const TensorView& t) { return add ? std::optional<TensorView>(t) : std::nullopt; };
      reference::rms_norm_forward({x, opt(r), w, want, opt(want_rout), want_rstd}, p);

      std::vector<Tensor> keep;
      const TensorView xd = device_rows(x, layout, keep), rd = device_rows(r, layout, keep);
      const TensorView outd = device_out(s, ot, layout, keep), routd = device_out(s, dt, layout, keep);
      Tensor wd = w.copy_to(Device::cuda(0)), rstdd = Tensor::empty({shape.rows}, DType::f32, Device::cuda(0));
      test::poison(rstdd);
      rms_norm_forward({xd, opt(rd), wd, outd, opt(routd), rstdd}, p);
      const std::string what = fmt::format("add {} offset {}", add, offset);
      EXPECT_TRUE(test::all_close(rstdd, want_rstd, out_tolerance(DType::f32, shape.cols))) << what << " rstd";
      EXPECT_TRUE(test::all_close(outd, want, out_tolerance(ot, shape.cols))) << what << " out";
      if (add) {
        EXPECT_TRUE(test::all_close(routd, want_rout, test::tolerance_for(dt))) << what << " residual_out";
      }
    }
}

TEST_P(NormGpu, BackwardMatchesSpec) {
  FK_SKIP_WITHOUT_GPU();
  const auto [dt, f32_weight, shape, layout] = GetParam();
  const DType wt = f32_weight ? DType::f32 : dt, ot = rms_norm_out_dtype(dt, wt);
  const Dims s{shape.rows, shape.cols};
  int seed = 50;
  for (bool add : {false, true})
    for (bool with_dw : {true, false}) {
      const RmsNormParams p{1e-5f, add ? 1.0f : 0.0f};
      Tensor x = test::random_tensor(s, dt, kCpu, ++seed, -2, 2), w = test::random_tensor({shape.cols}, wt, kCpu, ++seed);
      Tensor dout = test::random_tensor(s, ot, kCpu, ++seed), dr = test::random_tensor(s, dt, kCpu, ++seed);
      // rstd as the forward computes it.
      Tensor out = Tensor::empty(s, ot, kCpu), rstd = Tensor::empty({shape.rows}, DType::f32, kCpu);
      reference::rms_norm_forward({x, std::nullopt, w, out, std::nullopt, rstd}, p);
      auto opt = [&](const TensorView& t) { return add ? std::optional<TensorView>(t) : std::nullopt; };
      Tensor want_dx = Tensor::empty(s, dt, kCpu), want_dw = Tensor::empty({shape.cols}, wt, kCpu);
      reference::rms_norm_backward({dout, opt(dr), x, w, rstd, want_dx, want_dw.view()}, p);

      std::vector<Tensor> keep;
      const TensorView doutd = device_rows(dout, layout, keep), drd = device_rows(dr, layout, keep);
      const TensorView xd = device_rows(x, layout, keep), dxd = device_out(s, dt, layout, keep);
      Tensor wd = w.copy_to(Device::cuda(0)), rstdd = rstd.copy_to(Device::cuda(0));
      Tensor dwd = Tensor::empty({shape.cols}, wt, Device::cuda(0));
      test::poison(dwd);
      rms_norm_backward({doutd, opt(drd), xd, wd, rstdd, dxd,
                         with_dw ? std::optional<TensorView>(dwd.view()) : std::nullopt},
                        p);
      const std::string what = fmt::format("add {} dweight {}", add, with_dw);
      // ds = rstd (g - x^ mean): the difference loses digits of g's scale (|g| <= 2.5, rstd ~ 1).
      const test::Tolerance dxt = out_tolerance(dt, shape.cols);
      EXPECT_TRUE(test::all_close(dxd, want_dx, {4 * dxt.atol, dxt.rtol})) << what << " dx";
      if (!with_dw) continue;
      // A sum over rows of terms |dout x^| <= ~2 in another order: fp32 roundings grow with rows.
      const test::Tolerance dwt = test::tolerance_for(wt);
      const double accum = 2.0 * static_cast<double>(shape.rows) * 0x1p-24;
      EXPECT_TRUE(test::all_close(dwd, want_dw, {dwt.atol + accum, dwt.rtol})) << what << " dweight";
    }
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const auto [dt, f32_weight, shape, layout] = info.param;
  const char* lay = layout == Layout::contiguous ? "contiguous" : layout == Layout::padded ? "padded" : "misaligned";
  return fmt::format("{}_w{}_{}x{}_{}", dtype_name(dt), f32_weight ? "f32" : dtype_name(dt), shape.rows, shape.cols, lay);
}

// Odd sizes (tails, elementwise kernels), LLaMA widths (vector kernels), one row, rows longer than
// the register kernels hold (32768 for the forward; 16384 for the backward of 16-bit operands,
// 8192 with f32 ones).
INSTANTIATE_TEST_SUITE_P(
    EveryDtypePair, NormGpu,
    ::testing::Combine(::testing::Values(DType::bf16, DType::f16), ::testing::Bool(),
                       ::testing::Values(Shape{1, 1}, Shape{3, 7}, Shape{5, 33}, Shape{2, 1000}, Shape{1, 4097},
                                         Shape{33, 768}, Shape{70, 4096}, Shape{3, 8192}, Shape{2, 16384},
                                         Shape{2, 20000}, Shape{2, 40000}, Shape{5, 5120}, Shape{3, 30000}),
                       ::testing::Values(Layout::contiguous, Layout::padded)),
    case_name);

INSTANTIATE_TEST_SUITE_P(
    F32, NormGpu,
    ::testing::Combine(::testing::Values(DType::f32), ::testing::Values(true),
                       ::testing::Values(Shape{1, 1}, Shape{3, 7}, Shape{5, 33}, Shape{2, 1000}, Shape{1, 4097},
                                         Shape{33, 768}, Shape{70, 4096}, Shape{3, 8192}, Shape{2, 16384},
                                         Shape{2, 40000}),
                       ::testing::Values(Layout::contiguous, Layout::padded)),
    case_name);

INSTANTIATE_TEST_SUITE_P(
    Misaligned, NormGpu,
    ::testing::Combine(::testing::Values(DType::bf16, DType::f32), ::testing::Values(true),
                       ::testing::Values(Shape{9, 64}, Shape{4, 4096}), ::testing::Values(Layout::misaligned)),
    case_name);

// Many rows: the backward's grid strides over them, and dweight sums thousands of rows; several
// rows a block (768: 8 of 32 threads in the forward; 2048: 2 of 128), each reducing on its own
// named barrier.
INSTANTIATE_TEST_SUITE_P(
    ManyRows, NormGpu,
    ::testing::Combine(::testing::Values(DType::bf16), ::testing::Bool(),
                       ::testing::Values(Shape{4099, 256}, Shape{2048, 4096}, Shape{1037, 768}, Shape{517, 2048}),
                       ::testing::Values(Layout::contiguous)),
    case_name);

// f32 rows and weight (an autocast model's residual stream): a 16-bit out and dout, a 16-bit x
// added to the f32 residual.
TEST(NormGpuMixed, SixteenBitOutAndXWithF32RowsMatchSpec) {
  FK_SKIP_WITHOUT_GPU();
  int seed = 900;
  for (const Shape shape : {Shape{1, 1}, Shape{3, 7}, Shape{5, 33}, Shape{33, 768}, Shape{70, 4096}, Shape{2, 20000},
                            Shape{2, 40000}, Shape{9, 64}})
    for (Layout layout : {Layout::contiguous, Layout::padded, Layout::misaligned})
      for (DType ot : {DType::bf16, DType::f16, DType::f32})
        for (DType xt : {DType::f32, DType::bf16, DType::f16}) {
          const Dims s{shape.rows, shape.cols};
          const RmsNormParams p{1e-5f, 0.0f};
          const std::string what = fmt::format("{}x{} layout {} out {} x {}", shape.rows, shape.cols,
                                               static_cast<int>(layout), dtype_name(ot), dtype_name(xt));
          const bool add = xt != DType::f32 || ot == DType::f32;  // x f32 also without a residual
          Tensor x = test::random_tensor(s, xt, kCpu, ++seed, -2, 2);
          Tensor r = test::random_tensor(s, DType::f32, kCpu, ++seed, -2, 2);
          Tensor w = test::random_tensor({shape.cols}, DType::f32, kCpu, ++seed, -1.5f, 1.5f);
          Tensor want = Tensor::empty(s, ot, kCpu), want_rout = Tensor::empty(s, DType::f32, kCpu);
          Tensor want_rstd = Tensor::empty({shape.rows}, DType::f32, kCpu);
          auto opt = [&](const TensorView& t) { return add ? std::optional<TensorView>(t) : std::nullopt; };
          reference::rms_norm_forward({x, opt(r), w, want, opt(want_rout), want_rstd}, p);
          std::vector<Tensor> keep;
          const TensorView xd = device_rows(x, layout, keep), rd = device_rows(r, layout, keep);
          const TensorView outd = device_out(s, ot, layout, keep), routd = device_out(s, DType::f32, layout, keep);
          Tensor wd = w.copy_to(Device::cuda(0)), rstdd = Tensor::empty({shape.rows}, DType::f32, Device::cuda(0));
          rms_norm_forward({xd, opt(rd), wd, outd, opt(routd), rstdd}, p);
          EXPECT_TRUE(test::all_close(outd, want, out_tolerance(ot, shape.cols))) << what << " out";
          if (add) {
            EXPECT_TRUE(test::all_close(routd, want_rout, test::tolerance_for(DType::f32))) << what << " rout";
          }
          if (xt != DType::f32) continue;  // the backward: f32 s with a dout of out's dtype
          Tensor dout = test::random_tensor(s, ot, kCpu, ++seed), dr = test::random_tensor(s, DType::f32, kCpu, ++seed);
          Tensor want_dx = Tensor::empty(s, DType::f32, kCpu), want_dw = Tensor::empty({shape.cols}, DType::f32, kCpu);
          // with a 16-bit dout, ds in that dtype too (dx_low: the gradient of a 16-bit x)
          const bool low = ot != DType::f32;
          Tensor want_low = Tensor::empty(s, ot, kCpu);
          const auto if_low = [&](const TensorView& t) { return low ? std::optional<TensorView>(t) : std::nullopt; };
          reference::rms_norm_backward({dout, dr.view(), x, w, want_rstd, want_dx, want_dw.view(), if_low(want_low)}, p);
          const TensorView doutd = device_rows(dout, layout, keep), drd = device_rows(dr, layout, keep);
          const TensorView sd = device_rows(x, layout, keep), dxd = device_out(s, DType::f32, layout, keep);
          const TensorView lowd = device_out(s, ot, layout, keep);
          Tensor rstd_in = want_rstd.copy_to(Device::cuda(0)), dwd = Tensor::empty({shape.cols}, DType::f32, Device::cuda(0));
          rms_norm_backward({doutd, drd, sd, wd, rstd_in, dxd, dwd.view(), if_low(lowd)}, p);
          const test::Tolerance dxt = out_tolerance(DType::f32, shape.cols);
          EXPECT_TRUE(test::all_close(dxd, want_dx, {4 * dxt.atol, dxt.rtol})) << what << " dx";
          if (low) {
            const test::Tolerance lt = out_tolerance(ot, shape.cols);
            EXPECT_TRUE(test::all_close(lowd, want_low, {4 * dxt.atol + lt.atol, lt.rtol})) << what << " dx_low";
          }
          const double accum = 2.0 * static_cast<double>(shape.rows) * 0x1p-24;
          EXPECT_TRUE(test::all_close(dwd, want_dw, {test::tolerance_for(DType::f32).atol + accum,
                                                     test::tolerance_for(DType::f32).rtol}))
              << what << " dweight";
        }
}

// dx_low: f32 s with a bf16 or f16 dout only, of dout's dtype and s's shape; by hand on the CPU,
// ds = rstd (g - x^ mean(g x^)) + dresidual_out rounded once to dout's dtype.
TEST(NormSpec, SixteenBitGradientBesideF32Rows) {
  const float s[] = {1, 2, 3, 4}, w[] = {1, 1, 1, 1}, dr[] = {0.5f, 0, 0, 0}, rstd[] = {0.5f};
  Tensor dout = test::host_tensor({1, 4}, DType::bf16, {1, 0, 0, 0});
  float dx[4];
  Tensor low = Tensor::empty({1, 4}, DType::bf16, kCpu);
  rms_norm_backward({dout, host_view(dr, {1, 4}), host_view(s, {1, 4}), host_view(w, {4}), host_view(rstd, {1}),
                     host_view(dx, {1, 4}), std::nullopt, low.view()},
                    {});
  // x^ = (0.5, 1, 1.5, 2), g = (1, 0, 0, 0), mean(g x^) = 0.125: ds = 0.5 (g - 0.125 x^) + dr
  const std::vector<double> want = {0.5 * (1 - 0.0625) + 0.5, -0.0625, -0.09375, -0.125};
  for (int j = 0; j < 4; ++j) EXPECT_FLOAT_EQ(dx[j], static_cast<float>(want[static_cast<std::size_t>(j)]));
  const std::vector<double> got = test::to_doubles(low);
  for (int j = 0; j < 4; ++j) EXPECT_EQ(got[static_cast<std::size_t>(j)], static_cast<double>(dx[j])) << j;  // exact in bf16
  const auto bad = [&](const TensorView& dout_t, const TensorView& s_t, const TensorView& low_t, const TensorView& dx_t) {
    test::expect_arg_error([&] {
      rms_norm_backward({dout_t, std::nullopt, s_t, Tensor::empty({4}, s_t.dtype(), kCpu), host_view(rstd, {1}), dx_t,
                         std::nullopt, low_t}, {});
    }, "rms_norm_backward", "dx_low");
  };
  Tensor s16 = Tensor::empty({1, 4}, DType::bf16, kCpu), dx16 = Tensor::empty({1, 4}, DType::bf16, kCpu);
  Tensor dout32 = Tensor::empty({1, 4}, DType::f32, kCpu), low16 = Tensor::empty({1, 4}, DType::f16, kCpu);
  bad(dout, s16, low, dx16);                              // 16-bit rows
  bad(dout32, host_view(s, {1, 4}), low, host_view(dx, {1, 4}));  // f32 dout
  bad(dout, host_view(s, {1, 4}), low16, host_view(dx, {1, 4}));  // not dout's dtype
  bad(dout, host_view(s, {1, 4}), Tensor::empty({1, 3}, DType::bf16, kCpu), host_view(dx, {1, 4}));  // shape
}

// The same inputs give the same bits (dweight's sums in a fixed order).
TEST(NormGpuDeterminism, BackwardTwiceGivesTheSameBits) {
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  const Dims s{3000, 1024};
  Tensor x = test::random_tensor(s, DType::bf16, gpu, 1), dout = test::random_tensor(s, DType::bf16, gpu, 2);
  Tensor w = test::random_tensor({1024}, DType::bf16, gpu, 3), rstd = Tensor::empty({3000}, DType::f32, gpu);
  Tensor out = Tensor::empty(s, DType::bf16, gpu);
  rms_norm_forward({x, std::nullopt, w, out, std::nullopt, rstd}, {});
  std::vector<std::vector<float>> dws;
  for (int i = 0; i < 2; ++i) {
    Tensor dx = Tensor::empty(s, DType::bf16, gpu), dw = Tensor::empty({1024}, DType::f32, gpu);
    Tensor w32 = Tensor::empty({1024}, DType::f32, gpu);
    convert(w, w32);
    Tensor dout32 = Tensor::empty(s, DType::f32, gpu);
    convert(dout, dout32);
    rms_norm_backward({dout32, std::nullopt, x, w32, rstd, dx, dw.view()}, {});
    dws.push_back(test::to_floats(dw));
  }
  EXPECT_EQ(dws[0], dws[1]);
}

}  // namespace
}  // namespace fk
