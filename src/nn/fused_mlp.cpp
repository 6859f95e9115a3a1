#include "fusekit/nn/fused_mlp.hpp"

#include <fmt/format.h>

#include <cmath>

#include "fusekit/core/checks.hpp"
#include "fusekit/core/random.hpp"
#include "fusekit/core/stream.hpp"
#include "nn/module_util.hpp"

namespace fk::nn {

using detail::keep;
using detail::uniform;

FusedMLP::FusedMLP(std::int64_t in, std::int64_t hidden, int hidden_layers, std::int64_t out, Activation act,
                   Activation out_act, DType dtype, Device device, std::uint64_t seed)
    : in_(in), hidden_(hidden), out_(out) {
  constexpr const char* op = "FusedMLP";
  FK_CHECK_ARG(in > 0 && hidden > 0 && out > 0 && hidden_layers >= 1, op, "sizes",
               "positive in, hidden, out and at least one hidden layer",
               fmt::format("{}, {}, {}, {} hidden layers", in, hidden, out, hidden_layers));
  checks::dtype_in(op, "dtype", Tensor::empty({0}, dtype, Device::cpu()), {DType::bf16, DType::f16});
  for (int l = 0; l <= hidden_layers; ++l) {
    const std::int64_t fan_in = l == 0 ? in : hidden, fan_out = l == hidden_layers ? out : hidden;
    const float bound = 1.0f / std::sqrt(static_cast<float>(fan_in));
    const std::uint64_t k = 2 * static_cast<std::uint64_t>(l);
    weight.push_back(uniform({fan_out, fan_in}, bound, dtype, device, {seed, k}));
    bias.push_back(uniform({fan_out}, bound, dtype, device, {seed, k + 1}));
    weight_grad.push_back(Tensor::empty({fan_out, fan_in}, DType::f32, device));
    bias_grad.push_back(Tensor::empty({fan_out}, DType::f32, device));
    act_.push_back(l == hidden_layers ? out_act : act);
  }
}

std::vector<MlpLayer> FusedMLP::layers() const {
  std::vector<MlpLayer> v;
  for (std::size_t l = 0; l < weight.size(); ++l) v.push_back({weight[l], bias[l], act_[l]});
  return v;
}

std::vector<TensorView> FusedMLP::params() const {
  std::vector<TensorView> v;
  for (std::size_t l = 0; l < weight.size(); ++l) {
    v.push_back(weight[l]);
    v.push_back(bias[l]);
  }
  return v;
}

std::vector<TensorView> FusedMLP::grads() const {
  std::vector<TensorView> v;
  for (std::size_t l = 0; l < weight.size(); ++l) {
    v.push_back(weight_grad[l]);
    v.push_back(bias_grad[l]);
  }
  return v;
}

void FusedMLP::forward(const TensorView& x, const TensorView& y, const Stream* stream) {
  constexpr const char* op = "FusedMLP::forward";
  checks::tensor(op, "x", x, 2);
  FK_CHECK_ARG(x.size(1) == in_, op, "x", fmt::format("[batch, {}]", in_), x.shape().str());
  const std::int64_t n_hidden = static_cast<std::int64_t>(weight.size()) - 1;
  saved_hidden_ = Tensor::empty({n_hidden, x.size(0), hidden_}, weight[0].dtype(), weight[0].device(), stream);
  fused_mlp_forward_train({x, layers(), y, saved_hidden_}, stream);  // checks x, y
  saved_x_ = keep(x, stream);
  saved_y_ = act_.back() == Activation::identity ? Tensor() : keep(y, stream);
}

void FusedMLP::backward(const TensorView& dy, const std::optional<TensorView>& dx, const Stream* stream) {
  constexpr const char* op = "FusedMLP::backward";
  FK_CHECK_ARG(saved_x_.shape().size() == 2, op, "this", "a forward before the backward", "none");
  checks::tensor(op, "dy", dy, 2);
  checks::shape_is(op, "dy", dy, Dims{saved_x_.size(0), out_});
  // y is read only when the output activation is not the identity; dy stands in otherwise.
  const TensorView y = saved_y_.shape().size() == 2 ? saved_y_.view() : dy;
  std::vector<TensorView> dw(weight_grad.begin(), weight_grad.end()), db(bias_grad.begin(), bias_grad.end());
  fused_mlp_backward({dy, saved_x_, saved_hidden_, y, layers(), dx, dw, db}, stream);
}

}  // namespace fk::nn
