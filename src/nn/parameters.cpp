#include "fusekit/nn/parameters.hpp"

#include <fmt/format.h>

#include "fusekit/core/error.hpp"
#include "fusekit/core/random.hpp"
#include "fusekit/core/stream.hpp"
#include "fusekit/ops/recsys.hpp"

namespace fk::nn {

namespace {

constexpr std::int64_t kAlign = 64;  // floats: every parameter starts 256-byte aligned
constexpr const char* kOp = "nn::ParameterArena";

std::int64_t align_up(std::int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// A zeroed f32 buffer of n floats (at least one, so that its data is never null).
Tensor zeros(std::int64_t n, Device device) {
  Tensor t = Tensor::empty({std::max<std::int64_t>(n, 1)}, DType::f32, device);
  fill(t, 0.0);
  return t;
}

}  // namespace

OptimizerKind parse_optimizer(std::string_view name) {
  if (name == "sgd") return OptimizerKind::sgd;
  if (name == "adagrad") return OptimizerKind::adagrad;
  throw Error("nn::parse_optimizer", "name", "sgd | adagrad", std::string(name));
}

std::string_view optimizer_name(OptimizerKind k) { return k == OptimizerKind::sgd ? "sgd" : "adagrad"; }

ParameterArena::ParameterArena(std::int64_t capacity, Device device)
    : device_(device), values_(zeros(capacity, device)), grads_(zeros(capacity, device)) {
  FK_CHECK_ARG(capacity >= 0, kOp, "capacity", ">= 0 floats", fmt::format("{}", capacity));
}

std::int64_t ParameterArena::floats_for(const Dims& shape, std::int64_t row_stride) {
  FK_CHECK_ARG(shape.size() == 1 || shape.size() == 2, kOp, "shape", "rank 1 or 2", shape.str());
  if (shape.size() == 1) return align_up(shape.numel());
  const std::int64_t ld = row_stride == 0 ? shape[1] : row_stride;
  FK_CHECK_ARG(ld >= shape[1], kOp, "row_stride", fmt::format(">= the columns ({})", shape[1]),
               fmt::format("{}", row_stride));
  return align_up(Dims{shape[0], ld}.numel());
}

TensorView ParameterArena::view_of(const Tensor& buffer, const Parameter& p) const {
  const TensorView& v = p.value.view();
  return TensorView(buffer.data_as<float>() + p.offset, DType::f32, v.shape(), v.strides(), device_);
}

const ParameterArena::Parameter& ParameterArena::add(const Dims& shape, std::int64_t row_stride) {
  const std::int64_t n = floats_for(shape, row_stride);
  const std::int64_t capacity = values_.numel();
  FK_CHECK_ARG(used_ + n <= capacity, kOp, "add", fmt::format("room for {} more floats", n),
               fmt::format("{} of {} used", used_, capacity));
  const Dims strides = shape.size() == 1 ? Dims{1} : Dims{row_stride == 0 ? shape[1] : row_stride, 1};
  auto view = [&](const Tensor& buffer) {
    return Tensor::adopt(TensorView(buffer.data_as<float>() + used_, DType::f32, shape, strides, device_),
                         [keep = buffer.storage()] {});
  };
  params_.push_back({view(values_), view(grads_), used_});
  extent_.push_back(shape.size() == 1 ? shape[0] : (shape[0] - 1) * strides[0] + shape[1]);
  used_ += n;
  return params_.back();
}

TensorView ParameterArena::gradients() const {
  return TensorView(grads_.data(), DType::f32, {used_}, device_);
}

std::optional<TensorView> ParameterArena::state(std::size_t i) const {
  if (!has_state()) return std::nullopt;
  return view_of(state_, params_.at(i));
}

void ParameterArena::ensure_state(float initial_accumulator, const Stream* stream) {
  if (has_state()) return;
  state_ = Tensor::empty({std::max<std::int64_t>(used_, 1)}, DType::f32, device_, stream);
  // A uniform fill over [a, a] writes a exactly.
  fill_uniform(state_, initial_accumulator, initial_accumulator, {}, stream);
}

void ParameterArena::step(const OptimizerConfig& opt, bool one_launch, const Stream* stream) {
  const bool adagrad = opt.kind == OptimizerKind::adagrad;
  if (adagrad) ensure_state(opt.initial_accumulator, stream);
  const DenseOptimizerParams p{adagrad, opt.learning_rate, opt.eps};
  auto flat = [](const Tensor& buffer, std::int64_t offset, std::int64_t n) {
    return TensorView(buffer.data_as<float>() + offset, DType::f32, {n}, buffer.device());
  };
  if (one_launch) {
    if (used_ == 0) return;
    dense_optimizer_update({flat(values_, 0, used_), flat(grads_, 0, used_),
                            adagrad ? std::optional<TensorView>(flat(state_, 0, used_)) : std::nullopt},
                           p, stream);
    return;
  }
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const std::int64_t at = params_[i].offset, n = extent_[i];
    dense_optimizer_update({flat(values_, at, n), flat(grads_, at, n),
                            adagrad ? std::optional<TensorView>(flat(state_, at, n)) : std::nullopt},
                           p, stream);
  }
}

}  // namespace fk::nn
