// The distributed path in one process (the build without MPI runs these): the size-1
// communicator, and DistributedDlrm over it against the one-process Dlrm.
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <sstream>

#include "distributed_run.hpp"
#include "fusekit/dist/communicator.hpp"
#include "test_util.hpp"

namespace fk::dist {
namespace {

TEST(SingleCommunicator, CopiesAndChecks) {
  auto comm = make_single_communicator();
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_EQ(comm->size(), 1);
  EXPECT_EQ(comm->backend(), "single");
  std::vector<float> send{1, 2, 3}, recv(3, 0);
  const std::vector<std::int64_t> three{3};
  comm->all_to_all_v(TensorView(send.data(), DType::f32, {3}, Device::cpu()), three,
                     TensorView(recv.data(), DType::f32, {3}, Device::cpu()), three);
  EXPECT_EQ(recv, send);
  comm->all_reduce_sum(TensorView(send.data(), DType::f32, {3}, Device::cpu()));
  EXPECT_EQ(send, (std::vector<float>{1, 2, 3}));
  std::vector<std::int64_t> counts{7}, got{0};
  comm->exchange_counts(counts, got);
  EXPECT_EQ(got[0], 7);
  const std::vector<std::int64_t> four{4};
  test::expect_arg_error([&] {
    comm->all_to_all_v(TensorView(send.data(), DType::f32, {3}, Device::cpu()), four,
                       TensorView(recv.data(), DType::f32, {3}, Device::cpu()), four);
  }, "dist::Communicator::all_to_all_v", "send_counts");
  std::vector<std::int32_t> ints(3);
  test::expect_arg_error([&] {
    comm->all_to_all_v(TensorView(send.data(), DType::f32, {3}, Device::cpu()), three,
                       TensorView(ints.data(), DType::i32, {3}, Device::cpu()), three);
  }, "dist::Communicator::all_to_all_v", "recv");
  test::expect_arg_error([&] { comm->all_reduce_sum(TensorView(ints.data(), DType::i32, {3}, Device::cpu())); },
                         "dist::Communicator::all_reduce_sum", "data");
}

// Only in a build without NCCL: calling the factories here would make this program need
// libnccl.so.2 to start (dist_nccl_test tests them in a build with NCCL).
#if !FUSEKIT_WITH_NCCL
TEST(NcclCommunicator, WithoutNcclTheFactoriesSayHowToGetIt) {
  EXPECT_FALSE(built_with_nccl());
  test::expect_arg_error([] { make_nccl_communicator(make_single_communicator()); }, "dist::make_nccl_communicator",
                         "build");
  test::expect_arg_error([] { make_nccl_communicators(std::vector<int>{0}); }, "dist::make_nccl_communicators",
                         "build");
}
#endif

class OneRank : public ::testing::TestWithParam<test::DistCase> {};

TEST_P(OneRank, DistributedDlrmFollowsTheOneProcessModel) {
  auto comm = make_single_communicator();
  test::compare_with_one_process(GetParam(), *comm);
}

INSTANTIATE_TEST_SUITE_P(Cases, OneRank, ::testing::ValuesIn(test::dist_cases()),
                         [](const auto& info) { return test::dist_case_name(info.param); });

TEST(ShardedEmbeddingBags, RowWiseShardsFollowTheOneProcessLayer) {
  auto comm = make_single_communicator();
  test::compare_sharded_bags(*comm, {.kind = nn::OptimizerKind::sgd, .learning_rate = 0.1f}, false);
  test::compare_sharded_bags(*comm, {.kind = nn::OptimizerKind::adagrad, .learning_rate = 0.05f}, true);
}

// Shards without optimizer state (SGD, or Adagrad before its first step) save and load back:
// save_shards once read the state of a collection that had none (a crash in every SGD checkpoint).
TEST(DistributedDlrm, ShardsWithoutOptimizerStateSaveAndLoad) {
  auto comm = make_single_communicator();
  for (const bool sgd_steps : {true, false}) {
    const test::DistCase dc{sgd_steps ? models::InteractionOp::dot : models::InteractionOp::dcn, false,
                            models::DlrmImpl::fused, 14};
    const data::Featurizer feat = test::dist_featurizer(false);
    const models::DlrmConfig config = test::dist_config(dc, feat);
    const models::OptimizerConfig opt = test::dist_optimizer(dc);
    const dist::ShardingPlan plan = models::plan_dlrm_sharding(config, 1, 30, opt.kind, {}, {.max_shard_rows = 14});
    models::DistributedDlrm saved(config, *comm, plan), loaded(config, *comm, plan);
    if (sgd_steps) {
      data::SyntheticConfig sc;
      std::vector<data::RawRecord> recs(30);
      data::SyntheticCriteo(sc).generate(0, recs);
      data::Batch b;
      data::make_batch(recs, feat, b);
      saved.train_step({b.dense, b.indices, b.offsets}, b.labels, opt);
    }
    std::stringstream shards;
    saved.save_shards(shards);
    loaded.load_shards(shards);
    for (std::size_t s = 0; s < saved.embeddings().local_shards().size(); ++s) {
      const Tensor& a = saved.embeddings().shard_values(s);
      const Tensor& b = loaded.embeddings().shard_values(s);
      EXPECT_EQ(std::memcmp(a.data(), b.data(), a.nbytes()), 0) << (sgd_steps ? "sgd" : "untrained") << " shard " << s;
    }
  }
}

TEST(DistributedDlrm, PlansThatDoNotFitAreRefused) {
  auto comm = make_single_communicator();
  const data::Featurizer feat = test::dist_featurizer(false);
  const models::DlrmConfig config = test::dist_config({models::InteractionOp::dot, false, models::DlrmImpl::reference}, feat);
  std::vector<TableInfo> tables;
  for (std::int64_t r : config.table_rows) tables.push_back({r, config.embedding_dim, 1});
  const ShardingPlan two = plan_sharding(tables, 2, {.batch = 8});
  test::expect_arg_error([&] { models::DistributedDlrm m(config, *comm, two); }, "dist::ShardedEmbeddingBags", "plan");
  ShardingPlan gap = plan_sharding(tables, 1, {.batch = 8, .max_shard_rows = 16});
  gap.tables[0].erase(gap.tables[0].begin());  // table 0's first rows on no rank
  test::expect_arg_error([&] { models::DistributedDlrm m(config, *comm, gap); }, "dist::ShardedEmbeddingBags", "plan");
  std::vector<std::int64_t> rows;
  for (const TableInfo& t : tables) rows.push_back(t.rows);
  const ShardingPlan split = plan_sharding(tables, 1, {.batch = 8, .max_shard_rows = 16});
  test::expect_arg_error([&] {
    ShardedEmbeddingBags m(rows, config.embedding_dim, {.pooling = Pooling::mean}, {}, split, *comm);
  }, "dist::ShardedEmbeddingBags", "plan");
}

TEST(DistributedDlrm, SixteenBitTablesFollowTheOneProcessModel) {
  auto comm = make_single_communicator();
  for (const DType dt : {DType::bf16, DType::f16}) test::compare_sixteen_bit_with_one_process(*comm, dt);
}

// test::check_saved_state_resumes on the CPU (dist_nccl_dlrm_test runs it on a GPU).
TEST(DistributedDlrm, SavedStateResumesAndPredictionsFollow) {
  auto comm = make_single_communicator();
  test::check_saved_state_resumes(*comm, Device::cpu());
}

// The host views the step reads or writes through raw pointers are checked against the batch,
// naming the argument: labels and probabilities of another size or of no memory, and inputs the
// distributed model does not route.
TEST(DistributedDlrm, HostViewsOfTheWrongSizeAreRefused) {
  auto comm = make_single_communicator();
  const test::DistCase dc{models::InteractionOp::dot, false, models::DlrmImpl::reference};
  const data::Featurizer feat = test::dist_featurizer(false);
  const models::DlrmConfig config = test::dist_config(dc, feat);
  const models::OptimizerConfig opt = test::dist_optimizer(dc);
  models::DistributedDlrm m(config, *comm, models::plan_dlrm_sharding(config, 1, 8, opt.kind));
  data::SyntheticConfig sc;
  std::vector<data::RawRecord> recs(8);
  data::SyntheticCriteo(sc).generate(0, recs);
  data::Batch b;
  data::make_batch(recs, feat, b);
  const char* op = "models::DistributedDlrm";
  const TensorView short_labels = b.labels.view().slice_rows(0, 7);
  test::expect_arg_error([&] { m.train_step({b.dense, b.indices, b.offsets}, short_labels, opt); }, op, "labels");
  test::expect_arg_error([&] { m.train_step({b.dense, b.indices, b.offsets}, TensorView(), opt); }, op, "labels");
  Tensor probs = Tensor::empty({9}, DType::f32, Device::cpu());
  test::expect_arg_error([&] { m.predict({b.dense, b.indices, b.offsets}, probs); }, op, "probabilities");
  test::expect_arg_error([&] { m.predict({b.dense, b.indices, b.offsets}, TensorView(nullptr, DType::f32, {8}, Device::cpu())); }, op,
                         "probabilities");
  test::expect_arg_error([&] { m.predict({b.dense, b.indices, b.offsets, b.raw_sparse}, probs.view().slice_rows(0, 8)); },
                         op, "input");
  EXPECT_NO_THROW(m.train_step({b.dense, b.indices, b.offsets}, b.labels, opt));
}

}  // namespace
}  // namespace fk::dist
