// The two CUDA implementations of DLRM against the CPU model (the spec): forward logits, MLP
// gradients, parameters and tables after optimizer steps (SGD and Adagrad), for the dot, cat and
// outer interactions, one-hot raw input with the hash fused in and multi-hot CSR input, odd batch
// sizes, and tables so small that one row collects thousands of gradients (the fused sparse
// backward's cross-chunk path). Also: the CUDA-graph step equals the eager one bit for bit, the
// fused step is deterministic, checkpoints move between GPU and CPU, and bad input raises.
#include <algorithm>
#include <gtest/gtest.h>

#include <cmath>
#include <sstream>
#include <vector>

#include "fusekit/core/error.hpp"
#include "fusekit/core/philox.hpp"
#include "fusekit/models/dlrm.hpp"
#include "test_util.hpp"

namespace fk::models {
namespace {

struct HostBatch {
  std::int64_t b = 0;
  Tensor dense, indices, offsets, raw, labels;
  DlrmInput input(bool with_raw) const {
    return {dense, indices, offsets, with_raw ? raw.view() : TensorView()};
  }
};

std::uint32_t bits(std::uint64_t seed, std::uint64_t i) { return philox::random_block(seed, 11, i).v[0]; }
float unit(std::uint64_t seed, std::uint64_t i) { return philox::to_unit_float(philox::random_block(seed, 12, i).v[1]); }

// One-hot bags (raw values hashed with `hash`) unless multi_hot, then 0..3 indices per bag.
HostBatch make_batch(const DlrmConfig& c, std::int64_t b, std::uint64_t seed, bool multi_hot) {
  HostBatch h;
  h.b = b;
  const std::int64_t t = static_cast<std::int64_t>(c.table_rows.size());
  h.dense = Tensor::empty({b, c.bottom_mlp.front()}, DType::f32, Device::cpu());
  for (std::int64_t i = 0; i < h.dense.numel(); ++i) h.dense.data_as<float>()[i] = 3.0f * unit(seed, static_cast<std::uint64_t>(i));
  h.labels = Tensor::empty({b}, DType::f32, Device::cpu());
  for (std::int64_t i = 0; i < b; ++i) h.labels.data_as<float>()[i] = unit(seed + 1, static_cast<std::uint64_t>(i)) < 0.3f ? 1.f : 0.f;
  h.raw = Tensor::empty({t * b}, DType::i32, Device::cpu());
  h.offsets = Tensor::empty({t * b + 1}, DType::i64, Device::cpu());
  std::vector<std::int64_t> idx;
  auto* off = h.offsets.data_as<std::int64_t>();
  off[0] = 0;
  for (std::int64_t q = 0; q < t * b; ++q) {
    const std::int64_t rows = c.table_rows[static_cast<std::size_t>(q / b)];
    const std::uint32_t v = bits(seed + 2, static_cast<std::uint64_t>(q));
    h.raw.data_as<std::uint32_t>()[q] = v;
    if (!multi_hot) {
      idx.push_back(c.raw_hash == RowHash::seed ? static_cast<std::int64_t>((std::uint64_t{v} + 1) % static_cast<std::uint64_t>(rows))
                                                : static_cast<std::int64_t>(v % static_cast<std::uint64_t>(rows)));
    } else {
      const int n = static_cast<int>(v % 4);
      for (int k = 0; k < n; ++k) idx.push_back(static_cast<std::int64_t>(bits(seed + 3, static_cast<std::uint64_t>(q * 4 + k)) % rows));
    }
    off[q + 1] = static_cast<std::int64_t>(idx.size());
  }
  h.indices = Tensor::empty({static_cast<std::int64_t>(idx.size())}, DType::i64, Device::cpu());
  std::copy(idx.begin(), idx.end(), h.indices.data_as<std::int64_t>());
  return h;
}

DlrmConfig tiny(InteractionOp op) {
  DlrmConfig c;
  c.bottom_mlp = {13, 24, 8};
  c.top_mlp = {20, 1};
  c.embedding_dim = 8;
  c.table_rows = {50, 3, 200, 1, 77};
  c.interaction = op;
  c.seed = 5;
  c.allow_tf32 = false;  // fp32 GEMMs: compare with the CPU tightly
  return c;
}

void expect_close(const TensorView& got, const TensorView& ref, double tol, const std::string& what) {
  const Tensor g = test::to_host(got), r = test::to_host(ref);
  ASSERT_EQ(g.numel(), r.numel()) << what;
  EXPECT_LE(test::rel_err_normwise(g, r), tol) << what;
}

void expect_same_params(Dlrm& gpu, Dlrm& cpu, double tol, const std::string& what) {
  auto gl = gpu.linear_layers(), cl = cpu.linear_layers();
  ASSERT_EQ(gl.size(), cl.size());
  for (std::size_t i = 0; i < gl.size(); ++i) {
    expect_close(*gl[i].weight, *cl[i].weight, tol, what + ": weight " + std::to_string(i));
    expect_close(*gl[i].bias, *cl[i].bias, tol, what + ": bias " + std::to_string(i));
  }
  auto gt = gpu.tables(), ct = cpu.tables();
  ASSERT_EQ(gt.size(), ct.size());
  for (std::size_t t = 0; t < gt.size(); ++t) expect_close(*gt[t], *ct[t], tol, what + ": table " + std::to_string(t));
}

std::vector<float> host_vec(const TensorView& t) {
  const Tensor h = test::to_host(t);
  return {h.data_as<float>(), h.data_as<float>() + h.numel()};
}

struct Case {
  DlrmImpl impl;
  InteractionOp op;
  bool multi_hot;
  OptimizerKind opt;
};

class DlrmGpuVsCpu : public ::testing::TestWithParam<Case> {};

TEST_P(DlrmGpuVsCpu, ForwardGradientsAndStepsMatchTheCpuModel) {
  FK_SKIP_WITHOUT_GPU();
  const Case k = GetParam();
  const DlrmConfig c = tiny(k.op);
  Dlrm cpu(c, Device::cpu());
  Dlrm gpu(c, Device::cuda(), k.impl);
  expect_same_params(gpu, cpu, 1e-6, "init");
  const OptimizerConfig opt{.kind = k.opt, .learning_rate = k.opt == OptimizerKind::sgd ? 0.3f : 0.05f};
  for (std::int64_t b : {37, 1, 130}) {
    const HostBatch h = make_batch(c, b, 100 + static_cast<std::uint64_t>(b), k.multi_hot);
    Tensor lc = Tensor::empty({b}, DType::f32, Device::cpu()), lg = Tensor::empty({b}, DType::f32, Device::cpu());
    Tensor dl = Tensor::empty({b}, DType::f32, Device::cpu());
    cpu.forward(h.input(false), lc);
    gpu.forward(h.input(!k.multi_hot), lg);
    expect_close(lg, lc, 2e-5, "logits, batch " + std::to_string(b));
    const TensorView dlv = dl;
    bce_with_logits(lc, h.labels, &dlv);
    cpu.backward(dl);
    gpu.backward(dl);
    auto gl = gpu.linear_layers(), cl = cpu.linear_layers();
    for (std::size_t i = 0; i < gl.size(); ++i) {
      expect_close(*gl[i].weight_grad, *cl[i].weight_grad, 1e-4, "dW " + std::to_string(i));
      expect_close(*gl[i].bias_grad, *cl[i].bias_grad, 1e-4, "db " + std::to_string(i));
    }
    cpu.step(opt);
    gpu.step(opt);
    expect_same_params(gpu, cpu, 1e-5, "after step, batch " + std::to_string(b));
  }
  // Whole training steps (the graph path for fused one-hot input after the first).
  for (int i = 0; i < 4; ++i) {
    const HostBatch h = make_batch(c, 61, 900 + static_cast<std::uint64_t>(i), k.multi_hot);
    const double lc = cpu.train_step(h.input(false), h.labels, opt);
    const double lg = gpu.train_step(h.input(!k.multi_hot), h.labels, opt);
    EXPECT_NEAR(lg, lc, 1e-4 * std::max(1.0, std::fabs(lc))) << "train step " << i;
  }
  expect_same_params(gpu, cpu, 1e-4, "after train steps");
}

INSTANTIATE_TEST_SUITE_P(
    Impls, DlrmGpuVsCpu,
    ::testing::Values(Case{DlrmImpl::reference, InteractionOp::dot, false, OptimizerKind::sgd},
                      Case{DlrmImpl::fused, InteractionOp::dot, false, OptimizerKind::sgd},
                      Case{DlrmImpl::reference, InteractionOp::dot, true, OptimizerKind::adagrad},
                      Case{DlrmImpl::fused, InteractionOp::dot, true, OptimizerKind::adagrad},
                      Case{DlrmImpl::fused, InteractionOp::dot, false, OptimizerKind::adagrad},
                      Case{DlrmImpl::reference, InteractionOp::cat, false, OptimizerKind::sgd},
                      Case{DlrmImpl::fused, InteractionOp::cat, false, OptimizerKind::sgd},
                      Case{DlrmImpl::reference, InteractionOp::outer, false, OptimizerKind::sgd},
                      Case{DlrmImpl::fused, InteractionOp::outer, true, OptimizerKind::sgd}),
    [](const auto& info) {
      const Case& k = info.param;
      return std::string(impl_name(k.impl)) + "_" + std::string(interaction_op_name(k.op)) +
             (k.multi_hot ? "_multihot_" : "_onehot_") + std::string(optimizer_name(k.opt));
    });

TEST(DlrmGpu, HotRowsAcrossManyChunksMatchTheCpuModel) {
  FK_SKIP_WITHOUT_GPU();
  // Tables of 1-3 rows at batch 4133: each row gathers ~1400-4133 gradients, cut into many
  // chunks of 32 sorted entries (phase 2 of the fused backward), plus a large table.
  DlrmConfig c = tiny(InteractionOp::dot);
  c.table_rows = {2, 1, 3, 100000};
  c.embedding_dim = 16;  // the Kaggle width (the register-blocked interaction backward)
  c.bottom_mlp = {13, 24, 16};
  for (OptimizerKind ok : {OptimizerKind::sgd, OptimizerKind::adagrad}) {
    Dlrm cpu(c, Device::cpu());
    Dlrm gpu(c, Device::cuda(), DlrmImpl::fused);
    const OptimizerConfig opt{.kind = ok, .learning_rate = 0.05f};
    for (int i = 0; i < 3; ++i) {
      const HostBatch h = make_batch(c, 4133, 50 + static_cast<std::uint64_t>(i), false);
      cpu.train_step(h.input(false), h.labels, opt);
      gpu.train_step(h.input(true), h.labels, opt);
    }
    expect_same_params(gpu, cpu, 1e-4, std::string("hot rows, ") + std::string(optimizer_name(ok)));
  }
}

TEST(DlrmGpu, GraphStepEqualsEagerStepAndIsDeterministic) {
  FK_SKIP_WITHOUT_GPU();
  DlrmConfig c = tiny(InteractionOp::dot);
  c.table_rows = {3, 1000, 17, 5};
  c.allow_tf32 = true;
  const OptimizerConfig opt{.kind = OptimizerKind::sgd, .learning_rate = 0.1f};
  DlrmConfig no_graph = c;
  no_graph.cuda_graph = false;
  Dlrm graph(c, Device::cuda(), DlrmImpl::fused), eager(no_graph, Device::cuda(), DlrmImpl::fused),
      again(c, Device::cuda(), DlrmImpl::fused);
  for (int i = 0; i < 6; ++i) {
    const HostBatch h = make_batch(c, 2000, 7 + static_cast<std::uint64_t>(i), false);
    graph.enqueue_train_step(h.input(true), h.labels, opt);  // eager once, then captured and replayed
    again.enqueue_train_step(h.input(true), h.labels, opt);
    eager.enqueue_train_step(h.input(true), h.labels, opt);
  }
  const double lg = graph.drain_loss();
  EXPECT_GT(lg, 0.0);
  EXPECT_EQ(lg, again.drain_loss());
  EXPECT_EQ(lg, eager.drain_loss());
  auto tg = graph.tables(), te = eager.tables(), ta = again.tables();
  for (std::size_t t = 0; t < tg.size(); ++t) {
    EXPECT_EQ(host_vec(*tg[t]), host_vec(*ta[t])) << "table " << t << ": two fused runs differ";
    EXPECT_EQ(host_vec(*tg[t]), host_vec(*te[t])) << "table " << t << ": graph and eager steps differ";
  }
  auto wg = graph.linear_layers(), wa = again.linear_layers();
  for (std::size_t i = 0; i < wg.size(); ++i) EXPECT_EQ(host_vec(*wg[i].weight), host_vec(*wa[i].weight)) << i;
  // The reference implementation is deterministic too (its dense table gradients are summed
  // after a sort, not with atomics).
  Dlrm r1(c, Device::cuda(), DlrmImpl::reference), r2(c, Device::cuda(), DlrmImpl::reference);
  for (int i = 0; i < 3; ++i) {
    const HostBatch h = make_batch(c, 2000, 70 + static_cast<std::uint64_t>(i), false);
    EXPECT_EQ(r1.train_step(h.input(false), h.labels, opt), r2.train_step(h.input(false), h.labels, opt));
  }
  auto t1 = r1.tables(), t2 = r2.tables();
  for (std::size_t t = 0; t < t1.size(); ++t) EXPECT_EQ(host_vec(*t1[t]), host_vec(*t2[t])) << "reference table " << t;
}

// bf16 tables on the GPU: the captured step replays new draws (the rounding offset is read from
// a device counter the graph advances), so graph and eager steps give the same bits; and the GPU
// tracks the CPU model, which draws the same bits (the stochastic rounding flips only where the
// f32 values straddle a draw's threshold). Hot rows (tables of 1-3 rows) take phase 2 of the
// backward.
TEST(DlrmGpu, SixteenBitTablesReplayAsAGraphAndTrackTheCpuModel) {
  FK_SKIP_WITHOUT_GPU();
  DlrmConfig c = tiny(InteractionOp::dot);
  c.table_rows = {2, 1000, 3, 5000};
  c.embedding_dtype = DType::bf16;
  c.rowwise_adagrad = true;
  const OptimizerConfig opt{.kind = OptimizerKind::adagrad, .learning_rate = 0.05f};
  DlrmConfig no_graph = c;
  no_graph.cuda_graph = false;
  Dlrm graph(c, Device::cuda(), DlrmImpl::fused), eager(no_graph, Device::cuda(), DlrmImpl::fused),
      cpu(c, Device::cpu(), DlrmImpl::fused);
  for (int i = 0; i < 6; ++i) {
    const HostBatch h = make_batch(c, 1500, 90 + static_cast<std::uint64_t>(i), false);
    graph.enqueue_train_step(h.input(true), h.labels, opt);
    eager.enqueue_train_step(h.input(true), h.labels, opt);
    cpu.train_step(h.input(true), h.labels, opt);
  }
  EXPECT_EQ(graph.drain_loss(), eager.drain_loss());
  auto tg = graph.tables(), te = eager.tables(), tc = cpu.tables();
  for (std::size_t t = 0; t < tg.size(); ++t) {
    ASSERT_EQ(tg[t]->dtype(), DType::bf16);
    EXPECT_EQ(test::to_floats(*tg[t]), test::to_floats(*te[t])) << "table " << t << ": graph and eager steps differ";
    EXPECT_LE(test::rel_err_normwise(*tg[t], *tc[t]), 1e-3) << "table " << t;
  }
}

TEST(DlrmGpu, CheckpointMovesBetweenGpuAndCpuAndResumesExactly) {
  FK_SKIP_WITHOUT_GPU();
  const DlrmConfig c = tiny(InteractionOp::dot);
  const OptimizerConfig opt{.kind = OptimizerKind::adagrad, .learning_rate = 0.05f};
  Dlrm a(c, Device::cuda(), DlrmImpl::fused);
  std::vector<HostBatch> batches;
  for (int i = 0; i < 6; ++i) batches.push_back(make_batch(c, 300, 40 + static_cast<std::uint64_t>(i), false));
  for (int i = 0; i < 3; ++i) a.train_step(batches[i].input(true), batches[i].labels, opt);
  std::stringstream state;
  a.save_state(state);
  const std::string saved = state.str();
  Dlrm cpu(c, Device::cpu());
  std::stringstream s1(saved);
  cpu.load_state(s1);
  expect_same_params(a, cpu, 0.0, "GPU state loaded on the CPU");
  Dlrm b(c, Device::cuda(), DlrmImpl::fused);
  std::stringstream s2(saved);
  b.load_state(s2);
  for (int i = 3; i < 6; ++i) {
    const double la = a.train_step(batches[i].input(true), batches[i].labels, opt);
    const double lb = b.train_step(batches[i].input(true), batches[i].labels, opt);
    EXPECT_EQ(la, lb) << "step " << i << ": the resumed run differs";
  }
}

TEST(DlrmGpu, FusedMlpRunsBothMlpsInBf16AndTracksTheCpuModel) {
  FK_SKIP_WITHOUT_GPU();
  DlrmConfig c = tiny(InteractionOp::dot);
  c.bottom_mlp = {13, 32, 8};  // hidden width 32: fits fused_mlp
  c.top_mlp = {32, 1};         // input 8 + 15 = 23, hidden 32: fits
  DlrmConfig f = c;
  f.fused_mlp = true;
  Dlrm cpu(c, Device::cpu());
  Dlrm plain(c, Device::cuda(), DlrmImpl::fused);
  Dlrm fm(f, Device::cuda(), DlrmImpl::fused);
  const HostBatch h = make_batch(c, 300, 77, false);
  Tensor lc = Tensor::empty({300}, DType::f32, Device::cpu()), lp = Tensor::empty({300}, DType::f32, Device::cpu()),
         lf = Tensor::empty({300}, DType::f32, Device::cpu()), dl = Tensor::empty({300}, DType::f32, Device::cpu());
  cpu.forward(h.input(false), lc);
  plain.forward(h.input(true), lp);
  fm.forward(h.input(true), lf);
  // bf16 activations and weights: within bf16 rounding of the fp32 model, and visibly not the
  // fp32 path (which matches the CPU to ~1e-6).
  EXPECT_LE(test::rel_err_normwise(lf, lc), 3e-2);
  EXPECT_GT(test::rel_err_normwise(lf, lp), 1e-4) << "fused_mlp was not used";
  const TensorView dlv = dl;
  bce_with_logits(lc, h.labels, &dlv);
  cpu.backward(dl);
  fm.backward(dl);
  auto gl = fm.linear_layers(), cl = cpu.linear_layers();
  for (std::size_t i = 0; i < gl.size(); ++i) {
    expect_close(*gl[i].weight_grad, *cl[i].weight_grad, 6e-2, "fused_mlp dW " + std::to_string(i));
    expect_close(*gl[i].bias_grad, *cl[i].bias_grad, 6e-2, "fused_mlp db " + std::to_string(i));
  }
  // Whole steps (graph-captured after the first): the losses follow the fp32 model's.
  const OptimizerConfig opt{.kind = OptimizerKind::sgd, .learning_rate = 0.2f};
  double sum_c = 0, sum_f = 0;
  for (int i = 0; i < 30; ++i) {
    const HostBatch b = make_batch(c, 256, 500 + static_cast<std::uint64_t>(i), false);
    sum_c += cpu.train_step(b.input(false), b.labels, opt);
    sum_f += fm.train_step(b.input(true), b.labels, opt);
  }
  EXPECT_NEAR(sum_f / 30, sum_c / 30, 0.01 * sum_c / 30);
  test::expect_arg_error([&] { Dlrm bad(f, Device::cuda(), DlrmImpl::reference); }, "models::Dlrm", "config.fused_mlp");
}

// Activation compression on the GPU: against the compressed CPU model (the same packs, up to the
// last bits of the activations; dW through bf16 dz and bf16 x̂ on the tensor cores), the CUDA-graph
// step equal to the eager one bit for bit (the rounding's step counter advances inside the graph),
// and a checkpoint resumed exactly.
class DlrmGpuCompressed : public ::testing::TestWithParam<int> {};

TEST_P(DlrmGpuCompressed, TracksTheCpuModelReplaysAsAGraphAndResumes) {
  FK_SKIP_WITHOUT_GPU();
  DlrmConfig c = tiny(InteractionOp::dot);
  c.bottom_mlp = {13, 64, 8};
  c.top_mlp = {48, 1};
  c.compress_activations_bits = GetParam();
  Dlrm cpu(c, Device::cpu()), gpu(c, Device::cuda(), DlrmImpl::fused);
  const HostBatch h = make_batch(c, 300, 31, false);
  Tensor lc = Tensor::empty({300}, DType::f32, Device::cpu()), lg = Tensor::empty({300}, DType::f32, Device::cpu()),
         dl = Tensor::empty({300}, DType::f32, Device::cpu());
  cpu.forward(h.input(false), lc);
  gpu.forward(h.input(true), lg);
  expect_close(lg, lc, 2e-5, "logits");
  const TensorView dlv = dl;
  bce_with_logits(lc, h.labels, &dlv);
  cpu.backward(dl);
  gpu.backward(dl);
  auto gl = gpu.linear_layers(), cl = cpu.linear_layers();
  // The GPU packs each layer's input at its padded width (13 -> 16 columns here), so its groups
  // and Philox positions differ from the CPU's: the two dW are two independent stochastic
  // roundings of the same values, which differ normwise by up to about one quantization step
  // (1 / (2^bits - 1) of a group's range; measured 0.037 at 4 bits, 0.21 at 2). Below that, bf16
  // dz and x̂ (2^-9 each). Each against the uncompressed dW, elementwise within the bits' bound,
  // is mlp_compression_test's (CPU); the graph, eager and resumed runs below are exact.
  const double dw_tol = std::max(1e-2, 1.0 / ((1 << GetParam()) - 1));
  for (std::size_t i = 0; i < gl.size(); ++i) {
    expect_close(*gl[i].weight_grad, *cl[i].weight_grad, dw_tol, "dW " + std::to_string(i));
    expect_close(*gl[i].bias_grad, *cl[i].bias_grad, 1e-4, "db " + std::to_string(i));
  }
  expect_close(gpu.table_gradient(), cpu.table_gradient(), 1e-4, "table gradient");

  const OptimizerConfig opt{.kind = OptimizerKind::adagrad, .learning_rate = 0.05f};
  DlrmConfig no_graph = c;
  no_graph.cuda_graph = false;
  Dlrm graph(c, Device::cuda(), DlrmImpl::fused), again(c, Device::cuda(), DlrmImpl::fused),
      eager(no_graph, Device::cuda(), DlrmImpl::fused);
  std::vector<HostBatch> batches;
  for (int i = 0; i < 8; ++i) batches.push_back(make_batch(c, 1000, 60 + static_cast<std::uint64_t>(i), false));
  for (int i = 0; i < 4; ++i)
    for (Dlrm* m : {&graph, &again, &eager}) m->enqueue_train_step(batches[i].input(true), batches[i].labels, opt);
  const double lg4 = graph.drain_loss();
  EXPECT_EQ(lg4, again.drain_loss());
  EXPECT_EQ(lg4, eager.drain_loss()) << "the graph's steps round as the eager steps do";
  auto wg = graph.linear_layers(), we = eager.linear_layers();
  for (std::size_t i = 0; i < wg.size(); ++i)
    EXPECT_EQ(host_vec(*wg[i].weight), host_vec(*we[i].weight)) << "weight " << i << ": graph and eager steps differ";
  std::stringstream state;
  graph.save_state(state);
  Dlrm resumed(c, Device::cuda(), DlrmImpl::fused);
  resumed.load_state(state);
  for (int i = 4; i < 8; ++i) {
    const double a = graph.train_step(batches[i].input(true), batches[i].labels, opt);
    const double b = resumed.train_step(batches[i].input(true), batches[i].labels, opt);
    EXPECT_EQ(a, b) << "step " << i << ": the resumed run differs";
  }
}

INSTANTIATE_TEST_SUITE_P(Bits, DlrmGpuCompressed, ::testing::Values(8, 4, 2),
                         [](const auto& info) { return std::to_string(info.param) + "bits"; });

TEST(DlrmGpu, BadInputRaises) {
  FK_SKIP_WITHOUT_GPU();
  const DlrmConfig c = tiny(InteractionOp::dot);
  Dlrm ref(c, Device::cuda(), DlrmImpl::reference);
  HostBatch h = make_batch(c, 8, 1, false);
  Tensor l = Tensor::empty({8}, DType::f32, Device::cpu());
  test::expect_arg_error([&] { ref.forward({h.labels, h.indices, h.offsets, {}}, l); }, "models::Dlrm", "dense");
  h.indices.data_as<std::int64_t>()[8] = 3;  // table 1 has 3 rows
  test::expect_arg_error([&] { ref.forward(h.input(false), l); }, "models::Dlrm", "indices");
  Tensor short_logits = Tensor::empty({7}, DType::f32, Device::cpu());
  HostBatch ok = make_batch(c, 8, 2, false);
  test::expect_arg_error([&] { ref.forward(ok.input(false), short_logits); }, "models::Dlrm", "logits");
}

// The ops dispatch on the device, so both implementations run on the CPU too, and agree.
TEST(Dlrm, FusedOnTheCpuTracksTheReference) {
  for (InteractionOp op : {InteractionOp::dot, InteractionOp::cat}) {
    const DlrmConfig c = tiny(op);
    Dlrm ref(c, Device::cpu(), DlrmImpl::reference), fused(c, Device::cpu(), DlrmImpl::fused);
    for (OptimizerKind k : {OptimizerKind::sgd, OptimizerKind::adagrad}) {
      const OptimizerConfig opt{.kind = k, .learning_rate = 0.05f};
      for (int i = 0; i < 4; ++i) {
        const HostBatch h = make_batch(c, 33, 900 + static_cast<std::uint64_t>(i), i % 2 == 1);
        const double lr = ref.train_step(h.input(false), h.labels, opt);
        const double lf = fused.train_step(h.input(i % 2 == 0), h.labels, opt);
        EXPECT_NEAR(lf, lr, 1e-5 * std::fabs(lr)) << interaction_op_name(op) << " step " << i;
      }
    }
    expect_same_params(fused, ref, 1e-5, std::string("cpu fused vs reference, ") + std::string(interaction_op_name(op)));
  }
}

}  // namespace
}  // namespace fk::models
