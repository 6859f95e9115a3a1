// The spec of the pointwise family: plain loops, double arithmetic, one rounding to the dtype at
// each store; every [rows, cols] tensor is addressed through its own row stride. It is also the
// CPU backend.
#include <cmath>
#include <numbers>
#include <vector>

#include "fusekit/core/error.hpp"
#include "ops/common/reference_io.hpp"
#include "fusekit/ops/pointwise.hpp"

namespace fk::reference {
namespace {

constexpr double kSqrt2OverPi = 0.7978845608028654;  // sqrt(2/pi)
constexpr double kGeluC = 0.044715;

double sigmoid(double z) { return 1.0 / (1.0 + std::exp(-z)); }

// act'(z) expressed through y = act(z), for the activations where that is possible.
double grad_from_output(Activation act, double y) {
  switch (act) {
    case Activation::identity: return 1.0;
    case Activation::relu: return y > 0 ? 1.0 : 0.0;
    case Activation::sigmoid: return y * (1.0 - y);
    case Activation::tanh: return 1.0 - y * y;
    default: throw_internal("grad_from_output: activation needs the pre-activation");
  }
}

// The flat offset of element (i, j) of a [rows, cols] view with unit inner stride.
std::int64_t at(const TensorView& t, std::int64_t i, std::int64_t j) { return i * t.strides()[0] + j; }

}  // namespace

double activation(Activation act, double z) {
  switch (act) {
    case Activation::identity: return z;
    case Activation::relu: return std::isnan(z) ? z : (z > 0 ? z : 0.0);
    case Activation::sigmoid: return sigmoid(z);
    case Activation::tanh: return std::tanh(z);
    case Activation::gelu_tanh: return 0.5 * z * (1.0 + std::tanh(kSqrt2OverPi * (z + kGeluC * z * z * z)));
    case Activation::gelu_erf: return 0.5 * z * (1.0 + std::erf(z / std::numbers::sqrt2));
    case Activation::silu: return z * sigmoid(z);
  }
  throw_internal("activation: unknown activation");
}

double activation_grad(Activation act, double z) {
  switch (act) {
    case Activation::identity: return 1.0;
    case Activation::relu: return z > 0 ? 1.0 : 0.0;
    case Activation::sigmoid: { const double s = sigmoid(z); return s * (1.0 - s); }
    case Activation::tanh: { const double t = std::tanh(z); return 1.0 - t * t; }
    case Activation::gelu_tanh: {
      const double t = std::tanh(kSqrt2OverPi * (z + kGeluC * z * z * z));
      return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * kSqrt2OverPi * (1.0 + 3.0 * kGeluC * z * z);
    }
    case Activation::gelu_erf: {
      const double pdf = std::exp(-0.5 * z * z) / std::sqrt(2.0 * std::numbers::pi);
      return 0.5 * (1.0 + std::erf(z / std::numbers::sqrt2)) + z * pdf;
    }
    case Activation::silu: { const double s = sigmoid(z); return s * (1.0 + z * (1.0 - s)); }
  }
  throw_internal("activation_grad: unknown activation");
}

void bias_act_forward(const BiasActForwardArgs& a, const BiasActParams& p) {
  const std::int64_t rows = a.x.size(0), cols = a.x.size(1);
  for (std::int64_t i = 0; i < rows; ++i) {
    for (std::int64_t j = 0; j < cols; ++j) {
      // z is rounded to float, as the kernels hold it, before the activation.
      double z = load(a.x, at(a.x, i, j));
      if (a.r) z += static_cast<double>(p.alpha) * load(*a.r, at(*a.r, i, j));
      if (a.bias) z += load(*a.bias, j);
      z = static_cast<float>(z);
      if (a.preact) store(*a.preact, at(*a.preact, i, j), z);
      store(a.y, at(a.y, i, j), activation(p.act, z));
    }
  }
}

void bias_act_backward(const BiasActBackwardArgs& a, const BiasActParams& p) {
  const std::int64_t rows = a.dy.size(0), cols = a.dy.size(1);
  std::vector<double> db(a.dbias ? static_cast<std::size_t>(cols) : 0, 0.0);
  for (std::int64_t i = 0; i < rows; ++i) {
    for (std::int64_t j = 0; j < cols; ++j) {
      const double s = load(a.saved, at(a.saved, i, j));
      const double g = a.saved_kind == SavedForBackward::output ? grad_from_output(p.act, s)
                                                                : activation_grad(p.act, s);
      // dz is rounded to float, as the kernels hold it; dx, dr and db all derive from it.
      const double dz = static_cast<float>(load(a.dy, at(a.dy, i, j)) * g);
      store(a.dx, at(a.dx, i, j), dz);
      if (a.dr) store(*a.dr, at(*a.dr, i, j), static_cast<double>(p.alpha) * dz);
      if (a.dbias) db[static_cast<std::size_t>(j)] += dz;
    }
  }
  if (a.dbias)
    for (std::int64_t j = 0; j < cols; ++j) store(*a.dbias, j, db[static_cast<std::size_t>(j)]);
}

namespace {

// One of q, k through the rotation (forward) or its transpose (backward). x and y may be the same
// view: both halves of an element pair are read before either is written.
void rope_apply(const TensorView& x, const TensorView& cos, const TensorView& sin, const TensorView& y,
                bool backward) {
  const std::int64_t batch = x.size(0), heads = x.size(1), seq = x.size(2), half = x.size(3) / 2;
  const bool per_batch = cos.rank() == 3 && cos.size(0) > 1;
  // cos and sin as [B or 1, T, D]: a rank-2 [T, D] has no batch dimension to stride over.
  const auto table_offset = [&](const TensorView& t, std::int64_t b, std::int64_t s) {
    const int r = t.rank();
    return (per_batch ? b * t.strides()[0] : 0) + s * t.strides()[r - 2];
  };
  const auto offset4 = [](const TensorView& t, std::int64_t b, std::int64_t h, std::int64_t s) {
    return b * t.strides()[0] + h * t.strides()[1] + s * t.strides()[2];
  };
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t h = 0; h < heads; ++h)
      for (std::int64_t s = 0; s < seq; ++s) {
        const std::int64_t xo = offset4(x, b, h, s), yo = offset4(y, b, h, s);
        const std::int64_t co = table_offset(cos, b, s), so = table_offset(sin, b, s);
        for (std::int64_t j = 0; j < half; ++j) {
          const double x1 = load(x, xo + j), x2 = load(x, xo + half + j);
          const double c1 = load(cos, co + j), c2 = load(cos, co + half + j);
          const double s1 = load(sin, so + j), s2 = load(sin, so + half + j);
          const double y1 = backward ? x1 * c1 + x2 * s2 : x1 * c1 - x2 * s1;
          const double y2 = backward ? x2 * c2 - x1 * s1 : x2 * c2 + x1 * s2;
          store(y, yo + j, y1);
          store(y, yo + half + j, y2);
        }
      }
}

}  // namespace

void rope_forward(const RopeArgs& a) {
  rope_apply(a.q, a.cos, a.sin, a.q_out, false);
  rope_apply(a.k, a.cos, a.sin, a.k_out, false);
}

void rope_backward(const RopeArgs& a) {
  rope_apply(a.q, a.cos, a.sin, a.q_out, true);
  rope_apply(a.k, a.cos, a.sin, a.k_out, true);
}

}  // namespace fk::reference
