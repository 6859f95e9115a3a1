#include "fusekit/nn/glu.hpp"

#include <fmt/format.h>

#include <cmath>

#include "fusekit/core/checks.hpp"
#include "fusekit/core/random.hpp"
#include "fusekit/core/stream.hpp"
#include "fusekit/ops/gemm.hpp"
#include "fusekit/ops/pointwise.hpp"
#include "nn/module_util.hpp"

namespace fk::nn {

using detail::keep;
using detail::uniform;

GLUFeedForward::GLUFeedForward(std::int64_t d_in, std::int64_t hidden, std::int64_t d_out, GluOptions opt, DType dtype,
                               Device device, std::uint64_t seed)
    : d_in_(d_in), hidden_(hidden), d_out_(d_out), opt_(opt) {
  constexpr const char* op = "GLUFeedForward";
  FK_CHECK_ARG(d_in > 0 && hidden > 0 && d_out > 0, op, "sizes", "positive d_in, hidden, d_out",
               fmt::format("{}, {}, {}", d_in, hidden, d_out));
  checks::dtype_in(op, "dtype", Tensor::empty({0}, dtype, Device::cpu()), {DType::f32, DType::bf16, DType::f16});
  const float b1 = 1.0f / std::sqrt(static_cast<float>(d_in)), b2 = 1.0f / std::sqrt(static_cast<float>(hidden));
  weight1 = glu_prepare_weight(uniform({2 * hidden, d_in}, b1, dtype, device, {seed, 0}));
  bias1 = glu_prepare_weight(uniform({2 * hidden}, b1, dtype, device, {seed, 1}));
  weight2 = uniform({d_out, hidden}, b2, dtype, device, {seed, 2});
  bias2 = uniform({d_out}, b2, dtype, device, {seed, 3});
  weight1_grad = Tensor::empty(weight1.shape(), dtype, device);
  bias1_grad = Tensor::empty(bias1.shape(), dtype, device);
  weight2_grad = Tensor::empty(weight2.shape(), dtype, device);
  bias2_grad = Tensor::empty(bias2.shape(), dtype, device);
}

void GLUFeedForward::forward(const TensorView& x, const TensorView& y, const Stream* stream) {
  constexpr const char* op = "GLUFeedForward::forward";
  checks::tensor(op, "x", x, 2);
  FK_CHECK_ARG(x.size(1) == d_in_, op, "x", fmt::format("[T, {}]", d_in_), x.shape().str());
  checks::shape_is(op, "y", y, Dims{x.size(0), d_out_});
  saved_h_ = Tensor::empty({x.size(0), hidden_}, weight1.dtype(), weight1.device(), stream);
  glu_forward({x, weight1, bias1.view(), saved_h_}, opt_, stream);  // checks x's dtype and device
  matmul(saved_h_, weight2, y, Trans::n, Trans::t, stream, opt_.allow_tf32);
  bias_act_forward({y, std::nullopt, bias2.view(), y, std::nullopt}, {Activation::identity, 1.0f}, stream);
  saved_x_ = keep(x, stream);
}

void GLUFeedForward::backward(const TensorView& dy, const std::optional<TensorView>& dx, const Stream* stream) {
  constexpr const char* op = "GLUFeedForward::backward";
  FK_CHECK_ARG(saved_h_.numel() > 0 || saved_x_.shape().size() == 2, op, "this", "a forward before the backward",
               "none");
  checks::tensor(op, "dy", dy, 2);
  checks::same_dtype(op, "dy", dy, weight2);
  checks::shape_is(op, "dy", dy, Dims{saved_h_.size(0), d_out_});
  const std::int64_t t = dy.size(0);
  matmul(dy, saved_h_, weight2_grad, Trans::t, Trans::n, stream, opt_.allow_tf32);  // [d_out, H]
  // db2 = column sums of dy: the identity's backward, whose dx is a scratch copy.
  Tensor scratch = Tensor::empty(dy.shape(), dy.dtype(), dy.device(), stream);
  bias_act_backward({dy, dy, SavedForBackward::output, scratch, std::nullopt, bias2_grad.view()},
                    {Activation::identity, 1.0f}, stream);
  Tensor dh = Tensor::empty({t, hidden_}, dy.dtype(), dy.device(), stream);
  matmul(dy, weight2, dh, Trans::n, Trans::n, stream, opt_.allow_tf32);  // [T, H]
  glu_backward({dh, saved_x_, weight1, bias1.view(), dx, weight1_grad.view(), bias1_grad.view()}, opt_, stream);
}

}  // namespace fk::nn
