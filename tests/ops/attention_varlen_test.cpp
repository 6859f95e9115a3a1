// Tests of attention_forward_varlen and attention_backward_varlen (sequences packed without
// padding, FlashAttention's cu_seqlens layout): the spec on a hand-worked batch with an empty
// sequence; the spec equal, bit for bit, to the dense spec run on each sequence alone, for every
// option; every bad argument; the GPU kernels against the spec (lengths mixing 0, 1, 7, 127 and
// 1000, grouped-query heads 1/2/4/8 per group, causal both alignments, windows, softcap, D 64/96/128
// on the tensor-core backward, f32 and other head dims on the warp-per-row kernels, both dq modes);
// deterministic mode repeating its bits; small cases named for compute-sanitizer runs.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <ostream>
#include <string>
#include <vector>

#include "fusekit/fusekit.hpp"
#include "test_util.hpp"

namespace fk {
namespace {

const Device kCpu = Device::cpu();
constexpr double kInf = std::numeric_limits<double>::infinity();

// A packed batch: per-sequence query and key lengths, heads, head dim, and its tensors.
struct Batch {
  std::vector<int> q_lens, k_lens;
  std::int64_t h, hk, d;

  std::int64_t total_q() const { return std::accumulate(q_lens.begin(), q_lens.end(), std::int64_t{0}); }
  std::int64_t total_k() const { return std::accumulate(k_lens.begin(), k_lens.end(), std::int64_t{0}); }
  std::int64_t max_q() const { return q_lens.empty() ? 0 : *std::max_element(q_lens.begin(), q_lens.end()); }
  std::int64_t max_k() const { return k_lens.empty() ? 0 : *std::max_element(k_lens.begin(), k_lens.end()); }
};

// cu_seqlens of `lens` as a host i32 tensor [B + 1].
Tensor cu_seqlens(const std::vector<int>& lens) {
  std::vector<float> cu{0.0f};
  for (int n : lens) cu.push_back(cu.back() + static_cast<float>(n));
  return test::host_tensor({static_cast<std::int64_t>(cu.size())}, DType::i32, cu);
}

// The seqs argument over host (or device) cu_seqlens tensors.
AttentionVarlen seqs_of(const Batch& b, const Tensor& cu_q, const Tensor& cu_k) {
  return {cu_q.view(), cu_k.view(), b.max_q(), b.max_k()};
}

// Rows [start, start + len) of a packed [total, heads, D] f32 tensor as a dense [1, heads, len, D] one.
Tensor to_dense(const Tensor& packed, std::int64_t start, std::int64_t len) {
  const std::int64_t heads = packed.size(1), d = packed.size(2);
  Tensor t = Tensor::empty({1, heads, len, d}, DType::f32, kCpu);
  for (std::int64_t i = 0; i < len; ++i)
    for (std::int64_t h = 0; h < heads; ++h)
      for (std::int64_t c = 0; c < d; ++c)
        t.data_as<float>()[(h * len + i) * d + c] = packed.data_as<const float>()[((start + i) * heads + h) * d + c];
  return t;
}

// Each element of a dense [1, heads, len, D] result against rows [start, start + len) of the packed one.
void expect_rows_equal(const Tensor& packed, std::int64_t start, const Tensor& dense, const std::string& what) {
  const std::int64_t heads = dense.size(1), len = dense.size(2), d = dense.size(3);
  for (std::int64_t i = 0; i < len; ++i)
    for (std::int64_t h = 0; h < heads; ++h)
      for (std::int64_t c = 0; c < d; ++c)
        ASSERT_EQ(packed.data_as<const float>()[((start + i) * heads + h) * d + c],
                  dense.data_as<const float>()[(h * len + i) * d + c])
            << what << " token " << start + i << " head " << h << " col " << c;
}

// ---------------------------------------------------------------------------------------------
// The spec
// ---------------------------------------------------------------------------------------------

// Three sequences, H = Hk = 1, D = 1, scale 1, dout = 1:
//  0: query 1 against keys 0 and ln 3 (v 4, 8): weights 1/4, 3/4, out 7, lse ln 4; dq = 3/4 ln 3,
//     dk = (-3/4, 3/4), dv = (1/4, 3/4) (attention_backward_test's HandWorkedTwoKeys).
//  1: empty (no queries, no keys).
//  2: query 2 against the one key 0.5 (v -3): out -3, lse 1; a softmax over one key has no
//     gradient (dq = dk = 0), dv = dout = 1.
// Were sequence 0's query to see sequence 2's key, its out would not be 7.
TEST(AttentionVarlenSpec, HandWorkedThreeSequencesOneEmpty) {
  const float ln3 = std::log(3.0f);
  const Tensor q = test::host_tensor({2, 1, 1}, DType::f32, {1, 2});
  const Tensor k = test::host_tensor({3, 1, 1}, DType::f32, {0, ln3, 0.5f});
  const Tensor v = test::host_tensor({3, 1, 1}, DType::f32, {4, 8, -3});
  const Tensor dout = test::host_tensor({2, 1, 1}, DType::f32, {1, 1});
  const Tensor cu_q = test::host_tensor({4}, DType::i32, {0, 1, 1, 2}), cu_k = test::host_tensor({4}, DType::i32, {0, 2, 2, 3});
  const AttentionVarlen seqs{cu_q.view(), cu_k.view(), 1, 2};
  Tensor out = Tensor::empty({2, 1, 1}, DType::f32, kCpu), lse = Tensor::empty({1, 2}, DType::f32, kCpu);
  Tensor dq = Tensor::empty({2, 1, 1}, DType::f32, kCpu), dk = Tensor::empty({3, 1, 1}, DType::f32, kCpu);
  Tensor dv = Tensor::empty({3, 1, 1}, DType::f32, kCpu);
  for (Tensor* t : {&out, &lse, &dq, &dk, &dv}) test::poison(*t);
  attention_forward_varlen(q, k, v, out, lse, seqs, {.scale = 1.0f});
  attention_backward_varlen(q, k, v, out, dout, lse, dq, dk, dv, seqs, {.scale = 1.0f});
  const std::vector<double> o = test::to_doubles(out), l = test::to_doubles(lse), gq = test::to_doubles(dq);
  const std::vector<double> gk = test::to_doubles(dk), gv = test::to_doubles(dv);
  EXPECT_NEAR(o[0], 7.0, 1e-6);
  EXPECT_NEAR(l[0], std::log(4.0), 1e-6);
  EXPECT_NEAR(o[1], -3.0, 1e-6);
  EXPECT_NEAR(l[1], 1.0, 1e-6);
  EXPECT_NEAR(gq[0], 0.75 * std::log(3.0), 1e-6);
  EXPECT_NEAR(gq[1], 0.0, 1e-6);
  const std::vector<double> want_dk{-0.75, 0.75, 0.0}, want_dv{0.25, 0.75, 1.0};
  for (int j = 0; j < 3; ++j) {
    EXPECT_NEAR(gk[j], want_dk[j], 1e-6) << j;
    EXPECT_NEAR(gv[j], want_dv[j], 1e-6) << j;
  }
}

struct SpecCase {
  std::string name;
  Batch batch;
  AttentionOptions opt;
};

void PrintTo(const SpecCase& c, std::ostream* os) { *os << c.name; }

class AttentionVarlenSpecVsDense : public ::testing::TestWithParam<SpecCase> {};

// Forward and backward of the packed batch equal, bit for bit, the dense spec on each sequence
// alone ([1, H, len, D]): the same loops in the same order over the same values, so nothing but the
// addressing may differ. dk and dv of a sequence come only from its own queries.
TEST_P(AttentionVarlenSpecVsDense, EachSequenceAlone) {
  const SpecCase& c = GetParam();
  const Batch& b = c.batch;
  const Tensor q = test::random_tensor({b.total_q(), b.h, b.d}, DType::f32, kCpu, 1);
  const Tensor k = test::random_tensor({b.total_k(), b.hk, b.d}, DType::f32, kCpu, 2);
  const Tensor v = test::random_tensor({b.total_k(), b.hk, b.d}, DType::f32, kCpu, 3);
  const Tensor dout = test::random_tensor({b.total_q(), b.h, b.d}, DType::f32, kCpu, 4);
  const Tensor cu_q = cu_seqlens(b.q_lens), cu_k = cu_seqlens(b.k_lens);
  const AttentionVarlen seqs = seqs_of(b, cu_q, cu_k);
  Tensor out = Tensor::empty(q.shape(), DType::f32, kCpu), lse = Tensor::empty({b.h, b.total_q()}, DType::f32, kCpu);
  Tensor dq = Tensor::empty(q.shape(), DType::f32, kCpu), dk = Tensor::empty(k.shape(), DType::f32, kCpu);
  Tensor dv = Tensor::empty(k.shape(), DType::f32, kCpu);
  for (Tensor* t : {&out, &lse, &dq, &dk, &dv}) test::poison(*t);
  attention_forward_varlen(q, k, v, out, lse, seqs, c.opt);
  attention_backward_varlen(q, k, v, out, dout, lse, dq, dk, dv, seqs, c.opt);

  std::int64_t q0 = 0, k0 = 0;
  for (std::size_t s = 0; s < b.q_lens.size(); ++s) {
    const std::int64_t sq = b.q_lens[s], sk = b.k_lens[s];
    const std::string what = fmt::format("{} sequence {} (Sq {}, Sk {})", c.name, s, sq, sk);
    const Tensor qs = to_dense(q, q0, sq), ks = to_dense(k, k0, sk), vs = to_dense(v, k0, sk);
    const Tensor dos = to_dense(dout, q0, sq);
    Tensor os = Tensor::empty(qs.shape(), DType::f32, kCpu), ls = Tensor::empty({1, b.h, sq}, DType::f32, kCpu);
    Tensor dqs = Tensor::empty(qs.shape(), DType::f32, kCpu), dks = Tensor::empty(ks.shape(), DType::f32, kCpu);
    Tensor dvs = Tensor::empty(ks.shape(), DType::f32, kCpu);
    if (sq > 0) {
      attention_forward(qs, ks, vs, os, ls, c.opt);
      expect_rows_equal(out, q0, os, what + " out");
      for (std::int64_t h = 0; h < b.h; ++h)
        for (std::int64_t i = 0; i < sq; ++i)
          ASSERT_EQ(lse.data_as<const float>()[h * b.total_q() + q0 + i], ls.data_as<const float>()[h * sq + i])
              << what << " lse head " << h << " query " << i;
    }
    attention_backward(qs, ks, vs, to_dense(out, q0, sq), dos, ls, dqs, dks, dvs, c.opt);
    expect_rows_equal(dq, q0, dqs, what + " dq");
    expect_rows_equal(dk, k0, dks, what + " dk");
    expect_rows_equal(dv, k0, dvs, what + " dv");
    q0 += sq;
    k0 += sk;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Options, AttentionVarlenSpecVsDense,
    ::testing::Values(
        SpecCase{"plain", {{3, 0, 1, 5, 2}, {4, 2, 0, 5, 1}, 2, 2, 3}, {.scale = 0.7f}},
        SpecCase{"causal_top_left", {{5, 1, 0, 4}, {3, 1, 2, 6}, 2, 2, 4}, {.causal = true, .scale = 0.5f}},
        SpecCase{"causal_bottom_right_empty_rows", {{5, 2, 3, 0}, {3, 6, 3, 2}, 2, 1, 4},
                 {.causal = true, .bottom_right = true, .scale = 0.5f}},
        SpecCase{"gqa_4_over_2_window", {{6, 1, 7}, {6, 3, 7}, 4, 2, 3},
                 {.window_left = 2, .window_right = 1, .scale = 0.8f}},
        SpecCase{"mqa_3_over_1_causal_window", {{8, 2}, {8, 5}, 3, 1, 2},
                 {.causal = true, .bottom_right = true, .window_left = 3, .scale = 1.0f}},
        SpecCase{"softcap", {{4, 3}, {5, 0}, 2, 2, 4}, {.scale = 2.0f, .softcap = 1.5f}},
        SpecCase{"one_token_each", {{1, 1, 1}, {1, 1, 1}, 1, 1, 5}, {.scale = 1.0f}},
        SpecCase{"all_keys_empty", {{2, 3}, {0, 0}, 2, 2, 3}, {.scale = 1.0f}}),
    [](const auto& info) { return info.param.name; });

TEST(AttentionVarlenErrors, BadArgumentsNameThemselves) {
  const Batch b{{2, 3}, {4, 1}, 4, 2, 8};
  const Tensor q = test::random_tensor({5, 4, 8}, DType::f32, kCpu, 1), k = test::random_tensor({5, 2, 8}, DType::f32, kCpu, 2);
  const Tensor v = test::random_tensor({5, 2, 8}, DType::f32, kCpu, 3), k3 = test::random_tensor({5, 3, 8}, DType::f32, kCpu, 4);
  Tensor out = Tensor::empty(q.shape(), DType::f32, kCpu), lse = Tensor::empty({4, 5}, DType::f32, kCpu);
  Tensor lse_dense = Tensor::empty({1, 4, 5}, DType::f32, kCpu), dq = Tensor::empty(q.shape(), DType::f32, kCpu);
  Tensor dk = Tensor::empty(k.shape(), DType::f32, kCpu), dv = Tensor::empty(k.shape(), DType::f32, kCpu);
  const Tensor cu_q = cu_seqlens(b.q_lens), cu_k = cu_seqlens(b.k_lens);
  const AttentionVarlen ok = seqs_of(b, cu_q, cu_k);
  const AttentionOptions opt{.scale = 1.0f};
  constexpr const char* fwd = "attention_forward_varlen";
  auto forward = [&](const AttentionVarlen& s) { attention_forward_varlen(q, k, v, out, lse, s, opt); };
  auto with_q = [&](const Tensor& cu) { return AttentionVarlen{cu.view(), cu_k.view(), 10, 10}; };

  test::expect_arg_error([&] { attention_forward_varlen(q, k3, k3, out, lse, ok, opt); }, fwd, "k");
  test::expect_arg_error([&] { attention_forward_varlen(q, k, v, out, lse_dense, ok, opt); }, fwd, "lse");
  test::expect_arg_error([&] { attention_forward_varlen(q, k, v, out, lse, ok, {.scale = NAN}); }, fwd, "scale");
  test::expect_arg_error([&] { forward(with_q(test::host_tensor({3}, DType::i32, {1, 2, 5}))); }, fwd, "cu_seqlens_q");
  test::expect_arg_error([&] { forward(with_q(test::host_tensor({3}, DType::i32, {0, 4, 2}))); }, fwd, "cu_seqlens_q");
  test::expect_arg_error([&] { forward(with_q(test::host_tensor({3}, DType::i32, {0, 2, 4}))); }, fwd, "cu_seqlens_q");
  test::expect_arg_error([&] { forward(with_q(test::host_tensor({3}, DType::i64, {0, 2, 5}))); }, fwd, "cu_seqlens_q");
  test::expect_arg_error([&] { forward(with_q(test::host_tensor({1}, DType::i32, {0}))); }, fwd, "cu_seqlens_q");
  test::expect_arg_error([&] { forward(with_q(test::host_tensor({4}, DType::i32, {0, 2, 5, 5}))); }, fwd, "cu_seqlens_k");
  test::expect_arg_error([&] { forward({cu_q.view(), cu_k.view(), 2, 4}); }, fwd, "max_seqlen_q");
  test::expect_arg_error([&] { forward({cu_q.view(), cu_k.view(), 3, 3}); }, fwd, "max_seqlen_k");
  test::expect_arg_error([&] { forward({cu_q.view(), cu_k.view(), -1, 4}); }, fwd, "max_seqlen_q");
  test::expect_arg_error([&] { forward({cu_q.view(), test::host_tensor({3}, DType::i32, {0, 4, 4}).view(), 3, 4}); },
                         fwd, "cu_seqlens_k");
  // max_seqlen above every length is fine (the grid is only larger).
  EXPECT_NO_THROW(forward({cu_q.view(), cu_k.view(), 10, 10}));
  forward(ok);

  constexpr const char* bwd = "attention_backward_varlen";
  test::expect_arg_error([&] { attention_backward_varlen(q, k, v, out, out, lse, out, dk, dv, ok, opt); }, bwd, "dq");
  test::expect_arg_error([&] { attention_backward_varlen(q, k, v, out, out, lse, dq, dk, dk, ok, opt); }, bwd, "dv");
  test::expect_arg_error([&] { attention_backward_varlen(q, k, v, out, out, lse_dense, dq, dk, dv, ok, opt); }, bwd,
                         "lse");
  test::expect_arg_error(
      [&] { attention_backward_varlen(q, k, v, out, out, lse, dq, dk, dv, with_q(test::host_tensor({3}, DType::i32, {0, 3, 2})), opt); },
      bwd, "cu_seqlens_q");
  EXPECT_NO_THROW(attention_backward_varlen(q, k, v, out, out, lse, dq, dk, dv, ok, opt));
}

// ---------------------------------------------------------------------------------------------
// The GPU against the spec
// ---------------------------------------------------------------------------------------------

// Normwise relative error bounds of attention_backward_test's GPU tests, for the same reasons: f32
// on the warp-per-row kernels; bf16/f16 on the tensor-core backward, P and dS rounded to the dtype.
double gpu_tolerance(DType dt) { return dt == DType::f32 ? 1e-4 : dt == DType::bf16 ? 2e-2 : 4e-3; }

// Where got (host, packed [total, heads, D]) is farthest from ref: token, head, column.
std::string worst_element(const Tensor& got, const Tensor& ref) {
  const std::vector<double> a = test::to_doubles(got), r = test::to_doubles(ref);
  std::size_t at = 0;
  double err = -1.0;
  for (std::size_t e = 0; e < a.size(); ++e) {
    const double d = std::isnan(a[e]) ? kInf : std::abs(a[e] - r[e]);
    if (d > err) err = d, at = e;
    if (std::isnan(a[e])) break;
  }
  const std::int64_t d = ref.size(2), heads = ref.size(1);
  const auto e = static_cast<std::int64_t>(at);
  return fmt::format("worst at [token {}, head {}, col {}] got {} want {}", e / (d * heads), e / d % heads, e % d,
                     a.empty() ? 0.0 : a[at], r.empty() ? 0.0 : r[at]);
}

// lse [H, total_q]: -inf exactly where the spec has it (rows that see no key), else within 1e-4 +
// 1e-5 |lse| (an fp32 log of fp32 sums, as attention_test holds the dense forward).
void expect_lse_close(const Tensor& got, const Tensor& ref, const std::string& what) {
  const std::vector<double> a = test::to_doubles(got), r = test::to_doubles(ref);
  std::size_t bad = 0, first = 0;
  for (std::size_t e = 0; e < a.size(); ++e) {
    const bool ok = std::isinf(r[e]) ? a[e] == r[e] : std::abs(a[e] - r[e]) <= 1e-4 + 1e-5 * std::abs(r[e]);
    if (!ok && bad++ == 0) first = e;
  }
  const auto tokens = static_cast<std::size_t>(ref.size(1));
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " lse elements off, first [head " << first / tokens << ", token "
                     << first % tokens << "] got " << (bad ? a[first] : 0.0) << " want " << (bad ? r[first] : 0.0);
}

struct GpuCase {
  std::string name;
  Batch batch;
  AttentionOptions opt;
  std::vector<DType> dtypes;
  std::int64_t slack = 0;  // added to both max_seqlens on the GPU: a larger grid, the same results
};

const std::vector<DType> kHalfTypes = {DType::bf16, DType::f16};

// One dtype of a case: the packed inputs (seeds from `seed`), the spec's forward and backward on
// the CPU, and the GPU forward (outputs poisoned first, so that a row no kernel writes is a NaN)
// checked against the spec; then `backward(opt, what)` runs the GPU backward from the spec's out
// and lse (the same inputs) with `opt` and checks dq, dk and dv.
struct VarlenAgainstSpec {
  const GpuCase& c;
  DType dt;
  Device gpu = Device::cuda(0);
  Tensor cu_q, cu_k, cu_qg, cu_kg;
  AttentionVarlen seqs_g;
  Tensor q, k, v, dout, out, lse, dq, dk, dv, qg, kg, vg, dog, outg, lseg;
  std::string name;

  VarlenAgainstSpec(const GpuCase& gc, DType type, unsigned seed) : c(gc), dt(type) {
    const Batch& b = c.batch;
    cu_q = cu_seqlens(b.q_lens);
    cu_k = cu_seqlens(b.k_lens);
    cu_qg = cu_q.copy_to(gpu);
    cu_kg = cu_k.copy_to(gpu);
    const AttentionVarlen seqs = seqs_of(b, cu_q, cu_k);
    seqs_g = AttentionVarlen{cu_qg.view(), cu_kg.view(), b.max_q() + c.slack, b.max_k() + c.slack};
    const Dims lse_shape{b.h, b.total_q()};
    q = test::random_tensor({b.total_q(), b.h, b.d}, dt, kCpu, seed);
    k = test::random_tensor({b.total_k(), b.hk, b.d}, dt, kCpu, seed + 1);
    v = test::random_tensor({b.total_k(), b.hk, b.d}, dt, kCpu, seed + 2);
    dout = test::random_tensor({b.total_q(), b.h, b.d}, dt, kCpu, seed + 3);
    out = Tensor::empty(q.shape(), dt, kCpu);
    lse = Tensor::empty(lse_shape, DType::f32, kCpu);
    dq = Tensor::empty(q.shape(), dt, kCpu);
    dk = Tensor::empty(k.shape(), dt, kCpu);
    dv = Tensor::empty(k.shape(), dt, kCpu);
    attention_forward_varlen(q, k, v, out, lse, seqs, c.opt);
    attention_backward_varlen(q, k, v, out, dout, lse, dq, dk, dv, seqs, c.opt);

    qg = q.copy_to(gpu);
    kg = k.copy_to(gpu);
    vg = v.copy_to(gpu);
    dog = dout.copy_to(gpu);
    Tensor og = Tensor::empty(q.shape(), dt, gpu), lg = Tensor::empty(lse_shape, DType::f32, gpu);
    test::poison(og);
    test::poison(lg);
    attention_forward_varlen(qg, kg, vg, og, lg, seqs_g, c.opt);
    name = c.name + " " + std::string(dtype_name(dt));
    check(og, out, name + " out");
    expect_lse_close(test::to_host(lg), lse, name + " lse");
    outg = out.copy_to(gpu);
    lseg = lse.copy_to(gpu);
  }

  void check(const Tensor& got, const Tensor& ref, const std::string& what) const {
    const double tol = gpu_tolerance(dt);
    const Tensor host = test::to_host(got);
    const double err = test::rel_err_normwise(host, ref);
    EXPECT_LE(err, tol) << what << ": rel err " << err << ", " << worst_element(host, ref);
    if (err > tol / 4) std::printf("  [note] %s rel err %.3g (tol %.3g)\n", what.c_str(), err, tol);
  }

  void backward(const AttentionOptions& opt, const std::string& what) const {
    Tensor dqg = Tensor::empty(q.shape(), dt, gpu), dkg = Tensor::empty(k.shape(), dt, gpu);
    Tensor dvg = Tensor::empty(k.shape(), dt, gpu);
    for (Tensor* t : {&dqg, &dkg, &dvg}) test::poison(*t);
    attention_backward_varlen(qg, kg, vg, outg, dog, lseg, dqg, dkg, dvg, seqs_g, opt);
    check(dqg, dq, what + " dq");
    check(dkg, dk, what + " dk");
    check(dvg, dv, what + " dv");
  }
};
const std::vector<DType> kAllTypes = {DType::f32, DType::bf16, DType::f16};

void PrintTo(const GpuCase& c, std::ostream* os) { *os << c.name; }

class AttentionVarlenGpuVsSpec : public ::testing::TestWithParam<GpuCase> {};

// The packed batch on the GPU (forward on the sm_90 wgmma kernel for bf16/f16 at D 64/128 without
// window or softcap on an sm_90 GPU, else the warp-per-row kernel; backward on the tensor-core
// kernels for bf16/f16 at D 64/96/128, else warp-per-row) against the CPU spec, outputs poisoned
// first so that a row no kernel writes is a NaN; bf16/f16 backward in both dq modes.
TEST_P(AttentionVarlenGpuVsSpec, MatchesTheSpec) {
  FK_SKIP_WITHOUT_GPU();
  const GpuCase& c = GetParam();
  for (DType dt : c.dtypes) {
    const VarlenAgainstSpec r(c, dt, 61);
    for (bool deterministic : {false, true}) {
      if (dt == DType::f32 && deterministic) continue;  // the warp-per-row kernels have one mode
      AttentionOptions opt = c.opt;
      opt.deterministic = deterministic;
      r.backward(opt, r.name + (deterministic ? " deterministic" : ""));
    }
  }
}

// The same inputs twice: with opt.deterministic dq, dk and dv are the same bits; without, dk and dv
// still are (dq only close: f32 atomics).
TEST_P(AttentionVarlenGpuVsSpec, DeterministicModeRepeatsItsBits) {
  FK_SKIP_WITHOUT_GPU();
  const GpuCase& c = GetParam();
  const Batch& b = c.batch;
  const Device gpu = Device::cuda(0);
  const Tensor cu_qg = cu_seqlens(b.q_lens).copy_to(gpu), cu_kg = cu_seqlens(b.k_lens).copy_to(gpu);
  const AttentionVarlen seqs = seqs_of(b, cu_qg, cu_kg);
  for (DType dt : c.dtypes) {
    const Tensor q = test::random_tensor({b.total_q(), b.h, b.d}, dt, gpu, 71);
    const Tensor k = test::random_tensor({b.total_k(), b.hk, b.d}, dt, gpu, 72);
    const Tensor v = test::random_tensor({b.total_k(), b.hk, b.d}, dt, gpu, 73);
    const Tensor dout = test::random_tensor({b.total_q(), b.h, b.d}, dt, gpu, 74);
    const Tensor out = Tensor::empty(q.shape(), dt, gpu), lse = Tensor::empty({b.h, b.total_q()}, DType::f32, gpu);
    attention_forward_varlen(q, k, v, out, lse, seqs, c.opt);
    for (bool deterministic : {true, false}) {
      AttentionOptions opt = c.opt;
      opt.deterministic = deterministic;
      std::vector<std::vector<double>> first;
      for (int run = 0; run < 2; ++run) {
        Tensor dq = Tensor::empty(q.shape(), dt, gpu), dk = Tensor::empty(k.shape(), dt, gpu), dv = Tensor::empty(k.shape(), dt, gpu);
        for (Tensor* t : {&dq, &dk, &dv}) test::poison(*t);
        attention_backward_varlen(q, k, v, out, dout, lse, dq, dk, dv, seqs, opt);
        const std::vector<std::vector<double>> now = {test::to_doubles(dq), test::to_doubles(dk), test::to_doubles(dv)};
        if (run == 0) {
          first = now;
          continue;
        }
        const std::string what = c.name + " " + std::string(dtype_name(dt)) + (deterministic ? " deterministic" : " default");
        for (int i = 0; i < 3; ++i) {
          const char* name = i == 0 ? "dq" : i == 1 ? "dk" : "dv";
          std::size_t differ = 0, first_at = 0, unwritten = 0;
          for (std::size_t e = 0; e < now[i].size(); ++e) {
            unwritten += std::isnan(now[i][e]) ? 1 : 0;
            if (std::memcmp(&now[i][e], &first[i][e], sizeof(double)) != 0 && differ++ == 0) first_at = e;
          }
          EXPECT_EQ(unwritten, 0u) << what << " " << name << ": elements never written (NaN)";
          if (deterministic || i > 0 || dt == DType::f32)
            EXPECT_EQ(differ, 0u) << what << " " << name << ": " << differ << " elements differ between two runs, first at "
                                  << first_at;
          else if (differ > 0)
            std::printf("  [note] %s dq: %zu elements differ between runs (atomics)\n", what.c_str(), differ);
        }
      }
    }
  }
}

// Lengths mixing 0, 1, 7, 127 and 1000 (tails of the 64-query and 128-key tiles, sequences with no
// queries or no keys, one-token sequences), grouped-query heads 1, 2, 4 and 8 per k/v head, causal
// top-left and bottom-right with Sq != Sk per sequence (bottom-right with Sq > Sk leaves rows with
// no key), windows, softcap, D 64/96/128 (tensor-core backward), deterministic mode as the case's
// default. Spec cost bounds the sizes: one 1000-token sequence per case.
INSTANTIATE_TEST_SUITE_P(
    TensorCore, AttentionVarlenGpuVsSpec,
    ::testing::Values(
        GpuCase{"d64_group1_mixed", {{0, 1, 7, 127, 1000}, {0, 1, 7, 127, 1000}, 2, 2, 64}, {.scale = 0.125f}, kHalfTypes},
        GpuCase{"d96_group2_causal_top_left",
                {{7, 1000, 0, 127, 1}, {127, 1000, 1, 7, 0}, 4, 2, 96},
                {.causal = true, .scale = 0.1f},
                kHalfTypes},
        GpuCase{"d128_group4_causal_bottom_right",
                {{1, 127, 1000, 0, 7}, {1000, 7, 127, 5, 1}, 4, 1, 128},
                {.causal = true, .bottom_right = true, .scale = 0.088f},
                kHalfTypes},
        GpuCase{"d64_group8_window_softcap",
                {{127, 0, 300, 1, 7}, {127, 3, 200, 1, 7}, 8, 1, 64},
                {.bottom_right = true, .window_left = 30, .window_right = 5, .scale = 0.3f, .softcap = 4.0f},
                kHalfTypes},
        GpuCase{"d128_group2_deterministic_causal_window",
                {{1000, 7, 1, 0, 127}, {1000, 7, 1, 0, 127}, 4, 2, 128},
                {.causal = true, .window_left = 70, .scale = 0.088f, .deterministic = true},
                kHalfTypes},
        GpuCase{"d96_group4_deterministic_bottom_right",
                {{127, 7, 300}, {7, 127, 300}, 8, 2, 96},
                {.causal = true, .bottom_right = true, .scale = 0.1f, .deterministic = true},
                kHalfTypes},
        GpuCase{"d64_max_seqlen_above_every_length", {{7, 127, 1}, {127, 7, 0}, 4, 2, 64}, {.scale = 0.125f}, kHalfTypes,
                200}),
    [](const auto& info) { return info.param.name; });

// The warp-per-row kernels: f32 at every head dim, bf16/f16 at head dims off the tensor-core path.
INSTANTIATE_TEST_SUITE_P(
    Rowwise, AttentionVarlenGpuVsSpec,
    ::testing::Values(
        GpuCase{"d32_group2_causal_bottom_right", {{0, 1, 7, 127, 40}, {3, 1, 7, 60, 127}, 4, 2, 32},
                {.causal = true, .bottom_right = true, .scale = 0.2f}, kAllTypes},
        GpuCase{"d64_group4_window_softcap_f32", {{7, 127, 1}, {127, 7, 1}, 8, 2, 64},
                {.window_left = 9, .window_right = 3, .scale = 0.3f, .softcap = 2.0f}, {DType::f32}},
        GpuCase{"d256_one_token_sequences", {{1, 1, 0, 1}, {1, 77, 1, 0}, 2, 2, 256}, {.scale = 0.06f}, kAllTypes},
        GpuCase{"d64_no_queries_at_all", {{0, 0}, {5, 130}, 2, 1, 64}, {.scale = 0.125f}, kAllTypes}),
    [](const auto& info) { return info.param.name; });

// Small cases for compute-sanitizer (memcheck, racecheck, synccheck): short names, a few tiles,
// every kernel (tensor-core dk/dv with atomics and deterministic dq, the rowwise ones), sequences
// of 0 and 1 tokens next to a tile tail, so an out-of-bounds read past a sequence or tensor shows.
INSTANTIATE_TEST_SUITE_P(
    San, AttentionVarlenGpuVsSpec,
    ::testing::Values(GpuCase{"d64", {{0, 1, 70}, {5, 1, 130}, 2, 1, 64}, {.causal = true, .bottom_right = true, .scale = 0.125f}, kHalfTypes},
                      GpuCase{"d128_det", {{65, 0, 3}, {129, 2, 0}, 2, 2, 128}, {.scale = 0.088f, .deterministic = true}, kHalfTypes},
                      GpuCase{"d16_f32", {{9, 0, 33}, {0, 4, 40}, 2, 1, 16}, {.causal = true, .scale = 0.3f}, {DType::f32}}),
    [](const auto& info) { return info.param.name; });

// The sm_90 kernels on packed batches against the spec: the forward (on sm_90 every bf16/f16 call
// at D 64/128 without window or softcap takes the wgmma kernel) and the backward forced to each dq
// variant (wgmma_sm90: atomics; wgmma_sm90_tma_dq: TMA reduce-adds, whose boxes past a sequence's
// end add zeros into the next sequence's dq rows). Outputs poisoned first, so a row no kernel
// writes is a NaN, and a row a CTA of another sequence wrote shows as an error. Skipped off sm_90.
class AttentionVarlenSm90VsSpec : public ::testing::TestWithParam<GpuCase> {};

TEST_P(AttentionVarlenSm90VsSpec, MatchesTheSpec) {
  FK_SKIP_WITHOUT_GPU();
  if (!test::on_sm90()) GTEST_SKIP() << "the wgmma kernels run on sm_90 (H100/H200) only";
  const GpuCase& c = GetParam();
  for (DType dt : c.dtypes) {
    const VarlenAgainstSpec r(c, dt, 91);
    for (auto [kind, kind_name] : {std::pair{AttentionBackwardKernel::wgmma_sm90, "wgmma_sm90"},
                                   std::pair{AttentionBackwardKernel::wgmma_sm90_tma_dq, "wgmma_sm90_tma_dq"}}) {
      AttentionOptions opt = c.opt;
      opt.backward_kernel = kind;
      r.backward(opt, r.name + " " + kind_name);
    }
  }
}

// Lengths mixing 0, 1, 7, 127, 128, 129 and 1000 (sequences without queries or keys, one token,
// tails of the 64/128-query and 128-key tiles on both sides of a tile edge, so that most boxes run
// into the next sequence), grouped-query heads 1, 2, 4, 8 per k/v head, causal top-left and
// bottom-right with Sq != Sk per sequence (rows and whole blocks without a key), D 64 and 128,
// bf16 and f16, a grid larger than the longest sequence.
INSTANTIATE_TEST_SUITE_P(
    Sm90, AttentionVarlenSm90VsSpec,
    ::testing::Values(
        GpuCase{"d64_group1_mixed", {{0, 1, 7, 127, 128, 129, 1000}, {0, 1, 7, 127, 128, 129, 1000}, 2, 2, 64},
                {.scale = 0.125f}, kHalfTypes},
        GpuCase{"d128_group2_mixed", {{129, 1000, 0, 128, 1, 127, 7}, {129, 1000, 0, 128, 1, 127, 7}, 4, 2, 128},
                {.scale = 0.088f}, kHalfTypes},
        GpuCase{"d64_group4_causal_top_left", {{7, 1000, 0, 127, 1, 128, 129}, {127, 1000, 1, 7, 0, 129, 128}, 8, 2, 64},
                {.causal = true, .scale = 0.125f}, kHalfTypes},
        GpuCase{"d128_group8_causal_bottom_right", {{1, 127, 1000, 0, 7, 129, 128}, {1000, 7, 127, 5, 1, 128, 129}, 8, 1, 128},
                {.causal = true, .bottom_right = true, .scale = 0.088f}, kHalfTypes},
        GpuCase{"d64_group2_causal_bottom_right", {{128, 0, 129, 1000, 7}, {129, 3, 128, 1000, 1}, 4, 2, 64},
                {.causal = true, .bottom_right = true, .scale = 0.125f}, kHalfTypes},
        GpuCase{"d128_group4_causal_top_left_slack", {{129, 7, 1}, {128, 127, 0}, 4, 1, 128},
                {.causal = true, .scale = 0.088f}, kHalfTypes, 300}),
    [](const auto& info) { return info.param.name; });

// Forcing the wgmma backward on a packed call it does not take (a window; D 96) names
// backward_kernel, on any GPU.
TEST(AttentionVarlenErrors, ForcedWgmmaKernelThatCannotTakeTheCall) {
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  const Tensor cu = cu_seqlens({3, 5}).copy_to(gpu);
  const AttentionVarlen seqs{cu.view(), cu.view(), 5, 5};
  for (std::int64_t d : {64, 96}) {
    const Tensor q = test::random_tensor({8, 2, d}, DType::bf16, gpu, 1), k = test::random_tensor({8, 1, d}, DType::bf16, gpu, 2);
    const Tensor out = Tensor::empty(q.shape(), DType::bf16, gpu), lse = Tensor::empty({2, 8}, DType::f32, gpu);
    const Tensor dq = Tensor::empty(q.shape(), DType::bf16, gpu), dk = Tensor::empty(k.shape(), DType::bf16, gpu);
    const Tensor dv = Tensor::empty(k.shape(), DType::bf16, gpu);
    AttentionOptions opt{.scale = 0.125f};
    if (d == 64) opt.window_left = 2;  // D 64 alone would be taken on sm_90
    attention_forward_varlen(q, k, k, out, lse, seqs, opt);
    for (auto kind : {AttentionBackwardKernel::wgmma_sm90, AttentionBackwardKernel::wgmma_sm90_tma_dq}) {
      opt.backward_kernel = kind;
      test::expect_arg_error([&] { attention_backward_varlen(q, k, k, out, out, lse, dq, dk, dv, seqs, opt); },
                             "attention_backward_varlen", "backward_kernel");
    }
  }
}

// The varlen kernels on a batch of one sequence are the dense kernels' results (the same
// arithmetic in the same order; only the addressing differs): a packed [S, H, D] batch against
// [1, H, S, D], bit for bit, forward and backward in both dq modes.
TEST(AttentionVarlenGpu, OneSequenceIsTheDenseCall) {
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  const std::int64_t s = 200, h = 4, hk = 2, d = 64;
  const AttentionOptions base{.causal = true, .scale = 0.125f};
  const Tensor cu = test::host_tensor({2}, DType::i32, {0, static_cast<float>(s)}).copy_to(gpu);
  const AttentionVarlen seqs{cu.view(), cu.view(), s, s};
  for (DType dt : {DType::bf16, DType::f32}) {
    const Tensor q = test::random_tensor({s, h, d}, dt, kCpu, 81), k = test::random_tensor({s, hk, d}, dt, kCpu, 82);
    const Tensor v = test::random_tensor({s, hk, d}, dt, kCpu, 83), dout = test::random_tensor({s, h, d}, dt, kCpu, 84);
    // [S, H, D] -> [1, H, S, D], element by element through doubles (exact for every dtype here).
    auto dense = [&](const Tensor& t) {
      const std::int64_t heads = t.size(1);
      const std::vector<double> x = test::to_doubles(t);
      std::vector<float> y(x.size());
      for (std::int64_t i = 0; i < s; ++i)
        for (std::int64_t hh = 0; hh < heads; ++hh)
          for (std::int64_t c = 0; c < d; ++c)
            y[static_cast<std::size_t>((hh * s + i) * d + c)] = static_cast<float>(x[static_cast<std::size_t>((i * heads + hh) * d + c)]);
      return test::host_tensor({1, heads, s, d}, dt, y).copy_to(gpu);
    };
    const Tensor qg = q.copy_to(gpu), kg = k.copy_to(gpu), vg = v.copy_to(gpu), dog = dout.copy_to(gpu);
    const Tensor qd = dense(q), kd = dense(k), vd = dense(v), dod = dense(dout);
    Tensor o = Tensor::empty(q.shape(), dt, gpu), l = Tensor::empty({h, s}, DType::f32, gpu);
    Tensor od = Tensor::empty(qd.shape(), dt, gpu), ld = Tensor::empty({1, h, s}, DType::f32, gpu);
    // A window wider than the sequence (the same mask) keeps both calls on the warp-per-row
    // kernel; the sm_90 kernels' packed and dense instantiations are compared by their own suites.
    AttentionOptions fwd = base;
    fwd.window_left = s;
    attention_forward_varlen(qg, kg, vg, o, l, seqs, fwd);
    attention_forward(qd, kd, vd, od, ld, fwd);
    EXPECT_EQ(test::to_doubles(dense(test::to_host(o))), test::to_doubles(od)) << dtype_name(dt) << " out";
    EXPECT_EQ(test::to_doubles(l), test::to_doubles(ld)) << dtype_name(dt) << " lse";
    for (bool deterministic : {true, false}) {
      AttentionOptions opt = base;
      opt.deterministic = deterministic;
      Tensor dq = Tensor::empty(q.shape(), dt, gpu), dk = Tensor::empty(k.shape(), dt, gpu), dv = Tensor::empty(k.shape(), dt, gpu);
      Tensor dqd = Tensor::empty(qd.shape(), dt, gpu), dkd = Tensor::empty(kd.shape(), dt, gpu), dvd = Tensor::empty(kd.shape(), dt, gpu);
      attention_backward_varlen(qg, kg, vg, o, dog, l, dq, dk, dv, seqs, opt);
      attention_backward(qd, kd, vd, od, dod, ld, dqd, dkd, dvd, opt);
      const std::string what = std::string(dtype_name(dt)) + (deterministic ? " deterministic" : " default");
      // dq by atomics (bf16 default mode) may differ in the last bits between any two runs.
      if (deterministic || dt == DType::f32) {
        EXPECT_EQ(test::to_doubles(dense(test::to_host(dq))), test::to_doubles(dqd)) << what << " dq";
      }
      EXPECT_EQ(test::to_doubles(dense(test::to_host(dk))), test::to_doubles(dkd)) << what << " dk";
      EXPECT_EQ(test::to_doubles(dense(test::to_host(dv))), test::to_doubles(dvd)) << what << " dv";
    }
  }
}

}  // namespace
}  // namespace fk
