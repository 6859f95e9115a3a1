// Tests of the attention options and attention_backward's spec (CPU): hand-worked gradients,
// finite differences of the forward for every option (grouped-query heads, causal top-left and
// bottom-right with Sq != Sk, sliding windows, softcap), grouped-query attention against the
// heads expanded, rows that see no key, the GPU kernels against the spec on every option, and
// every bad argument.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
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
using test::host_tensor;

struct Grads {
  Tensor out, lse, dq, dk, dv;
};

// Forward, then backward with dout, all f32 on the CPU.
Grads run(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& dout, const AttentionOptions& opt) {
  Grads g{Tensor::empty(q.shape(), DType::f32, kCpu), Tensor::empty({q.size(0), q.size(1), q.size(2)}, DType::f32, kCpu),
          Tensor::empty(q.shape(), DType::f32, kCpu), Tensor::empty(k.shape(), DType::f32, kCpu),
          Tensor::empty(k.shape(), DType::f32, kCpu)};
  attention_forward(q, k, v, g.out, g.lse, opt);
  attention_backward(q, k, v, g.out, dout, g.lse, g.dq, g.dk, g.dv, opt);
  return g;
}

// D = 1, scale 1: q = 1 against keys 0 and ln 3 weighs them 1/4 and 3/4, out = 4/4 + 3 * 8/4 = 7.
// With dout = 1: dv = p = (1/4, 3/4); dp = v = (4, 8), rowsum(dout out) = 7, dS = p (dp - 7) =
// (-3/4, 3/4); dq = dS · k = 3/4 ln 3; dk = dS q = (-3/4, 3/4).
TEST(AttentionBackwardSpec, HandWorkedTwoKeys) {
  const float ln3 = std::log(3.0f);
  const Tensor q = host_tensor({1, 1, 1, 1}, DType::f32, {1}), k = host_tensor({1, 1, 2, 1}, DType::f32, {0, ln3});
  const Tensor v = host_tensor({1, 1, 2, 1}, DType::f32, {4, 8}), dout = host_tensor({1, 1, 1, 1}, DType::f32, {1});
  const Grads g = run(q, k, v, dout, {.scale = 1.0f});
  EXPECT_NEAR(test::to_doubles(g.out)[0], 7.0, 1e-6);
  EXPECT_NEAR(test::to_doubles(g.dq)[0], 0.75 * std::log(3.0), 1e-6);
  const std::vector<double> dk = test::to_doubles(g.dk), dv = test::to_doubles(g.dv);
  EXPECT_NEAR(dk[0], -0.75, 1e-6);
  EXPECT_NEAR(dk[1], 0.75, 1e-6);
  EXPECT_NEAR(dv[0], 0.25, 1e-6);
  EXPECT_NEAR(dv[1], 0.75, 1e-6);
}

// Bottom-right causal with Sq = 3 > Sk = 2: query i sees keys j <= i - 1, so query 0 sees none
// (out 0, lse -inf, no gradient), query 1 key 0, query 2 both. Top-left: query 0 sees key 0.
TEST(AttentionBackwardSpec, BottomRightCausalLeavesTheFirstRowEmpty) {
  const Tensor q = test::random_tensor({1, 1, 3, 4}, DType::f32, kCpu, 1), k = test::random_tensor({1, 1, 2, 4}, DType::f32, kCpu, 2);
  const Tensor v = test::random_tensor({1, 1, 2, 4}, DType::f32, kCpu, 3), dout = test::random_tensor({1, 1, 3, 4}, DType::f32, kCpu, 4);
  const Grads br = run(q, k, v, dout, {.causal = true, .bottom_right = true, .scale = 0.5f});
  const std::vector<double> out = test::to_doubles(br.out), lse = test::to_doubles(br.lse), dq = test::to_doubles(br.dq);
  const std::vector<double> vv = test::to_doubles(v);
  EXPECT_EQ(lse[0], -std::numeric_limits<double>::infinity());
  for (int c = 0; c < 4; ++c) {
    EXPECT_EQ(out[c], 0.0);
    EXPECT_EQ(dq[c], 0.0);
    EXPECT_NEAR(out[4 + c], vv[c], 1e-6);  // query 1 sees key 0 alone: out = v_0
    EXPECT_NEAR(dq[4 + c], 0.0, 1e-6);     // and a softmax over one key has no gradient
  }
  const Grads tl = run(q, k, v, dout, {.causal = true, .scale = 0.5f});
  for (int c = 0; c < 4; ++c) EXPECT_NEAR(test::to_doubles(tl.out)[c], vv[c], 1e-6);
}

struct OptionCase {
  std::string name;
  std::int64_t h, hk, sq, sk, d;
  AttentionOptions opt;
};

class AttentionBackwardFd : public ::testing::TestWithParam<OptionCase> {};

// L = sum(out ⊙ W): the backward with dout = W against central differences of the forward, on
// every element of q, k and v (f32 tensors, the spec in double: h = 1e-3 leaves about 1e-6 of
// truncation and 1e-7 / h of rounding).
TEST_P(AttentionBackwardFd, MatchesFiniteDifferencesOfTheForward) {
  const OptionCase& c = GetParam();
  Tensor q = test::random_tensor({2, c.h, c.sq, c.d}, DType::f32, kCpu, 11);
  Tensor k = test::random_tensor({2, c.hk, c.sk, c.d}, DType::f32, kCpu, 12);
  Tensor v = test::random_tensor({2, c.hk, c.sk, c.d}, DType::f32, kCpu, 13);
  const Tensor w = test::random_tensor({2, c.h, c.sq, c.d}, DType::f32, kCpu, 14);
  const Grads g = run(q, k, v, w, c.opt);
  const std::vector<double> wv = test::to_doubles(w);
  auto loss = [&] {
    Tensor out = Tensor::empty(q.shape(), DType::f32, kCpu), lse = Tensor::empty({2, c.h, c.sq}, DType::f32, kCpu);
    attention_forward(q, k, v, out, lse, c.opt);
    const std::vector<double> o = test::to_doubles(out);
    double s = 0;
    for (std::size_t i = 0; i < o.size(); ++i) s += o[i] * wv[i];
    return s;
  };
  const double h = 1e-3;
  for (auto [t, grad, name] : {std::tuple{&q, &g.dq, "dq"}, std::tuple{&k, &g.dk, "dk"}, std::tuple{&v, &g.dv, "dv"}}) {
    const std::vector<double> want = test::to_doubles(*grad);
    float* x = t->data_as<float>();
    for (std::int64_t e = 0; e < t->numel(); ++e) {
      const float keep = x[e];
      x[e] = keep + static_cast<float>(h);
      const double up = loss();
      x[e] = keep - static_cast<float>(h);
      const double down = loss();
      x[e] = keep;
      const double fd = (up - down) / (2 * h);
      ASSERT_NEAR(want[static_cast<std::size_t>(e)], fd, 2e-3 + 2e-3 * std::abs(fd)) << c.name << " " << name << "[" << e << "]";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Options, AttentionBackwardFd,
    ::testing::Values(OptionCase{"plain", 2, 2, 5, 7, 3, {.scale = 0.7f}},
                      OptionCase{"causal_top_left", 2, 2, 7, 5, 4, {.causal = true, .scale = 0.5f}},
                      OptionCase{"causal_bottom_right", 2, 2, 5, 7, 4, {.causal = true, .bottom_right = true, .scale = 0.5f}},
                      OptionCase{"gqa_4_over_2", 4, 2, 6, 6, 3, {.causal = true, .scale = 0.6f}},
                      OptionCase{"mqa_3_over_1", 3, 1, 4, 5, 2, {.scale = 0.9f}},
                      OptionCase{"window_2_1", 2, 1, 7, 7, 3, {.window_left = 2, .window_right = 1, .scale = 0.8f}},
                      OptionCase{"causal_window_3", 2, 2, 8, 8, 2, {.causal = true, .window_left = 3, .scale = 1.0f}},
                      OptionCase{"softcap", 2, 2, 5, 6, 4, {.scale = 2.0f, .softcap = 1.5f}},
                      OptionCase{"one_row_one_key", 1, 1, 1, 1, 5, {.scale = 1.0f}}),
    [](const auto& info) { return info.param.name; });

// Grouped-query attention is multi-head attention with each k/v head repeated over its group, and
// a k/v head's gradient is the sum of its copies'.
TEST(AttentionBackwardSpec, GroupedQueryIsTheExpandedHeads) {
  const std::int64_t h = 6, hk = 2, sq = 5, sk = 4, d = 3, group = h / hk;
  const Tensor q = test::random_tensor({1, h, sq, d}, DType::f32, kCpu, 21), dout = test::random_tensor({1, h, sq, d}, DType::f32, kCpu, 24);
  const Tensor k = test::random_tensor({1, hk, sk, d}, DType::f32, kCpu, 22), v = test::random_tensor({1, hk, sk, d}, DType::f32, kCpu, 23);
  Tensor ke = Tensor::empty({1, h, sk, d}, DType::f32, kCpu), ve = Tensor::empty({1, h, sk, d}, DType::f32, kCpu);
  for (std::int64_t hh = 0; hh < h; ++hh)
    for (std::int64_t e = 0; e < sk * d; ++e) {
      ke.data_as<float>()[hh * sk * d + e] = k.data_as<const float>()[(hh / group) * sk * d + e];
      ve.data_as<float>()[hh * sk * d + e] = v.data_as<const float>()[(hh / group) * sk * d + e];
    }
  const AttentionOptions opt{.causal = true, .bottom_right = true, .scale = 0.6f};
  const Grads gq = run(q, k, v, dout, opt), mh = run(q, ke, ve, dout, opt);
  EXPECT_EQ(test::to_doubles(gq.out), test::to_doubles(mh.out));
  EXPECT_EQ(test::to_doubles(gq.dq), test::to_doubles(mh.dq));
  const std::vector<double> dk = test::to_doubles(gq.dk), dke = test::to_doubles(mh.dk);
  for (std::int64_t kh = 0; kh < hk; ++kh)
    for (std::int64_t e = 0; e < sk * d; ++e) {
      double s = 0;
      for (std::int64_t j = 0; j < group; ++j) s += dke[static_cast<std::size_t>((kh * group + j) * sk * d + e)];
      EXPECT_NEAR(dk[static_cast<std::size_t>(kh * sk * d + e)], s, 1e-6);
    }
}

// The plain options through the new entry point are the old one's results, bit for bit.
TEST(AttentionBackwardSpec, PlainOptionsAreTheOldForward) {
  const Tensor q = test::random_tensor({2, 3, 9, 8}, DType::bf16, kCpu, 31), k = test::random_tensor({2, 3, 6, 8}, DType::bf16, kCpu, 32);
  const Tensor v = test::random_tensor({2, 3, 6, 8}, DType::bf16, kCpu, 33);
  for (bool causal : {false, true}) {
    Tensor a = Tensor::empty(q.shape(), DType::bf16, kCpu), b = Tensor::empty(q.shape(), DType::bf16, kCpu);
    Tensor la = Tensor::empty({2, 3, 9}, DType::f32, kCpu), lb = Tensor::empty({2, 3, 9}, DType::f32, kCpu);
    attention_forward(q, k, v, a, la, causal, 0.3f);
    attention_forward(q, k, v, b, lb, AttentionOptions{.causal = causal, .scale = 0.3f});
    EXPECT_EQ(test::to_doubles(a), test::to_doubles(b));
    EXPECT_EQ(test::to_doubles(la), test::to_doubles(lb));
  }
}

TEST(AttentionBackwardErrors, BadArgumentsNameThemselves) {
  const Tensor q = test::random_tensor({1, 4, 3, 2}, DType::f32, kCpu, 41), k = test::random_tensor({1, 2, 5, 2}, DType::f32, kCpu, 42);
  const Tensor v = test::random_tensor({1, 2, 5, 2}, DType::f32, kCpu, 43), k3 = test::random_tensor({1, 3, 5, 2}, DType::f32, kCpu, 44);
  Tensor out = Tensor::empty(q.shape(), DType::f32, kCpu), lse = Tensor::empty({1, 4, 3}, DType::f32, kCpu);
  Tensor dq = Tensor::empty(q.shape(), DType::f32, kCpu), dk = Tensor::empty(k.shape(), DType::f32, kCpu);
  Tensor dv = Tensor::empty(k.shape(), DType::f32, kCpu), dk_bad = Tensor::empty({1, 4, 5, 2}, DType::f32, kCpu);
  const AttentionOptions ok{.scale = 1.0f};
  test::expect_arg_error([&] { attention_forward(q, k3, k3, out, lse, ok); }, "attention_forward", "k");
  test::expect_arg_error([&] { attention_forward(q, k, v, out, lse, {.scale = 1.0f, .softcap = -1.0f}); },
                         "attention_forward", "softcap");
  test::expect_arg_error([&] { attention_forward(q, k, v, out, lse, {.window_left = -2, .scale = 1.0f}); },
                         "attention_forward", "window_left");
  test::expect_arg_error([&] { attention_forward(q, k, v, out, lse, {.scale = NAN}); }, "attention_forward", "scale");
  attention_forward(q, k, v, out, lse, ok);
  test::expect_arg_error([&] { attention_backward(q, k, v, out, out, lse, dq, dk_bad, dv, ok); }, "attention_backward", "dk");
  test::expect_arg_error([&] { attention_backward(q, k, v, out, out, lse, out, dk, dv, ok); }, "attention_backward", "dq");
  test::expect_arg_error([&] { attention_backward(q, k, v, out, out, lse, dq, dk, dk, ok); }, "attention_backward", "dv");
  EXPECT_NO_THROW(attention_backward(q, k, v, out, out, lse, dq, dk, dv, ok));
}

// Where got (a host tensor) is farthest from ref: "worst at [b, h, row, col] got x want y" over the
// [B, heads, rows, D] layout, the first NaN if there is one (an element no kernel wrote).
std::string worst_element(const Tensor& got, const Tensor& ref) {
  const std::vector<double> a = test::to_doubles(got), r = test::to_doubles(ref);
  std::size_t at = 0;
  double err = -1.0;
  for (std::size_t e = 0; e < a.size(); ++e) {
    const double d = std::isnan(a[e]) ? std::numeric_limits<double>::infinity() : std::abs(a[e] - r[e]);
    if (d > err) {
      err = d;
      at = e;
    }
    if (std::isnan(a[e])) break;
  }
  const std::int64_t d = ref.size(3), rows = ref.size(2), heads = ref.size(1);
  const auto e = static_cast<std::int64_t>(at);
  return fmt::format("worst at [b {}, h {}, row {}, col {}] got {} want {}", e / (d * rows * heads), e / (d * rows) % heads,
                     e / d % rows, e % d, a[at], r[at]);
}

// The normwise relative error of dt results: f32 runs on the warp-per-row kernels (f32 arithmetic);
// bf16 and f16 at D 64/96/128 on the tensor-core backward, which also rounds P and dS to the dtype
// before their products (FlashAttention's choice), and every output is rounded once to the dtype:
// about 5 unit roundoffs of bf16 (2^-8) covers that; f16's 8 units of 2^-11 likewise.
double gpu_tolerance(DType dt) { return dt == DType::f32 ? 1e-4 : dt == DType::bf16 ? 2e-2 : 4e-3; }

// The GPU's forward and backward against the spec, on every option, in f32, bf16 and f16 (bf16
// and f16 at D 64, 96, 128 through the tensor-core backward, the rest through the warp-per-row
// kernels). Each failure names the case, dtype, tensor, its error and its worst element.
class AttentionBackwardGpuVsSpec : public ::testing::TestWithParam<OptionCase> {};

TEST_P(AttentionBackwardGpuVsSpec, MatchesTheSpec) {
  FK_SKIP_WITHOUT_GPU();
  const OptionCase& c = GetParam();
  const Device gpu = Device::cuda(0);
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
    const Tensor q = test::random_tensor({2, c.h, c.sq, c.d}, dt, kCpu, 61);
    const Tensor k = test::random_tensor({2, c.hk, c.sk, c.d}, dt, kCpu, 62);
    const Tensor v = test::random_tensor({2, c.hk, c.sk, c.d}, dt, kCpu, 63);
    const Tensor dout = test::random_tensor({2, c.h, c.sq, c.d}, dt, kCpu, 64);
    Tensor out = Tensor::empty(q.shape(), dt, kCpu), lse = Tensor::empty({2, c.h, c.sq}, DType::f32, kCpu);
    Tensor dq = Tensor::empty(q.shape(), dt, kCpu), dk = Tensor::empty(k.shape(), dt, kCpu), dv = Tensor::empty(k.shape(), dt, kCpu);
    attention_forward(q, k, v, out, lse, c.opt);
    attention_backward(q, k, v, out, dout, lse, dq, dk, dv, c.opt);
    const Tensor qg = q.copy_to(gpu), kg = k.copy_to(gpu), vg = v.copy_to(gpu), dog = dout.copy_to(gpu);
    Tensor og = Tensor::empty(q.shape(), dt, gpu), lg = Tensor::empty({2, c.h, c.sq}, DType::f32, gpu);
    test::poison(og);
    attention_forward(qg, kg, vg, og, lg, c.opt);
    const double tol = gpu_tolerance(dt);
    auto check = [&](const Tensor& got, const Tensor& ref, const std::string& what) {
      const Tensor host = test::to_host(got);
      const double err = test::rel_err_normwise(host, ref);
      EXPECT_LE(err, tol) << what << ": rel err " << err << ", " << worst_element(host, ref);
      if (err > tol / 4) std::printf("  [note] %s rel err %.3g (tol %.3g)\n", what.c_str(), err, tol);
    };
    check(og, out, c.name + " " + std::string(dtype_name(dt)) + " out");
    // The backward from the spec's out and lse, so that it is checked on the same inputs; bf16 and
    // f16 in both dq modes (the tensor-core path's atomics and its separate dq kernel).
    const Tensor outg = out.copy_to(gpu), lseg = lse.copy_to(gpu);
    // bf16/f16 also with the mma.sync kernel forced (automatic takes the sm_90 wgmma kernel on an
    // H100 where it applies).
    for (int mode = 0; mode < 3; ++mode) {
      const bool deterministic = mode == 1 ? !c.opt.deterministic : c.opt.deterministic;
      if (dt == DType::f32 && mode > 0) continue;
      if (mode == 2 && c.d != 64 && c.d != 96 && c.d != 128) continue;  // mma.sync's head dims only
      AttentionOptions opt = c.opt;
      opt.deterministic = deterministic;
      if (mode == 2) opt.backward_kernel = AttentionBackwardKernel::mma_sync;
      Tensor dqg = Tensor::empty(q.shape(), dt, gpu), dkg = Tensor::empty(k.shape(), dt, gpu), dvg = Tensor::empty(k.shape(), dt, gpu);
      for (Tensor* t : {&dqg, &dkg, &dvg}) test::poison(*t);
      attention_backward(qg, kg, vg, outg, dog, lseg, dqg, dkg, dvg, opt);
      const std::string what = c.name + " " + std::string(dtype_name(dt)) + (deterministic ? " deterministic" : "") +
                               (mode == 2 ? " mma_sync" : "");
      check(dqg, dq, what + " dq");
      check(dkg, dk, what + " dk");
      check(dvg, dv, what + " dv");
    }
  }
}

// The same inputs twice: with opt.deterministic the three gradients are the same bits; without,
// dk and dv still are (summed in registers in a fixed order), dq only close (f32 atomics).
TEST_P(AttentionBackwardGpuVsSpec, DeterministicModeRepeatsItsBits) {
  FK_SKIP_WITHOUT_GPU();
  const OptionCase& c = GetParam();
  const Device gpu = Device::cuda(0);
  for (DType dt : {DType::bf16, DType::f16}) {
    const Tensor q = test::random_tensor({2, c.h, c.sq, c.d}, dt, gpu, 71);
    const Tensor k = test::random_tensor({2, c.hk, c.sk, c.d}, dt, gpu, 72);
    const Tensor v = test::random_tensor({2, c.hk, c.sk, c.d}, dt, gpu, 73);
    const Tensor dout = test::random_tensor({2, c.h, c.sq, c.d}, dt, gpu, 74);
    const Tensor out = Tensor::empty(q.shape(), dt, gpu), lse = Tensor::empty({2, c.h, c.sq}, DType::f32, gpu);
    attention_forward(q, k, v, out, lse, c.opt);
    for (bool deterministic : {true, false}) {
      AttentionOptions opt = c.opt;
      opt.deterministic = deterministic;
      std::vector<std::vector<double>> first;
      for (int run = 0; run < 2; ++run) {
        Tensor dq = Tensor::empty(q.shape(), dt, gpu), dk = Tensor::empty(k.shape(), dt, gpu), dv = Tensor::empty(k.shape(), dt, gpu);
        for (Tensor* t : {&dq, &dk, &dv}) test::poison(*t);
        attention_backward(q, k, v, out, dout, lse, dq, dk, dv, opt);
        const std::vector<std::vector<double>> now = {test::to_doubles(dq), test::to_doubles(dk), test::to_doubles(dv)};
        if (run == 0) {
          first = now;
          continue;
        }
        const std::string what = c.name + " " + std::string(dtype_name(dt)) + (deterministic ? " deterministic" : " default");
        for (int i = 0; i < 3; ++i) {
          const char* name = i == 0 ? "dq" : i == 1 ? "dk" : "dv";
          std::size_t differ = 0, first_at = 0;
          for (std::size_t e = 0; e < now[i].size(); ++e)
            if (std::memcmp(&now[i][e], &first[i][e], sizeof(double)) != 0 && differ++ == 0) first_at = e;
          if (deterministic || i > 0)
            EXPECT_EQ(differ, 0u) << what << " " << name << ": " << differ << " elements differ between two runs, first at "
                                  << first_at << " (" << first[i][first_at] << " then " << now[i][first_at] << ")";
          else if (differ > 0)
            std::printf("  [note] %s dq: %zu elements differ between runs (atomics)\n", what.c_str(), differ);
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Options, AttentionBackwardGpuVsSpec,
    ::testing::Values(OptionCase{"plain_d64", 2, 2, 70, 45, 64, {.scale = 0.125f}},
                      OptionCase{"causal_bottom_right", 2, 2, 33, 50, 32, {.causal = true, .bottom_right = true, .scale = 0.2f}},
                      OptionCase{"gqa_8_over_2_causal", 8, 2, 40, 40, 64, {.causal = true, .scale = 0.125f}},
                      OptionCase{"window_softcap_d96", 2, 1, 37, 37, 96, {.window_left = 5, .window_right = 2, .scale = 0.1f, .softcap = 3.0f}},
                      OptionCase{"d256_one_query", 2, 2, 1, 77, 256, {.scale = 0.06f}},
                      OptionCase{"empty_rows", 2, 2, 9, 4, 16, {.causal = true, .bottom_right = true, .scale = 0.3f}}),
    [](const auto& info) { return info.param.name; });

// Shapes for the tensor-core backward (bf16/f16 at D 64, 96, 128; 128-key CTAs, 64-query steps):
// sequence lengths 1, 17, 129 and 1000 (tails of both tiles), grouped-query heads 8 over 2 and over
// 1, causal top-left and bottom-right with Sq != Sk (query rows and whole key blocks that see
// nothing), windows, softcap, and deterministic mode (every case also runs in the other mode).
INSTANTIATE_TEST_SUITE_P(
    TensorCore, AttentionBackwardGpuVsSpec,
    ::testing::Values(
        OptionCase{"d64_one_by_one", 1, 1, 1, 1, 64, {.scale = 0.125f}},
        OptionCase{"d64_q17_k129", 2, 2, 17, 129, 64, {.scale = 0.125f}},
        OptionCase{"d96_q129_k17", 2, 2, 129, 17, 96, {.scale = 0.1f}},
        OptionCase{"d128_q1_k1000", 2, 2, 1, 1000, 128, {.scale = 0.088f}},
        OptionCase{"d64_causal_top_left_q100_k1000", 2, 2, 100, 1000, 64, {.causal = true, .scale = 0.125f}},
        OptionCase{"d128_q1000_causal", 2, 2, 1000, 1000, 128, {.causal = true, .scale = 0.088f}},
        OptionCase{"d64_q1000_k129_gqa_2_over_1", 2, 1, 1000, 129, 64, {.scale = 0.125f}},
        OptionCase{"d64_gqa_8_over_2_causal_bottom_right", 8, 2, 100, 300, 64, {.causal = true, .bottom_right = true, .scale = 0.125f}},
        OptionCase{"d128_mqa_8_over_1_causal_top_left", 8, 1, 129, 257, 128, {.causal = true, .scale = 0.088f}},
        OptionCase{"d96_causal_bottom_right_more_queries", 2, 2, 300, 129, 96, {.causal = true, .bottom_right = true, .scale = 0.1f}},
        OptionCase{"d128_window_40_7", 2, 2, 257, 257, 128, {.window_left = 40, .window_right = 7, .scale = 0.088f}},
        OptionCase{"d64_window_bottom_right", 2, 1, 50, 200, 64, {.bottom_right = true, .window_left = 30, .window_right = 10, .scale = 0.125f}},
        OptionCase{"d64_causal_window_17", 4, 2, 200, 200, 64, {.causal = true, .window_left = 17, .scale = 0.125f}},
        OptionCase{"d96_softcap", 2, 2, 130, 70, 96, {.scale = 0.5f, .softcap = 2.0f}},
        OptionCase{"d128_softcap_causal_gqa", 4, 2, 129, 129, 128, {.causal = true, .scale = 0.3f, .softcap = 5.0f}},
        OptionCase{"d64_deterministic_gqa", 8, 2, 129, 300, 64, {.scale = 0.125f, .deterministic = true}},
        OptionCase{"d128_deterministic_causal_window", 2, 1, 300, 300, 128, {.causal = true, .window_left = 70, .scale = 0.088f, .deterministic = true}},
        OptionCase{"d96_deterministic_bottom_right", 2, 2, 17, 1000, 96, {.causal = true, .bottom_right = true, .scale = 0.1f, .deterministic = true}}),
    [](const auto& info) { return info.param.name; });


// The sm_90 wgmma backward (AttentionBackwardKernel::wgmma_sm90 forces it; a call it does not take
// would throw) against the spec: sequence lengths 1, 17, 129, 1000 and 2048 (tails of the 128-key
// CTAs and of the 64-query steps, in both), causal top-left and bottom-right with Sq != Sk (query
// rows and whole key blocks that see nothing), grouped-query heads 4 over 1, D 64 and 128, bf16 and
// f16, batches of 1 and 2 (the 2048-long cases with few heads: the spec is a single-threaded CPU
// loop, about 8 s a dtype at D 128, 2048 x 2048, one head). Skipped off sm_90. The same cases
// forced to wgmma_sm90_tma_dq (dq by TMA reduces) in the suite Sm90TmaDq.
struct Sm90Case {
  std::string name;
  std::int64_t b, h, hk, sq, sk, d;
  AttentionOptions opt;
};

class AttentionBackwardSm90VsSpec : public ::testing::TestWithParam<Sm90Case> {};
class AttentionBackwardSm90TmaDqVsSpec : public ::testing::TestWithParam<Sm90Case> {};

void check_sm90_case(const Sm90Case& c, AttentionBackwardKernel kind, const char* kind_name) {
  const Device gpu = Device::cuda(0);
  for (DType dt : {DType::bf16, DType::f16}) {
    const Tensor q = test::random_tensor({c.b, c.h, c.sq, c.d}, dt, kCpu, 81);
    const Tensor k = test::random_tensor({c.b, c.hk, c.sk, c.d}, dt, kCpu, 82);
    const Tensor v = test::random_tensor({c.b, c.hk, c.sk, c.d}, dt, kCpu, 83);
    const Tensor dout = test::random_tensor({c.b, c.h, c.sq, c.d}, dt, kCpu, 84);
    Tensor out = Tensor::empty(q.shape(), dt, kCpu), lse = Tensor::empty({c.b, c.h, c.sq}, DType::f32, kCpu);
    Tensor dq = Tensor::empty(q.shape(), dt, kCpu), dk = Tensor::empty(k.shape(), dt, kCpu), dv = Tensor::empty(k.shape(), dt, kCpu);
    attention_forward(q, k, v, out, lse, c.opt);
    attention_backward(q, k, v, out, dout, lse, dq, dk, dv, c.opt);
    const Tensor qg = q.copy_to(gpu), kg = k.copy_to(gpu), vg = v.copy_to(gpu), dog = dout.copy_to(gpu);
    const Tensor outg = out.copy_to(gpu), lseg = lse.copy_to(gpu);
    AttentionOptions opt = c.opt;
    opt.backward_kernel = kind;
    Tensor dqg = Tensor::empty(q.shape(), dt, gpu), dkg = Tensor::empty(k.shape(), dt, gpu), dvg = Tensor::empty(k.shape(), dt, gpu);
    for (Tensor* t : {&dqg, &dkg, &dvg}) test::poison(*t);
    attention_backward(qg, kg, vg, outg, dog, lseg, dqg, dkg, dvg, opt);
    const double tol = gpu_tolerance(dt);
    const std::string what = c.name + " " + std::string(dtype_name(dt)) + " " + kind_name;
    for (auto [got, ref, name] : {std::tuple{&dqg, &dq, "dq"}, std::tuple{&dkg, &dk, "dk"}, std::tuple{&dvg, &dv, "dv"}}) {
      const Tensor host = test::to_host(*got);
      const double err = test::rel_err_normwise(host, *ref);
      EXPECT_LE(err, tol) << what << " " << name << ": rel err " << err << ", " << worst_element(host, *ref);
      if (err > tol / 4) std::printf("  [note] %s %s rel err %.3g (tol %.3g)\n", what.c_str(), name, err, tol);
    }
  }
}

TEST_P(AttentionBackwardSm90VsSpec, MatchesTheSpec) {
  FK_SKIP_WITHOUT_GPU();
  if (!test::on_sm90()) GTEST_SKIP() << "the wgmma backward runs on sm_90 (H100/H200) only";
  check_sm90_case(GetParam(), AttentionBackwardKernel::wgmma_sm90, "wgmma_sm90");
}

TEST_P(AttentionBackwardSm90TmaDqVsSpec, MatchesTheSpec) {
  FK_SKIP_WITHOUT_GPU();
  if (!test::on_sm90()) GTEST_SKIP() << "the wgmma backward runs on sm_90 (H100/H200) only";
  check_sm90_case(GetParam(), AttentionBackwardKernel::wgmma_sm90_tma_dq, "wgmma_sm90_tma_dq");
}

const auto kSm90Cases =
    ::testing::Values(
        Sm90Case{"d64_one_by_one_gqa_4_over_1", 2, 4, 1, 1, 1, 64, {.scale = 0.125f}},
        Sm90Case{"d128_q17_k129", 2, 2, 2, 17, 129, 128, {.scale = 0.088f}},
        Sm90Case{"d64_q129_k17_gqa_4_over_1", 2, 4, 1, 129, 17, 64, {.scale = 0.125f}},
        Sm90Case{"d128_q1_k1000_causal_bottom_right", 2, 2, 2, 1, 1000, 128, {.causal = true, .bottom_right = true, .scale = 0.088f}},
        Sm90Case{"d64_q1000_causal_gqa_4_over_1", 1, 4, 1, 1000, 1000, 64, {.causal = true, .scale = 0.125f}},
        Sm90Case{"d128_q129_k1000_causal_top_left_gqa_4_over_1", 2, 4, 1, 129, 1000, 128, {.causal = true, .scale = 0.088f}},
        Sm90Case{"d64_q17_k2048_causal_bottom_right", 2, 2, 2, 17, 2048, 64, {.causal = true, .bottom_right = true, .scale = 0.125f}},
        Sm90Case{"d128_q129_k2048_causal_bottom_right_gqa_4_over_1", 1, 4, 1, 129, 2048, 128, {.causal = true, .bottom_right = true, .scale = 0.088f}},
        Sm90Case{"d64_q2048_k1000_causal_bottom_right_gqa_4_over_1", 1, 4, 1, 2048, 1000, 64, {.causal = true, .bottom_right = true, .scale = 0.125f}},
        Sm90Case{"d128_q2048_k2048_causal", 1, 1, 1, 2048, 2048, 128, {.causal = true, .scale = 0.088f}},
        Sm90Case{"d128_q1000_k129", 2, 2, 2, 1000, 129, 128, {.scale = 0.088f}});
INSTANTIATE_TEST_SUITE_P(Sm90, AttentionBackwardSm90VsSpec, kSm90Cases, [](const auto& info) { return info.param.name; });
INSTANTIATE_TEST_SUITE_P(Sm90TmaDq, AttentionBackwardSm90TmaDqVsSpec, kSm90Cases,
                         [](const auto& info) { return info.param.name; });

// Forcing a kernel that cannot take the call names backward_kernel.
TEST(AttentionBackwardErrors, ForcedKernelThatCannotTakeTheCall) {
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  const Tensor q = test::random_tensor({1, 2, 5, 32}, DType::f32, gpu, 1), k = test::random_tensor({1, 2, 5, 32}, DType::f32, gpu, 2);
  const Tensor out = Tensor::empty(q.shape(), DType::f32, gpu), lse = Tensor::empty({1, 2, 5}, DType::f32, gpu);
  const Tensor dq = Tensor::empty(q.shape(), DType::f32, gpu), dk = Tensor::empty(q.shape(), DType::f32, gpu);
  const Tensor dv = Tensor::empty(q.shape(), DType::f32, gpu);
  attention_forward(q, k, k, out, lse, AttentionOptions{});
  for (auto kind : {AttentionBackwardKernel::wgmma_sm90, AttentionBackwardKernel::wgmma_sm90_tma_dq,
                    AttentionBackwardKernel::mma_sync})
    test::expect_arg_error([&] { attention_backward(q, k, k, out, out, lse, dq, dk, dv, {.backward_kernel = kind}); },
                           "attention_backward", "backward_kernel");
  EXPECT_NO_THROW(attention_backward(q, k, k, out, out, lse, dq, dk, dv, {.backward_kernel = AttentionBackwardKernel::rowwise}));
}

}  // namespace
}  // namespace fk
