// Model-parallel embedding bags: the tables spread over the ranks by a table-wise ShardingPlan,
// each rank's batch a slice of the global batch (the slices in rank order make the global batch).
//
//   forward   every rank sends each owner the bag lengths and ids of the owner's tables for its
//             samples (two all-to-alls: i64 lengths, then i64 ids); each owner pools the bags of
//             its tables for the whole global batch (one nn::EmbeddingBagCollection, the
//             single-process layer) and sends every rank the pooled rows of its samples (f32
//             all-to-all); each rank then holds pooled [b, T, D] for its samples, every table.
//   backward  each rank sends the owners the gradient of its pooled rows (f32 all-to-all); the
//             owner keeps [B, T_local, D] for the global batch and step() applies the optimizer
//             to the rows it touched (the fused sparse backward + optimizer, or the unfused path).
//
// The owner's pooling sees the bags in global-batch order, so a table's rows get the sums the
// single-process model computes, in the same order. Host memory only (the packing into and out of
// the send buffers is host code; a GPU version packs on the device and sends through NCCL).
// Row-wise shards (a table split by rows) are refused: their routing (ids by row range, partial
// pools summed on the way back) is not built yet.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "fusekit/core/random.hpp"
#include "fusekit/core/tensor.hpp"
#include "fusekit/dist/communicator.hpp"
#include "fusekit/dist/sharding.hpp"
#include "fusekit/nn/recsys.hpp"

namespace fk::dist {

class ShardedEmbeddingBags {
 public:
  // rows: every table's rows (the plan's tables); table t holds the values the single-process
  // nn::EmbeddingBagCollection(rows, dim, options, cpu, init) would (init subsequence + t). The
  // communicator must outlive this object.
  ShardedEmbeddingBags(std::vector<std::int64_t> rows, std::int64_t dim, nn::EmbeddingBagCollectionOptions options,
                       RandomParams init, ShardingPlan plan, Communicator& comm);

  const ShardingPlan& plan() const noexcept { return plan_; }
  int num_tables() const noexcept { return static_cast<int>(rows_.size()); }
  std::int64_t dim() const noexcept { return dim_; }
  // This rank's tables, ascending, and the layer holding them (none when the rank owns no table).
  const std::vector<int>& local_tables() const noexcept { return local_tables_; }
  nn::EmbeddingBagCollection* local() noexcept { return local_ ? &*local_ : nullptr; }
  // Table t's values [rows_t, D] when this rank holds it, else null.
  Tensor* table(int t);

  // Collective. This rank's `batch` (>= 1) samples: indices i64 [nnz] and offsets i64 [T * batch + 1]
  // (CSR, table-major, rows within each table; checked). pooled f32 [batch, T, D], contiguous:
  // written (=) with every table's pooled bags.
  void forward(const TensorView& indices, const TensorView& offsets, std::int64_t batch, const TensorView& pooled);
  // Samples of the last forward's global batch, and where this rank's slice starts in it.
  std::int64_t global_batch() const noexcept { return global_batch_; }
  std::int64_t slice_start() const noexcept;
  // Collective. dpooled f32 [batch, T, D], contiguous: the gradient of the last forward's pooled.
  void backward(const TensorView& dpooled);
  // Local: the optimizer on the rows of this rank's tables the last backward touched.
  void step(const nn::OptimizerConfig& opt);
  void ensure_state(float initial_accumulator);

 private:
  std::vector<std::int64_t> rows_;
  std::int64_t dim_;
  ShardingPlan plan_;
  Communicator& comm_;
  std::vector<int> local_tables_;
  std::vector<std::vector<int>> tables_of_;  // per rank
  TableLayout all_;                          // every table (host), for checking the input
  std::optional<nn::EmbeddingBagCollection> local_;
  // The last forward's batch: per rank its samples and first sample in the global batch.
  std::vector<std::int64_t> batch_of_, start_of_;
  std::int64_t batch_ = 0, global_batch_ = 0;
  // Host buffers, grown to the largest batch seen: the local bags (CSR), the local pooled rows
  // and their gradient [B, T_local, D] (kept until step()), and the exchange buffers.
  std::vector<std::int64_t> local_indices_, local_offsets_, send_i64_, recv_i64_;
  std::vector<float> local_out_, local_grad_, send_f32_, recv_f32_;
};

}  // namespace fk::dist
