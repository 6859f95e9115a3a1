// Model-parallel embedding bags: the all-to-all routing around the single-process layer, on host
// memory (the communicator's collectives on host buffers, the packing in host loops) or on the
// communicator's GPU (the exchanges through device buffers, the regrouping and the packing by the
// recsys family's ops on one stream).
#include "fusekit/dist/sharded_embeddings.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "core/on_device.hpp"
#include "fusekit/core/error.hpp"
#include "fusekit/core/random.hpp"
#include "fusekit/core/stream.hpp"
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

void check_pooled(const TensorView& t, std::int64_t b, std::int64_t tables, std::int64_t dim, Device device,
                  const char* arg) {
  FK_CHECK_ARG(t.dtype() == DType::f32 && t.rank() == 3 && t.size(0) == b && t.size(1) == tables &&
                   t.size(2) == dim && t.is_contiguous() && t.data() != nullptr && t.device() == device,
               kOp, arg, fmt::format("f32 [{}, {}, {}], contiguous, on {}", b, tables, dim, device.str()), t.str());
}

// The first n elements of a device buffer, grown (reallocated, the contents dropped) when smaller.
TensorView grown(Tensor& t, std::int64_t n, DType dtype, Device device, const Stream& stream) {
  if (t.numel() < std::max<std::int64_t>(n, 1)) t = Tensor::empty({std::max<std::int64_t>(n, 1)}, dtype, device, &stream);
  return TensorView(t.data(), dtype, {n}, device);
}

// A contiguous [rows, D] view of the start of a buffer.
TensorView matrix(const TensorView& v, std::int64_t rows, std::int64_t d) {
  return TensorView(v.data(), DType::f32, {rows, d}, v.device());
}

// An f32 buffer [n * D] as embedding-bag output [n, 1, D] (one table, n bags).
TensorView one_table_out(const TensorView& v, std::int64_t n, std::int64_t d) {
  return TensorView(v.data(), DType::f32, {n, 1, d}, v.device());
}

}  // namespace

// The GPU path's buffers, grown to the largest batch seen, and the index arrays of one batch size
// on the device.
struct ShardedEmbeddingBags::DeviceState {
  Stream stream;
  Tensor staged;                      // i64: this rank's routed lengths, then its ids
  Tensor recv_lengths, recv_ids;      // i64: what the owners receive
  Tensor order;                       // i64 [S * B]: owner_bag_order, for order_batch_of_
  Tensor local_offsets, local_indices, permute_workspace;
  Tensor local_out, recv_partials;    // f32: the owner's pooled [B, S, D]; the partials back [sum_o b S_o, D]
  Tensor send_grads, local_grad;      // f32: the backward's, the same shapes the other way
  // For `batch` samples, the partials as embedding-bag input: one table of their rows, each pooled
  // row a bag of the rows that add to it (in increasing row: the host loop's order); and the
  // gradients the other way, one-row bags reading the pooled gradient [b * T, D].
  std::int64_t batch = -1;
  TableLayout partials, pooled;
  Tensor sum_indices, sum_offsets, gather_indices, gather_offsets;
};

ShardedEmbeddingBags::~ShardedEmbeddingBags() = default;

ShardedEmbeddingBags::ShardedEmbeddingBags(std::vector<std::int64_t> rows, std::int64_t dim,
                                           nn::EmbeddingBagCollectionOptions options, RandomParams init,
                                           ShardingPlan plan, Communicator& comm)
    : rows_(std::move(rows)),
      dim_(dim),
      plan_(std::move(plan)),
      comm_(comm),
      device_(comm.device()),
      all_(rows_, Device::cpu()) {
  FK_CHECK_ARG(plan_.num_tables() == num_tables() && plan_.ranks == comm.size(), kOp, "plan",
               fmt::format("{} tables over {} ranks", num_tables(), comm.size()),
               fmt::format("{} tables over {} ranks", plan_.num_tables(), plan_.ranks));
  const fk::detail::OnDevice on(device_);
  if (device_.is_cuda()) dev_ = std::make_unique<DeviceState>(DeviceState{.stream = Stream::create(device_)});
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
    // Shard s's rows draw their rounding (16-bit tables) as rows [row_begin, row_end) of its table
    // in the one-process layer.
    std::vector<std::int64_t> local_rows, ids, draw_bases;
    for (const Shard& sh : mine) {
      local_rows.push_back(sh.row_end - sh.row_begin);
      ids.push_back(sh.table);
      draw_bases.push_back(all_.base(sh.table) + sh.row_begin);
    }
    local_.emplace(std::move(local_rows), dim, options, device_, init, ids, std::move(draw_bases));
    // The layer drew its tables on the legacy default stream: they are there before the copies below.
    if (dev_) Stream::default_stream().synchronize();
    // A split table's shard: its rows of the whole table's values. The whole table is drawn in the
    // tables' dtype (on the shard's device: uniform fills are the same bits everywhere) and its rows
    // copied (transient memory of one table; drawing from an offset of the Philox stream would
    // avoid it).
    const Stream* st = stream();
    for (std::size_t s = 0; s < mine.size(); ++s) {
      const Shard& sh = mine[s];
      const std::int64_t table_rows = rows_[static_cast<std::size_t>(sh.table)];
      if (sh.row_end - sh.row_begin == table_rows) continue;
      Tensor whole = Tensor::empty({table_rows, dim}, options.dtype, device_, st);
      const float bound = static_cast<float>(std::sqrt(1.0 / static_cast<double>(table_rows)));
      fill_uniform(whole, -bound, bound, {init.seed, init.subsequence + static_cast<std::uint64_t>(sh.table)}, st);
      const TensorView rows_of_shard = whole.view().slice_rows(sh.row_begin, sh.row_end);
      if (st) copy_async(local_->tables[s], rows_of_shard, *st);
      else copy(local_->tables[s], rows_of_shard);
    }
  }
  if (dev_) dev_->stream.synchronize();
}

const Stream* ShardedEmbeddingBags::stream() const noexcept { return dev_ ? &dev_->stream : nullptr; }

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
  check_pooled(pooled, batch, t_all, d, device_, "pooled");

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
  route_ids(shards_of_, indices.data_as<const std::int64_t>(), offsets.data_as<const std::int64_t>(), batch, routed_);
  if (dev_) return forward_device(pooled);
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
  check_pooled(dpooled, batch_, t_all, d, device_, "dpooled");
  if (dev_) return backward_device(dpooled);
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
  const fk::detail::OnDevice on(device_);
  if (local_) local_->step(opt, stream());
  if (dev_) dev_->stream.synchronize();
}

void ShardedEmbeddingBags::ensure_state(float initial_accumulator) {
  const fk::detail::OnDevice on(device_);
  if (local_) local_->ensure_state(initial_accumulator, stream());
  if (dev_) dev_->stream.synchronize();
}

// ---- The GPU path -------------------------------------------------------------------------------
// The same exchanges as the host path, through device buffers on this object's stream: the routed
// lengths and ids go to the device in one copy, the owners learn their id counts through
// exchange_counts (the host path reads them off the received lengths), permute_bags regroups the
// owner's bags, and the recsys embedding-bag forward does the packing: each pooled row is the sum of
// its partials in increasing row (one table of the received partials, a bag per pooled row: the f32
// sum from zero in the host loop's order, so the same bits), and the backward's gradients are
// one-row bags of the pooled gradient. Each call returns once its work is done, so that a
// collective queued on another stream (the dense all-reduce on the communicator's own) never runs
// beside one of these.

void ShardedEmbeddingBags::forward_device(const TensorView& pooled) {
  const fk::detail::OnDevice on(device_);
  DeviceState& g = *dev_;
  const Stream& st = g.stream;
  const auto ranks = static_cast<std::size_t>(comm_.size());
  const std::int64_t s_me = static_cast<std::int64_t>(local_shards().size()), d = dim_, gb = global_batch_;
  const std::int64_t batch = batch_;

  // 1-2. The routed lengths and ids (one copy), each owner's to it.
  std::vector<std::int64_t> len_recv(ranks), id_recv(ranks);
  comm_.exchange_counts(routed_.id_counts, id_recv);
  for (std::size_t o = 0; o < ranks; ++o) len_recv[o] = batch_of_[o] * s_me;
  const auto n_len_sent = std::ssize(routed_.lengths), n_ids_sent = std::ssize(routed_.ids);
  staged_.assign(routed_.lengths.begin(), routed_.lengths.end());
  staged_.insert(staged_.end(), routed_.ids.begin(), routed_.ids.end());
  const TensorView staged = grown(g.staged, std::ssize(staged_), DType::i64, device_, st);
  copy_async(staged, TensorView(staged_.data(), DType::i64, {std::ssize(staged_)}, Device::cpu()), st);
  const std::int64_t n_len = s_me * gb;
  const std::int64_t n_ids = std::accumulate(id_recv.begin(), id_recv.end(), std::int64_t{0});
  const TensorView recv_len = grown(g.recv_lengths, n_len, DType::i64, device_, st);
  const TensorView recv_ids = grown(g.recv_ids, n_ids, DType::i64, device_, st);
  const auto* base = staged.data_as<std::int64_t>();
  comm_.all_to_all_v(TensorView(const_cast<std::int64_t*>(base), DType::i64, {n_len_sent}, device_),
                     routed_.length_counts, recv_len, len_recv, &st);
  comm_.all_to_all_v(TensorView(const_cast<std::int64_t*>(base) + n_len_sent, DType::i64, {n_ids_sent}, device_),
                     routed_.id_counts, recv_ids, id_recv, &st);

  // 3. The owner's bags for the global batch, regrouped; its shards' pooled rows [B, S_local, D].
  const TensorView local_out = grown(g.local_out, gb * s_me * d, DType::f32, device_, st);
  if (s_me > 0) {
    if (order_batch_of_ != batch_of_) {
      order_ = owner_bag_order(batch_of_, s_me);
      order_batch_of_ = batch_of_;
      copy_async(grown(g.order, n_len, DType::i64, device_, st), TensorView(order_.data(), DType::i64, {n_len}, Device::cpu()),
                 st);
    }
    const TensorView lo = grown(g.local_offsets, n_len + 1, DType::i64, device_, st);
    const TensorView li = grown(g.local_indices, n_ids, DType::i64, device_, st);
    const auto ws_bytes = static_cast<std::int64_t>(permute_bags_workspace_bytes(n_len));
    const TensorView ws = grown(g.permute_workspace, ws_bytes, DType::u8, device_, st);
    permute_bags({recv_len, recv_ids, TensorView(g.order.data(), DType::i64, {n_len}, device_), lo, li, ws}, &st);
    local_->reserve(n_ids, &st);
    local_->forward({li, lo, std::nullopt}, gb, local_out.reshape({gb, s_me, d}), &st);
  }

  // 4. The partials back to the ranks whose samples they are, summed into pooled.
  std::vector<std::int64_t> send_counts(ranks), recv_counts(ranks);
  for (std::size_t r = 0; r < ranks; ++r) {
    send_counts[r] = batch_of_[r] * s_me * d;
    recv_counts[r] = batch * static_cast<std::int64_t>(shards_of_[r].size()) * d;
  }
  const DeviceState& bags = partial_bags(batch);
  const std::int64_t n_partials = std::ssize(row_of_);
  const TensorView partials = grown(g.recv_partials, n_partials * d, DType::f32, device_, st);
  comm_.all_to_all_v(local_out, send_counts, partials, recv_counts, &st);
  embedding_bag_forward(bags.partials,
                        {matrix(partials, n_partials, d), bags.sum_indices.view(), bags.sum_offsets.view(), std::nullopt,
                         one_table_out(pooled, batch * num_tables(), d)},
                        {}, &st);
  st.synchronize();
}

void ShardedEmbeddingBags::backward_device(const TensorView& dpooled) {
  const fk::detail::OnDevice on(device_);
  DeviceState& g = *dev_;
  const Stream& st = g.stream;
  const auto ranks = static_cast<std::size_t>(comm_.size());
  const std::int64_t s_me = static_cast<std::int64_t>(local_shards().size()), d = dim_;
  const DeviceState& bags = partial_bags(batch_);
  const std::int64_t n_partials = std::ssize(row_of_);
  const TensorView send = grown(g.send_grads, n_partials * d, DType::f32, device_, st);
  embedding_bag_forward(bags.pooled,
                        {matrix(dpooled, batch_ * num_tables(), d), bags.gather_indices.view(),
                         bags.gather_offsets.view(), std::nullopt, one_table_out(send, n_partials, d)},
                        {}, &st);
  std::vector<std::int64_t> send_counts(ranks), recv_counts(ranks);
  for (std::size_t o = 0; o < ranks; ++o) {
    send_counts[o] = batch_ * static_cast<std::int64_t>(shards_of_[o].size()) * d;
    recv_counts[o] = batch_of_[o] * s_me * d;
  }
  const TensorView grad = grown(g.local_grad, global_batch_ * s_me * d, DType::f32, device_, st);
  comm_.all_to_all_v(send, send_counts, grad, recv_counts, &st);
  if (local_) local_->backward(grad.reshape({global_batch_, s_me, d}), &st);
  st.synchronize();
}

const ShardedEmbeddingBags::DeviceState& ShardedEmbeddingBags::partial_bags(std::int64_t batch) {
  DeviceState& g = *dev_;
  const std::vector<std::int64_t>& row_of = partial_rows(batch);
  if (g.batch == batch) return g;
  const std::int64_t n = std::ssize(row_of), pooled_rows = batch * num_tables();
  // Each pooled row's partials in increasing order (a counting sort, stable), and one-row bags.
  std::vector<std::int64_t> sum_offsets(static_cast<std::size_t>(pooled_rows) + 1, 0), sum_indices(row_of.size());
  for (const std::int64_t row : row_of) ++sum_offsets[static_cast<std::size_t>(row) + 1];
  std::partial_sum(sum_offsets.begin(), sum_offsets.end(), sum_offsets.begin());
  std::vector<std::int64_t> at(sum_offsets.begin(), sum_offsets.end() - 1);
  for (std::int64_t k = 0; k < n; ++k) sum_indices[static_cast<std::size_t>(at[static_cast<std::size_t>(row_of[static_cast<std::size_t>(k)])]++)] = k;
  std::vector<std::int64_t> gather_offsets(static_cast<std::size_t>(n) + 1);
  std::iota(gather_offsets.begin(), gather_offsets.end(), std::int64_t{0});
  const auto upload = [&](const std::vector<std::int64_t>& v) {
    Tensor t = Tensor::empty({std::max<std::int64_t>(std::ssize(v), 1)}, DType::i64, device_, &g.stream);
    const TensorView dst(t.data(), DType::i64, {std::ssize(v)}, device_);
    copy_async(dst, TensorView(const_cast<std::int64_t*>(v.data()), DType::i64, {std::ssize(v)}, Device::cpu()), g.stream);
    return Tensor::adopt(dst, [keep = t.storage()] {});
  };
  g.sum_indices = upload(sum_indices);
  g.sum_offsets = upload(sum_offsets);
  g.gather_indices = upload(row_of);
  g.gather_offsets = upload(gather_offsets);
  g.partials = TableLayout({n}, device_);
  g.pooled = TableLayout({pooled_rows}, device_);
  g.stream.synchronize();  // the host vectors go now
  g.batch = batch;
  return g;
}

}  // namespace fk::dist
