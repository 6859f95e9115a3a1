// Model-parallel embedding bags: the all-to-all routing around the single-process layer.
#include "fusekit/dist/sharded_embeddings.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <numeric>

#include "fusekit/core/error.hpp"
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
  FK_CHECK_ARG(plan_.table_wise(), kOp, "plan", "a table-wise plan (row-wise shards are not routed yet)",
               "tables split by rows");
  FK_CHECK_ARG(comm.device().is_cpu(), kOp, "comm", "a host communicator", comm.device().str());
  for (int t = 0; t < num_tables(); ++t)
    FK_CHECK_ARG(plan_.tables[static_cast<std::size_t>(t)][0].row_begin == 0 &&
                     plan_.tables[static_cast<std::size_t>(t)][0].row_end == rows_[static_cast<std::size_t>(t)],
                 kOp, "plan", fmt::format("table {} with {} rows", t, rows_[static_cast<std::size_t>(t)]),
                 fmt::format("rows [{}, {})", plan_.tables[static_cast<std::size_t>(t)][0].row_begin,
                             plan_.tables[static_cast<std::size_t>(t)][0].row_end));
  for (int r = 0; r < comm.size(); ++r) tables_of_.push_back(plan_.tables_of(r));
  local_tables_ = tables_of_[static_cast<std::size_t>(comm.rank())];
  if (!local_tables_.empty()) {
    std::vector<std::int64_t> local_rows, ids;
    for (int t : local_tables_) {
      local_rows.push_back(rows_[static_cast<std::size_t>(t)]);
      ids.push_back(t);
    }
    local_.emplace(std::move(local_rows), dim, options, Device::cpu(), init, ids);
  }
}

Tensor* ShardedEmbeddingBags::table(int t) {
  const auto it = std::find(local_tables_.begin(), local_tables_.end(), t);
  if (it == local_tables_.end()) return nullptr;
  return &local_->tables[static_cast<std::size_t>(it - local_tables_.begin())];
}

std::int64_t ShardedEmbeddingBags::slice_start() const noexcept {
  return start_of_.empty() ? 0 : start_of_[static_cast<std::size_t>(comm_.rank())];
}

void ShardedEmbeddingBags::forward(const TensorView& indices, const TensorView& offsets, std::int64_t batch,
                                   const TensorView& pooled) {
  const int ranks = comm_.size();
  const std::int64_t t_all = num_tables(), t_me = static_cast<std::int64_t>(local_tables_.size()), d = dim_;
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

  // 1. The bag lengths of each owner's tables, table by table, this rank's samples in order.
  std::vector<std::int64_t> send_counts(static_cast<std::size_t>(ranks)), recv_counts(static_cast<std::size_t>(ranks));
  for (int o = 0; o < ranks; ++o) {
    send_counts[static_cast<std::size_t>(o)] = batch * static_cast<std::int64_t>(tables_of_[static_cast<std::size_t>(o)].size());
    recv_counts[static_cast<std::size_t>(o)] = batch_of_[static_cast<std::size_t>(o)] * t_me;
  }
  const TensorView send_len = host_view(send_i64_, std::accumulate(send_counts.begin(), send_counts.end(), std::int64_t{0}), DType::i64);
  const std::int64_t n_len = std::accumulate(recv_counts.begin(), recv_counts.end(), std::int64_t{0});
  std::vector<std::int64_t> lengths(static_cast<std::size_t>(n_len));
  {
    std::int64_t* p = send_len.data_as<std::int64_t>();
    for (int o = 0; o < ranks; ++o)
      for (int t : tables_of_[static_cast<std::size_t>(o)])
        for (std::int64_t i = 0; i < batch; ++i) *p++ = off[t * batch + i + 1] - off[t * batch + i];
  }
  comm_.all_to_all_v(send_len, send_counts, TensorView(lengths.data(), DType::i64, {n_len}, Device::cpu()), recv_counts);

  // 2. The ids, in the same order.
  std::vector<std::int64_t> id_recv_counts(static_cast<std::size_t>(ranks), 0);
  for (int o = 0; o < ranks; ++o) {
    std::int64_t n = 0;
    for (int t : tables_of_[static_cast<std::size_t>(o)]) n += off[(t + 1) * batch] - off[t * batch];
    send_counts[static_cast<std::size_t>(o)] = n;
  }
  {
    const std::int64_t* len = lengths.data();
    for (int r = 0; r < ranks; ++r) {
      const std::int64_t n = batch_of_[static_cast<std::size_t>(r)] * t_me;
      id_recv_counts[static_cast<std::size_t>(r)] = std::accumulate(len, len + n, std::int64_t{0});
      len += n;
    }
  }
  const TensorView send_ids = host_view(send_i64_, std::accumulate(send_counts.begin(), send_counts.end(), std::int64_t{0}), DType::i64);
  {
    std::int64_t* p = send_ids.data_as<std::int64_t>();
    for (int o = 0; o < ranks; ++o)
      for (int t : tables_of_[static_cast<std::size_t>(o)]) {
        const std::int64_t b0 = off[t * batch], b1 = off[(t + 1) * batch];
        p = std::copy(idx + b0, idx + b1, p);
      }
  }
  const std::int64_t n_ids = std::accumulate(id_recv_counts.begin(), id_recv_counts.end(), std::int64_t{0});
  const TensorView recv_ids = host_view(recv_i64_, n_ids, DType::i64);
  comm_.all_to_all_v(send_ids, send_counts, recv_ids, id_recv_counts);

  // 3. The owner's bags for the global batch: local table j, then ranks in order, then samples.
  const std::int64_t gb = global_batch_;
  if (t_me > 0) {
    local_offsets_.assign(static_cast<std::size_t>(t_me * gb + 1), 0);
    local_indices_.resize(static_cast<std::size_t>(std::max<std::int64_t>(n_ids, 1)));
    // Where rank r's lengths and ids start in the received buffers, and its ids of table j.
    std::vector<std::int64_t> len_at(static_cast<std::size_t>(ranks)), ids_at(static_cast<std::size_t>(ranks));
    std::int64_t l = 0, i = 0;
    for (int r = 0; r < ranks; ++r) {
      len_at[static_cast<std::size_t>(r)] = l;
      ids_at[static_cast<std::size_t>(r)] = i;
      l += batch_of_[static_cast<std::size_t>(r)] * t_me;
      i += id_recv_counts[static_cast<std::size_t>(r)];
    }
    const std::int64_t* all_ids = recv_ids.data_as<const std::int64_t>();
    std::int64_t q = 0, at = 0;
    for (std::int64_t j = 0; j < t_me; ++j)
      for (int r = 0; r < ranks; ++r) {
        const std::int64_t br = batch_of_[static_cast<std::size_t>(r)];
        const std::int64_t* len = lengths.data() + len_at[static_cast<std::size_t>(r)] + j * br;
        std::int64_t& src = ids_at[static_cast<std::size_t>(r)];  // rank r's ids are table by table: consumed in order
        for (std::int64_t i = 0; i < br; ++i) {
          std::copy(all_ids + src, all_ids + src + len[i], local_indices_.data() + at);
          src += len[i];
          at += len[i];
          local_offsets_[static_cast<std::size_t>(++q)] = at;
        }
      }
    const TensorView li(local_indices_.data(), DType::i64, {n_ids}, Device::cpu());
    const TensorView lo(local_offsets_.data(), DType::i64, {t_me * gb + 1}, Device::cpu());
    const TensorView out = host_view(local_out_, gb * t_me * d, DType::f32).reshape({gb, t_me, d});
    local_->reserve(n_ids);
    local_->forward({li, lo, std::nullopt}, gb, out);
  }

  // 4. The pooled rows back to the ranks whose samples they are: rank r's are rows
  //    [start_r, start_r + b_r) of the owner's [B, T_local, D], contiguous.
  for (int r = 0; r < ranks; ++r) {
    send_counts[static_cast<std::size_t>(r)] = batch_of_[static_cast<std::size_t>(r)] * t_me * d;
    recv_counts[static_cast<std::size_t>(r)] = batch * static_cast<std::int64_t>(tables_of_[static_cast<std::size_t>(r)].size()) * d;
  }
  const TensorView send_out = host_view(local_out_, gb * t_me * d, DType::f32);
  const TensorView recv_out = host_view(recv_f32_, batch * t_all * d, DType::f32);
  comm_.all_to_all_v(send_out, send_counts, recv_out, recv_counts);
  float* dst = pooled.data_as<float>();
  const float* src = recv_out.data_as<const float>();
  for (int o = 0; o < ranks; ++o) {
    const std::vector<int>& ts = tables_of_[static_cast<std::size_t>(o)];
    for (std::int64_t i = 0; i < batch; ++i)
      for (int t : ts) {
        std::memcpy(dst + (i * t_all + t) * d, src, static_cast<std::size_t>(d) * sizeof(float));
        src += d;
      }
  }
}

void ShardedEmbeddingBags::backward(const TensorView& dpooled) {
  const int ranks = comm_.size();
  const std::int64_t t_all = num_tables(), t_me = static_cast<std::int64_t>(local_tables_.size()), d = dim_;
  FK_CHECK_ARG(batch_ > 0, kOp, "backward", "a forward() first", "none");
  check_pooled(dpooled, batch_, t_all, d, "dpooled");
  std::vector<std::int64_t> send_counts(static_cast<std::size_t>(ranks)), recv_counts(static_cast<std::size_t>(ranks));
  const TensorView send = host_view(send_f32_, batch_ * t_all * d, DType::f32);
  float* p = send.data_as<float>();
  const float* g = dpooled.data_as<const float>();
  for (int o = 0; o < ranks; ++o) {
    const std::vector<int>& ts = tables_of_[static_cast<std::size_t>(o)];
    send_counts[static_cast<std::size_t>(o)] = batch_ * static_cast<std::int64_t>(ts.size()) * d;
    recv_counts[static_cast<std::size_t>(o)] = batch_of_[static_cast<std::size_t>(o)] * t_me * d;
    for (std::int64_t i = 0; i < batch_; ++i)
      for (int t : ts) p = std::copy(g + (i * t_all + t) * d, g + (i * t_all + t + 1) * d, p);
  }
  // The owner's gradient of [B, T_local, D], the ranks' slices in order: the global batch's.
  const TensorView grad = host_view(local_grad_, global_batch_ * t_me * d, DType::f32);
  comm_.all_to_all_v(send, send_counts, grad, recv_counts);
  if (local_) local_->backward(grad.reshape({global_batch_, t_me, d}));
}

void ShardedEmbeddingBags::step(const nn::OptimizerConfig& opt) {
  if (local_) local_->step(opt);
}

void ShardedEmbeddingBags::ensure_state(float initial_accumulator) {
  if (local_) local_->ensure_state(initial_accumulator);
}

}  // namespace fk::dist
