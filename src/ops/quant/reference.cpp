// The spec of the quant family: plain loops over the format of docs/quant-format.md, using the
// same float arithmetic as the kernels (quant_math.hpp). It is also the CPU backend.
#include <algorithm>
#include <cmath>
#include <vector>

#include "fusekit/ops/quant.hpp"
#include "ops/common/reference_io.hpp"
#include "quant_math.hpp"

namespace fk::reference {
namespace {

quant::Stats load_stats(const PackedView& p, std::int64_t row, std::int64_t g) {
  const std::int64_t i = row * p.groups() + g;
  return quant::make_stats(static_cast<float>(load(p.scale, i)), static_cast<float>(load(p.min, i)));
}

}  // namespace

void pack(const TensorView& x, const PackedView& out, const PackParams& p) {
  const std::int64_t rows = out.rows, cols = out.cols, groups = out.groups();
  const int vpw = 32 / p.bits, wpg = out.words_per_group();
  const bool bf16_stats = out.scale.dtype() == DType::bf16;
  auto* words = out.words.data_as<std::uint32_t>();
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t g = 0; g < groups; ++g) {
      const std::int64_t c0 = g * p.group, c1 = std::min(cols, c0 + p.group);
      float lo = INFINITY, hi = -INFINITY;
      bool nonfinite = false;
      for (std::int64_t c = c0; c < c1; ++c) {
        const float v = static_cast<float>(load(x, r * cols + c));
        nonfinite |= !quant::is_finite(v);
        lo = std::min(lo, v);
        hi = std::max(hi, v);
      }
      const quant::Stats st = quant::group_stats(lo, hi, nonfinite, p.bits, bf16_stats);
      store(out.scale, r * groups + g, st.scale);
      store(out.min, r * groups + g, st.min);
      std::uint32_t* w = words + (r * groups + g) * wpg;
      std::fill(w, w + wpg, 0u);
      for (std::int64_t c = c0; c < c1; ++c) {
        const float v = static_cast<float>(load(x, r * cols + c));
        const float u = p.rounding == Rounding::stochastic
                            ? quant::stochastic_u(p.seed, p.offset, static_cast<std::uint64_t>(r * cols + c))
                            : 0.0f;
        const std::uint32_t q = nonfinite ? 0u : quant::quantize(v, st, p.bits, p.rounding == Rounding::stochastic, u);
        const std::int64_t j = c - c0;
        w[j / vpw] |= q << ((j % vpw) * p.bits);
      }
    }
  }
}

void unpack(const PackedView& p, const TensorView& out) {
  const int vpw = 32 / p.bits, wpg = p.words_per_group();
  const std::uint32_t mask = (1u << p.bits) - 1u;
  const auto* words = p.words.data_as<const std::uint32_t>();
  for (std::int64_t r = 0; r < p.rows; ++r) {
    for (std::int64_t c = 0; c < p.cols; ++c) {
      const std::int64_t g = c / p.group, j = c % p.group;
      const std::uint32_t w = words[(r * p.groups() + g) * wpg + j / vpw];
      const std::uint32_t q = (w >> ((j % vpw) * p.bits)) & mask;
      store(out, r * p.cols + c, quant::dequantize(q, load_stats(p, r, g)));
    }
  }
}

void relu_forward_packed(const TensorView& x, const TensorView& y, const TensorView& mask) {
  auto* m = mask.data_as<std::uint32_t>();
  std::fill(m, m + mask.numel(), 0u);
  for (std::int64_t i = 0; i < x.numel(); ++i) {
    const double v = load(x, i);
    store(y, i, (v > 0 || std::isnan(v)) ? v : 0.0);
    if (v > 0) m[i / 32] |= 1u << (i % 32);
  }
}

void relu_backward_packed(const TensorView& dy, const TensorView& mask, const TensorView& dx) {
  const auto* m = mask.data_as<const std::uint32_t>();
  for (std::int64_t i = 0; i < dy.numel(); ++i) store(dx, i, ((m[i / 32] >> (i % 32)) & 1u) ? load(dy, i) : 0.0);
}

void weight_grad_from_packed(const TensorView& dy, const PackedView& x, const TensorView& dw,
                             const WeightGradParams& p) {
  const std::int64_t k_total = dy.size(0), cout = dy.size(1), cin = x.cols;
  // x̂ once, in fp32 as the format defines it, then dW = beta * dW + dyᵀ x̂ in double.
  Tensor xhat = Tensor::empty({x.rows, x.cols}, DType::f32, Device::cpu());
  reference::unpack(x, xhat);
  const float* xh = xhat.data_as<float>();
  std::vector<double> acc(static_cast<std::size_t>(cout * cin), 0.0);
  for (std::int64_t k = 0; k < k_total; ++k)
    for (std::int64_t o = 0; o < cout; ++o) {
      const double g = load(dy, k * cout + o);
      double* row = acc.data() + o * cin;
      for (std::int64_t c = 0; c < cin; ++c) row[c] += g * xh[k * cin + c];
    }
  for (std::int64_t i = 0; i < cout * cin; ++i) {
    const double prev = p.beta != 0.0f ? static_cast<double>(p.beta) * load(dw, i) : 0.0;
    store(dw, i, prev + acc[static_cast<std::size_t>(i)]);
  }
}

}  // namespace fk::reference
