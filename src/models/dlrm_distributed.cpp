// DLRM over several ranks: the external-table Dlrm, dist::ShardedEmbeddingBags and one all-reduce.
#include "fusekit/models/dlrm_distributed.hpp"

#include <fmt/format.h>

#include <sstream>

#include "core/on_device.hpp"
#include "fusekit/core/error.hpp"
#include "fusekit/core/stream.hpp"
#include "models/dlrm_state_io.hpp"

namespace fk::models {
namespace {

constexpr const char* kOp = "models::DistributedDlrm";

// A shard's optimizer state inside a collection's state buffer: [rows] row-wise, else [rows, D].
TensorView shard_state(const nn::EmbeddingBagCollection& l, int s, bool rowwise) {
  const TensorView& tv = l.tables[static_cast<std::size_t>(s)].view();
  const std::int64_t base = l.layout().base(s);
  auto* state = const_cast<float*>(l.state.data_as<const float>());
  if (rowwise) return TensorView(state + base, DType::f32, {tv.size(0)}, l.state.device());
  return TensorView(state + base * tv.size(1), DType::f32, tv.shape(), l.state.device());
}

// A host vector the step reads or writes through a raw pointer: f32 [n], contiguous, on the CPU.
void check_host_vector(const TensorView& t, std::int64_t n, const char* arg) {
  FK_CHECK_ARG(t.dtype() == DType::f32 && t.numel() == n && t.is_contiguous() && t.data() != nullptr &&
                   t.device().is_cpu(),
               kOp, arg, fmt::format("f32 [{}], contiguous, on the host", n), t.str() + (t.data() ? "" : " with no data"));
}

// Rank r's shards in (table, first row) order, as dist::ShardedEmbeddingBags holds them.
std::vector<dist::Shard> shards_of(const dist::ShardingPlan& plan, int r) {
  std::vector<dist::Shard> out;
  for (const auto& table : plan.tables)
    for (const dist::Shard& sh : table)
      if (sh.rank == r) out.push_back(sh);
  return out;
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
      dense_(config, comm.device(), impl, DlrmTables::external),
      embeddings_(config.table_rows, config.embedding_dim,
                  {Pooling::sum, config.raw_hash, impl == DlrmImpl::fused, config.rowwise_adagrad},
                  dlrm_table_init(config), std::move(plan), comm) {}

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
  dense_.backward(dlogits_, dpooled_);
  embeddings_.backward(dpooled_);
  // One flat bucket, after the whole backward (dense_gradients() is the parameter arena's one
  // buffer, on the model's device); overlapping it with the backward needs the MLPs' layers to hand
  // out their gradients as they are made, and stream-ordered all-reduces of buckets of them.
  comm_.all_reduce_sum(dense_.dense_gradients());
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

void DistributedDlrm::save_shards(std::ostream& out) {
  const fk::detail::OnDevice on(comm_.device());
  const nn::EmbeddingBagCollection* l = embeddings_.local();
  const bool adagrad = l != nullptr && l->state.numel() > 0;
  std::vector<TensorView> arrays;
  for (int s = 0; l && s < l->num_tables(); ++s) arrays.push_back(l->tables[static_cast<std::size_t>(s)]);
  for (int s = 0; adagrad && s < l->num_tables(); ++s) arrays.push_back(shard_state(*l, s, dense_.config().rowwise_adagrad));
  detail::write_state(out, adagrad, arrays);
}

void DistributedDlrm::load_shards(std::istream& in) {
  const fk::detail::OnDevice on(comm_.device());
  nn::EmbeddingBagCollection* l = embeddings_.local();
  std::uint64_t count = 0;
  const bool adagrad = detail::read_state_header(in, count);
  FK_CHECK_ARG(l != nullptr || count == 0, kOp, "in", "no shard (this rank holds none)",
               fmt::format("{} arrays", count));
  if (l == nullptr) return;
  l->state = Tensor();
  // On the embeddings' stream and device, done when it returns (the copies below are synchronous).
  if (adagrad) embeddings_.ensure_state(0.0f);
  std::vector<TensorView> arrays;
  for (int s = 0; s < l->num_tables(); ++s) arrays.push_back(l->tables[static_cast<std::size_t>(s)]);
  for (int s = 0; adagrad && s < l->num_tables(); ++s) arrays.push_back(shard_state(*l, s, dense_.config().rowwise_adagrad));
  detail::read_state_arrays(in, count, arrays);
}

void consolidate_distributed_state(const DlrmConfig& config, const dist::ShardingPlan& plan, std::istream& dense,
                                   const std::vector<std::istream*>& shards, std::ostream& out) {
  const char* op = "models::consolidate_distributed_state";
  const std::size_t tables = config.table_rows.size();
  const std::int64_t d = config.embedding_dim;
  FK_CHECK_ARG(static_cast<std::size_t>(plan.num_tables()) == tables, op, "plan", fmt::format("{} tables", tables),
               fmt::format("{}", plan.num_tables()));
  FK_CHECK_ARG(shards.size() == static_cast<std::size_t>(plan.ranks), op, "shards",
               fmt::format("one stream per rank ({})", plan.ranks), fmt::format("{}", shards.size()));
  // The dense state: parameters (P arrays), with Adagrad their accumulators (P more), then the
  // MLPs' rounding steps when compressing.
  std::uint64_t count = 0;
  const bool adagrad = detail::read_state_header(dense, count);
  const std::uint64_t extra = config.compress_activations_bits > 0 ? 1 : 0;
  FK_CHECK_ARG(count >= extra && (!adagrad || (count - extra) % 2 == 0), op, "dense",
               "a dense DLRM state of this configuration", fmt::format("{} arrays", count));
  const std::uint64_t params = adagrad ? (count - extra) / 2 : count - extra;
  const auto limit = static_cast<std::uint64_t>(config.parameter_count()) + 64;
  std::vector<std::vector<float>> dense_arrays;
  for (std::uint64_t i = 0; i < count; ++i) dense_arrays.push_back(detail::read_state_array(dense, limit, op, "dense"));
  // Every table whole, and its accumulators, filled from the shards that hold its rows.
  std::vector<Tensor> values, states;
  for (std::size_t t = 0; t < tables; ++t) {
    values.push_back(Tensor::empty({config.table_rows[t], d}, DType::f32, Device::cpu()));
    if (adagrad)
      states.push_back(config.rowwise_adagrad ? Tensor::empty({config.table_rows[t]}, DType::f32, Device::cpu())
                                              : Tensor::empty({config.table_rows[t], d}, DType::f32, Device::cpu()));
  }
  const auto rows_of = [&](const Tensor& full, const dist::Shard& sh) {
    auto* base = const_cast<float*>(full.data_as<const float>());
    const std::int64_t n = sh.row_end - sh.row_begin;
    if (full.view().rank() == 1) return TensorView(base + sh.row_begin, DType::f32, {n}, Device::cpu());
    return TensorView(base + sh.row_begin * d, DType::f32, {n, d}, Device::cpu());
  };
  for (int r = 0; r < plan.ranks; ++r) {
    const std::vector<dist::Shard> mine = shards_of(plan, r);
    std::uint64_t n = 0;
    const bool with_state = detail::read_state_header(*shards[static_cast<std::size_t>(r)], n);
    FK_CHECK_ARG(mine.empty() || with_state == adagrad, op, "shards",
                 fmt::format("rank {}'s shards {} optimizer state, as the dense state", r, adagrad ? "with" : "without"),
                 with_state ? "with" : "without");
    std::vector<TensorView> arrays;
    for (const dist::Shard& sh : mine) arrays.push_back(rows_of(values[static_cast<std::size_t>(sh.table)], sh));
    for (std::size_t i = 0; with_state && i < mine.size(); ++i)
      arrays.push_back(rows_of(states[static_cast<std::size_t>(mine[i].table)], mine[i]));
    detail::read_state_arrays(*shards[static_cast<std::size_t>(r)], n, arrays);
  }
  // The single-process order (Dlrm's state_arrays): parameters, tables, parameters' and tables'
  // accumulators, rounding steps.
  const auto view = [](std::vector<float>& v) {
    return TensorView(v.data(), DType::f32, {static_cast<std::int64_t>(v.size())}, Device::cpu());
  };
  std::vector<TensorView> all;
  for (std::uint64_t i = 0; i < params; ++i) all.push_back(view(dense_arrays[i]));
  for (const Tensor& v : values) all.push_back(v);
  for (std::uint64_t i = 0; adagrad && i < params; ++i) all.push_back(view(dense_arrays[params + i]));
  for (const Tensor& s : states) all.push_back(s);
  if (extra) all.push_back(view(dense_arrays.back()));
  detail::write_state(out, adagrad, all);
}

void DistributedDlrm::predict(const DlrmInput& input, const TensorView& probabilities) {
  FK_CHECK_ARG(input.dense.rank() == 2, kOp, "dense", "f32 [B, inputs]", input.dense.str());
  check_host_vector(probabilities, input.dense.size(0), "probabilities");
  lookup(input, input.dense.size(0));
  dense_.predict({input.dense, {}, {}, {}, pooled_}, probabilities);
}

}  // namespace fk::models
