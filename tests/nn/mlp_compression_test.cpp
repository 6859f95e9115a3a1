// nn::MLP with activation compression (ArenaOptions::compress): the gradients against the
// uncompressed MLP's within the quantization bound, training that still learns at 2 and 4 bits,
// reproducibility from the seed, the bytes kept, bad options; and the GPU against the CPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "fusekit/fusekit.hpp"
#include "fusekit/nn/linear.hpp"
#include "fusekit/nn/parameters.hpp"
#include "test_util.hpp"

namespace fk::nn {
namespace {

const Device kCpu = Device::cpu();

PackParams compression(int bits, int group = 32, std::uint64_t seed = 1) {
  return {.bits = bits, .group = group, .rounding = Rounding::stochastic, .seed = seed};
}

MLP::ArenaOptions options(std::int64_t pad_to, std::optional<PackParams> compress) {
  MLP::ArenaOptions o;
  o.act = Activation::relu;
  o.act_last = false;
  o.pad_to = pad_to;
  o.compress = compress;
  return o;
}

// x [b, in] with row stride `ld` (zero padding columns), as a model hands it to its first layer.
Tensor padded_input(std::int64_t b, std::int64_t in, std::int64_t ld, Device dev, std::uint64_t seed) {
  Tensor x = Tensor::empty({b, ld}, DType::f32, kCpu);
  fill(x, 0.0);
  copy(TensorView(x.data(), DType::f32, {b, in}, {ld, 1}, kCpu),
       test::random_tensor({b, in}, DType::f32, kCpu, seed, -2, 2));
  return x.copy_to(dev);
}

TensorView rows_of(const Tensor& x, std::int64_t in) {
  return TensorView(x.data(), DType::f32, {x.size(0), in}, {x.size(1), 1}, x.device());
}

// What an uncompressed MLP computes, layer by layer: each layer's input [b, k] (padding zero)
// and its dz, from which the bound on the compressed dW follows.
struct Reference {
  std::vector<Tensor> inputs, dz;
  std::vector<std::vector<double>> dw, db;
  std::vector<double> y, dx;
};

Reference run_uncompressed(MLP& mlp, const Tensor& x, const Tensor& r) {
  const std::size_t n = mlp.layers.size();
  const std::int64_t b = x.size(0);
  Reference ref;
  ref.inputs.push_back(x.clone());
  std::vector<Tensor> outs;
  for (std::size_t l = 0; l < n; ++l) {
    Linear& z = mlp.layers[l];
    const std::int64_t ld = l + 1 < n ? mlp.layers[l + 1].k() : z.out();
    Tensor out = Tensor::empty({b, ld}, DType::f32, kCpu);
    fill(out, 0.0);
    z.forward(rows_of(ref.inputs[l], z.in()), rows_of(out, z.out()));
    outs.push_back(out.clone());
    if (l + 1 < n) ref.inputs.push_back(std::move(out));
  }
  ref.y = test::to_doubles(outs.back());
  ref.dz.resize(n);
  ref.dw.resize(n);
  ref.db.resize(n);
  Tensor g = r.clone();
  for (std::size_t i = n; i-- > 0;) {
    Linear& z = mlp.layers[i];
    Tensor gin = Tensor::empty({b, z.k()}, DType::f32, kCpu);
    z.backward(rows_of(ref.inputs[i], z.in()), rows_of(outs[i], z.out()), rows_of(g, z.out()), rows_of(gin, z.in()));
    ref.dz[i] = std::move(g);
    ref.dw[i] = test::to_doubles(z.weight_grad);
    ref.db[i] = test::to_doubles(z.bias_grad);
    g = std::move(gin);
  }
  ref.dx = test::to_doubles(rows_of(g, mlp.layers[0].in()));
  return ref;
}

// Stochastic rounding keeps every value within one step `scale` of its level; a group's scale is
// at most its range / (2^bits - 1), raised by the bf16 rounding of the statistics (min rounded
// down: at most 2^-8 |min| more range; scale rounded, then raised one bf16 step at a time: at most
// 2^-7 more). A group lies within its row, so the row's range (padding zeros included) bounds it.
double step_bound(const Tensor& x, std::int64_t row, int bits) {
  const auto v = test::to_doubles(TensorView(x.data_as<float>() + row * x.size(1), DType::f32, {x.size(1)}, kCpu));
  const double lo = *std::min_element(v.begin(), v.end()), hi = *std::max_element(v.begin(), v.end());
  return ((hi - lo) + std::fabs(lo) * 0x1p-8) / ((1 << bits) - 1) * (1 + 0x1p-6);
}

// dW = dzᵀ x̂ against dzᵀ x: |ΔdW[o, c]| <= Σ_b |dz[b, o]| step(b), plus float rounding (the
// sums are in double, each result rounded once to f32). Returns Σ ΔdW² and Σ dW².
std::pair<double, double> check_weight_grad(const Linear& z, const std::vector<double>& want, const Tensor& input,
                                            const Tensor& dz, int bits, const std::string& what) {
  const std::vector<double> got = test::to_doubles(z.weight_grad);
  const std::int64_t b = input.size(0), out = z.out(), in = z.in(), ld_x = input.size(1), ld_dz = dz.size(1);
  std::vector<double> step(static_cast<std::size_t>(b));
  for (std::int64_t r = 0; r < b; ++r) step[static_cast<std::size_t>(r)] = step_bound(input, r, bits);
  const std::vector<double> g = test::to_doubles(dz), xs = test::to_doubles(input);
  std::pair<double, double> sums{0, 0};
  for (std::int64_t o = 0; o < out; ++o)
    for (std::int64_t c = 0; c < in; ++c) {
      double bound = 0, mag = 0;
      for (std::int64_t r = 0; r < b; ++r) {
        const double gz = std::fabs(g[static_cast<std::size_t>(r * ld_dz + o)]);
        bound += gz * step[static_cast<std::size_t>(r)];
        mag += gz * std::fabs(xs[static_cast<std::size_t>(r * ld_x + c)]);
      }
      const std::size_t i = static_cast<std::size_t>(o * in + c);
      const double err = std::fabs(got[i] - want[i]);
      EXPECT_LE(err, bound + 1e-6 * (mag + bound)) << what << " dW[" << o << ", " << c << "]";
      sums.first += err * err;
      sums.second += want[i] * want[i];
    }
  return sums;
}

// MLP::backward's layer_done: called for each layer from the last to the first, and a layer's
// gradients are final when it is called (a data-parallel caller all-reduces them from then on):
// what they hold at the call is what they hold after the backward. Plain and compressed.
TEST(MLPCompression, LayerDoneComesLastLayerFirstWithFinalGradients) {
  const std::vector<std::int64_t> sizes{13, 48, 30, 8};
  const std::int64_t b = 37, pad = 4;
  ParameterArena arena(2 * MLP::arena_floats(sizes, pad), kCpu);
  for (const bool compressed : {false, true}) {
    MLP mlp(sizes, options(pad, compressed ? std::optional<PackParams>(compression(4)) : std::nullopt), {5, 0}, arena);
    const Tensor x = padded_input(b, 13, 16, kCpu, 3);
    Tensor y = Tensor::empty({b, 8}, DType::f32, kCpu), dy = test::random_tensor({b, 8}, DType::f32, kCpu, 4);
    mlp.forward(rows_of(x, 13), y);
    std::vector<std::size_t> order;
    std::vector<std::vector<double>> at_call(mlp.layers.size());
    mlp.backward(y, dy, std::nullopt, nullptr, [&](std::size_t l) {
      order.push_back(l);
      at_call[l] = test::to_doubles(mlp.layers[l].weight_grad);
      const std::vector<double> db = test::to_doubles(mlp.layers[l].bias_grad);
      at_call[l].insert(at_call[l].end(), db.begin(), db.end());
    });
    EXPECT_EQ(order, (std::vector<std::size_t>{2, 1, 0})) << (compressed ? "compressed" : "plain");
    for (std::size_t l = 0; l < mlp.layers.size(); ++l) {
      std::vector<double> after = test::to_doubles(mlp.layers[l].weight_grad);
      const std::vector<double> db = test::to_doubles(mlp.layers[l].bias_grad);
      after.insert(after.end(), db.begin(), db.end());
      EXPECT_EQ(at_call[l], after) << (compressed ? "compressed" : "plain") << ", layer " << l;
    }
  }
}

// Three layers, the first padded (13 -> k 16) and a hidden width with padding (30 -> k 32): the
// forward, db and dx are those of the uncompressed MLP (compression touches only what dW reads),
// and dW is within the quantization bound of the uncompressed dW; fewer bits, larger errors.
TEST(MLPCompression, GradientsWithinTheQuantizationBoundOfTheUncompressedMlp) {
  const std::vector<std::int64_t> sizes{13, 48, 30, 8};
  const std::int64_t b = 37, pad = 4;
  ParameterArena arena(4 * MLP::arena_floats(sizes, pad), kCpu);
  MLP plain(sizes, options(pad, std::nullopt), {5, 0}, arena);
  const Tensor x = padded_input(b, 13, 16, kCpu, 3);
  const Tensor r = test::random_tensor({b, 8}, DType::f32, kCpu, 4);
  const Reference ref = run_uncompressed(plain, x, r);
  double previous = 0;
  for (int bits : {8, 4, 2}) {
    MLP packed(sizes, options(pad, compression(bits)), {5, 0}, arena);
    Tensor y = Tensor::empty({b, 8}, DType::f32, kCpu), dy = r.clone(), dx = Tensor::empty({b, 16}, DType::f32, kCpu);
    fill(dx, 0.0);
    packed.forward(rows_of(x, 13), y);
    EXPECT_EQ(test::to_doubles(y), ref.y) << bits << " bits: the forward itself is not compressed";
    packed.backward(y, dy, rows_of(dx, 13));
    const std::vector<double> dxv = test::to_doubles(rows_of(dx, 13));
    for (std::size_t i = 0; i < dxv.size(); ++i) EXPECT_NEAR(dxv[i], ref.dx[i], 1e-6 * (1 + std::fabs(ref.dx[i]))) << i;
    double err2 = 0, ref2 = 0;
    for (std::size_t l = 0; l < packed.layers.size(); ++l) {
      const Linear& z = packed.layers[l];
      const std::string what = std::to_string(bits) + " bits, layer " + std::to_string(l);
      const std::vector<double> db = test::to_doubles(z.bias_grad);
      for (std::size_t i = 0; i < db.size(); ++i)
        EXPECT_NEAR(db[i], ref.db[l][i], 1e-6 * (1 + std::fabs(ref.db[l][i]))) << what;
      const auto [e, w] = check_weight_grad(z, ref.dw[l], ref.inputs[l], ref.dz[l], bits, what);
      err2 += e;
      ref2 += w;
    }
    const double rel = std::sqrt(err2 / ref2);
    std::printf("MLP 13-48-30-8, %d bits: dW normwise deviation from the uncompressed %.2e\n", bits, rel);
    // The padding columns of the first layer's dW stay zero (the optimizer leaves them zero).
    const std::vector<double> full = test::to_doubles(
        TensorView(packed.layers[0].weight_grad.data(), DType::f32, {48, 16}, kCpu));
    for (std::int64_t o = 0; o < 48; ++o)
      for (std::int64_t c = 13; c < 16; ++c) EXPECT_EQ(full[static_cast<std::size_t>(o * 16 + c)], 0.0) << o << " " << c;
    EXPECT_GT(rel, previous) << bits << " bits: dW no further from the uncompressed one than with more bits";
    previous = rel;
    EXPECT_EQ(packed.rounding_step(), 1u);
  }
}

// Full-batch SGD on the squared error to a fixed nonlinear target: at 4 and 2 bits the loss falls
// as it does uncompressed.
TEST(MLPCompression, SgdStillLowersTheLossAtFourAndTwoBits) {
  const std::vector<std::int64_t> sizes{16, 64, 32, 1};
  const std::int64_t b = 256;
  const Tensor x = test::random_tensor({b, 16}, DType::f32, kCpu, 7, -1, 1);
  const auto xs = test::to_doubles(x);
  std::vector<float> target(static_cast<std::size_t>(b));
  for (std::int64_t i = 0; i < b; ++i) {
    double s = 0;
    for (std::int64_t j = 0; j < 16; ++j) s += xs[static_cast<std::size_t>(i * 16 + j)] * (j % 3 ? 0.7 : -1.1);
    target[static_cast<std::size_t>(i)] = static_cast<float>(std::sin(s));
  }
  for (int bits : {0, 4, 2}) {
    ParameterArena arena(MLP::arena_floats(sizes), kCpu);
    MLP mlp(sizes, options(1, bits ? std::optional(compression(bits)) : std::nullopt), {2, 0}, arena);
    Tensor y = Tensor::empty({b, 1}, DType::f32, kCpu), dy = Tensor::empty({b, 1}, DType::f32, kCpu);
    std::vector<double> losses;
    for (int step = 0; step < 150; ++step) {
      mlp.forward(x, y);
      double loss = 0;
      for (std::int64_t i = 0; i < b; ++i) {
        const float e = y.data_as<float>()[i] - target[static_cast<std::size_t>(i)];
        loss += static_cast<double>(e) * e / b;
        dy.data_as<float>()[i] = 2 * e / static_cast<float>(b);
      }
      losses.push_back(loss);
      mlp.backward(y, dy, std::nullopt);
      arena.step({OptimizerKind::sgd, 0.1f}, true);
    }
    std::printf("MLP %d bits: loss %.4f -> %.4f\n", bits, losses.front(), losses.back());
    EXPECT_LT(losses.back(), 0.5 * losses.front()) << bits << " bits";
  }
}

// Same seed, same steps: identical parameters (the draws come from (seed, offset + step)); another
// seed draws other roundings; and a run resumed at step k with set_rounding_step(k) continues the
// draws of the unbroken run.
TEST(MLPCompression, ReproducibleFromTheSeedAndResumable) {
  const std::vector<std::int64_t> sizes{10, 40, 24, 3};
  const std::int64_t b = 50;
  const Tensor r = test::random_tensor({b, 3}, DType::f32, kCpu, 9);
  auto train = [&](ParameterArena& arena, MLP& mlp, int from, int to) {
    for (int step = from; step < to; ++step) {
      const Tensor x = test::random_tensor({b, 10}, DType::f32, kCpu, 100 + static_cast<std::uint64_t>(step));
      Tensor y = Tensor::empty({b, 3}, DType::f32, kCpu), dy = r.clone();
      mlp.forward(x, y);
      mlp.backward(y, dy, std::nullopt);
      arena.step({OptimizerKind::sgd, 0.05f}, true);
    }
  };
  auto params = [](const MLP& mlp) {
    std::vector<float> v;
    for (const Linear& z : mlp.layers)
      for (const Tensor* t : {&z.weight, &z.bias}) {
        const std::vector<float> f = test::to_floats(*t);
        v.insert(v.end(), f.begin(), f.end());
      }
    return v;
  };
  ParameterArena a1(MLP::arena_floats(sizes), kCpu), a2(MLP::arena_floats(sizes), kCpu), a3(MLP::arena_floats(sizes), kCpu),
      a4(MLP::arena_floats(sizes), kCpu);
  MLP m1(sizes, options(1, compression(2, 32, 11)), {1, 0}, a1), m2(sizes, options(1, compression(2, 32, 11)), {1, 0}, a2),
      m3(sizes, options(1, compression(2, 32, 12)), {1, 0}, a3), m4(sizes, options(1, compression(2, 32, 11)), {1, 0}, a4);
  train(a1, m1, 0, 6);
  train(a2, m2, 0, 6);
  train(a3, m3, 0, 6);
  EXPECT_EQ(params(m1), params(m2));
  EXPECT_NE(params(m1), params(m3)) << "another seed drew the same roundings";
  EXPECT_EQ(m1.rounding_step(), 6u);
  // Resume: m4 takes m1's parameters after 3 steps and the step counter; then 3 more steps each.
  ParameterArena a5(MLP::arena_floats(sizes), kCpu);
  MLP m5(sizes, options(1, compression(2, 32, 11)), {1, 0}, a5);
  train(a5, m5, 0, 3);
  for (std::size_t l = 0; l < m5.layers.size(); ++l) {
    copy(m4.layers[l].weight, m5.layers[l].weight);
    copy(m4.layers[l].bias, m5.layers[l].bias);
  }
  m4.set_rounding_step(m5.rounding_step());
  train(a4, m4, 3, 6);
  EXPECT_EQ(params(m4), params(m1));
}

// At widths that are whole groups, the packed inputs take bits/32 of the f32 ones, plus 4 bytes
// of bf16 statistics a group, plus the hidden ReLUs' masks at one bit.
TEST(MLPCompression, SavedBytesAreBitsOverThirtyTwoPlusStatistics) {
  const std::vector<std::int64_t> sizes{64, 256, 128, 32};
  const std::int64_t b = 1000;
  for (int bits : {8, 4, 2}) {
    ParameterArena arena(2 * MLP::arena_floats(sizes), kCpu);
    MLP plain(sizes, options(1, std::nullopt), {1, 0}, arena);
    MLP packed(sizes, options(1, compression(bits, 256)), {1, 0}, arena);
    const MLP::SavedActivationBytes u = plain.saved_activation_bytes(b), c = packed.saved_activation_bytes(b);
    const std::size_t whole = b * (64 + 256 + 128) * 4;
    EXPECT_EQ(u.whole, whole);
    EXPECT_EQ(u.kept, whole);
    EXPECT_EQ(u.scratch, b * (256 + 128) * 4);  // the hidden gradients
    EXPECT_EQ(c.whole, whole);
    const std::size_t words = whole * bits / 32, stats = b * 3 * 4, masks = b * (256 + 128) / 8;
    EXPECT_EQ(c.kept, words + stats + masks) << bits << " bits";
    const double ratio = static_cast<double>(c.kept) / static_cast<double>(c.whole);
    EXPECT_GE(ratio, bits / 32.0);
    EXPECT_LE(ratio, (bits + 1) / 32.0 + 1 / 64.0) << bits << " bits";  // masks: a bit a value at most; stats: 4 bytes a 64
    // Two f32 buffers, one for the even layers' outputs (256 wide), one for the odd ones' (128),
    // and dz as weight_grad_from_packed reads it (f32 on the CPU, [b, widest out]).
    EXPECT_EQ(c.scratch, b * (256 + 128) * 4 + b * 256 * 4);
    std::printf("MLP 64-256-128-32, batch %lld, %d bits: %zu of %zu bytes kept (%.3f)\n", static_cast<long long>(b),
                bits, c.kept, c.whole, ratio);
  }
  // A 368-wide input (the Kaggle interaction, padded): 3 groups of 128, 384 values a row, rather
  // than 2 of 256 (512 values); a 16-wide one: 1 group of 32.
  ParameterArena arena(MLP::arena_floats({368, 8}) + MLP::arena_floats({16, 8}), kCpu);
  EXPECT_EQ(MLP({368, 8}, options(1, compression(2, 256)), {1, 0}, arena).saved_activation_bytes(b).kept,
            b * (384 * 2 / 8 + 3 * 4));
  EXPECT_EQ(MLP({16, 8}, options(1, compression(8, 256)), {1, 0}, arena).saved_activation_bytes(b).kept, b * (32 + 4));
}

// Two compressed MLPs run one after the other (as a model's bottom and top MLPs) share one scratch
// sized for both, and compute what they compute apart.
TEST(MLPCompression, MlpsRunInTurnShareOneScratch) {
  const std::vector<std::int64_t> s1{13, 64, 16}, s2{16, 40, 24, 1};
  const std::int64_t b = 33;
  ParameterArena arena(3 * MLP::arena_floats(s1, 4) + 2 * MLP::arena_floats(s2, 4), kCpu);
  MLP a1(s1, options(4, compression(4)), {1, 0}, arena), a2(s2, options(4, compression(4)), {2, 0}, arena);
  MLP b1(s1, options(4, compression(4)), {1, 0}, arena), b2(s2, options(4, compression(4)), {2, 0}, arena);
  b1.share_scratch(b2);
  // Alone: a1 64 wide (even), a2 40 (even) and 24 (odd); dz 64 and 40 wide; a1's first layer is
  // padded (13 -> 16): its dW goes through a [64, 16] scratch. Shared: the largest of each.
  EXPECT_EQ(a1.saved_activation_bytes(b).scratch, b * (64 + 1) * 4 + b * 64 * 4 + 64 * 16 * 4);
  EXPECT_EQ(a2.saved_activation_bytes(b).scratch, b * (40 + 24) * 4 + b * 40 * 4);
  EXPECT_EQ(b1.saved_activation_bytes(b).scratch, b * (64 + 24) * 4 + b * 64 * 4 + 64 * 16 * 4);
  EXPECT_EQ(b2.saved_activation_bytes(b).scratch, b1.saved_activation_bytes(b).scratch);
  const Tensor x = padded_input(b, 13, 16, kCpu, 1);
  auto run = [&](MLP& m1, MLP& m2) {
    Tensor h = Tensor::empty({b, 16}, DType::f32, kCpu), y = Tensor::empty({b, 1}, DType::f32, kCpu);
    Tensor dy = test::random_tensor({b, 1}, DType::f32, kCpu, 2), dh = Tensor::empty({b, 16}, DType::f32, kCpu);
    m1.forward(rows_of(x, 13), h);
    m2.forward(h, y);
    m2.backward(y, dy, dh.view());
    m1.backward(h, dh, std::nullopt);
    std::vector<float> g;
    for (MLP* m : {&m1, &m2})
      for (const Linear& z : m->layers) {
        const std::vector<float> w = test::to_floats(z.weight_grad);
        g.insert(g.end(), w.begin(), w.end());
      }
    return g;
  };
  EXPECT_EQ(run(b1, b2), run(a1, a2));
  MLP plain(s1, options(4, std::nullopt), {1, 0}, arena);
  test::expect_arg_error([&] { b1.share_scratch(plain); }, "nn::MLP::share_scratch", "other");
}

TEST(MLPCompression, BadOptionsNameTheOption) {
  using test::expect_arg_error;
  const std::vector<std::int64_t> sizes{13, 32, 32, 8};
  ParameterArena arena(8 * MLP::arena_floats(sizes), kCpu);
  for (int bits : {1, 3, 16})
    expect_arg_error([&] { MLP m(sizes, options(1, compression(bits)), {1, 0}, arena); }, "nn::MLP", "compress.bits");
  expect_arg_error([&] { MLP m(sizes, options(1, compression(8, 48)), {1, 0}, arena); }, "nn::MLP", "compress.group");
  MLP::ArenaOptions gelu = options(1, compression(8));
  gelu.act = Activation::gelu_tanh;
  expect_arg_error([&] { MLP m(sizes, gelu, {1, 0}, arena); }, "nn::MLP", "compress");
  MLP::ArenaOptions kernel = options(1, compression(8));
  kernel.fused_kernel = true;
  expect_arg_error([&] { MLP m(sizes, kernel, {1, 0}, arena); }, "nn::MLP", "compress");
  // The first layer's x is packed whole: its rows must be the layer's padded width apart.
  MLP m(sizes, options(4, compression(8)), {1, 0}, arena);
  const Tensor wide = padded_input(5, 13, 20, kCpu, 1);
  Tensor y = Tensor::empty({5, 8}, DType::f32, kCpu);
  expect_arg_error([&] { m.forward(rows_of(wide, 13), y); }, "nn::MLP::forward", "x");
  Tensor dy = Tensor::empty({5, 8}, DType::f32, kCpu);
  MLP fresh(sizes, options(1, compression(8)), {1, 0}, arena);
  expect_arg_error([&] { fresh.backward(y, dy, std::nullopt); }, "nn::MLP::backward", "this");
}

// The GPU MLP (bf16 dz into weight_grad_from_packed, x̂ rounded to bf16 by its tensor cores)
// against the CPU MLP from the same initialisation and the same rounding seed.
TEST(MLPCompression, GpuMatchesCpu) {
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  const std::vector<std::int64_t> sizes{13, 512, 256, 64, 16};
  const std::int64_t b = 1000;
  for (int bits : {8, 4, 2}) {
    ParameterArena ac(MLP::arena_floats(sizes, 4), kCpu), ag(MLP::arena_floats(sizes, 4), gpu);
    MLP cpu(sizes, options(4, compression(bits, 256)), {3, 0}, ac);
    MLP dev(sizes, options(4, compression(bits, 256)), {3, 0}, ag);
    const Tensor xh = padded_input(b, 13, 16, kCpu, 5), xd = xh.copy_to(gpu);
    const Tensor r = test::random_tensor({b, 16}, DType::f32, kCpu, 6);
    Tensor yc = Tensor::empty({b, 16}, DType::f32, kCpu), yg = Tensor::empty({b, 16}, DType::f32, gpu);
    Tensor dyc = r.clone(), dyg = r.copy_to(gpu);
    Tensor dxc = Tensor::empty({b, 16}, DType::f32, kCpu), dxg = Tensor::empty({b, 16}, DType::f32, gpu);
    cpu.forward(rows_of(xh, 13), yc);
    dev.forward(rows_of(xd, 13), yg);
    EXPECT_LE(test::rel_err_normwise(yg, yc), 1e-5) << bits;
    cpu.backward(yc, dyc, rows_of(dxc, 13));
    dev.backward(yg, dyg, rows_of(dxg, 13));
    EXPECT_LE(test::rel_err_normwise(rows_of(dxg, 13), rows_of(dxc, 13)), 1e-5) << bits;
    // dW: the GPU rounds dz and x̂ to bf16 (2^-9 each), and its hidden activations differ from
    // the CPU's in the last bits, which can move a value across a level at the rounding.
    for (std::size_t l = 0; l < cpu.layers.size(); ++l) {
      EXPECT_LE(test::rel_err_normwise(dev.layers[l].weight_grad, cpu.layers[l].weight_grad), 1e-2) << bits << " " << l;
      EXPECT_LE(test::rel_err_normwise(dev.layers[l].bias_grad, cpu.layers[l].bias_grad), 1e-5) << bits << " " << l;
    }
    EXPECT_EQ(dev.rounding_step(), 1u);
  }
}

}  // namespace
}  // namespace fk::nn
