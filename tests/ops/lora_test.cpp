// Tests of the lora family: the spec against a hand-worked case and finite differences, the GPU
// (the fused Hopper GEMM and the unfused path) against the spec on shapes that are not multiples
// of the tile, r = 1 .. 64, every activation, LoRALinear, and every bad input.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "fusekit/fusekit.hpp"
#include "ops/lora/lora_cuda.hpp"
#include "test_util.hpp"

namespace fk {
namespace {

const Device kCpu = Device::cpu();
const auto rel_err = test::rel_err_normwise;

// ---------------------------------------------------------------------------------------------
// The spec
// ---------------------------------------------------------------------------------------------

TEST(LoraSpec, TinyForwardByHand) {
  // x = [1, 2], W = I, b = [0.5, -0.5], A = [[1, 1]] (r = 1), B = [[1], [2]], s = 0.5:
  // t = 0.5 * 3 = 1.5; z = [1 + 0.5 + 1.5, 2 - 0.5 + 3] = [3, 4.5].
  const Tensor x = test::host_tensor({1, 2}, DType::f32, {1, 2});
  const Tensor w = test::host_tensor({2, 2}, DType::f32, {1, 0, 0, 1});
  const Tensor b = test::host_tensor({2}, DType::f32, {0.5f, -0.5f});
  const Tensor a = test::host_tensor({1, 2}, DType::f32, {1, 1});
  const Tensor bb = test::host_tensor({2, 1}, DType::f32, {1, 2});
  Tensor y = Tensor::empty({1, 2}, DType::f32, kCpu), t = Tensor::empty({1, 1}, DType::f32, kCpu),
         z = Tensor::empty({1, 2}, DType::f32, kCpu);
  lora_forward({x, w, b.view(), a, bb, y, t.view(), z.view()}, {Activation::sigmoid, 0.5f});
  EXPECT_FLOAT_EQ(t.data_as<float>()[0], 1.5f);
  EXPECT_FLOAT_EQ(z.data_as<float>()[0], 3.0f);
  EXPECT_FLOAT_EQ(z.data_as<float>()[1], 4.5f);
  EXPECT_NEAR(y.data_as<float>()[0], 1.0 / (1.0 + std::exp(-3.0)), 1e-7);
  EXPECT_NEAR(y.data_as<float>()[1], 1.0 / (1.0 + std::exp(-4.5)), 1e-7);
}

TEST(LoraSpec, BackwardMatchesFiniteDifferencesOfForward) {
  // loss = sum(y * G); the gradients of lora_backward against central differences, f32 on the
  // CPU (the spec in double underneath, rounded once at each store). r = 1 and r = 3.
  const std::int64_t m = 3, n = 4, k = 5;
  for (std::int64_t r : {1, 3})
    for (Activation act : {Activation::identity, Activation::sigmoid, Activation::tanh, Activation::gelu_tanh,
                           Activation::gelu_erf, Activation::silu}) {
      const LoraParams p{act, 0.75f};
      Tensor x = test::random_tensor({m, k}, DType::f32, kCpu, 1, -1.f, 1.f);
      const Tensor w = test::random_tensor({n, k}, DType::f32, kCpu, 2, -1.f, 1.f);
      Tensor bias = test::random_tensor({n}, DType::f32, kCpu, 3, -0.5f, 0.5f);
      Tensor a = test::random_tensor({r, k}, DType::f32, kCpu, 4, -1.f, 1.f);
      Tensor b = test::random_tensor({n, r}, DType::f32, kCpu, 5, -1.f, 1.f);
      const Tensor g = test::random_tensor({m, n}, DType::f32, kCpu, 6, -1.f, 1.f);
      Tensor y = Tensor::empty({m, n}, DType::f32, kCpu), z = Tensor::empty({m, n}, DType::f32, kCpu);
      lora_forward({x, w, bias.view(), a, b, y, std::nullopt, z.view()}, p);
      const bool from_y = derivative_from_output(act);
      Tensor dx = Tensor::empty({m, k}, DType::f32, kCpu), da = Tensor::empty({r, k}, DType::f32, kCpu),
             db = Tensor::empty({n, r}, DType::f32, kCpu), dbias = Tensor::empty({n}, DType::f32, kCpu);
      lora_backward({g, from_y ? y.view() : z.view(),
                     from_y ? SavedForBackward::output : SavedForBackward::preactivation, x, w, a, b, std::nullopt,
                     dx.view(), da, db, dbias.view()},
                    p);
      auto loss = [&] {
        Tensor out = Tensor::empty({m, n}, DType::f32, kCpu);
        lora_forward({x, w, bias.view(), a, b, out, std::nullopt, std::nullopt}, p);
        double s = 0;
        for (std::int64_t i = 0; i < m * n; ++i) s += double(out.data_as<float>()[i]) * g.data_as<float>()[i];
        return s;
      };
      auto check = [&](Tensor& param, const Tensor& grad, const char* name) {
        for (std::int64_t i = 0; i < param.numel(); ++i) {
          float* q = param.data_as<float>() + i;
          const float keep = *q, h = 1e-2f;
          *q = keep + h;
          const double up = loss();
          *q = keep - h;
          const double down = loss();
          *q = keep;
          EXPECT_NEAR(grad.data_as<float>()[i], (up - down) / (2.0 * h), 2e-3)
              << activation_name(act) << " r=" << r << " d" << name << "[" << i << "]";
        }
      };
      check(x, dx, "x");
      check(a, da, "a");
      check(b, db, "b");
      check(bias, dbias, "bias");
    }
}

TEST(LoraSpec, ZeroAdapterIsThePlainLinear) {
  // B = 0: y = act(x Wᵀ + b) whatever A and s are.
  const std::int64_t m = 4, n = 3, k = 6, r = 2;
  const Tensor x = test::random_tensor({m, k}, DType::f32, kCpu, 7);
  const Tensor w = test::random_tensor({n, k}, DType::f32, kCpu, 8);
  const Tensor bias = test::random_tensor({n}, DType::f32, kCpu, 9);
  const Tensor a = test::random_tensor({r, k}, DType::f32, kCpu, 10);
  Tensor b = Tensor::empty({n, r}, DType::f32, kCpu);
  fill(b, 0.0);
  Tensor y = Tensor::empty({m, n}, DType::f32, kCpu);
  lora_forward({x, w, bias.view(), a, b, y, std::nullopt, std::nullopt}, {Activation::tanh, 3.0f});
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t c = 0; c < n; ++c) {
      double z = bias.data_as<float>()[c];
      for (std::int64_t q = 0; q < k; ++q) z += double(x.data_as<float>()[i * k + q]) * w.data_as<float>()[c * k + q];
      EXPECT_NEAR(y.data_as<float>()[i * n + c], std::tanh(z), 1e-6);
    }
}

// ---------------------------------------------------------------------------------------------
// GPU against the spec
// ---------------------------------------------------------------------------------------------

struct GpuCase {
  std::int64_t m, n, k, r;
  DType dtype;
};

// Normwise relative error bound: one rounding of the output plus the roundings of t (and, in
// the backward, of g and s u) to the dtype, which the spec does not have.
double tolerance(DType t) { return t == DType::bf16 ? 1e-2 : (t == DType::f16 ? 2e-3 : 1e-5); }

std::string describe(const GpuCase& c) {
  return std::string(dtype_name(c.dtype)) + " M" + std::to_string(c.m) + " N" + std::to_string(c.n) + " K" +
         std::to_string(c.k) + " r" + std::to_string(c.r);
}

std::vector<GpuCase> gpu_cases() {
  std::vector<GpuCase> cases;
  // Tails of every tile dimension (128 x 128 x 64), M = 1, r = 1 .. 64 (r not a multiple of 16),
  // N or K not multiples of 8 (the unfused path).
  const std::int64_t shapes[][4] = {{1, 8, 8, 1},      {3, 16, 24, 16},   {130, 264, 72, 5},   {255, 136, 200, 64},
                                    {256, 512, 512, 16}, {200, 96, 264, 33}, {64, 203, 40, 4}, {33, 64, 13, 2}};
  for (const auto& s : shapes)
    for (DType d : {DType::bf16, DType::f16, DType::f32}) cases.push_back({s[0], s[1], s[2], s[3], d});
  return cases;
}

struct Operands {
  Tensor x, w, bias, a, b;
};

Operands make_operands(const GpuCase& c, int seed, Device dev) {
  Operands o;
  o.x = test::random_tensor({c.m, c.k}, c.dtype, dev, seed, -1.f, 1.f);
  o.w = test::random_tensor({c.n, c.k}, c.dtype, dev, seed + 1, -0.5f, 0.5f);
  o.bias = test::random_tensor({c.n}, c.dtype, dev, seed + 2, -0.5f, 0.5f);
  o.a = test::random_tensor({c.r, c.k}, c.dtype, dev, seed + 3, -0.5f, 0.5f);
  o.b = test::random_tensor({c.n, c.r}, c.dtype, dev, seed + 4, -0.5f, 0.5f);
  return o;
}

TEST(LoraGpu, ForwardMatchesSpec) {
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  int seed = 100;
  for (const GpuCase& c : gpu_cases())
    for (Activation act : {Activation::identity, Activation::relu, Activation::gelu_tanh, Activation::silu})
      for (bool with_bias : {true, false}) {
        seed += 10;
        const LoraParams p{act, 0.5f};
        const Operands h = make_operands(c, seed, kCpu), d = make_operands(c, seed, gpu);
        Tensor y = Tensor::empty({c.m, c.n}, c.dtype, kCpu), t = Tensor::empty({c.m, c.r}, c.dtype, kCpu),
               z = Tensor::empty({c.m, c.n}, c.dtype, kCpu);
        const auto hb = with_bias ? std::optional(h.bias.view()) : std::nullopt;
        const auto db = with_bias ? std::optional(d.bias.view()) : std::nullopt;
        reference::lora_forward({h.x, h.w, hb, h.a, h.b, y, t.view(), z.view()}, p);
        Tensor gy = Tensor::empty({c.m, c.n}, c.dtype, gpu), gt = Tensor::empty({c.m, c.r}, c.dtype, gpu),
               gz = Tensor::empty({c.m, c.n}, c.dtype, gpu), gy2 = Tensor::empty({c.m, c.n}, c.dtype, gpu);
        test::poison(gy);
        test::poison(gt);
        test::poison(gz);
        test::poison(gy2);
        lora_forward({d.x, d.w, db, d.a, d.b, gy, gt.view(), gz.view()}, p);
        lora_forward({d.x, d.w, db, d.a, d.b, gy2, std::nullopt, std::nullopt}, p);  // the inference path
        // y and t without z: at r <= 16 on sm_90, t comes out of the GEMM that computes y.
        Tensor gy3 = Tensor::empty({c.m, c.n}, c.dtype, gpu), gt3 = Tensor::empty({c.m, c.r}, c.dtype, gpu);
        test::poison(gy3);
        test::poison(gt3);
        lora_forward({d.x, d.w, db, d.a, d.b, gy3, gt3.view(), std::nullopt}, p);
        const std::string what = describe(c) + " " + std::string(activation_name(act)) + (with_bias ? " bias" : "");
        EXPECT_LE(rel_err(gy, y), tolerance(c.dtype)) << "y " << what;
        EXPECT_LE(rel_err(gz, z), tolerance(c.dtype)) << "z " << what;
        EXPECT_LE(rel_err(gt, t), tolerance(c.dtype)) << "t " << what;
        EXPECT_LE(rel_err(gy2, y), tolerance(c.dtype)) << "y (no t, z) " << what;
        EXPECT_LE(rel_err(gy3, y), tolerance(c.dtype)) << "y (t, no z) " << what;
        EXPECT_LE(rel_err(gt3, t), tolerance(c.dtype)) << "t (t, no z) " << what;
      }
}

TEST(LoraGpu, BackwardMatchesSpec) {
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  int seed = 5000;
  for (const GpuCase& c : gpu_cases())
    for (Activation act : {Activation::identity, Activation::sigmoid, Activation::gelu_erf})
      for (bool pass_t : {true, false}) {
        seed += 10;
        const LoraParams p{act, 0.5f};
        const Operands h = make_operands(c, seed, kCpu), d = make_operands(c, seed, gpu);
        const Tensor dy = test::random_tensor({c.m, c.n}, c.dtype, kCpu, seed + 7, -1.f, 1.f);
        // The saved tensor comes from the spec's forward, so that both backwards see the same z.
        Tensor y = Tensor::empty({c.m, c.n}, c.dtype, kCpu), z = Tensor::empty({c.m, c.n}, c.dtype, kCpu),
               t = Tensor::empty({c.m, c.r}, c.dtype, kCpu);
        reference::lora_forward({h.x, h.w, h.bias.view(), h.a, h.b, y, t.view(), z.view()}, p);
        const bool from_y = derivative_from_output(act);
        const SavedForBackward kind = from_y ? SavedForBackward::output : SavedForBackward::preactivation;
        const Tensor& saved = from_y ? y : z;
        Tensor dx = Tensor::empty({c.m, c.k}, c.dtype, kCpu), da = Tensor::empty({c.r, c.k}, c.dtype, kCpu),
               dbm = Tensor::empty({c.n, c.r}, c.dtype, kCpu), dbias = Tensor::empty({c.n}, c.dtype, kCpu);
        reference::lora_backward({dy, saved, kind, h.x, h.w, h.a, h.b, std::nullopt, dx.view(), da, dbm, dbias.view()},
                                 p);
        const Tensor gdy = dy.copy_to(gpu), gsaved = saved.copy_to(gpu), gtt = t.copy_to(gpu);
        Tensor gdx = Tensor::empty({c.m, c.k}, c.dtype, gpu), gda = Tensor::empty({c.r, c.k}, c.dtype, gpu),
               gdb = Tensor::empty({c.n, c.r}, c.dtype, gpu), gdbias = Tensor::empty({c.n}, c.dtype, gpu);
        for (const Tensor* o : {&gdx, &gda, &gdb, &gdbias}) test::poison(*o);
        lora_backward({gdy, gsaved, kind, d.x, d.w, d.a, d.b, pass_t ? std::optional(gtt.view()) : std::nullopt,
                       gdx.view(), gda, gdb, gdbias.view()},
                      p);
        const std::string what = describe(c) + " " + std::string(activation_name(act)) + (pass_t ? " t given" : "");
        // g and s u are rounded to the dtype before the GEMMs that use them: two more roundings.
        const double tol = 2 * tolerance(c.dtype);
        EXPECT_LE(rel_err(gdx, dx), tol) << "dx " << what;
        EXPECT_LE(rel_err(gda, da), tol) << "da " << what;
        EXPECT_LE(rel_err(gdb, dbm), tol) << "db " << what;
        EXPECT_LE(rel_err(gdbias, dbias), tol) << "dbias " << what;
      }
}

#if FUSEKIT_WITH_CUDA  // these two call the CUDA kernels directly
TEST(LoraGpu, BothGemmSchedulesMatchSpec) {
  // The fused GEMM's ways of finishing a tile (no-shared-memory register stores; TMA stores with
  // the rank-r term by mma.sync or as a mainloop k-tile) and a few tile orders of the persistent
  // scheduler, called directly: the public op picks one by the shape, and these tests reach the
  // others.
  // Forward (rhs [N, K]) and the backward's layout (rhs [K, N], z = lhs rhs + L Rᵀ, identity),
  // M and N past a tile.
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  const std::int64_t m = 300, n = 264, k = 136;
  for (DType dt : {DType::bf16, DType::f16})
    for (bool n_by_k : {true, false})
      for (int variant = 0; variant < 6; ++variant) {
        // 0: registers; 1: TMA; 2: TMA, swizzle 4 along M; 3: TMA, swizzle 2 along N; 4: the
        // rank-r term as the mainloop's last k-tile (R transposed as its right factor for rhs [K, N]);
        // 5: the rank-16 term by a register-sourced wgmma in the TMA epilogue (r = 16).
        const std::int64_t r = variant == 5 ? 16 : 32;
        const auto epi = variant == 0   ? cuda::LoraEpilogueKind::registers
                         : variant == 4 ? cuda::LoraEpilogueKind::tma_ktile
                         : variant == 5 ? cuda::LoraEpilogueKind::tma_rs
                                        : cuda::LoraEpilogueKind::tma;
        const int swizzle = variant == 2 ? 4 : (variant == 3 ? 2 : 0);
        const int raster = variant == 2 ? 1 : (variant == 3 ? 2 : 0);
        const Tensor x = test::random_tensor({m, k}, dt, kCpu, 1, -1.f, 1.f);
        const Tensor w = test::random_tensor(n_by_k ? Dims{n, k} : Dims{k, n}, dt, kCpu, 2, -0.5f, 0.5f);
        const Tensor bias = test::random_tensor({n}, dt, kCpu, 3, -0.5f, 0.5f);
        const Tensor l = test::random_tensor({m, r}, dt, kCpu, 4, -1.f, 1.f);
        const Tensor rr = test::random_tensor({n, r}, dt, kCpu, 5, -1.f, 1.f);
        // The spec of this product: plain loops in double.
        Tensor want = Tensor::empty({m, n}, DType::f32, kCpu);
        const std::vector<double> xv = test::to_doubles(x), wv = test::to_doubles(w), bv = test::to_doubles(bias),
                                  lv = test::to_doubles(l), rv = test::to_doubles(rr);
        for (std::int64_t i = 0; i < m; ++i)
          for (std::int64_t c = 0; c < n; ++c) {
            double z = n_by_k ? bv[c] : 0.0;
            for (std::int64_t q = 0; q < k; ++q) z += xv[i * k + q] * (n_by_k ? wv[c * k + q] : wv[q * n + c]);
            for (std::int64_t j = 0; j < r; ++j) z += lv[i * r + j] * rv[c * r + j];
            want.data_as<float>()[i * n + c] = static_cast<float>(n_by_k ? std::tanh(z) : z);
          }
        // R transposed, [r, N]: the k-tile path's right factor for rhs [K, N].
        const std::vector<double> rrv = test::to_doubles(rr);
        std::vector<float> rtv(static_cast<std::size_t>(r * n));
        for (std::int64_t j = 0; j < r; ++j)
          for (std::int64_t c = 0; c < n; ++c) rtv[j * n + c] = static_cast<float>(rrv[c * r + j]);
        const Tensor rt = test::host_tensor({r, n}, dt, rtv);
        const Tensor xg = x.copy_to(gpu), wg = w.copy_to(gpu), bg = bias.copy_to(gpu), lg = l.copy_to(gpu),
                     rg = rr.copy_to(gpu), rtg = rt.copy_to(gpu);
        Tensor out = Tensor::empty({m, n}, dt, gpu);
        test::poison(out);
        const TensorView bias_view = bg.view();
        ASSERT_TRUE(cuda::lora_gemm_fused(
            {xg, wg, n_by_k, lg, rg, n_by_k ? &bias_view : nullptr, n_by_k ? Activation::tanh : Activation::identity,
             out, nullptr, rtg.view(), epi, swizzle, raster},
            nullptr));
        Tensor got = Tensor::empty({m, n}, DType::f32, kCpu);
        const std::vector<double> ov = test::to_doubles(out);
        for (std::int64_t i = 0; i < m * n; ++i) got.data_as<float>()[i] = static_cast<float>(ov[i]);
        EXPECT_LE(rel_err(got, want), tolerance(dt))
            << dtype_name(dt) << (n_by_k ? " rhs [N, K]" : " rhs [K, N]")
            << " variant " << variant;
      }
}

TEST(LoraGpu, TInsideTheGemmOverManyWavesMatchesSpec) {
  // The forward with t computed inside the GEMM (lora_gemm_t.cu) over 17 x 17 tiles, more than a
  // wave on any GPU: every tile waits in its epilogue for the owner of its row block (the tile in
  // N-block 0). Tails in M, N and K; r = 16 and r = 5 (A and B zero-padded to 16); the
  // persistent scheduler's orders along M and along N. y and t against the spec on every 7th row
  // (plain loops in double).
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  const std::int64_t m = 2100, n = 2056, k = 520;
  const float scale = 0.75f;
  int seed = 9000;
  for (DType dt : {DType::bf16, DType::f16})
    for (std::int64_t r : {16, 5})
      for (int order = 0; order < 3; ++order) {
        // 0: the automatic order (swizzle 4 along M); 1: swizzle 1 along M; 2: swizzle 2 along N.
        seed += 10;
        const Tensor x = test::random_tensor({m, k}, dt, kCpu, seed, -1.f, 1.f);
        const Tensor w = test::random_tensor({n, k}, dt, kCpu, seed + 1, -0.5f, 0.5f);
        const Tensor bias = test::random_tensor({n}, dt, kCpu, seed + 2, -0.5f, 0.5f);
        const Tensor a = test::random_tensor({r, k}, dt, kCpu, seed + 3, -0.5f, 0.5f);
        const Tensor b = test::random_tensor({n, r}, dt, kCpu, seed + 4, -0.5f, 0.5f);
        // A [16, K] and B [N, 16], zero-padded, as lora_forward hands them to the GEMM.
        const std::vector<double> xv = test::to_doubles(x), wv = test::to_doubles(w), bv = test::to_doubles(bias),
                                  av = test::to_doubles(a), bbv = test::to_doubles(b);
        std::vector<float> ap(static_cast<std::size_t>(16 * k), 0.f), bp(static_cast<std::size_t>(n * 16), 0.f);
        for (std::int64_t j = 0; j < r; ++j)
          for (std::int64_t q = 0; q < k; ++q) ap[j * k + q] = static_cast<float>(av[j * k + q]);
        for (std::int64_t c = 0; c < n; ++c)
          for (std::int64_t j = 0; j < r; ++j) bp[c * 16 + j] = static_cast<float>(bbv[c * r + j]);
        const Tensor xg = x.copy_to(gpu), wg = w.copy_to(gpu), bg = bias.copy_to(gpu);
        const Tensor apg = test::host_tensor({16, k}, dt, ap).copy_to(gpu), bpg = test::host_tensor({n, 16}, dt, bp).copy_to(gpu);
        Tensor out = Tensor::empty({m, n}, dt, gpu), t = Tensor::empty({m, 16}, dt, gpu);
        test::poison(out);
        test::poison(t);
        const TensorView bias_view = bg.view();
        cuda::LoraGemmArgs args{xg, wg, true, t, bpg, &bias_view, Activation::relu, out, nullptr};
        args.lowrank_a = apg.view();
        args.lowrank_scale = scale;
        args.swizzle = order == 0 ? 0 : (order == 1 ? 1 : 2);
        args.raster = order == 0 ? 0 : (order == 1 ? 1 : 2);
        ASSERT_TRUE(cuda::lora_gemm_fused(args, nullptr));
        const std::vector<double> ov = test::to_doubles(out), tv = test::to_doubles(t);
        std::vector<float> got_y, want_y, got_t, want_t;
        for (std::int64_t i = 0; i < m; i += 7) {
          std::vector<double> ti(16, 0.0);
          for (std::int64_t j = 0; j < r; ++j) {
            for (std::int64_t q = 0; q < k; ++q) ti[j] += xv[i * k + q] * av[j * k + q];
            ti[j] *= scale;
          }
          for (std::int64_t j = 0; j < 16; ++j) {
            got_t.push_back(static_cast<float>(tv[i * 16 + j]));
            want_t.push_back(static_cast<float>(ti[j]));
          }
          for (std::int64_t c = 0; c < n; ++c) {
            double z = bv[c];
            for (std::int64_t q = 0; q < k; ++q) z += xv[i * k + q] * wv[c * k + q];
            for (std::int64_t j = 0; j < r; ++j) z += ti[j] * bbv[c * r + j];
            want_y.push_back(static_cast<float>(z > 0 ? z : 0.0));
            got_y.push_back(static_cast<float>(ov[i * n + c]));
          }
        }
        const auto as_tensor = [](const std::vector<float>& v) {
          return test::host_tensor({static_cast<std::int64_t>(v.size())}, DType::f32, v);
        };
        const std::string what = std::string(dtype_name(dt)) + " r" + std::to_string(r) + " order " + std::to_string(order);
        EXPECT_LE(rel_err(as_tensor(got_y), as_tensor(want_y)), tolerance(dt)) << "y " << what;
        EXPECT_LE(rel_err(as_tensor(got_t), as_tensor(want_t)), tolerance(dt)) << "t " << what;
      }
}

#endif

TEST(LoraGpu, EmptyBatch) {
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  const GpuCase c{0, 16, 16, 4, DType::bf16};
  const Operands d = make_operands(c, 1, gpu);
  Tensor y = Tensor::empty({0, 16}, DType::bf16, gpu), dx = Tensor::empty({0, 16}, DType::bf16, gpu);
  Tensor da = Tensor::empty({4, 16}, DType::bf16, gpu), db = Tensor::empty({16, 4}, DType::bf16, gpu);
  lora_forward({d.x, d.w, d.bias.view(), d.a, d.b, y, std::nullopt, std::nullopt}, {});
  lora_backward({y, y, SavedForBackward::output, d.x, d.w, d.a, d.b, std::nullopt, dx.view(), da, db, std::nullopt},
                {});
  for (double v : test::to_doubles(da)) EXPECT_EQ(v, 0.0);
  for (double v : test::to_doubles(db)) EXPECT_EQ(v, 0.0);
}

// ---------------------------------------------------------------------------------------------
// LoRALinear
// ---------------------------------------------------------------------------------------------

TEST(LoRALinear, StartsAsThePlainLinearAndTrainsTheAdapter) {
  const std::int64_t t = 5, d_in = 16, d_out = 8, r = 4;
  nn::LoRALinear layer(d_in, d_out, r, {Activation::silu, 2.0f}, true, DType::f32, kCpu, 42);
  const Tensor x = test::random_tensor({t, d_in}, DType::f32, kCpu, 1);
  Tensor y = Tensor::empty({t, d_out}, DType::f32, kCpu), want = Tensor::empty({t, d_out}, DType::f32, kCpu);
  layer.forward(x, y);
  const Tensor zero_a = Tensor::empty({r, d_in}, DType::f32, kCpu);
  fill(zero_a, 0.0);
  lora_forward({x, layer.weight, layer.bias.view(), zero_a, layer.lora_b, want, std::nullopt, std::nullopt},
               {Activation::silu, 2.0f});
  EXPECT_TRUE(test::all_close(y, want, {1e-6, 1e-6}));  // B = 0 at initialisation
  const Tensor dy = test::random_tensor({t, d_out}, DType::f32, kCpu, 2);
  Tensor dx = Tensor::empty({t, d_in}, DType::f32, kCpu);
  layer.backward(dy, dx.view());
  // With B = 0, dA = s (g B)ᵀ x = 0 while dB = gᵀ t is not.
  for (double v : test::to_doubles(layer.lora_a_grad)) EXPECT_EQ(v, 0.0);
  double norm = 0;
  for (double v : test::to_doubles(layer.lora_b_grad)) norm += v * v;
  EXPECT_GT(norm, 0.0);
}

TEST(LoRALinear, GpuMatchesCpu) {
  FK_SKIP_WITHOUT_GPU();
  const std::int64_t t = 300, d_in = 256, d_out = 136, r = 16;
  // gelu_tanh keeps z for the backward; sigmoid keeps y (and its forward computes t in the GEMM).
  // (Not relu: its derivative jumps at 0, so the two devices' roundings of z near 0 would flip
  // some of g's entries: 2.8% normwise here.)
  for (Activation act : {Activation::gelu_tanh, Activation::sigmoid}) {
  SCOPED_TRACE(activation_name(act));
  const LoraParams p{act, 0.5f};
  nn::LoRALinear cpu(d_in, d_out, r, p, true, DType::bf16, kCpu, 7);
  nn::LoRALinear gpu(d_in, d_out, r, p, true, DType::bf16, Device::cuda(0), 7);
  // A non-zero B on both, so that the adapter matters.
  const Tensor b = test::random_tensor({d_out, r}, DType::bf16, kCpu, 3, -0.5f, 0.5f);
  copy(cpu.lora_b, b);
  copy(gpu.lora_b, b);
  const Tensor x = test::random_tensor({t, d_in}, DType::bf16, kCpu, 1);
  const Tensor dy = test::random_tensor({t, d_out}, DType::bf16, kCpu, 2);
  Tensor y = Tensor::empty({t, d_out}, DType::bf16, kCpu), dx = Tensor::empty({t, d_in}, DType::bf16, kCpu);
  cpu.forward(x, y);
  cpu.backward(dy, dx.view());
  const Tensor xg = x.copy_to(Device::cuda(0)), dyg = dy.copy_to(Device::cuda(0));
  Tensor yg = Tensor::empty({t, d_out}, DType::bf16, Device::cuda(0)),
         dxg = Tensor::empty({t, d_in}, DType::bf16, Device::cuda(0));
  gpu.forward(xg, yg);
  gpu.backward(dyg, dxg.view());
  EXPECT_LE(rel_err(yg, y), 1e-2);
  EXPECT_LE(rel_err(dxg, dx), 2e-2);
  EXPECT_LE(rel_err(gpu.lora_a_grad, cpu.lora_a_grad), 2e-2);
  EXPECT_LE(rel_err(gpu.lora_b_grad, cpu.lora_b_grad), 2e-2);
  EXPECT_LE(rel_err(gpu.bias_grad, cpu.bias_grad), 2e-2);
  }
}

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

TEST(LoraErrors, BadArgumentsNameTheArgument) {
  const DType f = DType::f32;
  const Tensor x = Tensor::empty({4, 8}, f, kCpu), w = Tensor::empty({6, 8}, f, kCpu);
  const Tensor a = Tensor::empty({2, 8}, f, kCpu), b = Tensor::empty({6, 2}, f, kCpu);
  Tensor y = Tensor::empty({4, 6}, f, kCpu);
  const Tensor w_k = Tensor::empty({6, 9}, f, kCpu), w_bf16 = Tensor::empty({6, 8}, DType::bf16, kCpu);
  const Tensor x_int = Tensor::empty({4, 8}, DType::i32, kCpu);
  const Tensor a_r0 = Tensor::empty({0, 8}, f, kCpu), a_r65 = Tensor::empty({65, 8}, f, kCpu),
               a_k = Tensor::empty({2, 7}, f, kCpu);
  const Tensor b_bad = Tensor::empty({6, 3}, f, kCpu), bias_bad = Tensor::empty({5}, f, kCpu);
  Tensor y_bad = Tensor::empty({4, 5}, f, kCpu), t_bad = Tensor::empty({4, 3}, f, kCpu);
  const std::string fwd = "lora_forward", bwd = "lora_backward";
  const LoraParams p{};
  auto forward = [&](const TensorView& xx, const TensorView& ww, std::optional<TensorView> bias, const TensorView& aa,
                     const TensorView& bb, const TensorView& yy, std::optional<TensorView> t) {
    lora_forward({xx, ww, bias, aa, bb, yy, t, std::nullopt}, p);
  };
  test::expect_arg_error([&] { forward(x_int, w, std::nullopt, a, b, y, std::nullopt); }, fwd, "x");
  test::expect_arg_error([&] { forward(x, w_k, std::nullopt, a, b, y, std::nullopt); }, fwd, "w");
  test::expect_arg_error([&] { forward(x, w_bf16, std::nullopt, a, b, y, std::nullopt); }, fwd, "w");
  test::expect_arg_error([&] { forward(x, w, std::nullopt, a_r0, b, y, std::nullopt); }, fwd, "a");
  test::expect_arg_error([&] { forward(x, w, std::nullopt, a_r65, b, y, std::nullopt); }, fwd, "a");
  test::expect_arg_error([&] { forward(x, w, std::nullopt, a_k, b, y, std::nullopt); }, fwd, "a");
  test::expect_arg_error([&] { forward(x, w, std::nullopt, a, b_bad, y, std::nullopt); }, fwd, "b");
  test::expect_arg_error([&] { forward(x, w, bias_bad.view(), a, b, y, std::nullopt); }, fwd, "bias");
  test::expect_arg_error([&] { forward(x, w, std::nullopt, a, b, y_bad, std::nullopt); }, fwd, "y");
  test::expect_arg_error([&] { forward(x, w, std::nullopt, a, b, y, t_bad.view()); }, fwd, "t");
  test::expect_arg_error([&] { lora_forward({x, w, std::nullopt, a, b, y, std::nullopt, std::nullopt}, {.scale = NAN}); },
                         fwd, "scale");
  Tensor dx = Tensor::empty({4, 8}, f, kCpu), da = Tensor::empty({2, 8}, f, kCpu), db = Tensor::empty({6, 2}, f, kCpu);
  Tensor dx_bad = Tensor::empty({4, 9}, f, kCpu), da_bad = Tensor::empty({3, 8}, f, kCpu);
  auto backward = [&](const TensorView& dy, const TensorView& saved, SavedForBackward kind, const LoraParams& q,
                      const TensorView& ddx, const TensorView& dda) {
    lora_backward({dy, saved, kind, x, w, a, b, std::nullopt, ddx, dda, db, std::nullopt}, q);
  };
  const auto out = SavedForBackward::output;
  test::expect_arg_error([&] { backward(y_bad, y, out, p, dx, da); }, bwd, "dy");
  test::expect_arg_error([&] { backward(y, y_bad, out, p, dx, da); }, bwd, "saved");
  test::expect_arg_error([&] { backward(y, y, out, p, dx_bad, da); }, bwd, "dx");
  test::expect_arg_error([&] { backward(y, y, out, p, dx, da_bad); }, bwd, "da");
  // gelu needs z: its derivative cannot be taken from y.
  test::expect_arg_error([&] { backward(y, y, out, {Activation::gelu_erf, 1.0f}, dx, da); }, bwd, "saved");
  test::expect_arg_error([&] { nn::LoRALinear(8, 6, 65, {}, false, f, kCpu, 1); }, "LoRALinear", "rank");
}

// Outputs may alias nothing (issue 27 item 11): y over x gave wrong results on the CPU, preact
// over w overwrote the frozen weight; an infinite scale is refused like NaN.
TEST(LoraErrors, OutputsMayNotAliasAndScaleMustBeFinite) {
  const DType f = DType::f32;
  Tensor x = Tensor::empty({4, 8}, f, kCpu), w = Tensor::empty({8, 8}, f, kCpu);
  const Tensor a = Tensor::empty({2, 8}, f, kCpu), b = Tensor::empty({8, 2}, f, kCpu);
  Tensor y = Tensor::empty({4, 8}, f, kCpu);
  const std::string fwd = "lora_forward", bwd = "lora_backward";
  const TensorView w_rows(w.data(), f, {4, 8}, kCpu);  // the first rows of w, shaped as preact
  test::expect_arg_error([&] { lora_forward({x, w, std::nullopt, a, b, x, std::nullopt, std::nullopt}, {}); }, fwd, "y");
  test::expect_arg_error([&] { lora_forward({x, w, std::nullopt, a, b, y, std::nullopt, w_rows}, {}); }, fwd, "preact");
  test::expect_arg_error([&] { lora_forward({x, w, std::nullopt, a, b, y, std::nullopt, y.view()}, {}); }, fwd, "y");
  test::expect_arg_error(
      [&] { lora_forward({x, w, std::nullopt, a, b, y, std::nullopt, std::nullopt}, {.scale = INFINITY}); }, fwd,
      "scale");
  Tensor da = Tensor::empty({2, 8}, f, kCpu), db = Tensor::empty({8, 2}, f, kCpu);
  test::expect_arg_error(
      [&] {
        lora_backward({y, y, SavedForBackward::output, x, w, a, b, std::nullopt, x.view(), da, db, std::nullopt}, {});
      },
      bwd, "dx");
}

}  // namespace
}  // namespace fk
