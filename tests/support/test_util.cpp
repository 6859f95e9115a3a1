#include "test_util.hpp"

#include <cmath>
#include <limits>

#if FUSEKIT_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace fk::test {

Tensor random_tensor(Dims shape, DType dtype, Device device, std::uint64_t seed, float lo, float hi) {
  Tensor host = Tensor::empty(shape, dtype, Device::cpu());
  fill_uniform(host, lo, hi, RandomParams{seed, 0});
  return device.is_cpu() ? std::move(host) : host.copy_to(device);
}

Tensor to_host(const TensorView& t) {
  Tensor h = Tensor::empty(t.shape(), t.dtype(), Device::cpu());
  copy(h, t);
  return h;
}

std::vector<float> to_floats(const TensorView& t) {
  std::vector<float> out;
  for (double d : to_doubles(t)) out.push_back(static_cast<float>(d));
  return out;
}

std::vector<double> to_doubles(const TensorView& t) {
  const Tensor h = to_host(t);
  std::vector<double> out(static_cast<std::size_t>(h.numel()));
  visit_dtype(h.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const T* p = h.data_as<T>();
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<double>(static_cast<float>(p[i]));
  });
  return out;
}

Tensor host_tensor(Dims shape, DType dtype, const std::vector<float>& values) {
  Tensor t = Tensor::empty(shape, dtype, Device::cpu());
  visit_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    for (std::size_t i = 0; i < values.size(); ++i) t.data_as<T>()[i] = T(values[i]);
  });
  return t;
}

double rel_err_normwise(const TensorView& got, const TensorView& ref) {
  const std::vector<double> g = to_doubles(got), r = to_doubles(ref);
  double num = 0, den = 0;
  for (std::size_t i = 0; i < g.size(); ++i) {
    if (!std::isfinite(g[i])) return INFINITY;
    num += (g[i] - r[i]) * (g[i] - r[i]);
    den += r[i] * r[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

void poison(const TensorView& t) { fill(t, std::numeric_limits<double>::quiet_NaN()); }

Tolerance tolerance_for(DType t) {
  switch (t) {
    case DType::bf16: return {2.0 / 256, 2.0 / 256};
    case DType::f16: return {2.0 / 2048, 2.0 / 2048};
    default: return {2e-6, 2e-6};
  }
}

::testing::AssertionResult all_close(const TensorView& got, const TensorView& ref, Tolerance tol) {
  if (got.shape() != ref.shape())
    return ::testing::AssertionFailure() << "shape " << got.shape().str() << " != " << ref.shape().str();
  const std::vector<double> g = to_doubles(got), r = to_doubles(ref);
  std::size_t bad = 0, worst = 0;
  double worst_excess = -1;
  for (std::size_t i = 0; i < g.size(); ++i) {
    const double bound = tol.atol + tol.rtol * std::fabs(r[i]);
    const double err = std::fabs(g[i] - r[i]);
    const bool ok = (std::isnan(r[i]) && std::isnan(g[i])) || err <= bound;
    if (!ok) {
      ++bad;
      const double excess = std::isnan(err) ? std::numeric_limits<double>::infinity() : err - bound;
      if (excess > worst_excess) worst_excess = excess, worst = i;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << g.size() << " elements differ beyond atol "
                                       << tol.atol << " + rtol " << tol.rtol << "; worst at flat index " << worst
                                       << ": got " << g[worst] << ", expected " << r[worst];
}

bool on_sm90() {
#if FUSEKIT_WITH_CUDA
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0) != cudaSuccess)
    return false;
  return major == 9 && minor == 0;
#else
  return false;
#endif
}

}  // namespace fk::test
