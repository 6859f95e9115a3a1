// DLRM on the CPU: every layer's gradients against central finite differences on tiny shapes,
// the whole model's gradients, the optimizer updates by hand, the CPU GEMM against plain loops,
// bad input, and a tiny model trained on synthetic Criteo-like data whose test AUC must rise.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <sstream>
#include <vector>

#include "fusekit/core/error.hpp"
#include "fusekit/core/philox.hpp"
#include "fusekit/data/criteo.hpp"
#include "fusekit/models/dlrm.hpp"
#include "fusekit/models/metrics.hpp"
#include "test_util.hpp"

namespace fk::models {
namespace {

std::vector<float> random_floats(std::size_t n, std::uint64_t seed, float lo = -1.f, float hi = 1.f) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i)
    v[i] = lo + (hi - lo) * philox::to_unit_float(philox::random_block(seed, 7, i).v[0]);
  return v;
}

// Central differences of loss() in each coordinate of p, against the analytic gradient g. Float
// forward passes lose ~1e-7 relative per value, so with h = 1e-3 the numerical gradient is good
// to ~1e-4 of the loss scale; the bound leaves room for that and a stray ReLU kink nearby.
void expect_grad(float* p, const float* g, std::size_t n, const std::function<double()>& loss, const std::string& what,
                 float h = 1e-3f) {
  int bad = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const float keep = p[i];
    p[i] = keep + h;
    const double up = loss();
    p[i] = keep - h;
    const double down = loss();
    p[i] = keep;
    const double num = (up - down) / (2.0 * h);
    if (std::fabs(num - g[i]) > 2e-3 + 1e-2 * std::fabs(num)) {
      if (++bad <= 5) ADD_FAILURE() << what << "[" << i << "]: analytic " << g[i] << ", numerical " << num;
    }
  }
  EXPECT_EQ(bad, 0) << what;
}

TEST(Layers, BceWithLogitsValueAndGradient) {
  std::vector<float> logits = {0.0f, 2.0f, -3.0f, 40.0f}, labels = {1, 0, 0, 1}, g(4);
  const TensorView lv(logits.data(), DType::f32, {4}, Device::cpu()), yv(labels.data(), DType::f32, {4}, Device::cpu()),
      gv(g.data(), DType::f32, {4}, Device::cpu());
  // log 2, log(1 + e^2), log(1 + e^-3), log(1 + e^-40): mean.
  const double want = (std::log(2.0) + std::log1p(std::exp(2.0)) + std::log1p(std::exp(-3.0)) + std::log1p(std::exp(-40.0))) / 4;
  EXPECT_NEAR(bce_with_logits(lv, yv, &gv), want, 1e-12);
  EXPECT_NEAR(g[0], (0.5 - 1) / 4, 1e-7);
  expect_grad(logits.data(), g.data(), 3, [&] { return bce_with_logits(lv, yv, nullptr); }, "dlogits");
}

DlrmConfig tiny_config(InteractionOp op) {
  DlrmConfig c;
  c.bottom_mlp = {13, 8, 4};
  c.top_mlp = {6, 1};
  c.embedding_dim = 4;
  c.table_rows = {10, 7, 5};
  c.interaction = op;
  c.dcn_num_layers = 2;  // dcn only
  c.dcn_low_rank_dim = 3;
  c.seed = 5;
  return c;
}

class DlrmGrad : public ::testing::TestWithParam<InteractionOp> {};

TEST_P(DlrmGrad, WholeModelMatchesFiniteDifferences) {
  Dlrm model(tiny_config(GetParam()), Device::cpu());
  const std::int64_t b = 6, nt = 3;
  auto dense = random_floats(static_cast<std::size_t>(b * 13), 13, 0.f, 3.f);
  std::vector<std::int64_t> idx, off = {0};
  for (std::int64_t t = 0; t < nt; ++t)
    for (std::int64_t i = 0; i < b; ++i) {
      for (std::int64_t k = 0; k < (i + t) % 3; ++k) idx.push_back((i * 3 + k * 5 + t) % model.config().table_rows[t]);
      off.push_back(static_cast<std::int64_t>(idx.size()));
    }
  std::vector<float> labels = {1, 0, 0, 1, 0, 1}, logits(b), dlogits(b);
  const DlrmInput in{TensorView(dense.data(), DType::f32, {b, 13}, Device::cpu()),
                     TensorView(idx.data(), DType::i64, {static_cast<std::int64_t>(idx.size())}, Device::cpu()),
                     TensorView(off.data(), DType::i64, {static_cast<std::int64_t>(off.size())}, Device::cpu())};
  const TensorView lv(logits.data(), DType::f32, {b}, Device::cpu()), yv(labels.data(), DType::f32, {b}, Device::cpu()),
      gv(dlogits.data(), DType::f32, {b}, Device::cpu());
  auto loss = [&] {
    model.forward(in, lv);
    return bce_with_logits(lv, yv, nullptr);
  };
  model.forward(in, lv);
  bce_with_logits(lv, yv, &gv);
  model.backward(gv);
  // Snapshot the gradients first: each loss() call reruns forward.
  int l = 0;
  for (const auto& p : model.linear_layers()) {
    const Tensor gw = p.weight_grad->clone(), gb = p.bias_grad->clone();
    expect_grad(p.weight->data_as<float>(), gw.data_as<float>(), static_cast<std::size_t>(gw.numel()), loss,
                "linear " + std::to_string(l) + " W");
    expect_grad(p.bias->data_as<float>(), gb.data_as<float>(), static_cast<std::size_t>(gb.numel()), loss,
                "linear " + std::to_string(l) + " b");
    ++l;
  }
  int k = 0;
  for (const auto& p : model.cross_parameters()) {  // dcn: U, V, b of each layer
    const Tensor g = p.grad->clone();
    expect_grad(p.value->data_as<float>(), g.data_as<float>(), static_cast<std::size_t>(g.numel()), loss,
                "cross parameter " + std::to_string(k++));
  }
  // The tables' gradient [total_rows, D], against differences in each table's rows.
  const Tensor grad = model.table_gradient();
  const std::vector<double> g = test::to_doubles(grad);
  std::int64_t row = 0;
  for (std::size_t t = 0; t < model.tables().size(); ++t) {
    Tensor* table = model.tables()[t];
    expect_grad(table->data_as<float>(), std::vector<float>(g.begin() + row * 4, g.begin() + (row + table->size(0)) * 4).data(),
                static_cast<std::size_t>(table->numel()), loss, "table " + std::to_string(t));
    row += table->size(0);
  }
}

INSTANTIATE_TEST_SUITE_P(Ops, DlrmGrad,
                         ::testing::Values(InteractionOp::dot, InteractionOp::cat, InteractionOp::outer,
                                           InteractionOp::dcn),
                         [](const auto& info) { return std::string(interaction_op_name(info.param)); });

TEST(Dlrm, KaggleShapesAndParameterCount) {
  DlrmConfig c;
  c.table_rows.assign(data::kKaggleCardinalities.begin(), data::kKaggleCardinalities.end());
  EXPECT_EQ(c.interaction_size(), 367);
  c.interaction = InteractionOp::cat;
  EXPECT_EQ(c.interaction_size(), 432);
  c.interaction = InteractionOp::outer;
  EXPECT_EQ(c.interaction_size(), 186624);
  c.interaction = InteractionOp::dot;
  std::int64_t rows = 0;
  for (auto r : c.table_rows) rows += r;
  EXPECT_EQ(rows, 33762577);
  const std::int64_t mlp = (13 + 1) * 512 + (512 + 1) * 256 + (256 + 1) * 64 + (64 + 1) * 16 + (367 + 1) * 512 +
                           (512 + 1) * 256 + (256 + 1) * 1;
  EXPECT_EQ(c.parameter_count(), mlp + rows * 16);
}

TEST(Dlrm, BadConfigurationAndInputRaiseErrors) {
  DlrmConfig c = tiny_config(InteractionOp::dot);
  c.bottom_mlp = {13, 8, 5};  // last != embedding_dim
  test::expect_arg_error([&] { Dlrm m(c, Device::cpu()); }, "models::DlrmConfig", "bottom_mlp");
  c = tiny_config(InteractionOp::dot);
  c.top_mlp = {6, 2};
  test::expect_arg_error([&] { Dlrm m(c, Device::cpu()); }, "models::DlrmConfig", "top_mlp");
  test::expect_arg_error([&] { Dlrm m(tiny_config(InteractionOp::dot), Device::cuda(99)); }, "models::Dlrm", "device");

  Dlrm model(tiny_config(InteractionOp::dot), Device::cpu());
  std::vector<float> dense(13 * 2, 1.0f), logits(2);
  std::vector<std::int64_t> idx = {0, 1, 2, 3, 4, 7};  // 7 is past table 2's 5 rows
  std::vector<std::int64_t> off = {0, 1, 2, 3, 4, 5, 6};
  DlrmInput in{TensorView(dense.data(), DType::f32, {2, 13}, Device::cpu()),
               TensorView(idx.data(), DType::i64, {6}, Device::cpu()),
               TensorView(off.data(), DType::i64, {7}, Device::cpu())};
  const TensorView lv(logits.data(), DType::f32, {2}, Device::cpu());
  test::expect_arg_error([&] { model.forward(in, lv); }, "models::Dlrm", "indices");
  idx[5] = 1;
  off[3] = 5;  // decreasing
  test::expect_arg_error([&] { model.forward(in, lv); }, "models::Dlrm", "offsets");
  off[3] = 3;
  in.offsets = TensorView(off.data(), DType::i64, {6}, Device::cpu());
  test::expect_arg_error([&] { model.forward(in, lv); }, "models::Dlrm", "offsets");
}

// The tiny dot model over the featurizer's tables (max_ind_range 500) and n batches of 32
// synthetic records (seed 4): what the resume tests train.
struct SyntheticRun {
  DlrmConfig config;
  std::vector<data::Batch> batches;
};

SyntheticRun synthetic_run(std::size_t n) {
  data::SyntheticConfig sc;
  sc.seed = 4;
  data::Featurizer feat;
  feat.max_ind_range = 500;
  SyntheticRun r{tiny_config(InteractionOp::dot), std::vector<data::Batch>(n)};
  r.config.table_rows = feat.table_rows();
  std::vector<data::RawRecord> recs(n * 32);
  data::SyntheticCriteo(sc).generate(0, recs);
  for (std::size_t k = 0; k < n; ++k) data::make_batch(std::span(recs).subspan(k * 32, 32), feat, r.batches[k]);
  return r;
}

// The losses of training steps on batches [from, to).
std::vector<double> train_losses(Dlrm& m, const std::vector<data::Batch>& batches, std::size_t from, std::size_t to,
                                 const OptimizerConfig& opt) {
  std::vector<double> losses;
  for (std::size_t k = from; k < to; ++k)
    losses.push_back(m.train_step({batches[k].dense, batches[k].indices, batches[k].offsets}, batches[k].labels, opt));
  return losses;
}

TEST(Dlrm, ResumedFromSavedStateGivesBitIdenticalLosses) {
  const SyntheticRun r = synthetic_run(20);  // not a structured binding: the lambdas capture it
  const DlrmConfig& c = r.config;
  const std::vector<data::Batch>& batches = r.batches;
  const OptimizerConfig opt{.kind = OptimizerKind::adagrad, .learning_rate = 0.05f};
  auto run = [&](Dlrm& m, std::size_t from, std::size_t to) { return train_losses(m, batches, from, to, opt); };
  Dlrm straight(c, Device::cpu());
  const std::vector<double> all = run(straight, 0, 20);
  Dlrm first(c, Device::cpu());
  run(first, 0, 10);
  std::stringstream state;
  first.save_state(state);
  DlrmConfig other_seed = c;
  other_seed.seed = 77;  // loading must replace every parameter
  Dlrm resumed(other_seed, Device::cpu());
  resumed.load_state(state);
  const std::vector<double> rest = run(resumed, 10, 20);
  for (std::size_t k = 0; k < 10; ++k) EXPECT_EQ(rest[k], all[10 + k]) << "step " << 10 + k;
  const Tensor* a = straight.tables()[2];
  const Tensor* b = resumed.tables()[2];
  EXPECT_EQ(std::memcmp(a->data(), b->data(), a->nbytes()), 0);
  // A state of another shape is refused.
  DlrmConfig smaller = c;
  smaller.table_rows[0] = 3;
  Dlrm wrong(smaller, Device::cpu());
  std::stringstream again;
  first.save_state(again);
  test::expect_arg_error([&] { wrong.load_state(again); }, "models::Dlrm::load_state", "in");
}

// CI's training check: a tiny DLRM on synthetic Criteo-like data (tables capped at 2000 rows),
// 300 SGD steps of 128, then the AUC on 8192 held-out samples; uncompressed, and with the MLPs'
// activations kept at 4 and 2 bits.
class TinyDlrm : public ::testing::TestWithParam<int> {};

TEST_P(TinyDlrm, LearnsSyntheticCriteo) {
  const auto start = std::chrono::steady_clock::now();
  data::SyntheticConfig sc;
  sc.seed = 3;
  auto source = data::synthetic_source(sc, 300 * 128 + 8192);
  data::Featurizer feat;
  feat.max_ind_range = 2000;
  DlrmConfig c;
  c.bottom_mlp = {13, 32, 8};
  c.embedding_dim = 8;
  c.top_mlp = {32, 1};
  c.table_rows = feat.table_rows();
  c.seed = 9;
  c.compress_activations_bits = GetParam();
  Dlrm model(c, Device::cpu());
  const OptimizerConfig opt{.kind = OptimizerKind::sgd, .learning_rate = 0.2f};
  data::BatchLoader train(data::slice_source(source, 0, 300 * 128), feat, {.batch_size = 128});
  double first = 0, last = 0;
  int step = 0;
  while (const data::Batch* b = train.next()) {
    const double loss = model.train_step({b->dense, b->indices, b->offsets}, b->labels, opt);
    if (step < 20) first += loss / 20;
    if (step >= 280) last += loss / 20;
    ++step;
  }
  data::BatchLoader test_loader(data::slice_source(source, 300 * 128, 300 * 128 + 8192), feat, {.batch_size = 1024});
  std::vector<float> probs, labels;
  while (const data::Batch* b = test_loader.next()) {
    Tensor p = Tensor::empty({b->size}, DType::f32, Device::cpu());
    model.predict({b->dense, b->indices, b->offsets}, p);
    probs.insert(probs.end(), p.data_as<float>(), p.data_as<float>() + b->size);
    labels.insert(labels.end(), b->labels.data_as<float>(), b->labels.data_as<float>() + b->size);
  }
  const BinaryMetrics m = evaluate_binary(probs, labels);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("tiny DLRM (activations %d bits): loss %.4f -> %.4f, test AUC %.4f, logloss %.4f, accuracy %.4f "
              "(positives %.3f), %.1f s\n",
              GetParam() ? GetParam() : 32, first, last, m.auc, m.log_loss, m.accuracy, m.positive_rate, seconds);
  EXPECT_LT(last, first);
  EXPECT_GT(m.auc, 0.6);
}

INSTANTIATE_TEST_SUITE_P(CompressedActivations, TinyDlrm, ::testing::Values(0, 4, 2),
                         [](const auto& info) {
                           return info.param ? std::to_string(info.param) + "bits" : std::string("f32");
                         });

// The DLRM-DCNv2 model at CI size (configs/tiny_dcnv2.json's shape): the MLPerf model's 26
// multi-hot features (its bag sizes, tables capped at 2000 rows), a 2-layer cross network of rank
// 8, Adagrad with row-wise Adagrad for the tables; 300 steps of 128, both implementations: the
// loss falls and the test AUC rises above chance.
class TinyDcnv2 : public ::testing::TestWithParam<DlrmImpl> {};

data::Featurizer mlperf_like_featurizer() {
  data::Featurizer feat;
  feat.cardinalities = {40000000, 39060, 17295, 7424,     20265,    3,        7122,     1543,   63,
                        40000000, 3067956, 405282, 10,    2209,     11938,    155,      4,      976,
                        14,       40000000, 40000000, 40000000, 590152, 12973, 108, 36};
  feat.multi_hot_sizes = {3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1};
  feat.max_ind_range = 2000;
  return feat;
}

DlrmConfig tiny_dcnv2_config(const data::Featurizer& feat) {
  DlrmConfig c;
  c.bottom_mlp = {13, 32, 8};
  c.embedding_dim = 8;
  c.top_mlp = {64, 32, 1};
  c.table_rows = feat.table_rows();
  c.interaction = InteractionOp::dcn;
  c.dcn_num_layers = 2;
  c.dcn_low_rank_dim = 8;
  c.rowwise_adagrad = true;
  c.seed = 9;
  return c;
}

// The tiny DCNv2 run: 300 Adagrad steps of 128 on synthetic multi-hot data (seed 3), then the
// test AUC on the next 8192 samples; the mean losses of the first and the last 20 steps.
struct TinyRun {
  double first = 0, last = 0;
  BinaryMetrics metrics;
};

TinyRun train_tiny_dcnv2(const DlrmConfig& c, DlrmImpl impl) {
  data::SyntheticConfig sc;
  sc.seed = 3;
  auto source = data::synthetic_source(sc, 300 * 128 + 8192);
  const data::Featurizer feat = mlperf_like_featurizer();
  Dlrm model(c, Device::cpu(), impl);
  const OptimizerConfig opt{.kind = OptimizerKind::adagrad, .learning_rate = 0.05f};
  data::BatchLoader train(data::slice_source(source, 0, 300 * 128), feat, {.batch_size = 128});
  TinyRun r;
  int step = 0;
  while (const data::Batch* b = train.next()) {
    const double loss = model.train_step({b->dense, b->indices, b->offsets, b->raw_sparse}, b->labels, opt);
    if (step < 20) r.first += loss / 20;
    if (step >= 280) r.last += loss / 20;
    ++step;
  }
  data::BatchLoader test_loader(data::slice_source(source, 300 * 128, 300 * 128 + 8192), feat, {.batch_size = 1024});
  std::vector<float> probs, labels;
  while (const data::Batch* b = test_loader.next()) {
    Tensor p = Tensor::empty({b->size}, DType::f32, Device::cpu());
    model.predict({b->dense, b->indices, b->offsets, b->raw_sparse}, p);
    probs.insert(probs.end(), p.data_as<float>(), p.data_as<float>() + b->size);
    labels.insert(labels.end(), b->labels.data_as<float>(), b->labels.data_as<float>() + b->size);
  }
  r.metrics = evaluate_binary(probs, labels);
  return r;
}

TEST_P(TinyDcnv2, LearnsSyntheticMultiHotCriteo) {
  const DlrmConfig c = tiny_dcnv2_config(mlperf_like_featurizer());
  const TinyRun r = train_tiny_dcnv2(c, GetParam());
  const BinaryMetrics& m = r.metrics;
  const double first = r.first, last = r.last;
  std::printf("tiny DLRM-DCNv2 (%s): loss %.4f -> %.4f, test AUC %.4f\n", std::string(impl_name(GetParam())).c_str(),
              first, last, m.auc);
  EXPECT_LT(last, first);
  EXPECT_GT(m.auc, 0.6);
  EXPECT_EQ(Dlrm(c, Device::cpu(), GetParam()).cross_parameters().size(), 6u);
}

INSTANTIATE_TEST_SUITE_P(Impls, TinyDcnv2, ::testing::Values(DlrmImpl::reference, DlrmImpl::fused),
                         [](const auto& info) { return std::string(impl_name(info.param)); });

// The DCNv2 model's training state (cross layers, row-wise Adagrad's [rows] accumulators) saved
// and loaded: the resumed run's losses are the uninterrupted run's, bit for bit.
TEST(Dlrm, Dcnv2ResumedFromSavedStateGivesBitIdenticalLosses) {
  SyntheticRun r = synthetic_run(12);
  r.config.interaction = InteractionOp::dcn;
  r.config.rowwise_adagrad = true;
  const OptimizerConfig opt{.kind = OptimizerKind::adagrad, .learning_rate = 0.05f};
  Dlrm straight(r.config, Device::cpu());
  const std::vector<double> all = train_losses(straight, r.batches, 0, 12, opt);
  Dlrm first(r.config, Device::cpu());
  train_losses(first, r.batches, 0, 6, opt);
  std::stringstream state;
  first.save_state(state);
  DlrmConfig other_seed = r.config;
  other_seed.seed = 77;
  Dlrm resumed(other_seed, Device::cpu());
  resumed.load_state(state);
  const std::vector<double> rest = train_losses(resumed, r.batches, 6, 12, opt);
  for (std::size_t k = 0; k < 6; ++k) EXPECT_EQ(rest[k], all[6 + k]) << "step " << 6 + k;
}

// ---- 16-bit tables (DlrmConfig::embedding_dtype) ----------------------------------------------

// The tiny DCNv2 model of TinyDcnv2 (fused) trained with f32, bf16 and f16 tables on the same
// data: the 16-bit runs learn (loss falls, test AUC > 0.6) and end within 0.01 AUC of the f32 run.
TEST(Dlrm, SixteenBitTablesLearnAsF32Tables) {
  double auc[3] = {};
  const DType dtypes[3] = {DType::f32, DType::bf16, DType::f16};
  for (int i = 0; i < 3; ++i) {
    DlrmConfig c = tiny_dcnv2_config(mlperf_like_featurizer());
    c.embedding_dtype = dtypes[i];
    ASSERT_EQ(Dlrm(c, Device::cpu(), DlrmImpl::fused).tables()[0]->dtype(), dtypes[i]);
    const TinyRun r = train_tiny_dcnv2(c, DlrmImpl::fused);
    auc[i] = r.metrics.auc;
    std::printf("tiny DLRM-DCNv2, %s tables: loss %.4f -> %.4f, test AUC %.4f\n",
                std::string(dtype_name(dtypes[i])).c_str(), r.first, r.last, auc[i]);
    EXPECT_LT(r.last, r.first);
    EXPECT_GT(auc[i], 0.6);
  }
  EXPECT_NEAR(auc[1], auc[0], 0.01);
  EXPECT_NEAR(auc[2], auc[0], 0.01);
}

// bf16 tables' training state: the tables' values (saved as f32, exactly) and the rounding step,
// so that the resumed run draws what the uninterrupted one draws: the same losses and table
// bits. The state loads into an f32-table model too (the values widen exactly).
TEST(Dlrm, SixteenBitTablesResumeBitIdentical) {
  SyntheticRun r = synthetic_run(12);
  r.config.interaction = InteractionOp::dcn;
  r.config.rowwise_adagrad = true;
  r.config.embedding_dtype = DType::bf16;
  const OptimizerConfig opt{.kind = OptimizerKind::adagrad, .learning_rate = 0.05f};
  Dlrm straight(r.config, Device::cpu(), DlrmImpl::fused);
  const std::vector<double> all = train_losses(straight, r.batches, 0, 12, opt);
  Dlrm first(r.config, Device::cpu(), DlrmImpl::fused);
  train_losses(first, r.batches, 0, 6, opt);
  std::stringstream state;
  first.save_state(state);
  const std::string saved = state.str();
  // A fresh model of the same configuration (the rounding's key comes from the seed): its tables
  // and its rounding step are replaced by the state's.
  Dlrm resumed_same(r.config, Device::cpu(), DlrmImpl::fused);
  std::stringstream again(saved);
  resumed_same.load_state(again);
  const std::vector<double> rest = train_losses(resumed_same, r.batches, 6, 12, opt);
  for (std::size_t k = 0; k < 6; ++k) EXPECT_EQ(rest[k], all[6 + k]) << "step " << 6 + k;
  for (std::size_t t = 0; t < straight.tables().size(); ++t) {
    const Tensor* a = straight.tables()[t];
    const Tensor* b = resumed_same.tables()[t];
    ASSERT_EQ(a->nbytes(), b->nbytes());
    EXPECT_EQ(std::memcmp(a->data(), b->data(), a->nbytes()), 0) << "table " << t;
  }
  // Into f32 tables: the same values.
  DlrmConfig wide = r.config;
  wide.embedding_dtype = DType::f32;
  Dlrm widened(wide, Device::cpu(), DlrmImpl::fused);
  std::stringstream third(saved);
  widened.load_state(third);
  const std::vector<float> w16 = test::to_floats(*first.tables()[1]), w32 = test::to_floats(*widened.tables()[1]);
  EXPECT_EQ(w16, w32);
}

TEST(Dlrm, SixteenBitTablesNeedTheFusedImpl) {
  DlrmConfig c = tiny_config(InteractionOp::dot);
  c.embedding_dtype = DType::bf16;
  test::expect_arg_error([&] { Dlrm m(c, Device::cpu(), DlrmImpl::reference); }, "models::Dlrm",
                         "config.embedding_dtype");
  Dlrm fused(c, Device::cpu(), DlrmImpl::fused);
  EXPECT_EQ(fused.tables()[0]->dtype(), DType::bf16);
}

TEST(Dlrm, Dcnv2BadConfigurationRaisesErrors) {
  DlrmConfig c = tiny_config(InteractionOp::dcn);
  c.dcn_num_layers = 0;
  test::expect_arg_error([&] { Dlrm m(c, Device::cpu()); }, "models::DlrmConfig", "dcn_num_layers");
  c = tiny_config(InteractionOp::dcn);
  c.dcn_low_rank_dim = 0;
  test::expect_arg_error([&] { Dlrm m(c, Device::cpu()); }, "models::DlrmConfig", "dcn_low_rank_dim");
  EXPECT_EQ(parse_interaction_op("dcn"), InteractionOp::dcn);
}

// Compression changes only what the MLPs' weight gradients read: the logits, the bias and table
// gradients equal the uncompressed model's, and dW stays close to its (8 bits); both
// implementations (the fused one applies the ReLU derivative and db in one pass, the reference
// one in two, on either side of the compression).
class DlrmCompression : public ::testing::TestWithParam<DlrmImpl> {};

TEST_P(DlrmCompression, OnlyTheMlpWeightGradientsChange) {
  data::Featurizer feat;
  feat.max_ind_range = 10;
  DlrmConfig c = tiny_config(InteractionOp::dot);
  c.bottom_mlp = {13, 40, 4};
  c.top_mlp = {24, 1};
  c.table_rows = feat.table_rows();
  DlrmConfig packed = c;
  packed.compress_activations_bits = 8;
  Dlrm plain_model(c, Device::cpu(), GetParam()), packed_model(packed, Device::cpu(), GetParam());
  data::SyntheticConfig sc;
  sc.seed = 6;
  std::vector<data::RawRecord> recs(64);
  data::SyntheticCriteo(sc).generate(0, recs);
  data::Batch batch;
  data::make_batch(recs, feat, batch);
  const DlrmInput in{batch.dense, batch.indices, batch.offsets};
  std::vector<float> lp(64), lc(64), dl(64);
  const TensorView lpv(lp.data(), DType::f32, {64}, Device::cpu()), lcv(lc.data(), DType::f32, {64}, Device::cpu()),
      dlv(dl.data(), DType::f32, {64}, Device::cpu());
  plain_model.forward(in, lpv);
  packed_model.forward(in, lcv);
  EXPECT_EQ(lp, lc);
  bce_with_logits(lpv, batch.labels, &dlv);
  plain_model.backward(dlv);
  packed_model.backward(dlv);
  EXPECT_EQ(test::to_floats(plain_model.table_gradient()), test::to_floats(packed_model.table_gradient()));
  auto pl = plain_model.linear_layers(), cl = packed_model.linear_layers();
  for (std::size_t i = 0; i < pl.size(); ++i) {
    EXPECT_LE(test::rel_err_normwise(*cl[i].bias_grad, *pl[i].bias_grad), 1e-6) << "db " << i;
    const double e = test::rel_err_normwise(*cl[i].weight_grad, *pl[i].weight_grad);
    EXPECT_LE(e, 2e-2) << "dW " << i;
    EXPECT_GT(e, 0.0) << "dW " << i << ": nothing was quantized";
  }
}

INSTANTIATE_TEST_SUITE_P(Impls, DlrmCompression, ::testing::Values(DlrmImpl::reference, DlrmImpl::fused),
                         [](const auto& info) { return std::string(impl_name(info.param)); });

// The same seed gives the same parameters after several steps (the rounding's draws come from the
// seed and the step); the rounding steps travel with the state, so that a resumed run is the
// unbroken one; and another seed rounds otherwise.
TEST(DlrmCompressionRun, ReproducibleAndResumedExactly) {
  SyntheticRun r = synthetic_run(12);
  r.config.compress_activations_bits = 2;
  const DlrmConfig& c = r.config;
  const std::vector<data::Batch>& batches = r.batches;
  const OptimizerConfig opt{.kind = OptimizerKind::adagrad, .learning_rate = 0.05f};
  auto run = [&](Dlrm& m, std::size_t from, std::size_t to) { return train_losses(m, batches, from, to, opt); };
  auto weights = [](Dlrm& m) {
    std::vector<float> v;
    for (const auto& p : m.linear_layers()) {
      const std::vector<float> w = test::to_floats(*p.weight);
      v.insert(v.end(), w.begin(), w.end());
    }
    return v;
  };
  Dlrm a(c, Device::cpu()), b(c, Device::cpu());
  const std::vector<double> all = run(a, 0, 12);
  EXPECT_EQ(run(b, 0, 12), all);
  EXPECT_EQ(weights(a), weights(b));
  DlrmConfig other = c;
  other.seed = 6;
  Dlrm d(other, Device::cpu());
  std::stringstream from_a;
  Dlrm first(c, Device::cpu());
  run(first, 0, 6);
  first.save_state(from_a);
  const std::string saved = from_a.str();
  std::stringstream s1(saved), s2(saved);
  d.load_state(s1);  // the same parameters, but its own seed's roundings
  Dlrm resumed(c, Device::cpu());
  resumed.load_state(s2);
  const std::vector<double> rest = run(resumed, 6, 12);
  for (std::size_t k = 0; k < 6; ++k) EXPECT_EQ(rest[k], all[6 + k]) << "step " << 6 + k;
  EXPECT_EQ(weights(resumed), weights(a));
  run(d, 6, 12);
  EXPECT_NE(weights(d), weights(a));
  // A state saved without compression loads (the rounding starts at step 0), and the other way.
  DlrmConfig plain = c;
  plain.compress_activations_bits = 0;
  Dlrm u(plain, Device::cpu());
  std::stringstream su, s3(saved);
  u.save_state(su);
  Dlrm fresh(c, Device::cpu());
  EXPECT_NO_THROW(fresh.load_state(su));
  EXPECT_NO_THROW(u.load_state(s3));
  // The steps are the stream's last four floats: a value that is no step is refused.
  std::string bad = saved;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(bad.data() + bad.size() - 4, &nan, 4);
  std::stringstream s4(bad);
  test::expect_arg_error([&] { fresh.load_state(s4); }, "models::Dlrm::load_state", "in");
}

// The bytes the MLPs keep for the backward, for the Kaggle model's MLPs at batch 32768: the
// packed inputs take bits/32 of the f32 ones, plus the statistics, the masks and the rows'
// rounding up to whole groups (the top MLP's 367 inputs are 384 packed values).
TEST(DlrmCompressionRun, KeptBytesAreAboutBitsOverThirtyTwo) {
  DlrmConfig c;
  c.table_rows.assign(26, 4);
  const std::int64_t b = 32768;
  const Dlrm plain(c, Device::cpu());
  const nn::MLP::SavedActivationBytes u = plain.mlp_activation_bytes(b);
  // CPU: no padding; bottom inputs 13, 512, 256, 64; top 367, 512, 256.
  EXPECT_EQ(u.whole, static_cast<std::size_t>(b) * (13 + 512 + 256 + 64 + 367 + 512 + 256) * 4);
  EXPECT_EQ(u.kept, u.whole);
  for (int bits : {8, 4, 2}) {
    c.compress_activations_bits = bits;
    const Dlrm packed(c, Device::cpu());
    const nn::MLP::SavedActivationBytes p = packed.mlp_activation_bytes(b);
    EXPECT_EQ(p.whole, u.whole);
    const double ratio = static_cast<double>(p.kept) / static_cast<double>(p.whole);
    std::printf("Kaggle MLPs at batch %lld, %d bits: kept %.1f of %.1f MB (%.3f); scratch %.1f MB (uncompressed %.1f)\n",
                static_cast<long long>(b), bits, p.kept / 1e6, p.whole / 1e6, ratio, p.scratch / 1e6, u.scratch / 1e6);
    EXPECT_GE(ratio, bits / 32.0);
    EXPECT_LE(ratio, bits / 32.0 * 1.1 + 1 / 32.0 + 0.01) << bits;
    // The f32 scratch (two buffers: 512 wide for the even layers, 256 for the odd ones, shared by
    // both MLPs) and dz: less than the uncompressed hidden gradients with the kept activations.
    EXPECT_LT(p.kept + p.scratch, u.kept + u.scratch) << bits;
  }
}

TEST(DlrmCompressionRun, BadSettingsRaiseErrors) {
  DlrmConfig c = tiny_config(InteractionOp::dot);
  for (int bits : {1, 3, 16, -2}) {
    c.compress_activations_bits = bits;
    test::expect_arg_error([&] { Dlrm m(c, Device::cpu()); }, "models::DlrmConfig", "compress_activations_bits");
  }
  c.compress_activations_bits = 4;
  c.fused_mlp = true;
  test::expect_arg_error([&] { Dlrm m(c, Device::cpu(), DlrmImpl::fused); }, "models::DlrmConfig",
                         "compress_activations_bits");
}

}  // namespace
}  // namespace fk::models
