// The gemm family: the spec on hand-worked cases (small integers, so products are exact and
// compared with ==), the CPU backends against the spec, the cuBLAS / cuBLASLt backend against the
// spec for every epilogue, dtype and transpose, and every bad argument's error.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "fusekit/fusekit.hpp"
#include "fusekit/ops/gemm.hpp"
#include "test_util.hpp"

namespace fk {
namespace {

const Device kCpu = Device::cpu();
const auto rel_err = test::rel_err_normwise;

Tensor host_f32(Dims shape, const std::vector<float>& v) { return test::host_tensor(shape, DType::f32, v); }

std::vector<float> values(const TensorView& t) {
  std::vector<float> v;
  for (double d : test::to_doubles(t)) v.push_back(static_cast<float>(d));
  return v;
}

// The matrix [rows, cols] stored transposed when `t`: the operand op(x) = that matrix needs.
Tensor stored(const Tensor& m, Trans t) {
  if (t == Trans::n) return m.copy_to(m.device());
  const std::int64_t r = m.size(0), c = m.size(1);
  const std::vector<float> v = values(m);
  std::vector<float> out(v.size());
  for (std::int64_t i = 0; i < r; ++i)
    for (std::int64_t j = 0; j < c; ++j) out[j * r + i] = v[i * c + j];
  return test::host_tensor({c, r}, m.dtype(), out);
}

GemmParams params(Trans ta, Trans tb, GemmEpilogue e = GemmEpilogue::none, float alpha = 1.0f, float beta = 0.0f) {
  GemmParams p;
  p.trans_a = ta;
  p.trans_b = tb;
  p.alpha = alpha;
  p.beta = beta;
  p.epilogue = e;
  return p;
}

// ---- the spec, by hand ------------------------------------------------------------------------

TEST(GemmSpec, SmallIntegersEveryTransposeExact) {
  // a [2, 3] b [3, 2]: c = a b = [[4, 5], [10, 11]].
  const Tensor a = host_f32({2, 3}, {1, 2, 3, 4, 5, 6});
  const Tensor b = host_f32({3, 2}, {1, 0, 0, 1, 1, 1});
  for (DType dt : {DType::f32, DType::bf16, DType::f16})
    for (Trans ta : {Trans::n, Trans::t})
      for (Trans tb : {Trans::n, Trans::t}) {
        const Tensor as = stored(a, ta).copy_to(kCpu), bs = stored(b, tb);
        const Tensor at = test::host_tensor(as.shape(), dt, values(as)), bt = test::host_tensor(bs.shape(), dt, values(bs));
        Tensor c = Tensor::empty({2, 2}, dt, kCpu);
        test::poison(c);
        gemm({at, bt, c}, params(ta, tb));
        EXPECT_EQ(values(c), (std::vector<float>{4, 5, 10, 11})) << dtype_name(dt) << int(ta) << int(tb);
      }
}

TEST(GemmSpec, AlphaBetaAndBiasReluByHand) {
  const Tensor a = host_f32({2, 3}, {1, 2, 3, 4, 5, 6});
  const Tensor b = host_f32({3, 2}, {1, 0, 0, 1, 1, 1});
  Tensor c = host_f32({2, 2}, {1, 1, 2, 2});
  gemm({a, b, c}, params(Trans::n, Trans::n, GemmEpilogue::none, 2.0f, 3.0f));  // 2 a b + 3 c
  EXPECT_EQ(values(c), (std::vector<float>{11, 13, 26, 28}));
  const Tensor bias = host_f32({2}, {1, -20});
  gemm({a, b, c, bias}, params(Trans::n, Trans::n, GemmEpilogue::bias));
  EXPECT_EQ(values(c), (std::vector<float>{5, -15, 11, -9}));
  gemm({a, b, c, bias}, params(Trans::n, Trans::n, GemmEpilogue::relu_bias));
  EXPECT_EQ(values(c), (std::vector<float>{5, 0, 11, 0}));
  const Tensor neg = host_f32({2, 3}, {-1, -2, -3, 4, 5, 6});
  gemm({neg, b, c}, params(Trans::n, Trans::n, GemmEpilogue::relu));
  EXPECT_EQ(values(c), (std::vector<float>{0, 0, 10, 11}));
}

TEST(GemmSpec, BiasGradientOfTheWeightGradientByHand) {
  // dW = dyᵀ x with dy [3, 2], x [3, 1] of ones: dW = column sums of dy = bias_grad.
  const Tensor dy = host_f32({3, 2}, {1, 2, 3, 4, 5, 6});
  const Tensor x = host_f32({3, 1}, {1, 1, 1});
  Tensor dw = Tensor::empty({2, 1}, DType::f32, kCpu), db = Tensor::empty({2}, DType::f32, kCpu);
  test::poison(db);
  gemm({dy, x, dw, {}, {}, db}, params(Trans::t, Trans::n, GemmEpilogue::bgrad_a));
  EXPECT_EQ(values(dw), (std::vector<float>{9, 12}));
  EXPECT_EQ(values(db), (std::vector<float>{9, 12}));
}

TEST(GemmSpec, GeluAndItsDerivative) {
  // gelu (tanh approximation) at -1, 0, 1, 2: products of a one-element K.
  const Tensor a = host_f32({4, 1}, {-1, 0, 1, 2});
  const Tensor one = host_f32({1, 1}, {1});
  Tensor c = Tensor::empty({4, 1}, DType::f32, kCpu);
  gemm({a, one, c}, params(Trans::n, Trans::n, GemmEpilogue::gelu));
  const std::vector<float> g = values(c);
  const std::vector<double> want = {-0.15880800939172324, 0.0, 0.8411919906082768, 1.954597694087775};
  for (std::size_t i = 0; i < 4; ++i) EXPECT_NEAR(g[i], want[i], 1e-6) << i;
  // dgelu: c = z gelu'(aux) with z = 1; against a central difference of gelu.
  const auto gelu = [](double u) { return 0.5 * u * (1 + std::tanh(0.7978845608028654 * (u + 0.044715 * u * u * u))); };
  const Tensor ones = host_f32({4, 1}, {1, 1, 1, 1});
  const Tensor aux = host_f32({4, 1}, {-1, 0, 1, 2});
  Tensor db = Tensor::empty({1}, DType::f32, kCpu);
  gemm({ones, one, c, {}, aux, db}, params(Trans::n, Trans::n, GemmEpilogue::dgelu_bgrad));
  const std::vector<float> d = values(c);
  double sum = 0;
  for (std::size_t i = 0; i < 4; ++i) {
    const double u = values(aux)[i], h = 1e-4;
    EXPECT_NEAR(d[i], (gelu(u + h) - gelu(u - h)) / (2 * h), 1e-5) << i;
    sum += d[i];
  }
  EXPECT_NEAR(values(db)[0], sum, 1e-5);
  // gelu_aux_bias writes the pre-activation it applied gelu to.
  const Tensor bias = host_f32({1}, {0.5f});
  Tensor pre = Tensor::empty({4, 1}, DType::f32, kCpu);
  gemm({a, one, c, bias, pre}, params(Trans::n, Trans::n, GemmEpilogue::gelu_aux_bias));
  EXPECT_EQ(values(pre), (std::vector<float>{-0.5f, 0.5f, 1.5f, 2.5f}));
}

// ---- the CPU backends against the spec ----------------------------------------------------------

// The spec in double over plain vectors, for any transpose, alpha, beta.
std::vector<double> plain_product(const std::vector<double>& a, const std::vector<double>& b, const std::vector<double>& c,
                                  std::int64_t m, std::int64_t n, std::int64_t k, Trans ta, Trans tb, double alpha,
                                  double beta) {
  std::vector<double> out(static_cast<std::size_t>(m * n));
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (std::int64_t l = 0; l < k; ++l)
        s += a[ta == Trans::n ? i * k + l : l * m + i] * b[tb == Trans::n ? l * n + j : j * k + l];
      out[i * n + j] = alpha * s + (beta == 0 ? 0 : beta * c[i * n + j]);
    }
  return out;
}

TEST(GemmCpu, BlockedF32MatchesPlainLoopsEveryTransposeAndOddSizes) {
  for (float beta : {2.0f, 0.0f})
    for (Trans ta : {Trans::n, Trans::t})
      for (Trans tb : {Trans::n, Trans::t})
        for (auto [m, n, k] : {std::array<std::int64_t, 3>{1, 1, 1}, {7, 13, 300}, {9, 5, 3}, {33, 17, 513}, {8, 48, 0}}) {
          const Tensor a = test::random_tensor(ta == Trans::n ? Dims{m, k} : Dims{k, m}, DType::f32, kCpu, 1);
          const Tensor b = test::random_tensor(tb == Trans::n ? Dims{k, n} : Dims{n, k}, DType::f32, kCpu, 2);
          Tensor c = test::random_tensor({m, n}, DType::f32, kCpu, 3);
          if (beta == 0.0f) test::poison(c);  // beta 0 must not read c
          const std::vector<double> want = plain_product(test::to_doubles(a), test::to_doubles(b), test::to_doubles(c),
                                                         m, n, k, ta, tb, 0.5, beta);
          gemm({a, b, c}, params(ta, tb, GemmEpilogue::none, 0.5f, beta));
          const std::vector<double> got = test::to_doubles(c);
          for (std::size_t i = 0; i < got.size(); ++i)
            ASSERT_NEAR(got[i], want[i], 1e-4 * (1 + std::fabs(want[i]))) << int(ta) << int(tb) << " " << m << "x" << n
                                                                           << "x" << k;
        }
}

TEST(GemmCpu, PaddedRowsAndBroadcastBatch) {
  // c is columns [0, 5) of a [4, 8] buffer; a is one [4, 3] matrix for a batch of 2 (stride 0).
  const Tensor a = test::random_tensor({4, 3}, DType::f32, kCpu, 1);
  const Tensor b = test::random_tensor({2, 3, 5}, DType::f32, kCpu, 2);
  Tensor buf = Tensor::empty({2, 4, 8}, DType::f32, kCpu);
  fill(buf, 7.0);
  const TensorView a3(a.data(), DType::f32, {2, 4, 3}, {0, 3, 1}, kCpu);
  const TensorView c3(buf.data(), DType::f32, {2, 4, 5}, {32, 8, 1}, kCpu);
  gemm({a3, b, c3});
  const std::vector<double> av = test::to_doubles(a), bv = test::to_doubles(b), cv = test::to_doubles(buf);
  for (int g = 0; g < 2; ++g)
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 8; ++j) {
        double want = 7.0;
        if (j < 5) {
          want = 0;
          for (int l = 0; l < 3; ++l) want += av[i * 3 + l] * bv[g * 15 + l * 5 + j];
        }
        EXPECT_NEAR(cv[g * 32 + i * 8 + j], want, 1e-5) << g << " " << i << " " << j;
      }
}

// ---- the GPU against the spec -----------------------------------------------------------------

struct GpuCase {
  DType in, out;
  bool tf32;
};

double tolerance(const GpuCase& c) {
  if (c.in == DType::f32) return c.tf32 ? 2e-3 : 1e-5;  // TF32 keeps 10 mantissa bits
  return c.out == DType::f32 ? 1e-5 : 1e-2;              // one rounding of the output to 8 / 11 bits
}

TEST(GemmGpu, EveryEpilogueDtypeAndTransposeMatchesSpec) {
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  const GemmEpilogue epilogues[] = {GemmEpilogue::none,      GemmEpilogue::bias,       GemmEpilogue::relu,
                                    GemmEpilogue::relu_bias, GemmEpilogue::gelu,       GemmEpilogue::gelu_bias,
                                    GemmEpilogue::gelu_aux_bias, GemmEpilogue::dgelu, GemmEpilogue::dgelu_bgrad,
                                    GemmEpilogue::bgrad_a};
  const GpuCase cases[] = {{DType::f32, DType::f32, false}, {DType::f32, DType::f32, true},
                           {DType::bf16, DType::bf16, false}, {DType::f16, DType::f16, false},
                           {DType::bf16, DType::f32, false}};
  for (const GpuCase& gc : cases)
    for (GemmEpilogue e : epilogues)
      for (Trans ta : {Trans::n, Trans::t})
        for (Trans tb : {Trans::n, Trans::t})
          for (auto [m, n, k] : {std::array<std::int64_t, 3>{136, 264, 72}, {1, 8, 16}, {264, 40, 520}}) {
            if (e == GemmEpilogue::bgrad_a && ta == Trans::n) continue;  // refused: see GemmErrors
            const std::string what = fmt::format("{}->{}{} {} ta{} tb{} {}x{}x{}", dtype_name(gc.in), dtype_name(gc.out),
                                                 gc.tf32 ? " tf32" : "", gemm_epilogue_name(e), int(ta), int(tb), m, n, k);
            const Tensor a = test::random_tensor(ta == Trans::n ? Dims{m, k} : Dims{k, m}, gc.in, kCpu, 1);
            const Tensor b = test::random_tensor(tb == Trans::n ? Dims{k, n} : Dims{n, k}, gc.in, kCpu, 2);
            const Tensor bias = test::random_tensor({n}, gc.out, kCpu, 3);
            const Tensor aux_in = test::random_tensor({m, n}, gc.out, kCpu, 4, -3.f, 3.f);
            Tensor c = Tensor::empty({m, n}, gc.out, kCpu), aux = Tensor::empty({m, n}, gc.out, kCpu);
            Tensor bgrad = Tensor::empty({e == GemmEpilogue::bgrad_a ? m : n}, gc.out, kCpu);
            const bool with_bias = e == GemmEpilogue::bias || e == GemmEpilogue::relu_bias ||
                                   e == GemmEpilogue::gelu_bias || e == GemmEpilogue::gelu_aux_bias;
            const bool reads_aux = e == GemmEpilogue::dgelu || e == GemmEpilogue::dgelu_bgrad;
            const bool with_aux = reads_aux || e == GemmEpilogue::gelu_aux_bias;
            const bool with_bgrad = e == GemmEpilogue::dgelu_bgrad || e == GemmEpilogue::bgrad_a;
            if (reads_aux) copy(aux, aux_in);
            GemmParams p = params(ta, tb, e);
            p.allow_tf32 = gc.tf32;
            auto opt = [](bool on, const Tensor& t) { return on ? std::optional<TensorView>(t.view()) : std::nullopt; };
            gemm({a, b, c, opt(with_bias, bias), opt(with_aux, aux), opt(with_bgrad, bgrad)}, p);

            const Tensor ag = a.copy_to(gpu), bg = b.copy_to(gpu), biasg = bias.copy_to(gpu);
            Tensor cg = Tensor::empty({m, n}, gc.out, gpu), auxg = reads_aux ? aux_in.copy_to(gpu) : Tensor::empty({m, n}, gc.out, gpu);
            Tensor bgradg = Tensor::empty(bgrad.shape(), gc.out, gpu);
            test::poison(cg);
            test::poison(bgradg);
            if (!reads_aux) test::poison(auxg);
            try {
              gemm({ag, bg, cg, opt(with_bias, biasg), opt(with_aux, auxg), opt(with_bgrad, bgradg)}, p);
            } catch (const Error& err) {
              ADD_FAILURE() << what << ": " << err.what();
              continue;
            }
            // cuBLASLt's GELU evaluates tanh with a fast approximation (~1e-5 relative): the f32
            // bound of the GELU epilogues is that, not fp32 rounding.
            const bool gelu = e == GemmEpilogue::gelu || e == GemmEpilogue::gelu_bias ||
                              e == GemmEpilogue::gelu_aux_bias || e == GemmEpilogue::dgelu ||
                              e == GemmEpilogue::dgelu_bgrad;
            const double tol = gelu ? std::max(tolerance(gc), 1e-4) : tolerance(gc);
            EXPECT_LE(rel_err(cg, c), tol) << what;
            if (e == GemmEpilogue::gelu_aux_bias) {
              EXPECT_LE(rel_err(auxg, aux), tol) << "aux " << what;
            }
            if (with_bgrad) {
              EXPECT_LE(rel_err(bgradg, bgrad), tol) << "bias_grad " << what;
            }
          }
}

TEST(GemmGpu, PaddedRowsAsDlrmUsesThem) {
  // DLRM's layers: x [B, 13] in rows padded to 16 floats, y [B, 64] in rows of 80; TF32; bias + ReLU.
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  const std::int64_t rows = 1000;
  const Tensor xbuf = test::random_tensor({rows, 16}, DType::f32, kCpu, 1);
  const Tensor w = test::random_tensor({64, 16}, DType::f32, kCpu, 2);  // [out, in_ld], zero padding irrelevant
  const Tensor bias = test::random_tensor({64}, DType::f32, kCpu, 3);
  const TensorView x(xbuf.data(), DType::f32, {rows, 16}, {16, 1}, kCpu);
  Tensor want = Tensor::empty({rows, 64}, DType::f32, kCpu);
  GemmParams p = params(Trans::n, Trans::t, GemmEpilogue::relu_bias);
  p.allow_tf32 = true;
  gemm({x, w, want, bias}, p);
  const Tensor xg = xbuf.copy_to(gpu), wg = w.copy_to(gpu), bg = bias.copy_to(gpu);
  Tensor ybuf = Tensor::empty({rows, 80}, DType::f32, gpu);
  test::poison(ybuf);
  const TensorView y(ybuf.data(), DType::f32, {rows, 64}, {80, 1}, gpu);
  gemm({xg, wg, y, bg}, p);
  const std::vector<double> got = test::to_doubles(ybuf), ref = test::to_doubles(want);
  double err = 0, norm = 0;
  int untouched = 0;
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t j = 0; j < 80; ++j) {
      const double g = got[i * 80 + j];
      if (j >= 64) {
        untouched += std::isnan(g);
        continue;
      }
      err += (g - ref[i * 64 + j]) * (g - ref[i * 64 + j]);
      norm += ref[i * 64 + j] * ref[i * 64 + j];
    }
  EXPECT_LE(std::sqrt(err / norm), 2e-3);
  EXPECT_EQ(untouched, rows * 16) << "the padding columns must stay as they were";
}

TEST(GemmGpu, BatchedWithBroadcastAndEmptyK) {
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  for (DType dt : {DType::f32, DType::bf16}) {
    const Tensor a = test::random_tensor({37, 24}, dt, kCpu, 1);
    const Tensor b = test::random_tensor({5, 24, 40}, dt, kCpu, 2);
    const TensorView a3(a.data(), dt, {5, 37, 24}, {0, 24, 1}, kCpu);
    Tensor want = Tensor::empty({5, 37, 40}, dt, kCpu);
    gemm({a3, b, want});
    const Tensor ag = a.copy_to(gpu), bg = b.copy_to(gpu);
    const TensorView a3g(ag.data(), dt, {5, 37, 24}, {0, 24, 1}, gpu);
    Tensor got = Tensor::empty({5, 37, 40}, dt, gpu);
    test::poison(got);
    gemm({a3g, bg, got});
    EXPECT_LE(rel_err(got, want), dt == DType::f32 ? 1e-5 : 1e-2) << dtype_name(dt);
  }
  // K = 0, beta 0: c is zeros (the sum over nothing).
  const Tensor a = Tensor::empty({3, 0}, DType::f32, gpu), b = Tensor::empty({0, 4}, DType::f32, gpu);
  Tensor c = Tensor::empty({3, 4}, DType::f32, gpu);
  test::poison(c);
  gemm({a, b, c});
  for (double v : test::to_doubles(c)) EXPECT_EQ(v, 0.0);
}

// ---- bad arguments --------------------------------------------------------------------------------

TEST(GemmErrors, BadArgumentsNameTheArgument) {
  const Tensor a = Tensor::empty({4, 3}, DType::f32, kCpu), b = Tensor::empty({3, 5}, DType::f32, kCpu);
  const Tensor c = Tensor::empty({4, 5}, DType::f32, kCpu);
  const Tensor bias = Tensor::empty({5}, DType::f32, kCpu);
  using test::expect_arg_error;
  expect_arg_error([&] { gemm({a, Tensor::empty({4, 5}, DType::f32, kCpu), c}); }, "gemm", "b");
  expect_arg_error([&] { gemm({a, b, Tensor::empty({5, 5}, DType::f32, kCpu)}); }, "gemm", "a");
  expect_arg_error([&] { gemm({a, Tensor::empty({3, 5}, DType::bf16, kCpu), c}); }, "gemm", "b");
  expect_arg_error([&] { gemm({a, b, Tensor::empty({4, 5}, DType::f16, kCpu)}); }, "gemm", "c");
  expect_arg_error([&] { gemm({Tensor::empty({4, 3}, DType::i32, kCpu), b, c}); }, "gemm", "a");
  expect_arg_error([&] { gemm({a, b, c}, params(Trans::n, Trans::n, GemmEpilogue::bias)); }, "gemm", "bias");
  expect_arg_error([&] { gemm({a, b, c, bias}); }, "gemm", "bias");
  expect_arg_error([&] { gemm({a, b, c, Tensor::empty({4}, DType::f32, kCpu)}, params(Trans::n, Trans::n, GemmEpilogue::bias)); },
                   "gemm", "bias");
  expect_arg_error([&] { gemm({a, b, c}, params(Trans::n, Trans::n, GemmEpilogue::dgelu)); }, "gemm", "aux");
  expect_arg_error([&] { gemm({a, b, c, bias}, params(Trans::n, Trans::n, GemmEpilogue::relu_bias, 1.0f, 1.0f)); }, "gemm",
                   "beta");
  expect_arg_error([&] { gemm({a, b, c}, params(Trans::n, Trans::n, GemmEpilogue::none, NAN)); }, "gemm", "alpha");
  // c overlapping a; a view with a column stride of 2.
  Tensor buf = Tensor::empty({4, 5}, DType::f32, kCpu);
  expect_arg_error([&] { gemm({buf.view().reshape({4, 5}), Tensor::empty({5, 5}, DType::f32, kCpu), buf}); }, "gemm", "c");
  const TensorView strided(buf.data(), DType::f32, {4, 2}, {5, 2}, kCpu);
  expect_arg_error([&] { gemm({strided, Tensor::empty({2, 5}, DType::f32, kCpu), c}); }, "gemm", "a");
  // bgrad_a sums the rows of a stored [K, M] (the weight gradient's dy): trans_a = t only.
  expect_arg_error([&] { gemm({a, b, c, {}, {}, Tensor::empty({4}, DType::f32, kCpu)},
                              params(Trans::n, Trans::n, GemmEpilogue::bgrad_a)); }, "gemm", "trans_a");
  // Batched GEMMs take no epilogue; a batch that differs from c's.
  const Tensor a3 = Tensor::empty({2, 4, 3}, DType::f32, kCpu), b3 = Tensor::empty({2, 3, 5}, DType::f32, kCpu);
  const Tensor c3 = Tensor::empty({2, 4, 5}, DType::f32, kCpu), bias3 = Tensor::empty({5}, DType::f32, kCpu);
  expect_arg_error([&] { gemm({a3, b3, c3, bias3}, params(Trans::n, Trans::n, GemmEpilogue::bias)); }, "gemm", "epilogue");
  expect_arg_error([&] { gemm({Tensor::empty({3, 4, 3}, DType::f32, kCpu), b3, c3}); }, "gemm", "a");
}

}  // namespace
}  // namespace fk
