// DLRM over several ranks (TorchRec's layout): data-parallel dense part, model-parallel tables.
//
//   each rank  a Dlrm with DlrmTables::external (bottom MLP, interaction or cross network, top MLP,
//              the same initial values on every rank) on its slice of the global batch
//   tables     spread over the ranks by a dist::ShardingPlan, whole or split by rows
//              (dist::ShardedEmbeddingBags: ids to the owners of their rows, pooled rows or partial
//              sums back, their gradients to the owners again)
//   gradients  the dense gradients summed over the ranks before the optimizer step, so every rank's
//              replica stays the same: in buckets of at most DistributedDlrmOptions::bucket_bytes
//              (dist::plan_gradient_buckets over Dlrm::gradient_units), each all-reduce started
//              (Communicator::start_all_reduce_sum) as soon as the backward has made the bucket's
//              gradients, top MLP first, so that they overlap the rest of the backward and the
//              tables' gradient exchange; or (bucket_bytes 0) one all-reduce of the whole buffer
//              after the backward
//
// Loss normalisation: the single-process loss is the mean over the global batch B, so
// dL/dlogit = (p - y) / B. Each rank scales its slice's gradient (p - y) / b by b / B; the
// all-reduced sum is then the single-process gradient, and the table owners get the gradient of
// each pooled row the single-process model computes. The returned loss is the global mean.
//
// N ranks on the same global batches follow the one-process model up to the rounding of the
// reductions, whose order changes (a weight gradient's sum over the batch becomes N partial sums
// added by the all-reduce). 16-bit tables (DlrmConfig::embedding_dtype) too: each shard's rows
// draw their stochastic rounding as the one-process model's same rows do, so a stored value
// differs only where those reductions tip a rounding (by one 16-bit step).
//
// Devices: the communicator's. A host communicator (mpi, single) runs everything on the CPU; the
// NCCL one (one GPU a rank) puts the dense replica, the shards, the pooled rows and their
// gradients on the rank's GPU, and the all-reduces run there. The batch comes from the host (the
// loader's), and the loss and its gradient dL/dlogit are computed on the host from the logits
// (b floats each way a step), as on the CPU, so that one code path scales them.
#pragma once

#include <cstdint>
#include <functional>
#include <istream>
#include <ostream>
#include <string>
#include <vector>

#include "fusekit/dist/communicator.hpp"
#include "fusekit/dist/gradient_buckets.hpp"
#include "fusekit/dist/sharded_embeddings.hpp"
#include "fusekit/dist/sharding.hpp"
#include "fusekit/models/dlrm.hpp"

namespace fk::models {

// The plan of a DLRM's tables (dist::plan_sharding): bytes of the tables' dtype with the
// optimizer's state (Adagrad: D floats a row, row-wise Adagrad one), lookups from the bag sizes (empty: one-hot). Table-wise
// unless `split` asks for row-wise shards (max_shard_bytes, max_shard_rows; its other fields are
// ignored).
dist::ShardingPlan plan_dlrm_sharding(const DlrmConfig& config, int ranks, std::int64_t global_batch,
                                      OptimizerKind optimizer, const std::vector<std::int64_t>& bag_sizes = {},
                                      const dist::PlannerOptions& split = {});

// Where a saved state keeps its tables' rows, for loading them under any plan: the same plan, another
// of any number of ranks (N -> M), one process (N -> 1), or from a one-process state (1 -> M).
// `open(r)` gives saved rank r's stream, at the start of its state ("FKDLRMS1"):
//   shards       what rank r of `plan` wrote with DistributedDlrm::save_shards
//   one_process  a one-process Dlrm::save_state (`plan`: one rank, every table one shard); its dense
//                arrays are skipped
// A load calls open(r) at most once per rank, and only for the ranks holding rows it needs. It
// reads a stream's header and every array's length first (checked against what `plan` gives,
// before anything is skipped or read), then seeks to the row ranges it needs and reads only those.
// Rows are copied, so a state loaded under another plan holds the saved bits.
struct SavedTables {
  enum class Layout { shards, one_process };
  dist::ShardingPlan plan;
  Layout layout = Layout::shards;
  std::function<std::istream&(int rank)> open;
};

// The plan of a one-process state: one rank, every table one shard (SavedTables::one_process).
dist::ShardingPlan one_process_plan(const std::vector<std::int64_t>& table_rows);

struct DistributedDlrmOptions {
  // The dense gradients' all-reduce: buckets of at most this many bytes (25 MiB, PyTorch DDP's
  // bucket_cap_mb), each started as the backward makes it; 0: one all-reduce after the backward.
  // Every rank must use the same value. Each gradient is summed by one all-reduce either way, so
  // the results are those of the one all-reduce wherever the backend's sum of an element does not
  // depend on the buffer around it (always on 1 and 2 ranks; docs/dlrm.md).
  std::int64_t bucket_bytes = std::int64_t{25} << 20;
};

class DistributedDlrm {
 public:
  // Collective in effect: every rank builds it with the same config and plan, on the
  // communicator's device. The communicator must outlive the model.
  DistributedDlrm(DlrmConfig config, dist::Communicator& comm, dist::ShardingPlan plan,
                  DlrmImpl impl = DlrmImpl::reference, const DistributedDlrmOptions& options = {});

  // Collective. This rank's slice of the global batch (the slices in rank order: every rank's
  // dense, CSR bags over all tables, labels f32 [b]; host tensors); returns the global batch's mean
  // loss, the same on every rank.
  double train_step(const DlrmInput& input, const TensorView& labels, const OptimizerConfig& opt);
  // Collective. Click probabilities f32 [b] of this rank's slice (host).
  void predict(const DlrmInput& input, const TensorView& probabilities);

  // Local: this rank's shards (its tables of the plan, in (table, first row) order) as a DLRM
  // state stream ("FKDLRMS1", models/dlrm_state_io.hpp): each shard's values [rows, D] (16-bit
  // tables as their f32 values, exactly), then, once Adagrad has state, each shard's accumulators
  // ([rows] row-wise, else [rows, D]), then, with 16-bit tables, their rounding step (the updates
  // made: the offset of the next update's draws, as two floats: its low 24 bits and the rest). load_shards
  // reads the same (fk::Error naming `tables` for another plan's shards or a truncated stream). The
  // dense part is dense().save_state / load_state, the same on every rank. On a GPU (the NCCL
  // communicator) they run on the communicator's device, through host memory on the embeddings'
  // stream, and return once the copies are done.
  void save_shards(std::ostream& out);
  void load_shards(std::istream& in);
  // Local: the whole training state saved under any plan (N -> M): the dense state from `dense`
  // (dense().save_state's; with SavedTables::one_process, the one-process state itself, read before
  // `tables` opens it), and this rank's shards, optimizer state included, gathered from `tables`.
  // fk::Error (op models::DistributedDlrm::load) naming the saved rank whose stream does not
  // match its plan or the dense state (with or without optimizer state). On a GPU the rows are
  // gathered into host staging (a bounded chunk of a shard at a time) and copied to the shard's
  // values and accumulators on the embeddings' stream, so N -> M works there too.
  void load(std::istream& dense, const SavedTables& tables);

  const dist::ShardingPlan& plan() const noexcept { return embeddings_.plan(); }
  // The dense gradients' buckets, in the order their all-reduces start (empty with bucket_bytes 0),
  // and them as a line for the plan printout (dist::gradient_buckets_str; bucket_bytes 0: "one
  // all-reduce after the backward").
  const std::vector<dist::GradientBucket>& gradient_buckets() const noexcept { return buckets_; }
  std::string gradient_buckets_str() const;
  dist::Communicator& communicator() noexcept { return comm_; }
  // The dense part (its linear_layers(), cross_parameters()), the same on every rank.
  Dlrm& dense() noexcept { return dense_; }
  dist::ShardedEmbeddingBags& embeddings() noexcept { return embeddings_; }

 private:
  void lookup(const DlrmInput& input, std::int64_t batch);
  // This rank's shards from `tables` (with optimizer state when `adagrad`); errors name `op`.
  void load_tables(const SavedTables& tables, bool adagrad, const char* op);
  // The dense part's parameter arrays in its state (weights and biases, cross-layer parameters).
  std::uint64_t dense_arrays();
  // parts (host) = their sum over the ranks.
  void sum_over_ranks(float (&parts)[2]);
  dist::Communicator& comm_;
  DistributedDlrmOptions options_;
  Dlrm dense_;
  dist::ShardedEmbeddingBags embeddings_;
  Tensor pooled_, dpooled_;   // [b, T, D] on the communicator's device
  Tensor logits_, dlogits_;   // [b], host
  Tensor loss_parts_;         // [2] on the GPU: the loss's all-reduce (NCCL)
  std::vector<std::string> unit_names_;  // Dlrm::gradient_units' names
  std::vector<dist::GradientBucket> buckets_;
};

// A distributed checkpoint as the single-process Dlrm's state (what Dlrm::load_state reads): the
// dense state (DistributedDlrm::dense().save_state) and every table's rows gathered from `tables`
// (SavedTables::shards). Written to `out`; fk::Error naming `dense` or `tables` for a part that
// does not match config and plan.
void consolidate_distributed_state(const DlrmConfig& config, std::istream& dense, const SavedTables& tables,
                                   std::ostream& out);

}  // namespace fk::models
