// `fusekit check` for the families primitives and quant (apps/check_families.hpp).
#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "apps/check_families.hpp"
#include "fusekit/fusekit.hpp"

namespace fk::app::check {

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
    // The op's stated bound against the fp64 product: x̂ is rounded to bf16 for the tensor cores
    // (2^-9 an element), fp32 accumulation adds well under 2^-10.
    out.push_back(
        normwise(fmt::format("weight_grad_from_packed dW {}, {} bits, group {}, {} statistics, K {} COUT {} CIN {}",
                             dtype_name(dwt), bits, group, dtype_name(stats), k, cout, cin),
                 dw, want, 1e-2));
  }
  return out;
}

}  // namespace fk::app::check
