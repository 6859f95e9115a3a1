#include "fusekit/nn/recsys.hpp"

#include <fmt/format.h>

#include <cmath>
#include <cstring>

#include "fusekit/core/error.hpp"
#include "fusekit/core/stream.hpp"

namespace fk::nn {

namespace {

// The first n elements of a 1-D buffer.
TensorView head(const Tensor& t, std::int64_t n) { return TensorView(t.data(), t.dtype(), {n}, t.device()); }

}  // namespace

// ---- EmbeddingBagCollection ------------------------------------------------------------------

EmbeddingBagCollection::EmbeddingBagCollection(std::vector<std::int64_t> rows, std::int64_t dim,
                                               EmbeddingBagCollectionOptions options, Device device, RandomParams init,
                                               const std::vector<std::int64_t>& init_ids,
                                               std::vector<std::int64_t> draw_bases)
    : dim_(dim), options_(options) {
  constexpr const char* op = "nn::EmbeddingBagCollection";
  FK_CHECK_ARG(dim >= 1, op, "dim", ">= 1", fmt::format("{}", dim));
  FK_CHECK_ARG(init_ids.empty() || init_ids.size() == rows.size(), op, "init_ids",
               fmt::format("none or one per table ({})", rows.size()), fmt::format("{}", init_ids.size()));
  for (std::size_t t = 0; t < rows.size(); ++t)
    FK_CHECK_ARG(rows[t] >= 1, op, "rows", "tables of >= 1 row", fmt::format("table {} with {} rows", t, rows[t]));
  FK_CHECK_ARG(is_floating(options.dtype), op, "dtype", "f32, bf16 or f16", std::string(dtype_name(options.dtype)));
  FK_CHECK_ARG(options.dtype == DType::f32 || options.fused, op, "dtype",
               "f32 with fused = false (the unfused baseline's dense gradient and optimizer are f32)",
               std::string(dtype_name(options.dtype)));
  layout_ = TableLayout(std::move(rows), device, std::move(draw_bases));
  const DType dt = options.dtype;
  weights = Tensor::empty({std::max<std::int64_t>(layout_.total_rows(), 1), dim}, dt, device);
  if (dt != DType::f32) {
    step_ = Tensor::empty({1}, DType::i64, device);
    fill(step_, 0.0);
  }
  for (int t = 0; t < layout_.num_tables(); ++t) {
    const std::int64_t r = layout_.rows(t);
    auto* first =
        static_cast<char*>(weights.data()) + layout_.base(t) * dim * static_cast<std::int64_t>(dtype_size(dt));
    Tensor view = Tensor::adopt(TensorView(first, dt, {r, dim}, device), [keep = weights.storage()] {});
    const float bound = static_cast<float>(std::sqrt(1.0 / static_cast<double>(r)));
    const std::int64_t id = init_ids.empty() ? t : init_ids[static_cast<std::size_t>(t)];
    fill_uniform(view, -bound, bound, {init.seed, init.subsequence + static_cast<std::uint64_t>(id)});
    tables.push_back(std::move(view));
  }
}

std::int64_t EmbeddingBagCollection::nnz_of(const EmbeddingBagInput& in, std::int64_t batch) const {
  if (in.raw) return static_cast<std::int64_t>(num_tables()) * batch;
  FK_CHECK_ARG(in.indices.has_value() && in.offsets.has_value(), "nn::EmbeddingBagCollection::forward", "in",
               "CSR input (indices and offsets) or raw input", "neither");
  return in.indices->numel();
}

void EmbeddingBagCollection::reserve(std::int64_t nnz, const Stream* stream) {
  if (nnz <= capacity_) return;
  const Device dev = weights.device();
  keys_ = Tensor::empty({nnz}, DType::i32, dev, stream);
  bags_ = Tensor::empty({nnz}, DType::i32, dev, stream);
  if (dev.is_cuda()) {
    const std::size_t bytes = embedding_bag_backward_workspace_bytes(nnz, dim_);
    workspace_ = Tensor::empty({static_cast<std::int64_t>(std::max<std::size_t>(bytes, 1))}, DType::u8, dev, stream);
  }
  capacity_ = nnz;
}

void EmbeddingBagCollection::forward(const EmbeddingBagInput& in, std::int64_t batch, const TensorView& out,
                                     const Stream* stream) {
  const std::int64_t nnz = nnz_of(in, batch);
  reserve(nnz, stream);
  EmbeddingBagForwardArgs a;
  a.weights = weights.view();
  a.indices = in.indices;
  a.offsets = in.offsets;
  a.raw = in.raw;
  a.out = out;
  a.keys = head(keys_, nnz);
  a.bags = head(bags_, nnz);
  EmbeddingBagParams p;
  p.pooling = options_.pooling;
  p.hash = options_.hash;
  p.per_table_launch = !options_.fused;
  embedding_bag_forward(layout_, a, p, stream);
  batch_ = batch;
  nnz_ = nnz;
  offsets_ = in.raw ? std::nullopt : in.offsets;
}

void EmbeddingBagCollection::backward_update(const TensorView& target, const std::optional<TensorView>& state_view,
                                             EmbeddingUpdate update, float lr, float eps, const Stream* stream) {
  EmbeddingBagBackwardArgs a;
  a.keys = head(keys_, nnz_);
  a.bags = head(bags_, nnz_);
  a.dout = dout_;
  if (options_.pooling == Pooling::mean) a.offsets = offsets_;
  a.weights = target;
  a.state = state_view;
  if (workspace_.data()) a.workspace = workspace_.view();
  EmbeddingOptimizerParams p;
  p.update = update;
  p.lr = lr;
  p.eps = eps;
  p.pooling = options_.pooling;
  const bool rounds = target.data() == weights.data() && step_.data() != nullptr;
  if (rounds) {
    p.seed = options_.rounding_seed;
    p.offset_counter = step_.view();
  }
  embedding_bag_backward_update(layout_, a, p, stream);
  if (rounds) advance_offset(step_, 1, stream);
}

std::uint64_t EmbeddingBagCollection::rounding_step() const {
  if (!step_.data()) return 0;
  const Tensor h = step_.copy_to(Device::cpu());
  return *h.data_as<const std::uint64_t>();
}

void EmbeddingBagCollection::set_rounding_step(std::uint64_t step) {
  if (!step_.data()) return;
  Tensor h = Tensor::empty({1}, DType::i64, Device::cpu());
  *h.data_as<std::uint64_t>() = step;
  copy(step_, h);
}

void EmbeddingBagCollection::backward(const TensorView& dout, const Stream* stream) {
  dout_ = dout;
  if (options_.fused) return;  // step() reads dout
  if (!dense_grad_.data()) dense_grad_ = Tensor::empty(weights.shape(), DType::f32, weights.device(), stream);
  backward_update(dense_grad_, std::nullopt, EmbeddingUpdate::dense_gradient, 0.0f, 0.0f, stream);
}

void EmbeddingBagCollection::ensure_state(float initial_accumulator, const Stream* stream) {
  if (state.data()) return;
  state = options_.rowwise_adagrad ? Tensor::empty({weights.size(0)}, DType::f32, weights.device(), stream)
                                   : Tensor::empty(weights.shape(), DType::f32, weights.device(), stream);
  fill_uniform(state, initial_accumulator, initial_accumulator, {}, stream);  // [a, a] writes a exactly
}

void EmbeddingBagCollection::step(const OptimizerConfig& opt, const Stream* stream) {
  const bool adagrad = opt.kind == OptimizerKind::adagrad;
  if (adagrad) ensure_state(opt.initial_accumulator, stream);
  const bool rowwise = adagrad && options_.rowwise_adagrad;
  if (options_.fused || rowwise) {
    backward_update(weights, adagrad ? std::optional<TensorView>(state.view()) : std::nullopt,
                    rowwise    ? EmbeddingUpdate::rowwise_adagrad
                    : adagrad ? EmbeddingUpdate::adagrad
                              : EmbeddingUpdate::sgd,
                    opt.learning_rate, opt.eps, stream);
    return;
  }
  FK_CHECK_ARG(dense_grad_.data() != nullptr, "nn::EmbeddingBagCollection::step", "backward",
               "a backward() before step()", "none");
  for (int t = 0; t < num_tables(); ++t) {  // one dense pass per table
    const std::int64_t at = layout_.base(t) * dim_, n = layout_.rows(t) * dim_;
    auto flat = [&](const Tensor& buf) {
      return TensorView(buf.data_as<float>() + at, DType::f32, {n}, buf.device());
    };
    dense_optimizer_update({flat(weights), flat(dense_grad_), adagrad ? std::optional<TensorView>(flat(state)) : std::nullopt},
                           {adagrad, opt.learning_rate, opt.eps}, stream);
  }
}

Tensor EmbeddingBagCollection::gradient(const Stream* stream) {
  if (!options_.fused) {
    FK_CHECK_ARG(dense_grad_.data() != nullptr, "nn::EmbeddingBagCollection::gradient", "backward",
                 "a backward() first", "none");
    if (stream != nullptr) stream->synchronize();
    return dense_grad_.clone();
  }
  FK_CHECK_ARG(dout_.data() != nullptr || nnz_ == 0, "nn::EmbeddingBagCollection::gradient", "backward",
               "a backward() first", "none");
  Tensor g = Tensor::empty(weights.shape(), DType::f32, weights.device(), stream);
  backward_update(g, std::nullopt, EmbeddingUpdate::dense_gradient, 0.0f, 0.0f, stream);
  if (stream != nullptr) stream->synchronize();
  return g;
}

// ---- Interaction -----------------------------------------------------------------------------

Interaction::Interaction(std::int64_t features, std::int64_t dim, InteractionOptions options, Device device)
    : features_(features), dim_(dim), options_(options), device_(device) {
  constexpr const char* op = "nn::Interaction";
  FK_CHECK_ARG(features >= 1 && dim >= 1, op, "features/dim", ">= 1", fmt::format("{} x {}", features, dim));
  size_ = interaction_size({options.kind, options.self_interaction}, features, dim);
  if (options.kind == InteractionKind::dot) pairs_ = DotPairs(features, options.self_interaction, device);
}

void Interaction::reserve(std::int64_t batch, const Stream* stream) {
  if (batch <= capacity_) return;
  if (options_.kind == InteractionKind::dot && !options_.fused && device_.is_cuda())
    workspace_ = Tensor::empty({batch, features_, features_}, DType::f32, device_, stream);
  capacity_ = batch;
}

namespace {

InteractionParams interaction_params(const InteractionOptions& o) {
  InteractionParams p;
  p.kind = o.kind;
  p.self_interaction = o.self_interaction;
  p.impl = o.fused ? InteractionImpl::fused : InteractionImpl::bmm;
  return p;
}

}  // namespace

void Interaction::forward(const TensorView& z, const TensorView& r, const Stream* stream) {
  const std::int64_t b = z.rank() == 3 ? z.size(0) : 0;
  reserve(b, stream);
  InteractionForwardArgs a;
  a.z = z;
  a.r = r;
  a.pairs = &pairs_;
  if (workspace_.data()) a.workspace = TensorView(workspace_.data(), DType::f32, {b, features_, features_}, device_);
  interaction_forward(a, interaction_params(options_), stream);
}

void Interaction::backward(const TensorView& z, const TensorView& dr, const TensorView& dz, bool relu_x,
                           const Stream* stream) {
  const std::int64_t b = z.rank() == 3 ? z.size(0) : 0;
  reserve(b, stream);
  InteractionBackwardArgs a;
  a.z = z;
  a.dr = dr;
  a.dz = dz;
  a.pairs = &pairs_;
  a.relu_x = relu_x;
  if (workspace_.data()) a.workspace = TensorView(workspace_.data(), DType::f32, {b, features_, features_}, device_);
  interaction_backward(a, interaction_params(options_), stream);
}

// ---- BCEWithLogits ---------------------------------------------------------------------------

BCEWithLogits::BCEWithLogits(Device device, bool fused)
    : device_(device),
      fused_(fused),
      accumulator_(Tensor::empty({8 * kSigmoidBceAccumulatorDoubles}, DType::u8, device)) {
  fill(accumulator_, 0.0);
}

void BCEWithLogits::reserve(std::int64_t batch, const Stream* stream) {
  if (batch <= capacity_) return;
  if (!fused_) probabilities_ = Tensor::empty({batch}, DType::f32, device_, stream);
  capacity_ = batch;
}

void BCEWithLogits::forward_backward(const TensorView& logits, const TensorView& labels, const TensorView& dlogits,
                                     const Stream* stream) {
  const std::int64_t b = logits.numel();
  reserve(b, stream);
  SigmoidBceArgs a;
  a.logits = logits;
  a.labels = labels;
  a.dlogits = dlogits;
  a.accumulator = accumulator_.view();
  if (!fused_) a.probabilities = head(probabilities_, b);
  SigmoidBceParams p;
  p.unfused = !fused_;
  sigmoid_bce_forward_backward(a, p, stream);
}

double BCEWithLogits::drain(const Stream* stream) {
  double acc[2] = {0, 0};
  const TensorView sums(accumulator_.data(), DType::u8, {16}, device_);
  const TensorView host(acc, DType::u8, {16}, Device::cpu());
  if (stream != nullptr) {
    copy_async(host, sums, *stream);
    zero_async(sums, *stream);
    stream->synchronize();
  } else {
    copy(host, sums);
    fill(sums, 0.0);
  }
  return acc[1] > 0 ? acc[0] / acc[1] : 0.0;
}

// ---- CrossNet ----------------------------------------------------------------------------------

std::int64_t CrossNet::arena_floats(std::int64_t n, const CrossNetOptions& o) {
  return o.layers * (ParameterArena::floats_for({n, o.rank}) + ParameterArena::floats_for({o.rank, n}) +
                     ParameterArena::floats_for({n}));
}

CrossNet::CrossNet(std::int64_t n, CrossNetOptions options, RandomParams init, ParameterArena& arena)
    : n_(n), options_(options), device_(arena.device()) {
  constexpr const char* op = "nn::CrossNet";
  FK_CHECK_ARG(n >= 1, op, "n", ">= 1 features", fmt::format("{}", n));
  FK_CHECK_ARG(options.layers >= 1, op, "layers", ">= 1", fmt::format("{}", options.layers));
  FK_CHECK_ARG(options.rank >= 1, op, "rank", ">= 1", fmt::format("{}", options.rank));
  // torch.nn.init.xavier_normal_ on U [N, r] and V [r, N]: std = sqrt(2 / (fan_in + fan_out)).
  const auto std_dev = static_cast<float>(std::sqrt(2.0 / static_cast<double>(n + options.rank)));
  for (std::int64_t l = 0; l < options.layers; ++l) {
    Layer layer{&arena.add({n, options.rank}), &arena.add({options.rank, n}), &arena.add({n})};
    const auto sub = init.subsequence + 2 * static_cast<std::uint64_t>(l);
    fill_normal(layer.u->value, 0.0f, std_dev, {init.seed, sub});
    fill_normal(layer.v->value, 0.0f, std_dev, {init.seed, sub + 1});
    layers_.push_back(layer);  // the bias stays zero, as the arena made it
  }
}

void CrossNet::reserve(std::int64_t batch, const Stream* stream) {
  if (batch <= capacity_) return;
  const std::int64_t l = options_.layers;
  xs_ = Tensor::empty({std::max<std::int64_t>((l - 1) * batch * n_, 1)}, DType::f32, device_, stream);
  hs_ = Tensor::empty({l * batch * options_.rank}, DType::f32, device_, stream);
  if (device_.is_cuda())
    workspace_ = Tensor::empty({cross_layer_workspace_floats(batch, n_, options_.rank)}, DType::f32, device_, stream);
  capacity_ = batch;
}

// x_l: x0 for l = 0, out for l = L, the kept x_l between.
TensorView CrossNet::x_of(std::int64_t l, const TensorView& x0, const TensorView& out) const {
  if (l == 0) return x0;
  if (l == options_.layers) return out;
  return TensorView(xs_.data_as<float>() + (l - 1) * capacity_ * n_, DType::f32, {batch_, n_}, device_);
}

TensorView CrossNet::h_of(std::int64_t l) const {
  return TensorView(hs_.data_as<float>() + l * capacity_ * options_.rank, DType::f32, {batch_, options_.rank}, device_);
}

void CrossNet::forward(const TensorView& x0, const TensorView& out, const Stream* stream) {
  FK_CHECK_ARG(x0.rank() == 2, "nn::CrossNet::forward", "x0", fmt::format("[B, {}]", n_), x0.str());
  reserve(x0.size(0), stream);
  batch_ = x0.size(0);
  const CrossLayerParams p{options_.allow_tf32};
  for (std::int64_t l = 0; l < options_.layers; ++l) {
    const Layer& w = layers_[static_cast<std::size_t>(l)];
    cross_layer_forward({x0, x_of(l, x0, out), w.u->value, w.v->value, w.bias->value, h_of(l), x_of(l + 1, x0, out)}, p,
                        stream);
  }
}

void CrossNet::backward(const TensorView& x0, const TensorView& dout, const TensorView& dx0, const Stream* stream) {
  constexpr const char* op = "nn::CrossNet::backward";
  FK_CHECK_ARG(x0.rank() == 2 && x0.size(0) == batch_, op, "x0", fmt::format("the last forward's [{}, {}]", batch_, n_),
               x0.str());
  FK_CHECK_ARG(dx0.is_contiguous(), op, "dx0", "a contiguous tensor", dx0.str());
  if (stream != nullptr && device_.is_cuda())
    zero_async(dx0, *stream);
  else
    fill(dx0, 0.0);
  const CrossLayerParams p{options_.allow_tf32};
  const std::optional<TensorView> ws =
      workspace_.data() ? std::optional<TensorView>(TensorView(workspace_.data(), DType::f32,
                                                               {cross_layer_workspace_floats(batch_, n_, options_.rank)},
                                                               device_))
                        : std::nullopt;
  for (std::int64_t l = options_.layers - 1; l >= 0; --l) {
    const Layer& w = layers_[static_cast<std::size_t>(l)];
    cross_layer_backward({x0, x_of(l, x0, TensorView()), w.u->value, w.v->value, w.bias->value, h_of(l), dout, dx0,
                          w.u->grad, w.v->grad, w.bias->grad, l == 0, ws},
                         p, stream);
  }
}

}  // namespace fk::nn
