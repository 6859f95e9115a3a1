// Dispatch of the mlp family: argument checks, then the CPU spec or the fused CUDA kernels.
#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "fusekit/ops/mlp.hpp"

#if FUSEKIT_WITH_CUDA
#include "fusekit/core/cuda_check.hpp"
#endif
#include "mlp_cuda.hpp"
#include "ops/common/op_checks.hpp"

namespace fk {
namespace {

bool overlaps(const TensorView& a, const TensorView& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  const char* a0 = static_cast<const char*>(a.data());
  const char* b0 = static_cast<const char*>(b.data());
  return !(a0 + a.nbytes() <= b0 || b0 + b.nbytes() <= a0);
}

struct MlpShape {
  std::int64_t batch, in, hidden, out, layers;
};

// Checks x and the layers (shapes, dtypes, devices, activations); returns the MLP's shape.
MlpShape check_mlp(const char* op, const TensorView& x, const std::vector<MlpLayer>& layers) {
  checks::tensor(op, "x", x, 2);
  checks::dtype_in(op, "x", x, {DType::bf16, DType::f16});
  const Device dev = x.device();
  checks::cuda_available(op, dev);
  const std::int64_t batch = x.size(0), in = x.size(1);
  FK_CHECK_ARG(in >= 1 && in <= 128, op, "x", "an input width in [1, 128]", x.str());
  const std::int64_t n_layers = static_cast<std::int64_t>(layers.size());
  FK_CHECK_ARG(n_layers >= 2, op, "layers", "at least 2 layers (input -> hidden -> output)",
               std::to_string(n_layers));
  const std::int64_t hidden = layers[0].weight.rank() == 2 ? layers[0].weight.size(0) : 0;
  FK_CHECK_ARG(hidden == 16 || hidden == 32 || hidden == 64 || hidden == 128, op, "layers[0].weight",
               "a hidden width of 16, 32, 64 or 128", layers[0].weight.str());
  const std::int64_t out = layers.back().weight.rank() == 2 ? layers.back().weight.size(0) : 0;
  FK_CHECK_ARG(out >= 1 && out <= 128, op, "layers.back().weight", "an output width in [1, 128]",
               layers.back().weight.str());
  for (std::int64_t l = 0; l < n_layers; ++l) {
    const MlpLayer& layer = layers[static_cast<std::size_t>(l)];
    const std::string w = fmt::format("layers[{}].weight", l), b = fmt::format("layers[{}].bias", l);
    const std::int64_t rows = l == n_layers - 1 ? out : hidden, cols = l == 0 ? in : hidden;
    checks::tensor(op, w.c_str(), layer.weight, 2);
    checks::same_dtype(op, w.c_str(), layer.weight, x);
    checks::shape_is(op, w.c_str(), layer.weight, Dims{rows, cols});
    checks::same_device(op, w.c_str(), layer.weight, dev);
    checks::tensor(op, b.c_str(), layer.bias, 1);
    checks::same_dtype(op, b.c_str(), layer.bias, x);
    checks::shape_is(op, b.c_str(), layer.bias, Dims{rows});
    checks::same_device(op, b.c_str(), layer.bias, dev);
    FK_CHECK_ARG(layer.act == Activation::identity || layer.act == Activation::relu ||
                     layer.act == Activation::sigmoid,
                 op, fmt::format("layers[{}].act", l), "identity, relu or sigmoid",
                 std::string(activation_name(layer.act)));
  }
  return {batch, in, hidden, out, n_layers};
}

// An output or activation tensor of the MLP's dtype and device.
void check_io(const char* op, const char* arg, const TensorView& t, const TensorView& x, const Dims& shape) {
  checks::tensor(op, arg, t, static_cast<int>(shape.size()));
  checks::same_dtype(op, arg, t, x);
  checks::shape_is(op, arg, t, shape);
  checks::same_device(op, arg, t, x.device());
}

// The shared-memory budget of the CUDA kernels on the current device.
void check_fits(const char* op, const MlpShape& s, Device dev, bool train) {
#if FUSEKIT_WITH_CUDA
  if (dev.is_cpu()) return;
  const detail::DeviceScope on_device(dev.index);
  FK_CHECK_ARG(s.layers <= cuda::kMlpMaxLayers, op, "layers", fmt::format("at most {} layers", cuda::kMlpMaxLayers),
               std::to_string(s.layers));
  // Training needs the training forward and the backward (its smaller variant) to fit.
  const std::size_t need =
      train ? std::max(cuda::fused_mlp_smem_bytes(s.in, s.hidden, s.out, s.layers, true),
                       cuda::fused_mlp_backward_smem_bytes(s.in, s.hidden, s.out, s.layers))
            : cuda::fused_mlp_smem_bytes(s.in, s.hidden, s.out, s.layers, false);
  const std::size_t limit = cuda::fused_mlp_smem_limit();
  FK_CHECK_ARG(need <= limit, op, "layers",
               fmt::format("weights that fit in shared memory ({} bytes on this device)", limit),
               fmt::format("{} layers of width {}: {} bytes", s.layers, s.hidden, need));
#else
  (void)op, (void)s, (void)dev, (void)train;
#endif
}

}  // namespace

void fused_mlp_forward(const FusedMlpForwardArgs& a, const Stream* stream) {
  constexpr const char* op = "fused_mlp_forward";
  const MlpShape s = check_mlp(op, a.x, a.layers);
  check_io(op, "y", a.y, a.x, Dims{s.batch, s.out});
  FK_CHECK_ARG(!overlaps(a.y, a.x), op, "y", "memory that does not overlap x", "overlapping memory");
  if (s.batch == 0) return;
  if (a.x.device().is_cpu()) return reference::fused_mlp_forward(a);
  check_fits(op, s, a.x.device(), false);
#if FUSEKIT_WITH_CUDA
  cuda::fused_mlp_forward(a, nullptr, stream);
#else
  (void)stream;
#endif
}

void fused_mlp_forward_train(const FusedMlpTrainForwardArgs& a, const Stream* stream) {
  constexpr const char* op = "fused_mlp_forward_train";
  const MlpShape s = check_mlp(op, a.x, a.layers);
  check_io(op, "y", a.y, a.x, Dims{s.batch, s.out});
  check_io(op, "hidden", a.hidden, a.x, Dims{s.layers - 1, s.batch, s.hidden});
  FK_CHECK_ARG(!overlaps(a.y, a.x), op, "y", "memory that does not overlap x", "overlapping memory");
  FK_CHECK_ARG(!overlaps(a.hidden, a.x) && !overlaps(a.hidden, a.y), op, "hidden",
               "memory that overlaps neither x nor y", "overlapping memory");
  if (s.batch == 0) return;
  if (a.x.device().is_cpu()) return reference::fused_mlp_forward_train(a);
  check_fits(op, s, a.x.device(), true);
  FK_CHECK_ARG(reinterpret_cast<std::uintptr_t>(a.hidden.data()) % 16 == 0, op, "hidden",
               "16-byte aligned data (the kernel stores whole rows in 16-byte pieces)", "a misaligned pointer");
#if FUSEKIT_WITH_CUDA
  cuda::fused_mlp_forward({a.x, a.layers, a.y}, &a.hidden, stream);
#else
  (void)stream;
#endif
}

void fused_mlp_backward(const FusedMlpBackwardArgs& a, const Stream* stream) {
  constexpr const char* op = "fused_mlp_backward";
  const MlpShape s = check_mlp(op, a.x, a.layers);
  check_io(op, "dy", a.dy, a.x, Dims{s.batch, s.out});
  check_io(op, "hidden", a.hidden, a.x, Dims{s.layers - 1, s.batch, s.hidden});
  check_io(op, "y", a.y, a.x, Dims{s.batch, s.out});
  if (a.dx) {
    check_io(op, "dx", *a.dx, a.x, Dims{s.batch, s.in});
    FK_CHECK_ARG(!overlaps(*a.dx, a.dy) && !overlaps(*a.dx, a.x) && !overlaps(*a.dx, a.hidden) && !overlaps(*a.dx, a.y),
                 op, "dx", "memory that overlaps none of dy, x, hidden, y", "overlapping memory");
  }
  FK_CHECK_ARG(static_cast<std::int64_t>(a.dweight.size()) == s.layers, op, "dweight",
               fmt::format("{} tensors (one per layer)", s.layers), std::to_string(a.dweight.size()));
  FK_CHECK_ARG(static_cast<std::int64_t>(a.dbias.size()) == s.layers, op, "dbias",
               fmt::format("{} tensors (one per layer)", s.layers), std::to_string(a.dbias.size()));
  for (std::int64_t l = 0; l < s.layers; ++l) {
    const std::size_t i = static_cast<std::size_t>(l);
    const std::string w = fmt::format("dweight[{}]", l), b = fmt::format("dbias[{}]", l);
    checks::tensor(op, w.c_str(), a.dweight[i], 2);
    checks::dtype_in(op, w.c_str(), a.dweight[i], {DType::f32});
    checks::shape_is(op, w.c_str(), a.dweight[i], a.layers[i].weight.shape());
    checks::same_device(op, w.c_str(), a.dweight[i], a.x.device());
    checks::tensor(op, b.c_str(), a.dbias[i], 1);
    checks::dtype_in(op, b.c_str(), a.dbias[i], {DType::f32});
    checks::shape_is(op, b.c_str(), a.dbias[i], a.layers[i].bias.shape());
    checks::same_device(op, b.c_str(), a.dbias[i], a.x.device());
  }
  if (a.x.device().is_cpu()) return reference::fused_mlp_backward(a);
  check_fits(op, s, a.x.device(), true);
  FK_CHECK_ARG(reinterpret_cast<std::uintptr_t>(a.hidden.data()) % 4 == 0, op, "hidden",
               "4-byte aligned data (the kernels load pairs)", "a misaligned pointer");
  FK_CHECK_ARG(s.batch <= std::numeric_limits<int>::max(), op, "x", "at most 2^31 - 1 rows (cuBLAS's k)",
               a.x.str());
#if FUSEKIT_WITH_CUDA
  cuda::fused_mlp_backward(a, stream);
#else
  (void)stream;
#endif
}

}  // namespace fk
