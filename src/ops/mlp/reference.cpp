// The spec of the mlp family: plain loops, double accumulation, each layer's output rounded to the
// dtype (through float, as the kernel holds it) before the next layer reads it.
#include <cstddef>
#include <vector>

#include "fusekit/ops/mlp.hpp"
#include "ops/reference_io.hpp"

namespace fk::reference {
namespace {

double round_to(DType t, double v) {
  const float f = static_cast<float>(v);
  switch (t) {
    case DType::bf16: return static_cast<float>(bf16(f));
    case DType::f16: return static_cast<float>(f16(f));
    default: return f;
  }
}

}  // namespace

void fused_mlp_forward(const FusedMlpForwardArgs& a) {
  const std::int64_t batch = a.x.size(0), in = a.x.size(1);
  const DType dt = a.y.dtype();
  std::vector<double> h, next;
  for (std::int64_t r = 0; r < batch; ++r) {
    h.assign(static_cast<std::size_t>(in), 0.0);
    for (std::int64_t k = 0; k < in; ++k) h[static_cast<std::size_t>(k)] = load(a.x, r * in + k);
    for (const MlpLayer& layer : a.layers) {
      const std::int64_t n_out = layer.weight.size(0), n_in = layer.weight.size(1);
      next.assign(static_cast<std::size_t>(n_out), 0.0);
      for (std::int64_t n = 0; n < n_out; ++n) {
        double z = load(layer.bias, n);
        for (std::int64_t k = 0; k < n_in; ++k) z += h[static_cast<std::size_t>(k)] * load(layer.weight, n * n_in + k);
        // z is held in fp32 by the kernel before the activation.
        next[static_cast<std::size_t>(n)] = round_to(dt, activation(layer.act, static_cast<float>(z)));
      }
      h.swap(next);
    }
    const std::int64_t out = a.y.size(1);
    for (std::int64_t n = 0; n < out; ++n) store(a.y, r * out + n, h[static_cast<std::size_t>(n)]);
  }
}

}  // namespace fk::reference
