#include "fusekit/nn/compressed.hpp"

#include <fmt/format.h>

#include <cmath>

#include "fusekit/core/checks.hpp"
#include "fusekit/core/random.hpp"
#include "fusekit/core/stream.hpp"
#include "fusekit/ops/gemm.hpp"
#include "fusekit/ops/pointwise.hpp"
#include "nn/module_util.hpp"

namespace fk::nn {
namespace {

// The layer's dtype on its device: f32 on the CPU, bf16 on a GPU.
void check_layer_dtype(const char* op, DType dtype, Device device) {
  const DType want = device.is_cpu() ? DType::f32 : DType::bf16;
  FK_CHECK_ARG(dtype == want, op, "dtype", fmt::format("{} on {}", dtype_name(want), device.str()),
               std::string(dtype_name(dtype)));
}

}  // namespace

CompressedLinear::CompressedLinear(std::int64_t in, std::int64_t out, std::optional<PackParams> compress, DType dtype,
                                   Device device, std::uint64_t seed)
    : in_(in), out_(out), compress_(compress) {
  constexpr const char* op = "CompressedLinear";
  FK_CHECK_ARG(in > 0 && out > 0, op, "in/out", "positive sizes", fmt::format("{} -> {}", in, out));
  check_layer_dtype(op, dtype, device);
  const float bound = 1.0f / std::sqrt(static_cast<float>(in));
  Tensor w = Tensor::empty({out, in}, dtype, Device::cpu()), b = Tensor::empty({out}, dtype, Device::cpu());
  fill_uniform(w, -bound, bound, {seed, 0});
  fill_uniform(b, -bound, bound, {seed, 1});
  weight = w.copy_to(device);
  bias = b.copy_to(device);
  weight_grad = Tensor::empty({out, in}, dtype, device);
  bias_grad = Tensor::empty({out}, dtype, device);
}

void CompressedLinear::forward(const TensorView& x, const TensorView& y, const Stream* stream) {
  constexpr const char* op = "CompressedLinear::forward";
  detail::check_layer_input(op, x, weight, in_);
  checks::shape_is(op, "y", y, Dims{x.size(0), out_});
  checks::same_dtype(op, "y", y, weight);
  matmul(x, weight, y, Trans::n, Trans::t, stream);
  bias_act_forward({y, std::nullopt, bias.view(), y, std::nullopt}, {Activation::identity, 1.0f}, stream);
  saved_uncompressed_ = x.nbytes();
  if (compress_) {
    packed_ = pack(x, *compress_, stream);
    saved_ = Tensor();
  } else {
    saved_ = Tensor::empty(x.shape(), x.dtype(), x.device(), stream);
    copy(saved_, x);
    packed_ = PackedTensor();
  }
}

void CompressedLinear::backward(const TensorView& dy, const std::optional<TensorView>& dx, const Stream* stream) {
  constexpr const char* op = "CompressedLinear::backward";
  const std::int64_t n = compress_ ? packed_.rows : (saved_.numel() ? saved_.size(0) : 0);
  FK_CHECK_ARG(saved_uncompressed_ > 0 || n == 0, op, "this", "a forward before the backward", "none");
  checks::tensor(op, "dy", dy, 2);
  checks::same_dtype(op, "dy", dy, weight);
  checks::shape_is(op, "dy", dy, Dims{n, out_});
  if (dx) matmul(dy, weight, *dx, Trans::n, Trans::n, stream);  // [N, out] x [out, in]
  if (compress_) {
    weight_grad_from_packed(dy, packed_.view(), weight_grad, {}, stream);
  } else {
    matmul(dy, saved_, weight_grad, Trans::t, Trans::n, stream);  // [out, N] x [N, in]
  }
  // db = column sums of dy: the identity's backward, whose dx is a scratch copy.
  Tensor scratch = Tensor::empty(dy.shape(), dy.dtype(), dy.device(), stream);
  bias_act_backward({dy, dy, SavedForBackward::output, scratch, std::nullopt, bias_grad.view()},
                    {Activation::identity, 1.0f}, stream);
}

std::size_t CompressedLinear::saved_bytes() const noexcept {
  return compress_ ? packed_.nbytes() : saved_.nbytes();
}

void CompressedReLU::forward(const TensorView& x, const TensorView& y, const Stream* stream) {
  mask_ = Tensor::empty({relu_mask_words(x.numel())}, DType::i32, x.device(), stream);
  relu_forward_packed(x, y, mask_, stream);
  saved_uncompressed_ = x.nbytes();
}

void CompressedReLU::backward(const TensorView& dy, const TensorView& dx, const Stream* stream) {
  FK_CHECK_ARG(mask_.numel() > 0 || dy.numel() == 0, "CompressedReLU::backward", "this",
               "a forward before the backward", "none");
  relu_backward_packed(dy, mask_, dx, stream);
}

void sgd_step(const TensorView& param, const TensorView& grad, float lr, const Stream* stream) {
  // param + (-lr) * grad: the pointwise op with no bias and the identity, in place.
  const TensorView p2 = param.reshape({1, param.numel()}), g2 = grad.reshape({1, grad.numel()});
  bias_act_forward({p2, g2, std::nullopt, p2, std::nullopt}, {Activation::identity, -lr}, stream);
}

}  // namespace fk::nn
