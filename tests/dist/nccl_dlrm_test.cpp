// The distributed DLRM on GPUs through the NCCL communicator (dist_nccl_dlrm_test; a build with
// NCCL). One GPU: a 1-rank communicator, DistributedDlrm on cuda:0 against the single-GPU model
// (the fused and the reference implementation, dot and DCNv2, one-hot and multi-hot, table-wise
// and row-split tables) on the same batches, ShardedEmbeddingBags against the CPU layer, a saved
// state that resumes bit for bit, and predictions. Two GPUs or more (up to 4): one thread and
// communicator a GPU, each rank against the one-process model on its GPU. A test without the
// GPUs it needs skips, saying why.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <sstream>
#include <thread>

#include "distributed_run.hpp"
#include "fusekit/dist/communicator.hpp"
#include "test_util.hpp"

namespace fk::dist {
namespace {

#define FK_SKIP_WITHOUT_GPUS(n)                                                                        \
  do {                                                                                                  \
    if (cuda_device_count() < (n))                                                                      \
      GTEST_SKIP() << "needs " << (n) << " GPU(s), found " << cuda_device_count()                       \
                   << (cuda_device_count() == 0 ? ": " + cuda_unavailable_reason() : std::string());   \
  } while (0)

// One rank on cuda:0, made once for the whole program (NCCL's set-up takes a while).
Communicator& one_gpu() {
  static std::unique_ptr<Communicator> comm = std::move(make_nccl_communicators(std::vector<int>{0}).front());
  return *comm;
}

// Runs f on one thread a communicator, all at once (NCCL needs every rank's call in flight).
void on_every_rank(std::vector<std::unique_ptr<Communicator>>& comms, const std::function<void(Communicator&)>& f) {
  std::vector<std::thread> threads;
  for (auto& c : comms)
    threads.emplace_back([&f, comm = c.get()] {
      try {
        f(*comm);
      } catch (const std::exception& e) {
        ADD_FAILURE() << "rank " << comm->rank() << ": " << e.what();
      }
    });
  for (auto& t : threads) t.join();
}

class OneGpu : public ::testing::TestWithParam<test::DistCase> {};

TEST_P(OneGpu, DistributedDlrmFollowsTheSingleGpuModel) {
  FK_SKIP_WITHOUT_GPUS(1);
  test::compare_with_one_process(GetParam(), one_gpu(), Device::cuda(0));
}

INSTANTIATE_TEST_SUITE_P(Cases, OneGpu, ::testing::ValuesIn(test::dist_cases()),
                         [](const auto& info) { return test::dist_case_name(info.param); });

TEST(OneGpuShardedBags, RowWiseShardsFollowTheCpuLayer) {
  FK_SKIP_WITHOUT_GPUS(1);
  test::compare_sharded_bags(one_gpu(), {.kind = nn::OptimizerKind::sgd, .learning_rate = 0.1f}, false);
  test::compare_sharded_bags(one_gpu(), {.kind = nn::OptimizerKind::adagrad, .learning_rate = 0.05f}, true);
  test::compare_sharded_bags(one_gpu(), {.kind = nn::OptimizerKind::adagrad, .learning_rate = 0.05f}, false);
}

// Split tables with row-wise Adagrad: a state saved after 3 steps (dense part and shards, from
// the GPU) and loaded into a fresh model continues bit for bit; and the trained model's
// probabilities are the single-GPU model's within the comparison's tolerance.
TEST(OneGpuDistributedDlrm, SavedStateResumesAndPredictionsFollow) {
  FK_SKIP_WITHOUT_GPUS(1);
  Communicator& c = one_gpu();
  const test::DistCase dc{models::InteractionOp::dcn, true, models::DlrmImpl::fused, 11};
  const data::Featurizer feat = test::dist_featurizer(true);
  const models::DlrmConfig config = test::dist_config(dc, feat);
  const models::OptimizerConfig opt = test::dist_optimizer(dc);
  const auto plan = [&] {
    return models::plan_dlrm_sharding(config, 1, 30, opt.kind, feat.multi_hot_sizes, {.max_shard_rows = 11});
  };
  models::DistributedDlrm straight(config, c, plan()), resumed(config, c, plan());
  models::Dlrm one(config, Device::cuda(0), models::DlrmImpl::fused);
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
    const Tensor a = test::host_copy(straight.embeddings().shard_values(s));
    const Tensor b = test::host_copy(resumed.embeddings().shard_values(s));
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.nbytes()), 0) << "shard " << s;
  }
  const data::Batch b = batch(6);
  Tensor p_dist = Tensor::empty({30}, DType::f32, Device::cpu()), p_one = Tensor::empty({30}, DType::f32, Device::cpu());
  straight.predict({b.dense, b.indices, b.offsets}, p_dist);
  one.predict({b.dense, b.indices, b.offsets}, p_one);
  double worst = 0;
  test::expect_close(p_dist, p_one, test::kDistAtol, test::kDistRtol, "probabilities", worst);
}

// Every GPU up to 4, a thread and an NCCL communicator each: every rank against the one-process
// model, which each rank trains on its own GPU.
TEST(ThreadsAGpu, DistributedDlrmFollowsTheOneProcessModel) {
  FK_SKIP_WITHOUT_GPUS(2);
  const int n = std::min(cuda_device_count(), 4);
  std::vector<int> devices(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) devices[static_cast<std::size_t>(r)] = r;
  auto comms = make_nccl_communicators(devices);
  for (const test::DistCase& dc : test::dist_cases())
    on_every_rank(comms, [&](Communicator& c) { test::compare_with_one_process(dc, c, c.device()); });
  on_every_rank(comms, [](Communicator& c) {
    test::compare_sharded_bags(c, {.kind = nn::OptimizerKind::sgd, .learning_rate = 0.1f}, false);
    test::compare_sharded_bags(c, {.kind = nn::OptimizerKind::adagrad, .learning_rate = 0.05f}, true);
  });
}

}  // namespace
}  // namespace fk::dist
