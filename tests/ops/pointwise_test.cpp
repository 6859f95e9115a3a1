// Tests of the pointwise family: the spec against hand-worked values (the 8x10 bias + act example and
// values worked out by hand), the CUDA kernels against the spec on random inputs of many shapes,
// and every bad input.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <tuple>

#include "fusekit/fusekit.hpp"
#include "ops/pointwise/bias_act_example.hpp"
#include "test_util.hpp"

namespace fk {
namespace {

const Device kCpu = Device::cpu();

TensorView host_view(const float* p, Dims shape) {
  return TensorView(const_cast<float*>(p), DType::f32, shape, kCpu);
}

// ---------------------------------------------------------------------------------------------
// The spec against hand-worked values
// ---------------------------------------------------------------------------------------------

TEST(PointwiseSpec, BiasActExampleInPlace) {
  using namespace examples;
  Tensor x = Tensor::adopt(host_view(kBiasActX, {kBiasActRows, kBiasActCols}), nullptr).clone();
  const TensorView r = host_view(kBiasActR, {kBiasActRows, kBiasActCols});
  const TensorView b = host_view(kBiasActBias, {kBiasActCols});
  bias_act_forward({x, r, b, x, std::nullopt}, {Activation::relu, kBiasActAlpha});
  const TensorView want = host_view(kBiasActExpected, {kBiasActRows, kBiasActCols});
  EXPECT_TRUE(test::all_close(x, want, {kBiasActTolerance, 0.0}));
}

TEST(PointwiseSpec, ActivationsAtHandWorkedPoints) {
  using reference::activation;
  using reference::activation_grad;
  EXPECT_EQ(activation(Activation::relu, -1.5), 0.0);
  EXPECT_EQ(activation(Activation::relu, 2.5), 2.5);
  EXPECT_TRUE(std::isnan(activation(Activation::relu, NAN)));
  EXPECT_DOUBLE_EQ(activation(Activation::sigmoid, 0.0), 0.5);
  EXPECT_NEAR(activation(Activation::sigmoid, 2.0), 0.8807970779778823, 1e-15);
  EXPECT_NEAR(activation(Activation::tanh, 0.5), 0.46211715726000974, 1e-15);
  EXPECT_NEAR(activation(Activation::gelu_erf, 1.0), 0.8413447460685429, 1e-15);   // Phi(1)
  EXPECT_NEAR(activation(Activation::gelu_tanh, 1.0), 0.8411919906082768, 1e-15);
  EXPECT_NEAR(activation(Activation::silu, 1.0), 0.7310585786300049, 1e-15);
  EXPECT_NEAR(activation_grad(Activation::sigmoid, 0.0), 0.25, 1e-15);
  EXPECT_NEAR(activation_grad(Activation::tanh, 0.0), 1.0, 1e-15);
  EXPECT_NEAR(activation_grad(Activation::gelu_erf, 0.0), 0.5, 1e-15);
  EXPECT_NEAR(activation_grad(Activation::silu, 0.0), 0.5, 1e-15);
  // Every derivative against a central difference.
  for (Activation a : {Activation::identity, Activation::sigmoid, Activation::tanh, Activation::gelu_tanh,
                       Activation::gelu_erf, Activation::silu})
    for (double z : {-3.1, -0.7, 0.3, 1.9}) {
      const double h = 1e-6;
      const double fd = (activation(a, z + h) - activation(a, z - h)) / (2 * h);
      EXPECT_NEAR(activation_grad(a, z), fd, 1e-8) << activation_name(a) << " at " << z;
    }
}

TEST(PointwiseSpec, BackwardByHand) {
  // z = [[-1, 2], [3, -4]], relu, alpha 2: dz = dy * [[0, 1], [1, 0]].
  const float y[] = {0, 2, 3, 0}, dy[] = {10, 20, 30, 40};
  float dx[4], dr[4], db[2];
  bias_act_backward({host_view(dy, {2, 2}), host_view(y, {2, 2}), SavedForBackward::output, host_view(dx, {2, 2}),
                     host_view(dr, {2, 2}), host_view(db, {2})},
                    {Activation::relu, 2.0f});
  EXPECT_EQ(std::vector<float>(dx, dx + 4), (std::vector<float>{0, 20, 30, 0}));
  EXPECT_EQ(std::vector<float>(dr, dr + 4), (std::vector<float>{0, 40, 60, 0}));
  EXPECT_EQ(std::vector<float>(db, db + 2), (std::vector<float>{30, 20}));
}

TEST(PointwiseSpec, ForwardWritesPreactivationAndSkipsAbsentOperands) {
  const float x[] = {1, -2, 3}, b[] = {0.5f, 0.5f, 0.5f};
  float y[3], z[3];
  bias_act_forward({host_view(x, {1, 3}), std::nullopt, host_view(b, {3}), host_view(y, {1, 3}), host_view(z, {1, 3})},
                   {Activation::relu, 7.0f});
  EXPECT_EQ(std::vector<float>(z, z + 3), (std::vector<float>{1.5f, -1.5f, 3.5f}));
  EXPECT_EQ(std::vector<float>(y, y + 3), (std::vector<float>{1.5f, 0.0f, 3.5f}));
}

// Row-strided tensors: each [rows, cols] operand lives in a buffer of its own row stride; the
// padding (99) must come back untouched.
TEST(PointwiseSpec, ForwardRowStridedByHand) {
  constexpr float P = 99;
  const float x[] = {1, -2, 3, P, 4, 5, -6, P};            // row stride 4
  const float r[] = {1, 1, 1, P, P, 2, 2, 2, P, P};        // row stride 5
  const float b[] = {0.5f, -1, 0};
  float y[12], z[6];                                       // row strides 6 and 3
  std::fill(std::begin(y), std::end(y), P);
  const auto rows = [](const float* p, std::int64_t ld) {
    return TensorView(const_cast<float*>(p), DType::f32, {2, 3}, {ld, 1}, kCpu);
  };
  bias_act_forward({rows(x, 4), rows(r, 5), host_view(b, {3}), rows(y, 6), rows(z, 3)}, {Activation::relu, 0.5f});
  EXPECT_EQ(std::vector<float>(z, z + 6), (std::vector<float>{2, -2.5f, 3.5f, 5.5f, 5, -5}));
  EXPECT_EQ(std::vector<float>(y, y + 12), (std::vector<float>{2, 0, 3.5f, P, P, P, 5.5f, 5, 0, P, P, P}));
}

TEST(PointwiseSpec, BackwardRowStridedByHand) {
  // y as in ForwardRowStridedByHand; relu, alpha 2: dz = dy * (y > 0).
  constexpr float P = 99;
  const float dy[] = {1, 2, 3, P, 4, 5, 6, P};  // row stride 4
  const float y[] = {2, 0, 3.5f, 5.5f, 5, 0};   // row stride 3
  float dx[10], dr[8], db[3];                   // row strides 5 and 4
  std::fill(std::begin(dx), std::end(dx), P);
  std::fill(std::begin(dr), std::end(dr), P);
  const auto rows = [](const float* p, std::int64_t ld) {
    return TensorView(const_cast<float*>(p), DType::f32, {2, 3}, {ld, 1}, kCpu);
  };
  bias_act_backward({rows(dy, 4), rows(y, 3), SavedForBackward::output, rows(dx, 5), rows(dr, 4), host_view(db, {3})},
                    {Activation::relu, 2.0f});
  EXPECT_EQ(std::vector<float>(dx, dx + 10), (std::vector<float>{1, 0, 3, P, P, 4, 5, 0, P, P}));
  EXPECT_EQ(std::vector<float>(dr, dr + 8), (std::vector<float>{2, 0, 6, P, 8, 10, 0, P}));
  EXPECT_EQ(std::vector<float>(db, db + 3), (std::vector<float>{5, 5, 3}));
}

TEST(PointwiseSpec, RowStridedInPlace) {
  // y is x itself, a view of columns [0, 2) of a [2, 3] buffer.
  float x[] = {-1, 2, 7, 3, -4, 7};
  const TensorView v(x, DType::f32, {2, 2}, {3, 1}, kCpu);
  bias_act_forward({v, std::nullopt, std::nullopt, v, std::nullopt}, {Activation::relu, 1.0f});
  EXPECT_EQ(std::vector<float>(x, x + 6), (std::vector<float>{0, 2, 7, 3, 0, 7}));
}

TEST(PointwiseSpec, EmptyBackwardZeroesDbias) {
  float db[3] = {1, 2, 3};
  const TensorView empty(nullptr, DType::f32, {0, 3}, kCpu);
  bias_act_backward({empty, empty, SavedForBackward::output, empty, std::nullopt, host_view(db, {3})},
                    {Activation::relu, 1.0f});
  EXPECT_EQ(std::vector<float>(db, db + 3), (std::vector<float>{0, 0, 0}));
}

// ---------------------------------------------------------------------------------------------
// Bad inputs
// ---------------------------------------------------------------------------------------------

void expect_forward_error(const BiasActForwardArgs& a, const std::string& arg) {
  test::expect_arg_error([&] { bias_act_forward(a, {Activation::relu, 1.0f}); }, "bias_act_forward", arg);
}

void expect_backward_error(const BiasActBackwardArgs& a, Activation act, const std::string& arg) {
  test::expect_arg_error([&] { bias_act_backward(a, {act, 1.0f}); }, "bias_act_backward", arg);
}

TEST(PointwiseErrors, EachBadInputNamesItsArgument) {
  Tensor x = Tensor::empty({4, 6}, DType::f32, kCpu), y = Tensor::empty({4, 6}, DType::f32, kCpu);
  Tensor r5 = Tensor::empty({4, 5}, DType::f32, kCpu), b5 = Tensor::empty({5}, DType::f32, kCpu);
  Tensor xb = Tensor::empty({4, 6}, DType::bf16, kCpu), xi = Tensor::empty({4, 6}, DType::i32, kCpu);
  const auto none = std::nullopt;
  expect_forward_error({x, r5.view(), none, y, none}, "r");       // shape mismatch
  expect_forward_error({x, none, b5.view(), y, none}, "bias");    // bias length != cols
  expect_forward_error({x, xb.view(), none, y, none}, "r");       // dtype mismatch
  expect_forward_error({xi, none, none, xi, none}, "x");          // unsupported dtype
  expect_forward_error({x, none, none, r5, none}, "y");
  expect_forward_error({x, none, none, y, r5.view()}, "preact");
  expect_forward_error({TensorView(nullptr, DType::f32, {4, 6}, kCpu), none, none, y, none}, "x");  // null data
  const TensorView strided(x.data(), DType::f32, {4, 3}, {6, 2}, kCpu);
  expect_forward_error({strided, none, none, strided, none}, "x");  // inner stride 2
  const TensorView overlapping_rows(x.data(), DType::f32, {4, 6}, {5, 1}, kCpu);  // row stride < cols
  expect_forward_error({overlapping_rows, none, none, y, none}, "x");
  expect_forward_error({x, overlapping_rows, none, y, none}, "r");
  expect_forward_error({x, none, none, overlapping_rows, none}, "y");
  expect_forward_error({x, none, none, y, overlapping_rows}, "preact");
  // y sharing x's data must be x itself: the rows of a different view would race with x's.
  Tensor wide = Tensor::empty({4, 8}, DType::f32, kCpu);
  const TensorView x_ld8(wide.data(), DType::f32, {4, 6}, {8, 1}, kCpu);
  const TensorView y_ld7(wide.data(), DType::f32, {4, 6}, {7, 1}, kCpu);
  expect_forward_error({x_ld8, none, none, y_ld7, none}, "y");
  try {
    bias_act_forward({overlapping_rows, none, none, y, none}, {Activation::relu, 1.0f});
    ADD_FAILURE() << "no fk::Error for a row stride < cols";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("inner stride 1 and a row stride >= cols"), std::string::npos) << e.what();
  }
  expect_forward_error({x.view().reshape({2, 2, 6}), none, none, y, none}, "x");  // rank 3

  Tensor db16 = Tensor::empty({6}, DType::f16, kCpu);
  expect_backward_error({x, y, SavedForBackward::output, x, none, none}, Activation::gelu_erf, "saved_kind");
  expect_backward_error({xb, xb, SavedForBackward::output, xb, none, db16.view()}, Activation::relu, "dbias");
  expect_backward_error({x, y, SavedForBackward::output, x, none, b5.view()}, Activation::relu, "dbias");
  expect_backward_error({x, r5, SavedForBackward::output, x, none, none}, Activation::relu, "saved");
  expect_backward_error({x, y, SavedForBackward::output, x, r5.view(), none}, Activation::relu, "dr");
  expect_backward_error({strided, strided, SavedForBackward::output, strided, none, none}, Activation::relu, "dy");
  expect_backward_error({overlapping_rows, y, SavedForBackward::output, x, none, none}, Activation::relu, "dy");
  expect_backward_error({x, overlapping_rows, SavedForBackward::output, y, none, none}, Activation::relu, "saved");
  expect_backward_error({x, y, SavedForBackward::output, overlapping_rows, none, none}, Activation::relu, "dx");
  expect_backward_error({x, y, SavedForBackward::output, y, overlapping_rows, none}, Activation::relu, "dr");
  expect_backward_error({x_ld8, y, SavedForBackward::output, y_ld7, none, none}, Activation::relu, "dx");
  EXPECT_THROW(parse_activation("swish"), Error);
  EXPECT_EQ(parse_activation("gelu_erf"), Activation::gelu_erf);
}

TEST(PointwiseErrors, MixedDevices) {
  FK_SKIP_WITHOUT_GPU();
  Tensor x = Tensor::empty({4, 6}, DType::f32, Device::cuda(0)), y = Tensor::empty({4, 6}, DType::f32, kCpu);
  expect_forward_error({x, std::nullopt, std::nullopt, y, std::nullopt}, "y");
}

// ---------------------------------------------------------------------------------------------
// CUDA against the spec
// ---------------------------------------------------------------------------------------------

struct Shape {
  std::int64_t rows, cols;
};

using ForwardCase = std::tuple<DType, Activation, Shape>;

class PointwiseGpu : public ::testing::TestWithParam<ForwardCase> {};

// The CUDA kernels compute in fp32 with fma and the device math library; the spec in double with
// one rounding of z to float. On top of the dtype's own rounding they differ by a few fp32 ulps.
test::Tolerance kernel_tolerance(DType dt) {
  test::Tolerance t = test::tolerance_for(dt);
  if (dt == DType::f32) t = {1e-5, 1e-5};
  return t;
}

TEST_P(PointwiseGpu, ForwardMatchesSpec) {
  FK_SKIP_WITHOUT_GPU();
  const auto [dt, act, shape] = GetParam();
  const Device gpu = Device::cuda(0);
  int seed = 100;
  for (bool with_r : {true, false})
    for (bool with_b : {true, false})
      for (bool in_place : {false, true}) {
        const Dims s{shape.rows, shape.cols};
        Tensor x = test::random_tensor(s, dt, kCpu, ++seed, -3, 3);
        Tensor r = test::random_tensor(s, dt, kCpu, ++seed, -3, 3);
        Tensor b = test::random_tensor({shape.cols}, dt, kCpu, ++seed);
        Tensor want_y = Tensor::empty(s, dt, kCpu), want_z = Tensor::empty(s, dt, kCpu);
        const BiasActParams p{act, 0.75f};
        auto opt = [](bool on, const Tensor& t) { return on ? std::optional<TensorView>(t.view()) : std::nullopt; };
        reference::bias_act_forward({x, opt(with_r, r), opt(with_b, b), want_y, want_z.view()}, p);

        Tensor xd = x.copy_to(gpu), rd = r.copy_to(gpu), bd = b.copy_to(gpu);
        Tensor yd = Tensor::empty(s, dt, gpu), zd = Tensor::empty(s, dt, gpu);
        test::poison(yd);
        test::poison(zd);
        const TensorView y_out = in_place ? xd.view() : yd.view();
        bias_act_forward({xd, opt(with_r, rd), opt(with_b, bd), y_out, zd.view()}, p);
        const auto tol = kernel_tolerance(dt);
        EXPECT_TRUE(test::all_close(y_out, want_y, tol)) << "r " << with_r << " b " << with_b << " in place " << in_place;
        EXPECT_TRUE(test::all_close(zd, want_z, tol)) << "preactivation";
      }
}

TEST_P(PointwiseGpu, BackwardMatchesSpec) {
  FK_SKIP_WITHOUT_GPU();
  const auto [dt, act, shape] = GetParam();
  const Device gpu = Device::cuda(0);
  const Dims s{shape.rows, shape.cols};
  int seed = 200;
  std::vector<SavedForBackward> kinds{SavedForBackward::preactivation};
  if (derivative_from_output(act)) kinds.push_back(SavedForBackward::output);
  for (SavedForBackward kind : kinds)
    for (DType db_dtype : {DType::f32, dt})
      for (bool in_place : {false, true}) {
        Tensor dy = test::random_tensor(s, dt, kCpu, ++seed);
        Tensor z = test::random_tensor(s, dt, kCpu, ++seed, -3, 3);
        Tensor saved = Tensor::empty(s, dt, kCpu);
        if (kind == SavedForBackward::output)
          reference::bias_act_forward({z, std::nullopt, std::nullopt, saved, std::nullopt}, {act, 1.0f});
        else
          copy(saved, z);
        const BiasActParams p{act, -1.25f};
        Tensor want_dx = Tensor::empty(s, dt, kCpu), want_dr = Tensor::empty(s, dt, kCpu);
        Tensor want_db = Tensor::empty({shape.cols}, db_dtype, kCpu);
        reference::bias_act_backward({dy, saved, kind, want_dx, want_dr.view(), want_db.view()}, p);

        Tensor dyd = dy.copy_to(gpu), sd = saved.copy_to(gpu);
        Tensor dxd = Tensor::empty(s, dt, gpu), drd = Tensor::empty(s, dt, gpu);
        Tensor dbd = Tensor::empty({shape.cols}, db_dtype, gpu);
        test::poison(dxd);
        test::poison(drd);
        test::poison(dbd);
        const TensorView dx_out = in_place ? dyd.view() : dxd.view();
        bias_act_backward({dyd, sd, kind, dx_out, drd.view(), dbd.view()}, p);
        const auto tol = kernel_tolerance(dt);
        EXPECT_TRUE(test::all_close(dx_out, want_dx, tol));
        EXPECT_TRUE(test::all_close(drd, want_dr, tol));
        // db sums `rows` fp32 values of size <= ~2 in another order than the spec's double sum:
        // the error grows like sqrt(rows) fp32 roundings; plus one rounding to db's dtype.
        const double accum = 8.0 * std::sqrt(static_cast<double>(shape.rows)) * 2.0 * 0x1p-24;
        const auto dbt = test::tolerance_for(db_dtype);
        EXPECT_TRUE(test::all_close(dbd, want_db, {dbt.atol + accum, dbt.rtol})) << "dbias";
      }
}

std::string case_name(const ::testing::TestParamInfo<ForwardCase>& info) {
  const auto [dt, act, shape] = info.param;
  return std::string(dtype_name(dt)) + "_" + std::string(activation_name(act)) + "_" + std::to_string(shape.rows) +
         "x" + std::to_string(shape.cols);
}

// All activations on shapes with tails; then the bench shapes for a few.
INSTANTIATE_TEST_SUITE_P(
    AllActivationsOddShapes, PointwiseGpu,
    ::testing::Combine(::testing::Values(DType::f32, DType::bf16, DType::f16),
                       ::testing::Values(Activation::identity, Activation::relu, Activation::sigmoid, Activation::tanh,
                                         Activation::gelu_tanh, Activation::gelu_erf, Activation::silu),
                       ::testing::Values(Shape{1, 1}, Shape{7, 13}, Shape{33, 1001}, Shape{300, 8})),
    case_name);

INSTANTIATE_TEST_SUITE_P(
    LargerShapes, PointwiseGpu,
    ::testing::Combine(::testing::Values(DType::f32, DType::bf16), ::testing::Values(Activation::relu, Activation::silu),
                       ::testing::Values(Shape{128, 512}, Shape{3, 4100}, Shape{1000, 2048})),
    case_name);

// The benchmark shapes, once each (the spec over 2^26 elements takes seconds on the CPU).
TEST(PointwiseGpuBenchShapes, ForwardF32AndBackwardBf16At65536x1024) {
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  const Dims s{65536, 1024};
  {
    Tensor x = test::random_tensor(s, DType::f32, kCpu, 1), r = test::random_tensor(s, DType::f32, kCpu, 2);
    Tensor b = test::random_tensor({1024}, DType::f32, kCpu, 3);
    Tensor want = Tensor::empty(s, DType::f32, kCpu);
    reference::bias_act_forward({x, r.view(), b.view(), want, std::nullopt}, {Activation::relu, 0.5f});
    Tensor xd = x.copy_to(gpu), rd = r.copy_to(gpu), bd = b.copy_to(gpu), yd = Tensor::empty(s, DType::f32, gpu);
    test::poison(yd);
    bias_act_forward({xd, rd.view(), bd.view(), yd, std::nullopt}, {Activation::relu, 0.5f});
    EXPECT_TRUE(test::all_close(yd, want, kernel_tolerance(DType::f32)));
  }
  {
    Tensor dy = test::random_tensor(s, DType::bf16, kCpu, 4), z = test::random_tensor(s, DType::bf16, kCpu, 5);
    Tensor y = Tensor::empty(s, DType::bf16, kCpu);
    reference::bias_act_forward({z, std::nullopt, std::nullopt, y, std::nullopt}, {Activation::relu, 1.0f});
    Tensor want_dx = Tensor::empty(s, DType::bf16, kCpu), want_dr = Tensor::empty(s, DType::bf16, kCpu);
    Tensor want_db = Tensor::empty({1024}, DType::f32, kCpu);
    const BiasActParams p{Activation::relu, 0.5f};
    reference::bias_act_backward({dy, y, SavedForBackward::output, want_dx, want_dr.view(), want_db.view()}, p);
    Tensor dyd = dy.copy_to(gpu), yd = y.copy_to(gpu);
    Tensor dxd = Tensor::empty(s, DType::bf16, gpu), drd = Tensor::empty(s, DType::bf16, gpu);
    Tensor dbd = Tensor::empty({1024}, DType::f32, gpu);
    test::poison(dxd);
    test::poison(drd);
    test::poison(dbd);
    bias_act_backward({dyd, yd, SavedForBackward::output, dxd, drd.view(), dbd.view()}, p);
    EXPECT_TRUE(test::all_close(dxd, want_dx, kernel_tolerance(DType::bf16)));
    EXPECT_TRUE(test::all_close(drd, want_dr, kernel_tolerance(DType::bf16)));
    const double accum = 8.0 * std::sqrt(65536.0) * 2.0 * 0x1p-24;  // as in BackwardMatchesSpec
    EXPECT_TRUE(test::all_close(dbd, want_db, {test::tolerance_for(DType::f32).atol + accum, 1e-5}));
  }
}

TEST(PointwiseGpuBenchShapes, BackwardDbiasIsDeterministic) {
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  const Dims s{20000, 777};
  Tensor dy = test::random_tensor(s, DType::f32, gpu, 8), y = test::random_tensor(s, DType::f32, gpu, 9, 0, 1);
  Tensor dx = Tensor::empty(s, DType::f32, gpu);
  Tensor db1 = Tensor::empty({777}, DType::f32, gpu), db2 = Tensor::empty({777}, DType::f32, gpu);
  bias_act_backward({dy, y, SavedForBackward::output, dx, std::nullopt, db1.view()}, {Activation::sigmoid, 1.0f});
  bias_act_backward({dy, y, SavedForBackward::output, dx, std::nullopt, db2.view()}, {Activation::sigmoid, 1.0f});
  const Tensor a = test::to_host(db1), b = test::to_host(db2);
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.nbytes()), 0);
}

// A [rows, cols] view into a [rows, ld] buffer whose padding holds random values, so that a
// write past a row's end shows.
struct Padded {
  Tensor buffer;   // [rows, ld]
  TensorView view; // [rows, cols], row stride ld

  Padded(const Tensor& host, std::int64_t ld, Device device, std::uint64_t seed) {
    const std::int64_t rows = host.size(0), cols = host.size(1);
    Tensor buf = test::random_tensor({rows, ld}, host.dtype(), kCpu, seed);
    const std::size_t es = dtype_size(host.dtype());
    for (std::int64_t i = 0; i < rows; ++i)
      std::memcpy(static_cast<char*>(buf.data()) + i * ld * es, static_cast<const char*>(host.data()) + i * cols * es,
                  cols * es);
    buffer = buf.copy_to(device);
    view = TensorView(buffer.data(), host.dtype(), {rows, cols}, {ld, 1}, device);
  }
  // The rows, contiguous on the host.
  Tensor rows() const {
    const Tensor buf = test::to_host(buffer);
    const std::int64_t rows = view.size(0), cols = view.size(1), ld = buffer.size(1);
    Tensor out = Tensor::empty({rows, cols}, view.dtype(), kCpu);
    const std::size_t es = dtype_size(view.dtype());
    for (std::int64_t i = 0; i < rows; ++i)
      std::memcpy(static_cast<char*>(out.data()) + i * cols * es, static_cast<const char*>(buf.data()) + i * ld * es,
                  cols * es);
    return out;
  }
  // Whether the padding columns still hold what `before` (the buffer when made) held.
  bool padding_equals(const Tensor& before) const {
    const Tensor buf = test::to_host(buffer);
    const std::int64_t rows = view.size(0), cols = view.size(1), ld = buffer.size(1);
    const std::size_t es = dtype_size(view.dtype());
    for (std::int64_t i = 0; i < rows; ++i)
      if (std::memcmp(static_cast<const char*>(buf.data()) + (i * ld + cols) * es,
                      static_cast<const char*>(before.data()) + (i * ld + cols) * es, (ld - cols) * es) != 0)
        return false;
    return true;
  }
};

// Each of the four [rows, cols] tensors of an op (x, r, y, preact; dy, saved, dx, dr) with its
// own row stride.
struct StridedShape {
  std::int64_t rows, cols;
  std::array<std::int64_t, 4> ld;
};

using StridedCase = std::tuple<DType, Activation, StridedShape>;

class PointwiseGpuStrided : public ::testing::TestWithParam<StridedCase> {};

TEST_P(PointwiseGpuStrided, ForwardMatchesSpec) {
  FK_SKIP_WITHOUT_GPU();
  const auto [dt, act, shape] = GetParam();
  const Device gpu = Device::cuda(0);
  const Dims s{shape.rows, shape.cols};
  for (bool in_place : {false, true}) {
    Tensor x = test::random_tensor(s, dt, kCpu, 301, -3, 3), r = test::random_tensor(s, dt, kCpu, 302, -3, 3);
    Tensor b = test::random_tensor({shape.cols}, dt, kCpu, 303);
    Tensor want_y = Tensor::empty(s, dt, kCpu), want_z = Tensor::empty(s, dt, kCpu);
    const BiasActParams p{act, 0.75f};
    reference::bias_act_forward({x, r.view(), b.view(), want_y, want_z.view()}, p);

    Tensor unwritten = Tensor::empty(s, dt, kCpu);
    test::poison(unwritten);
    Padded xd(x, shape.ld[0], gpu, 311), rd(r, shape.ld[1], gpu, 312), yd(unwritten, shape.ld[2], gpu, 313),
        zd(unwritten, shape.ld[3], gpu, 314);
    const Tensor y_before = test::to_host(in_place ? xd.buffer : yd.buffer), z_before = test::to_host(zd.buffer);
    const Tensor bd = b.copy_to(gpu);
    const Padded& y_out = in_place ? xd : yd;
    bias_act_forward({xd.view, rd.view, bd.view(), y_out.view, zd.view}, p);
    const auto tol = kernel_tolerance(dt);
    EXPECT_TRUE(test::all_close(y_out.rows(), want_y, tol)) << "in place " << in_place;
    EXPECT_TRUE(test::all_close(zd.rows(), want_z, tol)) << "preactivation";
    EXPECT_TRUE(y_out.padding_equals(y_before)) << "y's padding";
    EXPECT_TRUE(zd.padding_equals(z_before)) << "preact's padding";
  }
}

TEST_P(PointwiseGpuStrided, BackwardMatchesSpec) {
  FK_SKIP_WITHOUT_GPU();
  const auto [dt, act, shape] = GetParam();
  const Device gpu = Device::cuda(0);
  const Dims s{shape.rows, shape.cols};
  for (bool in_place : {false, true}) {
    Tensor dy = test::random_tensor(s, dt, kCpu, 321), z = test::random_tensor(s, dt, kCpu, 322, -3, 3);
    const BiasActParams p{act, -1.25f};
    Tensor want_dx = Tensor::empty(s, dt, kCpu), want_dr = Tensor::empty(s, dt, kCpu);
    Tensor want_db = Tensor::empty({shape.cols}, DType::f32, kCpu);
    reference::bias_act_backward({dy, z, SavedForBackward::preactivation, want_dx, want_dr.view(), want_db.view()}, p);

    Tensor unwritten = Tensor::empty(s, dt, kCpu);
    test::poison(unwritten);
    Padded dyd(dy, shape.ld[0], gpu, 331), sd(z, shape.ld[1], gpu, 332), dxd(unwritten, shape.ld[2], gpu, 333),
        drd(unwritten, shape.ld[3], gpu, 334);
    const Padded& dx_out = in_place ? dyd : dxd;
    const Tensor dx_before = test::to_host(dx_out.buffer), dr_before = test::to_host(drd.buffer);
    Tensor dbd = Tensor::empty({shape.cols}, DType::f32, gpu);
    test::poison(dbd);
    bias_act_backward({dyd.view, sd.view, SavedForBackward::preactivation, dx_out.view, drd.view, dbd.view()}, p);
    const auto tol = kernel_tolerance(dt);
    EXPECT_TRUE(test::all_close(dx_out.rows(), want_dx, tol)) << "in place " << in_place;
    EXPECT_TRUE(test::all_close(drd.rows(), want_dr, tol));
    EXPECT_TRUE(dx_out.padding_equals(dx_before)) << "dx's padding";
    EXPECT_TRUE(drd.padding_equals(dr_before)) << "dr's padding";
    const double accum = 8.0 * std::sqrt(static_cast<double>(shape.rows)) * 2.0 * 0x1p-24;  // as in BackwardMatchesSpec
    EXPECT_TRUE(test::all_close(dbd, want_db, {test::tolerance_for(DType::f32).atol + accum, 1e-5})) << "dbias";
  }
}

std::string strided_case_name(const ::testing::TestParamInfo<StridedCase>& info) {
  const auto [dt, act, shape] = info.param;
  std::string name = fmt::format("{}_{}_{}x{}_ld", dtype_name(dt), activation_name(act), shape.rows, shape.cols);
  for (std::int64_t ld : shape.ld) name += fmt::format("_{}", ld);
  return name;
}

// Odd columns with row strides cols + 1 and cols + 3; columns and row strides that are multiples
// of 4 (f32's vector width: the vector path) and of 8 (bf16's); one row stride off the vector
// width among aligned ones (the scalar path).
INSTANTIATE_TEST_SUITE_P(
    RowStrides, PointwiseGpuStrided,
    ::testing::Combine(::testing::Values(DType::f32, DType::bf16), ::testing::Values(Activation::relu, Activation::silu),
                       ::testing::Values(StridedShape{7, 13, {14, 16, 17, 13}},
                                         StridedShape{33, 1001, {1002, 1004, 1008, 1001}},
                                         StridedShape{300, 8, {12, 16, 8, 24}},
                                         StridedShape{64, 16, {24, 32, 40, 16}},
                                         StridedShape{50, 64, {64, 72, 68, 80}},
                                         StridedShape{1, 5, {5, 9, 6, 5}})),
    strided_case_name);

TEST(PointwiseGpuLayout, MisalignedPointersTakeTheScalarPath) {
  FK_SKIP_WITHOUT_GPU();
  // Rows of 16 bf16 would be vectorised, but a view starting one element into the buffer is not
  // 16-byte aligned: the kernel must notice and still be right.
  const Device gpu = Device::cuda(0);
  const std::int64_t rows = 37, cols = 16;
  Tensor host = test::random_tensor({rows * cols + 1}, DType::bf16, kCpu, 5);
  Tensor bias = test::random_tensor({cols}, DType::bf16, kCpu, 6);
  const TensorView x_host(static_cast<bf16*>(host.data()) + 1, DType::bf16, {rows, cols}, kCpu);
  Tensor want = Tensor::empty({rows, cols}, DType::bf16, kCpu);
  reference::bias_act_forward({x_host, std::nullopt, bias.view(), want, std::nullopt}, {Activation::tanh, 1.0f});
  Tensor dev = host.copy_to(gpu), bd = bias.copy_to(gpu);
  const TensorView x_dev(static_cast<bf16*>(dev.data()) + 1, DType::bf16, {rows, cols}, gpu);
  Tensor y = Tensor::empty({rows, cols}, DType::bf16, gpu);
  bias_act_forward({x_dev, std::nullopt, bd.view(), y, std::nullopt}, {Activation::tanh, 1.0f});
  EXPECT_TRUE(test::all_close(y, want, kernel_tolerance(DType::bf16)));
}

TEST(PointwiseGpuLayout, LargeTensorNeeds64BitIndexing) {
  FK_SKIP_WITHOUT_GPU();
  // 2^31 + 2^21 elements of bf16: flat offsets past 2^31 must not wrap. x, y: 8.6 GB together.
  const std::int64_t rows = (std::int64_t{1} << 21) + 2048, cols = 1024;
  const Device gpu = Device::cuda(0);
  Tensor x, y;
  try {
    x = Tensor::empty({rows, cols}, DType::bf16, gpu);
    y = Tensor::empty({rows, cols}, DType::bf16, gpu);
  } catch (const Error&) {
    GTEST_SKIP() << "needs about 9 GiB of free GPU memory";
  }
  fill_uniform(x, -2, 2, {11, 0});
  Tensor bias = test::random_tensor({cols}, DType::bf16, gpu, 12);
  test::poison(y.view().slice_rows(rows - 4096, rows));
  bias_act_forward({x, std::nullopt, bias.view(), y, std::nullopt}, {Activation::relu, 1.0f});
  // Check the first rows and the last rows (the ones past 2^31 elements) against the spec.
  for (auto [r0, r1] : {std::pair<std::int64_t, std::int64_t>{0, 64}, {rows - 4096, rows}}) {
    Tensor xs = test::to_host(x.view().slice_rows(r0, r1));
    Tensor want = Tensor::empty({r1 - r0, cols}, DType::bf16, kCpu);
    Tensor bh = test::to_host(bias);
    reference::bias_act_forward({xs, std::nullopt, bh.view(), want, std::nullopt}, {Activation::relu, 1.0f});
    EXPECT_TRUE(test::all_close(y.view().slice_rows(r0, r1), want, kernel_tolerance(DType::bf16)))
        << "rows [" << r0 << ", " << r1 << ")";
  }
}

// ---- convert --------------------------------------------------------------------------------

TEST(ConvertSpec, RoundsToNearestEvenAndKeepsPadding) {
  // 1 + 2^-8 is halfway between two bf16 values (1 and 1 + 2^-7): it rounds to the even one, 1;
  // 1 + 3 * 2^-8 rounds up to 1 + 2^-6.
  const Tensor src = test::host_tensor({2, 2}, DType::f32, {1.0f + 1.0f / 256, 1.0f + 3.0f / 256, -2.5f, 0.0f});
  Tensor dst = Tensor::empty({2, 3}, DType::bf16, Device::cpu());
  fill(dst, 7.0);
  const TensorView rows(dst.data(), DType::bf16, {2, 2}, {3, 1}, Device::cpu());
  convert(src, rows);
  EXPECT_EQ(test::to_floats(dst), (std::vector<float>{1.0f, 1.0f + 1.0f / 64, 7.0f, -2.5f, 0.0f, 7.0f}));
  Tensor back = Tensor::empty({2, 2}, DType::f32, Device::cpu());
  convert(rows, back);
  EXPECT_EQ(test::to_floats(back), (std::vector<float>{1.0f, 1.0f + 1.0f / 64, -2.5f, 0.0f}));
}

// dbias may not alias the tensors the backward reads or writes (issue 27 item 11).
TEST(PointwiseErrors, DbiasMayNotAlias) {
  Tensor dy = Tensor::empty({4, 6}, DType::f32, Device::cpu()), y = Tensor::empty({4, 6}, DType::f32, Device::cpu());
  fill(dy, 1.0);
  fill(y, 1.0);
  const TensorView first_row(dy.data(), DType::f32, {6}, Device::cpu());
  test::expect_arg_error([&] { bias_act_backward({dy, y, SavedForBackward::output, dy, std::nullopt, first_row}, {}); },
                         "bias_act_backward", "dbias");
}

TEST(ConvertErrors, EachBadInputNamesItsArgument) {
  const Tensor a = Tensor::empty({3, 4}, DType::f32, Device::cpu());
  Tensor b = Tensor::empty({3, 4}, DType::bf16, Device::cpu());
  test::expect_arg_error([&] { convert(a, Tensor::empty({4, 3}, DType::bf16, Device::cpu())); }, "convert", "dst");
  test::expect_arg_error([&] { convert(Tensor::empty({3, 4}, DType::i32, Device::cpu()), b); }, "convert", "src");
  const Tensor wide = Tensor::empty({3, 8}, DType::f32, Device::cpu());
  Tensor wide16 = Tensor::empty({3, 8}, DType::bf16, Device::cpu());
  test::expect_arg_error(  // inner stride 2
      [&] { convert(a, TensorView(wide16.data(), DType::bf16, {3, 4}, {8, 2}, Device::cpu())); }, "convert", "dst");
  test::expect_arg_error(
      [&] { convert(TensorView(wide.data(), DType::f32, {3, 4}, {8, 2}, Device::cpu()), b); }, "convert", "src");
  test::expect_arg_error([&] { convert(a, TensorView(a.data_as<float>() + 1, DType::f32, {3, 4}, Device::cpu())); },
                         "convert", "dst");
}

TEST(ConvertGpu, MatchesSpecOnPaddedRows) {
  FK_SKIP_WITHOUT_GPU();
  for (DType from : {DType::f32, DType::bf16, DType::f16})
    for (DType to : {DType::f32, DType::bf16, DType::f16})
      for (auto [rows, cols, ld] : {std::tuple{1, 1, 1}, std::tuple{37, 13, 16}, std::tuple{300, 367, 368}}) {
        const Tensor host = test::random_tensor({rows, cols}, from, Device::cpu(), 3, -4.f, 4.f);
        Tensor want = Tensor::empty({rows, ld}, to, Device::cpu());
        fill(want, 0.0);
        reference::convert(host, TensorView(want.data(), to, {rows, cols}, {ld, 1}, Device::cpu()));
        Tensor got = Tensor::empty({rows, ld}, to, Device::cuda());
        fill(got, 0.0);
        convert(host.copy_to(Device::cuda()), TensorView(got.data(), to, {rows, cols}, {ld, 1}, Device::cuda()));
        EXPECT_EQ(test::to_floats(got), test::to_floats(want)) << dtype_name(from) << " -> " << dtype_name(to);
      }
}

// convert between strided views against its spec: a [2, 3, 5, 7] transposed view of [2, 5, 3, 7]
// memory into rows padded to 9, bf16 -> f32 and back.
TEST(ConvertStrided, MatchesSpecOnTransposedAndPaddedViews) {
  for (Device dev : {kCpu, Device::cuda(0)}) {
    if (dev.is_cuda() && cuda_device_count() == 0) continue;  // the GPU half skips without one
    Tensor src_mem = test::random_tensor({2 * 5 * 3 * 7}, DType::bf16, dev, 91);
    const TensorView src(src_mem.data(), DType::bf16, {2, 3, 5, 7}, {5 * 3 * 7, 7, 3 * 7, 1}, dev);
    Tensor dst_mem = Tensor::empty({2 * 3 * 5 * 9}, DType::f32, dev);
    test::poison(dst_mem);
    const TensorView dst(dst_mem.data(), DType::f32, {2, 3, 5, 7}, {3 * 5 * 9, 5 * 9, 9, 1}, dev);
    convert(src, dst);
    const std::vector<double> mem = test::to_doubles(src_mem), got = test::to_doubles(dst_mem);
    std::int64_t bad = 0;
    for (std::int64_t b = 0; b < 2; ++b)
      for (std::int64_t h = 0; h < 3; ++h)
        for (std::int64_t s = 0; s < 5; ++s)
          for (std::int64_t d = 0; d < 9; ++d) {
            const double g = got[static_cast<std::size_t>(((b * 3 + h) * 5 + s) * 9 + d)];
            const bool ok = d < 7 ? g == mem[static_cast<std::size_t>(((b * 5 + s) * 3 + h) * 7 + d)] : std::isnan(g);
            bad += ok ? 0 : 1;
          }
    EXPECT_EQ(bad, 0) << dev.str();
    Tensor back_mem = Tensor::empty({2 * 5 * 3 * 7}, DType::bf16, dev);
    const TensorView back(back_mem.data(), DType::bf16, src.shape(), src.strides(), dev);
    convert(dst, back);
    EXPECT_EQ(test::to_doubles(back_mem), mem) << dev.str();
  }
}

TEST(ConvertStrided, RefusesOutputsWhoseElementsShareMemory) {
  const Tensor src = Tensor::empty({2, 3, 4}, DType::f32, kCpu);
  Tensor mem = Tensor::empty({12}, DType::f32, kCpu);
  const TensorView repeated(mem.data(), DType::f32, {2, 3, 4}, {0, 4, 1}, kCpu);  // both b read one place
  test::expect_arg_error([&] { convert(src, repeated); }, "convert", "dst");
  const TensorView rank5(mem.data(), DType::f32, {1, 1, 1, 3, 4}, {12, 12, 12, 4, 1}, kCpu);
  EXPECT_NO_THROW(convert(Tensor::empty({1, 1, 1, 3, 4}, DType::f32, kCpu), rank5));  // contiguous: any rank
  const TensorView rank5_gap(mem.data(), DType::f32, {1, 1, 2, 1, 4}, {12, 12, 8, 4, 1}, kCpu);
  test::expect_arg_error([&] { convert(Tensor::empty({1, 1, 2, 1, 4}, DType::f32, kCpu), rank5_gap); }, "convert",
                         "dst");
}

// ---- rope -----------------------------------------------------------------------------------

// q = [1, 2, 3, 4] at one position, halves (1, 2) and (3, 4); cos and sin with unequal halves, so
// that using the wrong half shows:
//   forward   y1 = x1 c1 - x2 s1 = (1 - 1.5, 1 - 4) = (-0.5, -3)
//             y2 = x2 c2 + x1 s2 = (6 - 1, 1 + 4)   = (5, 5)
//   backward  dx1 = dy1 c1 + dy2 s2 = (1 - 3, 1 + 8)  = (-2, 9)
//             dx2 = dy2 c2 - dy1 s1 = (6 - 0.5, 1 - 2) = (5.5, -1)
TEST(RopeSpec, ForwardAndBackwardByHand) {
  const float x[] = {1, 2, 3, 4}, cos[] = {1, 0.5f, 2, 0.25f}, sin[] = {0.5f, 1, -1, 2};
  const float kx[] = {-2, 0, 0, 1};  // k: y1 = (-2 - 0, 0 - 1), y2 = (0 + 2, 0.25 + 0)
  float y[4], ky[4];
  const RopeArgs fwd{host_view(x, {1, 1, 1, 4}), host_view(kx, {1, 1, 1, 4}), host_view(cos, {1, 4}),
                     host_view(sin, {1, 4}), host_view(y, {1, 1, 1, 4}), host_view(ky, {1, 1, 1, 4})};
  rope_forward(fwd);
  EXPECT_EQ(std::vector<float>(y, y + 4), (std::vector<float>{-0.5f, -3, 5, 5}));
  EXPECT_EQ(std::vector<float>(ky, ky + 4), (std::vector<float>{-2, -1, 2, 0.25f}));
  rope_backward(fwd);
  EXPECT_EQ(std::vector<float>(y, y + 4), (std::vector<float>{-2, 9, 5.5f, -1}));
}

TEST(RopeSpec, IsARotationWhenTheHalvesAreEqual) {
  // D = 2, angle 0.3: forward is the rotation by 0.3, backward by -0.3; in place, backward(forward(x)) = x.
  const double c = std::cos(0.3), s = std::sin(0.3);
  const float cos[] = {float(c), float(c)}, sin[] = {float(s), float(s)};
  float q[] = {0.6f, -0.8f}, k[] = {2, 1};
  const RopeArgs a{host_view(q, {1, 1, 1, 2}), host_view(k, {1, 1, 1, 2}), host_view(cos, {1, 1, 2}),
                   host_view(sin, {1, 1, 2}), host_view(q, {1, 1, 1, 2}), host_view(k, {1, 1, 1, 2})};
  rope_forward(a);
  EXPECT_NEAR(q[0], 0.6 * c + 0.8 * s, 1e-7);
  EXPECT_NEAR(q[1], -0.8 * c + 0.6 * s, 1e-7);
  rope_backward(a);
  EXPECT_NEAR(q[0], 0.6f, 1e-6);
  EXPECT_NEAR(q[1], -0.8f, 1e-6);
  EXPECT_NEAR(k[0], 2, 1e-6);
  EXPECT_NEAR(k[1], 1, 1e-6);
}

// A rope operand [B, H, T, D] in one of the layouts a caller hands over, in a buffer of its own
// whose elements outside the view hold random values (so that a stray write shows).
enum class RopeLayout { contiguous, bthd, padded, misaligned };

struct RopeOperand {
  Tensor buffer;  // flat, on the host
  TensorView view;

  RopeOperand(Dims shape, RopeLayout layout, DType dt, std::uint64_t seed, float lo = -3, float hi = 3) {
    const std::int64_t B = shape[0], H = shape[1], T = shape[2], D = shape[3];
    Dims strides = contiguous_strides(shape);
    std::int64_t size = shape.numel(), offset = 0;
    switch (layout) {
      case RopeLayout::contiguous: break;
      case RopeLayout::bthd: strides = Dims{T * H * D, D, H * D, 1}; break;  // Hugging Face's q.transpose(1, 2)
      case RopeLayout::padded: {
        const std::int64_t ld = D + 6, head = T * ld + 4;
        strides = Dims{H * head + 2, head, ld, 1};
        size = B * strides[0];
        break;
      }
      case RopeLayout::misaligned: offset = 1; size += 1; break;
    }
    buffer = test::random_tensor({std::max<std::int64_t>(size, 1)}, dt, kCpu, seed, lo, hi);
    view = TensorView(static_cast<char*>(buffer.data()) + offset * dtype_size(dt), dt, shape, strides, kCpu);
  }
  // The same operand on `device`: buffer copied, view at the same offset and strides.
  std::pair<Tensor, TensorView> on(Device device) const {
    Tensor b = buffer.copy_to(device);
    const std::ptrdiff_t offset = static_cast<const char*>(view.data()) - static_cast<const char*>(buffer.data());
    TensorView v(static_cast<char*>(b.data()) + offset, view.dtype(), view.shape(), view.strides(), device);
    return {std::move(b), v};
  }
};

TEST(RopeSpec, BackwardIsTheAdjointOfForward) {
  // <forward(x), g> = <x, backward(g)> for any cos and sin (halves unequal), q in HF's transposed
  // layout, k padded, GQA (3 q heads, 2 k heads), [B, T, D] tables.
  const std::int64_t B = 2, Hq = 3, Hk = 2, T = 5, D = 6;
  RopeOperand q({B, Hq, T, D}, RopeLayout::bthd, DType::f32, 1), k({B, Hk, T, D}, RopeLayout::padded, DType::f32, 2);
  RopeOperand gq({B, Hq, T, D}, RopeLayout::contiguous, DType::f32, 3), gk({B, Hk, T, D}, RopeLayout::bthd, DType::f32, 4);
  const Tensor cos = test::random_tensor({B, T, D}, DType::f32, kCpu, 5), sin = test::random_tensor({B, T, D}, DType::f32, kCpu, 6);
  RopeOperand yq({B, Hq, T, D}, RopeLayout::padded, DType::f32, 7), yk({B, Hk, T, D}, RopeLayout::contiguous, DType::f32, 8);
  RopeOperand dq({B, Hq, T, D}, RopeLayout::bthd, DType::f32, 9), dk({B, Hk, T, D}, RopeLayout::padded, DType::f32, 10);
  rope_forward({q.view, k.view, cos, sin, yq.view, yk.view});
  rope_backward({gq.view, gk.view, cos, sin, dq.view, dk.view});
  const auto dot = [](const TensorView& a, const TensorView& b) {
    double sum = 0;
    for (std::int64_t i0 = 0; i0 < a.size(0); ++i0)
      for (std::int64_t i1 = 0; i1 < a.size(1); ++i1)
        for (std::int64_t i2 = 0; i2 < a.size(2); ++i2)
          for (std::int64_t i3 = 0; i3 < a.size(3); ++i3) {
            const auto at = [&](const TensorView& t) {
              return i0 * t.strides()[0] + i1 * t.strides()[1] + i2 * t.strides()[2] + i3;
            };
            sum += double(a.data_as<float>()[at(a)]) * b.data_as<float>()[at(b)];
          }
    return sum;
  };
  const double lhs = dot(yq.view, gq.view) + dot(yk.view, gk.view), rhs = dot(q.view, dq.view) + dot(k.view, dk.view);
  EXPECT_NEAR(lhs, rhs, 1e-4 * (1 + std::abs(lhs)));
}

void expect_rope_error(const RopeArgs& a, const std::string& arg) {
  test::expect_arg_error([&] { rope_forward(a); }, "rope_forward", arg);
}

TEST(RopeErrors, EachBadInputNamesItsArgument) {
  const auto t = [](Dims shape, DType dt = DType::bf16) { return Tensor::empty(shape, dt, kCpu); };
  Tensor q = t({2, 4, 8, 16}), k = t({2, 2, 8, 16}), cos = t({8, 16}), sin = t({8, 16}), qo = t({2, 4, 8, 16}),
         ko = t({2, 2, 8, 16});
  const RopeArgs good{q, k, cos, sin, qo, ko};
  EXPECT_NO_THROW(rope_forward(good));
  const auto with = [&](auto change) {
    RopeArgs a = good;
    change(a);
    return a;
  };
  Tensor odd = t({2, 4, 8, 15}), k_odd_t = t({2, 2, 7, 16}), k_f32 = t({2, 2, 8, 16}, DType::f32);
  Tensor cos16 = t({8, 16}, DType::f16), cos32 = t({8, 16}, DType::f32), cos_b3 = t({3, 8, 16}), cos_t = t({9, 16});
  Tensor cos4 = t({1, 1, 8, 16}), qi = t({2, 4, 8, 16}, DType::i32), qo32 = t({2, 4, 8, 16}, DType::f32);
  Tensor wide = t({2, 4, 8, 32});
  expect_rope_error(with([&](RopeArgs& a) { a.q = odd; a.q_out = odd; }), "q");           // odd D
  expect_rope_error(with([&](RopeArgs& a) { a.q = qi; }), "q");                            // dtype
  expect_rope_error(with([&](RopeArgs& a) {                                                // last stride 2
    a.q = TensorView(wide.data(), DType::bf16, {2, 4, 8, 16}, {1024, 256, 32, 2}, kCpu);
  }), "q");
  expect_rope_error(with([&](RopeArgs& a) {                                                // negative stride
    a.q = TensorView(q.data(), DType::bf16, {2, 4, 8, 16}, {512, -128, 16, 1}, kCpu);
  }), "q");
  expect_rope_error(with([&](RopeArgs& a) { a.q = TensorView(nullptr, DType::bf16, {2, 4, 8, 16}, kCpu); }), "q");
  expect_rope_error(with([&](RopeArgs& a) { a.k = k_odd_t; }), "k");                       // T differs
  expect_rope_error(with([&](RopeArgs& a) { a.k = k_f32; }), "k");                         // dtype differs
  expect_rope_error(with([&](RopeArgs& a) { a.k = q.view().reshape({2, 4, 128}); }), "k"); // rank 3
  expect_rope_error(with([&](RopeArgs& a) { a.cos = cos16; }), "cos");                     // neither q's nor f32
  expect_rope_error(with([&](RopeArgs& a) { a.cos = cos_b3; a.sin = cos_b3; }), "cos");    // batch 3, not 1 or 2
  expect_rope_error(with([&](RopeArgs& a) { a.cos = cos_t; a.sin = cos_t; }), "cos");      // T 9
  expect_rope_error(with([&](RopeArgs& a) { a.cos = cos4; a.sin = cos4; }), "cos");        // rank 4
  expect_rope_error(with([&](RopeArgs& a) { a.sin = cos32; }), "sin");                     // dtype differs from cos
  expect_rope_error(with([&](RopeArgs& a) { a.sin = cos_b3; }), "sin");                    // shape differs from cos
  expect_rope_error(with([&](RopeArgs& a) { a.q_out = qo32; }), "q_out");
  expect_rope_error(with([&](RopeArgs& a) { a.k_out = odd; }), "k_out");                   // shape
  expect_rope_error(with([&](RopeArgs& a) { a.k = TensorView(qo.data(), DType::bf16, {2, 2, 8, 16}, kCpu); }),
                    "q_out");  // q_out overlaps k
  expect_rope_error(with([&](RopeArgs& a) {  // q's data, other strides: rows would race
    a.q_out = TensorView(q.data(), DType::bf16, {2, 4, 8, 16}, {512, 16, 64, 1}, kCpu);
  }), "q_out");
  expect_rope_error(with([&](RopeArgs& a) { a.k_out = TensorView(q.data(), DType::bf16, {2, 2, 8, 16}, kCpu); }),
                    "k_out");
  // In place is allowed: the same views.
  EXPECT_NO_THROW(rope_forward({q, k, cos, sin, q, k}));
  EXPECT_NO_THROW(rope_backward({q, k, cos32, cos32, q, k}));
}

// q's and k's outputs as the two column blocks of one [B, T, (Hq + Hk) D] matrix (their spans
// interleave row by row, their elements do not): what qkv_rope's backward writes for one GEMM over
// both. Equal to the spec into separate tensors, on the CPU and the GPU; blocks one column too
// wide overlap, and are refused.
TEST(RopeLayouts, OutputsMayBeColumnBlocksOfOneMatrix) {
  const std::int64_t b = 2, hq = 3, hk = 1, t = 5, d = 8, w = (hq + hk) * d;
  for (Device dev : {kCpu, Device::cuda(0)}) {
    if (dev.is_cuda() && cuda_device_count() == 0) continue;  // the GPU half skips without one
    for (bool backward : {false, true}) {
      const DType dt = dev.is_cuda() ? DType::bf16 : DType::f32;
      const Tensor q = test::random_tensor({b, hq, t, d}, dt, dev, 61), k = test::random_tensor({b, hk, t, d}, dt, dev, 62);
      const Tensor cos = test::random_tensor({t, d}, dt, dev, 63), sin = test::random_tensor({t, d}, dt, dev, 64);
      Tensor qo = Tensor::empty({b, hq, t, d}, dt, dev), ko = Tensor::empty({b, hk, t, d}, dt, dev);
      Tensor g = Tensor::empty({b * t * w}, dt, dev);
      test::poison(g);
      const auto block = [&](std::int64_t col, std::int64_t heads) {
        return TensorView(static_cast<char*>(g.data()) + col * dtype_size(dt), dt, {b, heads, t, d},
                          {t * w, d, w, 1}, dev);
      };
      const RopeArgs apart{q, k, cos, sin, qo, ko}, together{q, k, cos, sin, block(0, hq), block(hq * d, hk)};
      const auto run = [&](const RopeArgs& a) { backward ? rope_backward(a) : rope_forward(a); };
      run(apart);
      run(together);
      const std::vector<double> mem = test::to_doubles(g), qv = test::to_doubles(qo), kv = test::to_doubles(ko);
      std::int64_t bad = 0;
      for (std::int64_t bi = 0; bi < b; ++bi)
        for (std::int64_t ti = 0; ti < t; ++ti)
          for (std::int64_t c = 0; c < w; ++c) {
            const std::int64_t head = c / d, j = c % d;
            const double want = head < hq ? qv[static_cast<std::size_t>(((bi * hq + head) * t + ti) * d + j)]
                                          : kv[static_cast<std::size_t>(((bi * hk + head - hq) * t + ti) * d + j)];
            bad += mem[static_cast<std::size_t>((bi * t + ti) * w + c)] == want ? 0 : 1;
          }
      EXPECT_EQ(bad, 0) << dev.str() << (backward ? " backward" : " forward");
    }
  }
  const Tensor q = Tensor::empty({1, 2, 3, 4}, DType::f32, kCpu), k = Tensor::empty({1, 1, 3, 4}, DType::f32, kCpu);
  const Tensor cos = Tensor::empty({3, 4}, DType::f32, kCpu);
  Tensor g = Tensor::empty({3 * 12}, DType::f32, kCpu);
  const auto at = [&](std::int64_t col, std::int64_t heads) {
    return TensorView(static_cast<float*>(g.data()) + col, DType::f32, {1, heads, 3, 4}, {36, 4, 12, 1}, kCpu);
  };
  EXPECT_NO_THROW(rope_forward({q, k, cos, cos, at(0, 2), at(8, 1)}));
  expect_rope_error({q, k, cos, cos, at(0, 2), at(7, 1)}, "q_out");  // k's block starts in q's last head
}

TEST(RopeErrors, MixedDevices) {
  FK_SKIP_WITHOUT_GPU();
  Tensor q = Tensor::empty({1, 2, 3, 4}, DType::f32, Device::cuda(0)), k = Tensor::empty({1, 2, 3, 4}, DType::f32, Device::cuda(0));
  Tensor cos = Tensor::empty({3, 4}, DType::f32, kCpu);
  Tensor qo = Tensor::empty({1, 2, 3, 4}, DType::f32, Device::cuda(0)), ko = Tensor::empty({1, 2, 3, 4}, DType::f32, Device::cuda(0));
  expect_rope_error({q, k, cos, cos, qo, ko}, "cos");
}

struct RopeShape {
  std::int64_t batch, q_heads, k_heads, seq, dim;
  int table_rank;  // 2: [T, D]; 3: [1, T, D] when table_batch is 1, else [B, T, D]
  std::int64_t table_batch;
  RopeLayout q_layout, k_layout, out_layout;
};

using RopeCase = std::tuple<DType, bool, RopeShape>;  // q's dtype, tables in f32, shape

class RopeGpu : public ::testing::TestWithParam<RopeCase> {};

TEST_P(RopeGpu, MatchesSpec) {
  FK_SKIP_WITHOUT_GPU();
  const auto [dt, f32_tables, sh] = GetParam();
  const Device gpu = Device::cuda(0);
  const DType tdt = f32_tables ? DType::f32 : dt;
  const Dims qs{sh.batch, sh.q_heads, sh.seq, sh.dim}, ks{sh.batch, sh.k_heads, sh.seq, sh.dim};
  const Dims ts = sh.table_rank == 2 ? Dims{sh.seq, sh.dim} : Dims{sh.table_batch, sh.seq, sh.dim};
  const Tensor cos = test::random_tensor(ts, tdt, kCpu, 41), sin = test::random_tensor(ts, tdt, kCpu, 42);
  const Tensor cos_d = cos.copy_to(gpu), sin_d = sin.copy_to(gpu);
  for (bool backward : {false, true})
    for (bool in_place : {false, true}) {
      RopeOperand q(qs, sh.q_layout, dt, 43), k(ks, sh.k_layout, dt, 44);
      RopeOperand qo(qs, sh.out_layout, dt, 45), ko(ks, sh.out_layout, dt, 46);
      auto [qb, qd] = q.on(gpu);
      auto [kb, kd] = k.on(gpu);
      auto [qob, qod] = qo.on(gpu);
      auto [kob, kod] = ko.on(gpu);
      const RopeArgs want{q.view, k.view, cos, sin, in_place ? q.view : qo.view, in_place ? k.view : ko.view};
      const RopeArgs got{qd, kd, cos_d, sin_d, in_place ? qd : qod, in_place ? kd : kod};
      if (backward) {
        reference::rope_backward(want);
        rope_backward(got);
      } else {
        reference::rope_forward(want);
        rope_forward(got);
      }
      // Whole buffers: the elements outside the views must come back as they were.
      const auto tol = kernel_tolerance(dt);
      const std::string what = fmt::format("backward {} in place {}", backward, in_place);
      EXPECT_TRUE(test::all_close(in_place ? qb : qob, in_place ? q.buffer : qo.buffer, tol)) << "q_out, " << what;
      EXPECT_TRUE(test::all_close(in_place ? kb : kob, in_place ? k.buffer : ko.buffer, tol)) << "k_out, " << what;
      if (!in_place) {
        EXPECT_TRUE(test::all_close(qb, q.buffer, {0, 0})) << "q unchanged";
        EXPECT_TRUE(test::all_close(kb, k.buffer, {0, 0})) << "k unchanged";
      }
    }
}

std::string rope_case_name(const ::testing::TestParamInfo<RopeCase>& info) {
  const auto [dt, f32_tables, s] = info.param;
  constexpr const char* layouts[] = {"contig", "bthd", "padded", "misaligned"};
  return fmt::format("{}_{}_B{}_Hq{}_Hk{}_T{}_D{}_table{}x{}_{}_{}_{}", dtype_name(dt), f32_tables ? "f32tables" : "sametables",
                     s.batch, s.q_heads, s.k_heads, s.seq, s.dim, s.table_rank, s.table_batch,
                     layouts[int(s.q_layout)], layouts[int(s.k_layout)], layouts[int(s.out_layout)]);
}

using L = RopeLayout;
INSTANTIATE_TEST_SUITE_P(
    OddShapesAndLayouts, RopeGpu,
    ::testing::Combine(::testing::Values(DType::f32, DType::bf16, DType::f16), ::testing::Bool(),
                       ::testing::Values(RopeShape{1, 1, 1, 1, 2, 2, 1, L::contiguous, L::contiguous, L::contiguous},
                                         RopeShape{2, 3, 1, 7, 6, 3, 2, L::bthd, L::contiguous, L::padded},
                                         RopeShape{3, 5, 5, 1, 64, 3, 1, L::bthd, L::bthd, L::bthd},
                                         RopeShape{2, 8, 2, 33, 128, 3, 2, L::bthd, L::bthd, L::contiguous},
                                         RopeShape{1, 12, 4, 17, 128, 2, 1, L::padded, L::misaligned, L::bthd},
                                         RopeShape{2, 7, 3, 9, 80, 3, 2, L::misaligned, L::padded, L::padded},
                                         RopeShape{1, 40, 8, 5, 64, 3, 1, L::contiguous, L::bthd, L::contiguous},
                                         RopeShape{2, 3, 0, 4, 16, 3, 2, L::bthd, L::contiguous, L::contiguous},
                                         RopeShape{1, 2, 2, 3, 1024, 2, 1, L::contiguous, L::contiguous, L::padded})),
    rope_case_name);

// Many tokens at LLaMA-like shapes; at B 17, more blocks of tokens than the row kernel's grid of 32
// blocks an SM (it strides over them).
INSTANTIATE_TEST_SUITE_P(
    LongSequence, RopeGpu,
    ::testing::Combine(::testing::Values(DType::bf16), ::testing::Bool(),
                       ::testing::Values(RopeShape{2, 12, 4, 4099, 64, 3, 2, L::bthd, L::bthd, L::bthd},
                                         RopeShape{17, 2, 1, 4099, 64, 2, 1, L::bthd, L::bthd, L::bthd},
                                         RopeShape{1, 32, 8, 2048, 128, 2, 1, L::bthd, L::contiguous, L::bthd})),
    rope_case_name);

}  // namespace
}  // namespace fk
