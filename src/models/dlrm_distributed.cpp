// DLRM over several ranks: the external-table Dlrm, dist::ShardedEmbeddingBags and one all-reduce.
// Its saved state (shards, N -> M loads, consolidation): dlrm_distributed_state.cpp.
#include "fusekit/models/dlrm_distributed.hpp"

#include <fmt/format.h>

#include "fusekit/core/error.hpp"

namespace fk::models {
namespace {

constexpr const char* kOp = "models::DistributedDlrm";

}  // namespace

dist::ShardingPlan plan_dlrm_sharding(const DlrmConfig& config, int ranks, std::int64_t global_batch,
                                      OptimizerKind optimizer, const std::vector<std::int64_t>& bag_sizes,
                                      const dist::PlannerOptions& split) {
  const std::size_t n = config.table_rows.size();
  FK_CHECK_ARG(bag_sizes.empty() || bag_sizes.size() == n, "models::plan_dlrm_sharding", "bag_sizes",
               fmt::format("none (one-hot) or one per table ({})", n), fmt::format("{}", bag_sizes.size()));
  std::vector<dist::TableInfo> tables;
  for (std::size_t t = 0; t < n; ++t)
    tables.push_back({config.table_rows[t], config.embedding_dim,
                      bag_sizes.empty() ? 1.0 : static_cast<double>(bag_sizes[t])});
  std::int64_t state = 0;
  if (optimizer == OptimizerKind::adagrad) state = config.rowwise_adagrad ? 4 : 4 * config.embedding_dim;
  return dist::plan_sharding(tables, ranks,
                             {.batch = global_batch,
                              .state_bytes_per_row = state,
                              .max_shard_bytes = split.max_shard_bytes,
                              .max_shard_rows = split.max_shard_rows});
}

DistributedDlrm::DistributedDlrm(DlrmConfig config, dist::Communicator& comm, dist::ShardingPlan plan, DlrmImpl impl)
    : comm_(comm),
      dense_(config, Device::cpu(), impl, DlrmTables::external),
      embeddings_(config.table_rows, config.embedding_dim,
                  {Pooling::sum, config.raw_hash, impl == DlrmImpl::fused, config.rowwise_adagrad},
                  dlrm_table_init(config), std::move(plan), comm) {}

void DistributedDlrm::lookup(const DlrmInput& input, std::int64_t batch) {
  FK_CHECK_ARG(input.indices.data() != nullptr && input.offsets.data() != nullptr, kOp, "input",
               "CSR bags (indices and offsets; raw values are not routed)", "none");
  const std::int64_t t = embeddings_.num_tables(), d = embeddings_.dim();
  if (pooled_.numel() != batch * t * d) {
    pooled_ = Tensor::empty({batch, t, d}, DType::f32, Device::cpu());
    dpooled_ = Tensor::empty({batch, t, d}, DType::f32, Device::cpu());
    logits_ = Tensor::empty({batch}, DType::f32, Device::cpu());
    dlogits_ = Tensor::empty({batch}, DType::f32, Device::cpu());
  }
  embeddings_.forward(input.indices, input.offsets, batch, pooled_);
}

double DistributedDlrm::train_step(const DlrmInput& input, const TensorView& labels, const OptimizerConfig& opt) {
  FK_CHECK_ARG(input.dense.rank() == 2, kOp, "dense", "f32 [B, inputs]", input.dense.str());
  const std::int64_t b = input.dense.size(0);
  lookup(input, b);
  dense_.forward({input.dense, {}, {}, {}, pooled_}, logits_);
  // This slice's mean loss and (p - y) / b, rescaled to the global batch's (p - y) / B.
  const TensorView dlogits = dlogits_;
  const double loss = bce_with_logits(logits_, labels, &dlogits);
  const std::int64_t gb = embeddings_.global_batch();
  const float scale = static_cast<float>(static_cast<double>(b) / static_cast<double>(gb));
  float* g = dlogits_.data_as<float>();
  for (std::int64_t i = 0; i < b; ++i) g[i] *= scale;
  dense_.backward(dlogits_, dpooled_);
  embeddings_.backward(dpooled_);
  comm_.all_reduce_sum(dense_.dense_gradients());
  if (opt.kind == OptimizerKind::adagrad) embeddings_.ensure_state(opt.initial_accumulator);
  dense_.step(opt);
  embeddings_.step(opt);
  // The loss summed over the ranks as two floats (a double split into its float and the rest),
  // so the global mean keeps about 14 digits through an f32 all-reduce.
  const double sum = loss * static_cast<double>(b);
  float parts[2] = {static_cast<float>(sum), 0.0f};
  parts[1] = static_cast<float>(sum - static_cast<double>(parts[0]));
  comm_.all_reduce_sum(TensorView(parts, DType::f32, {2}, Device::cpu()));
  return (static_cast<double>(parts[0]) + static_cast<double>(parts[1])) / static_cast<double>(gb);
}

void DistributedDlrm::predict(const DlrmInput& input, const TensorView& probabilities) {
  FK_CHECK_ARG(input.dense.rank() == 2, kOp, "dense", "f32 [B, inputs]", input.dense.str());
  lookup(input, input.dense.size(0));
  dense_.predict({input.dense, {}, {}, {}, pooled_}, probabilities);
}

}  // namespace fk::models
