// Model-parallel embedding bags: the tables spread over the ranks by a ShardingPlan (a table whole
// on one rank, or split by rows into shards on several), each rank's batch a slice of the global
// batch (the slices in rank order make the global batch). Each rank holds its shards, in
// (table, first row) order, as the tables of one nn::EmbeddingBagCollection (the single-process
// layer), shard s's row r being its table's row row_begin + r.
//
//   forward   every rank sends each owner, for each of the owner's shards, the lengths of its
//             samples' bags restricted to the shard's rows, then those ids less the shard's first
//             row (two all-to-alls: i64 lengths, then i64 ids); each owner pools its shards' bags
//             for the whole global batch (a partial sum for a split table; zero for a bag with no
//             id in the shard) and sends every rank the pooled rows of its samples (f32
//             all-to-all); each rank sums the partials of each bag by owner rank, then shard order
//             (deterministic), into pooled [b, T, D], every table.
//   backward  each rank sends every shard's owner the gradient of its pooled rows of that shard's
//             table (f32 all-to-all; every shard, as the forward returned every shard's partial:
//             fixed-size messages, and a bag with no id in a shard updates nothing there); the
//             owner keeps [B, S_local, D] for the global batch and step() applies the optimizer to
//             the rows it touched (the fused sparse backward + optimizer, or the unfused path).
//
// The owner's pooling sees the bags in global-batch order, so a row's gradient is summed in the
// single-process order, and every row's optimizer state (Adagrad's, row-wise Adagrad's
// accumulator) lives with the row. A whole table's pooled bags are the single-process sums; a
// split table's are the sums of its shards' partial sums, which round differently. Sum pooling
// only for split tables (a mean of partial means is not the mean).
//
// Tables of any dtype the layer takes (options.dtype: f32, or bf16 / f16 updated with stochastic
// rounding); the pooled rows and their gradients are f32 either way. A 16-bit shard's rows draw
// their rounding as the same rows of the one-process layer (its layout's draw bases: the rows'
// place in the one-process buffer), so that where the f32 updates agree the stored values do; the
// update's number, the draws' offset, is the same on every rank holding shards.
//
// Devices: the communicator's (Communicator::device()). Host memory with a host communicator (mpi,
// single): the packing into and out of the send buffers is host code. A GPU with the NCCL
// communicator: tables, pooled rows, gradients and every exchange buffer on that GPU, the work on
// one stream of this object's; the index work (which id goes to which owner, bag_routing.hpp) stays
// on the host, from the batch's host copy, and reaches the device in one copy a step; the owner
// regroups its bags with permute_bags, and the partials are summed (and the gradients gathered) by
// the embedding-bag forward, in the host loops' order. forward(), backward() and step() return once
// their work is done on the GPU.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "fusekit/core/random.hpp"
#include "fusekit/core/tensor.hpp"
#include "fusekit/dist/bag_routing.hpp"
#include "fusekit/dist/communicator.hpp"
#include "fusekit/dist/sharding.hpp"
#include "fusekit/nn/recsys.hpp"

namespace fk::dist {

class ShardedEmbeddingBags {
 public:
  // rows: every table's rows (the plan's tables); table t holds the values the single-process
  // nn::EmbeddingBagCollection(rows, dim, options, cpu, init) would (init subsequence + t), each
  // shard its rows of them. The communicator must outlive this object.
  ShardedEmbeddingBags(std::vector<std::int64_t> rows, std::int64_t dim, nn::EmbeddingBagCollectionOptions options,
                       RandomParams init, ShardingPlan plan, Communicator& comm);
  ~ShardedEmbeddingBags();
  ShardedEmbeddingBags(const ShardedEmbeddingBags&) = delete;
  ShardedEmbeddingBags& operator=(const ShardedEmbeddingBags&) = delete;

  const ShardingPlan& plan() const noexcept { return plan_; }
  int num_tables() const noexcept { return static_cast<int>(rows_.size()); }
  std::int64_t dim() const noexcept { return dim_; }
  // Where the tables and the pooled rows live: the communicator's device.
  Device device() const noexcept { return device_; }
  // The stream of its GPU work (null on the host).
  const Stream* stream() const noexcept;
  // This rank's shards in (table, first row) order, and the layer holding them (its table s is
  // shard s; none when the rank owns no shard).
  const std::vector<Shard>& local_shards() const noexcept { return shards_of_[static_cast<std::size_t>(comm_.rank())]; }
  nn::EmbeddingBagCollection* local() noexcept { return local_ ? &*local_ : nullptr; }
  // Local shard s's values [row_end - row_begin, D]: rows [row_begin, row_end) of its table.
  Tensor& shard_values(std::size_t s);

  // Collective. This rank's `batch` (>= 1) samples: indices i64 [nnz] and offsets i64 [T * batch + 1]
  // (CSR, table-major, rows within each table; host tensors, checked). pooled f32 [batch, T, D],
  // contiguous, on device(): written (=) with every table's pooled bags.
  void forward(const TensorView& indices, const TensorView& offsets, std::int64_t batch, const TensorView& pooled);
  // Samples of the last forward's global batch, and where this rank's slice starts in it.
  std::int64_t global_batch() const noexcept { return global_batch_; }
  std::int64_t slice_start() const noexcept;
  // Collective. dpooled f32 [batch, T, D], contiguous, on device(): the gradient of the last
  // forward's pooled.
  void backward(const TensorView& dpooled);
  // Local: the optimizer on the rows of this rank's tables the last backward touched.
  void step(const nn::OptimizerConfig& opt);
  void ensure_state(float initial_accumulator);

 private:
  struct DeviceState;
  void forward_device(const TensorView& pooled);
  void backward_device(const TensorView& dpooled);
  const DeviceState& partial_bags(std::int64_t batch);

  std::vector<std::int64_t> rows_;
  std::int64_t dim_;
  ShardingPlan plan_;
  Communicator& comm_;
  Device device_;
  std::unique_ptr<DeviceState> dev_;         // the GPU path's stream and buffers (none on the host)
  std::vector<std::int64_t> staged_;         // GPU: the routed lengths and ids, for their one copy
  std::vector<std::vector<Shard>> shards_of_;  // per rank, in (table, first row) order
  TableLayout all_;                          // every table (host), for checking the input
  std::optional<nn::EmbeddingBagCollection> local_;
  // The last forward's batch: per rank its samples and first sample in the global batch.
  std::vector<std::int64_t> batch_of_, start_of_;
  std::int64_t batch_ = 0, global_batch_ = 0;
  // The index work (bag_routing.hpp): this batch's ids routed to the owners; the owner's regrouping
  // of the bags it receives, made for batch sizes order_batch_of_; the pooled row of each partial
  // a rank gets back, for rows_batch_ samples.
  RoutedIds routed_;
  std::vector<std::int64_t> order_, order_batch_of_, row_of_;
  std::int64_t rows_batch_ = -1;
  const std::vector<std::int64_t>& partial_rows(std::int64_t batch);
  // Host buffers, grown to the largest batch seen: the local bags (CSR), the local pooled rows
  // and their gradient [B, S_local, D] (kept until step()), and the exchange buffers.
  std::vector<std::int64_t> local_indices_, local_offsets_, recv_i64_;
  std::vector<float> local_out_, local_grad_, send_f32_, recv_f32_;
};

}  // namespace fk::dist
