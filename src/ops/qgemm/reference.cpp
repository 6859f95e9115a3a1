// The spec of the qgemm family: plain loops over the packed layout (qgemm_layout.hpp). It is also
// the CPU backend, and quantize_weights' only implementation (a one-time step at model load).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "fusekit/ops/qgemm.hpp"
#include "ops/common/reference_io.hpp"
#include "qgemm_layout.hpp"

namespace fk::reference {
namespace {

// The smallest value of `dtype` (f16 or bf16) that is >= v >= 0.
double round_up_to(DType dtype, double v) {
  const float f = static_cast<float>(v);
  if (dtype == DType::f16) {
    f16 h(f);
    if (static_cast<double>(static_cast<float>(h)) < v) h.bits = static_cast<std::uint16_t>(h.bits + 1);
    return static_cast<float>(h);
  }
  bf16 b(f);
  if (static_cast<double>(static_cast<float>(b)) < v) b.bits = static_cast<std::uint16_t>(b.bits + 1);
  return static_cast<float>(b);
}

}  // namespace

QuantizedWeight quantize_weights(const TensorView& w, int group) {
  const std::int64_t n_rows = w.size(0), k = w.size(1);
  QuantizedWeight qw = QuantizedWeight::zeros(n_rows, k, group, w.dtype(), Device::cpu());
  const std::int64_t groups = qw.groups(), n_pad = qw.n_pad();
  auto* words = qw.packed.data_as<std::uint32_t>();
  auto* zeros = qw.zero.data_as<std::uint32_t>();
  for (std::int64_t n = 0; n < n_rows; ++n) {
    for (std::int64_t g = 0; g < groups; ++g) {
      const std::int64_t k0 = g * group, k1 = std::min(k, k0 + group);
      double lo = 0.0, hi = 0.0;  // the range always holds 0, so that z is a valid 4-bit value
      for (std::int64_t c = k0; c < k1; ++c) {
        const double v = load(w, n * k + c);
        FK_CHECK_ARG(std::isfinite(v), "quantize_weights", "w", "finite values",
                     "a NaN or an infinity in row " + std::to_string(n));
        lo = std::min(lo, v);
        hi = std::max(hi, v);
      }
      // s rounded up, so that (hi - lo) / s <= 15 after the rounding to the dtype.
      const double s = round_up_to(w.dtype(), (hi - lo) / 15.0);
      store(qw.scale, g * n_pad + n, s);
      const int z = s > 0 ? static_cast<int>(std::clamp(std::nearbyint(-lo / s), 0.0, 15.0)) : 0;
      zeros[g * (n_pad / 8) + n / 8] |= static_cast<std::uint32_t>(z) << (4 * (n % 8));
      for (std::int64_t c = k0; c < k1; ++c) {
        const double v = load(w, n * k + c);
        const int q = s > 0 ? static_cast<int>(std::clamp(std::nearbyint(v / s) + z, 0.0, 15.0)) : 0;
        const qgemm_layout::Slot sl = qgemm_layout::slot_of(n, c, n_pad);
        words[sl.word] |= static_cast<std::uint32_t>(q) << sl.shift;
      }
    }
  }
  return qw;
}

void dequantize_weights(const QuantizedWeight& qw, const TensorView& out) {
  const std::int64_t n_pad = qw.n_pad(), groups = qw.groups();
  const auto* words = qw.packed.data_as<const std::uint32_t>();
  const auto* zeros = qw.zero.data_as<const std::uint32_t>();
  for (std::int64_t n = 0; n < qw.n; ++n) {
    for (std::int64_t c = 0; c < qw.k; ++c) {
      const std::int64_t g = std::min(c / qw.group, groups - 1);
      const qgemm_layout::Slot sl = qgemm_layout::slot_of(n, c, n_pad);
      const int q = static_cast<int>((words[sl.word] >> sl.shift) & 0xFu);
      const int z = static_cast<int>((zeros[g * (n_pad / 8) + n / 8] >> (4 * (n % 8))) & 0xFu);
      // s * (q - z) is exact in fp32 (11 + 5 significant bits); one rounding to the dtype.
      const float s = static_cast<float>(load(qw.scale, g * n_pad + n));
      store(out, n * qw.k + c, s * static_cast<float>(q - z));
    }
  }
}

void qgemm(const TensorView& x, const QuantizedWeight& qw, const TensorView& y) {
  const std::int64_t m = x.size(0), k = qw.k, n = qw.n;
  Tensor w = Tensor::empty({n, k}, qw.dtype, Device::cpu());
  reference::dequantize_weights(qw, w);
  std::vector<double> wf(static_cast<std::size_t>(n * k));
  for (std::int64_t i = 0; i < n * k; ++i) wf[static_cast<std::size_t>(i)] = load(w, i);
  std::vector<double> xr(static_cast<std::size_t>(k));
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t c = 0; c < k; ++c) xr[static_cast<std::size_t>(c)] = load(x, i * k + c);
    for (std::int64_t j = 0; j < n; ++j) {
      double acc = 0.0;
      for (std::int64_t c = 0; c < k; ++c) acc += xr[static_cast<std::size_t>(c)] * wf[static_cast<std::size_t>(j * k + c)];
      store(y, i * n + j, acc);
    }
  }
}

}  // namespace fk::reference
