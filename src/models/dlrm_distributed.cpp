// DLRM over several ranks: the external-table Dlrm, dist::ShardedEmbeddingBags and the dense
// gradients' bucketed all-reduces.
// Its saved state (shards, N -> M loads, consolidation): dlrm_distributed_state.cpp.
#include "fusekit/models/dlrm_distributed.hpp"

#include <fmt/format.h>

#include "core/on_device.hpp"
#include "fusekit/core/error.hpp"
#include "fusekit/core/stream.hpp"

namespace fk::models {
namespace {

constexpr const char* kOp = "models::DistributedDlrm";

// A host vector the step reads or writes through a raw pointer: f32 [n], contiguous, on the CPU.
void check_host_vector(const TensorView& t, std::int64_t n, const char* arg) {
  FK_CHECK_ARG(t.dtype() == DType::f32 && t.numel() == n && t.is_contiguous() && t.data() != nullptr &&
                   t.device().is_cpu(),
               kOp, arg, fmt::format("f32 [{}], contiguous, on the host", n), t.str() + (t.data() ? "" : " with no data"));
}

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
                      bag_sizes.empty() ? 1.0 : static_cast<double>(bag_sizes[t]),
                      static_cast<std::int64_t>(dtype_size(config.embedding_dtype))});
  std::int64_t state = 0;
  if (optimizer == OptimizerKind::adagrad) state = config.rowwise_adagrad ? 4 : 4 * config.embedding_dim;
  return dist::plan_sharding(tables, ranks,
                             {.batch = global_batch,
                              .state_bytes_per_row = state,
                              .max_shard_bytes = split.max_shard_bytes,
                              .max_shard_rows = split.max_shard_rows});
}

DistributedDlrm::DistributedDlrm(DlrmConfig config, dist::Communicator& comm, dist::ShardingPlan plan, DlrmImpl impl,
                                 const DistributedDlrmOptions& options)
    : comm_(comm),
      options_(options),
      dense_(config, comm.device(), impl, DlrmTables::external),
      embeddings_(config.table_rows, config.embedding_dim,
                  {Pooling::sum, config.raw_hash, impl == DlrmImpl::fused, config.rowwise_adagrad,
                   config.embedding_dtype, dlrm_table_rounding_seed(config)},
                  dlrm_table_init(config), std::move(plan), comm) {
  FK_CHECK_ARG(options.bucket_bytes >= 0, kOp, "options.bucket_bytes", ">= 0 (0: one all-reduce after the backward)",
               fmt::format("{}", options.bucket_bytes));
  std::vector<dist::GradientRange> ranges;
  for (const Dlrm::GradientUnit& u : dense_.gradient_units()) {
    unit_names_.push_back(u.name);
    ranges.push_back({u.offset, u.floats});
  }
  if (options.bucket_bytes > 0) buckets_ = dist::plan_gradient_buckets(ranges, options.bucket_bytes);
}

std::string DistributedDlrm::gradient_buckets_str() const {
  if (buckets_.empty()) {
    const TensorView g = const_cast<Dlrm&>(dense_).dense_gradients();
    return fmt::format("gradient buckets: none, one all-reduce of {:.3g} MB after the backward\n",
                       static_cast<double>(g.numel()) * 4.0 / 1e6);
  }
  return dist::gradient_buckets_str(buckets_, unit_names_, options_.bucket_bytes);
}

void DistributedDlrm::lookup(const DlrmInput& input, std::int64_t batch) {
  FK_CHECK_ARG(input.indices.data() != nullptr && input.offsets.data() != nullptr, kOp, "input",
               "CSR bags (indices and offsets; raw values are not routed)", "none");
  FK_CHECK_ARG(input.dense.device().is_cpu() && input.indices.device().is_cpu() && input.offsets.device().is_cpu(), kOp,
               "input", "host tensors (the loader's batch)",
               input.dense.str() + ", " + input.indices.str() + ", " + input.offsets.str());
  FK_CHECK_ARG(input.raw_sparse.data() == nullptr && input.pooled.data() == nullptr, kOp, "input",
               "dense and CSR bags only (no raw_sparse or pooled)", input.raw_sparse.str() + ", " + input.pooled.str());
  const std::int64_t t = embeddings_.num_tables(), d = embeddings_.dim();
  if (pooled_.numel() != batch * t * d) {
    const Device dev = comm_.device();
    const fk::detail::OnDevice on(dev);
    pooled_ = Tensor::empty({batch, t, d}, DType::f32, dev);
    dpooled_ = Tensor::empty({batch, t, d}, DType::f32, dev);
    logits_ = Tensor::empty({batch}, DType::f32, Device::cpu());
    dlogits_ = Tensor::empty({batch}, DType::f32, Device::cpu());
  }
  // The step's buffers against the batch (the host ones are written through raw pointers).
  FK_CHECK_ARG(pooled_.numel() == batch * t * d && dpooled_.numel() == pooled_.numel() &&
                   pooled_.view().device() == comm_.device() && dpooled_.view().device() == comm_.device(),
               kOp, "pooled", fmt::format("f32 [{}, {}, {}] on {}", batch, t, d, comm_.device().str()),
               pooled_.view().str() + ", " + dpooled_.view().str());
  check_host_vector(logits_, batch, "logits");
  check_host_vector(dlogits_, batch, "dlogits");
  embeddings_.forward(input.indices, input.offsets, batch, pooled_);
}

double DistributedDlrm::train_step(const DlrmInput& input, const TensorView& labels, const OptimizerConfig& opt) {
  FK_CHECK_ARG(input.dense.rank() == 2, kOp, "dense", "f32 [B, inputs]", input.dense.str());
  const std::int64_t b = input.dense.size(0);
  check_host_vector(labels, b, "labels");
  lookup(input, b);
  dense_.forward({input.dense, {}, {}, {}, pooled_}, logits_);
  // This slice's mean loss and (p - y) / b, rescaled to the global batch's (p - y) / B.
  const TensorView dlogits = dlogits_;
  const double loss = bce_with_logits(logits_, labels, &dlogits);
  const std::int64_t gb = embeddings_.global_batch();
  const float scale = static_cast<float>(static_cast<double>(b) / static_cast<double>(gb));
  float* g = dlogits_.data_as<float>();
  for (std::int64_t i = 0; i < b; ++i) g[i] *= scale;
  if (buckets_.empty()) {
    // One all-reduce of the parameter arena's whole gradient buffer, after the backward.
    dense_.backward(dlogits_, dpooled_);
    embeddings_.backward(dpooled_);
    comm_.all_reduce_sum(dense_.dense_gradients());
  } else {
    // Each bucket's all-reduce starts once the backward has made its last unit (queued on the
    // model's stream on a GPU; the communicator orders the sum after it), and runs during the rest
    // of the backward and the tables' gradient exchange; the optimizer step waits for them all.
    const TensorView grads = dense_.dense_gradients();
    auto* base = static_cast<float*>(grads.data());
    std::size_t next = 0;
    dense_.backward(dlogits_, dpooled_, [&](std::size_t unit) {
      while (next < buckets_.size() && buckets_[next].last_unit == unit) {
        const dist::GradientBucket& bk = buckets_[next++];
        comm_.start_all_reduce_sum(TensorView(base + bk.offset, DType::f32, {bk.floats}, grads.device()),
                                   dense_.stream());
      }
    });
    FK_CHECK_ARG(next == buckets_.size(), kOp, "gradient buckets", fmt::format("{} started by the backward", buckets_.size()),
                 fmt::format("{}", next));
    // On a GPU the tables' gradient exchange is queued after the sums (NCCL runs a communicator's
    // collectives one at a time, in the order they are queued, whatever their streams), so that no
    // collective of the embeddings' runs beside another; on the host (MPI) the exchange runs while
    // the sums are in flight, and moves them on.
    if (const Stream* st = embeddings_.stream()) comm_.wait_all_reduces(st);
    embeddings_.backward(dpooled_);
    comm_.wait_all_reduces(dense_.stream());
  }
  if (opt.kind == OptimizerKind::adagrad) embeddings_.ensure_state(opt.initial_accumulator);
  dense_.step(opt);
  embeddings_.step(opt);
  // The loss summed over the ranks as two floats (a double split into its float and the rest),
  // so the global mean keeps about 14 digits through an f32 all-reduce.
  const double sum = loss * static_cast<double>(b);
  float parts[2] = {static_cast<float>(sum), 0.0f};
  parts[1] = static_cast<float>(sum - static_cast<double>(parts[0]));
  sum_over_ranks(parts);
  return (static_cast<double>(parts[0]) + static_cast<double>(parts[1])) / static_cast<double>(gb);
}

void DistributedDlrm::sum_over_ranks(float (&parts)[2]) {
  const TensorView host(parts, DType::f32, {2}, Device::cpu());
  const Stream* st = embeddings_.stream();
  if (st == nullptr) return comm_.all_reduce_sum(host);
  // A device collective: through two floats on the GPU, ordered on the embeddings' stream.
  const fk::detail::OnDevice on(comm_.device());
  if (!loss_parts_.data()) loss_parts_ = Tensor::empty({2}, DType::f32, comm_.device(), st);
  copy_async(loss_parts_, host, *st);
  comm_.all_reduce_sum(loss_parts_, st);
  copy_async(host, loss_parts_, *st);
  st->synchronize();
}

void DistributedDlrm::predict(const DlrmInput& input, const TensorView& probabilities) {
  FK_CHECK_ARG(input.dense.rank() == 2, kOp, "dense", "f32 [B, inputs]", input.dense.str());
  check_host_vector(probabilities, input.dense.size(0), "probabilities");
  lookup(input, input.dense.size(0));
  dense_.predict({input.dense, {}, {}, {}, pooled_}, probabilities);
}

}  // namespace fk::models
