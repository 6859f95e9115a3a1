// DLRM: nn layers wired as dlrm_s_pytorch.py wires them, one code path for every device.
#include "fusekit/models/dlrm.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <istream>
#include <map>
#include <optional>
#include <ostream>
#include <set>
#include <tuple>

#include "fusekit/core/allocator.hpp"
#include "fusekit/core/error.hpp"
#include "fusekit/core/event.hpp"
#include "fusekit/core/stream.hpp"
#include "fusekit/core/trace.hpp"
#include "fusekit/nn/linear.hpp"
#include "fusekit/nn/recsys.hpp"
#include "fusekit/ops/pointwise.hpp"
#include "core/on_device.hpp"
#include "models/dlrm_state_io.hpp"

#if FUSEKIT_WITH_CUDA
#include "fusekit/core/cuda_check.hpp"
#endif

namespace fk::models {

using fk::detail::OnDevice;

InteractionOp parse_interaction_op(std::string_view name) {
  if (name == "dot") return InteractionOp::dot;
  if (name == "cat") return InteractionOp::cat;
  if (name == "outer") return InteractionOp::outer;
  if (name == "dcn") return InteractionOp::dcn;
  throw Error("models::parse_interaction_op", "name", "dot | cat | outer | dcn", std::string(name));
}

std::string_view interaction_op_name(InteractionOp op) {
  switch (op) {
    case InteractionOp::dot: return "dot";
    case InteractionOp::cat: return "cat";
    case InteractionOp::outer: return "outer";
    case InteractionOp::dcn: return "dcn";
  }
  return "?";
}

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
    case InteractionOp::cat:
    case InteractionOp::dcn: return f * d;
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
  if (interaction == InteractionOp::dcn) {
    FK_CHECK_ARG(dcn_num_layers >= 1, op, "dcn_num_layers", ">= 1 cross layers", fmt::format("{}", dcn_num_layers));
    FK_CHECK_ARG(dcn_low_rank_dim >= 1, op, "dcn_low_rank_dim", ">= 1", fmt::format("{}", dcn_low_rank_dim));
  }
  FK_CHECK_ARG(is_floating(embedding_dtype), op, "embedding_dtype", "f32, bf16 or f16",
               std::string(dtype_name(embedding_dtype)));
  const int bits = compress_activations_bits;
  FK_CHECK_ARG(bits == 0 || bits == 8 || bits == 4 || bits == 2, op, "compress_activations_bits", "0 (off), 8, 4 or 2",
               std::to_string(bits));
  FK_CHECK_ARG(bits == 0 || !fused_mlp, op, "compress_activations_bits",
               "0 with fused_mlp (the one-kernel MLP keeps its own bf16 activations)", std::to_string(bits));
}

std::int64_t DlrmConfig::parameter_count() const {
  std::int64_t n = 0;
  for (std::size_t l = 0; l + 1 < bottom_mlp.size(); ++l) n += (bottom_mlp[l] + 1) * bottom_mlp[l + 1];
  std::int64_t in = interaction_size();
  for (std::int64_t s : top_mlp) {
    n += (in + 1) * s;
    in = s;
  }
  if (interaction == InteractionOp::dcn) n += dcn_num_layers * (2 * dcn_low_rank_dim + 1) * interaction_size();
  for (std::int64_t r : table_rows) n += r * embedding_dim;
  return n;
}

namespace {
constexpr const char* kOp = "models::Dlrm";
}  // namespace

namespace detail {

namespace {

constexpr std::int64_t kGpuRowAlign = 4;  // floats: 16-byte rows for the TF32 GEMMs

std::int64_t round_up(std::int64_t n, std::int64_t to) { return (n + to - 1) / to * to; }

InteractionKind interaction_kind(InteractionOp op) {
  switch (op) {
    case InteractionOp::dot: return InteractionKind::dot;
    case InteractionOp::cat: return InteractionKind::cat;
    case InteractionOp::outer: return InteractionKind::outer;
    case InteractionOp::dcn: break;  // nn::CrossNet, not an Interaction
  }
  throw_internal("models::Dlrm: no Interaction for this interaction op");
}

RandomParams table_init(const DlrmConfig& c);
std::uint64_t table_rounding_seed(const DlrmConfig& c);

std::vector<std::int64_t> top_sizes(const DlrmConfig& c) {
  std::vector<std::int64_t> s{c.interaction_size()};
  s.insert(s.end(), c.top_mlp.begin(), c.top_mlp.end());
  return s;
}

bool kernel(const DlrmConfig& c, const std::vector<std::int64_t>& sizes);

// The top MLP's row padding: the outer interaction's R has exactly I columns (the op writes no
// padding there), so a top MLP behind one whose I is not a multiple of `pad` is not padded.
std::int64_t top_pad(const DlrmConfig& c, std::int64_t pad) {
  return c.interaction == InteractionOp::outer && c.interaction_size() % pad != 0 ? 1 : pad;
}

nn::CrossNetOptions cross_options(const DlrmConfig& c) {
  return {c.dcn_num_layers, c.dcn_low_rank_dim, c.allow_tf32};
}

std::int64_t arena_floats(const DlrmConfig& c, std::int64_t pad) {
  return nn::MLP::arena_floats(c.bottom_mlp, kernel(c, c.bottom_mlp) ? 1 : pad) +
         nn::MLP::arena_floats(top_sizes(c), kernel(c, top_sizes(c)) ? 1 : top_pad(c, pad)) +
         (c.interaction == InteractionOp::dcn ? nn::CrossNet::arena_floats(c.interaction_size(), cross_options(c)) : 0);
}

// Whether an MLP of these sizes runs as one fused_mlp kernel (DlrmConfig::fused_mlp).
bool kernel(const DlrmConfig& c, const std::vector<std::int64_t>& sizes) {
  return c.fused_mlp && nn::MLP::fits_fused_kernel(sizes);
}

// Philox subsequences: bottom layers from 0, top layers from 1000, cross layers from 2000, tables from 2^40; the MLPs'
// stochastic rounding (compress_activations_bits) from 2^62 (bottom) and 2^62 + 2^61 (top), to
// which nn::MLP adds layer * 2^40 + step.
constexpr std::uint64_t kTopStream = 1000, kCrossStream = 2000, kTableStream = std::uint64_t{1} << 40;
constexpr std::uint64_t kBottomRounding = std::uint64_t{1} << 62, kTopRounding = kBottomRounding + (std::uint64_t{1} << 61);

RandomParams table_init(const DlrmConfig& c) { return {c.seed, kTableStream}; }

// 16-bit tables' stochastic rounding: its own Philox key (the seed with these bits flipped), the
// update's number as the subsequence, so that its draws repeat none of the streams above.
std::uint64_t table_rounding_seed(const DlrmConfig& c) { return c.seed ^ 0x9e3779b97f4a7c15ull; }

// The MLPs' activation compression: group at most 256 (the quant family's default), bf16
// statistics (weight_grad_from_packed's register-sourced path on sm_90).
std::optional<PackParams> compression(const DlrmConfig& c, std::uint64_t stream) {
  if (c.compress_activations_bits == 0) return std::nullopt;
  return PackParams{.bits = c.compress_activations_bits, .group = 256, .rounding = Rounding::stochastic, .seed = c.seed,
                    .offset = stream};
}

}  // namespace

struct DlrmState {
  DlrmConfig config;
  DlrmImpl impl;
  Device dev;
  bool fused;
  std::optional<Stream> stream_, copy_stream_;  // GPU: compute and input-copy streams
  std::int64_t pad, features, dim, inter, ldr, ld_dense;
  nn::ParameterArena arena;
  nn::MLP bottom, top;
  std::optional<nn::EmbeddingBagCollection> embeddings;  // none with DlrmTables::external
  std::optional<nn::Interaction> interaction;  // dot, cat, outer
  std::optional<nn::CrossNet> cross;           // dcn
  nn::BCEWithLogits loss;

  // Batch buffers for the largest batch seen. GPU: the input is copied into one of two slots
  // (the copy of the next batch overlaps the step of this one).
  struct Slot {
    Tensor dense, raw, labels, indices, offsets;
    Event copied, free;
  };
  std::array<Slot, 2> slots;
  std::int64_t cap = 0, cap_nnz = 0;
  Tensor z, dz, r, dr, logits, dlogits, prob;

  // The batch of the last forward.
  std::int64_t batch = 0;
  int slot = 0;
  nn::EmbeddingBagInput bags;
  TensorView dense, labels;
  TensorView pooled;  // external tables: the batch's pooled bags [B, T, D] (host)
  std::int64_t steps = 0;
  std::map<std::tuple<int, std::int64_t, int, float, float>, Graph> graphs;
  std::set<std::int64_t> warm;  // batch sizes that ran one eager step

  // Phase timing for set_trace: mark(name) starts a phase (ending the previous one); flush_trace()
  // waits for the step and adds the phases to the trace (GPU: timed by events on the GPU track).
  TraceRecorder* trace = nullptr;
  std::vector<Event> events;
  std::vector<double> host_marks;
  std::vector<const char*> marks;
  double step_start_us = 0;

  DlrmState(const DlrmConfig& c, DlrmImpl im, Device d, DlrmTables tables)
      : config(c),
        impl(im),
        dev(d),
        fused(im == DlrmImpl::fused),
        stream_(d.is_cuda() ? std::optional<Stream>(Stream::create(d)) : std::nullopt),
        copy_stream_(d.is_cuda() ? std::optional<Stream>(Stream::create(d)) : std::nullopt),
        pad(d.is_cuda() ? kGpuRowAlign : 1),
        features(c.num_features()),
        dim(c.embedding_dim),
        inter(c.interaction_size()),
        ldr(round_up(inter, top_pad(c, pad))),
        ld_dense(round_up(c.bottom_mlp.front(), pad)),
        arena(arena_floats(c, pad), d),
        bottom(c.bottom_mlp,
               {Activation::relu, true, c.allow_tf32, fused, pad, kernel(c, c.bottom_mlp), compression(c, kBottomRounding)},
               {c.seed, 0}, arena),
        top(top_sizes(c),
            {Activation::relu, false, c.allow_tf32, fused, top_pad(c, pad), kernel(c, top_sizes(c)),
             compression(c, kTopRounding)},
            {c.seed, kTopStream}, arena),
        loss(d, fused) {
    if (tables == DlrmTables::local)
      embeddings.emplace(c.table_rows, c.embedding_dim,
                         nn::EmbeddingBagCollectionOptions{Pooling::sum, c.raw_hash, fused, c.rowwise_adagrad,
                                                           c.embedding_dtype, table_rounding_seed(c)},
                         d, table_init(c));
    if (c.interaction == InteractionOp::dcn)
      cross.emplace(c.interaction_size(), cross_options(c), RandomParams{c.seed, kCrossStream}, arena);
    else
      interaction.emplace(c.num_features(), c.embedding_dim,
                          nn::InteractionOptions{interaction_kind(c.interaction), c.interaction_itself, fused}, d);
    // The MLPs run one after the other on one stream: their compressed activations' scratch is one.
    if (c.compress_activations_bits != 0) bottom.share_scratch(top);
    if (d.is_cuda())
      for (Slot& sl : slots) {
        sl.copied = Event::create(d, false);
        sl.free = Event::create(d, false);
      }
  }

  const Stream* s() const { return stream_ ? &*stream_ : nullptr; }
  int num_tables() const { return static_cast<int>(config.table_rows.size()); }

  void mark(const char* name) {
    if (!trace) return;
    if (!stream_) {
      host_marks.push_back(trace->now_us());
      marks.push_back(name);
      return;
    }
    if (marks.empty()) {
      stream_->synchronize();
      step_start_us = trace->now_us();
    }
    if (events.size() <= marks.size()) events.push_back(Event::create(dev, true));
    events[marks.size()].record(*stream_);
    marks.push_back(name);
  }

  void flush_trace() {
    if (!trace || marks.empty()) return;
    mark(nullptr);
    if (!stream_) {
      for (std::size_t i = 0; i + 1 < marks.size(); ++i)
        trace->add(marks[i], "cpu", host_marks[i], host_marks[i + 1] - host_marks[i]);
      host_marks.clear();
      marks.clear();
      return;
    }
    events[marks.size() - 1].synchronize();
    for (std::size_t i = 0; i + 1 < marks.size(); ++i) {
      const double start = 1e3 * events[i].elapsed_ms_since(events[0]);
      const double end = 1e3 * events[i + 1].elapsed_ms_since(events[0]);
      trace->add_on_track(marks[i], "gpu", step_start_us + start, end - start, TraceRecorder::kGpuTrack);
    }
    marks.clear();
  }

  // ---- views of the batch buffers -------------------------------------------------------------
  // External tables: [B, T, D] between the caller's contiguous pooled bags and Z's (or dZ's)
  // table columns, on the model's device (GPU: queued on the compute stream).
  void copy_pooled(const TensorView& dst, const TensorView& src) const {
    const std::int64_t row = num_tables() * dim;
    auto rows = [&](const TensorView& v) {
      return TensorView(v.data(), DType::f32, {batch, row}, {v.strides()[0], 1}, dev);
    };
    if (stream_) copy_async(rows(dst), rows(src), *stream_);
    else copy(rows(dst), rows(src));
  }

  TensorView f32(const Tensor& t, Dims shape, Dims strides) const {
    return TensorView(t.data(), DType::f32, shape, strides, dev);
  }
  TensorView z_all(const Tensor& t) const { return f32(t, {batch, features, dim}, {features * dim, dim, 1}); }
  TensorView z_flat(const Tensor& t) const { return f32(t, {batch, features * dim}, {features * dim, 1}); }
  TensorView z_first(const Tensor& t) const { return f32(t, {batch, dim}, {features * dim, 1}); }
  TensorView z_tables(const Tensor& t) const {
    return TensorView(t.data_as<float>() + dim, DType::f32, {batch, num_tables(), dim}, {features * dim, dim, 1}, dev);
  }
  TensorView r_rows(const Tensor& t) const { return f32(t, {batch, inter}, {ldr, 1}); }
  // R as the interaction writes and reads it: [B, ldr], the padding columns [I, ldr) zero.
  TensorView r_full(const Tensor& t) const { return f32(t, {batch, ldr}, {ldr, 1}); }
  TensorView column(const Tensor& t) const { return f32(t, {batch, 1}, {1, 1}); }
  TensorView vec(const Tensor& t) const { return f32(t, {batch}, {1}); }

  // Buffers for batches up to b rows and nnz looked-up rows. Graphs captured with the old buffers
  // are dropped.
  void ensure_capacity(std::int64_t b, std::int64_t nnz) {
    if (b <= cap && nnz <= cap_nnz) return;
    if (stream_) {
      stream_->synchronize();
      copy_stream_->synchronize();
    }
    graphs.clear();
    warm.clear();
    cap = std::max(cap, b);
    cap_nnz = std::max({cap_nnz, nnz, cap * num_tables()});
    const Stream* st = s();
    auto buf = [&](std::int64_t n, DType dt = DType::f32) {
      return Tensor::empty({std::max<std::int64_t>(n, 1)}, dt, dev, st);
    };
    z = buf(cap * features * dim);
    dz = buf(cap * features * dim);
    r = buf(cap * ldr);
    dr = buf(cap * ldr);
    logits = buf(cap);
    dlogits = buf(cap);
    prob = buf(cap);
    if (stream_) {
      for (Slot& sl : slots) {
        sl.dense = buf(cap * ld_dense);
        // Zeroed on the copy stream, the one that writes the slot (its padding columns stay 0).
        zero_async(sl.dense, *copy_stream_);
        sl.raw = buf(cap * num_tables(), DType::i32);
        sl.labels = buf(cap);
        sl.indices = buf(cap_nnz, DType::i64);
        sl.offsets = buf(cap * num_tables() + 1, DType::i64);
      }
      copy_stream_->synchronize();
    }
    bottom.reserve(cap, st);
    top.reserve(cap, st);
    if (embeddings) embeddings->reserve(cap_nnz, st);
    if (interaction) interaction->reserve(cap, st);
    if (cross) {
      cross->reserve(cap, st);
      // The cross network writes and reads R's first I columns only: its padding stays zero.
      if (ldr != inter) {
        for (const Tensor* t : {&r, &dr}) {
          if (stream_) zero_async(*t, *stream_);
          else fill(*t, 0.0);
        }
      }
    }
    loss.reserve(cap, st);
  }

  // Checks the input and makes it the batch of the next forward. GPU: copies it into slot `si` on
  // the copy stream (after the slot's last step) and makes the compute stream wait for the copy;
  // returns once the copy is done (the caller's buffers are then free).
  void stage(int si, const DlrmInput& in, const TensorView* label) {
    const std::int64_t t = num_tables(), n_in = config.bottom_mlp.front();
    FK_CHECK_ARG(in.dense.dtype() == DType::f32 && in.dense.rank() == 2 && in.dense.size(1) == n_in &&
                     in.dense.is_contiguous() && in.dense.data() != nullptr,
                 kOp, "dense", fmt::format("f32 [B, {}], contiguous", n_in), in.dense.str());
    const std::int64_t b = in.dense.size(0);
    FK_CHECK_ARG(b >= 1, kOp, "dense", "a batch of at least one sample", in.dense.str());
    if (label)
      FK_CHECK_ARG(label->dtype() == DType::f32 && label->numel() == b && label->is_contiguous() &&
                       label->data() != nullptr,
                   kOp, "labels", fmt::format("f32 with {} elements", b), label->str());
    if (!stream_) {
      FK_CHECK_ARG(in.dense.device().is_cpu(), kOp, "dense", "a host tensor (the model is on the CPU)", in.dense.str());
      if (label) checks_host(*label, "labels");
    }
    const bool raw = fused && in.raw_sparse.data() != nullptr;
    std::int64_t nnz = t * b;
    FK_CHECK_ARG(embeddings.has_value() != (in.pooled.data() != nullptr), kOp, "pooled",
                 embeddings ? "none (the model holds its tables)" : "the pooled bags (the model's tables are external)",
                 in.pooled.str());
    if (!embeddings) {
      FK_CHECK_ARG(in.pooled.dtype() == DType::f32 && in.pooled.rank() == 3 && in.pooled.size(0) == b &&
                       in.pooled.size(1) == t && in.pooled.size(2) == dim && in.pooled.is_contiguous(),
                   kOp, "pooled", fmt::format("f32 [{}, {}, {}], contiguous", b, t, dim), in.pooled.str());
      FK_CHECK_ARG(in.pooled.device() == dev, kOp, "pooled", fmt::format("a tensor on {} (the model's device)", dev.str()),
                   in.pooled.str());
      nnz = 0;
    } else if (raw) {
      FK_CHECK_ARG(in.raw_sparse.dtype() == DType::i32 && in.raw_sparse.numel() == t * b && in.raw_sparse.is_contiguous(),
                   kOp, "raw_sparse", fmt::format("i32 [{}] (tables * batch)", t * b), in.raw_sparse.str());
      if (!stream_) checks_host(in.raw_sparse, "raw_sparse");
    } else {
      FK_CHECK_ARG(in.offsets.device().is_cpu() && in.indices.device().is_cpu(), kOp, "indices/offsets",
                   "host tensors (checked before they are used)", in.indices.str() + " " + in.offsets.str());
      check_embedding_input(embeddings->layout(), in.indices, in.offsets, b, kOp);
      nnz = in.indices.numel();
    }
    ensure_capacity(b, nnz);
    batch = b;
    slot = si;
    pooled = in.pooled;
    Slot* sl = stream_ ? &slots[static_cast<std::size_t>(si)] : nullptr;
    if (sl) sl->free.wait_on(*copy_stream_);
    // An input array as the step reads it: on the CPU the caller's; on a GPU its copy at the start
    // of the slot's buffer `buf`, on the copy stream. The same checks on both, so that the CPU
    // tests catch an array taken that the input does not have (a default TensorView is one
    // element of no memory).
    auto take = [&](Tensor Slot::*buf, const TensorView& src, const char* arg) {
      FK_CHECK_ARG((src.data() != nullptr || src.numel() == 0) && src.is_contiguous(), kOp, arg,
                   "a contiguous tensor with data",
                   src.str() + (src.data() ? "" : " with no data"));
      if (!sl) return src;
      const Tensor& to = sl->*buf;
      FK_CHECK_ARG(src.nbytes() <= to.nbytes(), kOp, arg,
                   fmt::format("at most {} bytes (the batch buffer's, for batches of {})", to.nbytes(), cap),
                   src.str());
      const TensorView dst(to.data(), src.dtype(), {src.numel()}, dev);
      copy_async(dst, src.reshape({src.numel()}), *copy_stream_);
      return dst;
    };
    if (sl) {
      dense = TensorView(sl->dense.data(), DType::f32, {b, n_in}, {ld_dense, 1}, dev);
      copy_async(dense, in.dense, *copy_stream_);
    } else {
      dense = in.dense;
    }
    labels = label ? take(&Slot::labels, *label, "labels") : TensorView();
    // The bags: none with external tables (the pooled rows come instead: copy_pooled), else the
    // raw ids or the CSR bags.
    if (!embeddings) bags = {};
    else if (raw) bags = {std::nullopt, std::nullopt, take(&Slot::raw, in.raw_sparse, "raw_sparse")};
    else bags = {take(&Slot::indices, in.indices, "indices"), take(&Slot::offsets, in.offsets, "offsets"), std::nullopt};
    if (!sl) return;  // the CPU reads the caller's tensors
    sl->copied.record(*copy_stream_);
    sl->copied.wait_on(*stream_);
    sl->copied.synchronize();
  }

  static void checks_host(const TensorView& t, const char* arg) {
    FK_CHECK_ARG(t.device().is_cpu(), kOp, arg, "a host tensor (the model is on the CPU)", t.str());
  }

  // ---- the step's phases ----------------------------------------------------------------------
  void forward_body() {
    const Stream* st = s();
    mark("bottom_mlp.fwd");
    bottom.forward(dense, z_first(z), st);
    mark("embeddings.fwd");
    if (embeddings) embeddings->forward(bags, batch, z_tables(z), st);
    else copy_pooled(z_tables(z), pooled);
    mark("interaction.fwd");
    if (cross)
      cross->forward(z_flat(z), r_rows(r), st);
    else
      interaction->forward(z_all(z), r_full(r), st);
    mark("top_mlp.fwd");
    top.forward(r_rows(r), column(logits), st);
  }

  void loss_body() {
    mark("bce_loss");
    loss.forward_backward(vec(logits), labels, vec(dlogits), s());
  }

  // unit_done: Dlrm::gradient_units()' order (top layers from the last, cross, bottom layers from the last).
  void backward_body(const std::function<void(std::size_t)>& unit_done = {}) {
    const Stream* st = s();
    const std::size_t top_n = top.layers.size(), bottom_first = top_n + (cross ? 1 : 0);
    const std::size_t bottom_n = bottom.layers.size();
    std::function<void(std::size_t)> top_done, bottom_done;
    if (unit_done) {
      top_done = [&](std::size_t l) { unit_done(top_n - 1 - l); };
      bottom_done = [&](std::size_t l) { unit_done(bottom_first + bottom_n - 1 - l); };
    }
    mark("top_mlp.bwd");
    top.backward(column(logits), column(dlogits), r_rows(dr), st, top_done);
    mark("interaction.bwd");
    // Fused dot: the bottom MLP's last ReLU derivative is applied here (again by its backward,
    // a no-op on an already masked gradient).
    if (cross)  // dr is overwritten: it carries the gradient down the cross layers
      cross->backward(z_flat(z), r_rows(dr), z_flat(dz), st);
    if (cross && unit_done) unit_done(top_n);
    if (!cross)
      interaction->backward(z_all(z), r_full(dr), z_all(dz), fused && config.interaction == InteractionOp::dot, st);
    mark("embeddings.bwd");
    if (embeddings) embeddings->backward(z_tables(dz), st);
    mark("bottom_mlp.bwd");
    bottom.backward(z_first(z), z_first(dz), std::nullopt, st, bottom_done);
  }

  void step_body(const OptimizerConfig& opt) {
    const Stream* st = s();
    mark("optimizer.embeddings");
    if (embeddings) embeddings->step(opt, st);
    mark("optimizer.mlp");
    arena.step(opt, fused, st);
  }

  void ensure_optimizer_state(const OptimizerConfig& opt) {
    if (opt.kind != OptimizerKind::adagrad) return;
    arena.ensure_state(opt.initial_accumulator, s());
    if (embeddings) embeddings->ensure_state(opt.initial_accumulator, s());
  }

  void finish_step() {
    if (stream_) slots[static_cast<std::size_t>(slot)].free.record(*stream_);
    ++steps;
    flush_trace();
  }

  void sync() const {
    if (stream_) stream_->synchronize();
  }

  std::vector<nn::Linear*> linears() {
    std::vector<nn::Linear*> v;
    for (auto& l : bottom.layers) v.push_back(&l);
    for (auto& l : top.layers) v.push_back(&l);
    return v;
  }

  // The rounding steps as the state's last array, when anything rounds stochastically (the MLPs'
  // compress_activations_bits, 16-bit tables): f32 [6], the bottom MLP's, the top MLP's and the
  // tables' step, each as two exact integers (its low 24 bits, the rest; exact below 2^48 steps).
  // A state of 4 (saved before the tables' step was kept) starts the tables' at 0.
  static constexpr std::int64_t kRoundingStepFloats = 6;
  bool rounds() const { return bottom.compressed() || (embeddings && embeddings->options().dtype != DType::f32); }
  void rounding_steps_to(const Tensor& host) const {
    float* v = host.data_as<float>();
    const std::uint64_t steps[3] = {bottom.rounding_step(), top.rounding_step(),
                                    embeddings ? embeddings->rounding_step() : 0};
    for (int i = 0; i < 3; ++i) step_to_floats(steps[i], v + 2 * i);
  }
  void rounding_steps_from(const std::vector<float>& v) {
    const auto step = [&](std::size_t i) {
      return 2 * i + 1 < v.size() ? step_from_floats(v.data() + 2 * i, "models::Dlrm::load_state") : std::uint64_t{0};
    };
    bottom.set_rounding_step(step(0));
    top.set_rounding_step(step(1));
    if (embeddings) embeddings->set_rounding_step(step(2));
  }

  // Every array of the training state in the stream's order: linear weights and biases, tables,
  // then (with Adagrad state) their optimizer states in the same order.
  std::vector<TensorView> state_arrays(bool with_adagrad) {
    std::vector<TensorView> v;
    for (nn::Linear* l : linears()) {
      v.push_back(l->weight);
      v.push_back(l->bias);
    }
    if (cross)
      for (const nn::CrossNet::Layer& l : cross->layers())
        for (const auto* p : {l.u, l.v, l.bias}) v.push_back(p->value);
    if (embeddings)
      for (const Tensor& t : embeddings->tables) v.push_back(t);
    if (with_adagrad) {
      for (std::size_t i = 0; i < arena.parameters().size(); ++i) v.push_back(*arena.state(i));
      for (int t = 0; embeddings && t < num_tables(); ++t) {
        const TensorView& tv = embeddings->tables[static_cast<std::size_t>(t)].view();
        if (config.rowwise_adagrad)  // one accumulator per row
          v.push_back(TensorView(embeddings->state.data_as<float>() + embeddings->layout().base(t), DType::f32,
                                 {tv.size(0)}, dev));
        else
          v.push_back(TensorView(embeddings->state.data_as<float>() + embeddings->layout().base(t) * dim, DType::f32,
                                 tv.shape(), dev));
      }
    }
    return v;
  }
};

}  // namespace detail

RandomParams dlrm_table_init(const DlrmConfig& config) { return detail::table_init(config); }
std::uint64_t dlrm_table_rounding_seed(const DlrmConfig& config) { return detail::table_rounding_seed(config); }

namespace {

void check_vector(const TensorView& t, std::int64_t n, const char* arg) {
  FK_CHECK_ARG(t.dtype() == DType::f32 && t.rank() == 1 && t.numel() == n && t.is_contiguous() &&
                   (t.data() != nullptr || n == 0),
               "models::Dlrm", arg, fmt::format("f32 [{}] with data", n), t.str());
}

}  // namespace

Dlrm::Dlrm(DlrmConfig config, Device device, DlrmImpl impl, DlrmTables tables) {
  config.validate();
  if (device.is_cuda()) {
#if FUSEKIT_WITH_CUDA
    const int count = cuda_device_count();
    FK_CHECK_ARG(device.index >= 0 && device.index < count, kOp, "device", "a CUDA device that exists",
                 fmt::format("{} ({} CUDA devices usable)", device.str(), count));
#else
    throw Error(kOp, "device", "cpu (fusekit was built without CUDA)", device.str());
#endif
  }
  FK_CHECK_ARG(device.is_cpu() || device.is_cuda(), kOp, "device", "cpu | cuda", device.str());
  FK_CHECK_ARG(!config.fused_mlp || impl == DlrmImpl::fused, kOp, "config.fused_mlp", "impl fused",
               std::string(impl_name(impl)));
  FK_CHECK_ARG(config.embedding_dtype == DType::f32 || impl == DlrmImpl::fused, kOp, "config.embedding_dtype",
               "f32 with impl reference (its dense table gradient is f32)",
               std::string(dtype_name(config.embedding_dtype)));
  const OnDevice on(device);
  s_ = std::make_unique<detail::DlrmState>(config, impl, device, tables);
  s_->sync();
}

Dlrm::~Dlrm() = default;
Dlrm::Dlrm(Dlrm&&) noexcept = default;
Dlrm& Dlrm::operator=(Dlrm&&) noexcept = default;

const DlrmConfig& Dlrm::config() const noexcept { return s_->config; }
Device Dlrm::device() const noexcept { return s_->dev; }
DlrmImpl Dlrm::impl() const noexcept { return s_->impl; }

void Dlrm::forward(const DlrmInput& input, const TensorView& logits) {
  detail::DlrmState& s = *s_;
  const OnDevice on(s.dev);
  s.stage(static_cast<int>(s.steps % 2), input, nullptr);
  check_vector(logits, s.batch, "logits");
  s.forward_body();
  s.sync();
  copy(logits, s.vec(s.logits));
}

void Dlrm::backward(const TensorView& dlogits, const TensorView& dpooled) { backward(dlogits, dpooled, {}); }

void Dlrm::backward(const TensorView& dlogits, const TensorView& dpooled,
                    const std::function<void(std::size_t)>& unit_done) {
  detail::DlrmState& s = *s_;
  const OnDevice on(s.dev);
  FK_CHECK_ARG(s.batch > 0, kOp, "backward", "a forward() first", "none");
  check_vector(dlogits, s.batch, "dlogits");
  const std::int64_t t = s.num_tables();
  if (!s.embeddings)
    FK_CHECK_ARG(dpooled.dtype() == DType::f32 && dpooled.rank() == 3 && dpooled.size(0) == s.batch &&
                     dpooled.size(1) == t && dpooled.size(2) == s.dim && dpooled.is_contiguous() &&
                     dpooled.data() != nullptr && dpooled.device() == s.dev,
                 kOp, "dpooled", fmt::format("f32 [{}, {}, {}], contiguous, on {}", s.batch, t, s.dim, s.dev.str()),
                 dpooled.str());
  // On a GPU the copy is ordered on the compute stream: a synchronous copy from pageable memory may
  // return before its data has landed, and the compute stream does not wait for the legacy one.
  if (s.stream_) copy_async(s.vec(s.dlogits), dlogits, *s.stream_);
  else copy(s.vec(s.dlogits), dlogits);
  s.backward_body(unit_done);
  if (!s.embeddings) s.copy_pooled(dpooled, s.z_tables(s.dz));
  s.sync();
}

void Dlrm::step(const OptimizerConfig& opt) {
  detail::DlrmState& s = *s_;
  const OnDevice on(s.dev);
  FK_CHECK_ARG(s.batch > 0, kOp, "step", "a forward() and backward() first", "none");
  s.ensure_optimizer_state(opt);
  s.step_body(opt);
  s.finish_step();
  s.sync();
}

void Dlrm::enqueue_train_step(const DlrmInput& input, const TensorView& labels, const OptimizerConfig& opt) {
  detail::DlrmState& s = *s_;
  const OnDevice on(s.dev);
  const int si = static_cast<int>(s.steps % 2);
  s.stage(si, input, &labels);
  s.ensure_optimizer_state(opt);
  auto body = [&] {
    s.forward_body();
    s.loss_body();
    s.backward_body();
    s.step_body(opt);
  };
  // The fused step with one-hot raw input has fixed sizes for a given batch: after one eager
  // step at that size (which also picks the GEMMs' algorithms and fills the allocator's cache),
  // capture it once per slot and replay.
  const bool graphable = s.stream_ && s.fused && s.bags.raw.has_value() && s.config.cuda_graph && s.trace == nullptr;
  if (!graphable || !s.warm.contains(s.batch)) {
    body();
    s.warm.insert(s.batch);
  } else {
    const auto key = std::make_tuple(si, s.batch, static_cast<int>(opt.kind), opt.learning_rate, opt.eps);
    auto it = s.graphs.find(key);
    if (it == s.graphs.end()) it = s.graphs.emplace(key, Graph::capture(*s.stream_, body)).first;
    it->second.launch(*s.stream_);
  }
  s.finish_step();
}

double Dlrm::train_step(const DlrmInput& input, const TensorView& labels, const OptimizerConfig& opt) {
  enqueue_train_step(input, labels, opt);
  return drain_loss();
}

double Dlrm::drain_loss() {
  detail::DlrmState& s = *s_;
  const OnDevice on(s.dev);
  return s.loss.drain(s.s());
}

void Dlrm::predict(const DlrmInput& input, const TensorView& probabilities) {
  detail::DlrmState& s = *s_;
  const OnDevice on(s.dev);
  s.stage(static_cast<int>(s.steps % 2), input, nullptr);
  check_vector(probabilities, s.batch, "probabilities");
  TraceRecorder* trace = s.trace;  // evaluation is not traced
  s.trace = nullptr;
  s.forward_body();
  s.trace = trace;
  bias_act_forward({s.column(s.logits), std::nullopt, std::nullopt, s.column(s.prob), std::nullopt},
                   {Activation::sigmoid, 1.0f}, s.s());
  if (s.stream_) s.slots[static_cast<std::size_t>(s.slot)].free.record(*s.stream_);
  s.sync();
  copy(probabilities, s.vec(s.prob));
}

void Dlrm::set_trace(TraceRecorder* trace) noexcept { s_->trace = trace; }

std::size_t Dlrm::peak_device_bytes() const {
  return s_->dev.is_cuda() ? allocator::stats(s_->dev).peak_allocated_bytes : 0;
}

nn::MLP::SavedActivationBytes Dlrm::mlp_activation_bytes(std::int64_t batch) const {
  const nn::MLP::SavedActivationBytes b = s_->bottom.saved_activation_bytes(batch),
                                      t = s_->top.saved_activation_bytes(batch);
  // Compressed, the two MLPs share one scratch (both report its size).
  return {b.whole + t.whole, b.kept + t.kept, s_->bottom.compressed() ? b.scratch : b.scratch + t.scratch};
}

std::vector<Dlrm::LinearParams> Dlrm::linear_layers() {
  std::vector<LinearParams> v;
  for (nn::Linear* l : s_->linears()) v.push_back({&l->weight, &l->bias, &l->weight_grad, &l->bias_grad});
  return v;
}

std::vector<Dlrm::ParamAndGrad> Dlrm::cross_parameters() {
  std::vector<ParamAndGrad> v;
  if (s_->cross)
    for (const nn::CrossNet::Layer& l : s_->cross->layers())
      for (const nn::ParameterArena::Parameter* p : {l.u, l.v, l.bias})
        v.push_back({const_cast<Tensor*>(&p->value), const_cast<Tensor*>(&p->grad)});
  return v;
}

std::vector<Tensor*> Dlrm::tables() {
  std::vector<Tensor*> v;
  if (s_->embeddings)
    for (Tensor& t : s_->embeddings->tables) v.push_back(&t);
  return v;
}

TensorView Dlrm::dense_gradients() { return s_->arena.gradients(); }

std::vector<Dlrm::GradientUnit> Dlrm::gradient_units() {
  detail::DlrmState& s = *s_;
  const TensorView all = s.arena.gradients();
  const auto* base = static_cast<const float*>(all.data());
  const auto at = [&](const Tensor& g) { return static_cast<std::int64_t>(static_cast<const float*>(g.data()) - base); };
  // Each unit's first gradient; a unit runs to the next one's start in the arena (the last: its end).
  std::vector<GradientUnit> units;
  for (std::size_t l = s.top.layers.size(); l-- > 0;)
    units.push_back({fmt::format("top.{}", l), at(s.top.layers[l].weight_grad), 0});
  if (s.cross) {
    std::int64_t first = all.numel();
    for (const nn::CrossNet::Layer& l : s.cross->layers())
      for (const nn::ParameterArena::Parameter* p : {l.u, l.v, l.bias}) first = std::min(first, p->offset);
    units.push_back({"cross", first, 0});
  }
  for (std::size_t l = s.bottom.layers.size(); l-- > 0;)
    units.push_back({fmt::format("bottom.{}", l), at(s.bottom.layers[l].weight_grad), 0});
  std::vector<std::int64_t> starts;
  for (const GradientUnit& u : units) starts.push_back(u.offset);
  std::sort(starts.begin(), starts.end());
  for (GradientUnit& u : units) {
    const auto next = std::upper_bound(starts.begin(), starts.end(), u.offset);
    u.floats = (next == starts.end() ? all.numel() : *next) - u.offset;
  }
  return units;
}

const Stream* Dlrm::stream() const noexcept { return s_->s(); }

Tensor Dlrm::table_gradient() {
  const OnDevice on(s_->dev);
  FK_CHECK_ARG(s_->embeddings.has_value(), kOp, "table_gradient", "a model holding its tables", "external tables");
  return s_->embeddings->gradient(s_->s());
}

void Dlrm::save_state(std::ostream& out) const {
  detail::DlrmState& s = *s_;
  const OnDevice on(s.dev);
  s.sync();
  const bool adagrad = s.arena.has_state();
  std::vector<TensorView> arrays = s.state_arrays(adagrad);
  const Tensor steps = Tensor::empty({detail::DlrmState::kRoundingStepFloats}, DType::f32, Device::cpu());
  if (s.rounds()) {
    s.rounding_steps_to(steps);
    arrays.push_back(steps);
  }
  detail::write_state(out, adagrad, arrays);
}

void Dlrm::load_state(std::istream& in) {
  detail::DlrmState& s = *s_;
  const OnDevice on(s.dev);
  s.sync();
  std::uint64_t count = 0;
  const bool adagrad = detail::read_state_header(in, count);
  s.arena.drop_state();
  if (s.embeddings) s.embeddings->state = Tensor();
  if (adagrad) {  // allocated here, the values read below
    s.arena.ensure_state(0.0f, s.s());
    if (s.embeddings) s.embeddings->ensure_state(0.0f, s.s());
    s.sync();
  }
  const std::vector<TensorView> arrays = s.state_arrays(adagrad);
  // One more array: the rounding steps (a state saved with compress_activations_bits or 16-bit
  // tables), of 4 or 6 floats.
  const bool has_steps = count == arrays.size() + 1;
  detail::read_state_arrays(in, has_steps ? count - 1 : count, arrays);
  std::vector<float> steps;
  if (has_steps) {
    steps = detail::read_state_array(in, detail::DlrmState::kRoundingStepFloats, "models::Dlrm::load_state", "in");
    FK_CHECK_ARG(steps.size() == 4 || steps.size() == 6, "models::Dlrm::load_state", "in",
                 "rounding steps of 4 or 6 floats", fmt::format("{} floats", steps.size()));
  }
  s.rounding_steps_from(steps);
  s.graphs.clear();  // they captured the old optimizer state's buffers
  s.warm.clear();
}

double bce_with_logits(const TensorView& logits, const TensorView& labels, const TensorView* dlogits) {
  const std::int64_t n = logits.numel();
  check_vector(logits, n, "logits");
  check_vector(labels, n, "labels");
  if (dlogits) check_vector(*dlogits, n, "dlogits");
  for (const TensorView* t : {&logits, &labels, dlogits})
    if (t) FK_CHECK_ARG(t->device().is_cpu(), "models::bce_with_logits", "logits/labels/dlogits", "host tensors", t->str());
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
