// The spec of the norm family: plain loops, double arithmetic, one rounding to the dtype at each
// store (s = x + residual is rounded to residual's dtype before it is normalized, as the kernels and
// PyTorch's `residual + hidden` do; rstd is rounded to f32, the value the backward reads). It is
// also the CPU backend.
#include <cmath>
#include <vector>

#include "fusekit/ops/norm.hpp"
#include "ops/common/reference_io.hpp"

namespace fk::reference {
namespace {

// The flat offset of element (i, j) of a [rows, cols] view with unit inner stride.
std::int64_t at(const TensorView& t, std::int64_t i, std::int64_t j) { return i * t.strides()[0] + j; }

}  // namespace

void rms_norm_forward(const RmsNormForwardArgs& a, const RmsNormParams& p) {
  const std::int64_t rows = a.x.size(0), cols = a.x.size(1);
  std::vector<double> s(static_cast<std::size_t>(cols));
  for (std::int64_t i = 0; i < rows; ++i) {
    double sum_sq = 0.0;
    for (std::int64_t j = 0; j < cols; ++j) {
      double v = load(a.x, at(a.x, i, j));
      if (a.residual) {
        v = round_to(a.residual->dtype(), v + load(*a.residual, at(*a.residual, i, j)));
        store(*a.residual_out, at(*a.residual_out, i, j), v);
      }
      s[static_cast<std::size_t>(j)] = v;
      sum_sq += v * v;
    }
    const double rstd = static_cast<float>(1.0 / std::sqrt(sum_sq / static_cast<double>(cols) + p.eps));
    store(a.rstd, i, rstd);
    for (std::int64_t j = 0; j < cols; ++j)
      store(a.out, at(a.out, i, j), s[static_cast<std::size_t>(j)] * rstd * (load(a.weight, j) + p.offset));
  }
}

void rms_norm_backward(const RmsNormBackwardArgs& a, const RmsNormParams& p) {
  const std::int64_t rows = a.dout.size(0), cols = a.dout.size(1);
  std::vector<double> dw(static_cast<std::size_t>(cols), 0.0), g(static_cast<std::size_t>(cols)),
      xhat(static_cast<std::size_t>(cols));
  for (std::int64_t i = 0; i < rows; ++i) {
    const double rstd = load(a.rstd, i);
    double dot = 0.0;
    for (std::int64_t j = 0; j < cols; ++j) {
      const auto k = static_cast<std::size_t>(j);
      const double dout = load(a.dout, at(a.dout, i, j));
      g[k] = dout * (load(a.weight, j) + p.offset);
      xhat[k] = load(a.s, at(a.s, i, j)) * rstd;
      dot += g[k] * xhat[k];
      dw[k] += dout * xhat[k];
    }
    const double mean = dot / static_cast<double>(cols);
    for (std::int64_t j = 0; j < cols; ++j) {
      const auto k = static_cast<std::size_t>(j);
      double ds = rstd * (g[k] - xhat[k] * mean);
      if (a.dresidual_out) ds += load(*a.dresidual_out, at(*a.dresidual_out, i, j));
      store(a.dx, at(a.dx, i, j), ds);
      if (a.dx_low) store(*a.dx_low, at(*a.dx_low, i, j), static_cast<double>(static_cast<float>(ds)));
    }
  }
  if (a.dweight)
    for (std::int64_t j = 0; j < cols; ++j) store(*a.dweight, j, dw[static_cast<std::size_t>(j)]);
}

}  // namespace fk::reference
