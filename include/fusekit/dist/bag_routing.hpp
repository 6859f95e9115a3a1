// The index work of the sharded embeddings' exchanges (dist::ShardedEmbeddingBags), done on the
// host for both devices: which ids go to which owner, how an owner regroups what it receives, and
// which pooled row each returned partial belongs to. Kept apart from the collectives so that each
// can be tested alone.
//
// Why on the host, also for a GPU run: the loader's batches are host tensors, and the counts an
// all-to-all needs are host numbers; routing on the device would need the batch copied first and
// the counts copied back (a synchronisation) before the first exchange. The host pass is one read
// of the batch's ids; its results go to the device in one copy a step (the lengths and the ids),
// and what depends only on the batch sizes (the owner's order, the partials' rows) is made once per
// batch size.
//
// `shards_of[r]`: rank r's shards in (table, first row) order, as ShardedEmbeddingBags holds them.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "fusekit/dist/sharding.hpp"

namespace fk::dist {

// The sender's side of the forward: this rank's `batch` samples' bags (CSR over every table,
// table-major, checked by the caller) routed to the shards' owners. For each owner in rank order,
// each of its shards, each sample in order: the number of the bag's ids within the shard's rows
// (lengths), and those ids less the shard's first row, in the same order (ids).
struct RoutedIds {
  std::vector<std::int64_t> lengths;        // [sum over owners o of S_o * batch]
  std::vector<std::int64_t> ids;            // [sum of lengths]
  std::vector<std::int64_t> length_counts;  // per owner: S_o * batch
  std::vector<std::int64_t> id_counts;      // per owner: its ids
};
// Fills `out` (its vectors reused).
void route_ids(std::span<const std::vector<Shard>> shards_of, const std::int64_t* indices, const std::int64_t* offsets,
               std::int64_t batch, RoutedIds& out);

// The owner's side: it receives its `shards` shards' bags from every rank, rank after rank (rank
// r's batch_of[r] samples shard by shard, as route_ids lays them out), and pools them shard by
// shard over the global batch, in global-batch order. Entry j * B + start_r + i of the result (B
// the global batch, start_r rank r's first sample) is the received bag shards * start_r +
// j * batch_of[r] + i: the permutation permute_bags applies.
std::vector<std::int64_t> owner_bag_order(std::span<const std::int64_t> batch_of, std::int64_t shards);

// The partial sums a rank gets back from the owners, owner after owner (owner o's rows [b, S_o, D]
// for this rank's `batch` samples), as rows of its pooled [b, T, D] (T = `tables`): entry k is the
// pooled row i * T + table that received row k adds to. A pooled row sums its partials in
// increasing k (owner rank, then shard order: deterministic), from zero; the backward sends row k
// the gradient of that pooled row.
std::vector<std::int64_t> pooled_row_of_partials(std::span<const std::vector<Shard>> shards_of, std::int64_t batch,
                                                 int tables);

}  // namespace fk::dist
