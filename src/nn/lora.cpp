#include "fusekit/nn/lora.hpp"

#include <fmt/format.h>

#include <cmath>

#include "fusekit/core/checks.hpp"
#include "fusekit/core/random.hpp"
#include "fusekit/core/stream.hpp"

namespace fk::nn {
namespace {

// A copy of x that outlives the caller's tensor, ordered after the work queued on `stream`.
Tensor keep(const TensorView& x, const Stream* stream) {
  if (stream != nullptr) stream->synchronize();  // copy() is ordered on the legacy stream only
  Tensor t = Tensor::empty(x.shape(), x.dtype(), x.device());
  copy(t, x);
  return t;
}

Tensor uniform(Dims shape, float bound, DType dtype, Device device, RandomParams key) {
  Tensor h = Tensor::empty(shape, dtype, Device::cpu());
  fill_uniform(h, -bound, bound, key);
  return h.copy_to(device);
}

}  // namespace

LoRALinear::LoRALinear(std::int64_t d_in, std::int64_t d_out, std::int64_t rank, LoraParams params, bool train_bias,
                       DType dtype, Device device, std::uint64_t seed)
    : d_in_(d_in), d_out_(d_out), rank_(rank), params_(params), train_bias_(train_bias) {
  constexpr const char* op = "LoRALinear";
  FK_CHECK_ARG(d_in > 0 && d_out > 0, op, "sizes", "positive d_in, d_out", fmt::format("{}, {}", d_in, d_out));
  FK_CHECK_ARG(rank >= 1 && rank <= kLoraMaxRank, op, "rank", fmt::format("1 <= r <= {}", kLoraMaxRank),
               std::to_string(rank));
  checks::dtype_in(op, "dtype", Tensor::empty({0}, dtype, Device::cpu()), {DType::f32, DType::bf16, DType::f16});
  const float bound = 1.0f / std::sqrt(static_cast<float>(d_in));
  weight = uniform({d_out, d_in}, bound, dtype, device, {seed, 0});
  bias = uniform({d_out}, bound, dtype, device, {seed, 1});
  lora_a = uniform({rank, d_in}, bound, dtype, device, {seed, 2});
  lora_b = Tensor::empty({d_out, rank}, dtype, device);
  fill(lora_b, 0.0);
  lora_a_grad = Tensor::empty(lora_a.shape(), dtype, device);
  lora_b_grad = Tensor::empty(lora_b.shape(), dtype, device);
  if (train_bias) bias_grad = Tensor::empty(bias.shape(), dtype, device);
}

void LoRALinear::forward(const TensorView& x, const TensorView& y, const Stream* stream) {
  constexpr const char* op = "LoRALinear::forward";
  checks::tensor(op, "x", x, 2);
  FK_CHECK_ARG(x.size(1) == d_in_, op, "x", fmt::format("[T, {}]", d_in_), x.shape().str());
  saved_t_ = Tensor::empty({x.size(0), rank_}, weight.dtype(), weight.device(), stream);
  if (derivative_from_output(params_.act)) {
    saved_kind_ = SavedForBackward::output;
    lora_forward({x, weight, bias.view(), lora_a, lora_b, y, saved_t_.view(), std::nullopt}, params_, stream);
    saved_ = keep(y, stream);
  } else {
    saved_kind_ = SavedForBackward::preactivation;
    saved_ = Tensor::empty({x.size(0), d_out_}, weight.dtype(), weight.device(), stream);
    lora_forward({x, weight, bias.view(), lora_a, lora_b, y, saved_t_.view(), saved_.view()}, params_, stream);
  }
  saved_x_ = keep(x, stream);
}

void LoRALinear::backward(const TensorView& dy, const std::optional<TensorView>& dx, const Stream* stream) {
  constexpr const char* op = "LoRALinear::backward";
  FK_CHECK_ARG(saved_x_.view().rank() == 2, op, "this", "a forward before the backward", "none");
  lora_backward({dy, saved_, saved_kind_, saved_x_, weight, lora_a, lora_b, saved_t_.view(), dx,
                 lora_a_grad, lora_b_grad, train_bias_ ? std::optional(bias_grad.view()) : std::nullopt},
                params_, stream);
}

}  // namespace fk::nn
