// `fusekit check`'s comparisons and test tensors (check_compare.hpp).
#include "apps/check_compare.hpp"

#include <cmath>
#include <cstring>
#include <type_traits>

namespace fk::app::check {

// ---------------------------------------------------------------------------------------------
// Comparisons
// ---------------------------------------------------------------------------------------------

// One rounding to the dtype plus a few float operations: 2 units of roundoff, relative and
// absolute, as tests/support/test_util.cpp's tolerance_for (the GPU tests' starting point).
Tol one_rounding(DType t) {
  switch (t) {
    case DType::bf16: return {2.0 / 256, 2.0 / 256};
    case DType::f16: return {2.0 / 2048, 2.0 / 2048};
    default: return {2e-6, 2e-6};
  }
}

// Every element of a tensor on any device, as double (integers exactly).
std::vector<double> values(const TensorView& t) {
  Tensor h = Tensor::empty(t.shape(), t.dtype(), kCpu);
  copy(h, t);
  std::vector<double> v(static_cast<std::size_t>(h.numel()));
  visit_dtype(h.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const T* p = h.data_as<T>();
    for (std::size_t i = 0; i < v.size(); ++i) {
      if constexpr (std::is_integral_v<T>) v[i] = static_cast<double>(p[i]);
      else v[i] = static_cast<float>(p[i]);
    }
  });
  return v;
}

Measure close(std::string what, const std::vector<double>& got, const std::vector<double>& want, Tol tol) {
  Measure m{std::move(what), "elementwise", 0, tol.atol};
  if (got.size() != want.size()) {
    m.err = kInf;
    return m;
  }
  double nearest = -1;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(want[i]) && std::isnan(got[i])) continue;
    const double err = std::fabs(got[i] - want[i]), bound = tol.atol + tol.rtol * std::fabs(want[i]);
    const double nearness = err <= bound ? (bound > 0 ? err / bound : 0.0) : kInf;
    if (nearness > nearest) {
      nearest = nearness;
      m.err = std::isnan(err) ? kInf : err;
      m.bound = bound;
    }
    if (nearness == kInf) break;
  }
  return m;
}

Measure close(std::string what, const TensorView& got, const TensorView& want, Tol tol) {
  return close(std::move(what), values(got), values(want), tol);
}

// ||got - want|| / ||want|| (||got - want|| when want is all zeros), infinite when got holds a NaN
// or an infinity: the relative error GEMM-shaped ops are held to, as `fusekit bench` reports it.
Measure normwise(std::string what, const TensorView& got, const TensorView& want, double bound) {
  Measure m{std::move(what), "normwise", 0, bound};
  const std::vector<double> g = values(got), w = values(want);
  if (g.size() != w.size()) {
    m.err = kInf;
    return m;
  }
  double num = 0, den = 0;
  for (std::size_t i = 0; i < g.size(); ++i) {
    if (!std::isfinite(g[i])) {
      m.err = kInf;
      return m;
    }
    num += (g[i] - w[i]) * (g[i] - w[i]);
    den += w[i] * w[i];
  }
  m.err = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  return m;
}

// The number of elements whose bits differ; any NaN matches any NaN (the host and the device write
// different NaN payloads).
Measure same_bits(std::string what, const TensorView& got, const TensorView& want) {
  Measure m{std::move(what), "exact", 0, 0};
  Tensor g = Tensor::empty(got.shape(), got.dtype(), kCpu), w = Tensor::empty(want.shape(), want.dtype(), kCpu);
  copy(g, got);
  copy(w, want);
  if (g.dtype() != w.dtype() || g.numel() != w.numel()) {
    m.err = kInf;
    return m;
  }
  visit_dtype(g.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const T* a = g.data_as<T>();
    const T* b = w.data_as<T>();
    for (std::int64_t i = 0; i < g.numel(); ++i) {
      bool same = std::memcmp(&a[i], &b[i], sizeof(T)) == 0;
      if constexpr (!std::is_integral_v<T>)
        same |= std::isnan(static_cast<float>(a[i])) && std::isnan(static_cast<float>(b[i]));
      m.err += same ? 0 : 1;
    }
  });
  return m;
}

// ---------------------------------------------------------------------------------------------
// Tensors
// ---------------------------------------------------------------------------------------------

// A host tensor holding `v` (row-major), each value rounded to `dtype`.
Tensor host(Dims shape, DType dtype, const std::vector<double>& v) {
  Tensor t = Tensor::empty(shape, dtype, kCpu);
  visit_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    for (std::size_t i = 0; i < v.size(); ++i) t.data_as<T>()[i] = T(static_cast<float>(v[i]));
  });
  return t;
}

// Uniform values in [lo, hi) from the Philox stream `seed`, on the host (copied where needed, so
// that the spec and the kernel see the same inputs).
Tensor random(Dims shape, DType dtype, std::uint64_t seed, float lo, float hi) {
  Tensor t = Tensor::empty(shape, dtype, kCpu);
  fill_uniform(t, lo, hi, RandomParams{seed, 0});
  return t;
}

// NaN everywhere, so that an element a kernel fails to write cannot pass.
void poison(const TensorView& t) { fill(t, std::numeric_limits<double>::quiet_NaN()); }

}  // namespace fk::app::check
