// `fusekit check` for the GEMM-shaped families: gemm, glu, qgemm, mlp, lora (apps/check_families.hpp).
#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "apps/check_families.hpp"
#include "fusekit/fusekit.hpp"

namespace fk::app::check {

// ---------------------------------------------------------------------------------------------
// gemm
// ---------------------------------------------------------------------------------------------

// gemm_test.cpp's GemmSpec cases: small integers, exact in every dtype.
std::vector<Measure> gemm_by_hand() {
  std::vector<Measure> out;
  // a [2, 3] b [3, 2]: a b = [[4, 5], [10, 11]]; with bias [1, -20] and ReLU: [[5, 0], [11, 0]].
  for (DType dt : {DType::f32, DType::bf16}) {
    const Tensor a = host({2, 3}, dt, {1, 2, 3, 4, 5, 6}), b = host({3, 2}, dt, {1, 0, 0, 1, 1, 1});
    Tensor c = Tensor::empty({2, 2}, dt, kCpu);
    poison(c);
    gemm({a, b, c});
    out.push_back(close(fmt::format("gemm c = a b, {} M 2 N 2 K 3 by hand", dtype_name(dt)), values(c), {4, 5, 10, 11},
                        kExact));
    const Tensor bias = host({2}, dt, {1, -20});
    gemm({a, b, c, bias.view()}, {.epilogue = GemmEpilogue::relu_bias});
    out.push_back(close(fmt::format("gemm relu_bias, {} M 2 N 2 K 3 by hand", dtype_name(dt)), values(c), {5, 0, 11, 0},
                        kExact));
  }
  // bgrad_a: dW = dyᵀ x with x a column of ones: dW = the column sums of dy = the bias gradient.
  const Tensor dy = host({3, 2}, DType::f32, {1, 2, 3, 4, 5, 6}), x = host({3, 1}, DType::f32, {1, 1, 1});
  Tensor dw = Tensor::empty({2, 1}, DType::f32, kCpu), db = Tensor::empty({2}, DType::f32, kCpu);
  poison(db);
  gemm({dy, x, dw, std::nullopt, std::nullopt, db.view()}, {.trans_a = Trans::t, .epilogue = GemmEpilogue::bgrad_a});
  out.push_back(close("gemm bgrad_a dw = dyᵀ x, f32 by hand", values(dw), {9, 12}, kExact));
  out.push_back(close("gemm bgrad_a bias_grad = column sums of dy, f32 by hand", values(db), {9, 12}, kExact));
  return out;
}

// gemm_test.cpp's EveryEpilogueDtypeAndTransposeMatchesSpec at two odd shapes: bf16 operands with
// an f32 output (the CPU runs the spec) and f32 with the weight gradient's bias-gradient epilogue.
std::vector<Measure> gemm_against_spec(Device gpu) {
  std::vector<Measure> out;
  {
    const std::int64_t m = 130, n = 257, k = 72;
    const std::string c = fmt::format("bf16->f32 relu_bias ta n tb t M {} N {} K {}", m, n, k);
    const Tensor a = random({m, k}, DType::bf16, 401), b = random({n, k}, DType::bf16, 402);
    const Tensor bias = random({n}, DType::f32, 403);
    const GemmParams p{.trans_b = Trans::t, .epilogue = GemmEpilogue::relu_bias};
    Tensor want = Tensor::empty({m, n}, DType::f32, kCpu), got = Tensor::empty({m, n}, DType::f32, gpu);
    gemm({a, b, want, bias.view()}, p);
    const Tensor biasg = bias.copy_to(gpu);
    poison(got);
    gemm({a.copy_to(gpu), b.copy_to(gpu), got, biasg.view()}, p);
    // fp32 accumulation of exact bf16 products in another order: the f32 output's 1e-5.
    out.push_back(normwise("gemm c, " + c, got, want, 1e-5));
  }
  {
    const std::int64_t m = 65, n = 33, k = 257;
    const std::string c = fmt::format("f32 bgrad_a ta t tb n M {} N {} K {}", m, n, k);
    const Tensor dy = random({k, m}, DType::f32, 404), x = random({k, n}, DType::f32, 405);
    const GemmParams p{.trans_a = Trans::t, .epilogue = GemmEpilogue::bgrad_a};
    Tensor dw = Tensor::empty({m, n}, DType::f32, kCpu), db = Tensor::empty({m}, DType::f32, kCpu);
    gemm({dy, x, dw, std::nullopt, std::nullopt, db.view()}, p);
    Tensor gdw = Tensor::empty({m, n}, DType::f32, gpu), gdb = Tensor::empty({m}, DType::f32, gpu);
    poison(gdw);
    poison(gdb);
    gemm({dy.copy_to(gpu), x.copy_to(gpu), gdw, std::nullopt, std::nullopt, gdb.view()}, p);
    // fp32 accumulation in another order: the f32 bound of the GPU tests.
    out.push_back(normwise("gemm dw, " + c, gdw, dw, 1e-5));
    out.push_back(normwise("gemm bias_grad, " + c, gdb, db, 1e-5));
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
    // fp32 accumulation in another order plus one rounding of y to the dtype: within the
    // family's 5e-3 bound (bf16 rounding alone is 2^-9 = 2e-3 relative).
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

}  // namespace fk::app::check
