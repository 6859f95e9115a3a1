// A real distributed run: this binary is launched by ctest under mpirun (-np 2 and -np 4). The MPI
// communicator's collectives with uneven counts, then DistributedDlrm on every rank against the
// one-process model each rank also trains (tests/dist/distributed_run.hpp). Every rank runs every
// test (each test is collective); only rank 0 prints gtest's progress, every rank its failures.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <numeric>
#include <sstream>

#include "distributed_run.hpp"
#include "fusekit/core/error.hpp"
#include "fusekit/dist/communicator.hpp"

namespace fk::dist {
namespace {

Communicator* g_comm = nullptr;

TEST(MpiCommunicator, AllToAllVWithUnevenCounts) {
  Communicator& c = *g_comm;
  const int n = c.size(), me = c.rank();
  ASSERT_GE(n, 2) << "run under mpirun -np 2 or more";
  // Rank s sends rank r (s + r) % 3 values (some zero), each value 1000 s + 10 r + k.
  auto count = [](int s, int r) { return static_cast<std::int64_t>((s + r) % 3); };
  std::vector<std::int64_t> send_counts, recv_counts;
  std::vector<float> send;
  for (int r = 0; r < n; ++r) {
    send_counts.push_back(count(me, r));
    recv_counts.push_back(count(r, me));
    for (std::int64_t k = 0; k < count(me, r); ++k) send.push_back(static_cast<float>(1000 * me + 10 * r + k));
  }
  std::vector<float> recv(static_cast<std::size_t>(std::accumulate(recv_counts.begin(), recv_counts.end(), std::int64_t{0})) + 1);
  c.all_to_all_v(TensorView(send.data(), DType::f32, {static_cast<std::int64_t>(send.size())}, Device::cpu()), send_counts,
                 TensorView(recv.data(), DType::f32, {static_cast<std::int64_t>(recv.size())}, Device::cpu()), recv_counts);
  std::size_t at = 0;
  for (int s = 0; s < n; ++s)
    for (std::int64_t k = 0; k < count(s, me); ++k) EXPECT_EQ(recv[at++], static_cast<float>(1000 * s + 10 * me + k));
  // i64 and bytes too; and the counts exchange.
  std::vector<std::int64_t> mine(static_cast<std::size_t>(n)), theirs(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) mine[static_cast<std::size_t>(r)] = 100 * me + r;
  c.exchange_counts(mine, theirs);
  for (int s = 0; s < n; ++s) EXPECT_EQ(theirs[static_cast<std::size_t>(s)], 100 * s + me);
  std::vector<std::uint8_t> bytes_out(static_cast<std::size_t>(2 * n)), bytes_in(static_cast<std::size_t>(2 * n));
  for (int i = 0; i < 2 * n; ++i) bytes_out[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(16 * me + i);
  const std::vector<std::int64_t> twos(static_cast<std::size_t>(n), 2);
  c.all_to_all_v(TensorView(bytes_out.data(), DType::u8, {2 * n}, Device::cpu()), twos,
                 TensorView(bytes_in.data(), DType::u8, {2 * n}, Device::cpu()), twos);
  for (int s = 0; s < n; ++s)
    for (int k = 0; k < 2; ++k) EXPECT_EQ(bytes_in[static_cast<std::size_t>(2 * s + k)], 16 * s + 2 * me + k);
}

TEST(MpiCommunicator, AllReduceSumIsTheSameOnEveryRank) {
  Communicator& c = *g_comm;
  const int n = c.size(), me = c.rank();
  // Small integers: exact in any order.
  std::vector<float> v(1000);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(me + 1) * static_cast<float>(i % 7);
  c.all_reduce_sum(TensorView(v.data(), DType::f32, {1000}, Device::cpu()));
  const float ranks_sum = static_cast<float>(n * (n + 1) / 2);
  for (std::size_t i = 0; i < v.size(); ++i) ASSERT_EQ(v[i], ranks_sum * static_cast<float>(i % 7)) << i;
  // Values that round: every rank gets the same bits (rank 0's result, exchanged as counts).
  float x = 0.1f * static_cast<float>(me + 1) + 1e-3f;
  c.all_reduce_sum(TensorView(&x, DType::f32, {1}, Device::cpu()));
  std::int64_t bits = 0;
  std::memcpy(&bits, &x, sizeof x);
  std::vector<std::int64_t> out(static_cast<std::size_t>(n), bits), in(static_cast<std::size_t>(n));
  c.exchange_counts(out, in);
  for (int s = 0; s < n; ++s) EXPECT_EQ(in[static_cast<std::size_t>(s)], bits) << "rank " << s;
  c.barrier();
}

TEST(ShardedEmbeddingBags, RowWiseShardsFollowTheOneProcessLayer) {
  test::compare_sharded_bags(*g_comm, {.kind = nn::OptimizerKind::sgd, .learning_rate = 0.1f}, false);
  test::compare_sharded_bags(*g_comm, {.kind = nn::OptimizerKind::adagrad, .learning_rate = 0.05f}, true);
  test::compare_sharded_bags(*g_comm, {.kind = nn::OptimizerKind::adagrad, .learning_rate = 0.05f}, false);
}

class Ranks : public ::testing::TestWithParam<test::DistCase> {};

TEST_P(Ranks, DistributedDlrmFollowsTheOneProcessModel) { test::compare_with_one_process(GetParam(), *g_comm); }

INSTANTIATE_TEST_SUITE_P(Cases, Ranks, ::testing::ValuesIn(test::dist_cases()),
                         [](const auto& info) { return test::dist_case_name(info.param); });

// The dense gradients' bucketed all-reduces (started as the backward makes them, MPI_Iallreduce)
// against one MPI_Allreduce after the backward: bit for bit on 2 ranks (a sum of two is the same in
// either order); on more, Open MPI picks its algorithm (and so its order of the additions) by the
// message size and by blocking or not, so within the distributed comparison's tolerance.
TEST(DistributedDlrm, BucketedAllReducesMatchOneAllReduce) {
  for (const auto op : {models::InteractionOp::dot, models::InteractionOp::dcn})
    test::compare_gradient_buckets(*g_comm, {op, true, models::DlrmImpl::fused, 11}, g_comm->size() <= 2);
}

// MPI_Iallreduce through start_all_reduce_sum / wait_all_reduces: several sums in flight at once,
// one of them empty, the same results as all_reduce_sum (small integers: exact in any order).
TEST(MpiCommunicator, StartedAllReducesGiveTheSums) {
  Communicator& c = *g_comm;
  const int n = c.size(), me = c.rank();
  std::vector<float> a(1000), b(3), none;
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>((me + 1) * static_cast<int>(i % 5));
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<float>(me * 10 + static_cast<int>(i));
  c.start_all_reduce_sum(TensorView(a.data(), DType::f32, {1000}, Device::cpu()));
  c.start_all_reduce_sum(TensorView(b.data(), DType::f32, {0}, Device::cpu()));
  c.start_all_reduce_sum(TensorView(b.data(), DType::f32, {3}, Device::cpu()));
  c.wait_all_reduces();
  c.wait_all_reduces();  // nothing left: returns
  for (std::size_t i = 0; i < a.size(); ++i)
    ASSERT_EQ(a[i], static_cast<float>(n * (n + 1) / 2 * static_cast<int>(i % 5))) << i;
  for (std::size_t i = 0; i < b.size(); ++i)
    EXPECT_EQ(b[i], static_cast<float>(10 * n * (n - 1) / 2 + n * static_cast<int>(i))) << i;
  std::vector<std::int32_t> ints(3);
  EXPECT_THROW(c.start_all_reduce_sum(TensorView(ints.data(), DType::i32, {3}, Device::cpu())), Error);
}

// The replicas of the dense part hold the same bits on every rank after training.
TEST(DistributedDlrm, DenseReplicasStayIdentical) {
  Communicator& c = *g_comm;
  const test::DistCase dc{models::InteractionOp::dcn, true, models::DlrmImpl::fused};
  const data::Featurizer feat = test::dist_featurizer(true);
  const models::DlrmConfig config = test::dist_config(dc, feat);
  const models::OptimizerConfig opt = test::dist_optimizer(dc);
  models::DistributedDlrm m(config, c, models::plan_dlrm_sharding(config, c.size(), 30, opt.kind, feat.multi_hot_sizes));
  data::SyntheticConfig sc;
  sc.seed = 5;
  std::vector<data::RawRecord> recs(90);
  data::SyntheticCriteo(sc).generate(0, recs);
  for (int k = 0; k < 3; ++k) {
    const auto [b, e] = test::slice_of(30, c.rank(), c.size());
    data::Batch mine;
    data::make_batch(std::span(recs).subspan(static_cast<std::size_t>(30 * k + b), static_cast<std::size_t>(e - b)), feat, mine);
    m.train_step({mine.dense, mine.indices, mine.offsets}, mine.labels, opt);
  }
  std::uint64_t h = 1469598103934665603ull;  // FNV-1a over every dense parameter's bytes
  auto mix = [&](const Tensor& t) {
    const auto* p = static_cast<const unsigned char*>(t.data());
    for (std::size_t i = 0; i < t.nbytes(); ++i) h = (h ^ p[i]) * 1099511628211ull;
  };
  for (const auto& l : m.dense().linear_layers()) {
    mix(*l.weight);
    mix(*l.bias);
  }
  for (const auto& p : m.dense().cross_parameters()) mix(*p.value);
  const auto mine = static_cast<std::int64_t>(h);
  std::vector<std::int64_t> out(static_cast<std::size_t>(c.size()), mine), in(static_cast<std::size_t>(c.size()));
  c.exchange_counts(out, in);
  for (int s = 0; s < c.size(); ++s) EXPECT_EQ(in[static_cast<std::size_t>(s)], mine) << "rank " << s;
}

TEST(DistributedDlrm, SixteenBitTablesFollowTheOneProcessModel) {
  for (const DType dt : {DType::bf16, DType::f16}) test::compare_sixteen_bit_with_one_process(*g_comm, dt);
}

// A state saved after 3 steps (the dense part and this rank's shards, row-wise Adagrad's
// accumulators included) and loaded into a fresh model continues bit for bit: the next 3 losses
// and every shard equal the unbroken model's.
TEST(DistributedDlrm, SavedStateResumesBitForBit) {
  // f32 and 16-bit tables (whose shard streams keep the tables' rounding step too).
  for (const DType dt : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(std::string(dtype_name(dt)) + " tables");
    Communicator& c = *g_comm;
    const test::DistCase dc{models::InteractionOp::dcn, true, models::DlrmImpl::fused, 11};
    const data::Featurizer feat = test::dist_featurizer(true);
    models::DlrmConfig config = test::dist_config(dc, feat);
    config.embedding_dtype = dt;
    const models::OptimizerConfig opt = test::dist_optimizer(dc);
    const auto plan = [&] {
      return models::plan_dlrm_sharding(config, c.size(), 30, opt.kind, feat.multi_hot_sizes, {.max_shard_rows = 11});
    };
    models::DistributedDlrm straight(config, c, plan(), dc.impl), resumed(config, c, plan(), dc.impl);
    data::SyntheticConfig sc;
    sc.seed = 7;
    std::vector<data::RawRecord> recs(180);
    data::SyntheticCriteo(sc).generate(0, recs);
    const auto step = [&](models::DistributedDlrm& m, int k) {
      const auto [b, e] = test::slice_of(30, c.rank(), c.size());
      data::Batch mine;
      data::make_batch(std::span(recs).subspan(static_cast<std::size_t>(30 * k + b), static_cast<std::size_t>(e - b)), feat, mine);
      return m.train_step({mine.dense, mine.indices, mine.offsets}, mine.labels, opt);
    };
    for (int k = 0; k < 3; ++k) step(straight, k);
    std::stringstream dense, shards;
    straight.dense().save_state(dense);
    straight.save_shards(shards);
    resumed.dense().load_state(dense);
    resumed.load_shards(shards);
    for (int k = 3; k < 6; ++k) EXPECT_EQ(step(resumed, k), step(straight, k)) << "step " << k;
    for (std::size_t s = 0; s < straight.embeddings().local_shards().size(); ++s) {
      const Tensor& a = straight.embeddings().shard_values(s);
      const Tensor& b = resumed.embeddings().shard_values(s);
      EXPECT_EQ(std::memcmp(a.data(), b.data(), a.nbytes()), 0) << "shard " << s;
    }
  }
}

// N -> 1 and 1 -> N with real ranks: the N-rank state loaded into a one-rank model (another
// split) on every rank, and a one-rank model's state loaded onto the N ranks; each continues for 3
// steps as the model that saved it does, within the distributed comparison's tolerance.
TEST(DistributedDlrm, StateMovesBetweenRanksAndOneProcess) {
  Communicator& c = *g_comm;
  auto single = make_single_communicator();
  const test::DistCase dc{models::InteractionOp::dcn, true, models::DlrmImpl::fused, 11};
  const data::Featurizer feat = test::dist_featurizer(true);
  const models::DlrmConfig config = test::dist_config(dc, feat);
  const models::OptimizerConfig opt = test::dist_optimizer(dc);
  const auto plan = [&](int ranks, std::int64_t rows) {
    return models::plan_dlrm_sharding(config, ranks, 30, opt.kind, feat.multi_hot_sizes, {.max_shard_rows = rows});
  };
  data::SyntheticConfig sc;
  sc.seed = 9;
  std::vector<data::RawRecord> recs(180);
  data::SyntheticCriteo(sc).generate(0, recs);
  const auto step = [&](models::DistributedDlrm& m, int k) {
    const auto [b, e] = m.communicator().size() == 1 ? std::pair<std::int64_t, std::int64_t>{0, 30}
                                                     : test::slice_of(30, c.rank(), c.size());
    data::Batch mine;
    data::make_batch(std::span(recs).subspan(static_cast<std::size_t>(30 * k + b), static_cast<std::size_t>(e - b)), feat, mine);
    return m.train_step({mine.dense, mine.indices, mine.offsets}, mine.labels, opt);
  };
  const auto save = [](models::DistributedDlrm& m, std::string& dense, std::string& shards) {
    std::ostringstream d, s;
    m.dense().save_state(d);
    m.save_shards(s);
    dense = d.str();
    shards = s.str();
  };
  models::DistributedDlrm ranks(config, c, plan(c.size(), 11)), solo(config, *single, plan(1, 0));
  for (int k = 0; k < 3; ++k) {
    step(ranks, k);
    step(solo, k);
  }
  std::string dense, mine, solo_dense, solo_shards;
  save(ranks, dense, mine);
  save(solo, solo_dense, solo_shards);
  // Every rank's shard stream to every rank (all_to_all_v of bytes, each rank's sent to all).
  const auto n = static_cast<std::size_t>(c.size());
  const std::vector<std::int64_t> send_counts(n, static_cast<std::int64_t>(mine.size()));
  std::vector<std::int64_t> recv_counts(n);
  c.exchange_counts(send_counts, recv_counts);
  std::string send, recv(static_cast<std::size_t>(std::accumulate(recv_counts.begin(), recv_counts.end(), std::int64_t{0})), '\0');
  for (std::size_t r = 0; r < n; ++r) send += mine;
  c.all_to_all_v(TensorView(send.data(), DType::u8, {static_cast<std::int64_t>(send.size())}, Device::cpu()), send_counts,
                 TensorView(recv.data(), DType::u8, {static_cast<std::int64_t>(recv.size())}, Device::cpu()), recv_counts);
  std::vector<std::string> shards;
  for (std::size_t r = 0, at = 0; r < n; at += static_cast<std::size_t>(recv_counts[r]), ++r)
    shards.push_back(recv.substr(at, static_cast<std::size_t>(recv_counts[r])));
  std::vector<std::unique_ptr<std::istringstream>> opened;
  const auto from = [&](const dist::ShardingPlan& p, const std::vector<std::string>& streams) {
    return models::SavedTables{p, models::SavedTables::Layout::shards, [&opened, &streams](int r) -> std::istream& {
                                 opened.push_back(std::make_unique<std::istringstream>(streams[static_cast<std::size_t>(r)]));
                                 return *opened.back();
                               }};
  };
  models::DistributedDlrm one(config, *single, plan(1, 14)), onto_ranks(config, c, plan(c.size(), 0));
  std::istringstream d1(dense), d2(solo_dense);
  one.load(d1, from(ranks.plan(), shards));
  const std::vector<std::string> solo_streams{solo_shards};
  onto_ranks.load(d2, from(solo.plan(), solo_streams));
  for (int k = 3; k < 6; ++k) {
    const double want = step(ranks, k), got = step(one, k);
    EXPECT_NEAR(got, want, test::kDistAtol + test::kDistRtol * std::fabs(want)) << c.size() << " -> 1, step " << k;
    const double want_solo = step(solo, k), got_ranks = step(onto_ranks, k);
    EXPECT_NEAR(got_ranks, want_solo, test::kDistAtol + test::kDistRtol * std::fabs(want_solo))
        << "1 -> " << c.size() << ", step " << k;
  }
}

}  // namespace
}  // namespace fk::dist

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  std::unique_ptr<fk::dist::Communicator> comm = fk::dist::make_mpi_communicator();
  fk::dist::g_comm = comm.get();
  if (comm->rank() != 0) {  // one progress log; the other ranks still report their failures
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  const int rc = RUN_ALL_TESTS();
  // Every rank's verdict: a rank whose test failed makes the whole run fail on rank 0 too.
  std::vector<std::int64_t> out(static_cast<std::size_t>(comm->size()), rc), in(static_cast<std::size_t>(comm->size()));
  comm->exchange_counts(out, in);
  int failed = 0;
  for (std::int64_t r : in) failed += r != 0;
  if (comm->rank() == 0 && failed > 0) std::printf("%d of %d ranks had failures\n", failed, comm->size());
  return failed > 0 ? 1 : 0;
}
