// The distributed DLRM on GPUs through the NCCL communicator (dist_nccl_dlrm_test; a build with
// NCCL). One GPU: a 1-rank communicator, DistributedDlrm on cuda:0 against the single-GPU model
// (the fused and the reference implementation, dot and DCNv2, one-hot and multi-hot, table-wise
// and row-split tables) on the same batches, ShardedEmbeddingBags against the CPU layer, a saved
// state that resumes bit for bit, states of other plans (N -> M, 1 -> M) loaded onto the GPU,
// predictions, and 16-bit tables; the dense gradients' bucketed all-reduces against one all-reduce, and the
// communicator's started all-reduces against the streams they wait for. Two GPUs or more (up to
// 4): one thread and
// communicator a GPU, each rank against the one-process model on its GPU. A test without the
// GPUs it needs skips, saying why.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <sstream>
#include <thread>

#include "distributed_run.hpp"
#include "fusekit/core/stream.hpp"
#include "fusekit/dist/communicator.hpp"
#include "nccl_checks.hpp"
#include "test_util.hpp"

namespace fk::dist {
namespace {


// One rank on cuda:0, made once for the whole program (NCCL's set-up takes a while).
Communicator& one_gpu() {
  static std::unique_ptr<Communicator> comm = std::move(make_nccl_communicators(std::vector<int>{0}).front());
  return *comm;
}

using test::on_every_rank;

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

// The dense gradients' all-reduces in buckets started as the backward makes them (on the
// communicator's stream, after an event of the model's) against one all-reduce after the
// backward: the same bits on one rank.
TEST(OneGpuDistributedDlrm, BucketedAllReducesMatchOneAllReduce) {
  FK_SKIP_WITHOUT_GPUS(1);
  for (const auto impl : {models::DlrmImpl::fused, models::DlrmImpl::reference})
    for (const auto op : {models::InteractionOp::dot, models::InteractionOp::dcn})
      test::compare_gradient_buckets(one_gpu(), {op, true, impl, 11}, true);
}

// start_all_reduce_sum waits for the work queued on `ready` (a 64 MB copy to the buffer) and
// wait_all_reduces makes the copy back on another stream wait for the sums; with n ranks the sum
// of rank r's values (r + 1) * (i % 7) is n (n + 1) / 2 * (i % 7), exact in any order.
void started_all_reduces(Communicator& c) {
  constexpr std::int64_t kN = std::int64_t{1} << 24;
  const int n = c.size();
  std::vector<float> host(static_cast<std::size_t>(kN)), back(static_cast<std::size_t>(kN), -1.0f);
  for (std::int64_t i = 0; i < kN; ++i) host[static_cast<std::size_t>(i)] = static_cast<float>((c.rank() + 1) * (i % 7));
  const Stream ready = Stream::create(c.device()), after = Stream::create(c.device());
  const Tensor d = Tensor::empty({kN}, DType::f32, c.device());
  const TensorView h(host.data(), DType::f32, {kN}, Device::cpu()), b(back.data(), DType::f32, {kN}, Device::cpu());
  copy_async(d, h, ready);
  c.start_all_reduce_sum(d.view().slice_rows(0, kN / 2), &ready);
  c.start_all_reduce_sum(d.view().slice_rows(kN / 2, kN), &ready);
  c.wait_all_reduces(&after);
  copy_async(b, d, after);
  after.synchronize();
  for (std::int64_t i = 0; i < kN; ++i)
    ASSERT_EQ(back[static_cast<std::size_t>(i)], static_cast<float>(n * (n + 1) / 2 * (i % 7))) << "rank " << c.rank() << ", " << i;
  // Without a stream the host waits.
  copy_async(d, h, ready);
  c.start_all_reduce_sum(d, &ready);
  c.wait_all_reduces();
  copy(b, d);
  for (std::int64_t i = 0; i < kN; i += 4099)
    ASSERT_EQ(back[static_cast<std::size_t>(i)], static_cast<float>(n * (n + 1) / 2 * (i % 7))) << "rank " << c.rank() << ", " << i;
}

TEST(OneGpuCommunicator, StartedAllReducesWaitForTheirStreams) {
  FK_SKIP_WITHOUT_GPUS(1);
  started_all_reduces(one_gpu());
}

// test::check_saved_state_resumes on the GPU, against the single-GPU model.
TEST(OneGpuDistributedDlrm, SavedStateResumesAndPredictionsFollow) {
  FK_SKIP_WITHOUT_GPUS(1);
  test::check_saved_state_resumes(one_gpu(), Device::cuda(0));
}

// N -> M onto the GPU (models::DistributedDlrm::load, whose rows go through host staging and are
// copied on the embeddings' stream): a state trained on the CPU under shards of at most 11 rows,
// loaded onto cuda:0 under shards of at most 7 (and table-wise), saved again from the GPU,
// consolidates to the same bytes; and the one-process state (1 -> M) likewise. Row-wise and full
// Adagrad (accumulators [rows] and [rows, D]).
TEST(OneGpuDistributedDlrm, StatesOfOtherPlansLoadOntoTheGpuBitForBit) {
  FK_SKIP_WITHOUT_GPUS(1);
  Communicator& c = one_gpu();
  const test::DistCase dc{models::InteractionOp::dcn, true, models::DlrmImpl::fused, 11};
  const data::Featurizer feat = test::dist_featurizer(true);
  const models::OptimizerConfig opt = test::dist_optimizer(dc);
  data::SyntheticConfig sc;
  sc.seed = 13;
  std::vector<data::RawRecord> recs(90);
  data::SyntheticCriteo(sc).generate(0, recs);
  for (const bool rowwise : {true, false}) {
    models::DlrmConfig config = test::dist_config(dc, feat);
    config.rowwise_adagrad = rowwise;
    const auto plan = [&](std::int64_t rows) {
      return models::plan_dlrm_sharding(config, 1, 30, opt.kind, feat.multi_hot_sizes, {.max_shard_rows = rows});
    };
    auto host = make_single_communicator();
    models::DistributedDlrm cpu(config, *host, plan(11), dc.impl);
    for (int k = 0; k < 3; ++k) {
      data::Batch b;
      data::make_batch(std::span(recs).subspan(static_cast<std::size_t>(30 * k), 30), feat, b);
      cpu.train_step({b.dense, b.indices, b.offsets}, b.labels, opt);
    }
    std::ostringstream dense_out, shards_out;
    cpu.dense().save_state(dense_out);
    cpu.save_shards(shards_out);
    const std::string dense = dense_out.str(), shards = shards_out.str();
    const auto tables_of = [](const dist::ShardingPlan& p, const std::string& bytes, std::istringstream& in) {
      return models::SavedTables{p, models::SavedTables::Layout::shards, [&in, bytes](int) -> std::istream& {
                                   in.str(bytes);
                                   in.clear();
                                   return in;
                                 }};
    };
    const auto consolidated = [&](const dist::ShardingPlan& p, const std::string& d, const std::string& sh) {
      std::istringstream dense_in(d), shards_in;
      std::ostringstream out;
      models::consolidate_distributed_state(config, dense_in, tables_of(p, sh, shards_in), out);
      return out.str();
    };
    const std::string whole = consolidated(plan(11), dense, shards);
    for (const std::int64_t rows : {std::int64_t{7}, std::int64_t{0}}) {
      models::DistributedDlrm gpu(config, c, plan(rows), dc.impl);
      std::istringstream dense_in(dense), shards_in;
      gpu.load(dense_in, tables_of(plan(11), shards, shards_in));
      std::ostringstream d, sh;
      gpu.dense().save_state(d);
      gpu.save_shards(sh);
      EXPECT_EQ(consolidated(plan(rows), d.str(), sh.str()), whole)
          << (rowwise ? "row-wise" : "full") << " Adagrad, 11 -> " << rows << " rows a shard";
    }
    // 1 -> M: the consolidated (one-process) state onto the GPU under shards of at most 7 rows.
    models::DistributedDlrm gpu(config, c, plan(7), dc.impl);
    std::istringstream in(whole);
    gpu.load(in, {models::one_process_plan(config.table_rows), models::SavedTables::Layout::one_process,
                  [&in](int) -> std::istream& {
                    in.clear();
                    in.seekg(0);
                    return in;
                  }});
    std::ostringstream d, sh;
    gpu.dense().save_state(d);
    gpu.save_shards(sh);
    EXPECT_EQ(consolidated(plan(7), d.str(), sh.str()), whole) << (rowwise ? "row-wise" : "full") << " Adagrad, 1 -> M";
  }
}

// 16-bit tables on the GPU (test::compare_sixteen_bit_with_one_process), against the single-GPU model.
TEST(OneGpuDistributedDlrm, SixteenBitTablesFollowTheSingleGpuModel) {
  FK_SKIP_WITHOUT_GPUS(1);
  for (const DType dt : {DType::bf16, DType::f16}) test::compare_sixteen_bit_with_one_process(one_gpu(), dt, Device::cuda(0));
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
  // 16-bit tables: the shards' rows drawing their rounding as the one-process model's.
  on_every_rank(comms, [](Communicator& c) { test::compare_sixteen_bit_with_one_process(c, DType::bf16, c.device()); });
  on_every_rank(comms, [](Communicator& c) {
    test::compare_sharded_bags(c, {.kind = nn::OptimizerKind::sgd, .learning_rate = 0.1f}, false);
    test::compare_sharded_bags(c, {.kind = nn::OptimizerKind::adagrad, .learning_rate = 0.05f}, true);
  });
  // Bucketed all-reduces overlapped with the backward: bit for bit on 2 GPUs (a sum of two), within
  // the comparison's tolerance on more (NCCL's ring order depends on where an element falls in
  // the buffer).
  on_every_rank(comms, [n](Communicator& c) {
    started_all_reduces(c);
    for (const auto op : {models::InteractionOp::dot, models::InteractionOp::dcn})
      test::compare_gradient_buckets(c, {op, true, models::DlrmImpl::fused, 11}, n <= 2);
  });
}

}  // namespace
}  // namespace fk::dist
