// A distributed DLRM's saved state loaded under other plans (models::SavedTables,
// DistributedDlrm::load, consolidate_distributed_state), in one process: each rank of an N-rank
// plan is built on an offline communicator (no collective is needed to load or save a rank's
// state), so every N -> M is reachable here. Rows are copied, never recomputed: a state moved
// through any chain of plans consolidates to the same bytes, and loaded back under the plan that
// trained it continues bit for bit.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "distributed_run.hpp"
#include "fusekit/dist/communicator.hpp"
#include "test_util.hpp"

namespace fk::dist {
namespace {

// DCNv2 with row-wise Adagrad, multi-hot (tests/dist/distributed_run.hpp's tiny DLRM), its tables
// f32, bf16 or f16 (16-bit shard streams end with the tables' rounding step).
struct ReshardCase {
  test::DistCase c{models::InteractionOp::dcn, true, models::DlrmImpl::fused, 11};
  data::Featurizer feat = test::dist_featurizer(true);
  models::DlrmConfig config = test::dist_config(c, feat);
  models::OptimizerConfig opt = test::dist_optimizer(c);
  std::vector<data::RawRecord> recs;

  explicit ReshardCase(DType tables = DType::f32) {
    config.embedding_dtype = tables;
    data::SyntheticConfig sc;
    sc.seed = 13;
    recs.resize(30 * 6);
    data::SyntheticCriteo(sc).generate(0, recs);
  }
  ShardingPlan plan(int ranks, std::int64_t max_shard_rows) const {
    return models::plan_dlrm_sharding(config, ranks, 30, opt.kind, feat.multi_hot_sizes,
                                      {.max_shard_rows = max_shard_rows});
  }
  // Step k (global batch k) of a one-rank model.
  double step(models::DistributedDlrm& m, int k) const {
    data::Batch b;
    data::make_batch(std::span(recs).subspan(static_cast<std::size_t>(30 * k), 30), feat, b);
    return m.train_step({b.dense, b.indices, b.offsets}, b.labels, opt);
  }
};

// A saved state: the dense part and every rank's shard stream.
struct Saved {
  ShardingPlan plan;
  std::string dense;
  std::vector<std::string> shards;
  std::vector<std::shared_ptr<std::istringstream>> open_streams;  // what tables() opened

  models::SavedTables tables() {
    return {plan, models::SavedTables::Layout::shards, [this](int r) -> std::istream& {
              open_streams.push_back(std::make_shared<std::istringstream>(shards[static_cast<std::size_t>(r)]));
              return *open_streams.back();
            }};
  }
};

// `from` loaded rank by rank into `plan` (offline ranks), and saved again.
Saved reshard(Saved& from, const ReshardCase& s, const ShardingPlan& plan) {
  Saved out{plan, from.dense, {}, {}};
  for (int r = 0; r < plan.ranks; ++r) {
    auto comm = make_offline_communicator(r, plan.ranks);
    models::DistributedDlrm m(s.config, *comm, plan, s.c.impl);
    std::istringstream dense(from.dense);
    m.load(dense, from.tables());
    std::ostringstream shards;
    m.save_shards(shards);
    out.shards.push_back(shards.str());
  }
  return out;
}

std::string consolidated(Saved& saved, const ReshardCase& s) {
  std::istringstream dense(saved.dense);
  std::ostringstream out;
  models::consolidate_distributed_state(s.config, dense, saved.tables(), out);
  return out.str();
}

constexpr DType kTableDtypes[] = {DType::f32, DType::bf16, DType::f16};

TEST(Reshard, ChainsOfPlansKeepEveryBitAndResumeBitForBit) {
  for (const DType dt : kTableDtypes) {
    SCOPED_TRACE(std::string(dtype_name(dt)) + " tables");
    const ReshardCase s(dt);
    auto single = make_single_communicator();
    const ShardingPlan trained_plan = s.plan(1, 11);
    models::DistributedDlrm straight(s.config, *single, trained_plan, s.c.impl);
    for (int k = 0; k < 3; ++k) s.step(straight, k);
    Saved saved{trained_plan, {}, {""}, {}};
    {
      std::ostringstream dense, shards;
      straight.dense().save_state(dense);
      straight.save_shards(shards);
      saved.dense = dense.str();
      saved.shards[0] = shards.str();
    }
    const std::string whole = consolidated(saved, s);
    // 1 -> 2 (table-wise) -> 4 (split at 11 rows) -> 3 (split at 7) -> 1 (split at 14).
    Saved at = saved;
    at.open_streams.clear();
    for (const auto& [ranks, rows] : std::vector<std::pair<int, std::int64_t>>{{2, 0}, {4, 11}, {3, 7}, {1, 14}}) {
      at = reshard(at, s, s.plan(ranks, rows));
      EXPECT_EQ(consolidated(at, s), whole) << ranks << " ranks, shards of at most " << rows << " rows";
    }
    // Back onto the plan that trained it: the next steps are the unbroken model's, bit for bit.
    models::DistributedDlrm resumed(s.config, *single, trained_plan, s.c.impl);
    std::istringstream dense(at.dense);
    resumed.load(dense, at.tables());
    for (int k = 3; k < 6; ++k) EXPECT_EQ(s.step(resumed, k), s.step(straight, k)) << "step " << k;
    for (std::size_t sh = 0; sh < straight.embeddings().local_shards().size(); ++sh) {
      const Tensor &a = straight.embeddings().shard_values(sh), &b = resumed.embeddings().shard_values(sh);
      EXPECT_EQ(std::memcmp(a.data(), b.data(), a.nbytes()), 0) << "shard " << sh;
    }
  }
}

// 1 -> M from a one-process Dlrm's state: consolidated again, it is that state, byte for byte.
TEST(Reshard, AOneProcessStateLoadsOntoAnyPlan) {
  for (const DType dt : kTableDtypes) {
    SCOPED_TRACE(std::string(dtype_name(dt)) + " tables");
    const ReshardCase s(dt);
    models::Dlrm one(s.config, Device::cpu(), s.c.impl);
    for (int k = 0; k < 2; ++k) {
      data::Batch b;
      data::make_batch(std::span(s.recs).subspan(static_cast<std::size_t>(30 * k), 30), s.feat, b);
      one.train_step({b.dense, b.indices, b.offsets}, b.labels, s.opt);
    }
    std::ostringstream state;
    one.save_state(state);
    const std::string bytes = state.str();
    for (const auto& [ranks, rows] : std::vector<std::pair<int, std::int64_t>>{{1, 0}, {3, 11}, {4, 0}}) {
      const ShardingPlan plan = s.plan(ranks, rows);
      Saved out{plan, {}, {}, {}};
      for (int r = 0; r < ranks; ++r) {
        auto comm = make_offline_communicator(r, ranks);
        models::DistributedDlrm m(s.config, *comm, plan, s.c.impl);
        std::istringstream in(bytes);
        m.load(in, {models::one_process_plan(s.config.table_rows), models::SavedTables::Layout::one_process,
                    [&](int) -> std::istream& {
                      in.clear();
                      in.seekg(0);
                      return in;
                    }});
        std::ostringstream dense, shards;
        m.dense().save_state(dense);
        m.save_shards(shards);
        if (r == 0) out.dense = dense.str();
        out.shards.push_back(shards.str());
      }
      EXPECT_EQ(consolidated(out, s), bytes) << ranks << " ranks";
    }
  }
}

// A saved rank's stream that its plan does not describe (another plan's, one without the dense
// state's optimizer state, a truncated one) is refused, naming the load and the tables.
TEST(Reshard, StreamsThatDoNotMatchTheirPlanAreRefused) {
  const ReshardCase s;
  auto single = make_single_communicator();
  models::DistributedDlrm trained(s.config, *single, s.plan(1, 11), s.c.impl);
  s.step(trained, 0);
  Saved saved{s.plan(1, 11), {}, {""}, {}};
  std::ostringstream dense, shards;
  trained.dense().save_state(dense);
  trained.save_shards(shards);
  saved.dense = dense.str();
  saved.shards[0] = shards.str();
  const auto load = [&](Saved& from) {
    models::DistributedDlrm m(s.config, *single, s.plan(1, 0), s.c.impl);
    std::istringstream d(from.dense);
    m.load(d, from.tables());
  };
  Saved other_plan = saved;
  other_plan.plan = s.plan(1, 14);
  test::expect_arg_error([&] { load(other_plan); }, "models::DistributedDlrm::load", "tables");
  Saved truncated = saved;
  truncated.shards[0].resize(truncated.shards[0].size() - 5);
  test::expect_arg_error([&] { load(truncated); }, "models::DistributedDlrm::load", "tables");
  Saved no_state = saved;
  {
    models::DistributedDlrm fresh(s.config, *single, s.plan(1, 11), s.c.impl);  // never trained: no state
    std::ostringstream out;
    fresh.save_shards(out);
    no_state.shards[0] = out.str();
  }
  test::expect_arg_error([&] { load(no_state); }, "models::DistributedDlrm::load", "tables");
  Saved gap = saved;
  gap.plan.tables[3].clear();
  test::expect_arg_error([&] { load(gap); }, "models::DistributedDlrm::load", "tables");
  test::expect_arg_error([] { make_offline_communicator(2, 2); }, "dist::make_offline_communicator", "rank");
  // A 16-bit model's shards (with the tables' rounding step) where f32 ones are wanted, and the
  // other way.
  const ReshardCase s16(DType::bf16);
  models::DistributedDlrm trained16(s16.config, *single, s16.plan(1, 11), s16.c.impl);
  s16.step(trained16, 0);
  Saved saved16 = saved;
  {
    std::ostringstream out;
    trained16.save_shards(out);
    saved16.shards[0] = out.str();
  }
  test::expect_arg_error([&] { load(saved16); }, "models::DistributedDlrm::load", "tables");
  test::expect_arg_error([&] {
    models::DistributedDlrm m(s16.config, *single, s16.plan(1, 0), s16.c.impl);
    std::istringstream d(saved.dense);
    m.load(d, saved.tables());
  }, "models::DistributedDlrm::load", "tables");
}

}  // namespace
}  // namespace fk::dist
