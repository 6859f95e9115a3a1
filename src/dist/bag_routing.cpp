// The host-side index work of the sharded embeddings' exchanges (bag_routing.hpp).
#include "fusekit/dist/bag_routing.hpp"

namespace fk::dist {

void route_ids(std::span<const std::vector<Shard>> shards_of, const std::int64_t* indices, const std::int64_t* offsets,
               std::int64_t batch, RoutedIds& out) {
  const std::size_t ranks = shards_of.size();
  out.lengths.clear();
  out.ids.clear();
  out.length_counts.assign(ranks, 0);
  out.id_counts.assign(ranks, 0);
  for (std::size_t o = 0; o < ranks; ++o) {
    out.length_counts[o] = batch * static_cast<std::int64_t>(shards_of[o].size());
    const std::size_t first_id = out.ids.size();
    for (const Shard& sh : shards_of[o])
      for (std::int64_t i = 0; i < batch; ++i) {
        const std::size_t before = out.ids.size();
        for (std::int64_t k = offsets[sh.table * batch + i]; k < offsets[sh.table * batch + i + 1]; ++k)
          if (indices[k] >= sh.row_begin && indices[k] < sh.row_end) out.ids.push_back(indices[k] - sh.row_begin);
        out.lengths.push_back(static_cast<std::int64_t>(out.ids.size() - before));
      }
    out.id_counts[o] = static_cast<std::int64_t>(out.ids.size() - first_id);
  }
}

std::vector<std::int64_t> owner_bag_order(std::span<const std::int64_t> batch_of, std::int64_t shards) {
  std::int64_t global = 0;
  for (const std::int64_t b : batch_of) global += b;
  std::vector<std::int64_t> order(static_cast<std::size_t>(shards * global));
  std::int64_t start = 0;  // rank r's first sample in the global batch
  for (const std::int64_t b : batch_of) {
    for (std::int64_t j = 0; j < shards; ++j)
      for (std::int64_t i = 0; i < b; ++i)
        order[static_cast<std::size_t>(j * global + start + i)] = shards * start + j * b + i;
    start += b;
  }
  return order;
}

std::vector<std::int64_t> pooled_row_of_partials(std::span<const std::vector<Shard>> shards_of, std::int64_t batch,
                                                 int tables) {
  std::vector<std::int64_t> row;
  for (const std::vector<Shard>& owned : shards_of)
    for (std::int64_t i = 0; i < batch; ++i)
      for (const Shard& sh : owned) row.push_back(i * tables + sh.table);
  return row;
}

}  // namespace fk::dist
