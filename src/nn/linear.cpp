#include "fusekit/nn/linear.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>

#include "fusekit/core/checks.hpp"
#include "fusekit/nn/parameters.hpp"
#include "fusekit/ops/gemm.hpp"
#include "fusekit/ops/quant.hpp"
#include "nn/module_util.hpp"

namespace fk::nn {

namespace {

constexpr std::uint64_t kBiasStream = std::uint64_t{1} << 32;

GemmEpilogue forward_epilogue(Activation act) {
  switch (act) {
    case Activation::identity: return GemmEpilogue::bias;
    case Activation::relu: return GemmEpilogue::relu_bias;
    case Activation::gelu_tanh: return GemmEpilogue::gelu_aux_bias;
    default: throw_internal("nn::Linear: activation not checked by the constructor");
  }
}

// A layer's x, y, dy or dx: rows [rows, cols] (rank 2, inner stride 1, row stride >= cols, or
// >= `k` for x and dx of a padded layer), the weight's dtype and device.
void check_rows(const char* op, const char* arg, const TensorView& t, const Tensor& weight, std::int64_t rows,
                std::int64_t cols, std::int64_t k) {
  FK_CHECK_ARG(t.rank() == 2, op, arg, "a rank-2 tensor", t.str());
  checks::same_dtype(op, arg, t, weight);
  checks::same_device(op, arg, t, weight.device());
  FK_CHECK_ARG((rows < 0 || t.size(0) == rows) && t.size(1) == cols, op, arg,
               fmt::format("[{}, {}]", rows < 0 ? std::string("rows") : std::to_string(rows), cols), t.shape().str());
  FK_CHECK_ARG(t.strides()[1] == 1 && (t.size(0) <= 1 || t.strides()[0] >= k), op, arg,
               fmt::format("rows with inner stride 1 and a row stride >= {}", k), t.str());
  FK_CHECK_ARG(t.data() != nullptr || t.numel() == 0, op, arg, "non-null data", "a null pointer");
}

// Rows t [B, cols] seen as [B, k] (k >= cols: the padding columns of a padded layer).
TensorView widen(const TensorView& t, std::int64_t k) {
  if (t.size(1) == k) return t;
  return TensorView(t.data(), t.dtype(), {t.size(0), k}, {std::max(t.strides()[0], k), 1}, t.device());
}

// The initial W and b (DLRM reference's init) on the host, f32.
std::pair<Tensor, Tensor> initial_parameters(std::int64_t in, std::int64_t out, RandomParams init) {
  Tensor w = Tensor::empty({out, in}, DType::f32, Device::cpu()), b = Tensor::empty({out}, DType::f32, Device::cpu());
  fill_normal(w, 0.0f, static_cast<float>(std::sqrt(2.0 / static_cast<double>(in + out))), init);
  fill_normal(b, 0.0f, static_cast<float>(std::sqrt(1.0 / static_cast<double>(out))),
              {init.seed, init.subsequence + kBiasStream});
  return {std::move(w), std::move(b)};
}

}  // namespace

void Linear::check_options(const char* op, std::int64_t in, std::int64_t out, DType dtype) const {
  FK_CHECK_ARG(in >= 1 && out >= 1, op, "in/out", "sizes >= 1", fmt::format("{} -> {}", in, out));
  FK_CHECK_ARG(options_.act == Activation::identity || options_.act == Activation::relu ||
                   options_.act == Activation::gelu_tanh,
               op, "act", "identity, relu or gelu_tanh (the GEMM epilogues)", std::string(activation_name(options_.act)));
  FK_CHECK_ARG(dtype == DType::f32 || dtype == DType::bf16 || dtype == DType::f16, op, "dtype", "f32, bf16 or f16",
               std::string(dtype_name(dtype)));
  FK_CHECK_ARG(options_.in_stride == 0 || options_.in_stride >= in, op, "in_stride", fmt::format("0 or >= in ({})", in),
               fmt::format("{}", options_.in_stride));
}

Linear::Linear(std::int64_t in, std::int64_t out, LinearOptions options, DType dtype, Device device,
               RandomParams init)
    : options_(options) {
  check_options("nn::Linear", in, out, dtype);
  auto [w, b] = initial_parameters(in, out, init);
  const auto place = [&](const Tensor& host) {
    if (dtype == DType::f32) return host.copy_to(device);
    Tensor t = Tensor::empty(host.shape(), dtype, Device::cpu());
    const float* src = host.data_as<float>();
    for (std::int64_t i = 0; i < host.numel(); ++i) {
      if (dtype == DType::bf16) t.data_as<bf16>()[i] = bf16(src[i]);
      else t.data_as<f16>()[i] = f16(src[i]);
    }
    return t.copy_to(device);
  };
  const std::int64_t k = options.in_stride == 0 ? in : options.in_stride;
  auto padded = [&](Tensor t) {  // [out, in] with row stride k, padding zero
    if (k == in) return t;
    Tensor full = Tensor::empty({out, k}, dtype, device);
    fill(full, 0.0);
    Tensor v = Tensor::adopt(TensorView(full.data(), dtype, {out, in}, {k, 1}, device), [keep = full.storage()] {});
    copy(v, t);
    return v;
  };
  weight = padded(place(w));
  bias = place(b);
  weight_grad = padded(Tensor::empty({out, in}, dtype, device));
  bias_grad = Tensor::empty({out}, dtype, device);
}

std::int64_t Linear::arena_floats(std::int64_t in, std::int64_t out, std::int64_t in_stride) {
  return ParameterArena::floats_for({out, in}, in_stride) + ParameterArena::floats_for({out});
}

Linear::Linear(std::int64_t in, std::int64_t out, LinearOptions options, RandomParams init, ParameterArena& arena)
    : options_(options) {
  check_options("nn::Linear", in, out, DType::f32);
  auto [w, b] = initial_parameters(in, out, init);
  const auto share = [](const Tensor& t) { return Tensor::adopt(t.view(), [keep = t.storage()] {}); };
  const ParameterArena::Parameter& pw = arena.add({out, in}, options.in_stride);
  weight = share(pw.value);
  weight_grad = share(pw.grad);
  const ParameterArena::Parameter& pb = arena.add({out});
  bias = share(pb.value);
  bias_grad = share(pb.grad);
  copy(weight, w);
  copy(bias, b);
}

void Linear::forward(const TensorView& x, const TensorView& y, const Stream* stream) {
  constexpr const char* op = "nn::Linear::forward";
  check_rows(op, "x", x, weight, -1, in(), k());
  check_rows(op, "y", y, weight, x.size(0), out(), out());
  const TensorView xk = widen(x, k()), wk = widen(weight, k());
  GemmParams p;
  p.trans_b = Trans::t;
  p.allow_tf32 = options_.allow_tf32;
  if (!options_.fused) {  // GEMM, then bias, then the activation
    gemm({xk, wk, y, std::nullopt, std::nullopt, std::nullopt}, p, stream);
    bias_act_forward({y, std::nullopt, bias.view(), y, std::nullopt}, {Activation::identity, 1.0f}, stream);
    if (options_.act == Activation::gelu_tanh) {
      if (preact_.shape() != y.shape()) preact_ = Tensor::empty(y.shape(), y.dtype(), y.device(), stream);
      bias_act_forward({y, std::nullopt, std::nullopt, y, preact_.view()}, {options_.act, 1.0f}, stream);
    } else if (options_.act != Activation::identity) {
      bias_act_forward({y, std::nullopt, std::nullopt, y, std::nullopt}, {options_.act, 1.0f}, stream);
    }
    return;
  }
  p.epilogue = forward_epilogue(options_.act);
  std::optional<TensorView> aux;
  if (options_.act == Activation::gelu_tanh) {
    if (preact_.shape() != y.shape()) preact_ = Tensor::empty(y.shape(), y.dtype(), y.device(), stream);
    aux = preact_.view();
  }
  gemm({xk, wk, y, bias.view(), aux, std::nullopt}, p, stream);
}

void Linear::backward(const TensorView& x, const TensorView& y, const TensorView& dy, const std::optional<TensorView>& dx,
                      const Stream* stream) {
  constexpr const char* op = "nn::Linear::backward";
  check_rows(op, "x", x, weight, -1, in(), k());
  const std::int64_t b = x.size(0);
  check_rows(op, "y", y, weight, b, out(), out());
  check_rows(op, "dy", dy, weight, b, out(), out());
  if (dx) {
    check_rows(op, "dx", *dx, weight, b, in(), k());
    FK_CHECK_ARG(!checks::overlaps(widen(*dx, k()), dy), op, "dx", "memory that does not overlap dy",
                 "an overlapping tensor");
  }
  activation_backward(op, y, dy, stream);
  const TensorView xk = widen(x, k());
  matmul(dy, xk, widen(weight_grad, k()), Trans::t, Trans::n, stream, options_.allow_tf32);  // dW = dzᵀ x
  if (dx) matmul(dy, widen(weight, k()), widen(*dx, k()), Trans::n, Trans::n, stream, options_.allow_tf32);  // dx = dz W
}

void Linear::activation_backward(const char* op, const TensorView& y, const TensorView& dy, const Stream* stream) {
  const bool gelu = options_.act == Activation::gelu_tanh;
  if (gelu) checks::shape_is(op, "y", preact_, Dims{dy.size(0), out()});  // the forward of this batch kept z
  const TensorView saved = gelu ? preact_.view() : y;
  const SavedForBackward kind = gelu ? SavedForBackward::preactivation : SavedForBackward::output;
  if (options_.fused) {  // dz = dy ⊙ act'(z) in place, db = column sums of dz: one pass
    bias_act_backward({dy, saved, kind, dy, std::nullopt, bias_grad.view()}, {options_.act, 1.0f}, stream);
  } else {  // the derivative, then the column sums: two passes
    if (options_.act != Activation::identity)
      bias_act_backward({dy, saved, kind, dy, std::nullopt, std::nullopt}, {options_.act, 1.0f}, stream);
    bias_act_backward({dy, y, SavedForBackward::output, dy, std::nullopt, bias_grad.view()},
                      {Activation::identity, 1.0f}, stream);
  }
}

void Linear::backward_packed(const PackedView& x, const std::optional<TensorView>& y, const TensorView& dy,
                             const std::optional<TensorView>& dx, const PackedScratch& scratch, const Stream* stream) {
  constexpr const char* op = "nn::Linear::backward_packed";
  FK_CHECK_ARG(weight.dtype() == DType::f32, op, "this", "an f32 layer", std::string(dtype_name(weight.dtype())));
  FK_CHECK_ARG(x.cols == k() && x.dtype == DType::f32, op, "x", fmt::format("f32 [B, {}] packed", k()),
               fmt::format("{} [{}, {}] packed", dtype_name(x.dtype), x.rows, x.cols));
  const std::int64_t b = x.rows;
  check_rows(op, "dy", dy, weight, b, out(), out());
  if (y) check_rows(op, "y", *y, weight, b, out(), out());
  if (dx) {
    check_rows(op, "dx", *dx, weight, b, in(), k());
    FK_CHECK_ARG(!checks::overlaps(widen(*dx, k()), dy), op, "dx", "memory that does not overlap dy",
                 "an overlapping tensor");
  }
  checks::shape_is(op, "scratch.dz", scratch.dz, Dims{b, out()});
  if (y) {
    activation_backward(op, *y, dy, stream);
  } else {  // dy is dz: db = its column sums
    bias_act_backward({dy, dy, SavedForBackward::output, dy, std::nullopt, bias_grad.view()},
                      {Activation::identity, 1.0f}, stream);
  }
  // dW = dzᵀ x̂ from the packed bits, dz in the dtype and layout the op reads.
  const bool direct = dy.is_contiguous() && dy.dtype() == scratch.dz.dtype();
  if (!direct) convert(dy, scratch.dz, stream);
  const TensorView dz = direct ? dy : scratch.dz;
  if (k() == in()) {
    weight_grad_from_packed(dz, x, weight_grad, {}, stream);
  } else {  // [out, k] in the scratch, then its in() columns: weight_grad's padding stays zero
    checks::shape_is(op, "scratch.dw", scratch.dw, Dims{out(), k()});
    weight_grad_from_packed(dz, x, scratch.dw, {}, stream);
    convert(TensorView(scratch.dw.data(), DType::f32, {out(), in()}, {k(), 1}, scratch.dw.device()), weight_grad, stream);
  }
  if (dx) matmul(dy, widen(weight, k()), widen(*dx, k()), Trans::n, Trans::n, stream, options_.allow_tf32);  // dx = dz W
}

MLP::MLP(const std::vector<std::int64_t>& sizes, Activation act, bool act_last, bool allow_tf32, DType dtype,
         Device device, RandomParams init) {
  FK_CHECK_ARG(sizes.size() >= 2, "nn::MLP", "sizes", "an input and at least one layer's output size",
               fmt::format("{} sizes", sizes.size()));
  for (std::size_t l = 0; l + 1 < sizes.size(); ++l) {
    const bool last = l + 2 == sizes.size();
    layers.emplace_back(sizes[l], sizes[l + 1], LinearOptions{last && !act_last ? Activation::identity : act, allow_tf32},
                        dtype, device, RandomParams{init.seed, init.subsequence + l});
  }
}

namespace {

std::int64_t round_up(std::int64_t n, std::int64_t to) { return (n + to - 1) / to * to; }

void check_mlp_sizes(const std::vector<std::int64_t>& sizes, std::int64_t pad_to) {
  FK_CHECK_ARG(sizes.size() >= 2, "nn::MLP", "sizes", "an input and at least one layer's output size",
               fmt::format("{} sizes", sizes.size()));
  FK_CHECK_ARG(pad_to >= 1, "nn::MLP", "pad_to", ">= 1", fmt::format("{}", pad_to));
}

// The group of a packed row of `cols` values: of the powers of two from 32 (the GPU weight-gradient
// kernel's multiple) to `cap`, the largest of those that store the fewest values in whole groups
// (368 -> 128: 3 groups, 384 values; 512 -> 256; 16 -> 32), so that a narrow row is not one mostly
// empty group, and pack runs its warp-per-group kernels (a power of two of lanes per group).
int packed_group(std::int64_t cols, int cap) {
  int best = 32;
  for (int g = 64; g <= cap; g *= 2)
    if (round_up(cols, g) <= round_up(cols, best)) best = g;
  return best;
}

// Bytes of a [rows, cols] tensor packed with p: words and the statistics (scale and min).
std::size_t packed_bytes(std::int64_t rows, std::int64_t cols, const PackParams& p) {
  const std::int64_t groups = (cols + p.group - 1) / p.group;
  return static_cast<std::size_t>(rows * groups) *
         (static_cast<std::size_t>(p.group * p.bits / 8) + 2 * dtype_size(p.stats_dtype));
}

void zero(const TensorView& t, const Stream* stream) {
  if (stream != nullptr) zero_async(t, *stream);
  else fill(t, 0.0);
}

// Philox subsequences a layer's packs draw from: offset + l * 2^40 + step.
constexpr int kLayerStreamBits = 40;

}  // namespace

std::int64_t MLP::arena_floats(const std::vector<std::int64_t>& sizes, std::int64_t pad_to) {
  check_mlp_sizes(sizes, pad_to);
  std::int64_t n = 0;
  for (std::size_t l = 0; l + 1 < sizes.size(); ++l)
    n += Linear::arena_floats(sizes[l], sizes[l + 1], round_up(sizes[l], pad_to));
  return n;
}

bool MLP::fits_fused_kernel(const std::vector<std::int64_t>& sizes) {
  if (sizes.size() < 3) return false;
  const std::int64_t h = sizes[1];
  if (h != 16 && h != 32 && h != 64 && h != 128) return false;
  for (std::size_t l = 1; l + 1 < sizes.size(); ++l)
    if (sizes[l] != h) return false;
  return sizes.front() <= 128 && sizes.back() <= 128;
}

// The buffers of a compressed MLP's full-precision activations and gradients, which hold nothing
// between calls: work[i] f32 [rows * work_row[i]] (layer l's output, then its gradient, in work[l %
// 2]), dz [rows * dz_row] (Linear::PackedScratch::dz), dw f32 [dw_floats] (padded layers); each
// size the largest any MLP sharing the scratch needs.
struct MLP::Scratch {
  explicit Scratch(Device d) : device(d) {}
  Device device;
  std::int64_t work_row[2] = {1, 1}, dz_row = 1, dw_floats = 0;
  std::int64_t rows = 0;  // rows the buffers hold (0: none, or sizes grown since)
  Tensor work[2], dz, dw;

  void need(const std::int64_t w[2], std::int64_t z, std::int64_t d) {
    work_row[0] = std::max(work_row[0], w[0]);
    work_row[1] = std::max(work_row[1], w[1]);
    dz_row = std::max(dz_row, z);
    dw_floats = std::max(dw_floats, d);
    rows = 0;
  }
  void ensure(std::int64_t batch, const Stream* stream) {
    if (batch <= rows) return;
    for (int i = 0; i < 2; ++i) work[i] = Tensor::empty({batch * work_row[i]}, DType::f32, device, stream);
    dz = Tensor::empty({batch * dz_row}, Linear::packed_dz_dtype(device), device, stream);
    dw = Tensor::empty({std::max<std::int64_t>(dw_floats, 1)}, DType::f32, device, stream);
    rows = batch;
  }
  std::size_t bytes(std::int64_t batch) const {
    const std::size_t b = static_cast<std::size_t>(batch);
    return b * static_cast<std::size_t>(work_row[0] + work_row[1]) * 4 +
           b * static_cast<std::size_t>(dz_row) * dtype_size(Linear::packed_dz_dtype(device)) +
           static_cast<std::size_t>(dw_floats) * 4;
  }
};

MLP::MLP(const std::vector<std::int64_t>& sizes, const ArenaOptions& o, RandomParams init, ParameterArena& arena)
    : fused_kernel_(o.fused_kernel) {
  constexpr const char* op = "nn::MLP";
  check_mlp_sizes(sizes, o.pad_to);
  FK_CHECK_ARG(!o.fused_kernel || fits_fused_kernel(sizes), op, "fused_kernel",
               "sizes fused_mlp takes (in and out <= 128, hidden layers of one width 16, 32, 64 or 128)",
               fmt::format("{}", fmt::join(sizes, "-")));
  if (o.compress) {
    const PackParams& p = *o.compress;
    FK_CHECK_ARG(!o.fused_kernel, op, "compress", "no fused_kernel (fused_mlp keeps its own bf16 activations)",
                 "fused_kernel");
    FK_CHECK_ARG(p.bits == 8 || p.bits == 4 || p.bits == 2, op, "compress.bits", "8, 4 or 2", std::to_string(p.bits));
    FK_CHECK_ARG(p.group > 0 && p.group % 32 == 0, op, "compress.group", "a positive multiple of 32",
                 std::to_string(p.group));
    FK_CHECK_ARG(p.stats_dtype == DType::bf16 || p.stats_dtype == DType::f32, op, "compress.stats_dtype", "bf16 or f32",
                 std::string(dtype_name(p.stats_dtype)));
    FK_CHECK_ARG(o.act == Activation::relu || o.act == Activation::identity, op, "compress",
                 "act relu or identity (a compressed MLP keeps a ReLU's mask, not the pre-activation)",
                 std::string(activation_name(o.act)));
  }
  const std::int64_t pad = o.fused_kernel ? 1 : o.pad_to;
  for (std::size_t l = 0; l + 1 < sizes.size(); ++l) {
    const bool last = l + 2 == sizes.size();
    LinearOptions lo{last && !o.act_last ? Activation::identity : o.act, o.allow_tf32, o.fused, round_up(sizes[l], pad)};
    layers.emplace_back(sizes[l], sizes[l + 1], lo, RandomParams{init.seed, init.subsequence + l}, arena);
  }
  if (fused_kernel_) {
    const Linear& z = layers.back();
    kernel_floats_ = (z.bias.data_as<float>() + z.out()) - layers.front().weight.data_as<float>();
    w16_ = Tensor::empty({kernel_floats_}, DType::bf16, arena.device());
  }
  if (o.compress) {
    compress_ = o.compress;
    step_ = Tensor::empty({1}, DType::i64, arena.device());
    fill(step_, 0.0);
    scratch_ = std::make_shared<Scratch>(arena.device());
    std::int64_t work_row[2] = {1, 1}, dz_row = 1, dw = 0;
    for (std::size_t l = 0; l < layers.size(); ++l) {
      const Linear& z = layers[l];
      PackParams p = *o.compress;
      p.group = packed_group(z.k(), o.compress->group);
      p.offset = o.compress->offset + (std::uint64_t{l} << kLayerStreamBits);
      p.offset_counter = step_.view();
      pack_.push_back(p);
      if (l + 1 < layers.size()) work_row[l % 2] = std::max(work_row[l % 2], layers[l + 1].k());
      dz_row = std::max(dz_row, z.out());
      if (z.k() > z.in()) dw = std::max(dw, z.out() * z.k());
    }
    scratch_->need(work_row, dz_row, dw);
  }
}

void MLP::share_scratch(MLP& other) {
  FK_CHECK_ARG(compress_ && other.compress_, "nn::MLP::share_scratch", "other", "two compressed MLPs",
               compress_ ? "an uncompressed one" : "this one uncompressed");
  FK_CHECK_ARG(other.scratch_->device == scratch_->device, "nn::MLP::share_scratch", "other",
               "an MLP on " + scratch_->device.str(), other.scratch_->device.str());
  if (other.scratch_ == scratch_) return;
  scratch_->need(other.scratch_->work_row, other.scratch_->dz_row, other.scratch_->dw_floats);
  other.scratch_ = scratch_;
  if (const std::int64_t rows = std::max(capacity_, other.capacity_); rows > 0) scratch_->ensure(rows, nullptr);
}

std::vector<MlpLayer> MLP::kernel_layers() const {
  std::vector<MlpLayer> v;
  const float* base = layers.front().weight.data_as<float>();
  auto* w16 = static_cast<std::uint16_t*>(w16_.data());
  for (const Linear& l : layers)
    v.push_back({TensorView(w16 + (l.weight.data_as<float>() - base), DType::bf16, {l.out(), l.in()}, w16_.device()),
                 TensorView(w16 + (l.bias.data_as<float>() - base), DType::bf16, {l.out()}, w16_.device()),
                 l.options().act});
  return v;
}

TensorView MLP::bf16_rows(const Tensor& t, std::int64_t cols) const {
  return TensorView(t.data(), DType::bf16, {batch_, cols}, t.device());
}

void MLP::kernel_forward(const TensorView& x, const TensorView& y, const Stream* stream) {
  const std::int64_t in = layers.front().in(), out = layers.back().out(), h = layers.front().out();
  const Device dev = w16_.device();
  convert(TensorView(layers.front().weight.data(), DType::f32, {kernel_floats_}, dev), w16_, stream);
  convert(x, bf16_rows(x16_, in), stream);
  fused_mlp_forward_train({bf16_rows(x16_, in), kernel_layers(), bf16_rows(y16_, out),
                           TensorView(hidden16_.data(), DType::bf16,
                                      {static_cast<std::int64_t>(layers.size()) - 1, batch_, h}, dev)},
                          stream);
  convert(bf16_rows(y16_, out), y, stream);
}

void MLP::kernel_backward(const TensorView& dy, const std::optional<TensorView>& dx, const Stream* stream) {
  const std::int64_t in = layers.front().in(), out = layers.back().out(), h = layers.front().out();
  const Device dev = w16_.device();
  convert(dy, bf16_rows(dy16_, out), stream);
  FusedMlpBackwardArgs a{bf16_rows(dy16_, out),
                         bf16_rows(x16_, in),
                         TensorView(hidden16_.data(), DType::bf16, {static_cast<std::int64_t>(layers.size()) - 1, batch_, h}, dev),
                         bf16_rows(y16_, out),
                         kernel_layers(),
                         std::nullopt,
                         {},
                         {}};
  if (dx) a.dx = bf16_rows(dx16_, in);
  for (const Linear& l : layers) {
    a.dweight.push_back(l.weight_grad.view());
    a.dbias.push_back(l.bias_grad.view());
  }
  fused_mlp_backward(a, stream);
  if (dx) convert(bf16_rows(dx16_, in), *dx, stream);
}

void MLP::reserve(std::int64_t batch, const Stream* stream) {
  if (batch <= capacity_) return;
  const std::size_t n = layers.size();
  if (compress_) {
    const Device dev = layers.front().weight.device();
    packed_.clear();
    mask_.clear();
    mask_.resize(n);
    for (std::size_t l = 0; l < n; ++l) {
      packed_.push_back(PackedTensor::empty(batch, layers[l].k(), DType::f32, pack_[l], dev, stream));
      if (relu_mask(l)) mask_[l] = Tensor::empty({relu_mask_words(batch * layers[l + 1].k())}, DType::i32, dev, stream);
    }
    scratch_->ensure(batch, stream);
    capacity_ = batch;
    return;
  }
  hidden_.clear();
  grad_.clear();
  hidden_.resize(n - 1);
  grad_.resize(n - 1);
  for (std::size_t l = 0; l + 1 < n; ++l) {
    // The row stride is the next layer's K: its padding columns are read by its GEMMs, so zero.
    const Dims shape{batch, layers[l + 1].k()};
    const DType dt = layers[l].weight.dtype();
    const Device dev = layers[l].weight.device();
    hidden_[l] = Tensor::empty(shape, dt, dev, stream);
    grad_[l] = Tensor::empty(shape, dt, dev, stream);
    zero(hidden_[l], stream);
    zero(grad_[l], stream);
  }
  if (fused_kernel_) {
    const std::int64_t in = layers.front().in(), out = layers.back().out(), h = layers.front().out();
    const Device dev = w16_.device();
    x16_ = Tensor::empty({batch * in}, DType::bf16, dev, stream);
    dx16_ = Tensor::empty({batch * in}, DType::bf16, dev, stream);
    y16_ = Tensor::empty({batch * out}, DType::bf16, dev, stream);
    dy16_ = Tensor::empty({batch * out}, DType::bf16, dev, stream);
    hidden16_ = Tensor::empty({static_cast<std::int64_t>(layers.size() - 1) * batch * h}, DType::bf16, dev, stream);
  }
  capacity_ = batch;
}

TensorView MLP::rows(const Tensor& t, std::size_t l) const {
  return TensorView(t.data(), t.dtype(), {batch_, layers[l].out()}, {t.size(1), 1}, t.device());
}

void MLP::forward(const TensorView& x, const TensorView& y, const Stream* stream) {
  const std::int64_t b = x.rank() == 2 ? x.size(0) : 0;
  const std::size_t n = layers.size();
  reserve(b, stream);
  batch_ = b;
  input_ = x;
  if (fused_kernel_) return kernel_forward(x, y, stream);
  if (compress_) return compressed_forward(x, y, stream);
  for (std::size_t l = 0; l < n; ++l)
    layers[l].forward(l == 0 ? x : rows(hidden_[l - 1], l - 1), l + 1 == n ? y : rows(hidden_[l], l), stream);
}

bool MLP::relu_mask(std::size_t l) const {
  return l + 1 < layers.size() && layers[l].options().act == Activation::relu;
}

TensorView MLP::work(std::size_t l, std::int64_t cols) const {
  const Tensor& t = scratch_->work[l % 2];
  return TensorView(t.data(), DType::f32, {batch_, cols}, t.device());
}

PackedView MLP::packed_rows(std::size_t l) const {
  const PackedTensor& p = packed_[l];
  const Device dev = p.words.device();
  const std::int64_t groups = p.words.size(1);
  return {TensorView(p.words.data(), DType::i32, {batch_, groups, p.words.size(2)}, dev),
          TensorView(p.scale.data(), p.scale.dtype(), {batch_, groups}, dev),
          TensorView(p.min.data(), p.min.dtype(), {batch_, groups}, dev),
          batch_,
          p.cols,
          p.dtype,
          p.bits,
          p.group};
}

// Layer l writes its output into work(l) with the next layer's row stride (its padding
// columns zeroed first where it has some), packs its input (x, or the previous output, before the
// next layer overwrites that buffer) and keeps a hidden ReLU's mask.
void MLP::compressed_forward(const TensorView& x, const TensorView& y, const Stream* stream) {
  const std::size_t n = layers.size();
  FK_CHECK_ARG(x.rank() == 2 && x.strides()[1] == 1 && (x.size(0) <= 1 || x.strides()[0] == layers[0].k()),
               "nn::MLP::forward", "x",
               fmt::format("rows [B, {}] with row stride {} (a compressed MLP packs them whole)", layers[0].in(),
                           layers[0].k()),
               x.str());
  for (std::size_t l = 0; l < n; ++l) {
    const Linear& z = layers[l];
    const TensorView in =
        l == 0 ? x : TensorView(work(l - 1, z.k()).data(), DType::f32, {batch_, z.in()}, {z.k(), 1}, x.device());
    TensorView out = y;
    if (l + 1 < n) {
      const std::int64_t ld = layers[l + 1].k();
      if (z.out() < ld) zero(work(l, ld), stream);
      out = TensorView(work(l, ld).data(), DType::f32, {batch_, z.out()}, {ld, 1}, x.device());
    }
    layers[l].forward(in, out, stream);
    const TensorView packed_in = l == 0 ? TensorView(x.data(), DType::f32, {batch_, z.k()}, x.device()) : work(l - 1, z.k());
    pack(packed_in, packed_rows(l), pack_[l], stream);
    if (relu_mask(l)) {
      const TensorView full = work(l, layers[l + 1].k());
      relu_forward_packed(full, full, TensorView(mask_[l].data(), DType::i32, {relu_mask_words(full.numel())}, x.device()),
                          stream);
    }
  }
}

// Each layer from its packed input; a hidden ReLU's derivative from its mask, applied to the
// gradient in place. The gradient of layer l's output lives where its output did (work(l)).
void MLP::compressed_backward(const TensorView& y, const TensorView& dy, const std::optional<TensorView>& dx,
                              const Stream* stream, const std::function<void(std::size_t)>& layer_done) {
  const std::size_t n = layers.size();
  FK_CHECK_ARG(packed_.size() == n, "nn::MLP::backward", "this", "a forward before the backward", "none");
  const Device dev = y.device();
  for (std::size_t i = n; i-- > 0;) {
    Linear& z = layers[i];
    TensorView g = dy;
    if (i + 1 < n) {
      const std::int64_t ld = layers[i + 1].k();
      g = TensorView(work(i, ld).data(), DType::f32, {batch_, z.out()}, {ld, 1}, dev);
      if (relu_mask(i)) {
        const TensorView full = work(i, ld);
        relu_backward_packed(full, TensorView(mask_[i].data(), DType::i32, {relu_mask_words(full.numel())}, dev), full,
                             stream);
      }
    }
    std::optional<TensorView> gin = dx;
    if (i > 0) gin = TensorView(work(i - 1, z.k()).data(), DType::f32, {batch_, z.in()}, {z.k(), 1}, dev);
    const Tensor& dz = scratch_->dz;
    const Linear::PackedScratch scratch{
        TensorView(dz.data(), dz.dtype(), {batch_, z.out()}, dev),
        z.k() > z.in() ? TensorView(scratch_->dw.data(), DType::f32, {z.out(), z.k()}, dev) : TensorView()};
    z.backward_packed(packed_rows(i), i + 1 == n ? std::optional<TensorView>(y) : std::nullopt, g, gin, scratch, stream);
    if (layer_done) layer_done(i);
  }
  advance_offset(step_, 1, stream);
}

std::uint64_t MLP::rounding_step() const {
  if (!compress_) return 0;
  const Tensor h = step_.copy_to(Device::cpu());
  return *h.data_as<const std::uint64_t>();
}

void MLP::set_rounding_step(std::uint64_t step) {
  if (!compress_) return;
  Tensor h = Tensor::empty({1}, DType::i64, Device::cpu());
  *h.data_as<std::uint64_t>() = step;
  copy(step_, h);
}

MLP::SavedActivationBytes MLP::saved_activation_bytes(std::int64_t batch) const {
  const std::size_t n = layers.size(), es = dtype_size(layers.front().weight.dtype()), b = static_cast<std::size_t>(batch);
  SavedActivationBytes s;
  for (const Linear& z : layers) s.whole += b * static_cast<std::size_t>(z.k()) * es;
  if (!compress_) {
    s.kept = s.whole;
    for (std::size_t l = 0; l + 1 < n; ++l) s.scratch += b * static_cast<std::size_t>(layers[l + 1].k()) * es;
    return s;
  }
  for (std::size_t l = 0; l < n; ++l) {
    s.kept += packed_bytes(batch, layers[l].k(), pack_[l]);
    if (relu_mask(l)) s.kept += static_cast<std::size_t>(relu_mask_words(batch * layers[l + 1].k())) * 4;
  }
  s.scratch = scratch_->bytes(batch);
  return s;
}

void MLP::backward(const TensorView& y, const TensorView& dy, const std::optional<TensorView>& dx, const Stream* stream,
                   const std::function<void(std::size_t)>& layer_done) {
  if (fused_kernel_) {
    kernel_backward(dy, dx, stream);
    for (std::size_t i = layers.size(); layer_done && i-- > 0;) layer_done(i);
    return;
  }
  if (compress_) return compressed_backward(y, dy, dx, stream, layer_done);
  const std::size_t n = layers.size();
  for (std::size_t i = n; i-- > 0;) {
    const TensorView in = i == 0 ? input_ : rows(hidden_[i - 1], i - 1);
    const TensorView out = i + 1 == n ? y : rows(hidden_[i], i);
    const TensorView g = i + 1 == n ? dy : rows(grad_[i], i);
    std::optional<TensorView> gin = dx;
    if (i > 0) gin = rows(grad_[i - 1], i - 1);
    layers[i].backward(in, out, g, gin, stream);
    if (layer_done) layer_done(i);
  }
}

}  // namespace fk::nn
