// Where each embedding table lives when the tables are spread over ranks (TorchRec's planner in
// its simplest form). A table is cut into shards, each a row range [row_begin, row_end) on one
// rank: table-wise placement gives every table one shard; row-wise splitting (a table larger than
// max_shard_bytes, or with more rows than max_shard_rows) gives it several, of near-equal rows.
//
// Greedy, largest first, memory first (a rank's tables must fit; lookups only cost time): shards
// sorted by bytes (then lookups, then table and row), each placed, among the ranks whose bytes
// after it stay within `bytes_slack` of an even share above the fewest, on the one with the fewest
// lookups (then the lower rank). Large tables thus spread by bytes as in list scheduling (no rank
// above the even share of bytes by more than the largest shard plus the slack), and the small
// tables, whose bytes barely count, by lookups. Deterministic.
//   bytes   rows x dim x 4 (f32) + rows x state_bytes_per_row (the optimizer's state)
//   lookups batch x bag size: rows read per step (the traffic of the ids and the pooling)
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace fk::dist {

struct TableInfo {
  std::int64_t rows = 1;
  std::int64_t dim = 1;
  double bag_size = 1;  // mean rows per bag (the multi-hot size; 1: one-hot)
  std::int64_t value_bytes = 4;  // bytes a stored value: 4 (f32), 2 (bf16, f16 tables)
};

struct PlannerOptions {
  std::int64_t batch = 1;                // global batch (lookups per step = batch x bag size)
  std::int64_t state_bytes_per_row = 0;  // SGD 0, row-wise Adagrad 4, Adagrad 4 x dim
  std::int64_t max_shard_bytes = 0;      // > 0: split larger tables by rows; 0: table-wise only
  std::int64_t max_shard_rows = 0;       // > 0: split tables with more rows too (small tests force splits)
  double bytes_slack = 0.05;             // of an even share of the bytes: room traded for lookups
};

struct Shard {
  int table = 0;
  std::int64_t row_begin = 0, row_end = 0;  // rows [row_begin, row_end) of the table
  int rank = 0;
  std::int64_t bytes = 0;
  double lookups = 0;  // per step, assuming the table's ids spread evenly over its rows
};

struct ShardingPlan {
  int ranks = 1;
  std::vector<std::vector<Shard>> tables;  // per table, its shards in row order
  std::vector<std::int64_t> rank_bytes;    // per rank
  std::vector<double> rank_lookups;        // per rank, per step

  int num_tables() const noexcept { return static_cast<int>(tables.size()); }
  // Every table one shard on one rank.
  bool table_wise() const noexcept;
  // Table-wise plans: the rank holding table t (fk::Error for a split table).
  int owner(int table) const;
  // The tables with a shard on `rank`, ascending.
  std::vector<int> tables_of(int rank) const;
  // The plan as text: one line per rank (tables, bytes, lookups), then table -> rank.
  std::string str() const;
};

// Throws fk::Error for ranks < 1, no table, or a table with rows or dim < 1.
ShardingPlan plan_sharding(std::span<const TableInfo> tables, int ranks, const PlannerOptions& options = {});

}  // namespace fk::dist
