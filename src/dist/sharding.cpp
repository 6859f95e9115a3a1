// The sharding planner: greedy largest-first placement of table shards over ranks.
#include "fusekit/dist/sharding.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <numeric>

#include "fusekit/core/error.hpp"

namespace fk::dist {
namespace {

constexpr const char* kOp = "dist::plan_sharding";

std::string gigabytes(std::int64_t bytes) {
  return bytes >= (std::int64_t{1} << 30) ? fmt::format("{:.2f} GB", static_cast<double>(bytes) / 1e9)
                                          : fmt::format("{:.2f} MB", static_cast<double>(bytes) / 1e6);
}

}  // namespace

bool ShardingPlan::table_wise() const noexcept {
  return std::all_of(tables.begin(), tables.end(), [](const auto& s) { return s.size() == 1; });
}

int ShardingPlan::owner(int table) const {
  FK_CHECK_ARG(table >= 0 && table < num_tables(), "dist::ShardingPlan::owner", "table",
               fmt::format("a table in [0, {})", num_tables()), fmt::format("{}", table));
  const auto& shards = tables[static_cast<std::size_t>(table)];
  FK_CHECK_ARG(shards.size() == 1, "dist::ShardingPlan::owner", "table", "a table placed whole (table-wise)",
               fmt::format("table {} split into {} row ranges", table, shards.size()));
  return shards[0].rank;
}

std::vector<int> ShardingPlan::tables_of(int rank) const {
  std::vector<int> v;
  for (int t = 0; t < num_tables(); ++t)
    for (const Shard& s : tables[static_cast<std::size_t>(t)])
      if (s.rank == rank) {
        v.push_back(t);
        break;
      }
  return v;
}

std::string ShardingPlan::str() const {
  std::size_t shards = 0;
  for (const auto& t : tables) shards += t.size();
  std::string out = fmt::format("sharding plan: {} tables over {} ranks ({}; {} shards)\n", num_tables(), ranks,
                                table_wise() ? "table-wise" : "table-wise and row-wise", shards);
  for (int r = 0; r < ranks; ++r) {
    std::vector<std::string> names;
    for (int t = 0; t < num_tables(); ++t)
      for (const Shard& s : tables[static_cast<std::size_t>(t)])
        if (s.rank == r)
          names.push_back(tables[static_cast<std::size_t>(t)].size() == 1
                              ? fmt::format("{}", t)
                              : fmt::format("{}[{}:{})", t, s.row_begin, s.row_end));
    out += fmt::format("  rank {}: {}, {:.0f} lookups/step; tables {}\n", r,
                       gigabytes(rank_bytes[static_cast<std::size_t>(r)]), rank_lookups[static_cast<std::size_t>(r)],
                       fmt::join(names, " "));
  }
  return out;
}

ShardingPlan plan_sharding(std::span<const TableInfo> tables, int ranks, const PlannerOptions& options) {
  FK_CHECK_ARG(ranks >= 1, kOp, "ranks", ">= 1", fmt::format("{}", ranks));
  FK_CHECK_ARG(!tables.empty(), kOp, "tables", "at least one table", "none");
  FK_CHECK_ARG(options.batch >= 1 && options.state_bytes_per_row >= 0 && options.max_shard_bytes >= 0 &&
                   options.max_shard_rows >= 0 && options.bytes_slack >= 0,
               kOp, "options",
               "batch >= 1, state_bytes_per_row >= 0, max_shard_bytes >= 0, max_shard_rows >= 0, bytes_slack >= 0",
               fmt::format("{}, {}, {}, {}, {}", options.batch, options.state_bytes_per_row, options.max_shard_bytes,
                           options.max_shard_rows, options.bytes_slack));
  std::vector<Shard> shards;
  for (std::size_t t = 0; t < tables.size(); ++t) {
    const TableInfo& ti = tables[t];
    FK_CHECK_ARG(ti.rows >= 1 && ti.dim >= 1 && ti.bag_size >= 0 && (ti.value_bytes == 2 || ti.value_bytes == 4), kOp,
                 "tables", "rows >= 1, dim >= 1, bag_size >= 0, value_bytes 2 or 4",
                 fmt::format("table {}: {} rows, dim {}, bag size {}, value_bytes {}", t, ti.rows, ti.dim, ti.bag_size,
                             ti.value_bytes));
    const std::int64_t row_bytes = ti.dim * ti.value_bytes + options.state_bytes_per_row;
    const std::int64_t bytes = ti.rows * row_bytes;
    // Row-wise: the fewest near-equal row ranges of at most max_shard_bytes and max_shard_rows (at
    // most one per row).
    std::int64_t pieces = 1;
    if (options.max_shard_bytes > 0 && bytes > options.max_shard_bytes)
      pieces = std::min(ti.rows, (bytes + options.max_shard_bytes - 1) / options.max_shard_bytes);
    if (options.max_shard_rows > 0)
      pieces = std::max(pieces, (ti.rows + options.max_shard_rows - 1) / options.max_shard_rows);
    const double lookups = static_cast<double>(options.batch) * ti.bag_size;
    for (std::int64_t p = 0; p < pieces; ++p) {
      Shard s;
      s.table = static_cast<int>(t);
      s.row_begin = ti.rows * p / pieces;
      s.row_end = ti.rows * (p + 1) / pieces;
      s.bytes = (s.row_end - s.row_begin) * row_bytes;
      s.lookups = lookups * static_cast<double>(s.row_end - s.row_begin) / static_cast<double>(ti.rows);
      shards.push_back(s);
    }
  }
  const double total_bytes = static_cast<double>(
      std::accumulate(shards.begin(), shards.end(), std::int64_t{0}, [](std::int64_t a, const Shard& s) { return a + s.bytes; }));
  // Largest bytes first (then most lookups; stable: then table and row order).
  std::vector<std::size_t> order(shards.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return shards[a].bytes != shards[b].bytes ? shards[a].bytes > shards[b].bytes : shards[a].lookups > shards[b].lookups;
  });
  const double slack = options.bytes_slack * total_bytes / ranks;

  ShardingPlan plan;
  plan.ranks = ranks;
  plan.tables.resize(tables.size());
  plan.rank_bytes.assign(static_cast<std::size_t>(ranks), 0);
  plan.rank_lookups.assign(static_cast<std::size_t>(ranks), 0.0);
  for (std::size_t i : order) {
    Shard& s = shards[i];
    // Memory first: the ranks within `slack` of the fewest bytes after this shard; among them, the
    // fewest lookups after it, then the lower rank.
    const std::int64_t least = *std::min_element(plan.rank_bytes.begin(), plan.rank_bytes.end()) + s.bytes;
    int best = -1;
    for (int r = 0; r < ranks; ++r) {
      const auto ru = static_cast<std::size_t>(r);
      if (static_cast<double>(plan.rank_bytes[ru] + s.bytes) > static_cast<double>(least) + slack) continue;
      if (best < 0 || plan.rank_lookups[ru] < plan.rank_lookups[static_cast<std::size_t>(best)]) best = r;
    }
    s.rank = best;
    plan.rank_bytes[static_cast<std::size_t>(best)] += s.bytes;
    plan.rank_lookups[static_cast<std::size_t>(best)] += s.lookups;
  }
  for (const Shard& s : shards) plan.tables[static_cast<std::size_t>(s.table)].push_back(s);  // row order kept
  return plan;
}

}  // namespace fk::dist
