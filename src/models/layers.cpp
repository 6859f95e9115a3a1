#include "models/layers.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "fusekit/core/error.hpp"
#include "fusekit/core/random.hpp"
#include "fusekit/ops/gemm.hpp"

namespace fk::models::cpu {

namespace {

constexpr std::uint64_t kBiasStream = std::uint64_t{1} << 32;

Tensor host_f32(Dims shape) { return Tensor::empty(shape, DType::f32, Device::cpu()); }

TensorView host_view(const float* p, std::int64_t rows, std::int64_t cols) {
  return TensorView(const_cast<float*>(p), DType::f32, {rows, cols}, Device::cpu());
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Linear
// ---------------------------------------------------------------------------------------------

Linear::Linear(std::int64_t in, std::int64_t out, bool relu, std::uint64_t seed, std::uint64_t subsequence)
    : weight(host_f32({out, in})), bias(host_f32({out})), weight_grad(host_f32({out, in})),
      bias_grad(host_f32({out})), relu_(relu) {
  fill_normal(weight, 0.0f, static_cast<float>(std::sqrt(2.0 / static_cast<double>(in + out))), {seed, subsequence});
  fill_normal(bias, 0.0f, static_cast<float>(std::sqrt(1.0 / static_cast<double>(out))),
              {seed, subsequence + kBiasStream});
  fill(weight_grad, 0.0);
  fill(bias_grad, 0.0);
}

void Linear::forward(const float* x, std::int64_t batch, float* y) const {
  const std::int64_t n = out(), k = in();
  matmul(host_view(x, batch, k), weight, host_view(y, batch, n), Trans::n, Trans::t);
  const float* b = bias.data_as<float>();
  for (std::int64_t i = 0; i < batch; ++i) {
    float* row = y + i * n;
    for (std::int64_t j = 0; j < n; ++j) row[j] += b[j];
    if (relu_)
      for (std::int64_t j = 0; j < n; ++j) row[j] = std::max(row[j], 0.0f);
  }
}

void Linear::backward(const float* x, const float* y, float* dy, std::int64_t batch, float* dx) {
  const std::int64_t n = out(), k = in();
  if (relu_)
    for (std::int64_t i = 0; i < batch * n; ++i)
      if (!(y[i] > 0.0f)) dy[i] = 0.0f;
  matmul(host_view(dy, batch, n), host_view(x, batch, k), weight_grad, Trans::t, Trans::n);
  float* db = bias_grad.data_as<float>();
  std::fill(db, db + n, 0.0f);
  for (std::int64_t i = 0; i < batch; ++i)
    for (std::int64_t j = 0; j < n; ++j) db[j] += dy[i * n + j];
  if (dx) matmul(host_view(dy, batch, n), weight, host_view(dx, batch, k), Trans::n, Trans::n);
}

// ---------------------------------------------------------------------------------------------
// Mlp
// ---------------------------------------------------------------------------------------------

Mlp::Mlp(const std::vector<std::int64_t>& sizes, bool relu_last, std::uint64_t seed, std::uint64_t first_subsequence) {
  for (std::size_t l = 0; l + 1 < sizes.size(); ++l)
    layers.emplace_back(sizes[l], sizes[l + 1], relu_last || l + 2 < sizes.size(), seed, first_subsequence + l);
  acts_.resize(layers.size() + 1);
}

void Mlp::forward(const float* x, std::int64_t batch, float* y) {
  batch_ = batch;
  input_ = x;
  for (std::size_t l = 0; l < layers.size(); ++l) {
    acts_[l + 1].resize(static_cast<std::size_t>(batch * layers[l].out()));
    layers[l].forward(l == 0 ? x : acts_[l].data(), batch, acts_[l + 1].data());
  }
  std::copy(acts_.back().begin(), acts_.back().end(), y);
}

void Mlp::backward(const float* dy, float* dx) {
  grad_a_.assign(dy, dy + batch_ * layers.back().out());
  for (std::size_t l = layers.size(); l-- > 0;) {
    // The first layer writes its input gradient straight to dx (it can be hundreds of MB).
    float* out = nullptr;
    if (l > 0) {
      grad_b_.resize(static_cast<std::size_t>(batch_ * layers[l].in()));
      out = grad_b_.data();
    } else {
      out = dx;
    }
    layers[l].backward(l == 0 ? input_ : acts_[l].data(), acts_[l + 1].data(), grad_a_.data(), batch_, out);
    if (l > 0) std::swap(grad_a_, grad_b_);
  }
}

// ---------------------------------------------------------------------------------------------
// EmbeddingBagCollection
// ---------------------------------------------------------------------------------------------

EmbeddingBagCollection::EmbeddingBagCollection(const std::vector<std::int64_t>& rows, std::int64_t d,
                                               std::uint64_t seed, std::uint64_t first_subsequence)
    : dim(d), grads(rows.size()) {
  for (std::size_t t = 0; t < rows.size(); ++t) {
    tables.push_back(host_f32({rows[t], d}));
    const float bound = static_cast<float>(std::sqrt(1.0 / static_cast<double>(rows[t])));
    fill_uniform(tables.back(), -bound, bound, {seed, first_subsequence + t});
  }
}

void EmbeddingBagCollection::forward(const TensorView& indices, const TensorView& offsets, std::int64_t batch,
                                     float* out, std::int64_t out_stride) {
  const char* op = "models::Dlrm::forward";
  const std::int64_t nt = num_tables();
  FK_CHECK_ARG(offsets.dtype() == DType::i64 && offsets.rank() == 1 && offsets.numel() == nt * batch + 1 &&
                   offsets.is_contiguous() && offsets.device().is_cpu(),
               op, "offsets", fmt::format("host i64 [{}] (tables * batch + 1)", nt * batch + 1), offsets.str());
  FK_CHECK_ARG(indices.dtype() == DType::i64 && indices.rank() == 1 && indices.is_contiguous() &&
                   indices.device().is_cpu(),
               op, "indices", "host i64 [nnz]", indices.str());
  const std::int64_t* off = offsets.data_as<std::int64_t>();
  const std::int64_t* idx = indices.data_as<std::int64_t>();
  FK_CHECK_ARG(off[0] == 0 && off[nt * batch] == indices.numel(), op, "offsets",
               fmt::format("0 first and {} (nnz) last", indices.numel()),
               fmt::format("{} first and {} last", off[0], off[nt * batch]));
  for (std::int64_t k = 0; k < nt * batch; ++k)
    FK_CHECK_ARG(off[k] <= off[k + 1], op, "offsets", "non-decreasing offsets",
                 fmt::format("offsets[{}] = {} > offsets[{}] = {}", k, off[k], k + 1, off[k + 1]));
  batch_ = batch;
  indices_.assign(idx, idx + indices.numel());
  offsets_.assign(off, off + offsets.numel());
  for (std::int64_t t = 0; t < nt; ++t) {
    const std::int64_t rows = tables[t].size(0);
    const float* table = tables[t].data_as<float>();
    for (std::int64_t b = 0; b < batch; ++b) {
      float* dst = out + b * out_stride + t * dim;
      std::fill(dst, dst + dim, 0.0f);
      for (std::int64_t k = off[t * batch + b]; k < off[t * batch + b + 1]; ++k) {
        const std::int64_t r = idx[k];
        FK_CHECK_ARG(r >= 0 && r < rows, op, "indices", fmt::format("rows of table {} in [0, {})", t, rows),
                     fmt::format("{} at position {}", r, k));
        const float* src = table + r * dim;
        for (std::int64_t c = 0; c < dim; ++c) dst[c] += src[c];
      }
    }
  }
}

void EmbeddingBagCollection::backward(const float* dout, std::int64_t out_stride) {
  std::vector<std::pair<std::int64_t, std::int64_t>> hits;  // (row, bag)
  for (std::int64_t t = 0; t < num_tables(); ++t) {
    hits.clear();
    for (std::int64_t b = 0; b < batch_; ++b)
      for (std::int64_t k = offsets_[t * batch_ + b]; k < offsets_[t * batch_ + b + 1]; ++k)
        hits.emplace_back(indices_[k], b);
    std::sort(hits.begin(), hits.end());
    SparseGrad& g = grads[t];
    g.rows.clear();
    g.values.clear();
    for (std::size_t h = 0; h < hits.size(); ++h) {
      if (h == 0 || hits[h].first != hits[h - 1].first) {
        g.rows.push_back(hits[h].first);
        g.values.resize(g.values.size() + static_cast<std::size_t>(dim), 0.0f);
      }
      float* dst = g.values.data() + g.values.size() - dim;
      const float* src = dout + hits[h].second * out_stride + t * dim;
      for (std::int64_t c = 0; c < dim; ++c) dst[c] += src[c];
    }
  }
}

void EmbeddingBagCollection::step(const OptimizerConfig& opt) {
  if (opt.kind == OptimizerKind::adagrad && adagrad_state.empty())
    for (const Tensor& t : tables) {
      adagrad_state.push_back(host_f32(t.shape()));
      fill(adagrad_state.back(), opt.initial_accumulator);
    }
  for (std::int64_t t = 0; t < num_tables(); ++t) {
    const SparseGrad& g = grads[t];
    float* table = tables[t].data_as<float>();
    float* state = adagrad_state.empty() ? nullptr : adagrad_state[t].data_as<float>();
    for (std::size_t r = 0; r < g.rows.size(); ++r) {
      const std::int64_t at = g.rows[r] * dim;
      optimizer_update(opt, table + at, g.values.data() + r * dim, state ? state + at : nullptr, dim);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Interaction
// ---------------------------------------------------------------------------------------------

namespace {

InteractionKind interaction_kind(InteractionOp op) {
  switch (op) {
    case InteractionOp::dot: return InteractionKind::dot;
    case InteractionOp::cat: return InteractionKind::cat;
    case InteractionOp::outer: return InteractionKind::outer;
  }
  throw_internal("interaction_kind: unknown op");
}

TensorView host_view(const float* p, Dims shape) { return TensorView(const_cast<float*>(p), DType::f32, shape, Device::cpu()); }

}  // namespace

Interaction::Interaction(InteractionOp op, std::int64_t features, std::int64_t dim, bool itself)
    : params_{interaction_kind(op), itself}, f_(features), d_(dim), out_(interaction_size(params_, features, dim)) {
  if (op == InteractionOp::dot) pairs_ = DotPairs(features, itself);
}

void Interaction::forward(const float* z, std::int64_t batch, float* r) const {
  reference::interaction_forward({host_view(z, {batch, f_, d_}), host_view(r, {batch, out_}), &pairs_}, params_);
}

void Interaction::backward(const float* z, const float* dr, std::int64_t batch, float* dz) const {
  reference::interaction_backward(
      {host_view(z, {batch, f_, d_}), host_view(dr, {batch, out_}), host_view(dz, {batch, f_, d_}), &pairs_}, params_);
}

void optimizer_update(const OptimizerConfig& opt, float* param, const float* grad, float* state, std::int64_t n) {
  const float lr = opt.learning_rate;
  if (opt.kind == OptimizerKind::sgd) {
    for (std::int64_t i = 0; i < n; ++i) param[i] -= lr * grad[i];
    return;
  }
  for (std::int64_t i = 0; i < n; ++i) {
    state[i] += grad[i] * grad[i];
    param[i] -= lr * grad[i] / (std::sqrt(state[i]) + opt.eps);
  }
}

}  // namespace fk::models::cpu
