// The distributed DLRM against the one-process model, shared by the single-process test
// (dist_test) and the MPI one (dist_mpi_test, under mpirun): the same tiny model, the same global
// batches of synthetic records; each rank trains DistributedDlrm on its slice of every global
// batch and trains the one-process Dlrm on the whole batches itself, then compares the losses, the
// dense parameters and the tables it owns.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <span>
#include <string>
#include <vector>

#include "fusekit/data/criteo.hpp"
#include "fusekit/dist/communicator.hpp"
#include "fusekit/models/dlrm.hpp"
#include "fusekit/models/dlrm_distributed.hpp"

namespace fk::test {

struct DistCase {
  models::InteractionOp op;
  bool multi_hot;
  models::DlrmImpl impl;
};

inline std::string dist_case_name(const DistCase& c) {
  return std::string(models::interaction_op_name(c.op)) + (c.multi_hot ? "_multihot_" : "_onehot_") +
         std::string(models::impl_name(c.impl));
}

inline std::vector<DistCase> dist_cases() {
  std::vector<DistCase> v;
  for (auto op : {models::InteractionOp::dot, models::InteractionOp::dcn})
    for (bool mh : {false, true})
      for (auto impl : {models::DlrmImpl::reference, models::DlrmImpl::fused}) v.push_back({op, mh, impl});
  return v;
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

// |got - ref| <= atol + rtol |ref|; records the worst ratio of error to bound in `worst`.
inline void expect_close(const TensorView& got, const TensorView& ref, double atol, double rtol, const std::string& what,
                         double& worst) {
  ASSERT_EQ(got.numel(), ref.numel()) << what;
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
// worst error is 0.043 of the bound, on 4 ranks; each case prints its own).
constexpr double kDistAtol = 1e-6, kDistRtol = 1e-5;

inline void compare_with_one_process(const DistCase& c, dist::Communicator& comm) {
  const data::Featurizer feat = dist_featurizer(c.multi_hot);
  const models::DlrmConfig config = dist_config(c, feat);
  const models::OptimizerConfig opt = dist_optimizer(c);
  const std::vector<std::int64_t> bags =
      c.multi_hot ? feat.multi_hot_sizes : std::vector<std::int64_t>{};
  models::DistributedDlrm dist(config, comm,
                               models::plan_dlrm_sharding(config, comm.size(), kGlobalBatch, opt.kind, bags), c.impl);
  models::Dlrm one(config, Device::cpu(), c.impl);

  data::SyntheticConfig sc;
  sc.seed = 21;
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
  const std::vector<Tensor*> tables = one.tables();
  for (int t : dist.embeddings().local_tables())
    expect_close(*dist.embeddings().table(t), *tables[static_cast<std::size_t>(t)], kDistAtol, kDistRtol,
                 "table " + std::to_string(t), worst);
  EXPECT_EQ(dist.embeddings().local_tables(), dist.plan().tables_of(comm.rank()));
  std::printf("rank %d/%d %s: worst error / tolerance %.3g\n", comm.rank(), comm.size(), dist_case_name(c).c_str(),
              worst);
}

}  // namespace fk::test
