// The spec of the glu family: sigmoid(l) * tanh(r) and the other GLU variants in plain loops, double
// arithmetic, PyTorch weight layout (w [2N, K], rows 0..N-1 the left half), one rounding to the
// dtype at each store.
#include <cmath>
#include <numbers>
#include <vector>

#include "fusekit/core/error.hpp"
#include "fusekit/ops/glu.hpp"
#include "fusekit/ops/pointwise.hpp"
#include "ops/common/reference_io.hpp"

namespace fk::reference {
namespace {

// The gate's activation g and the value's activation v: glu(l, r) = g(l) * v(r).
struct GateValue {
  Activation gate, value;
};

GateValue parts(GluKind k) {
  switch (k) {
    case GluKind::sigmoid_tanh: return {Activation::sigmoid, Activation::tanh};
    case GluKind::swiglu: return {Activation::silu, Activation::identity};
    case GluKind::geglu_tanh: return {Activation::identity, Activation::gelu_tanh};
    case GluKind::geglu_erf: return {Activation::identity, Activation::gelu_erf};
    case GluKind::reglu: return {Activation::relu, Activation::identity};
  }
  throw_internal("glu: unknown kind");
}

// C = x wᵀ + b in double, [M, 2N], PyTorch layout.
std::vector<double> preactivations(const TensorView& x, const TensorView& w, const std::optional<TensorView>& b) {
  const std::int64_t m = x.size(0), k = x.size(1), n2 = w.size(0);
  std::vector<double> c(static_cast<std::size_t>(m * n2));
  std::vector<double> xr(static_cast<std::size_t>(k));
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t kk = 0; kk < k; ++kk) xr[kk] = load(x, i * k + kk);
    for (std::int64_t j = 0; j < n2; ++j) {
      double s = b ? load(*b, j) : 0.0;
      for (std::int64_t kk = 0; kk < k; ++kk) s += xr[kk] * load(w, j * k + kk);
      c[i * n2 + j] = s;
    }
  }
  return c;
}

}  // namespace

double glu(GluKind k, double l, double r) {
  const GateValue p = parts(k);
  return activation(p.gate, l) * activation(p.value, r);
}

double glu_dl(GluKind k, double l, double r) {
  const GateValue p = parts(k);
  return activation_grad(p.gate, l) * activation(p.value, r);
}

double glu_dr(GluKind k, double l, double r) {
  const GateValue p = parts(k);
  return activation(p.gate, l) * activation_grad(p.value, r);
}

void glu_forward(const GluForwardArgs& a, const GluOptions& opt) {
  const std::int64_t m = a.x.size(0), n = a.out.size(1);
  const std::vector<double> c = preactivations(a.x, a.w, a.bias);
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j)
      store(a.out, i * n + j, glu(opt.kind, c[i * 2 * n + j], c[i * 2 * n + n + j]));
  if (a.preact)
    for (std::int64_t i = 0; i < m * 2 * n; ++i) store(*a.preact, i, c[static_cast<std::size_t>(i)]);
}

namespace {

// dC = [dy dglu/dl, dy dglu/dr] from C (both [M, 2N], PyTorch layout), then dx = dC w,
// dw = dCᵀ x, db = the column sums of dC, each where asked for.
void backward_from(const std::vector<double>& c, const TensorView& dy, const TensorView& x, const TensorView& w,
                   const std::optional<TensorView>& dx, const std::optional<TensorView>& dw,
                   const std::optional<TensorView>& dbias, const GluOptions& opt) {
  const std::int64_t m = x.size(0), k = x.size(1), n = dy.size(1), n2 = 2 * n;
  std::vector<double> dc(static_cast<std::size_t>(m * n2));
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      const double g = load(dy, i * n + j), l = c[i * n2 + j], r = c[i * n2 + n + j];
      dc[i * n2 + j] = g * glu_dl(opt.kind, l, r);
      dc[i * n2 + n + j] = g * glu_dr(opt.kind, l, r);
    }
  if (dx)
    for (std::int64_t i = 0; i < m; ++i)
      for (std::int64_t kk = 0; kk < k; ++kk) {
        double s = 0;
        for (std::int64_t j = 0; j < n2; ++j) s += dc[i * n2 + j] * load(w, j * k + kk);
        store(*dx, i * k + kk, s);
      }
  if (dw)
    for (std::int64_t j = 0; j < n2; ++j)
      for (std::int64_t kk = 0; kk < k; ++kk) {
        double s = 0;
        for (std::int64_t i = 0; i < m; ++i) s += dc[i * n2 + j] * load(x, i * k + kk);
        store(*dw, j * k + kk, s);
      }
  if (dbias)
    for (std::int64_t j = 0; j < n2; ++j) {
      double s = 0;
      for (std::int64_t i = 0; i < m; ++i) s += dc[i * n2 + j];
      store(*dbias, j, s);
    }
}

}  // namespace

void glu_backward(const GluBackwardArgs& a, const GluOptions& opt) {
  backward_from(preactivations(a.x, a.w, a.bias), a.dy, a.x, a.w, a.dx, a.dw, a.dbias, opt);
}

void glu_activate(const GluActivateArgs& a, const GluOptions& opt) {
  const std::int64_t m = a.out.size(0), n = a.out.size(1);
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j)
      store(a.out, i * n + j, glu(opt.kind, load(a.preact, i * 2 * n + j), load(a.preact, i * 2 * n + n + j)));
}

void glu_preact_grad(const GluPreactGradArgs& a, const GluOptions& opt) {
  const std::int64_t m = a.dy.size(0), n = a.dy.size(1);
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      const double g = load(a.dy, i * n + j), l = load(a.preact, i * 2 * n + j), r = load(a.preact, i * 2 * n + n + j);
      store(a.dpreact, i * 2 * n + j, g * glu_dl(opt.kind, l, r));
      store(a.dpreact, i * 2 * n + n + j, g * glu_dr(opt.kind, l, r));
    }
  if (a.out) reference::glu_activate(GluActivateArgs{a.preact, *a.out}, opt);
}

void glu_backward_from_preact(const GluBackwardFromPreactArgs& a, const GluOptions& opt) {
  std::vector<double> c(static_cast<std::size_t>(a.preact.numel()));
  for (std::int64_t i = 0; i < a.preact.numel(); ++i) c[static_cast<std::size_t>(i)] = load(a.preact, i);
  backward_from(c, a.dy, a.x, a.w, a.dx, a.dw, a.dbias, opt);
  if (a.out) reference::glu_activate(GluActivateArgs{a.preact, *a.out}, opt);
}

}  // namespace fk::reference
