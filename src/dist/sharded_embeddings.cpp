// Model-parallel embedding bags: the all-to-all routing around the single-process layer.
#include "fusekit/dist/sharded_embeddings.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "fusekit/core/error.hpp"
#include "fusekit/core/random.hpp"
#include "fusekit/dist/bag_routing.hpp"
#include "fusekit/ops/recsys.hpp"

namespace fk::dist {
namespace {

constexpr const char* kOp = "dist::ShardedEmbeddingBags";

template <class T>
TensorView host_view(std::vector<T>& v, std::int64_t n, DType dt) {
  if (static_cast<std::int64_t>(v.size()) < n) v.resize(static_cast<std::size_t>(n));
  return TensorView(v.data(), dt, {n}, Device::cpu());
}

void check_pooled(const TensorView& t, std::int64_t b, std::int64_t tables, std::int64_t dim, const char* arg) {
  FK_CHECK_ARG(t.dtype() == DType::f32 && t.rank() == 3 && t.size(0) == b && t.size(1) == tables &&
                   t.size(2) == dim && t.is_contiguous() && t.data() != nullptr && t.device().is_cpu(),
               kOp, arg, fmt::format("f32 [{}, {}, {}], contiguous, on the host", b, tables, dim), t.str());
}

}  // namespace

ShardedEmbeddingBags::ShardedEmbeddingBags(std::vector<std::int64_t> rows, std::int64_t dim,
                                           nn::EmbeddingBagCollectionOptions options, RandomParams init,
                                           ShardingPlan plan, Communicator& comm)
    : rows_(std::move(rows)), dim_(dim), plan_(std::move(plan)), comm_(comm), all_(rows_, Device::cpu()) {
  FK_CHECK_ARG(plan_.num_tables() == num_tables() && plan_.ranks == comm.size(), kOp, "plan",
               fmt::format("{} tables over {} ranks", num_tables(), comm.size()),
               fmt::format("{} tables over {} ranks", plan_.num_tables(), plan_.ranks));
  FK_CHECK_ARG(comm.device().is_cpu(), kOp, "comm", "a host communicator", comm.device().str());
  shards_of_.resize(static_cast<std::size_t>(comm.size()));
  for (int t = 0; t < num_tables(); ++t) {
    const std::vector<Shard>& shards = plan_.tables[static_cast<std::size_t>(t)];
    // The shards must tile the table's rows, in order.
    std::int64_t next = 0;
    for (const Shard& sh : shards) {
      FK_CHECK_ARG(sh.table == t && sh.row_begin == next && sh.row_end > sh.row_begin && sh.rank >= 0 &&
                       sh.rank < comm.size(),
                   kOp, "plan", fmt::format("table {}'s shards tiling its {} rows in order, on ranks [0, {})", t,
                                            rows_[static_cast<std::size_t>(t)], comm.size()),
                   fmt::format("table {} rows [{}, {}) on rank {}", sh.table, sh.row_begin, sh.row_end, sh.rank));
      next = sh.row_end;
      shards_of_[static_cast<std::size_t>(sh.rank)].push_back(sh);
    }
    FK_CHECK_ARG(next == rows_[static_cast<std::size_t>(t)], kOp, "plan",
                 fmt::format("table {}'s shards covering its {} rows", t, rows_[static_cast<std::size_t>(t)]),
                 fmt::format("rows [0, {})", next));
    FK_CHECK_ARG(shards.size() == 1 || options.pooling == Pooling::sum, kOp, "plan",
                 "tables split by rows only with sum pooling (partial sums add up; partial means do not)",
                 fmt::format("table {} in {} shards", t, shards.size()));
  }
  const std::vector<Shard>& mine = local_shards();
  if (!mine.empty()) {
    std::vector<std::int64_t> local_rows, ids;
    for (const Shard& sh : mine) {
      local_rows.push_back(sh.row_end - sh.row_begin);
      ids.push_back(sh.table);
    }
    local_.emplace(std::move(local_rows), dim, options, Device::cpu(), init, ids);
    // A split table's shard: its rows of the whole table's values. The whole table is drawn and
    // its rows copied (transient memory of one table; drawing from an offset of the Philox stream
    // would avoid it).
    for (std::size_t s = 0; s < mine.size(); ++s) {
      const Shard& sh = mine[s];
      const std::int64_t table_rows = rows_[static_cast<std::size_t>(sh.table)];
      if (sh.row_end - sh.row_begin == table_rows) continue;
      Tensor whole = Tensor::empty({table_rows, dim}, DType::f32, Device::cpu());
      const float bound = static_cast<float>(std::sqrt(1.0 / static_cast<double>(table_rows)));
      fill_uniform(whole, -bound, bound, {init.seed, init.subsequence + static_cast<std::uint64_t>(sh.table)});
      std::memcpy(local_->tables[s].data(), whole.data_as<const float>() + sh.row_begin * dim,
                  static_cast<std::size_t>((sh.row_end - sh.row_begin) * dim) * sizeof(float));
    }
  }
}

Tensor& ShardedEmbeddingBags::shard_values(std::size_t s) {
  FK_CHECK_ARG(s < local_shards().size(), "dist::ShardedEmbeddingBags::shard_values", "s",
               fmt::format("a local shard in [0, {})", local_shards().size()), fmt::format("{}", s));
  return local_->tables[s];
}

std::int64_t ShardedEmbeddingBags::slice_start() const noexcept {
  return start_of_.empty() ? 0 : start_of_[static_cast<std::size_t>(comm_.rank())];
}

void ShardedEmbeddingBags::forward(const TensorView& indices, const TensorView& offsets, std::int64_t batch,
                                   const TensorView& pooled) {
  const int ranks = comm_.size();
  const std::int64_t t_all = num_tables(), s_me = static_cast<std::int64_t>(local_shards().size()), d = dim_;
  FK_CHECK_ARG(batch >= 1, kOp, "batch", ">= 1 sample on every rank", fmt::format("{}", batch));
  check_embedding_input(all_, indices, offsets, batch, kOp);
  check_pooled(pooled, batch, t_all, d, "pooled");
  const std::int64_t* idx = indices.data_as<const std::int64_t>();
  const std::int64_t* off = offsets.data_as<const std::int64_t>();

  // Every rank's batch, and where its slice starts in the global batch.
  const std::vector<std::int64_t> mine(static_cast<std::size_t>(ranks), batch);
  batch_of_.assign(static_cast<std::size_t>(ranks), 0);
  comm_.exchange_counts(mine, batch_of_);
  start_of_.assign(static_cast<std::size_t>(ranks), 0);
  std::exclusive_scan(batch_of_.begin(), batch_of_.end(), start_of_.begin(), std::int64_t{0});
  batch_ = batch;
  global_batch_ = start_of_.back() + batch_of_.back();

  // 1. The bag lengths within each owner's shards, shard by shard, this rank's samples in order;
  //    and how many ids each owner gets.
  route_ids(shards_of_, idx, off, batch, routed_);
  std::vector<std::int64_t> send_counts(static_cast<std::size_t>(ranks)), recv_counts(static_cast<std::size_t>(ranks));
  for (int o = 0; o < ranks; ++o) recv_counts[static_cast<std::size_t>(o)] = batch_of_[static_cast<std::size_t>(o)] * s_me;
  const std::int64_t n_len = std::accumulate(recv_counts.begin(), recv_counts.end(), std::int64_t{0});
  std::vector<std::int64_t> lengths(static_cast<std::size_t>(n_len));
  comm_.all_to_all_v(host_view(routed_.lengths, std::ssize(routed_.lengths), DType::i64), routed_.length_counts,
                     TensorView(lengths.data(), DType::i64, {n_len}, Device::cpu()), recv_counts);

  // 2. The ids, in the same order, as rows of their shard.
  std::vector<std::int64_t> id_recv_counts(static_cast<std::size_t>(ranks), 0);
  {
    const std::int64_t* len = lengths.data();
    for (int r = 0; r < ranks; ++r) {
      const std::int64_t n = batch_of_[static_cast<std::size_t>(r)] * s_me;
      id_recv_counts[static_cast<std::size_t>(r)] = std::accumulate(len, len + n, std::int64_t{0});
      len += n;
    }
  }
  const std::int64_t n_ids = std::accumulate(id_recv_counts.begin(), id_recv_counts.end(), std::int64_t{0});
  const TensorView recv_ids = host_view(recv_i64_, n_ids, DType::i64);
  comm_.all_to_all_v(host_view(routed_.ids, std::ssize(routed_.ids), DType::i64), routed_.id_counts, recv_ids,
                     id_recv_counts);

  // 3. The owner's bags for the global batch: local shard j, then ranks in order, then samples.
  const std::int64_t gb = global_batch_;
  if (s_me > 0) {
    if (order_batch_of_ != batch_of_) {
      order_ = owner_bag_order(batch_of_, s_me);
      order_batch_of_ = batch_of_;
    }
    local_offsets_.resize(static_cast<std::size_t>(s_me * gb + 1));
    local_indices_.resize(static_cast<std::size_t>(std::max<std::int64_t>(n_ids, 1)));
    permute_bags({TensorView(lengths.data(), DType::i64, {n_len}, Device::cpu()), recv_ids,
                  TensorView(order_.data(), DType::i64, {s_me * gb}, Device::cpu()),
                  TensorView(local_offsets_.data(), DType::i64, {s_me * gb + 1}, Device::cpu()),
                  TensorView(local_indices_.data(), DType::i64, {n_ids}, Device::cpu())});
    const TensorView li(local_indices_.data(), DType::i64, {n_ids}, Device::cpu());
    const TensorView lo(local_offsets_.data(), DType::i64, {s_me * gb + 1}, Device::cpu());
    const TensorView out = host_view(local_out_, gb * s_me * d, DType::f32).reshape({gb, s_me, d});
    local_->reserve(n_ids);
    local_->forward({li, lo, std::nullopt}, gb, out);
  }

  // 4. The pooled rows back to the ranks whose samples they are: rank r's are rows
  //    [start_r, start_r + b_r) of the owner's [B, S_local, D], contiguous. Each rank sums the
  //    partials of a bag by owner rank, then shard order (a whole table's single partial: 0 + x).
  for (int r = 0; r < ranks; ++r) {
    send_counts[static_cast<std::size_t>(r)] = batch_of_[static_cast<std::size_t>(r)] * s_me * d;
    recv_counts[static_cast<std::size_t>(r)] = batch * static_cast<std::int64_t>(shards_of_[static_cast<std::size_t>(r)].size()) * d;
  }
  const TensorView send_out = host_view(local_out_, gb * s_me * d, DType::f32);
  const TensorView recv_out = host_view(recv_f32_, std::accumulate(recv_counts.begin(), recv_counts.end(), std::int64_t{0}), DType::f32);
  comm_.all_to_all_v(send_out, send_counts, recv_out, recv_counts);
  const std::vector<std::int64_t>& row_of = partial_rows(batch);
  float* dst = pooled.data_as<float>();
  std::fill(dst, dst + batch * t_all * d, 0.0f);
  const float* src = recv_out.data_as<const float>();
  for (const std::int64_t row : row_of) {
    float* to = dst + row * d;
    for (std::int64_t k = 0; k < d; ++k) to[k] += src[k];
    src += d;
  }
}

const std::vector<std::int64_t>& ShardedEmbeddingBags::partial_rows(std::int64_t batch) {
  if (rows_batch_ != batch) {
    row_of_ = pooled_row_of_partials(shards_of_, batch, num_tables());
    rows_batch_ = batch;
  }
  return row_of_;
}

void ShardedEmbeddingBags::backward(const TensorView& dpooled) {
  const int ranks = comm_.size();
  const std::int64_t t_all = num_tables(), s_me = static_cast<std::int64_t>(local_shards().size()), d = dim_;
  FK_CHECK_ARG(batch_ > 0, kOp, "backward", "a forward() first", "none");
  check_pooled(dpooled, batch_, t_all, d, "dpooled");
  std::vector<std::int64_t> send_counts(static_cast<std::size_t>(ranks)), recv_counts(static_cast<std::size_t>(ranks));
  // A bag's gradient goes to every shard of its table (a shard its bag did not reach pooled zero
  // there, and its backward touches no row for it).
  for (int o = 0; o < ranks; ++o) {
    send_counts[static_cast<std::size_t>(o)] = batch_ * static_cast<std::int64_t>(shards_of_[static_cast<std::size_t>(o)].size()) * d;
    recv_counts[static_cast<std::size_t>(o)] = batch_of_[static_cast<std::size_t>(o)] * s_me * d;
  }
  const TensorView send = host_view(send_f32_, std::accumulate(send_counts.begin(), send_counts.end(), std::int64_t{0}), DType::f32);
  float* p = send.data_as<float>();
  const float* g = dpooled.data_as<const float>();
  for (const std::int64_t row : partial_rows(batch_)) p = std::copy(g + row * d, g + (row + 1) * d, p);
  // The owner's gradient of [B, S_local, D], the ranks' slices in order: the global batch's.
  const TensorView grad = host_view(local_grad_, global_batch_ * s_me * d, DType::f32);
  comm_.all_to_all_v(send, send_counts, grad, recv_counts);
  if (local_) local_->backward(grad.reshape({global_batch_, s_me, d}));
}

void ShardedEmbeddingBags::step(const nn::OptimizerConfig& opt) {
  if (local_) local_->step(opt);
}

void ShardedEmbeddingBags::ensure_state(float initial_accumulator) {
  if (local_) local_->ensure_state(initial_accumulator);
}

}  // namespace fk::dist
