// DLRM over several ranks (TorchRec's layout): data-parallel dense part, model-parallel tables.
//
//   each rank  a Dlrm with DlrmTables::external (bottom MLP, interaction or cross network, top MLP,
//              the same initial values on every rank) on its slice of the global batch
//   tables     spread over the ranks by a dist::ShardingPlan, whole or split by rows
//              (dist::ShardedEmbeddingBags: ids to the owners of their rows, pooled rows or partial
//              sums back, their gradients to the owners again)
//   gradients  the dense gradients summed over the ranks (one all-reduce of the parameter arena's
//              gradient buffer) before the optimizer step, so every rank's replica stays the same
//
// Loss normalisation: the single-process loss is the mean over the global batch B, so
// dL/dlogit = (p - y) / B. Each rank scales its slice's gradient (p - y) / b by b / B; the
// all-reduced sum is then the single-process gradient, and the table owners get the gradient of
// each pooled row the single-process model computes. The returned loss is the global mean.
//
// N ranks on the same global batches follow the one-process model up to the rounding of the
// reductions, whose order changes (a weight gradient's sum over the batch becomes N partial sums
// added by the all-reduce).
//
// Devices: the communicator's. A host communicator (mpi, single) runs everything on the CPU; the
// NCCL one (one GPU a rank) puts the dense replica, the shards, the pooled rows and their
// gradients on the rank's GPU, and the all-reduces run there. The batch comes from the host (the
// loader's), and the loss and its gradient dL/dlogit are computed on the host from the logits
// (b floats each way a step), as on the CPU, so that one code path scales them.
#pragma once

#include <cstdint>
#include <istream>
#include <ostream>
#include <vector>

#include "fusekit/dist/communicator.hpp"
#include "fusekit/dist/sharded_embeddings.hpp"
#include "fusekit/dist/sharding.hpp"
#include "fusekit/models/dlrm.hpp"

namespace fk::models {

// The plan of a DLRM's tables (dist::plan_sharding): bytes with the optimizer's state (Adagrad: D
// floats a row, row-wise Adagrad one), lookups from the bag sizes (empty: one-hot). Table-wise
// unless `split` asks for row-wise shards (max_shard_bytes, max_shard_rows; its other fields are
// ignored).
dist::ShardingPlan plan_dlrm_sharding(const DlrmConfig& config, int ranks, std::int64_t global_batch,
                                      OptimizerKind optimizer, const std::vector<std::int64_t>& bag_sizes = {},
                                      const dist::PlannerOptions& split = {});

class DistributedDlrm {
 public:
  // Collective in effect: every rank builds it with the same config and plan, on the
  // communicator's device. The communicator must outlive the model.
  DistributedDlrm(DlrmConfig config, dist::Communicator& comm, dist::ShardingPlan plan,
                  DlrmImpl impl = DlrmImpl::reference);

  // Collective. This rank's slice of the global batch (the slices in rank order: every rank's
  // dense, CSR bags over all tables, labels f32 [b]; host tensors); returns the global batch's mean
  // loss, the same on every rank.
  double train_step(const DlrmInput& input, const TensorView& labels, const OptimizerConfig& opt);
  // Collective. Click probabilities f32 [b] of this rank's slice (host).
  void predict(const DlrmInput& input, const TensorView& probabilities);

  // Local: this rank's shards (its tables of the plan, in (table, first row) order) as a DLRM
  // state stream ("FKDLRMS1", models/dlrm_state_io.hpp): each shard's values [rows, D], then, once
  // Adagrad has state, each shard's accumulators ([rows] row-wise, else [rows, D]). load_shards
  // reads the same (fk::Error naming `in` for another plan's shards or a truncated stream). The
  // dense part is dense().save_state / load_state, the same on every rank.
  void save_shards(std::ostream& out);
  void load_shards(std::istream& in);

  const dist::ShardingPlan& plan() const noexcept { return embeddings_.plan(); }
  dist::Communicator& communicator() noexcept { return comm_; }
  // The dense part (its linear_layers(), cross_parameters()), the same on every rank.
  Dlrm& dense() noexcept { return dense_; }
  dist::ShardedEmbeddingBags& embeddings() noexcept { return embeddings_; }

 private:
  void lookup(const DlrmInput& input, std::int64_t batch);
  // parts (host) = their sum over the ranks.
  void sum_over_ranks(float (&parts)[2]);
  dist::Communicator& comm_;
  Dlrm dense_;
  dist::ShardedEmbeddingBags embeddings_;
  Tensor pooled_, dpooled_;   // [b, T, D] on the communicator's device
  Tensor logits_, dlogits_;   // [b], host
  Tensor loss_parts_;         // [2] on the GPU: the loss's all-reduce (NCCL)
};

// A distributed checkpoint as the single-process Dlrm's state (what Dlrm::load_state reads): the
// dense state (DistributedDlrm::dense().save_state) and, per rank r of plan.ranks, shards[r]
// (that rank's save_shards), each table's rows gathered from the shards that hold them. Written
// to `out`; fk::Error naming `dense` or `shards` for a part that does not match config and plan.
void consolidate_distributed_state(const DlrmConfig& config, const dist::ShardingPlan& plan, std::istream& dense,
                                   const std::vector<std::istream*>& shards, std::ostream& out);

}  // namespace fk::models
