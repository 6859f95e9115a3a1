#include "fusekit/nn/linear.hpp"

#include <fmt/format.h>

#include <cmath>

#include "fusekit/ops/gemm.hpp"
#include "nn/module_util.hpp"
#include "ops/op_checks.hpp"

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

}  // namespace

Linear::Linear(std::int64_t in, std::int64_t out, LinearOptions options, DType dtype, Device device,
               RandomParams init)
    : options_(options) {
  constexpr const char* op = "nn::Linear";
  FK_CHECK_ARG(in >= 1 && out >= 1, op, "in/out", "sizes >= 1", fmt::format("{} -> {}", in, out));
  FK_CHECK_ARG(options.act == Activation::identity || options.act == Activation::relu ||
                   options.act == Activation::gelu_tanh,
               op, "act", "identity, relu or gelu_tanh (the GEMM epilogues)", std::string(activation_name(options.act)));
  FK_CHECK_ARG(dtype == DType::f32 || dtype == DType::bf16 || dtype == DType::f16, op, "dtype", "f32, bf16 or f16",
               std::string(dtype_name(dtype)));
  Tensor w = Tensor::empty({out, in}, DType::f32, Device::cpu()), b = Tensor::empty({out}, DType::f32, Device::cpu());
  fill_normal(w, 0.0f, static_cast<float>(std::sqrt(2.0 / static_cast<double>(in + out))), init);
  fill_normal(b, 0.0f, static_cast<float>(std::sqrt(1.0 / static_cast<double>(out))),
              {init.seed, init.subsequence + kBiasStream});
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
  weight = place(w);
  bias = place(b);
  weight_grad = Tensor::empty({out, in}, dtype, device);
  bias_grad = Tensor::empty({out}, dtype, device);
}

void Linear::forward(const TensorView& x, const TensorView& y, const Stream* stream) {
  constexpr const char* op = "nn::Linear::forward";
  detail::check_layer_input(op, x, weight, in());
  checks::companion(op, "y", y, weight, {x.size(0), out()});
  GemmParams p;
  p.trans_b = Trans::t;
  p.epilogue = forward_epilogue(options_.act);
  p.allow_tf32 = options_.allow_tf32;
  std::optional<TensorView> aux;
  if (options_.act == Activation::gelu_tanh) {
    if (preact_.shape() != y.shape()) preact_ = Tensor::empty(y.shape(), y.dtype(), y.device(), stream);
    aux = preact_.view();
  }
  gemm({x, weight, y, bias.view(), aux, std::nullopt}, p, stream);
}

void Linear::backward(const TensorView& x, const TensorView& y, const TensorView& dy, const std::optional<TensorView>& dx,
                      const Stream* stream) {
  constexpr const char* op = "nn::Linear::backward";
  detail::check_layer_input(op, x, weight, in());
  const Dims out_shape{x.size(0), out()};
  checks::companion(op, "y", y, weight, out_shape);
  checks::companion(op, "dy", dy, weight, out_shape);
  if (dx) {
    checks::companion(op, "dx", *dx, weight, x.shape());
    FK_CHECK_ARG(!checks::overlaps(*dx, dy), op, "dx", "memory that does not overlap dy", "an overlapping tensor");
  }
  const bool gelu = options_.act == Activation::gelu_tanh;
  if (gelu) checks::shape_is(op, "y", preact_, out_shape);  // the forward of this batch kept z
  // dz = dy ⊙ act'(z) in place, db = column sums of dz: one pass.
  bias_act_backward({dy, gelu ? preact_.view() : y, gelu ? SavedForBackward::preactivation : SavedForBackward::output,
                     dy, std::nullopt, bias_grad.view()},
                    {options_.act, 1.0f}, stream);
  matmul(dy, x, weight_grad, Trans::t, Trans::n, stream, options_.allow_tf32);  // dW = dzᵀ x
  if (dx) matmul(dy, weight, *dx, Trans::n, Trans::n, stream, options_.allow_tf32);  // dx = dz W
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

void MLP::forward(const TensorView& x, const TensorView& y, const Stream* stream) {
  const std::int64_t b = x.rank() == 2 ? x.size(0) : 0;
  const std::size_t n = layers.size();
  hidden_.resize(n - 1);
  input_ = x;
  for (std::size_t l = 0; l + 1 < n; ++l) {
    const Dims shape{b, layers[l].out()};
    if (hidden_[l].shape() != shape) hidden_[l] = Tensor::empty(shape, layers[l].weight.dtype(), layers[l].weight.device(), stream);
  }
  for (std::size_t l = 0; l < n; ++l)
    layers[l].forward(l == 0 ? x : hidden_[l - 1].view(), l + 1 == n ? y : hidden_[l].view(), stream);
}

void MLP::backward(const TensorView& y, const TensorView& dy, const std::optional<TensorView>& dx, const Stream* stream) {
  const std::size_t n = layers.size();
  grad_.resize(n - 1);
  for (std::size_t l = 0; l + 1 < n; ++l)
    if (grad_[l].shape() != hidden_[l].shape())
      grad_[l] = Tensor::empty(hidden_[l].shape(), hidden_[l].dtype(), hidden_[l].device(), stream);
  for (std::size_t i = n; i-- > 0;) {
    const TensorView in = i == 0 ? input_ : hidden_[i - 1].view();
    const TensorView out = i + 1 == n ? y : hidden_[i].view();
    const TensorView g = i + 1 == n ? dy : grad_[i].view();
    std::optional<TensorView> gin = dx;
    if (i > 0) gin = grad_[i - 1].view();
    layers[i].backward(in, out, g, gin, stream);
  }
}

}  // namespace fk::nn
