// `fusekit check`: one short case per op family on each device present, against the family's spec.
//
// On each CUDA device the family's kernels run on random inputs (odd sizes, the dtypes the family
// is built for) and are compared with its CPU spec (fk::reference) under the bounds its GPU tests
// hold them to (tests/ops/<family>_test.cpp; each bound below gives the tests' reason). On the CPU
// the public ops run the spec itself, so comparing them with the spec would prove nothing: there
// each family is checked against hand-worked values instead, the ones its spec tests use.
//
// This is a smoke test of an installed build on a given machine, not the test suite: the tests
// cover many shapes, dtypes, kernel paths and every bad input; this covers one case of each family.
//
// One line per (family, device): of the family's comparisons, the one nearest its bound, with its
// error and that bound. A comparison is elementwise (|got - want| and atol + rtol |want| at the
// element nearest its bound; NaN matches NaN), normwise (||got - want|| / ||want||, for
// GEMM-shaped outputs) or exact (elements whose bits differ, NaN payloads aside; bound 0).
#include "apps/check.hpp"

#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <iterator>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "fusekit/fusekit.hpp"
#include "ops/pointwise/bias_act_example.hpp"

#if FUSEKIT_WITH_CUDA
#include "fusekit/core/cuda_check.hpp"
#endif

namespace fk::app {
namespace {

const Device kCpu = Device::cpu();
constexpr double kInf = std::numeric_limits<double>::infinity();

// ---------------------------------------------------------------------------------------------
// Comparisons
// ---------------------------------------------------------------------------------------------

struct Measure {
  std::string what;  // the op, the output and the case
  const char* kind;  // "elementwise", "normwise" or "exact"
  double err = 0, bound = 0;

  bool ok() const { return err <= bound; }  // false for a NaN error
  // 0 exact, 1 at the bound; infinite once past it.
  double nearness() const { return !ok() ? kInf : bound > 0 ? err / bound : 0.0; }
};

struct Tol {
  double atol, rtol;
};

constexpr Tol kExact{0, 0};

// One rounding to the dtype plus a few float operations: 2 units of roundoff, relative and
// absolute, as tests/support/test_util.cpp's tolerance_for (the GPU tests' starting point).
Tol one_rounding(DType t) {
  switch (t) {
    case DType::bf16: return {2.0 / 256, 2.0 / 256};
    case DType::f16: return {2.0 / 2048, 2.0 / 2048};
    default: return {2e-6, 2e-6};
  }
}

// Every element of a tensor on any device, as double (integers exactly).
std::vector<double> values(const TensorView& t) {
  Tensor h = Tensor::empty(t.shape(), t.dtype(), kCpu);
  copy(h, t);
  std::vector<double> v(static_cast<std::size_t>(h.numel()));
  visit_dtype(h.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const T* p = h.data_as<T>();
    for (std::size_t i = 0; i < v.size(); ++i) {
      if constexpr (std::is_integral_v<T>) v[i] = static_cast<double>(p[i]);
      else v[i] = static_cast<float>(p[i]);
    }
  });
  return v;
}

// A packed word or mask word as the i32 tensor holds it.
double word(std::uint32_t w) { return static_cast<double>(static_cast<std::int32_t>(w)); }

Measure close(std::string what, const std::vector<double>& got, const std::vector<double>& want, Tol tol) {
  Measure m{std::move(what), "elementwise", 0, tol.atol};
  if (got.size() != want.size()) {
    m.err = kInf;
    return m;
  }
  double nearest = -1;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(want[i]) && std::isnan(got[i])) continue;
    const double err = std::fabs(got[i] - want[i]), bound = tol.atol + tol.rtol * std::fabs(want[i]);
    const double nearness = err <= bound ? (bound > 0 ? err / bound : 0.0) : kInf;
    if (nearness > nearest) {
      nearest = nearness;
      m.err = std::isnan(err) ? kInf : err;
      m.bound = bound;
    }
    if (nearness == kInf) break;
  }
  return m;
}

Measure close(std::string what, const TensorView& got, const TensorView& want, Tol tol) {
  return close(std::move(what), values(got), values(want), tol);
}

// ||got - want|| / ||want|| (||got - want|| when want is all zeros), infinite when got holds a NaN
// or an infinity: the relative error GEMM-shaped ops are held to, as `fusekit bench` reports it.
Measure normwise(std::string what, const TensorView& got, const TensorView& want, double bound) {
  Measure m{std::move(what), "normwise", 0, bound};
  const std::vector<double> g = values(got), w = values(want);
  if (g.size() != w.size()) {
    m.err = kInf;
    return m;
  }
  double num = 0, den = 0;
  for (std::size_t i = 0; i < g.size(); ++i) {
    if (!std::isfinite(g[i])) {
      m.err = kInf;
      return m;
    }
    num += (g[i] - w[i]) * (g[i] - w[i]);
    den += w[i] * w[i];
  }
  m.err = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  return m;
}

// The number of elements whose bits differ; any NaN matches any NaN (the host and the device write
// different NaN payloads).
Measure same_bits(std::string what, const TensorView& got, const TensorView& want) {
  Measure m{std::move(what), "exact", 0, 0};
  Tensor g = Tensor::empty(got.shape(), got.dtype(), kCpu), w = Tensor::empty(want.shape(), want.dtype(), kCpu);
  copy(g, got);
  copy(w, want);
  if (g.dtype() != w.dtype() || g.numel() != w.numel()) {
    m.err = kInf;
    return m;
  }
  visit_dtype(g.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const T* a = g.data_as<T>();
    const T* b = w.data_as<T>();
    for (std::int64_t i = 0; i < g.numel(); ++i) {
      bool same = std::memcmp(&a[i], &b[i], sizeof(T)) == 0;
      if constexpr (!std::is_integral_v<T>)
        same |= std::isnan(static_cast<float>(a[i])) && std::isnan(static_cast<float>(b[i]));
      m.err += same ? 0 : 1;
    }
  });
  return m;
}

// ---------------------------------------------------------------------------------------------
// Tensors
// ---------------------------------------------------------------------------------------------

// A host tensor holding `v` (row-major), each value rounded to `dtype`.
Tensor host(Dims shape, DType dtype, const std::vector<double>& v) {
  Tensor t = Tensor::empty(shape, dtype, kCpu);
  visit_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    for (std::size_t i = 0; i < v.size(); ++i) t.data_as<T>()[i] = T(static_cast<float>(v[i]));
  });
  return t;
}

// Uniform values in [lo, hi) from the Philox stream `seed`, on the host (copied where needed, so
// that the spec and the kernel see the same inputs).
Tensor random(Dims shape, DType dtype, std::uint64_t seed, float lo = -1.f, float hi = 1.f) {
  Tensor t = Tensor::empty(shape, dtype, kCpu);
  fill_uniform(t, lo, hi, RandomParams{seed, 0});
  return t;
}

// NaN everywhere, so that an element a kernel fails to write cannot pass.
void poison(const TensorView& t) { fill(t, std::numeric_limits<double>::quiet_NaN()); }

// ---------------------------------------------------------------------------------------------
// pointwise
// ---------------------------------------------------------------------------------------------

std::vector<Measure> pointwise_by_hand() {
  using namespace examples;
  std::vector<Measure> out;
  auto vec = [](const float* p, int n) { return std::vector<double>(p, p + n); };
  const int n = kBiasActRows * kBiasActCols;
  Tensor x = host({kBiasActRows, kBiasActCols}, DType::f32, vec(kBiasActX, n));
  const Tensor r = host({kBiasActRows, kBiasActCols}, DType::f32, vec(kBiasActR, n));
  const Tensor b = host({kBiasActCols}, DType::f32, vec(kBiasActBias, kBiasActCols));
  bias_act_forward({x, r.view(), b.view(), x, std::nullopt}, {Activation::relu, kBiasActAlpha});
  // The seed prints its expected values to 4 decimals.
  out.push_back(close("bias_act_forward relu(x + 2.3 r + b), f32 [8, 10]: seed 003's example",
                      values(x), vec(kBiasActExpected, n), {kBiasActTolerance, 0}));

  // z = [[-1, 2], [3, -4]], relu, alpha 2: dz = dy [z > 0]; dx = dz, dr = 2 dz, db = column sums.
  // Small integers: exact.
  const Tensor y = host({2, 2}, DType::f32, {0, 2, 3, 0}), dy = host({2, 2}, DType::f32, {10, 20, 30, 40});
  Tensor dx = Tensor::empty({2, 2}, DType::f32, kCpu), dr = Tensor::empty({2, 2}, DType::f32, kCpu),
         db = Tensor::empty({2}, DType::f32, kCpu);
  bias_act_backward({dy, y, SavedForBackward::output, dx, dr.view(), db.view()}, {Activation::relu, 2.0f});
  out.push_back(close("bias_act_backward dx, relu f32 [2, 2] by hand", values(dx), {0, 20, 30, 0}, kExact));
  out.push_back(close("bias_act_backward dr, relu f32 [2, 2] by hand", values(dr), {0, 40, 60, 0}, kExact));
  out.push_back(close("bias_act_backward dbias, relu f32 [2, 2] by hand", values(db), {30, 20}, kExact));
  return out;
}

// pointwise_test.cpp's PointwiseGpu: forward with r, bias and the pre-activation, then the
// backward from the spec's pre-activation (gelu needs z), f32 with a row tail.
std::vector<Measure> pointwise_against_spec(Device gpu) {
  std::vector<Measure> out;
  const DType dt = DType::f32;
  const std::int64_t rows = 257, cols = 1000;
  const Dims s{rows, cols};
  const BiasActParams p{Activation::gelu_tanh, 0.75f};
  const std::string c = fmt::format("{} {} {}", activation_name(p.act), dtype_name(dt), s.str());
  // The kernels compute in fp32 with fma and the device math library, the spec in double with one
  // rounding: a few fp32 ulps apart.
  const Tol tol{1e-5, 1e-5};

  const Tensor x = random(s, dt, 101, -3, 3), r = random(s, dt, 102, -3, 3), b = random({cols}, dt, 103);
  Tensor want_y = Tensor::empty(s, dt, kCpu), want_z = Tensor::empty(s, dt, kCpu);
  reference::bias_act_forward({x, r.view(), b.view(), want_y, want_z.view()}, p);
  const Tensor xd = x.copy_to(gpu), rd = r.copy_to(gpu), bd = b.copy_to(gpu);
  Tensor y = Tensor::empty(s, dt, gpu), z = Tensor::empty(s, dt, gpu);
  poison(y);
  poison(z);
  bias_act_forward({xd, rd.view(), bd.view(), y, z.view()}, p);
  out.push_back(close("bias_act_forward y, " + c, y, want_y, tol));
  out.push_back(close("bias_act_forward preact, " + c, z, want_z, tol));

  const Tensor dy = random(s, dt, 104);
  Tensor want_dx = Tensor::empty(s, dt, kCpu), want_dr = Tensor::empty(s, dt, kCpu),
         want_db = Tensor::empty({cols}, DType::f32, kCpu);
  reference::bias_act_backward({dy, want_z, SavedForBackward::preactivation, want_dx, want_dr.view(), want_db.view()},
                               p);
  const Tensor dyd = dy.copy_to(gpu), zd = want_z.copy_to(gpu);
  Tensor dx = Tensor::empty(s, dt, gpu), dr = Tensor::empty(s, dt, gpu), db = Tensor::empty({cols}, DType::f32, gpu);
  poison(dx);
  poison(dr);
  poison(db);
  bias_act_backward({dyd, zd, SavedForBackward::preactivation, dx, dr.view(), db.view()}, p);
  out.push_back(close("bias_act_backward dx, " + c, dx, want_dx, tol));
  out.push_back(close("bias_act_backward dr, " + c, dr, want_dr, tol));
  // db sums `rows` fp32 values of size <= ~2 in another order than the spec's double sum: the
  // error grows like sqrt(rows) fp32 roundings; plus one rounding to db's dtype.
  const Tol f32 = one_rounding(DType::f32);
  const double accum = 8.0 * std::sqrt(static_cast<double>(rows)) * 2.0 * 0x1p-24;
  out.push_back(close("bias_act_backward dbias, " + c, db, want_db, {f32.atol + accum, f32.rtol}));
  return out;
}

// ---------------------------------------------------------------------------------------------
// primitives: softmax and attention
// ---------------------------------------------------------------------------------------------

std::vector<Measure> primitives_by_hand() {
  std::vector<Measure> out;
  const double ln3 = std::log(3.0);
  // [0, ln 3] -> [1/4, 3/4]; [5, 5] -> [1/2, 1/2].
  const Tensor x = host({2, 2}, DType::f32, {0, ln3, 5, 5});
  Tensor y = Tensor::empty({2, 2}, DType::f32, kCpu);
  softmax(x, y);
  out.push_back(close("softmax f32 [2, 2] by hand", values(y), {0.25, 0.75, 0.5, 0.5}, {1e-7, 0}));

  // One head, D = 2, scale 1. Query 0 = (1, 0) scores the keys (0, 5) and (ln 3, 7) as 0 and ln 3:
  // weights 1/4 and 3/4, out = (1/4 4 + 3/4 8, 1/4 1 - 3/4 1) = (7, -1/2), lse = ln 4. Query 1 =
  // (0, 0) scores both 0: out = (6, 0), lse = ln 2. Causal: query 0 sees key 0 only (out = v0,
  // lse = 0).
  const Tensor q = host({1, 1, 2, 2}, DType::f32, {1, 0, 0, 0});
  const Tensor k = host({1, 1, 2, 2}, DType::f32, {0, 5, ln3, 7});
  const Tensor v = host({1, 1, 2, 2}, DType::f32, {4, 1, 8, -1});
  Tensor o = Tensor::empty({1, 1, 2, 2}, DType::f32, kCpu), lse = Tensor::empty({1, 1, 2}, DType::f32, kCpu);
  const Tol tol{1e-6, 0};
  attention_forward(q, k, v, o, lse, false, 1.0f);
  out.push_back(close("attention_forward out, f32 [1, 1, 2, 2] by hand", values(o), {7, -0.5, 6, 0}, tol));
  out.push_back(
      close("attention_forward lse, f32 [1, 1, 2, 2] by hand", values(lse), {std::log(4.0), std::log(2.0)}, tol));
  attention_forward(q, k, v, o, lse, true, 1.0f);
  out.push_back(close("attention_forward out, causal, f32 [1, 1, 2, 2] by hand", values(o), {4, 1, 6, 0}, tol));
  out.push_back(close("attention_forward lse, causal, f32 [1, 1, 2, 2] by hand", values(lse), {0, std::log(2.0)}, tol));
  return out;
}

// primitives_rows_test.cpp's SoftmaxMatchesSpec and attention_test.cpp's AttentionGpuVsSpec.
std::vector<Measure> primitives_against_spec(Device gpu) {
  std::vector<Measure> out;
  {
    const DType dt = DType::bf16;
    const Dims s{6, 4096};
    const Tensor x = random(s, dt, 2, -8, 8);
    Tensor want = Tensor::empty(s, dt, kCpu), y = Tensor::empty(s, dt, gpu);
    softmax(x, want);
    poison(y);
    softmax(x.copy_to(gpu), y);
    // exp2 of the hardware (about 2^-22 relative), x - max rounded in fp32, the sum of positive
    // terms (below 2^-20 relative): 2^-16 covers all, plus one rounding to the dtype.
    out.push_back(close(fmt::format("softmax {} {}", dtype_name(dt), s.str()), y, want,
                        {1e-37, 0x1p-16 + 2 * 0x1p-8}));
  }
  {
    const DType dt = DType::bf16;
    const std::int64_t b = 2, h = 3, sq = 200, sk = 200, d = 128;
    const bool causal = true;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    const Tensor q = random({b, h, sq, d}, dt, 1001, -3, 3), k = random({b, h, sk, d}, dt, 1002, -3, 3);
    const Tensor v = random({b, h, sk, d}, dt, 1003);
    Tensor want = Tensor::empty({b, h, sq, d}, dt, kCpu), want_lse = Tensor::empty({b, h, sq}, DType::f32, kCpu);
    attention_forward(q, k, v, want, want_lse, causal, scale);
    Tensor o = Tensor::empty({b, h, sq, d}, dt, gpu), lse = Tensor::empty({b, h, sq}, DType::f32, gpu);
    poison(o);
    poison(lse);
    attention_forward(q.copy_to(gpu), k.copy_to(gpu), v.copy_to(gpu), o, lse, causal, scale);
    const std::string c = fmt::format("causal {} [B {}, H {}, S {}, D {}]", dtype_name(dt), b, h, sq, d);
    // P is rounded to the dtype before P v on the tensor cores and out once more at the store:
    // with |v| <= 1, within 4 units of roundoff (bf16 2^-8), absolute and relative. lse is an fp32
    // log of fp32 sums of exp2 over fp32 scores.
    out.push_back(close("attention_forward out, " + c, o, want, {0x1p-6, 0x1p-6}));
    out.push_back(close("attention_forward lse, " + c, lse, want_lse, {1e-4, 1e-5}));
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// quant
// ---------------------------------------------------------------------------------------------

std::vector<Measure> quant_by_hand() {
  std::vector<Measure> out;
  // min -3, max 3: scale 6 / 3 = 2 exactly; level = (x + 3) / 2, ties to even (1.5 -> 2, 2.5 -> 2):
  // levels 0,1,2,3,3,2,1,0,2,2,0,0,0,0,0,3, two bits each from bit 0 up.
  const Tensor x = host({1, 16}, DType::f32, {-3, -1, 1, 3, 3, 1, -1, -3, 0, 2, -2, -3, -3, -3, -3, 3});
  const PackedTensor p = pack(x, {.bits = 2, .group = 16, .stats_dtype = DType::f32});
  const std::string c = "2 bits, group 16, f32 [1, 16] by hand";
  out.push_back(close("pack words, " + c, values(p.words), {word(0xc00a1be4u)}, kExact));
  out.push_back(close("pack scale, " + c, values(p.scale), {2}, kExact));
  out.push_back(close("pack min, " + c, values(p.min), {-3}, kExact));
  out.push_back(close("unpack, " + c, values(unpack(p.view(), DType::f32)),
                      {-3, -1, 1, 3, 3, 1, -1, -3, 1, 1, -3, -3, -3, -3, -3, 3}, kExact));

  // ReLU with a 1-bit mask over 34 values: bits 1, 3, 6, 7..31 of word 0 and bit 1 of word 1 (NaN
  // and 0 are not > 0; NaN propagates to y).
  const double nan = std::numeric_limits<double>::quiet_NaN();
  std::vector<double> xv = {-1, 2, 0, 3, nan, -0.5, 7};
  xv.resize(32, 1.0);
  xv.push_back(-2);
  xv.push_back(4);
  std::vector<double> yv = {0, 2, 0, 3, nan, 0, 7};
  yv.resize(32, 1.0);
  yv.push_back(0);
  yv.push_back(4);
  const Tensor rx = host({34}, DType::f32, xv);
  Tensor y = Tensor::empty({34}, DType::f32, kCpu), mask = Tensor::empty({2}, DType::i32, kCpu);
  relu_forward_packed(rx, y, mask);
  out.push_back(close("relu_forward_packed y, f32 [34] by hand", values(y), yv, kExact));
  out.push_back(close("relu_forward_packed mask, f32 [34] by hand", values(mask), {word(0xffffffcau), 2}, kExact));
  const Tensor dy = random({34}, DType::f32, 3);
  Tensor dx = Tensor::empty({34}, DType::f32, kCpu);
  relu_backward_packed(dy, mask, dx);
  std::vector<double> want_dx = values(dy);
  for (int i = 0; i < 34; ++i)
    if (!(i == 1 || i == 3 || (i >= 6 && i <= 31) || i == 33)) want_dx[static_cast<std::size_t>(i)] = 0;
  out.push_back(close("relu_backward_packed dx, f32 [34] by hand", values(dx), want_dx, kExact));
  return out;
}

// quant_test.cpp's QuantPackGpu and QuantReluGpu (bit-exact), quant_weight_grad_test.cpp's
// WeightGradPackedGpu (normwise).
std::vector<Measure> quant_against_spec(Device gpu) {
  std::vector<Measure> out;
  {
    const int bits = 2, group = 256;
    const DType xt = DType::bf16, stats = DType::bf16;
    const std::int64_t rows = 3, cols = 1000;
    Tensor x = random({rows, cols}, xt, 21, -3, 5);
    // A non-finite value: its group must be poisoned as the spec poisons it.
    Tensor nan = Tensor::empty({1}, xt, kCpu);
    fill(nan, std::numeric_limits<double>::quiet_NaN());
    std::memcpy(static_cast<char*>(x.data()) + 3 * dtype_size(xt), nan.data(), dtype_size(xt));
    const Tensor xd = x.copy_to(gpu);
    for (Rounding rounding : {Rounding::nearest, Rounding::stochastic}) {
      const PackParams p{
          .bits = bits, .group = group, .rounding = rounding, .seed = 77, .offset = 3, .stats_dtype = stats};
      const std::string c = fmt::format("{} bits, group {}, {} rounding, {} {}", bits, group,
                                        rounding == Rounding::nearest ? "nearest" : "stochastic", dtype_name(xt),
                                        Dims{rows, cols}.str());
      const PackedTensor want = pack(x, p);
      PackedTensor got = PackedTensor::empty(rows, cols, xt, p, gpu);
      poison(got.scale);
      poison(got.min);
      fill(got.words, -1.0);
      pack(xd, got.view(), p);
      out.push_back(same_bits("pack words, " + c, got.words, want.words));
      out.push_back(same_bits("pack scale, " + c, got.scale, want.scale));
      out.push_back(same_bits("pack min, " + c, got.min, want.min));
      for (DType ut : {DType::bf16, DType::f32}) {
        Tensor u = Tensor::empty({rows, cols}, ut, gpu);
        poison(u);
        unpack(got.view(), u);
        out.push_back(same_bits(fmt::format("unpack to {}, {}", dtype_name(ut), c), u, unpack(want.view(), ut)));
      }
    }
  }
  {
    const DType dt = DType::bf16;
    const std::int64_t n = 4099;
    const Tensor x = random({n}, dt, 31), dy = random({n}, dt, 32);
    Tensor want_y = Tensor::empty({n}, dt, kCpu), want_mask = Tensor::empty({relu_mask_words(n)}, DType::i32, kCpu),
           want_dx = Tensor::empty({n}, dt, kCpu);
    relu_forward_packed(x, want_y, want_mask);
    relu_backward_packed(dy, want_mask, want_dx);
    const Tensor xd = x.copy_to(gpu), dyd = dy.copy_to(gpu);
    Tensor y = Tensor::empty({n}, dt, gpu), mask = Tensor::empty({relu_mask_words(n)}, DType::i32, gpu),
           dx = Tensor::empty({n}, dt, gpu);
    poison(y);
    poison(dx);
    fill(mask, -1.0);
    relu_forward_packed(xd, y, mask);
    relu_backward_packed(dyd, mask, dx);
    const std::string c = fmt::format("{} [{}]", dtype_name(dt), n);
    out.push_back(same_bits("relu_forward_packed y, " + c, y, want_y));
    out.push_back(same_bits("relu_forward_packed mask, " + c, mask, want_mask));
    out.push_back(same_bits("relu_backward_packed dx, " + c, dx, want_dx));
  }
  {
    // dW [COUT, CIN] = dyᵀ unpack(x): K not a multiple of the 64-deep k-block, COUT and CIN not
    // multiples of the tile, CIN not a multiple of the group.
    const std::int64_t k = 777, cout = 320, cin = 300;
    const int bits = 2, group = 64;
    const DType stats = DType::f32, dwt = DType::f32;
    const auto seed = static_cast<std::uint64_t>(k * 131 + cout * 17 + cin * 7 + bits);
    const Tensor x = random({k, cin}, DType::f32, seed, -2.f, 3.f);
    const PackedTensor xp = pack(x, {.bits = bits, .group = group, .stats_dtype = stats});
    PackedTensor xg;
    xg.words = xp.words.copy_to(gpu);
    xg.scale = xp.scale.copy_to(gpu);
    xg.min = xp.min.copy_to(gpu);
    xg.rows = xp.rows, xg.cols = xp.cols, xg.dtype = xp.dtype, xg.bits = bits, xg.group = group;
    const Tensor dy = random({k, cout}, DType::bf16, seed + 1);
    Tensor dw = Tensor::empty({cout, cin}, dwt, gpu), want = Tensor::empty({cout, cin}, DType::f32, kCpu);
    poison(dw);  // beta 0 overwrites it
    weight_grad_from_packed(dy.copy_to(gpu), xg.view(), dw, {.beta = 0.0f});
    weight_grad_from_packed(dy, xp.view(), want, {.beta = 0.0f});
    // The bound against the fp64 product: x̂ is rounded to bf16 for the tensor cores
    // (2^-9 an element), fp32 accumulation adds well under 2^-10.
    out.push_back(
        normwise(fmt::format("weight_grad_from_packed dW {}, {} bits, group {}, {} statistics, K {} COUT {} CIN {}",
                             dtype_name(dwt), bits, group, dtype_name(stats), k, cout, cin),
                 dw, want, 1e-2));
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// glu
// ---------------------------------------------------------------------------------------------

std::vector<Measure> glu_by_hand() {
  std::vector<Measure> out;
  // x = [1, 2], w = [[1, 0], [0, 1]] (left row, right row), b = [0.5, -0.5]: L = 1.5, R = 1.5. With
  // N = 1 the op's prepared layout is PyTorch's.
  const Tensor x = host({1, 2}, DType::f32, {1, 2});
  const Tensor w = host({2, 2}, DType::f32, {1, 0, 0, 1});
  const Tensor b = host({2}, DType::f32, {0.5, -0.5});
  Tensor y = Tensor::empty({1, 1}, DType::f32, kCpu);
  const Tol tol{1e-6, 0};
  glu_forward({x, w, b.view(), y}, {.kind = GluKind::swiglu});
  out.push_back(close("glu_forward swiglu = silu(1.5) 1.5, f32 [1, 2] by hand", values(y), {1.839542571435698}, tol));
  glu_forward({x, w, std::nullopt, y}, {.kind = GluKind::sigmoid_tanh});
  out.push_back(close("glu_forward sigmoid_tanh = sigmoid(1) tanh(2), f32 [1, 2] by hand", values(y),
                      {1.0 / (1.0 + std::exp(-1.0)) * std::tanh(2.0)}, tol));
  return out;
}

// glu_test.cpp's ForwardMatchesSpec and BackwardMatchesSpec: M, N and K with tails of every tile.
std::vector<Measure> glu_against_spec(Device gpu) {
  std::vector<Measure> out;
  const std::int64_t m = 130, n = 257, k = 72;
  const DType dt = DType::bf16;
  const GluOptions opt{.kind = GluKind::swiglu, .allow_tf32 = false};
  const std::string c = fmt::format("{} {} M {} N {} K {}, bias", glu_kind_name(opt.kind), dtype_name(dt), m, n, k);
  // 16-bit operands on the tensor cores with fp32 accumulation and one rounding of the output.
  const double tol = 1e-2;
  const Tensor x = random({m, k}, dt, 101, -1.f, 1.f);
  const Tensor w = random({2 * n, k}, dt, 1101, -0.5f, 0.5f);
  const Tensor b = random({2 * n}, dt, 2101, -0.5f, 0.5f);
  const Tensor dy = random({m, n}, dt, 3101, -1.f, 1.f);
  Tensor want = Tensor::empty({m, n}, dt, kCpu);
  reference::glu_forward({x, w, b.view(), want}, opt);
  const Tensor xg = x.copy_to(gpu), wg = glu_prepare_weight(w.copy_to(gpu)), bg = glu_prepare_weight(b.copy_to(gpu));
  Tensor y = Tensor::empty({m, n}, dt, gpu);
  poison(y);
  glu_forward({xg, wg, bg.view(), y}, opt);
  out.push_back(normwise("glu_forward out, " + c, y, want, tol));

  Tensor dx = Tensor::empty({m, k}, dt, kCpu), dw = Tensor::empty({2 * n, k}, dt, kCpu),
         db = Tensor::empty({2 * n}, dt, kCpu);
  reference::glu_backward({dy, x, w, b.view(), dx.view(), dw.view(), db.view()}, opt);
  const Tensor dyg = dy.copy_to(gpu);
  Tensor gdx = Tensor::empty({m, k}, dt, gpu), gdw = Tensor::empty({2 * n, k}, dt, gpu),
         gdb = Tensor::empty({2 * n}, dt, gpu);
  poison(gdx);
  poison(gdw);
  poison(gdb);
  glu_backward({dyg, xg, wg, bg.view(), gdx.view(), gdw.view(), gdb.view()}, opt);
  // dC is rounded to the operand dtype before the two GEMMs: one more rounding than the spec.
  out.push_back(normwise("glu_backward dx, " + c, gdx, dx, 2 * tol));
  out.push_back(normwise("glu_backward dw, " + c, glu_unprepare_weight(gdw), dw, 2 * tol));
  out.push_back(normwise("glu_backward dbias, " + c, glu_unprepare_weight(gdb), db, 2 * tol));
  return out;
}

// ---------------------------------------------------------------------------------------------
// qgemm
// ---------------------------------------------------------------------------------------------

std::vector<Measure> qgemm_by_hand() {
  std::vector<Measure> out;
  // Row 0 spans exactly 15 steps of 1 (-5 .. 10): s = 1, z = 5, q = w + 5, so w̃ = w. Row 1 is
  // zero: s = 0, w̃ = 0. With x = 1, y = the row sums: 2 (0 + ... + 15) - 32 5 = 80, and 0.
  std::vector<double> wv(64, 0.0);
  for (int k = 0; k < 32; ++k) wv[static_cast<std::size_t>(k)] = k % 16 - 5.0;
  const Tensor w = host({2, 32}, DType::f16, wv);
  const QuantizedWeight qw = quantize_weights(w, 32);
  out.push_back(close("dequantize_weights(quantize_weights(w)), f16 [2, 32], group 32 by hand",
                      values(dequantize_weights(qw)), wv, kExact));
  const Tensor x = host({1, 32}, DType::f16, std::vector<double>(32, 1.0));
  out.push_back(close("qgemm y = x w̃ᵀ, f16 M 1 N 2 K 32 by hand", values(qgemm(x, qw)), {80, 0}, kExact));
  return out;
}

// qgemm_test.cpp's MatchesSpecOnDequantizedWeights at M = 1 (the weight-streaming kernel) and
// M = 65 (the tiled kernel), odd N.
std::vector<Measure> qgemm_against_spec(Device gpu) {
  std::vector<Measure> out;
  struct Case {
    std::int64_t m, n, k;
    int group;
    DType dt;
  };
  for (const Case& c : {Case{1, 97, 256, 32, DType::f16}, Case{65, 129, 384, 32, DType::bf16}}) {
    const std::string what = fmt::format("{} M {} N {} K {} group {}", dtype_name(c.dt), c.m, c.n, c.k, c.group);
    const Tensor w = random({c.n, c.k}, c.dt, static_cast<std::uint64_t>(c.m * 7 + c.n * 3 + c.k));
    const QuantizedWeight qw_host = quantize_weights(w, c.group);
    const QuantizedWeight qw = qw_host.copy_to(gpu);
    const Tensor x = random({c.m, c.k}, c.dt, static_cast<std::uint64_t>(c.m + 11));
    Tensor y = Tensor::empty({c.m, c.n}, c.dt, gpu), want = Tensor::empty({c.m, c.n}, DType::f32, kCpu);
    poison(y);
    qgemm(x.copy_to(gpu), qw, y);
    reference::qgemm(x, qw_host, want);
    // fp32 accumulation in another order plus one rounding of y to the dtype: within the issue's
    // 5e-3 (bf16 rounding alone is 2^-9 = 2e-3 relative).
    out.push_back(normwise("qgemm y, " + what, y, want, 5e-3));
    // The GPU's dequantization is the spec's, value for value.
    out.push_back(close("dequantize_weights, " + what, dequantize_weights(qw), dequantize_weights(qw_host), kExact));
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// mlp
// ---------------------------------------------------------------------------------------------

// An MLP's tensors, owned, on one device.
struct Mlp {
  Tensor x;
  std::vector<Tensor> w, b;
  std::vector<Activation> act;

  std::vector<MlpLayer> layers() const {
    std::vector<MlpLayer> l;
    for (std::size_t i = 0; i < w.size(); ++i) l.push_back({w[i], b[i], act[i]});
    return l;
  }
  Mlp to(Device d) const {
    Mlp m{x.copy_to(d), {}, {}, act};
    for (std::size_t i = 0; i < w.size(); ++i) {
      m.w.push_back(w[i].copy_to(d));
      m.b.push_back(b[i].copy_to(d));
    }
    return m;
  }
};

// What the training forward saves and the backward writes (gradients of W and b in f32).
struct MlpGrads {
  Tensor hidden, y, dx;
  std::vector<Tensor> dw, db;

  MlpGrads(const Mlp& n, std::int64_t out_width, Device d) {
    const std::int64_t batch = n.x.size(0), width = n.w[0].size(0);
    const DType dt = n.x.dtype();
    hidden = Tensor::empty({static_cast<std::int64_t>(n.w.size()) - 1, batch, width}, dt, d);
    y = Tensor::empty({batch, out_width}, dt, d);
    dx = Tensor::empty(n.x.shape(), dt, d);
    for (std::size_t l = 0; l < n.w.size(); ++l) {
      dw.push_back(Tensor::empty(n.w[l].shape(), DType::f32, d));
      db.push_back(Tensor::empty(n.b[l].shape(), DType::f32, d));
    }
  }
  FusedMlpBackwardArgs backward_args(const Mlp& n, const TensorView& dy) const {
    FusedMlpBackwardArgs a{dy, n.x, hidden, y, n.layers(), dx.view(), {}, {}};
    for (std::size_t l = 0; l < dw.size(); ++l) {
      a.dweight.push_back(dw[l]);
      a.dbias.push_back(db[l]);
    }
    return a;
  }
};

std::vector<Measure> mlp_by_hand() {
  std::vector<Measure> out;
  // x = [1, 2]; layer 0 (hidden width 16, rows 2.. zero): W0 rows [1, 0], [-1, 1], b0 = [0.5, -4],
  // relu: z = [1.5, -3] -> h = [1.5, 0, ...]; layer 1: W1 = [2, 3, 0, ...], b1 = [1], identity:
  // y = 4. Backward with dy = 1: g1 = 1, dW1 = h = [1.5, 0, ...], db1 = 1; dh = W1 = [2, 3, ...],
  // g0 = dh [h > 0] = [2, 0, ...]: dW0 = g0ᵀ x = [[2, 4], 0, ...], db0 = [2, 0, ...], dx = g0 W0 = [2, 0].
  // Small numbers, exact in bf16.
  const DType dt = DType::bf16;
  auto padded = [](std::vector<double> v, std::size_t n) {
    v.resize(n, 0.0);
    return v;
  };
  Mlp n;
  n.x = host({1, 2}, dt, {1, 2});
  n.w.push_back(host({16, 2}, dt, padded({1, 0, -1, 1}, 32)));
  n.b.push_back(host({16}, dt, padded({0.5, -4}, 16)));
  n.w.push_back(host({1, 16}, dt, padded({2, 3}, 16)));
  n.b.push_back(host({1}, dt, {1}));
  n.act = {Activation::relu, Activation::identity};
  MlpGrads g(n, 1, kCpu);
  fused_mlp_forward_train({n.x, n.layers(), g.y, g.hidden});
  const std::string c = "bf16 2-16-1 by hand";
  out.push_back(close("fused_mlp_forward_train hidden, " + c, values(g.hidden), padded({1.5}, 16), kExact));
  out.push_back(close("fused_mlp_forward_train y, " + c, values(g.y), {4}, kExact));
  const Tensor dy = host({1, 1}, dt, {1});
  fused_mlp_backward(g.backward_args(n, dy));
  out.push_back(close("fused_mlp_backward dW1, " + c, values(g.dw[1]), padded({1.5}, 16), kExact));
  out.push_back(close("fused_mlp_backward db1, " + c, values(g.db[1]), {1}, kExact));
  out.push_back(close("fused_mlp_backward dW0, " + c, values(g.dw[0]), padded({2, 4}, 32), kExact));
  out.push_back(close("fused_mlp_backward db0, " + c, values(g.db[0]), padded({2}, 16), kExact));
  out.push_back(close("fused_mlp_backward dx, " + c, values(g.dx), {2, 0}, kExact));
  return out;
}

// mlp_test.cpp's MlpTrainGpu (ForwardTrainAndBackwardMatchSpec): a 64-32-32-32-16 MLP over a
// batch that is not a multiple of the 128-row CTA.
std::vector<Measure> mlp_against_spec(Device gpu) {
  std::vector<Measure> out;
  const DType dt = DType::bf16;
  const std::int64_t batch = 1000;
  const std::vector<std::int64_t> widths = {64, 32, 32, 32, 16};
  const std::string c = fmt::format("{} 64-32-32-32-16 relu, batch {}", dtype_name(dt), batch);
  const std::uint64_t first_seed = 3000 + static_cast<std::uint64_t>(batch);
  std::uint64_t seed = first_seed;
  Mlp host_net;
  host_net.x = random({batch, widths.front()}, dt, seed++, -2.f, 2.f);
  for (std::size_t l = 0; l + 1 < widths.size(); ++l) {
    // U(±1.7 / sqrt(fan_in)) keeps the activations of order 1 through the layers.
    const float s = 1.7f / std::sqrt(static_cast<float>(widths[l]));
    host_net.w.push_back(random({widths[l + 1], widths[l]}, dt, seed++, -s, s));
    host_net.b.push_back(random({widths[l + 1]}, dt, seed++, -0.5f, 0.5f));
  }
  host_net.act = {Activation::relu, Activation::relu, Activation::relu, Activation::identity};
  const Tensor dy = random({batch, widths.back()}, dt, first_seed + 100);
  MlpGrads want(host_net, widths.back(), kCpu);
  reference::fused_mlp_forward_train({host_net.x, host_net.layers(), want.y, want.hidden});
  reference::fused_mlp_backward(want.backward_args(host_net, dy));

  const Mlp dev = host_net.to(gpu);
  MlpGrads got(dev, widths.back(), gpu);
  poison(got.y);
  poison(got.hidden);
  fused_mlp_forward_train({dev.x, dev.layers(), got.y, got.hidden});
  // fp32 sums in another order than the double spec: a hidden value at a rounding boundary of the
  // dtype rounds to the neighbouring value, and that ulp travels through the remaining layers: four
  // times the one-rounding tolerance.
  const Tol one = one_rounding(dt), four{4 * one.atol, 4 * one.rtol};
  out.push_back(close("fused_mlp_forward_train y, " + c, got.y, want.y, four));
  out.push_back(close("fused_mlp_forward_train hidden, " + c, got.hidden, want.hidden, four));
  Tensor y = Tensor::empty({batch, widths.back()}, dt, gpu);
  poison(y);
  fused_mlp_forward({dev.x, dev.layers(), y});
  out.push_back(close("fused_mlp_forward y against the training forward's, " + c, y, got.y, kExact));

  // The backward from the spec's saved tensors, so that both sides see the same inputs.
  copy(got.hidden, want.hidden);
  copy(got.y, want.y);
  poison(got.dx);
  for (const Tensor& t : got.dw) poison(t);
  for (const Tensor& t : got.db) poison(t);
  const Tensor dyd = dy.copy_to(gpu);
  fused_mlp_backward(got.backward_args(dev, dyd));
  // dh summed in fp32 in another order: a g at a rounding boundary rounds to the neighbouring
  // value, carried into the layers below; 4x the dtype's one-rounding bound, normwise.
  const double bound = 4 * one.rtol;
  out.push_back(normwise("fused_mlp_backward dx, " + c, got.dx, want.dx, bound));
  for (std::size_t l = 0; l < got.dw.size(); ++l) {
    out.push_back(normwise(fmt::format("fused_mlp_backward dW{}, {}", l, c), got.dw[l], want.dw[l], bound));
    out.push_back(normwise(fmt::format("fused_mlp_backward db{}, {}", l, c), got.db[l], want.db[l], bound));
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// lora
// ---------------------------------------------------------------------------------------------

std::vector<Measure> lora_by_hand() {
  std::vector<Measure> out;
  // x = [1, 2], W = I, b = [0.5, -0.5], A = [[1, 1]] (r = 1), B = [[1], [2]], s = 0.5:
  // t = 0.5 3 = 1.5; z = [1 + 0.5 + 1.5, 2 - 0.5 + 3] = [3, 4.5]; y = sigmoid(z).
  const Tensor x = host({1, 2}, DType::f32, {1, 2});
  const Tensor w = host({2, 2}, DType::f32, {1, 0, 0, 1});
  const Tensor b = host({2}, DType::f32, {0.5, -0.5});
  const Tensor a = host({1, 2}, DType::f32, {1, 1});
  const Tensor bb = host({2, 1}, DType::f32, {1, 2});
  Tensor y = Tensor::empty({1, 2}, DType::f32, kCpu), t = Tensor::empty({1, 1}, DType::f32, kCpu),
         z = Tensor::empty({1, 2}, DType::f32, kCpu);
  lora_forward({x, w, b.view(), a, bb, y, t.view(), z.view()}, {Activation::sigmoid, 0.5f});
  const std::string c = "sigmoid, f32 M 1 N 2 K 2 r 1 by hand";
  const Tol four_ulps{0, 4 * 0x1p-23};  // the test's EXPECT_FLOAT_EQ
  out.push_back(close("lora_forward t, " + c, values(t), {1.5}, four_ulps));
  out.push_back(close("lora_forward preact, " + c, values(z), {3, 4.5}, four_ulps));
  out.push_back(close("lora_forward y, " + c, values(y), {1 / (1 + std::exp(-3.0)), 1 / (1 + std::exp(-4.5))},
                      {1e-7, 0}));
  return out;
}

// lora_test.cpp's ForwardMatchesSpec and BackwardMatchesSpec: tails of the 128 x 128 x 64 tile, a
// rank that is not a multiple of 16.
std::vector<Measure> lora_against_spec(Device gpu) {
  std::vector<Measure> out;
  const std::int64_t m = 130, n = 264, k = 72, r = 5;
  const DType dt = DType::bf16;
  const LoraParams p{Activation::sigmoid, 0.5f};
  const std::string c =
      fmt::format("{} {} M {} N {} K {} r {}, bias", activation_name(p.act), dtype_name(dt), m, n, k, r);
  // One rounding of the output plus the roundings of t (and in the backward of g and s u) to the
  // dtype, which the spec does not have.
  const double tol = 1e-2;
  const std::uint64_t seed = 110;
  const Tensor x = random({m, k}, dt, seed), w = random({n, k}, dt, seed + 1, -0.5f, 0.5f);
  const Tensor bias = random({n}, dt, seed + 2, -0.5f, 0.5f), a = random({r, k}, dt, seed + 3, -0.5f, 0.5f);
  const Tensor b = random({n, r}, dt, seed + 4, -0.5f, 0.5f), dy = random({m, n}, dt, seed + 7);
  Tensor y = Tensor::empty({m, n}, dt, kCpu), t = Tensor::empty({m, r}, dt, kCpu), z = Tensor::empty({m, n}, dt, kCpu);
  reference::lora_forward({x, w, bias.view(), a, b, y, t.view(), z.view()}, p);

  const Tensor xg = x.copy_to(gpu), wg = w.copy_to(gpu), biasg = bias.copy_to(gpu), ag = a.copy_to(gpu),
               bg = b.copy_to(gpu);
  Tensor gy = Tensor::empty({m, n}, dt, gpu), gt = Tensor::empty({m, r}, dt, gpu), gz = Tensor::empty({m, n}, dt, gpu);
  Tensor gy2 = Tensor::empty({m, n}, dt, gpu), gy3 = Tensor::empty({m, n}, dt, gpu),
         gt3 = Tensor::empty({m, r}, dt, gpu);
  for (const Tensor* o : {&gy, &gt, &gz, &gy2, &gy3, &gt3}) poison(*o);
  lora_forward({xg, wg, biasg.view(), ag, bg, gy, gt.view(), gz.view()}, p);
  lora_forward({xg, wg, biasg.view(), ag, bg, gy2, std::nullopt, std::nullopt}, p);  // the inference path
  lora_forward({xg, wg, biasg.view(), ag, bg, gy3, gt3.view(), std::nullopt}, p);    // t out of y's GEMM
  out.push_back(normwise("lora_forward y, " + c, gy, y, tol));
  out.push_back(normwise("lora_forward preact, " + c, gz, z, tol));
  out.push_back(normwise("lora_forward t, " + c, gt, t, tol));
  out.push_back(normwise("lora_forward y (no t, no preact), " + c, gy2, y, tol));
  out.push_back(normwise("lora_forward y (t, no preact), " + c, gy3, y, tol));
  out.push_back(normwise("lora_forward t (t, no preact), " + c, gt3, t, tol));

  // The backward from the spec's y (sigmoid's derivative comes from the output) and t.
  Tensor dx = Tensor::empty({m, k}, dt, kCpu), da = Tensor::empty({r, k}, dt, kCpu),
         db = Tensor::empty({n, r}, dt, kCpu), dbias = Tensor::empty({n}, dt, kCpu);
  reference::lora_backward({dy, y, SavedForBackward::output, x, w, a, b, std::nullopt, dx.view(), da, db, dbias.view()},
                           p);
  const Tensor gdy = dy.copy_to(gpu), gsaved = y.copy_to(gpu), gtt = t.copy_to(gpu);
  Tensor gdx = Tensor::empty({m, k}, dt, gpu), gda = Tensor::empty({r, k}, dt, gpu),
         gdb = Tensor::empty({n, r}, dt, gpu), gdbias = Tensor::empty({n}, dt, gpu);
  for (const Tensor* o : {&gdx, &gda, &gdb, &gdbias}) poison(*o);
  lora_backward(
      {gdy, gsaved, SavedForBackward::output, xg, wg, ag, bg, gtt.view(), gdx.view(), gda, gdb, gdbias.view()}, p);
  // g and s u are rounded to the dtype before the GEMMs that use them: two more roundings.
  out.push_back(normwise("lora_backward dx, " + c, gdx, dx, 2 * tol));
  out.push_back(normwise("lora_backward da, " + c, gda, da, 2 * tol));
  out.push_back(normwise("lora_backward db, " + c, gdb, db, 2 * tol));
  out.push_back(normwise("lora_backward dbias, " + c, gdbias, dbias, 2 * tol));
  return out;
}

// ---------------------------------------------------------------------------------------------
// The families
// ---------------------------------------------------------------------------------------------

struct Family {
  const char* name;
  std::vector<Measure> (*by_hand)();             // on the CPU
  std::vector<Measure> (*against_spec)(Device);  // on a CUDA device
};

// `gemm` and `recsys` join this list when those families land, each with a hand-worked case for
// the CPU and one short random case against its spec for a CUDA device.
const Family kFamilies[] = {
    {"pointwise", pointwise_by_hand, pointwise_against_spec},
    {"primitives", primitives_by_hand, primitives_against_spec},
    {"quant", quant_by_hand, quant_against_spec},
    {"glu", glu_by_hand, glu_against_spec},
    {"qgemm", qgemm_by_hand, qgemm_against_spec},
    {"mlp", mlp_by_hand, mlp_against_spec},
    {"lora", lora_by_hand, lora_against_spec},
};

std::string number(double v) { return v == 0 ? "0" : fmt::format("{:.1e}", v); }

// Runs one family on one device and prints its line; false when a comparison is past its bound
// or the family threw.
bool run_family(const Family& f, Device device) {
  const std::string head = fmt::format("{:<11} {:<7}", f.name, device.str());
  std::vector<Measure> ms;
  try {
#if FUSEKIT_WITH_CUDA
    // Launches, cuBLAS handles and the legacy default stream belong to the current device.
    std::optional<detail::DeviceScope> on_device;
    if (device.is_cuda()) on_device.emplace(device.index);
#endif
    ms = device.is_cpu() ? f.by_hand() : f.against_spec(device);
  } catch (const std::exception& e) {
    fmt::print("{} FAILED  error: {}\n", head, e.what());
    return false;
  }
  if (ms.empty()) {
    fmt::print("{} FAILED  no comparison made\n", head);
    return false;
  }
  std::size_t nearest = 0, failed = 0;
  for (std::size_t i = 0; i < ms.size(); ++i) {
    failed += !ms[i].ok();
    if (ms[i].nearness() > ms[nearest].nearness()) nearest = i;
  }
  const Measure& m = ms[nearest];
  fmt::print("{} {:<7} {:<8}  {:<8}  {} ({}; {})\n", head, failed ? "FAILED" : "ok", number(m.err), number(m.bound),
             m.what, m.kind,
             failed ? fmt::format("{} of {} comparisons failed", failed, ms.size())
                    : fmt::format("nearest of {} comparisons", ms.size()));
  return failed == 0;
}

}  // namespace

int run_check() {
  fmt::print("fusekit check: one case per op family and device. The CPU: hand-worked values. A CUDA device:\n"
             "the kernels on random inputs against the CPU spec, within the bounds of the GPU tests. Shown: the\n"
             "comparison nearest its bound (elementwise |got - want| <= atol + rtol |want|; normwise\n"
             "||got - want|| / ||want||; exact: elements whose bits differ).\n");
  fmt::print("{:<11} {:<7} {:<7} {:<8}  {:<8}  {}\n", "family", "device", "result", "error", "bound", "comparison");
  std::vector<Device> devices{kCpu};
  const int gpus = cuda_device_count();
  for (int i = 0; i < gpus; ++i) devices.push_back(Device::cuda(i));
  int failed = 0, run = 0;
  for (const Device& d : devices)
    for (const Family& f : kFamilies) {
      ++run;
      failed += !run_family(f, d);
    }
  if (gpus == 0) fmt::print("GPU checks skipped: {}\n", cuda_unavailable_reason());
  if (failed == 0) {
    fmt::print("check: all passed ({} families on {} device{})\n", std::size(kFamilies), devices.size(),
               devices.size() > 1 ? "s" : "");
    return 0;
  }
  fmt::print("check: FAILED ({} of {} family/device checks)\n", failed, run);
  return 1;
}

}  // namespace fk::app
