// The mlp family's bindings: a whole narrow MLP in one kernel (inference, or keeping the hidden
// layers for training) and its fused backward.
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

#include "bindings.hpp"
#include "fusekit/ops/mlp.hpp"
#include "fusekit/ops/pointwise.hpp"

namespace fk::py {

using namespace nb::literals;

namespace {

// The fused MLP's layers from parallel lists (weights [out_l, in_l], biases [out_l], activations).
std::vector<MlpLayer> mlp_layers(const std::vector<Array>& weights, const std::vector<Array>& biases,
                                 const std::vector<std::string>& acts, const char* op) {
  FK_CHECK_ARG(biases.size() == weights.size() && acts.size() == weights.size(), op, "biases",
               std::to_string(weights.size()) + " biases and activations (one per weight)",
               std::to_string(biases.size()) + " biases, " + std::to_string(acts.size()) + " activations");
  std::vector<MlpLayer> layers;
  for (std::size_t l = 0; l < weights.size(); ++l)
    layers.push_back({view(weights[l], op, "weights"), view(biases[l], op, "biases"), parse_activation(acts[l])});
  return layers;
}

}  // namespace

void bind_mlp(nb::module_& m) {
  m.def(
      "fused_mlp_forward",
      [](const Array& x, const std::vector<Array>& weights, const std::vector<Array>& biases,
         const std::vector<std::string>& acts, const Array& y, const OptArray& hidden, std::uintptr_t stream) {
        constexpr const char* op = "fused_mlp_forward";
        const TensorView xv = view(x, op, "x");
        std::vector<MlpLayer> layers = mlp_layers(weights, biases, acts, op);
        if (hidden) {
          fused_mlp_forward_train({xv, std::move(layers), view(y, op, "y"), view(*hidden, op, "hidden")},
                                  StreamArg(stream, xv).get());
        } else {
          fused_mlp_forward({xv, std::move(layers), view(y, op, "y")}, StreamArg(stream, xv).get());
        }
      },
      "x"_a, "weights"_a, "biases"_a, "acts"_a, "y"_a, "hidden"_a.none(), "stream"_a, kNoGil);
  m.def(
      "fused_mlp_backward",
      [](const Array& dy, const Array& x, const Array& hidden, const Array& y, const std::vector<Array>& weights,
         const std::vector<Array>& biases, const std::vector<std::string>& acts, const OptArray& dx,
         const std::vector<Array>& dweight, const std::vector<Array>& dbias, std::uintptr_t stream) {
        constexpr const char* op = "fused_mlp_backward";
        FusedMlpBackwardArgs a{view(dy, op, "dy"), view(x, op, "x"), view(hidden, op, "hidden"), view(y, op, "y"),
                               mlp_layers(weights, biases, acts, op), view(dx, op, "dx"), {}, {}};
        for (const Array& d : dweight) a.dweight.push_back(view(d, op, "dweight"));
        for (const Array& d : dbias) a.dbias.push_back(view(d, op, "dbias"));
        fused_mlp_backward(a, StreamArg(stream, a.dy).get());
      },
      "dy"_a, "x"_a, "hidden"_a, "y"_a, "weights"_a, "biases"_a, "acts"_a, "dx"_a.none(), "dweight"_a, "dbias"_a,
      "stream"_a, kNoGil);
}

}  // namespace fk::py
