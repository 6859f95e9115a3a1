// Dispatch of the recsys family: argument checks, then the CPU spec or the CUDA kernels.
#include <fmt/format.h>

#include <algorithm>
#include <vector>

#include "fusekit/core/stream.hpp"
#include "fusekit/ops/gemm.hpp"
#include "fusekit/ops/recsys.hpp"
#include "ops/common/op_checks.hpp"
#if FUSEKIT_WITH_CUDA
#include "fusekit/core/cuda_check.hpp"
#include "recsys_cuda.hpp"
#endif

namespace fk {
namespace {

#if FUSEKIT_WITH_CUDA
// The GPU embedding kernels run one thread per output element (or 4 of them): at most 2^28.
constexpr std::int64_t kMaxPooledElements = std::int64_t{1} << 28;
#endif
constexpr std::size_t kWorkspaceAlign = 256;

[[maybe_unused]] std::size_t align_up(std::size_t n) { return (n + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign; }

// An f32 [B, T, D] view whose rows may be strided: strides (>= T * D, D, 1).
void check_pooled(const char* op, const char* arg, const TensorView& t, std::int64_t tables, std::int64_t dim,
                  Device device) {
  FK_CHECK_ARG(t.rank() == 3, op, arg, "a rank-3 tensor [B, T, D]", t.str());
  checks::dtype_in(op, arg, t, {DType::f32});
  FK_CHECK_ARG(t.size(1) == tables && t.size(2) == dim, op, arg, fmt::format("shape [B, {}, {}]", tables, dim),
               t.shape().str());
  const Dims& s = t.strides();
  FK_CHECK_ARG(s[2] == 1 && s[1] == dim && s[0] >= tables * dim, op, arg,
               fmt::format("strides (>= {}, {}, 1)", tables * dim, dim), s.str());
  FK_CHECK_ARG(t.data() != nullptr || t.numel() == 0, op, arg, "non-null data", "a null pointer");
  checks::same_device(op, arg, t, device);
}

void check_vector(const char* op, const char* arg, const TensorView& t, DType dtype, std::int64_t n, Device device) {
  checks::tensor(op, arg, t, 1);
  checks::dtype_in(op, arg, t, {dtype});
  checks::shape_is(op, arg, t, Dims{n});
  checks::same_device(op, arg, t, device);
}

void check_weights(const char* op, const TableLayout& layout, const TensorView& w) {
  checks::tensor(op, "weights", w, 2);
  checks::dtype_in(op, "weights", w, checks::kFloatTypes);
  FK_CHECK_ARG(w.size(0) == layout.total_rows() && w.size(1) >= 1, op, "weights",
               fmt::format("shape [{}, D] (the layout's rows), D >= 1", layout.total_rows()), w.shape().str());
  checks::cuda_available(op, w.device());
  FK_CHECK_ARG(layout.device() == w.device(), op, "layout", fmt::format("a layout made for {}", w.device().str()),
               layout.device().str());
}

#if FUSEKIT_WITH_CUDA
cuda::TableSet table_set(const TableLayout& layout, const TensorView& weights, float* state, bool rowwise) {
  const auto* meta = layout.device_meta().data_as<std::int64_t>();
  cuda::TableSet ts;
  ts.weights = weights.data();
  ts.dtype = weights.dtype();
  ts.adagrad_state = state;
  ts.base = meta;
  ts.rows = meta + layout.num_tables();
  if (layout.draws_elsewhere()) ts.draw_base = meta + 2 * layout.num_tables();
  ts.tables = layout.num_tables();
  ts.dim = static_cast<int>(weights.size(1));
  ts.rowwise = rowwise;
  return ts;
}
#endif

}  // namespace

// ---- TableLayout ----------------------------------------------------------------------------------

TableLayout::TableLayout(std::vector<std::int64_t> rows, Device device, std::vector<std::int64_t> draw_bases)
    : rows_(std::move(rows)), draw_base_(std::move(draw_bases)), device_(device) {
  constexpr const char* op = "TableLayout";
  FK_CHECK_ARG(!rows_.empty(), op, "rows", "at least one table", "none");
  for (std::size_t t = 0; t < rows_.size(); ++t) {
    FK_CHECK_ARG(rows_[t] >= 1, op, "rows", "tables of at least one row", fmt::format("{} rows in table {}", rows_[t], t));
    base_.push_back(total_rows_);
    FK_CHECK_ARG(rows_[t] < (std::int64_t{1} << 32) - total_rows_, op, "rows", "fewer than 2^32 rows in all",
                 fmt::format("more, at table {}", t));
    total_rows_ += rows_[t];
  }
  while ((std::int64_t{1} << key_bits_) < total_rows_) ++key_bits_;
  if (draw_base_.empty()) draw_base_ = base_;
  FK_CHECK_ARG(draw_base_.size() == rows_.size(), op, "draw_bases", fmt::format("none or one per table ({})", rows_.size()),
               fmt::format("{}", draw_base_.size()));
  for (std::size_t t = 0; t < rows_.size(); ++t)
    FK_CHECK_ARG(draw_base_[t] >= 0 && draw_base_[t] < (std::int64_t{1} << 56) - rows_[t], op, "draw_bases",
                 "rows >= 0 and, with the table's rows, below 2^56",
                 fmt::format("{} for table {} of {} rows", draw_base_[t], t, rows_[t]));
  checks::cuda_available(op, device);
  if (device.is_cpu()) return;
  const auto t = static_cast<std::int64_t>(rows_.size());
  Tensor host = Tensor::empty({3, t}, DType::i64, Device::cpu());
  std::copy(base_.begin(), base_.end(), host.data_as<std::int64_t>());
  std::copy(rows_.begin(), rows_.end(), host.data_as<std::int64_t>() + t);
  std::copy(draw_base_.begin(), draw_base_.end(), host.data_as<std::int64_t>() + 2 * t);
  meta_ = Tensor::empty({3, t}, DType::i64, device);
  copy(meta_, host);
}

void check_embedding_input(const TableLayout& layout, const TensorView& indices, const TensorView& offsets,
                           std::int64_t batch, const char* op) {
  const std::int64_t bags = layout.num_tables() * batch;
  checks::tensor(op, "offsets", offsets, 1);
  checks::dtype_in(op, "offsets", offsets, {DType::i64});
  checks::shape_is(op, "offsets", offsets, Dims{bags + 1});
  FK_CHECK_ARG(offsets.device().is_cpu(), op, "offsets", "a host tensor (to be checked)", offsets.device().str());
  checks::tensor(op, "indices", indices, 1);
  checks::dtype_in(op, "indices", indices, {DType::i64});
  FK_CHECK_ARG(indices.device().is_cpu(), op, "indices", "a host tensor (to be checked)", indices.device().str());
  const std::int64_t* off = offsets.data_as<std::int64_t>();
  const std::int64_t* idx = indices.data_as<std::int64_t>();
  const std::int64_t nnz = indices.numel();
  FK_CHECK_ARG(off[0] == 0 && off[bags] == nnz, op, "offsets", fmt::format("0 first and {} (nnz) last", nnz),
               fmt::format("{} first and {} last", off[0], off[bags]));
  for (std::int64_t q = 0; q < bags; ++q) {
    FK_CHECK_ARG(off[q] <= off[q + 1], op, "offsets", "non-decreasing offsets",
                 fmt::format("offsets[{}] = {} > offsets[{}] = {}", q, off[q], q + 1, off[q + 1]));
    const int t = static_cast<int>(q / batch);
    const std::int64_t rows = layout.rows(t);
    for (std::int64_t k = off[q]; k < off[q + 1]; ++k)
      FK_CHECK_ARG(idx[k] >= 0 && idx[k] < rows, op, "indices", fmt::format("rows of table {} in [0, {})", t, rows),
                   fmt::format("{} at position {}", idx[k], k));
  }
}

// ---- Embedding bags -------------------------------------------------------------------------------

void embedding_bag_forward(const TableLayout& layout, const EmbeddingBagForwardArgs& a, const EmbeddingBagParams& p,
                           const Stream* stream) {
  constexpr const char* op = "embedding_bag_forward";
  check_weights(op, layout, a.weights);
  const Device dev = a.weights.device();
  const std::int64_t nt = layout.num_tables(), dim = a.weights.size(1);
  check_pooled(op, "out", a.out, nt, dim, dev);
  const std::int64_t batch = a.out.size(0), bags = nt * batch;
  const bool csr = a.indices.has_value() || a.offsets.has_value();
  FK_CHECK_ARG(csr != a.raw.has_value(), op, "raw", "either raw values or CSR indices and offsets",
               csr ? "both" : "neither");
  FK_CHECK_ARG(!(p.per_table_launch && a.raw), op, "per_table_launch",
               "CSR input (the per-table baseline takes rows hashed beforehand)", "raw input");
  FK_CHECK_ARG(!p.per_table_launch || a.weights.dtype() == DType::f32, op, "per_table_launch",
               "f32 tables (the per-table baseline)", a.weights.str());
  std::int64_t nnz = bags;
  if (a.raw) {
    check_vector(op, "raw", *a.raw, DType::i32, bags, dev);
  } else {
    FK_CHECK_ARG(a.indices.has_value(), op, "indices", "CSR indices with the offsets", "none");
    FK_CHECK_ARG(a.offsets.has_value(), op, "offsets", "CSR offsets with the indices", "none");
    checks::tensor(op, "indices", *a.indices, 1);
    checks::dtype_in(op, "indices", *a.indices, {DType::i64});
    checks::same_device(op, "indices", *a.indices, dev);
    check_vector(op, "offsets", *a.offsets, DType::i64, bags + 1, dev);
    nnz = a.indices->numel();
    if (dev.is_cpu()) check_embedding_input(layout, *a.indices, *a.offsets, batch, op);
  }
  FK_CHECK_ARG(a.keys.has_value() == a.bags.has_value(), op, a.keys ? "bags" : "keys", "keys and bags together",
               "one of them");
  if (a.keys) {
    check_vector(op, "keys", *a.keys, DType::i32, nnz, dev);
    check_vector(op, "bags", *a.bags, DType::i32, nnz, dev);
  }
  FK_CHECK_ARG(nnz < (std::int64_t{1} << 31), op, "indices", "fewer than 2^31 entries", std::to_string(nnz));
  if (bags == 0) return;
  if (dev.is_cpu()) return reference::embedding_bag_forward(layout, a, p);
#if FUSEKIT_WITH_CUDA
  FK_CHECK_ARG(bags * dim <= kMaxPooledElements, op, "out", "at most 2^28 pooled elements (B * T * D) per call",
               a.out.shape().str());
  const detail::DeviceScope on(dev.index);
  const cuda::TableSet ts = table_set(layout, a.weights, nullptr, false);
  if (p.per_table_launch) {
    const cudaStream_t s = detail::cuda_stream(stream);
    const auto* indices = a.indices->data_as<std::int64_t>();
    const auto* offsets = a.offsets->data_as<std::int64_t>();
    for (int t = 0; t < layout.num_tables(); ++t)
      cuda::embedding_forward_table(a.weights.data_as<float>() + layout.base(t) * dim, static_cast<int>(dim), t,
                                    indices, offsets, batch, a.out.data_as<float>(), a.out.strides()[0],
                                    p.pooling == Pooling::mean, s);
    if (a.keys)
      cuda::embedding_keys(ts, indices, offsets, batch, static_cast<std::uint32_t*>(a.keys->data()),
                           static_cast<std::uint32_t*>(a.bags->data()), s);
    return;
  }
  cuda::embedding_forward_fused(
      ts, a.raw ? static_cast<const std::uint32_t*>(a.raw->data()) : nullptr, p.hash,
      a.indices ? a.indices->data_as<std::int64_t>() : nullptr, a.offsets ? a.offsets->data_as<std::int64_t>() : nullptr,
      batch, a.out.data_as<float>(), a.out.strides()[0], p.pooling == Pooling::mean,
      a.keys ? static_cast<std::uint32_t*>(a.keys->data()) : nullptr,
      a.bags ? static_cast<std::uint32_t*>(a.bags->data()) : nullptr, detail::cuda_stream(stream));
#else
  (void)stream;
#endif
}

std::size_t embedding_bag_backward_workspace_bytes(std::int64_t nnz, std::int64_t dim) {
  FK_CHECK_ARG(nnz >= 0 && nnz < (std::int64_t{1} << 31), "embedding_bag_backward_workspace_bytes", "nnz",
               "in [0, 2^31)", std::to_string(nnz));
  FK_CHECK_ARG(dim >= 1, "embedding_bag_backward_workspace_bytes", "dim", ">= 1", std::to_string(dim));
  if (nnz == 0) return 0;
#if FUSEKIT_WITH_CUDA
  const auto n = static_cast<std::size_t>(nnz);
  const auto chunks = static_cast<std::size_t>(cuda::sparse_backward_chunks(nnz));
  const auto d = static_cast<std::size_t>(dim);
  return kWorkspaceAlign + 2 * align_up(n * 4) + align_up(cuda::sparse_backward_sort_bytes(nnz)) +
         2 * align_up(chunks * d * 4) + align_up(chunks) + align_up((chunks + 1) * 4);
#else
  return 0;
#endif
}

void embedding_bag_backward_update(const TableLayout& layout, const EmbeddingBagBackwardArgs& a,
                                   const EmbeddingOptimizerParams& p, const Stream* stream) {
  constexpr const char* op = "embedding_bag_backward_update";
  check_weights(op, layout, a.weights);
  const Device dev = a.weights.device();
  const std::int64_t nt = layout.num_tables(), dim = a.weights.size(1);
  check_pooled(op, "dout", a.dout, nt, dim, dev);
  const std::int64_t batch = a.dout.size(0), bags = nt * batch;
  checks::tensor(op, "keys", a.keys, 1);
  checks::dtype_in(op, "keys", a.keys, {DType::i32});
  checks::same_device(op, "keys", a.keys, dev);
  const std::int64_t nnz = a.keys.numel();
  check_vector(op, "bags", a.bags, DType::i32, nnz, dev);
  const bool stores_gradient =
      p.update == EmbeddingUpdate::store_gradient || p.update == EmbeddingUpdate::dense_gradient;
  FK_CHECK_ARG(!stores_gradient || a.weights.dtype() == DType::f32, op, "weights",
               "an f32 gradient buffer (store_gradient, dense_gradient)", a.weights.str());
  const bool rounds = a.weights.dtype() != DType::f32;
  if (rounds && p.offset_counter.data() != nullptr) {
    checks::tensor(op, "offset_counter", p.offset_counter, 1);
    checks::dtype_in(op, "offset_counter", p.offset_counter, {DType::i64});
    checks::shape_is(op, "offset_counter", p.offset_counter, Dims{1});
    checks::same_device(op, "offset_counter", p.offset_counter, dev);
  }
  switch (p.update) {
    case EmbeddingUpdate::sgd:
    case EmbeddingUpdate::store_gradient:
    case EmbeddingUpdate::dense_gradient:
      FK_CHECK_ARG(!a.state.has_value(), op, "state", "none (SGD and the gradient stores keep no state)",
                   a.state->str());
      break;
    case EmbeddingUpdate::adagrad:
      FK_CHECK_ARG(a.state.has_value(), op, "state", fmt::format("f32 [{}, {}] (Adagrad)", layout.total_rows(), dim),
                   "none");
      checks::tensor(op, "state", *a.state, 2);
      checks::dtype_in(op, "state", *a.state, {DType::f32});
      checks::shape_is(op, "state", *a.state, a.weights.shape());
      checks::same_device(op, "state", *a.state, dev);
      break;
    case EmbeddingUpdate::rowwise_adagrad:
      FK_CHECK_ARG(a.state.has_value(), op, "state", fmt::format("f32 [{}] (row-wise Adagrad)", layout.total_rows()),
                   "none");
      check_vector(op, "state", *a.state, DType::f32, layout.total_rows(), dev);
      break;
  }
  const bool mean = p.pooling == Pooling::mean;
  if (mean) {
    FK_CHECK_ARG(a.offsets.has_value(), op, "offsets", "the forward's CSR offsets (mean pooling)", "none");
    check_vector(op, "offsets", *a.offsets, DType::i64, bags + 1, dev);
  }
  const bool dense = p.update == EmbeddingUpdate::dense_gradient;
  if (nnz == 0) {
    if (!dense) return;
    if (dev.is_cpu()) return fill(a.weights, 0.0);
#if FUSEKIT_WITH_CUDA
    const detail::DeviceScope on(dev.index);
    FK_CUDA_CHECK(cudaMemsetAsync(a.weights.data(), 0, a.weights.nbytes(), detail::cuda_stream(stream)));
#endif
    return;
  }
  if (dev.is_cpu()) {
    // The spec reads what the keys and bags name: check them (on a GPU they are the forward's own).
    const auto* k = a.keys.data_as<std::int32_t>();
    const auto* q = a.bags.data_as<std::int32_t>();
    for (std::int64_t e = 0; e < nnz; ++e) {
      FK_CHECK_ARG(static_cast<std::uint32_t>(k[e]) < static_cast<std::uint64_t>(layout.total_rows()), op, "keys",
                   fmt::format("global rows in [0, {})", layout.total_rows()),
                   fmt::format("{} at position {}", static_cast<std::uint32_t>(k[e]), e));
      FK_CHECK_ARG(static_cast<std::uint32_t>(q[e]) < static_cast<std::uint64_t>(bags), op, "bags",
                   fmt::format("bags in [0, {})", bags), fmt::format("{} at position {}", static_cast<std::uint32_t>(q[e]), e));
    }
    if (mean) {
      const std::int64_t* off = a.offsets->data_as<std::int64_t>();
      for (std::int64_t e = 0; e < nnz; ++e) {
        const std::int64_t bag = static_cast<std::uint32_t>(q[e]);
        FK_CHECK_ARG(off[bag + 1] > off[bag], op, "offsets", "a non-empty bag for every entry",
                     fmt::format("bag {} empty", bag));
      }
    }
    return reference::embedding_bag_backward_update(layout, a, p);
  }
#if FUSEKIT_WITH_CUDA
  const std::size_t need = embedding_bag_backward_workspace_bytes(nnz, dim);
  FK_CHECK_ARG(a.workspace.has_value(), op, "workspace", fmt::format("u8 [>= {}]", need), "none");
  checks::tensor(op, "workspace", *a.workspace, 1);
  checks::dtype_in(op, "workspace", *a.workspace, {DType::u8});
  checks::same_device(op, "workspace", *a.workspace, dev);
  FK_CHECK_ARG(a.workspace->nbytes() >= need, op, "workspace", fmt::format("u8 [>= {}]", need), a.workspace->str());
  // Carve the workspace: every piece 256-byte aligned.
  auto at = reinterpret_cast<std::uintptr_t>(a.workspace->data());
  at = (at + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign;
  const auto take = [&](std::size_t bytes) {
    void* ptr = reinterpret_cast<void*>(at);
    at += align_up(bytes);
    return ptr;
  };
  const auto n = static_cast<std::size_t>(nnz);
  const auto chunks = static_cast<std::size_t>(cuda::sparse_backward_chunks(nnz));
  cuda::SparseBackwardWorkspace ws;
  ws.key_sorted = static_cast<std::uint32_t*>(take(n * 4));
  ws.bag_sorted = static_cast<std::uint32_t*>(take(n * 4));
  ws.sort_temp_bytes = cuda::sparse_backward_sort_bytes(nnz);
  ws.sort_temp = take(ws.sort_temp_bytes);
  ws.head = static_cast<float*>(take(chunks * static_cast<std::size_t>(dim) * 4));
  ws.tail = static_cast<float*>(take(chunks * static_cast<std::size_t>(dim) * 4));
  ws.ends = static_cast<std::uint8_t*>(take(chunks));
  ws.owners = static_cast<int*>(take((chunks + 1) * 4));
  const detail::DeviceScope on(dev.index);
  const bool rowwise = p.update == EmbeddingUpdate::rowwise_adagrad;
  cuda::TableSet ts = table_set(layout, a.weights, a.state ? a.state->data_as<float>() : nullptr, rowwise);
  ts.store_gradient = stores_gradient;
  ts.seed = p.seed;
  ts.offset = p.offset;
  if (rounds && p.offset_counter.data() != nullptr)
    ts.offset_counter = p.offset_counter.data_as<const std::uint64_t>();
  if (dense) FK_CUDA_CHECK(cudaMemsetAsync(a.weights.data(), 0, a.weights.nbytes(), detail::cuda_stream(stream)));
  cuda::embedding_backward_fused(ts, layout.key_bits(), static_cast<const std::uint32_t*>(a.keys.data()),
                                 static_cast<const std::uint32_t*>(a.bags.data()), nnz, batch,
                                 a.dout.data_as<float>(), a.dout.strides()[0],
                                 mean ? a.offsets->data_as<std::int64_t>() : nullptr, p.lr, p.eps, ws,
                                 detail::cuda_stream(stream));
#else
  (void)stream;
#endif
}

// ---- Dense optimizer ------------------------------------------------------------------------------

void dense_optimizer_update(const DenseOptimizerArgs& a, const DenseOptimizerParams& p, const Stream* stream) {
  constexpr const char* op = "dense_optimizer_update";
  checks::tensor(op, "param", a.param, a.param.rank());
  checks::dtype_in(op, "param", a.param, {DType::f32});
  const Device dev = a.param.device();
  checks::cuda_available(op, dev);
  checks::companion(op, "grad", a.grad, a.param, a.param.shape());
  if (p.adagrad) {
    FK_CHECK_ARG(a.state.has_value(), op, "state", fmt::format("f32 {} (Adagrad)", a.param.shape().str()), "none");
    checks::companion(op, "state", *a.state, a.param, a.param.shape());
  } else {
    FK_CHECK_ARG(!a.state.has_value(), op, "state", "none (SGD keeps no state)", a.state->str());
  }
  if (a.param.numel() == 0) return;
  if (dev.is_cpu()) return reference::dense_optimizer_update(a, p);
#if FUSEKIT_WITH_CUDA
  const detail::DeviceScope on(dev.index);
  cuda::optimizer_update(a.param.data_as<float>(), a.grad.data_as<float>(),
                         p.adagrad ? a.state->data_as<float>() : nullptr, a.param.numel(), p.lr, p.eps,
                         detail::cuda_stream(stream));
#else
  (void)stream;
#endif
}

// ---- Interaction ----------------------------------------------------------------------------------

std::int64_t interaction_size(const InteractionParams& p, std::int64_t features, std::int64_t dim) {
  FK_CHECK_ARG(features >= 1 && features < (1 << 16) && dim >= 1, "interaction_size", "z",
               "F in [1, 65536) and D >= 1", fmt::format("F = {}, D = {}", features, dim));
  switch (p.kind) {
    case InteractionKind::dot:
      return dim + features * (features - 1) / 2 + (p.self_interaction ? features : 0);
    case InteractionKind::cat: return features * dim;
    case InteractionKind::outer: {
      const std::int64_t n = features * dim;
      FK_CHECK_ARG(n <= (std::int64_t{1} << 31), "interaction_size", "z", "F * D <= 2^31 (outer)", std::to_string(n));
      return n * n;
    }
  }
  throw_internal("interaction_size: unknown kind");
}

DotPairs::DotPairs(std::int64_t features, bool self_interaction, Device device)
    : features_(features), self_(self_interaction) {
  FK_CHECK_ARG(features >= 1 && features < (1 << 16), "DotPairs", "features", "in [1, 65536)",
               std::to_string(features));
  checks::cuda_available("DotPairs", device);
  for (std::uint32_t i = 0; i < static_cast<std::uint32_t>(features); ++i)
    for (std::uint32_t j = 0; j < i + (self_interaction ? 1u : 0u); ++j) host_.push_back(i << 16 | j);
  if (device.is_cpu() || host_.empty()) return;
  const auto p = static_cast<std::int64_t>(host_.size());
  device_ = Tensor::empty({p}, DType::i32, device);
  copy(device_, TensorView(host_.data(), DType::i32, {p}, Device::cpu()));
}

namespace {

// z [B, F, D] f32 contiguous; r [B, L] f32 contiguous with L >= I (outer: L == I).
void check_interaction(const char* op, const TensorView& z, const char* r_arg, const TensorView& r,
                       const DotPairs* pairs, const InteractionParams& p) {
  checks::tensor(op, "z", z, 3);
  checks::dtype_in(op, "z", z, {DType::f32});
  const Device dev = z.device();
  checks::cuda_available(op, dev);
  const std::int64_t batch = z.size(0), nf = z.size(1), dim = z.size(2);
  FK_CHECK_ARG(nf >= 1 && nf < (1 << 16) && dim >= 1, op, "z", "shape [B, F, D], F in [1, 65536), D >= 1",
               z.shape().str());
  const std::int64_t size = interaction_size(p, nf, dim);
  checks::tensor(op, r_arg, r, 2);
  checks::dtype_in(op, r_arg, r, {DType::f32});
  checks::same_device(op, r_arg, r, dev);
  if (p.kind == InteractionKind::outer)
    FK_CHECK_ARG(r.size(0) == batch && r.size(1) == size, op, r_arg, fmt::format("shape [{}, {}]", batch, size),
                 r.shape().str());
  else
    FK_CHECK_ARG(r.size(0) == batch && r.size(1) >= size, op, r_arg,
                 fmt::format("shape [{}, L] with L >= {} (the padding columns [I, L) are zero)", batch, size),
                 r.shape().str());
  if (p.kind != InteractionKind::dot) return;
  FK_CHECK_ARG(pairs != nullptr, op, "pairs", "the dot interaction's DotPairs", "none");
  FK_CHECK_ARG(pairs->features() == nf && pairs->self_interaction() == p.self_interaction, op, "pairs",
               fmt::format("pairs of {} features{}", nf, p.self_interaction ? " with self-interaction" : ""),
               fmt::format("pairs of {} features{}", pairs->features(), pairs->self_interaction() ? " with self" : ""));
  if (dev.is_cuda())
    FK_CHECK_ARG(pairs->host().empty() || pairs->device_pairs().device() == dev, op, "pairs",
                 fmt::format("pairs made for {}", dev.str()),
                 pairs->device_pairs().data() ? pairs->device_pairs().device().str() : std::string("cpu"));
}

// Whether the dot interaction runs unfused (batched GEMM + gather / scatter): on a GPU only.
bool uses_bmm(const TensorView& z, const InteractionParams& p) {
  return p.kind == InteractionKind::dot && p.impl == InteractionImpl::bmm && z.device().is_cuda();
}

// The unfused dot's scratch: f32 [B, F, F] contiguous on z's device; R's row stride and F * D are
// int in its gather, scatter and add kernels.
void check_bmm(const char* op, const TensorView& z, const std::optional<TensorView>& workspace, const TensorView& r) {
  const std::int64_t batch = z.size(0), nf = z.size(1);
  const Dims want{batch, nf, nf};
  FK_CHECK_ARG(workspace.has_value(), op, "workspace", fmt::format("f32 {} (dot with impl bmm)", want.str()), "none");
  checks::companion(op, "workspace", *workspace, z, want);
  const std::int64_t fd = z.size(1) * z.size(2);
  FK_CHECK_ARG(r.size(1) < (std::int64_t{1} << 31) && fd < (std::int64_t{1} << 31), op, "z",
               "F * D and R's row length below 2^31 (impl bmm)", fmt::format("{} and {}", fd, r.size(1)));
}

// The dot kernels stage a sample's Z (and S) in shared memory: 8 samples a block, 48 KB at most.
constexpr std::int64_t kDotSmemFloats = 48 * 1024 / 4 / 8;
std::int64_t dot_forward_floats(std::int64_t nf, std::int64_t dim) { return nf * (dim % 4 == 0 ? dim + 4 : dim + 1); }
bool dot_backward_in_registers(std::int64_t nf, std::int64_t dim) {
  return nf <= 32 && (dim == 8 || dim == 16 || dim == 32);
}
std::int64_t dot_backward_floats(std::int64_t nf, std::int64_t dim) {
  return dot_backward_in_registers(nf, dim) ? nf * ((nf + 3) / 4 * 4) : nf * dim + nf * nf;
}

[[maybe_unused]] void check_dot_smem(const char* op, std::int64_t floats_per_sample) {
  FK_CHECK_ARG(floats_per_sample <= kDotSmemFloats, op, "z",
               "F and D small enough for the GPU dot interaction (interaction_dot_fused_fits; impl bmm otherwise)",
               fmt::format("{} floats of shared memory per sample", floats_per_sample));
}

}  // namespace

bool interaction_dot_fused_fits(std::int64_t features, std::int64_t dim) noexcept {
  return dot_forward_floats(features, dim) <= kDotSmemFloats && dot_backward_floats(features, dim) <= kDotSmemFloats;
}

void interaction_forward(const InteractionForwardArgs& a, const InteractionParams& p, const Stream* stream) {
  constexpr const char* op = "interaction_forward";
  check_interaction(op, a.z, "r", a.r, a.pairs, p);
  const bool bmm = uses_bmm(a.z, p);
  if (bmm) check_bmm(op, a.z, a.workspace, a.r);
  if (a.z.numel() == 0) return;
  if (a.z.device().is_cpu()) return reference::interaction_forward(a, p);
#if FUSEKIT_WITH_CUDA
  const detail::DeviceScope on(a.z.device().index);
  const cudaStream_t s = detail::cuda_stream(stream);
  const std::int64_t batch = a.z.size(0), nf = a.z.size(1), dim = a.z.size(2), ldr = a.r.size(1);
  float* r = a.r.data_as<float>();
  switch (p.kind) {
    case InteractionKind::dot: {
      const auto& pairs = a.pairs->host();
      if (bmm) {
        matmul(a.z, a.z, *a.workspace, Trans::n, Trans::t, stream);  // ZZ[b] = Z[b] Z[b]ᵀ in fp32
        cuda::interaction_gather(a.z.data_as<float>(), a.workspace->data_as<float>(),
                                 static_cast<const std::uint32_t*>(a.pairs->device_pairs().data()),
                                 static_cast<int>(pairs.size()), static_cast<int>(nf), static_cast<int>(dim), batch, r,
                                 ldr, s);
        break;
      }
      check_dot_smem(op, dot_forward_floats(nf, dim));
      cuda::interaction_dot_forward(a.z.data_as<float>(), static_cast<const std::uint32_t*>(a.pairs->device_pairs().data()),
                                    static_cast<int>(pairs.size()), static_cast<int>(nf), static_cast<int>(dim), batch,
                                    r, ldr, s);
      break;
    }
    case InteractionKind::cat:
      cuda::interaction_cat_forward(a.z.data_as<float>(), nf * dim, batch, r, ldr, s);
      break;
    case InteractionKind::outer: cuda::interaction_outer_forward(a.z.data_as<float>(), nf * dim, batch, r, s); break;
  }
#else
  (void)stream;
#endif
}

void interaction_backward(const InteractionBackwardArgs& a, const InteractionParams& p, const Stream* stream) {
  constexpr const char* op = "interaction_backward";
  check_interaction(op, a.z, "dr", a.dr, a.pairs, p);
  checks::companion(op, "dz", a.dz, a.z, a.z.shape());
  FK_CHECK_ARG(!a.relu_x || p.kind == InteractionKind::dot, op, "relu_x", "false (the mask is fused into dot only)",
               "true");
  FK_CHECK_ARG(!a.relu_x || p.kind != InteractionKind::dot || p.impl == InteractionImpl::fused, op, "relu_x",
               "false with impl bmm (the unfused path runs the ReLU's backward on its own)", "true");
  const bool bmm = uses_bmm(a.z, p);
  if (bmm) check_bmm(op, a.z, a.workspace, a.dr);
  if (a.z.numel() == 0) return;
  if (a.z.device().is_cpu()) return reference::interaction_backward(a, p);
#if FUSEKIT_WITH_CUDA
  const detail::DeviceScope on(a.z.device().index);
  const cudaStream_t s = detail::cuda_stream(stream);
  const std::int64_t batch = a.z.size(0), nf = a.z.size(1), dim = a.z.size(2), ldr = a.dr.size(1);
  switch (p.kind) {
    case InteractionKind::dot: {
      if (bmm) {
        const auto& pairs = a.pairs->host();
        cuda::interaction_scatter(a.dr.data_as<float>(), ldr,
                                  static_cast<const std::uint32_t*>(a.pairs->device_pairs().data()),
                                  static_cast<int>(pairs.size()), static_cast<int>(nf), static_cast<int>(dim), batch,
                                  a.workspace->data_as<float>(), s);
        matmul(*a.workspace, a.z, a.dz, Trans::n, Trans::n, stream);  // dZ[b] = S[b] Z[b] in fp32
        cuda::add_dense_grad(a.dr.data_as<float>(), static_cast<int>(ldr), static_cast<int>(dim),
                             static_cast<int>(nf * dim), batch, a.dz.data_as<float>(), s);
        break;
      }
      check_dot_smem(op, dot_backward_floats(nf, dim));
      const auto& pairs = a.pairs->host();
      cuda::interaction_dot_backward(a.z.data_as<float>(), a.dr.data_as<float>(), ldr,
                                     static_cast<const std::uint32_t*>(a.pairs->device_pairs().data()),
                                     static_cast<int>(pairs.size()), static_cast<int>(nf), static_cast<int>(dim), batch,
                                     a.dz.data_as<float>(), a.relu_x, s);
      break;
    }
    case InteractionKind::cat:
      cuda::interaction_cat_backward(a.dr.data_as<float>(), ldr, nf * dim, batch, a.dz.data_as<float>(), s);
      break;
    case InteractionKind::outer:
      cuda::interaction_outer_backward(a.z.data_as<float>(), a.dr.data_as<float>(), nf * dim, batch,
                                       a.dz.data_as<float>(), s);
      break;
  }
#else
  (void)stream;
#endif
}

// ---- Bag permutation ------------------------------------------------------------------------------

std::size_t permute_bags_workspace_bytes(std::int64_t n) {
  FK_CHECK_ARG(n >= 0, "permute_bags_workspace_bytes", "n", ">= 0", std::to_string(n));
#if FUSEKIT_WITH_CUDA
  const auto bags = static_cast<std::size_t>(n);
  return kWorkspaceAlign + 2 * align_up(bags * 8) + align_up(cuda::permute_bags_scan_bytes(n));
#else
  return 0;
#endif
}

void permute_bags(const PermuteBagsArgs& a, const Stream* stream) {
  constexpr const char* op = "permute_bags";
  checks::tensor(op, "lengths", a.lengths, 1);
  checks::dtype_in(op, "lengths", a.lengths, {DType::i64});
  const Device dev = a.lengths.device();
  checks::cuda_available(op, dev);
  const std::int64_t n = a.lengths.numel();
  checks::tensor(op, "indices", a.indices, 1);
  checks::dtype_in(op, "indices", a.indices, {DType::i64});
  checks::same_device(op, "indices", a.indices, dev);
  const std::int64_t nnz = a.indices.numel();
  check_vector(op, "permutation", a.permutation, DType::i64, n, dev);
  check_vector(op, "out_offsets", a.out_offsets, DType::i64, n + 1, dev);
  check_vector(op, "out_indices", a.out_indices, DType::i64, nnz, dev);
  checks::outputs_disjoint(op, {{"out_offsets", &a.out_offsets}, {"out_indices", &a.out_indices}},
                           {{"lengths", &a.lengths}, {"indices", &a.indices}, {"permutation", &a.permutation}});
  checks::check_stream(op, stream, dev);
  if (dev.is_cpu()) {
    const auto* len = a.lengths.data_as<const std::int64_t>();
    const auto* perm = a.permutation.data_as<const std::int64_t>();
    std::int64_t total = 0;
    for (std::int64_t q = 0; q < n; ++q) {
      FK_CHECK_ARG(len[q] >= 0 && len[q] <= nnz - total, op, "lengths",
                   fmt::format("sizes >= 0 summing to {} (the entries of indices)", nnz),
                   fmt::format("{} at bag {} after {} entries", len[q], q, total));
      total += len[q];
    }
    FK_CHECK_ARG(total == nnz, op, "lengths", fmt::format("sizes summing to {} (the entries of indices)", nnz),
                 fmt::format("a sum of {}", total));
    std::vector<bool> seen(static_cast<std::size_t>(n), false);
    for (std::int64_t k = 0; k < n; ++k) {
      FK_CHECK_ARG(perm[k] >= 0 && perm[k] < n && !seen[static_cast<std::size_t>(perm[k])], op, "permutation",
                   fmt::format("a permutation of [0, {})", n), fmt::format("{} at position {}", perm[k], k));
      seen[static_cast<std::size_t>(perm[k])] = true;
    }
    return reference::permute_bags(a);
  }
#if FUSEKIT_WITH_CUDA
  const std::size_t need = permute_bags_workspace_bytes(n);
  FK_CHECK_ARG(a.workspace.has_value(), op, "workspace", fmt::format("u8 [>= {}]", need), "none");
  checks::tensor(op, "workspace", *a.workspace, 1);
  checks::dtype_in(op, "workspace", *a.workspace, {DType::u8});
  checks::same_device(op, "workspace", *a.workspace, dev);
  FK_CHECK_ARG(a.workspace->nbytes() >= need, op, "workspace", fmt::format("u8 [>= {}]", need), a.workspace->str());
  const detail::DeviceScope on(dev.index);
  // Carve the workspace: every piece 256-byte aligned.
  auto at = (reinterpret_cast<std::uintptr_t>(a.workspace->data()) + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign;
  auto take = [&](std::size_t bytes) {
    void* p = reinterpret_cast<void*>(at);
    at += align_up(bytes);
    return p;
  };
  cuda::PermuteBagsWorkspace ws;
  ws.in_start = static_cast<std::int64_t*>(take(static_cast<std::size_t>(n) * 8));
  ws.out_lengths = static_cast<std::int64_t*>(take(static_cast<std::size_t>(n) * 8));
  ws.scan_bytes = cuda::permute_bags_scan_bytes(n);
  ws.scan_temp = take(ws.scan_bytes);
  cuda::permute_bags(a.lengths.data_as<std::int64_t>(), a.indices.data_as<std::int64_t>(),
                     a.permutation.data_as<std::int64_t>(), n, a.out_offsets.data_as<std::int64_t>(),
                     a.out_indices.data_as<std::int64_t>(), ws, detail::cuda_stream(stream));
#else
  (void)stream;
#endif
}

// ---- Loss -----------------------------------------------------------------------------------------

void sigmoid_bce_forward_backward(const SigmoidBceArgs& a, const Stream* stream) {
  sigmoid_bce_forward_backward(a, SigmoidBceParams{}, stream);
}

void sigmoid_bce_forward_backward(const SigmoidBceArgs& a, const SigmoidBceParams& p, const Stream* stream) {
  constexpr const char* op = "sigmoid_bce_forward_backward";
  checks::tensor(op, "logits", a.logits, 1);
  checks::dtype_in(op, "logits", a.logits, {DType::f32});
  const Device dev = a.logits.device();
  checks::cuda_available(op, dev);
  const std::int64_t batch = a.logits.numel();
  FK_CHECK_ARG(batch >= 1, op, "logits", "at least one logit", a.logits.str());
  check_vector(op, "labels", a.labels, DType::f32, batch, dev);
  check_vector(op, "dlogits", a.dlogits, DType::f32, batch, dev);
  check_vector(op, "accumulator", a.accumulator, DType::u8, 8 * kSigmoidBceAccumulatorDoubles, dev);
  FK_CHECK_ARG(reinterpret_cast<std::uintptr_t>(a.accumulator.data()) % 8 == 0, op, "accumulator",
               "8-byte aligned data (it holds doubles)", "a misaligned pointer");
  if (p.unfused) {
    FK_CHECK_ARG(a.probabilities.has_value(), op, "probabilities", fmt::format("f32 [{}] (the unfused loss)", batch),
                 "none");
    check_vector(op, "probabilities", *a.probabilities, DType::f32, batch, dev);
  } else {
    FK_CHECK_ARG(!a.probabilities.has_value(), op, "probabilities", "none (the fused loss writes no probabilities)",
                 a.probabilities->str());
  }
  if (dev.is_cpu()) return reference::sigmoid_bce_forward_backward(a, p);
#if FUSEKIT_WITH_CUDA
  const detail::DeviceScope on(dev.index);
  if (p.unfused)
    return cuda::sigmoid_bce_reference(a.logits.data_as<float>(), a.labels.data_as<float>(), batch,
                                       a.probabilities->data_as<float>(), a.dlogits.data_as<float>(),
                                       a.accumulator.data_as<double>(), detail::cuda_stream(stream));
  cuda::sigmoid_bce_fused(a.logits.data_as<float>(), a.labels.data_as<float>(), batch, a.dlogits.data_as<float>(),
                          a.accumulator.data_as<double>(), detail::cuda_stream(stream));
#else
  (void)stream;
#endif
}

}  // namespace fk
