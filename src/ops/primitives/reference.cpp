// The spec of the primitives family: plain loops, double accumulation, one rounding to c's dtype
// (through float, as the kernels hold their fp32 accumulators) at each store. It is also the CPU
// backend.
#include <cstdint>

#include "fusekit/core/error.hpp"
#include "fusekit/ops/primitives.hpp"

namespace fk::reference {
namespace {

// Element i of a host tensor of any float dtype, as double.
double load(const TensorView& t, std::int64_t i) {
  switch (t.dtype()) {
    case DType::f32: return t.data_as<float>()[i];
    case DType::bf16: return static_cast<float>(t.data_as<bf16>()[i]);
    case DType::f16: return static_cast<float>(t.data_as<f16>()[i]);
    default: throw_internal("primitives reference: dtype not checked by the caller");
  }
}

void store(const TensorView& t, std::int64_t i, double v) {
  const float f = static_cast<float>(v);
  switch (t.dtype()) {
    case DType::f32: t.data_as<float>()[i] = f; return;
    case DType::bf16: t.data_as<bf16>()[i] = bf16(f); return;
    case DType::f16: t.data_as<f16>()[i] = f16(f); return;
    default: throw_internal("primitives reference: dtype not checked by the caller");
  }
}

}  // namespace

void batched_matmul(const TensorView& a, const TensorView& b, const TensorView& c) {
  const std::int64_t batch = a.size(0), m = a.size(1), k = a.size(2), n = b.size(2);
  for (std::int64_t i = 0; i < batch; ++i) {
    const std::int64_t a0 = i * m * k, b0 = i * k * n, c0 = i * m * n;  // a: (M,K), b: (K,N), c: (M,N)
    for (std::int64_t r = 0; r < m; ++r) {
      for (std::int64_t col = 0; col < n; ++col) {
        double acc = 0.0;
        for (std::int64_t j = 0; j < k; ++j) acc += load(a, a0 + r * k + j) * load(b, b0 + j * n + col);
        store(c, c0 + r * n + col, acc);
      }
    }
  }
}

}  // namespace fk::reference
