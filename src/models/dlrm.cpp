// DLRM on the CPU: the layers of models/layers.hpp wired as dlrm_s_pytorch.py wires them.
#include "fusekit/models/dlrm.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <istream>
#include <ostream>

#include "fusekit/core/error.hpp"
#include "fusekit/core/trace.hpp"
#include "fusekit/ops/recsys.hpp"
#include "models/layers.hpp"

#include "models/dlrm_gpu.hpp"

#if FUSEKIT_WITH_CUDA
#include <cuda_runtime.h>

#include "fusekit/core/cuda_check.hpp"
#endif

namespace fk::models {

InteractionOp parse_interaction_op(std::string_view name) {
  if (name == "dot") return InteractionOp::dot;
  if (name == "cat") return InteractionOp::cat;
  if (name == "outer") return InteractionOp::outer;
  throw Error("models::parse_interaction_op", "name", "dot | cat | outer", std::string(name));
}

std::string_view interaction_op_name(InteractionOp op) {
  switch (op) {
    case InteractionOp::dot: return "dot";
    case InteractionOp::cat: return "cat";
    case InteractionOp::outer: return "outer";
  }
  return "?";
}

OptimizerKind parse_optimizer(std::string_view name) {
  if (name == "sgd") return OptimizerKind::sgd;
  if (name == "adagrad") return OptimizerKind::adagrad;
  throw Error("models::parse_optimizer", "name", "sgd | adagrad", std::string(name));
}

std::string_view optimizer_name(OptimizerKind k) { return k == OptimizerKind::sgd ? "sgd" : "adagrad"; }

DlrmImpl parse_impl(std::string_view name) {
  if (name == "reference") return DlrmImpl::reference;
  if (name == "fused") return DlrmImpl::fused;
  throw Error("models::parse_impl", "name", "reference | fused", std::string(name));
}

std::string_view impl_name(DlrmImpl impl) { return impl == DlrmImpl::fused ? "fused" : "reference"; }

std::int64_t DlrmConfig::interaction_size() const {
  const std::int64_t f = num_features(), d = embedding_dim;
  switch (interaction) {
    case InteractionOp::dot: return d + f * (f - 1) / 2 + (interaction_itself ? f : 0);
    case InteractionOp::cat: return f * d;
    case InteractionOp::outer: return (f * d) * (f * d);
  }
  return 0;
}

void DlrmConfig::validate() const {
  const char* op = "models::DlrmConfig";
  auto sizes = [](const std::vector<std::int64_t>& v) { return fmt::format("{}", fmt::join(v, "-")); };
  FK_CHECK_ARG(embedding_dim >= 1, op, "embedding_dim", ">= 1", fmt::format("{}", embedding_dim));
  FK_CHECK_ARG(bottom_mlp.size() >= 2 && std::all_of(bottom_mlp.begin(), bottom_mlp.end(), [](auto s) { return s >= 1; }),
               op, "bottom_mlp", "at least an input and an output size, all >= 1", sizes(bottom_mlp));
  FK_CHECK_ARG(bottom_mlp.back() == embedding_dim, op, "bottom_mlp",
               fmt::format("a last size equal to the embedding dimension {}", embedding_dim), sizes(bottom_mlp));
  FK_CHECK_ARG(!top_mlp.empty() && top_mlp.back() == 1 &&
                   std::all_of(top_mlp.begin(), top_mlp.end(), [](auto s) { return s >= 1; }),
               op, "top_mlp", "sizes >= 1 ending in 1 (the logit)", sizes(top_mlp));
  for (std::size_t t = 0; t < table_rows.size(); ++t)
    FK_CHECK_ARG(table_rows[t] >= 1, op, "table_rows", "tables of >= 1 row",
                 fmt::format("table {} with {} rows", t, table_rows[t]));
}

std::int64_t DlrmConfig::parameter_count() const {
  std::int64_t n = 0;
  for (std::size_t l = 0; l + 1 < bottom_mlp.size(); ++l) n += (bottom_mlp[l] + 1) * bottom_mlp[l + 1];
  std::int64_t in = interaction_size();
  for (std::int64_t s : top_mlp) {
    n += (in + 1) * s;
    in = s;
  }
  for (std::int64_t r : table_rows) n += r * embedding_dim;
  return n;
}

namespace detail {

struct DlrmState {
  DlrmConfig config;
  cpu::Mlp bottom, top;
  cpu::EmbeddingBagCollection embeddings;
  cpu::Interaction interaction;
  std::vector<std::vector<float>> adagrad_state;  // per Linear: weight then bias, flattened
  std::int64_t batch = 0;
  TraceRecorder* trace = nullptr;
  // Activations of the last forward and their gradients (F = tables + 1, I = interaction size):
  std::vector<float> x, dx;         // bottom MLP output   [B, D]
  std::vector<float> z, dz;         // [x, e_1 .. e_T]     [B, F, D]
  std::vector<float> r, dr;         // interaction output  [B, I]
  std::vector<float> logits, dlogits;  // train_step's     [B]

  static std::vector<std::int64_t> top_sizes(const DlrmConfig& c) {
    std::vector<std::int64_t> s{c.interaction_size()};
    s.insert(s.end(), c.top_mlp.begin(), c.top_mlp.end());
    return s;
  }

  explicit DlrmState(DlrmConfig c)
      : config((c.validate(), std::move(c))),
        // Philox subsequences: bottom layers from 0, top layers from 1000, tables from 2^40.
        bottom(config.bottom_mlp, true, config.seed, 0),
        top(top_sizes(config), false, config.seed, 1000),
        embeddings(config.table_rows, config.embedding_dim, config.seed, std::uint64_t{1} << 40),
        interaction(config.interaction, config.num_features(), config.embedding_dim, config.interaction_itself) {}

  std::vector<cpu::Linear*> linears() {
    std::vector<cpu::Linear*> v;
    for (auto& l : bottom.layers) v.push_back(&l);
    for (auto& l : top.layers) v.push_back(&l);
    return v;
  }
};

}  // namespace detail

namespace {

void check_vector(const TensorView& t, std::int64_t n, const char* arg) {
  FK_CHECK_ARG(t.dtype() == DType::f32 && t.rank() == 1 && t.numel() == n && t.is_contiguous() &&
                   t.device().is_cpu() && (t.data() != nullptr || n == 0),
               "models::Dlrm", arg, fmt::format("host f32 [{}] with data", n), t.str());
}

}  // namespace

Dlrm::Dlrm(DlrmConfig config, Device device, DlrmImpl impl) : device_(device), impl_(impl) {
  config.validate();
  if (device.is_cuda()) {
#if FUSEKIT_WITH_CUDA
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
    FK_CHECK_ARG(device.index >= 0 && device.index < count, "models::Dlrm", "device", "a CUDA device that exists",
                 fmt::format("{} ({} CUDA devices usable)", device.str(), count));
    g_ = std::make_unique<gpu::GpuDlrm>(config, impl, device.index);
    config_ = std::move(config);
    return;
#else
    throw Error("models::Dlrm", "device", "cpu (fusekit was built without CUDA)", device.str());
#endif
  }
  FK_CHECK_ARG(device.is_cpu(), "models::Dlrm", "device", "cpu | cuda", device.str());
  FK_CHECK_ARG(impl == DlrmImpl::reference, "models::Dlrm", "impl",
               "reference on the CPU (the fused implementation is CUDA only)", std::string(impl_name(impl)));
  config_ = config;
  s_ = std::make_unique<detail::DlrmState>(std::move(config));
}

Dlrm::~Dlrm() = default;
Dlrm::Dlrm(Dlrm&&) noexcept = default;
Dlrm& Dlrm::operator=(Dlrm&&) noexcept = default;

const DlrmConfig& Dlrm::config() const noexcept { return config_; }
Device Dlrm::device() const noexcept { return device_; }
DlrmImpl Dlrm::impl() const noexcept { return impl_; }

void Dlrm::forward(const DlrmInput& input, const TensorView& logits) {
  if (g_) return g_->forward(input, logits);
  detail::DlrmState& s = *s_;
  const std::int64_t in = s.config.bottom_mlp.front(), d = s.config.embedding_dim, f = s.config.num_features();
  FK_CHECK_ARG(input.dense.dtype() == DType::f32 && input.dense.rank() == 2 && input.dense.size(1) == in &&
                   input.dense.is_contiguous() && input.dense.device().is_cpu(),
               "models::Dlrm::forward", "dense", fmt::format("host f32 [B, {}]", in), input.dense.str());
  const std::int64_t b = input.dense.size(0);
  check_vector(logits, b, "logits");
  s.batch = b;
  s.x.resize(static_cast<std::size_t>(b * d));
  s.z.resize(static_cast<std::size_t>(b * f * d));
  s.r.resize(static_cast<std::size_t>(b * s.interaction.output_size()));
  {
    const auto scope = trace_scope(s.trace, "bottom_mlp.fwd");
    s.bottom.forward(input.dense.data_as<float>(), b, s.x.data());
    for (std::int64_t i = 0; i < b; ++i) std::copy_n(s.x.data() + i * d, d, s.z.data() + i * f * d);
  }
  {
    const auto scope = trace_scope(s.trace, "embeddings.fwd");
    s.embeddings.forward(input.indices, input.offsets, b, s.z.data() + d, f * d);
  }
  {
    const auto scope = trace_scope(s.trace, "interaction.fwd");
    s.interaction.forward(s.z.data(), b, s.r.data());
  }
  const auto scope = trace_scope(s.trace, "top_mlp.fwd");
  s.top.forward(s.r.data(), b, logits.data_as<float>());
}

void Dlrm::backward(const TensorView& dlogits) {
  if (g_) return g_->backward(dlogits);
  detail::DlrmState& s = *s_;
  check_vector(dlogits, s.batch, "dlogits");
  const std::int64_t b = s.batch, d = s.config.embedding_dim, f = s.config.num_features();
  s.dr.resize(s.r.size());
  s.dz.resize(s.z.size());
  s.dx.resize(s.x.size());
  {
    const auto scope = trace_scope(s.trace, "top_mlp.bwd");
    s.top.backward(dlogits.data_as<float>(), s.dr.data());
  }
  {
    const auto scope = trace_scope(s.trace, "interaction.bwd");
    s.interaction.backward(s.z.data(), s.dr.data(), b, s.dz.data());
  }
  {
    const auto scope = trace_scope(s.trace, "embeddings.bwd");
    s.embeddings.backward(s.dz.data() + d, f * d);
  }
  const auto scope = trace_scope(s.trace, "bottom_mlp.bwd");
  for (std::int64_t i = 0; i < b; ++i) std::copy_n(s.dz.data() + i * f * d, d, s.dx.data() + i * d);
  s.bottom.backward(s.dx.data(), nullptr);
}

void Dlrm::step(const OptimizerConfig& opt) {
  if (g_) return g_->step(opt);
  detail::DlrmState& s = *s_;
  const std::vector<cpu::Linear*> layers = s.linears();
  if (opt.kind == OptimizerKind::adagrad && s.adagrad_state.empty())
    for (cpu::Linear* l : layers) {
      s.adagrad_state.emplace_back(static_cast<std::size_t>(l->weight.numel()), opt.initial_accumulator);
      s.adagrad_state.emplace_back(static_cast<std::size_t>(l->bias.numel()), opt.initial_accumulator);
    }
  {
    const auto scope = trace_scope(s.trace, "optimizer.mlp");
    for (std::size_t i = 0; i < layers.size(); ++i) {
      cpu::Linear& l = *layers[i];
      float* sw = s.adagrad_state.empty() ? nullptr : s.adagrad_state[2 * i].data();
      float* sb = s.adagrad_state.empty() ? nullptr : s.adagrad_state[2 * i + 1].data();
      cpu::optimizer_update(opt, l.weight.data_as<float>(), l.weight_grad.data_as<float>(), sw, l.weight.numel());
      cpu::optimizer_update(opt, l.bias.data_as<float>(), l.bias_grad.data_as<float>(), sb, l.bias.numel());
    }
  }
  const auto scope = trace_scope(s.trace, "optimizer.embeddings");
  s.embeddings.step(opt);
}

double Dlrm::train_step(const DlrmInput& input, const TensorView& labels, const OptimizerConfig& opt) {
  if (g_) {
    g_->enqueue_train_step(input, labels, opt);
    return g_->drain_loss();
  }
  detail::DlrmState& s = *s_;
  const std::int64_t b = input.dense.rank() == 2 ? input.dense.size(0) : 0;
  s.logits.resize(static_cast<std::size_t>(b));
  s.dlogits.resize(static_cast<std::size_t>(b));
  const TensorView logits(s.logits.data(), DType::f32, {b}, Device::cpu());
  const TensorView dlogits(s.dlogits.data(), DType::f32, {b}, Device::cpu());
  forward(input, logits);
  double loss = 0;
  {
    const auto scope = trace_scope(s.trace, "bce_loss");
    loss = bce_with_logits(logits, labels, &dlogits);
  }
  backward(dlogits);
  step(opt);
  return loss;
}

void Dlrm::predict(const DlrmInput& input, const TensorView& probabilities) {
  if (g_) return g_->predict(input, probabilities);
  forward(input, probabilities);
  float* p = probabilities.data_as<float>();
  for (std::int64_t i = 0; i < probabilities.numel(); ++i) p[i] = 1.0f / (1.0f + std::exp(-p[i]));
}

void Dlrm::set_trace(TraceRecorder* trace) noexcept {
  if (s_) s_->trace = trace;
  if (g_) g_->set_trace(trace);
}

void Dlrm::enqueue_train_step(const DlrmInput& input, const TensorView& labels, const OptimizerConfig& opt) {
  if (g_) return g_->enqueue_train_step(input, labels, opt);
  pending_loss_ += train_step(input, labels, opt);
  ++pending_steps_;
}

double Dlrm::drain_loss() {
  if (g_) return g_->drain_loss();
  const double mean = pending_steps_ > 0 ? pending_loss_ / static_cast<double>(pending_steps_) : 0.0;
  pending_loss_ = 0;
  pending_steps_ = 0;
  return mean;
}

std::size_t Dlrm::peak_device_bytes() const { return g_ ? g_->peak_device_bytes() : 0; }

std::vector<Dlrm::LinearParams> Dlrm::linear_layers() {
  if (g_) return g_->linear_layers();
  std::vector<LinearParams> v;
  for (cpu::Linear* l : s_->linears()) v.push_back({&l->weight, &l->bias, &l->weight_grad, &l->bias_grad});
  return v;
}

std::vector<Tensor*> Dlrm::tables() {
  if (g_) return g_->tables();
  std::vector<Tensor*> v;
  for (Tensor& t : s_->embeddings.tables) v.push_back(&t);
  return v;
}

const std::vector<SparseGrad>& Dlrm::table_grads() const {
  if (g_) {
    static const std::vector<SparseGrad> none;
    return none;
  } return s_->embeddings.grads; }

namespace {

constexpr char kStateMagic[8] = {'F', 'K', 'D', 'L', 'R', 'M', 'S', '1'};
constexpr std::int64_t kCopyChunk = std::int64_t{1} << 24;  // floats per host bounce (64 MB)

// Every float array of the CPU training state, in the stream's order: linear weights and biases,
// tables, then (when Adagrad has run) their optimizer states in the same order.
std::vector<detail::StateArray> state_arrays(detail::DlrmState& s, bool with_adagrad) {
  std::vector<detail::StateArray> v;
  for (cpu::Linear* l : s.linears()) {
    v.push_back({l->weight.data_as<float>(), l->weight.numel(), false});
    v.push_back({l->bias.data_as<float>(), l->bias.numel(), false});
  }
  for (Tensor& t : s.embeddings.tables) v.push_back({t.data_as<float>(), t.numel(), false});
  if (with_adagrad) {
    for (auto& a : s.adagrad_state) v.push_back({a.data(), static_cast<std::int64_t>(a.size()), false});
    for (Tensor& t : s.embeddings.adagrad_state) v.push_back({t.data_as<float>(), t.numel(), false});
  }
  return v;
}

void copy_floats(float* dst, const float* src, std::int64_t n, bool to_device) {
#if FUSEKIT_WITH_CUDA
  FK_CUDA_CHECK(cudaMemcpy(dst, src, static_cast<std::size_t>(n) * 4,
                           to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost));
#else
  (void)dst, (void)src, (void)n, (void)to_device;
  throw Error("models::Dlrm", "state", "host arrays (fusekit was built without CUDA)", "a device array");
#endif
}

}  // namespace

namespace detail {

void write_state(std::ostream& out, bool adagrad, const std::vector<StateArray>& arrays) {
  const std::uint8_t flag = adagrad ? 1 : 0;
  const std::uint64_t count = arrays.size();
  out.write(kStateMagic, 8);
  out.write(reinterpret_cast<const char*>(&flag), 1);
  out.write(reinterpret_cast<const char*>(&count), 8);
  std::vector<float> bounce;
  for (const StateArray& a : arrays) {
    const std::uint64_t len = static_cast<std::uint64_t>(a.size);
    out.write(reinterpret_cast<const char*>(&len), 8);
    for (std::int64_t at = 0; at < a.size; at += kCopyChunk) {
      const std::int64_t n = std::min(kCopyChunk, a.size - at);
      const float* src = a.data + at;
      if (a.on_device) {
        bounce.resize(static_cast<std::size_t>(n));
        copy_floats(bounce.data(), src, n, false);
        src = bounce.data();
      }
      out.write(reinterpret_cast<const char*>(src), static_cast<std::streamsize>(n * 4));
    }
  }
  if (!out) throw Error("models::Dlrm::save_state", "out", "a writable stream", "a failed write");
}

bool read_state_header(std::istream& in, std::uint64_t& count) {
  char magic[8] = {};
  std::uint8_t adagrad = 0;
  in.read(magic, 8);
  in.read(reinterpret_cast<char*>(&adagrad), 1);
  in.read(reinterpret_cast<char*>(&count), 8);
  FK_CHECK_ARG(in && std::equal(magic, magic + 8, kStateMagic), "models::Dlrm::load_state", "in",
               "a DLRM state (FKDLRMS1)", "something else");
  return adagrad != 0;
}

void read_state_arrays(std::istream& in, std::uint64_t count, const std::vector<StateArray>& arrays) {
  const char* op = "models::Dlrm::load_state";
  FK_CHECK_ARG(count == arrays.size(), op, "in", fmt::format("{} arrays (this configuration)", arrays.size()),
               fmt::format("{}", count));
  std::vector<float> bounce;
  for (std::size_t i = 0; i < arrays.size(); ++i) {
    std::uint64_t len = 0;
    in.read(reinterpret_cast<char*>(&len), 8);
    FK_CHECK_ARG(in && len == static_cast<std::uint64_t>(arrays[i].size), op, "in",
                 fmt::format("array {} of {} floats (this configuration)", i, arrays[i].size), fmt::format("{}", len));
    for (std::int64_t at = 0; at < arrays[i].size; at += kCopyChunk) {
      const std::int64_t n = std::min(kCopyChunk, arrays[i].size - at);
      float* dst = arrays[i].data + at;
      if (arrays[i].on_device) {
        bounce.resize(static_cast<std::size_t>(n));
        dst = bounce.data();
      }
      in.read(reinterpret_cast<char*>(dst), static_cast<std::streamsize>(n * 4));
      FK_CHECK_ARG(static_cast<bool>(in), op, "in", "a complete state", "a truncated stream");
      if (arrays[i].on_device) copy_floats(arrays[i].data + at, bounce.data(), n, true);
    }
  }
}

}  // namespace detail

void Dlrm::save_state(std::ostream& out) const {
  if (g_) return g_->save_state(out);
  detail::DlrmState& s = *s_;
  const bool adagrad = !s.adagrad_state.empty();
  detail::write_state(out, adagrad, state_arrays(s, adagrad));
}

void Dlrm::load_state(std::istream& in) {
  if (g_) return g_->load_state(in);
  detail::DlrmState& s = *s_;
  std::uint64_t count = 0;
  const bool adagrad = detail::read_state_header(in, count);
  s.adagrad_state.clear();
  s.embeddings.adagrad_state.clear();
  if (adagrad) {
    // Allocate the optimizer state the stream holds; its values are read below.
    for (cpu::Linear* l : s.linears()) {
      s.adagrad_state.emplace_back(static_cast<std::size_t>(l->weight.numel()), 0.0f);
      s.adagrad_state.emplace_back(static_cast<std::size_t>(l->bias.numel()), 0.0f);
    }
    for (const Tensor& t : s.embeddings.tables)
      s.embeddings.adagrad_state.push_back(Tensor::empty(t.shape(), DType::f32, Device::cpu()));
  }
  detail::read_state_arrays(in, count, state_arrays(s, adagrad));
}

double bce_with_logits(const TensorView& logits, const TensorView& labels, const TensorView* dlogits) {
  const std::int64_t n = logits.numel();
  check_vector(logits, n, "logits");
  check_vector(labels, n, "labels");
  if (dlogits) check_vector(*dlogits, n, "dlogits");
  if (n == 0) return 0.0;
  // The recsys family's spec; its accumulator holds the mean loss in [0].
  Tensor scratch = dlogits ? Tensor() : Tensor::empty({n}, DType::f32, Device::cpu());
  alignas(8) unsigned char acc[8 * kSigmoidBceAccumulatorDoubles] = {};
  reference::sigmoid_bce_forward_backward({logits.reshape({n}), labels.reshape({n}),
                                           dlogits ? dlogits->reshape({n}) : scratch.view(),
                                           TensorView(acc, DType::u8, {8 * kSigmoidBceAccumulatorDoubles}, Device::cpu())});
  double loss = 0;
  std::memcpy(&loss, acc, sizeof loss);
  return loss;
}

}  // namespace fk::models
