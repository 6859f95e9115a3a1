// The nn layers DLRM is built from: EmbeddingBagCollection, Interaction, BCEWithLogits, the
// ParameterArena's optimizers, and Linear's padded and unfused forms. On the CPU: hand-worked
// cases and gradients against central differences; fused and unfused give the same results; on a
// GPU, every layer against the CPU from the same initialisation.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <vector>

#include "fusekit/fusekit.hpp"
#include "fusekit/nn/linear.hpp"
#include "fusekit/nn/recsys.hpp"
#include "test_util.hpp"

namespace fk {
namespace {

const Device kCpu = Device::cpu();

double dot(const TensorView& a, const TensorView& b) {
  const std::vector<double> x = test::to_doubles(a), y = test::to_doubles(b);
  double s = 0;
  for (std::size_t i = 0; i < x.size(); ++i) s += x[i] * y[i];
  return s;
}

// Central differences of loss() in each element of the contiguous host tensor p, against g.
void expect_grad(const Tensor& p, const std::vector<double>& g, const std::function<double()>& loss,
                 const std::string& what, float h = 1e-3f) {
  float* v = p.data_as<float>();
  int bad = 0;
  for (std::int64_t i = 0; i < p.numel(); ++i) {
    const float keep = v[i];
    v[i] = keep + h;
    const double up = loss();
    v[i] = keep - h;
    const double down = loss();
    v[i] = keep;
    const double num = (up - down) / (2.0 * h);
    if (std::fabs(num - g[static_cast<std::size_t>(i)]) > 2e-3 + 1e-2 * std::fabs(num) && ++bad <= 5)
      ADD_FAILURE() << what << "[" << i << "]: analytic " << g[static_cast<std::size_t>(i)] << ", numerical " << num;
  }
  EXPECT_EQ(bad, 0) << what;
}

struct InteractionCase {
  InteractionKind kind;
  bool self;
  bool fused;
  std::int64_t expected;  // for F = 4, D = 3
};

class InteractionGrad : public ::testing::TestWithParam<InteractionCase> {};

TEST_P(InteractionGrad, MatchesFiniteDifferences) {
  const InteractionCase k = GetParam();
  const std::int64_t b = 3, f = 4, d = 3;
  nn::Interaction inter(f, d, {k.kind, k.self, k.fused}, kCpu);
  ASSERT_EQ(inter.output_size(), k.expected);
  Tensor z = test::random_tensor({b, f, d}, DType::f32, kCpu, 9);
  const Tensor w = test::random_tensor({b, k.expected}, DType::f32, kCpu, 10);
  Tensor r = Tensor::empty({b, k.expected}, DType::f32, kCpu), dz = Tensor::empty({b, f, d}, DType::f32, kCpu);
  auto loss = [&] {
    inter.forward(z, r);
    return dot(r, w);
  };
  loss();
  inter.backward(z, w, dz);
  expect_grad(z, test::to_doubles(dz), loss, "dz");
}

INSTANTIATE_TEST_SUITE_P(Kinds, InteractionGrad,
                         ::testing::Values(InteractionCase{InteractionKind::dot, false, true, 3 + 6},
                                           InteractionCase{InteractionKind::dot, false, false, 3 + 6},
                                           InteractionCase{InteractionKind::dot, true, true, 3 + 10},
                                           InteractionCase{InteractionKind::cat, false, true, 12},
                                           InteractionCase{InteractionKind::outer, false, true, 144}));

TEST(Interaction, DotHandWorked) {
  // F = 3, D = 2: Z = [x; e1; e2] = [[1, 2], [3, 4], [5, 6]] -> [x, <e1,x>, <e2,x>, <e2,e1>].
  nn::Interaction inter(3, 2, {}, kCpu);
  const Tensor z = test::host_tensor({1, 3, 2}, DType::f32, {1, 2, 3, 4, 5, 6});
  Tensor r = Tensor::empty({1, 5}, DType::f32, kCpu);
  inter.forward(z, r);
  EXPECT_EQ(test::to_floats(r), (std::vector<float>{1, 2, 11, 17, 39}));
}

// Two tables (6 and 4 rows, D = 3), batch 3, bags with repeats and an empty bag.
struct Bags {
  Tensor indices = test::host_tensor({8}, DType::i64, {1, 1, 4, 0, 2, 3, 2, 2});
  Tensor offsets = test::host_tensor({7}, DType::i64, {0, 3, 3, 4, 5, 7, 8});  // t0: [1,1,4] [] [0]; t1: [2] [3,2] [2]
  Tensor on_device_indices, on_device_offsets;  // copies on the device of the last input()
  nn::EmbeddingBagInput input(Device dev) {
    on_device_indices = indices.copy_to(dev);
    on_device_offsets = offsets.copy_to(dev);
    return {on_device_indices.view(), on_device_offsets.view(), std::nullopt};
  }
};

TEST(EmbeddingBagCollection, MultiHotForwardAndGradient) {
  for (bool fused : {true, false}) {
    const std::int64_t b = 3, d = 3;
    nn::EmbeddingBagCollection emb({6, 4}, d, {Pooling::sum, RowHash::seed, fused}, kCpu, {11, 0});
    Bags bags;
    Tensor out = Tensor::empty({b, 2, d}, DType::f32, kCpu);
    const Tensor w = test::random_tensor({b, 2, d}, DType::f32, kCpu, 12);
    auto loss = [&] {
      emb.forward(bags.input(kCpu), b, out);
      return dot(out, w);
    };
    loss();
    const std::vector<float> o = test::to_floats(out), t0 = test::to_floats(emb.tables[0]);
    for (int c = 0; c < d; ++c) {
      EXPECT_EQ(o[static_cast<std::size_t>(1 * 2 * d + c)], 0.0f);  // bag (t0, b1) is empty
      EXPECT_FLOAT_EQ(o[static_cast<std::size_t>(c)], 2 * t0[1 * d + c] + t0[4 * d + c]);
    }
    emb.backward(w);
    const Tensor g = emb.gradient();
    expect_grad(emb.weights, test::to_doubles(g), loss, fused ? "fused" : "unfused");
    // An SGD step moves exactly the touched rows by -lr g.
    const std::vector<float> before = test::to_floats(emb.weights), grad = test::to_floats(g);
    emb.step({nn::OptimizerKind::sgd, 0.5f});
    const std::vector<float> after = test::to_floats(emb.weights);
    for (std::size_t i = 0; i < before.size(); ++i) EXPECT_FLOAT_EQ(after[i], before[i] - 0.5f * grad[i]) << i;
  }
}

TEST(ParameterArena, SgdAndAdagradByHand) {
  for (bool one_launch : {true, false}) {
    nn::ParameterArena arena(nn::ParameterArena::floats_for({1}) + nn::ParameterArena::floats_for({2, 3}, 4), kCpu);
    const auto& p = arena.add({1});
    const auto& m = arena.add({2, 3}, 4);  // padded rows
    ASSERT_EQ(m.value.view().strides()[0], 4);
    copy(p.value, test::host_tensor({1}, DType::f32, {1.0f}));
    copy(p.grad, test::host_tensor({1}, DType::f32, {0.5f}));
    copy(m.grad, test::host_tensor({2, 3}, DType::f32, {1, 1, 1, 1, 1, 1}));
    arena.step({nn::OptimizerKind::sgd, 0.1f}, one_launch);
    EXPECT_FLOAT_EQ(test::to_floats(p.value)[0], 0.95f);
    copy(p.value, test::host_tensor({1}, DType::f32, {1.0f}));
    const nn::OptimizerConfig ada{nn::OptimizerKind::adagrad, 0.1f};
    arena.step(ada, one_launch);  // state 0.25, step 0.1 * 0.5 / 0.5
    EXPECT_FLOAT_EQ(test::to_floats(*arena.state(0))[0], 0.25f);
    EXPECT_FLOAT_EQ(test::to_floats(p.value)[0], 0.9f);
    arena.step(ada, one_launch);  // state 0.5, step 0.05 / sqrt(0.5)
    EXPECT_NEAR(test::to_floats(p.value)[0], 0.9f - 0.05f / std::sqrt(0.5f), 1e-6);
    // The padding column of the matrix stays zero.
    const float* raw = m.value.data_as<float>();
    EXPECT_EQ(raw[3], 0.0f);
    EXPECT_NEAR(raw[0], -0.1f - 0.1f - 0.1f / std::sqrt(2.0f), 1e-6);
  }
}

TEST(ParameterArena, FullArenaIsRefused) {
  nn::ParameterArena arena(nn::ParameterArena::floats_for({3}), kCpu);
  arena.add({3});
  test::expect_arg_error([&] { arena.add({1}); }, "nn::ParameterArena", "add");
}

// A padded layer (in_stride > in) and an unfused one compute what the plain layer computes.
TEST(Linear, PaddedAndUnfusedMatchThePlainLayer) {
  const std::int64_t b = 5, in = 7, out = 6, k = 8;
  nn::ParameterArena arena(3 * nn::Linear::arena_floats(in, out, k), kCpu);
  nn::Linear plain(in, out, {Activation::relu}, {3, 0}, arena);
  nn::Linear padded(in, out, {Activation::relu, false, true, k}, {3, 0}, arena);
  nn::Linear unfused(in, out, {Activation::relu, false, false, 0}, {3, 0}, arena);
  const Tensor x = test::random_tensor({b, in}, DType::f32, kCpu, 4);
  Tensor xp = Tensor::empty({b, k}, DType::f32, kCpu);
  fill(xp, 0.0);
  const TensorView xpv(xp.data(), DType::f32, {b, in}, {k, 1}, kCpu);
  copy(xpv, x);
  const Tensor r = test::random_tensor({b, out}, DType::f32, kCpu, 5);
  struct Result {
    std::vector<float> y, dw, db, dx;
  };
  auto run = [&](nn::Linear& l, const TensorView& xv, const TensorView& dxv) {
    Tensor y = Tensor::empty({b, out}, DType::f32, kCpu), dy = r.clone();
    l.forward(xv, y);
    l.backward(xv, y, dy, dxv);
    return Result{test::to_floats(y), test::to_floats(l.weight_grad), test::to_floats(l.bias_grad), test::to_floats(dxv)};
  };
  Tensor dx1 = Tensor::empty({b, in}, DType::f32, kCpu), dx3 = Tensor::empty({b, in}, DType::f32, kCpu);
  Tensor dxp = Tensor::empty({b, k}, DType::f32, kCpu);
  const Result a = run(plain, x, dx1);
  const Result p = run(padded, xpv, TensorView(dxp.data(), DType::f32, {b, in}, {k, 1}, kCpu));
  const Result u = run(unfused, x, dx3);
  for (const Result* o : {&p, &u}) {
    EXPECT_EQ(o->y, a.y);
    EXPECT_EQ(o->db, a.db);
    for (std::size_t i = 0; i < a.dw.size(); ++i) EXPECT_NEAR(o->dw[i], a.dw[i], 1e-5);
    for (std::size_t i = 0; i < a.dx.size(); ++i) EXPECT_NEAR(o->dx[i], a.dx[i], 1e-5);
  }
  EXPECT_EQ(padded.weight.view().strides()[0], k);
  EXPECT_EQ(test::to_floats(TensorView(dxp.data(), DType::f32, {b, k}, kCpu))[k - 1], 0.0f);  // dx's padding column
}

// An MLP run as one fused_mlp kernel (bf16) from the arena's fp32 masters tracks the fp32 MLP.
TEST(MLP, FusedKernelTracksTheFp32Layers) {
  const std::vector<std::int64_t> sizes{13, 32, 32, 8};
  ASSERT_TRUE(nn::MLP::fits_fused_kernel(sizes));
  EXPECT_FALSE(nn::MLP::fits_fused_kernel({13, 512, 16}));
  nn::ParameterArena arena(2 * nn::MLP::arena_floats(sizes), kCpu);
  nn::MLP plain(sizes, {}, {5, 0}, arena);
  nn::MLP::ArenaOptions ko;
  ko.fused_kernel = true;
  nn::MLP kernel(sizes, ko, {5, 0}, arena);
  const std::int64_t b = 9;
  const Tensor x = test::random_tensor({b, 13}, DType::f32, kCpu, 1, 0.f, 2.f);
  Tensor y1 = Tensor::empty({b, 8}, DType::f32, kCpu), y2 = Tensor::empty({b, 8}, DType::f32, kCpu);
  plain.forward(x, y1);
  kernel.forward(x, y2);
  EXPECT_LE(test::rel_err_normwise(y2, y1), 3e-2);
  EXPECT_GT(test::rel_err_normwise(y2, y1), 0.0) << "the bf16 kernel path was not taken";
  const Tensor r = test::random_tensor({b, 8}, DType::f32, kCpu, 2);
  Tensor d1 = r.clone(), d2 = r.clone(), dx1 = Tensor::empty({b, 13}, DType::f32, kCpu),
         dx2 = Tensor::empty({b, 13}, DType::f32, kCpu);
  plain.backward(y1, d1, dx1.view());
  kernel.backward(y2, d2, dx2.view());
  EXPECT_LE(test::rel_err_normwise(dx2, dx1), 1e-1);
  for (std::size_t l = 0; l < plain.layers.size(); ++l)
    EXPECT_LE(test::rel_err_normwise(kernel.layers[l].weight_grad, plain.layers[l].weight_grad), 6e-2) << l;
  test::expect_arg_error([&] { nn::MLP bad({13, 512, 16}, ko, {5, 0}, arena); }, "nn::MLP", "fused_kernel");
}

TEST(BCEWithLogits, FusedAndUnfusedAccumulateTheMeanLoss) {
  for (bool fused : {true, false}) {
    nn::BCEWithLogits bce(kCpu, fused);
    const Tensor logits = test::host_tensor({4}, DType::f32, {0.0f, 2.0f, -3.0f, 4.0f});
    const Tensor labels = test::host_tensor({4}, DType::f32, {1, 0, 0, 1});
    Tensor g = Tensor::empty({4}, DType::f32, kCpu);
    EXPECT_EQ(bce.drain(), 0.0);
    bce.forward_backward(logits, labels, g);
    bce.forward_backward(logits, labels, g);
    const double want = (std::log(2.0) + std::log1p(std::exp(2.0)) + std::log1p(std::exp(-3.0)) + std::log1p(std::exp(-4.0))) / 4;
    EXPECT_NEAR(bce.drain(), want, 1e-6);
    EXPECT_EQ(bce.drain(), 0.0);
    EXPECT_NEAR(test::to_floats(g)[0], (0.5 - 1) / 4, 1e-7);
  }
}

// ---- GPU against CPU ------------------------------------------------------------------------

TEST(RecsysLayersGpu, MatchTheCpu) {
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda();
  for (bool fused : {true, false}) {
    const std::int64_t b = 3, d = 3;
    nn::EmbeddingBagCollection ec({6, 4}, d, {Pooling::sum, RowHash::seed, fused}, kCpu, {11, 0});
    nn::EmbeddingBagCollection eg({6, 4}, d, {Pooling::sum, RowHash::seed, fused}, gpu, {11, 0});
    EXPECT_EQ(test::to_floats(eg.weights), test::to_floats(ec.weights));
    Bags bags, gbags;
    Tensor oc = Tensor::empty({b, 2, d}, DType::f32, kCpu), og = Tensor::empty({b, 2, d}, DType::f32, gpu);
    ec.forward(bags.input(kCpu), b, oc);
    eg.forward(gbags.input(gpu), b, og);
    EXPECT_LE(test::rel_err_normwise(og, oc), 1e-6);
    const Tensor w = test::random_tensor({b, 2, d}, DType::f32, kCpu, 12), wg = w.copy_to(gpu);
    ec.backward(w);
    eg.backward(wg);
    for (auto kind : {nn::OptimizerKind::sgd, nn::OptimizerKind::adagrad}) {
      ec.step({kind, 0.3f});
      eg.step({kind, 0.3f});
    }
    EXPECT_LE(test::rel_err_normwise(eg.weights, ec.weights), 1e-6) << fused;

    nn::Interaction ic(4, 3, {InteractionKind::dot, false, fused}, kCpu), ig(4, 3, {InteractionKind::dot, false, fused}, gpu);
    const Tensor z = test::random_tensor({5, 4, 3}, DType::f32, kCpu, 3), zg = z.copy_to(gpu);
    Tensor rc = Tensor::empty({5, 12}, DType::f32, kCpu), rg = Tensor::empty({5, 12}, DType::f32, gpu);
    const TensorView rcv = rc.view(), rgv = rg.view();  // I = 9 of 12 columns: the padding is zeroed
    ic.forward(z, rcv);
    ig.forward(zg, rgv);
    EXPECT_LE(test::rel_err_normwise(rg, rc), 1e-6);
    Tensor dzc = Tensor::empty({5, 4, 3}, DType::f32, kCpu), dzg = Tensor::empty({5, 4, 3}, DType::f32, gpu);
    ic.backward(z, rcv, dzc);
    ig.backward(zg, rgv, dzg);
    EXPECT_LE(test::rel_err_normwise(dzg, dzc), 1e-6);
  }
  // A padded unfused linear layer on the GPU against the CPU.
  nn::ParameterArena ac(nn::Linear::arena_floats(7, 6, 8), kCpu), ag(nn::Linear::arena_floats(7, 6, 8), gpu);
  nn::Linear lc(7, 6, {Activation::relu, false, false, 8}, {3, 0}, ac), lg(7, 6, {Activation::relu, false, false, 8}, {3, 0}, ag);
  Tensor xc = Tensor::empty({5, 8}, DType::f32, kCpu);
  fill(xc, 0.0);
  copy(TensorView(xc.data(), DType::f32, {5, 7}, {8, 1}, kCpu), test::random_tensor({5, 7}, DType::f32, kCpu, 4));
  const Tensor xg = xc.copy_to(gpu);
  Tensor yc = Tensor::empty({5, 6}, DType::f32, kCpu), yg = Tensor::empty({5, 6}, DType::f32, gpu);
  lc.forward(TensorView(xc.data(), DType::f32, {5, 7}, {8, 1}, kCpu), yc);
  lg.forward(TensorView(xg.data(), DType::f32, {5, 7}, {8, 1}, gpu), yg);
  EXPECT_LE(test::rel_err_normwise(yg, yc), 1e-6);
}

}  // namespace
}  // namespace fk
