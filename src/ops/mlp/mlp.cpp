// Dispatch of the mlp family: argument checks, then the CPU spec or the fused CUDA kernel.
#include <fmt/format.h>

#include "fusekit/ops/mlp.hpp"

#if FUSEKIT_WITH_CUDA
#include "fusekit/core/cuda_check.hpp"
#endif
#include "mlp_cuda.hpp"
#include "ops/op_checks.hpp"

namespace fk {

void fused_mlp_forward(const FusedMlpForwardArgs& a, const Stream* stream) {
  constexpr const char* op = "fused_mlp_forward";
  checks::tensor(op, "x", a.x, 2);
  checks::dtype_in(op, "x", a.x, {DType::bf16, DType::f16});
  const Device dev = a.x.device();
  checks::cuda_available(op, dev);
  const std::int64_t batch = a.x.size(0), in = a.x.size(1);
  FK_CHECK_ARG(in >= 1 && in <= 128, op, "x", "an input width in [1, 128]", a.x.str());
  const std::int64_t n_layers = static_cast<std::int64_t>(a.layers.size());
  FK_CHECK_ARG(n_layers >= 2, op, "layers", "at least 2 layers (input -> hidden -> output)",
               std::to_string(n_layers));
  const std::int64_t hidden = a.layers[0].weight.rank() == 2 ? a.layers[0].weight.size(0) : 0;
  FK_CHECK_ARG(hidden == 16 || hidden == 32 || hidden == 64 || hidden == 128, op, "layers[0].weight",
               "a hidden width of 16, 32, 64 or 128", a.layers[0].weight.str());
  const std::int64_t out = a.layers.back().weight.rank() == 2 ? a.layers.back().weight.size(0) : 0;
  FK_CHECK_ARG(out >= 1 && out <= 128, op, "layers.back().weight", "an output width in [1, 128]",
               a.layers.back().weight.str());
  for (std::int64_t l = 0; l < n_layers; ++l) {
    const MlpLayer& layer = a.layers[static_cast<std::size_t>(l)];
    const std::string w = fmt::format("layers[{}].weight", l), b = fmt::format("layers[{}].bias", l);
    const std::int64_t rows = l == n_layers - 1 ? out : hidden, cols = l == 0 ? in : hidden;
    checks::tensor(op, w.c_str(), layer.weight, 2);
    checks::same_dtype(op, w.c_str(), layer.weight, a.x);
    checks::shape_is(op, w.c_str(), layer.weight, Dims{rows, cols});
    checks::same_device(op, w.c_str(), layer.weight, dev);
    checks::tensor(op, b.c_str(), layer.bias, 1);
    checks::same_dtype(op, b.c_str(), layer.bias, a.x);
    checks::shape_is(op, b.c_str(), layer.bias, Dims{rows});
    checks::same_device(op, b.c_str(), layer.bias, dev);
    FK_CHECK_ARG(layer.act == Activation::identity || layer.act == Activation::relu ||
                     layer.act == Activation::sigmoid,
                 op, fmt::format("layers[{}].act", l), "identity, relu or sigmoid",
                 std::string(activation_name(layer.act)));
  }
  checks::tensor(op, "y", a.y, 2);
  checks::same_dtype(op, "y", a.y, a.x);
  checks::shape_is(op, "y", a.y, Dims{batch, out});
  checks::same_device(op, "y", a.y, dev);
  if (batch > 0) {
    const char* x0 = static_cast<const char*>(a.x.data());
    const char* y0 = static_cast<const char*>(a.y.data());
    FK_CHECK_ARG(y0 + a.y.nbytes() <= x0 || x0 + a.x.nbytes() <= y0, op, "y", "memory that does not overlap x",
                 "overlapping memory");
  }
  if (batch == 0) return;
  if (dev.is_cpu()) return reference::fused_mlp_forward(a);
#if FUSEKIT_WITH_CUDA
  {
    const detail::DeviceScope on_device(dev.index);
    FK_CHECK_ARG(n_layers <= cuda::kMlpMaxLayers, op, "layers", fmt::format("at most {} layers", cuda::kMlpMaxLayers),
                 std::to_string(n_layers));
    const std::size_t need = cuda::fused_mlp_smem_bytes(in, hidden, out, n_layers);
    const std::size_t limit = cuda::fused_mlp_smem_limit();
    FK_CHECK_ARG(need <= limit, op, "layers",
                 fmt::format("weights that fit in shared memory ({} bytes on this device)", limit),
                 fmt::format("{} layers of width {}: {} bytes", n_layers, hidden, need));
  }
  cuda::fused_mlp_forward(a, stream);
#else
  (void)stream;
#endif
}

}  // namespace fk
