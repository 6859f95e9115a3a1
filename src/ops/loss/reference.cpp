// The spec of the loss family: plain loops on host tensors in double, one rounding to the dtype
// at each store. It is also the CPU backend.
#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <vector>

#include "fusekit/core/error.hpp"
#include "fusekit/ops/loss.hpp"
#include "ops/common/reference_io.hpp"

namespace fk::reference {

void linear_cross_entropy(const LinearCrossEntropyArgs& args, const LinearCrossEntropyParams& p) {
  const std::int64_t n = args.h.size(0), hd = args.h.size(1), v = args.w.size(0);
  const std::int64_t* targets = args.targets.data_as<std::int64_t>();
  std::int64_t count = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t t = targets[i];
    if (t == p.ignore_index) continue;
    if (t < 0 || t >= v)
      throw Error("linear_cross_entropy", "targets",
                  fmt::format("class indices in [0, {}) or ignore_index {}", v, p.ignore_index),
                  fmt::format("{} at row {}", t, i));
    ++count;
  }
  const double denom = p.reduction == LossReduction::mean ? static_cast<double>(count) : 1.0;
  const double eps = p.label_smoothing, zeta = p.z_loss;

  std::vector<double> z(static_cast<std::size_t>(v)), g(static_cast<std::size_t>(v));
  std::vector<double> dh(static_cast<std::size_t>(hd));
  std::vector<double> dw(args.dw ? static_cast<std::size_t>(v * hd) : 0, 0.0);
  std::vector<double> dbias(args.dbias ? static_cast<std::size_t>(v) : 0, 0.0);
  double total = 0.0;
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t t = targets[i];
    const bool ignored = t == p.ignore_index;
    if (!ignored) {
      double zmax = -std::numeric_limits<double>::infinity(), zsum = 0.0;
      for (std::int64_t j = 0; j < v; ++j) {
        double acc = args.bias ? load(*args.bias, j) : 0.0;
        for (std::int64_t k = 0; k < hd; ++k) acc += load(args.h, i * hd + k) * load(args.w, j * hd + k);
        z[static_cast<std::size_t>(j)] = acc;
        zmax = std::max(zmax, acc);
        zsum += acc;
      }
      double sum_exp = 0.0;
      for (std::int64_t j = 0; j < v; ++j) sum_exp += std::exp(z[static_cast<std::size_t>(j)] - zmax);
      const double lse = zmax + std::log(sum_exp);
      total += (1.0 - eps) * (lse - z[static_cast<std::size_t>(t)]) + eps * (lse - zsum / static_cast<double>(v)) +
               zeta * lse * lse;
      for (std::int64_t j = 0; j < v; ++j) {
        const double prob = std::exp(z[static_cast<std::size_t>(j)] - lse);
        g[static_cast<std::size_t>(j)] =
            (prob * (1.0 + 2.0 * zeta * lse) - (j == t ? 1.0 - eps : 0.0) - eps / static_cast<double>(v)) / denom;
      }
    }
    if (args.dh) {
      for (std::int64_t k = 0; k < hd; ++k) {
        double acc = 0.0;
        if (!ignored)
          for (std::int64_t j = 0; j < v; ++j) acc += g[static_cast<std::size_t>(j)] * load(args.w, j * hd + k);
        dh[static_cast<std::size_t>(k)] = acc;
      }
      for (std::int64_t k = 0; k < hd; ++k) store(*args.dh, i * hd + k, dh[static_cast<std::size_t>(k)]);
    }
    if (ignored) continue;
    if (args.dw)
      for (std::int64_t j = 0; j < v; ++j)
        for (std::int64_t k = 0; k < hd; ++k)
          dw[static_cast<std::size_t>(j * hd + k)] += g[static_cast<std::size_t>(j)] * load(args.h, i * hd + k);
    if (args.dbias)
      for (std::int64_t j = 0; j < v; ++j) dbias[static_cast<std::size_t>(j)] += g[static_cast<std::size_t>(j)];
  }
  // 0 / 0 for a mean over no rows: NaN, as F.cross_entropy gives.
  args.loss.data_as<float>()[0] = static_cast<float>(total / denom);
  if (args.dw)
    for (std::int64_t e = 0; e < v * hd; ++e) store(*args.dw, e, dw[static_cast<std::size_t>(e)]);
  if (args.dbias)
    for (std::int64_t j = 0; j < v; ++j) store(*args.dbias, j, dbias[static_cast<std::size_t>(j)]);
}

}  // namespace fk::reference
