// `fusekit check`'s comparisons and test tensors, shared by the families' checks (apps/check.cpp).
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "fusekit/fusekit.hpp"

namespace fk::app::check {

inline const Device kCpu = Device::cpu();
inline constexpr double kInf = std::numeric_limits<double>::infinity();

struct Measure {
  std::string what;  // the op, the output and the case
  const char* kind;  // "elementwise", "normwise" or "exact"
  double err = 0, bound = 0;

  bool ok() const { return err <= bound; }  // false for a NaN error
  // 0 exact, 1 at the bound; infinite once past it.
  double nearness() const { return !ok() ? kInf : bound > 0 ? err / bound : 0.0; }
};

struct Tol {
  double atol, rtol;
};

constexpr Tol kExact{0, 0};

// One rounding to the dtype plus a few float operations: 2 units of roundoff, relative and
// absolute, as tests/support/test_util.cpp's tolerance_for (the GPU tests' starting point).
Tol one_rounding(DType t);
// Every element of a tensor on any device, as double (integers exactly).
std::vector<double> values(const TensorView& t);
// A packed word or mask word as the i32 tensor holds it.
inline double word(std::uint32_t w) { return static_cast<double>(static_cast<std::int32_t>(w)); }

// Elementwise: of the elements, the one nearest atol + rtol |want|; NaN matches NaN.
Measure close(std::string what, const std::vector<double>& got, const std::vector<double>& want, Tol tol);
Measure close(std::string what, const TensorView& got, const TensorView& want, Tol tol);
// ||got - want|| / ||want|| (||got - want|| when want is all zeros), infinite when got holds a NaN
// or an infinity: the relative error GEMM-shaped ops are held to, as `fusekit bench` reports it.
Measure normwise(std::string what, const TensorView& got, const TensorView& want, double bound);
// The number of elements whose bits differ; any NaN matches any NaN (the host and the device write
// different NaN payloads).
Measure same_bits(std::string what, const TensorView& got, const TensorView& want);

// A host tensor holding `v` (row-major), each value rounded to `dtype`.
Tensor host(Dims shape, DType dtype, const std::vector<double>& v);
// Uniform values in [lo, hi) from the Philox stream `seed`, on the host (copied where needed, so
// that the spec and the kernel see the same inputs).
Tensor random(Dims shape, DType dtype, std::uint64_t seed, float lo = -1.f, float hi = 1.f);
// NaN everywhere, so that an element a kernel fails to write cannot pass.
void poison(const TensorView& t);

}  // namespace fk::app::check
