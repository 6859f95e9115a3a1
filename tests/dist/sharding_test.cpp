// The sharding planner: deterministic, every table placed once, balanced within the list-scheduling
// bound on the MLPerf DLRM-DCNv2 model's tables (configs/mlperf_dcnv2.json), row-wise splitting,
// bad input.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <numeric>

#include "fusekit/dist/sharding.hpp"
#include "test_util.hpp"

namespace fk::dist {
namespace {

// The MLPerf model's tables as its config file gives them: dim 128, the 26 Criteo 1TB sizes and
// multi-hot bag sizes.
std::vector<TableInfo> mlperf_tables() {
  std::ifstream in(FK_CONFIG_DIR "/mlperf_dcnv2.json");
  const nlohmann::json j = nlohmann::json::parse(in);
  const auto rows = j["data"]["cardinalities"].get<std::vector<std::int64_t>>();
  const auto bags = j["data"]["multi_hot_sizes"].get<std::vector<std::int64_t>>();
  const std::int64_t dim = j["model"]["arch_sparse_feature_size"].get<std::int64_t>();
  std::vector<TableInfo> v;
  for (std::size_t t = 0; t < rows.size(); ++t) v.push_back({rows[t], dim, static_cast<double>(bags[t])});
  return v;
}

// The MLPerf recipe: row-wise Adagrad (4 bytes a row), global batch 65536.
constexpr PlannerOptions kMlperf{.batch = 65536, .state_bytes_per_row = 4};

void expect_consistent_and_balanced(const ShardingPlan& p, std::span<const TableInfo> tables) {
  ASSERT_EQ(p.num_tables(), static_cast<int>(tables.size()));
  std::vector<std::int64_t> bytes(static_cast<std::size_t>(p.ranks), 0);
  std::int64_t largest = 0, total = 0;
  for (int t = 0; t < p.num_tables(); ++t) {
    const auto& shards = p.tables[static_cast<std::size_t>(t)];
    ASSERT_FALSE(shards.empty());
    std::int64_t row = 0;  // the shards cover the table's rows once, in order
    for (const Shard& s : shards) {
      EXPECT_EQ(s.table, t);
      EXPECT_EQ(s.row_begin, row);
      EXPECT_GT(s.row_end, s.row_begin);
      EXPECT_GE(s.rank, 0);
      EXPECT_LT(s.rank, p.ranks);
      row = s.row_end;
      bytes[static_cast<std::size_t>(s.rank)] += s.bytes;
      largest = std::max(largest, s.bytes);
      total += s.bytes;
    }
    EXPECT_EQ(row, tables[static_cast<std::size_t>(t)].rows);
  }
  EXPECT_EQ(bytes, p.rank_bytes);
  // The stated bound: no rank above the even share of bytes by more than the largest shard plus
  // the slack (5% of the even share).
  const double even = static_cast<double>(total) / p.ranks;
  for (int r = 0; r < p.ranks; ++r)
    EXPECT_LE(static_cast<double>(p.rank_bytes[static_cast<std::size_t>(r)]), even + static_cast<double>(largest) + 0.05 * even)
        << "rank " << r;
}

TEST(Sharding, MlperfTablesTableWiseOverTwoFourEightRanks) {
  const std::vector<TableInfo> tables = mlperf_tables();
  ASSERT_EQ(tables.size(), 26u);
  for (int ranks : {1, 2, 4, 8}) {
    const ShardingPlan p = plan_sharding(tables, ranks, kMlperf);
    EXPECT_TRUE(p.table_wise());
    expect_consistent_and_balanced(p, tables);
    // Deterministic: the same plan again.
    const ShardingPlan again = plan_sharding(tables, ranks, kMlperf);
    for (int t = 0; t < p.num_tables(); ++t) EXPECT_EQ(p.owner(t), again.owner(t));
    std::printf("%s", p.str().c_str());
  }
  // Table-wise, the five 40M-row tables (20.64 GB each with their row-wise state) decide: the
  // plan's fullest rank holds ceil(5 / ranks) of them and nothing else, the table-wise optimum.
  const std::int64_t big = std::int64_t{40000000} * (128 * 4 + 4);
  for (int ranks : {2, 4, 8}) {
    const ShardingPlan p = plan_sharding(tables, ranks, kMlperf);
    EXPECT_EQ(*std::max_element(p.rank_bytes.begin(), p.rank_bytes.end()), (5 + ranks - 1) / ranks * big) << ranks;
  }
  // bf16 tables (2 bytes a value): 10.4 GB a 40M-row table with its state, the same placement.
  std::vector<TableInfo> half = tables;
  for (TableInfo& t : half) t.value_bytes = 2;
  const std::int64_t big16 = std::int64_t{40000000} * (128 * 2 + 4);
  for (int ranks : {2, 4, 8}) {
    const ShardingPlan p = plan_sharding(half, ranks, kMlperf);
    EXPECT_EQ(*std::max_element(p.rank_bytes.begin(), p.rank_bytes.end()), (5 + ranks - 1) / ranks * big16) << ranks;
  }
}

TEST(Sharding, RowWiseSplitsTablesAboveTheLimit) {
  const std::vector<TableInfo> tables = mlperf_tables();
  // 8 ranks: an even share is 13.2 GB, less than one 40M-row table (20.6 GB); shards of at most
  // half of it.
  const std::int64_t total = std::accumulate(tables.begin(), tables.end(), std::int64_t{0},
                                             [](std::int64_t a, const TableInfo& t) { return a + t.rows * (t.dim * 4 + 4); });
  PlannerOptions o = kMlperf;
  o.max_shard_bytes = total / 16;
  const ShardingPlan p = plan_sharding(tables, 8, o);
  EXPECT_FALSE(p.table_wise());
  expect_consistent_and_balanced(p, tables);
  for (int t = 0; t < p.num_tables(); ++t)
    for (const Shard& s : p.tables[static_cast<std::size_t>(t)]) EXPECT_LE(s.bytes, o.max_shard_bytes);
  EXPECT_EQ(p.tables[0].size(), 4u);  // 40M rows in four ranges of 10M
  test::expect_arg_error([&] { (void)p.owner(0); }, "dist::ShardingPlan::owner", "table");
  const std::int64_t most = *std::max_element(p.rank_bytes.begin(), p.rank_bytes.end());
  const ShardingPlan whole = plan_sharding(tables, 8, kMlperf);
  EXPECT_LT(most, *std::max_element(whole.rank_bytes.begin(), whole.rank_bytes.end()));
  std::printf("%s", p.str().c_str());
}

TEST(Sharding, SmallCasesByHand) {
  // Three equal tables over two ranks: largest first, ties to the lower rank: 0, 1, then 0.
  const std::vector<TableInfo> three(3, TableInfo{100, 4, 1});
  const ShardingPlan p = plan_sharding(three, 2, {.batch = 8});
  EXPECT_EQ(p.owner(0), 0);
  EXPECT_EQ(p.owner(1), 1);
  EXPECT_EQ(p.owner(2), 0);
  EXPECT_EQ(p.tables_of(0), (std::vector<int>{0, 2}));
  EXPECT_EQ(p.rank_bytes[0], 2 * 100 * 16);
  // 16-bit tables: 2 bytes a value, plus the row-wise state's 4 a row.
  const std::vector<TableInfo> half(3, TableInfo{100, 4, 1, 2});
  EXPECT_EQ(plan_sharding(half, 2, {.batch = 8, .state_bytes_per_row = 4}).rank_bytes[0], 2 * 100 * (8 + 4));
  // More ranks than tables: some ranks hold none.
  const ShardingPlan q = plan_sharding(three, 4, {.batch = 8});
  EXPECT_TRUE(q.tables_of(3).empty());
  // A heavy lookup table balances against a large one.
  const std::vector<TableInfo> mixed{{1000, 4, 1}, {10, 4, 100}, {10, 4, 1}};
  const ShardingPlan m = plan_sharding(mixed, 2, {.batch = 8});
  EXPECT_NE(m.owner(0), m.owner(1));
}

TEST(Sharding, BadInputRaisesErrors) {
  const std::vector<TableInfo> one{{10, 4, 1}};
  test::expect_arg_error([&] { plan_sharding(one, 0); }, "dist::plan_sharding", "ranks");
  test::expect_arg_error([&] { plan_sharding(std::vector<TableInfo>{}, 2); }, "dist::plan_sharding", "tables");
  const std::vector<TableInfo> empty_table{{0, 4, 1}};
  test::expect_arg_error([&] { plan_sharding(empty_table, 2); }, "dist::plan_sharding", "tables");
  test::expect_arg_error([&] { plan_sharding(one, 2, {.batch = 0}); }, "dist::plan_sharding", "options");
  const std::vector<TableInfo> odd_bytes{{10, 4, 1, 3}};
  test::expect_arg_error([&] { plan_sharding(odd_bytes, 2); }, "dist::plan_sharding", "tables");
}

}  // namespace
}  // namespace fk::dist
