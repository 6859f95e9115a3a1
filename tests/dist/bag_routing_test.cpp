// The host-side index work of the sharded embeddings (bag_routing.hpp): a hand-worked case, and
// every rank's routed ids exchanged in memory and regrouped by permute_bags against each shard's
// bags read straight off the global batch (random bags, uneven slices, split tables, ranks that
// own nothing).
#include <gtest/gtest.h>

#include <numeric>
#include <random>

#include "fusekit/dist/bag_routing.hpp"
#include "fusekit/ops/recsys.hpp"

namespace fk::dist {
namespace {

using Ids = std::vector<std::int64_t>;

// Rank 0 holds table 0's rows [0, 3); rank 1 its rows [3, 5), and table 1 whole (2 rows).
// Bags (table-major, 2 samples): table 0 {0, 4, 3}, {}; table 1 {1}, {0, 0}.
const std::vector<std::vector<Shard>> kShardsOf = {{{0, 0, 3, 0}}, {{0, 3, 5, 1}, {1, 0, 2, 1}}};

TEST(BagRouting, RouteIdsByHand) {
  const Ids indices{0, 4, 3, 1, 0, 0}, offsets{0, 3, 3, 4, 6};
  RoutedIds r;
  route_ids(kShardsOf, indices.data(), offsets.data(), 2, r);
  EXPECT_EQ(r.lengths, (Ids{1, 0, /* rank 1: */ 2, 0, 1, 2}));
  EXPECT_EQ(r.ids, (Ids{0, /* rank 1: rows 4, 3 less 3, then table 1 */ 1, 0, 1, 0, 0}));
  EXPECT_EQ(r.length_counts, (Ids{2, 4}));
  EXPECT_EQ(r.id_counts, (Ids{1, 5}));
}

TEST(BagRouting, OwnerOrderAndPartialRowsByHand) {
  // Two shards here, from ranks of 2 and 1 samples: received bags (rank 0: shard 0 samples 0, 1;
  // shard 1 samples 0, 1; rank 1: shard 0, shard 1), pooled shard by shard over samples 0, 1, 2.
  EXPECT_EQ(owner_bag_order(Ids{2, 1}, 2), (Ids{0, 1, 4, 2, 3, 5}));
  EXPECT_EQ(owner_bag_order(Ids{3}, 1), (Ids{0, 1, 2}));
  EXPECT_TRUE(owner_bag_order(Ids{2, 1}, 0).empty());
  // Partials back: rank 0's (table 0) for samples 0 and 1, then rank 1's (tables 0 and 1) for each.
  EXPECT_EQ(pooled_row_of_partials(kShardsOf, 2, 2), (Ids{0, 2, 0, 1, 2, 3}));
}

// Every rank routes its slice; the owners' receive buffers are the senders' blocks in rank order,
// as all_to_all_v makes them; permute_bags with owner_bag_order must give, for each of the
// owner's shards and each sample of the global batch, the bag's ids in the shard less its first row.
TEST(BagRouting, ExchangedAndRegroupedBagsAreTheShardsBags) {
  const std::vector<std::int64_t> rows{40, 9, 1, 27, 15};
  std::vector<TableInfo> tables;
  for (std::int64_t r : rows) tables.push_back({r, 4, 2.0});
  for (int ranks : {1, 2, 3, 5}) {
    const ShardingPlan plan = plan_sharding(tables, ranks, {.batch = 11, .max_shard_rows = 10});
    std::vector<std::vector<Shard>> shards_of(static_cast<std::size_t>(ranks));
    for (const auto& t : plan.tables)
      for (const Shard& sh : t) shards_of[static_cast<std::size_t>(sh.rank)].push_back(sh);
    // The global batch: 11 samples, bags of 0 to 4 ids.
    const auto nt = static_cast<std::int64_t>(rows.size());
    constexpr std::int64_t kB = 11;
    std::mt19937_64 rng(static_cast<std::uint64_t>(ranks));
    std::vector<Ids> bag(static_cast<std::size_t>(nt * kB));  // bag t * B + g
    for (std::int64_t q = 0; q < nt * kB; ++q)
      for (std::uint64_t k = rng() % 5; k > 0; --k)
        bag[static_cast<std::size_t>(q)].push_back(static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(rows[static_cast<std::size_t>(q / kB)])));
    // Slices of 11 over the ranks: the first 11 % ranks get one more.
    Ids batch_of(static_cast<std::size_t>(ranks)), start(static_cast<std::size_t>(ranks));
    for (int r = 0; r < ranks; ++r) batch_of[static_cast<std::size_t>(r)] = kB / ranks + (r < kB % ranks ? 1 : 0);
    std::exclusive_scan(batch_of.begin(), batch_of.end(), start.begin(), std::int64_t{0});
    std::vector<RoutedIds> sent(static_cast<std::size_t>(ranks));
    for (int r = 0; r < ranks; ++r) {
      Ids idx, off{0};
      for (std::int64_t t = 0; t < nt; ++t)
        for (std::int64_t i = 0; i < batch_of[static_cast<std::size_t>(r)]; ++i) {
          const Ids& b = bag[static_cast<std::size_t>(t * kB + start[static_cast<std::size_t>(r)] + i)];
          idx.insert(idx.end(), b.begin(), b.end());
          off.push_back(static_cast<std::int64_t>(idx.size()));
        }
      route_ids(shards_of, idx.data(), off.data(), batch_of[static_cast<std::size_t>(r)], sent[static_cast<std::size_t>(r)]);
    }
    for (int o = 0; o < ranks; ++o) {
      const auto s = static_cast<std::int64_t>(shards_of[static_cast<std::size_t>(o)].size());
      Ids lengths, ids;  // what o receives: each sender's block for o, in rank order
      for (const RoutedIds& from : sent) {
        const auto lo = std::accumulate(from.length_counts.begin(), from.length_counts.begin() + o, std::int64_t{0});
        const auto io = std::accumulate(from.id_counts.begin(), from.id_counts.begin() + o, std::int64_t{0});
        lengths.insert(lengths.end(), from.lengths.begin() + lo, from.lengths.begin() + lo + from.length_counts[static_cast<std::size_t>(o)]);
        ids.insert(ids.end(), from.ids.begin() + io, from.ids.begin() + io + from.id_counts[static_cast<std::size_t>(o)]);
      }
      Ids order = owner_bag_order(batch_of, s), out_off(static_cast<std::size_t>(s * kB + 1)), out(ids.size());
      auto view = [](Ids& v) { return TensorView(v.data(), DType::i64, {std::ssize(v)}, Device::cpu()); };
      permute_bags({view(lengths), view(ids), view(order), view(out_off), view(out)});
      for (std::int64_t j = 0; j < s; ++j) {
        const Shard& sh = shards_of[static_cast<std::size_t>(o)][static_cast<std::size_t>(j)];
        for (std::int64_t g = 0; g < kB; ++g) {
          Ids want;
          for (std::int64_t id : bag[static_cast<std::size_t>(sh.table * kB + g)])
            if (id >= sh.row_begin && id < sh.row_end) want.push_back(id - sh.row_begin);
          const std::int64_t q = j * kB + g;
          const Ids got(out.begin() + out_off[static_cast<std::size_t>(q)], out.begin() + out_off[static_cast<std::size_t>(q) + 1]);
          EXPECT_EQ(got, want) << ranks << " ranks, owner " << o << ", shard " << j << ", sample " << g;
        }
      }
    }
  }
}

}  // namespace
}  // namespace fk::dist
