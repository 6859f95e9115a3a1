// The distributed DLRM against the one-process model, shared by the single-process test
// (dist_test), the MPI one (dist_mpi_test, under mpirun) and the NCCL one (dist_nccl_dlrm_test: a
// GPU a rank, a thread each): the same tiny model, the same global batches of synthetic records;
// each rank trains DistributedDlrm (on its communicator's device) on its slice of every global
// batch and trains the one-process Dlrm (on the CPU, or on a GPU) on the whole batches itself,
// then compares the losses, the dense parameters and the tables it owns.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <span>
#include <string>
#include <vector>

#include "fusekit/data/criteo.hpp"
#include "fusekit/dist/communicator.hpp"
#include "fusekit/dist/sharded_embeddings.hpp"
#include "fusekit/dist/sharding.hpp"
#include "fusekit/nn/recsys.hpp"
#include "fusekit/models/dlrm.hpp"
#include "fusekit/models/dlrm_distributed.hpp"

namespace fk::test {

struct DistCase {
  models::InteractionOp op;
  bool multi_hot;
  models::DlrmImpl impl;
  std::int64_t max_shard_rows = 0;  // > 0: tables with more rows split by rows (0: table-wise)
};

inline std::string dist_case_name(const DistCase& c) {
  return std::string(models::interaction_op_name(c.op)) + (c.multi_hot ? "_multihot_" : "_onehot_") +
         std::string(models::impl_name(c.impl)) +
         (c.max_shard_rows > 0 ? "_rows" + std::to_string(c.max_shard_rows) : std::string());
}

// Table-wise, then row-wise: at most 14 rows a shard (the 40-row tables in 3 shards of 13, 13 and
// 14 rows; 27 rows as 13 + 14, 15 as 7 + 8) and at most 11 (40 rows in 4 shards, 27 in 3); the
// tables of 10 rows and fewer stay whole.
inline std::vector<DistCase> dist_cases() {
  std::vector<DistCase> v;
  for (auto op : {models::InteractionOp::dot, models::InteractionOp::dcn})
    for (bool mh : {false, true})
      for (auto impl : {models::DlrmImpl::reference, models::DlrmImpl::fused}) v.push_back({op, mh, impl});
  for (std::int64_t rows : {14, 11})
    for (auto op : {models::InteractionOp::dot, models::InteractionOp::dcn})
      for (bool mh : {false, true}) v.push_back({op, mh, models::DlrmImpl::fused, rows});
  v.push_back({models::InteractionOp::dcn, true, models::DlrmImpl::reference, 14});
  return v;
}

// The most ranks any one table is spread over.
inline int widest_split(const dist::ShardingPlan& plan) {
  int widest = 0;
  for (const auto& shards : plan.tables) {
    std::vector<int> ranks;
    for (const dist::Shard& s : shards) ranks.push_back(s.rank);
    std::sort(ranks.begin(), ranks.end());
    widest = std::max(widest, static_cast<int>(std::unique(ranks.begin(), ranks.end()) - ranks.begin()));
  }
  return widest;
}

// A host copy of a tensor on any device (a padded GPU weight's rows come back contiguous).
inline Tensor host_copy(const TensorView& t) {
  Tensor h = Tensor::empty(t.shape(), t.dtype(), Device::cpu());
  copy(h, t);
  return h;
}

// Rows [begin, end) of a host table [rows, D], as a view.
inline TensorView table_rows(const Tensor& table, std::int64_t begin, std::int64_t end) {
  const std::int64_t d = table.size(1);
  return TensorView(const_cast<float*>(table.data_as<const float>()) + begin * d, DType::f32, {end - begin, d},
                    Device::cpu());
}

// Global batches of 30 (uneven slices on 4 ranks: 8, 8, 7, 7); tables capped at 40 rows so that
// the batches touch rows more than once; multi-hot: the MLPerf bag sizes (100 rows in table 20).
constexpr std::int64_t kGlobalBatch = 30;
constexpr int kSteps = 4;

inline data::Featurizer dist_featurizer(bool multi_hot) {
  data::Featurizer feat;
  feat.max_ind_range = 40;
  if (multi_hot)
    feat.multi_hot_sizes = {3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1};
  return feat;
}

// dot: SGD; dcn: Adagrad with row-wise Adagrad for the tables (the MLPerf recipe's optimizers).
inline models::DlrmConfig dist_config(const DistCase& c, const data::Featurizer& feat) {
  models::DlrmConfig m;
  m.bottom_mlp = {13, 16, 8};
  m.embedding_dim = 8;
  m.top_mlp = {16, 1};
  m.table_rows = feat.table_rows();
  m.interaction = c.op;
  m.dcn_num_layers = 2;
  m.dcn_low_rank_dim = 4;
  m.rowwise_adagrad = c.op == models::InteractionOp::dcn;
  m.seed = 11;
  // GPU: fp32 GEMMs, so that the fp32 tolerance below holds (TF32 rounds a GEMM's inputs to 10
  // bits: an fp32 rounding difference upstream can then move a product by 2^-11).
  m.allow_tf32 = false;
  return m;
}

inline models::OptimizerConfig dist_optimizer(const DistCase& c) {
  if (c.op == models::InteractionOp::dcn) return {.kind = models::OptimizerKind::adagrad, .learning_rate = 0.01f};
  return {.kind = models::OptimizerKind::sgd, .learning_rate = 0.1f};
}

// Rank r's samples of a batch of n: the first n % ranks ranks one more.
inline std::pair<std::int64_t, std::int64_t> slice_of(std::int64_t n, int rank, int ranks) {
  const std::int64_t base = n / ranks, extra = n % ranks;
  const std::int64_t begin = rank * base + std::min<std::int64_t>(rank, extra);
  return {begin, begin + base + (rank < extra ? 1 : 0)};
}

// |got - ref| <= atol + rtol |ref| (tensors on any device); records the worst ratio of error to
// bound in `worst`.
inline void expect_close(const TensorView& got_any, const TensorView& ref_any, double atol, double rtol,
                         const std::string& what, double& worst) {
  ASSERT_EQ(got_any.numel(), ref_any.numel()) << what;
  const Tensor got = host_copy(got_any), ref = host_copy(ref_any);
  const auto* g = got.data_as<const float>();
  const auto* r = ref.data_as<const float>();
  std::int64_t bad = 0;
  for (std::int64_t i = 0; i < got.numel(); ++i) {
    const double err = std::fabs(static_cast<double>(g[i]) - r[i]);
    const double bound = atol + rtol * std::fabs(static_cast<double>(r[i]));
    worst = std::max(worst, err / bound);
    if (!(err <= bound) && bad++ < 3) ADD_FAILURE() << what << "[" << i << "]: " << g[i] << " vs " << r[i];
  }
}

// The comparison's tolerance. The distributed step computes the one-process step's arithmetic in
// another order: each weight gradient is N partial sums over the slices, added by the all-reduce,
// instead of one sum over the batch; the losses' mean likewise. Each such sum differs by a few
// f32 roundings (2^-24 relative each) of its terms' magnitude, and 4 steps carry them on (Adagrad
// divides by the root of the summed squares, which keeps them relative). 1e-5 relative with 1e-6
// absolute (parameters of order 0.1-1) leaves a margin of about 20x over what these runs show (the
// worst error is 0.043 of the bound, on 4 ranks; each case prints its own). On GPUs (fp32 GEMMs)
// the same argument holds for the same arithmetic, with one more difference: the one-process GPU
// model computes its loss gradient on the GPU, the distributed one on the host (a rounding of
// (p - y) / B apart).
constexpr double kDistAtol = 1e-6, kDistRtol = 1e-5;

// Trains `dist` on this rank's slices and `one` on the whole global batches, kSteps steps of the
// same synthetic records (`seed`), expecting the same losses within the comparison's tolerance
// (kDistAtol, kDistRtol, above); returns the worst loss error over its tolerance.
inline double train_side_by_side(models::DistributedDlrm& dist, models::Dlrm& one, const data::Featurizer& feat,
                                 const models::OptimizerConfig& opt, const dist::Communicator& comm,
                                 std::uint64_t seed) {
  data::SyntheticConfig sc;
  sc.seed = seed;
  std::vector<data::RawRecord> recs(static_cast<std::size_t>(kGlobalBatch * kSteps));
  data::SyntheticCriteo(sc).generate(0, recs);
  const auto [begin, end] = slice_of(kGlobalBatch, comm.rank(), comm.size());
  double worst = 0;
  for (int k = 0; k < kSteps; ++k) {
    const auto global = std::span(recs).subspan(static_cast<std::size_t>(k * kGlobalBatch), kGlobalBatch);
    data::Batch whole, mine;
    data::make_batch(global, feat, whole);
    data::make_batch(global.subspan(static_cast<std::size_t>(begin), static_cast<std::size_t>(end - begin)), feat, mine);
    const double l1 = one.train_step({whole.dense, whole.indices, whole.offsets}, whole.labels, opt);
    const double ln = dist.train_step({mine.dense, mine.indices, mine.offsets}, mine.labels, opt);
    EXPECT_NEAR(ln, l1, kDistAtol + kDistRtol * std::fabs(l1)) << "step " << k;
    worst = std::max(worst, std::fabs(ln - l1) / (kDistAtol + kDistRtol * std::fabs(l1)));
  }
  return worst;
}

// `one`: where the one-process model runs (the CPU's spec, or a GPU: the single-GPU model).
inline void compare_with_one_process(const DistCase& c, dist::Communicator& comm, Device one_device = Device::cpu()) {
  const data::Featurizer feat = dist_featurizer(c.multi_hot);
  const models::DlrmConfig config = dist_config(c, feat);
  const models::OptimizerConfig opt = dist_optimizer(c);
  const std::vector<std::int64_t> bags =
      c.multi_hot ? feat.multi_hot_sizes : std::vector<std::int64_t>{};
  models::DistributedDlrm dist(
      config, comm,
      models::plan_dlrm_sharding(config, comm.size(), kGlobalBatch, opt.kind, bags, {.max_shard_rows = c.max_shard_rows}),
      c.impl);
  models::Dlrm one(config, one_device, c.impl);
  double worst = train_side_by_side(dist, one, feat, opt, comm, 21);
  auto dl = dist.dense().linear_layers();
  auto ol = one.linear_layers();
  ASSERT_EQ(dl.size(), ol.size());
  for (std::size_t l = 0; l < dl.size(); ++l) {
    expect_close(*dl[l].weight, *ol[l].weight, kDistAtol, kDistRtol, "linear " + std::to_string(l) + " weight", worst);
    expect_close(*dl[l].bias, *ol[l].bias, kDistAtol, kDistRtol, "linear " + std::to_string(l) + " bias", worst);
  }
  auto dc = dist.dense().cross_parameters();
  auto oc = one.cross_parameters();
  ASSERT_EQ(dc.size(), oc.size());
  for (std::size_t p = 0; p < dc.size(); ++p)
    expect_close(*dc[p].value, *oc[p].value, kDistAtol, kDistRtol, "cross parameter " + std::to_string(p), worst);
  std::vector<Tensor> tables;
  for (const Tensor* t : one.tables()) tables.push_back(host_copy(*t));
  const std::vector<dist::Shard>& shards = dist.embeddings().local_shards();
  std::vector<int> shard_tables;
  for (std::size_t s = 0; s < shards.size(); ++s) {
    const dist::Shard& sh = shards[s];
    EXPECT_EQ(sh.rank, comm.rank());
    shard_tables.push_back(sh.table);
    expect_close(dist.embeddings().shard_values(s),
                 table_rows(tables[static_cast<std::size_t>(sh.table)], sh.row_begin, sh.row_end), kDistAtol, kDistRtol,
                 "table " + std::to_string(sh.table) + " rows [" + std::to_string(sh.row_begin) + ", " +
                     std::to_string(sh.row_end) + ")",
                 worst);
  }
  shard_tables.erase(std::unique(shard_tables.begin(), shard_tables.end()), shard_tables.end());
  EXPECT_EQ(shard_tables, dist.plan().tables_of(comm.rank()));
  // Row-wise cases spread a table over every rank up to 4 (the 40-row tables' 3 or 4 shards).
  const int widest = widest_split(dist.plan());
  if (c.max_shard_rows > 0 && comm.size() > 1) {
    EXPECT_FALSE(dist.plan().table_wise());
    EXPECT_EQ(widest, std::min(comm.size(), c.max_shard_rows == 14 ? 3 : 4)) << dist.plan().str();
  }
  std::printf("rank %d/%d (%s) %s: %zu shards here, a table over at most %d ranks; worst error / tolerance %.3g\n",
              comm.rank(), comm.size(), comm.device().str().c_str(), dist_case_name(c).c_str(), shards.size(), widest,
              worst);
}

// The dense gradients all-reduced in buckets as the backward makes them against one all-reduce
// after the backward: the same model, plan and slices trained kSteps steps with
// DistributedDlrmOptions::bucket_bytes 0 (one all-reduce), 1 (each layer's gradients a bucket of
// their own), 2048 (the bottom MLP's two layers, 768 + 1280 bytes with their alignment, in one) and 2^40 (one bucket). Each gradient is summed
// by one all-reduce either way: `bitwise`, the losses, dense parameters and shards must hold the
// same bits (what a backend whose sum of an element does not depend on the buffer around it
// gives: one rank, two ranks, whose sum a + b is the same in either order); otherwise within the
// distributed comparison's tolerance (more ranks under MPI, whose algorithm, and so its order of
// the additions, may change with the message size).
// Split tables with row-wise Adagrad on comm's device: a state saved after 3 steps (dense part and
// shards) and loaded into a fresh model continues bit for bit, and the trained model's
// probabilities follow the one-process model's (on one_device) within the comparison's tolerance.
inline void check_saved_state_resumes(dist::Communicator& comm, Device one_device) {
  const DistCase dc{models::InteractionOp::dcn, true, models::DlrmImpl::fused, 11};
  const data::Featurizer feat = dist_featurizer(true);
  const models::DlrmConfig config = dist_config(dc, feat);
  const models::OptimizerConfig opt = dist_optimizer(dc);
  const auto plan = [&] {
    return models::plan_dlrm_sharding(config, 1, 30, opt.kind, feat.multi_hot_sizes, {.max_shard_rows = 11});
  };
  models::DistributedDlrm straight(config, comm, plan()), resumed(config, comm, plan());
  models::Dlrm one(config, one_device, models::DlrmImpl::fused);
  data::SyntheticConfig sc;
  sc.seed = 7;
  std::vector<data::RawRecord> recs(210);
  data::SyntheticCriteo(sc).generate(0, recs);
  const auto batch = [&](int k) {
    data::Batch b;
    data::make_batch(std::span(recs).subspan(static_cast<std::size_t>(30 * k), 30), feat, b);
    return b;
  };
  for (int k = 0; k < 3; ++k) {
    const data::Batch b = batch(k);
    straight.train_step({b.dense, b.indices, b.offsets}, b.labels, opt);
    one.train_step({b.dense, b.indices, b.offsets}, b.labels, opt);
  }
  std::stringstream dense, shards;
  straight.dense().save_state(dense);
  straight.save_shards(shards);
  resumed.dense().load_state(dense);
  resumed.load_shards(shards);
  for (int k = 3; k < 6; ++k) {
    const data::Batch b = batch(k);
    EXPECT_EQ(resumed.train_step({b.dense, b.indices, b.offsets}, b.labels, opt),
              straight.train_step({b.dense, b.indices, b.offsets}, b.labels, opt))
        << "step " << k;
    one.train_step({b.dense, b.indices, b.offsets}, b.labels, opt);
  }
  for (std::size_t s = 0; s < straight.embeddings().local_shards().size(); ++s) {
    const Tensor a = host_copy(straight.embeddings().shard_values(s));
    const Tensor b = host_copy(resumed.embeddings().shard_values(s));
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.nbytes()), 0) << "shard " << s;
  }
  const data::Batch b = batch(6);
  Tensor p_dist = Tensor::empty({30}, DType::f32, Device::cpu()), p_one = Tensor::empty({30}, DType::f32, Device::cpu());
  straight.predict({b.dense, b.indices, b.offsets}, p_dist);
  one.predict({b.dense, b.indices, b.offsets}, p_one);
  double worst = 0;
  expect_close(p_dist, p_one, kDistAtol, kDistRtol, "probabilities", worst);
}

inline void compare_gradient_buckets(dist::Communicator& comm, const DistCase& c, bool bitwise) {
  const data::Featurizer feat = dist_featurizer(c.multi_hot);
  const models::DlrmConfig config = dist_config(c, feat);
  const models::OptimizerConfig opt = dist_optimizer(c);
  const std::vector<std::int64_t> bags = c.multi_hot ? feat.multi_hot_sizes : std::vector<std::int64_t>{};
  data::SyntheticConfig sc;
  sc.seed = 23;
  std::vector<data::RawRecord> recs(static_cast<std::size_t>(kGlobalBatch * kSteps));
  data::SyntheticCriteo(sc).generate(0, recs);
  // (not a structured binding: the lambda below captures them, which clang 14 refuses)
  const std::pair<std::int64_t, std::int64_t> slice = slice_of(kGlobalBatch, comm.rank(), comm.size());
  const std::int64_t begin = slice.first, end = slice.second;
  struct Run {
    std::vector<double> losses;
    std::vector<Tensor> params;  // host copies: every linear weight and bias, the cross parameters, the shards
    std::size_t buckets = 0, units = 0;
  };
  const auto train = [&](std::int64_t bucket_bytes) {
    models::DistributedDlrm m(
        config, comm,
        models::plan_dlrm_sharding(config, comm.size(), kGlobalBatch, opt.kind, bags, {.max_shard_rows = c.max_shard_rows}),
        c.impl, {.bucket_bytes = bucket_bytes});
    Run r;
    r.buckets = m.gradient_buckets().size();
    r.units = m.dense().gradient_units().size();
    for (int k = 0; k < kSteps; ++k) {
      data::Batch mine;
      data::make_batch(std::span(recs).subspan(static_cast<std::size_t>(k * kGlobalBatch + begin),
                                               static_cast<std::size_t>(end - begin)),
                       feat, mine);
      r.losses.push_back(m.train_step({mine.dense, mine.indices, mine.offsets}, mine.labels, opt));
    }
    for (const auto& l : m.dense().linear_layers()) {
      r.params.push_back(host_copy(*l.weight));
      r.params.push_back(host_copy(*l.bias));
    }
    for (const auto& p : m.dense().cross_parameters()) r.params.push_back(host_copy(*p.value));
    for (std::size_t s = 0; s < m.embeddings().local_shards().size(); ++s)
      r.params.push_back(host_copy(m.embeddings().shard_values(s)));
    return r;
  };
  const Run once = train(0);
  EXPECT_EQ(once.buckets, 0u);
  const std::size_t layers = config.bottom_mlp.size() - 1 + config.top_mlp.size();  // top: from the interaction
  EXPECT_EQ(once.units, layers + (c.op == models::InteractionOp::dcn ? 1 : 0));
  double worst = 0;
  for (const std::int64_t bytes : {std::int64_t{1}, std::int64_t{2048}, std::int64_t{1} << 40}) {
    const Run run = train(bytes);
    const std::string what = "bucket_bytes " + std::to_string(bytes);
    if (bytes == 1) {
      EXPECT_EQ(run.buckets, run.units) << what;
    } else if (bytes == 2048) {
      EXPECT_LT(run.buckets, run.units) << what;  // the bottom MLP's layers share a bucket
      EXPECT_GT(run.buckets, 1u) << what;
    } else {
      EXPECT_EQ(run.buckets, 1u) << what;
    }
    ASSERT_EQ(run.params.size(), once.params.size());
    for (std::size_t k = 0; k < run.losses.size(); ++k) {
      if (bitwise) {
        EXPECT_EQ(run.losses[k], once.losses[k]) << what << ", step " << k;
      } else {
        EXPECT_NEAR(run.losses[k], once.losses[k], kDistAtol + kDistRtol * std::fabs(once.losses[k])) << what;
      }
    }
    for (std::size_t p = 0; p < run.params.size(); ++p) {
      const Tensor &a = run.params[p], &b = once.params[p];
      ASSERT_EQ(a.nbytes(), b.nbytes());
      if (bitwise) {
        EXPECT_EQ(std::memcmp(a.data(), b.data(), a.nbytes()), 0) << what << ", parameter " << p;
      } else {
        expect_close(a, b, kDistAtol, kDistRtol, what + ", parameter " + std::to_string(p), worst);
      }
    }
  }
  std::printf("rank %d/%d (%s) %s: bucketed all-reduces %s the single all-reduce's (%zu gradient units); worst "
              "error / tolerance %.3g\n",
              comm.rank(), comm.size(), comm.device().str().c_str(), dist_case_name(c).c_str(),
              bitwise ? "bit for bit" : "within tolerance of", once.units, worst);
}

// ShardedEmbeddingBags alone against the one-process nn::EmbeddingBagCollection on hand-made bags:
// tables of 9, 5 and 7 rows cut into shards of at most 3 rows (3 + 3 + 3, 2 + 3, 2 + 2 + 3: uneven),
// a global batch of 7 whose bags hold 0 to 3 ids (empty bags; bags whose ids all fall in one shard,
// bags spread over several; repeated ids). Pooled rows, then the tables after two steps of `opt`
// (SGD, or Adagrad: row-wise when `rowwise`), within the DLRM comparison's tolerance. The sharded
// layer on the communicator's device, the one-process layer on the CPU (the spec).
inline void compare_sharded_bags(dist::Communicator& comm, const nn::OptimizerConfig& opt, bool rowwise) {
  const std::vector<std::int64_t> rows{9, 5, 7};
  constexpr std::int64_t kT = 3, kD = 4, kB = 7;
  const nn::EmbeddingBagCollectionOptions options{.pooling = Pooling::sum, .rowwise_adagrad = rowwise};
  const RandomParams init{17, 3};
  std::vector<dist::TableInfo> infos;
  for (std::int64_t r : rows) infos.push_back({r, kD, 1.5});
  dist::ShardingPlan plan = dist::plan_sharding(infos, comm.size(), {.batch = kB, .max_shard_rows = 3});
  dist::ShardedEmbeddingBags sharded(rows, kD, options, init, plan, comm);
  nn::EmbeddingBagCollection one(rows, kD, options, Device::cpu(), init);
  const auto [begin, end] = slice_of(kB, comm.rank(), comm.size());
  const std::int64_t b = end - begin;
  double worst = 0;
  for (int step = 0; step < 2; ++step) {
    // Bag (t, i): (i + t + step) % 4 ids, id k being (5 i + 3 t + 2 k + step) % rows_t.
    std::vector<std::int64_t> idx, off{0}, my_idx, my_off{0};
    for (std::int64_t t = 0; t < kT; ++t)
      for (std::int64_t i = 0; i < kB; ++i) {
        for (std::int64_t k = 0; k < (i + t + step) % 4; ++k) {
          const std::int64_t id = (5 * i + 3 * t + 2 * k + step) % rows[static_cast<std::size_t>(t)];
          idx.push_back(id);
          if (i >= begin && i < end) my_idx.push_back(id);
        }
        off.push_back(static_cast<std::int64_t>(idx.size()));
        if (i >= begin && i < end) my_off.push_back(static_cast<std::int64_t>(my_idx.size()));
      }
    auto view = [](std::vector<std::int64_t>& v) {
      return TensorView(v.data(), DType::i64, {static_cast<std::int64_t>(v.size())}, Device::cpu());
    };
    Tensor pooled_one = Tensor::empty({kB, kT, kD}, DType::f32, Device::cpu());
    Tensor pooled = Tensor::empty({b, kT, kD}, DType::f32, comm.device());
    one.reserve(static_cast<std::int64_t>(idx.size()));
    one.forward({view(idx), view(off), std::nullopt}, kB, pooled_one);
    sharded.forward(view(my_idx), view(my_off), b, pooled);
    expect_close(pooled, TensorView(pooled_one.data_as<float>() + begin * kT * kD, DType::f32, {b, kT, kD}, Device::cpu()),
                 kDistAtol, kDistRtol, "pooled, step " + std::to_string(step), worst);
    // dpooled: small distinct values; this rank's rows of the global one.
    Tensor grad_one = Tensor::empty({kB, kT, kD}, DType::f32, Device::cpu());
    for (std::int64_t i = 0; i < grad_one.numel(); ++i)
      grad_one.data_as<float>()[i] = 0.01f * static_cast<float>((i * 7) % 13) - 0.05f;
    Tensor grad_host = Tensor::empty({b, kT, kD}, DType::f32, Device::cpu());
    std::copy_n(grad_one.data_as<const float>() + begin * kT * kD, b * kT * kD, grad_host.data_as<float>());
    const Tensor grad = grad_host.copy_to(comm.device());
    one.backward(grad_one);
    sharded.backward(grad);
    if (opt.kind == nn::OptimizerKind::adagrad) {
      one.ensure_state(opt.initial_accumulator);
      sharded.ensure_state(opt.initial_accumulator);
    }
    one.step(opt);
    sharded.step(opt);
  }
  const std::vector<dist::Shard>& shards = sharded.local_shards();
  for (std::size_t s = 0; s < shards.size(); ++s)
    expect_close(sharded.shard_values(s),
                 table_rows(one.tables[static_cast<std::size_t>(shards[s].table)], shards[s].row_begin, shards[s].row_end),
                 kDistAtol, kDistRtol, "table " + std::to_string(shards[s].table) + " shard " + std::to_string(s), worst);
  std::printf("rank %d/%d sharded bags (%s): %zu shards here, worst error / tolerance %.3g\n", comm.rank(), comm.size(),
              opt.kind == nn::OptimizerKind::sgd ? "sgd" : rowwise ? "row-wise adagrad" : "adagrad", shards.size(), worst);
}

// A host tensor of f32, bf16 or f16 values as floats (16-bit values widen exactly).
inline std::vector<float> widened(const TensorView& any) {
  const Tensor h = host_copy(any);
  std::vector<float> v(static_cast<std::size_t>(h.numel()));
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (h.dtype() == DType::bf16) v[i] = static_cast<float>(h.data_as<const bf16>()[i]);
    else if (h.dtype() == DType::f16) v[i] = static_cast<float>(h.data_as<const f16>()[i]);
    else v[i] = h.data_as<const float>()[i];
  }
  return v;
}

// The spacing of 16-bit values at |x|: bf16's 8 significant bits, f16's 11 (2^-24 below its
// normal range).
inline double sixteen_bit_ulp(double x, DType dtype) {
  const int bits = dtype == DType::bf16 ? 8 : 11;
  const int e = x == 0 ? -126 : std::ilogb(x);
  return std::ldexp(1.0, dtype == DType::f16 ? std::max(e, -14) - bits + 1 : e - bits + 1);
}

// 16-bit tables across the ranks (bf16 or f16; DCNv2, multi-hot, row-wise Adagrad, tables split at
// 11 rows) against the one-process model with the same tables, kSteps steps: the shards hold
// `dtype` (half the f32 bytes), and each shard's rows draw their rounding as the one-process
// model's same rows do. So the stored values are the one-process ones wherever the f32 updates
// round the same way; the updates differ only by the order of the dense gradients' sums (the f32
// comparison's 1e-5), which tips a rounding only for an update within that of a 16-bit value's
// rounding threshold: at most one ulp of 16 bits, in at most 1% of the values (the runs show 0-1
// of some 1700 a rank), and the losses within the f32 comparison's tolerance. Rounding with other
// draws (a rank's own) fails both: most values then differ, by up to hundreds of ulps after 4
// steps of row-wise Adagrad (its first steps move a row by about lr whatever the gradient's size,
// so a 1-ulp difference can flip a small gradient's sign), and the losses by about 1e-3.
inline void compare_sixteen_bit_with_one_process(dist::Communicator& comm, DType dtype,
                                                 Device one_device = Device::cpu()) {
  const DistCase dc{models::InteractionOp::dcn, true, models::DlrmImpl::fused, 11};
  const data::Featurizer feat = dist_featurizer(true);
  models::DlrmConfig config = dist_config(dc, feat);
  config.embedding_dtype = dtype;
  const models::OptimizerConfig opt = dist_optimizer(dc);
  models::DistributedDlrm dist(config, comm,
                               models::plan_dlrm_sharding(config, comm.size(), kGlobalBatch, opt.kind,
                                                          feat.multi_hot_sizes, {.max_shard_rows = 11}),
                               dc.impl);
  models::Dlrm one(config, one_device, dc.impl);
  const double worst_loss = train_side_by_side(dist, one, feat, opt, comm, 29);
  const std::vector<Tensor*> tables = one.tables();
  const std::vector<dist::Shard>& shards = dist.embeddings().local_shards();
  std::int64_t differ = 0, values = 0;
  double worst_ulps = 0;
  for (std::size_t s = 0; s < shards.size(); ++s) {
    const dist::Shard& sh = shards[s];
    const Tensor& shard = dist.embeddings().shard_values(s);
    EXPECT_EQ(shard.dtype(), dtype) << "shard " << s;
    const std::vector<float> got = widened(shard);
    const std::vector<float> ref = widened(*tables[static_cast<std::size_t>(sh.table)]);
    const std::int64_t d = config.embedding_dim;
    for (std::int64_t i = 0; i < static_cast<std::int64_t>(got.size()); ++i) {
      const float g = got[static_cast<std::size_t>(i)], r = ref[static_cast<std::size_t>(sh.row_begin * d + i)];
      const double ulps = std::fabs(static_cast<double>(g) - r) /
                          sixteen_bit_ulp(std::max(std::fabs(static_cast<double>(g)), std::fabs(static_cast<double>(r))), dtype);
      if (ulps > 1 && differ < 3)
        ADD_FAILURE() << "table " << sh.table << " row " << sh.row_begin + i / d << ": " << g << " vs " << r << " ("
                      << ulps << " ulps)";
      differ += g != r;
      worst_ulps = std::max(worst_ulps, ulps);
      ++values;
    }
  }
  EXPECT_LE(differ * 100, values) << "values that differ from the one-process model's";
  std::printf("rank %d/%d (%s) %s tables: %zu shards here, %lld of %lld values differ from the one-process model's "
              "(at most %.3g ulps); worst loss error / tolerance %.3g\n",
              comm.rank(), comm.size(), comm.device().str().c_str(), std::string(dtype_name(dtype)).c_str(),
              shards.size(), static_cast<long long>(differ), static_cast<long long>(values), worst_ulps, worst_loss);
}

}  // namespace fk::test
