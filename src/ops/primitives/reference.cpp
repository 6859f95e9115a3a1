// The spec of the primitives family: plain loops, double accumulation, one rounding to c's dtype
// (through float, as the kernels hold their fp32 accumulators) at each store. It is also the CPU
// backend.
#include <cstdint>

#include "fusekit/core/error.hpp"
#include "ops/reference_io.hpp"
#include "fusekit/ops/primitives.hpp"

namespace fk::reference {
namespace {

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
