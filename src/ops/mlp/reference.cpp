// The spec of the mlp family: plain loops, double accumulation, each layer's output rounded to the
// dtype (through float, as the kernel holds it) before the next layer reads it.
#include <cstddef>
#include <vector>

#include "fusekit/ops/mlp.hpp"
#include "ops/common/reference_io.hpp"

namespace fk::reference {
namespace {

// One row through the MLP: h[l] = the output of layer l, rounded to the dtype (h[L-1] = y's row).
void forward_row(const TensorView& x, std::int64_t r, const std::vector<MlpLayer>& layers, DType dt,
                 std::vector<std::vector<double>>& h) {
  const std::int64_t in = x.size(1);
  std::vector<double> cur(static_cast<std::size_t>(in));
  for (std::int64_t k = 0; k < in; ++k) cur[static_cast<std::size_t>(k)] = load(x, r * in + k);
  h.resize(layers.size());
  for (std::size_t l = 0; l < layers.size(); ++l) {
    const MlpLayer& layer = layers[l];
    const std::int64_t n_out = layer.weight.size(0), n_in = layer.weight.size(1);
    std::vector<double>& next = h[l];
    next.assign(static_cast<std::size_t>(n_out), 0.0);
    for (std::int64_t n = 0; n < n_out; ++n) {
      double z = load(layer.bias, n);
      for (std::int64_t k = 0; k < n_in; ++k) z += cur[static_cast<std::size_t>(k)] * load(layer.weight, n * n_in + k);
      // z is held in fp32 by the kernel before the activation.
      next[static_cast<std::size_t>(n)] = round_to(dt, activation(layer.act, static_cast<float>(z)));
    }
    cur = next;
  }
}

// act'(z) from y = act(z), for identity, relu and sigmoid.
double grad_from_output(Activation act, double y) {
  switch (act) {
    case Activation::relu: return y > 0 ? 1.0 : 0.0;
    case Activation::sigmoid: return y * (1.0 - y);
    default: return 1.0;
  }
}

}  // namespace

void fused_mlp_forward(const FusedMlpForwardArgs& a) {
  const std::int64_t batch = a.x.size(0), out = a.y.size(1);
  std::vector<std::vector<double>> h;
  for (std::int64_t r = 0; r < batch; ++r) {
    forward_row(a.x, r, a.layers, a.y.dtype(), h);
    for (std::int64_t n = 0; n < out; ++n) store(a.y, r * out + n, h.back()[static_cast<std::size_t>(n)]);
  }
}

void fused_mlp_forward_train(const FusedMlpTrainForwardArgs& a) {
  const std::int64_t batch = a.x.size(0), out = a.y.size(1);
  const std::size_t n_hidden = a.layers.size() - 1;
  const std::int64_t hidden = a.layers[0].weight.size(0);
  std::vector<std::vector<double>> h;
  for (std::int64_t r = 0; r < batch; ++r) {
    forward_row(a.x, r, a.layers, a.y.dtype(), h);
    for (std::size_t l = 0; l < n_hidden; ++l)
      for (std::int64_t n = 0; n < hidden; ++n)
        store(a.hidden, (static_cast<std::int64_t>(l) * batch + r) * hidden + n, h[l][static_cast<std::size_t>(n)]);
    for (std::int64_t n = 0; n < out; ++n) store(a.y, r * out + n, h.back()[static_cast<std::size_t>(n)]);
  }
}

void fused_mlp_backward(const FusedMlpBackwardArgs& a) {
  const std::int64_t batch = a.x.size(0), in = a.x.size(1), out = a.y.size(1);
  const std::size_t n_layers = a.layers.size();
  const std::int64_t hidden = a.layers[0].weight.size(0);
  const DType dt = a.x.dtype();
  std::vector<std::vector<double>> dw(n_layers), db(n_layers);
  for (std::size_t l = 0; l < n_layers; ++l) {
    dw[l].assign(static_cast<std::size_t>(a.layers[l].weight.numel()), 0.0);
    db[l].assign(static_cast<std::size_t>(a.layers[l].bias.numel()), 0.0);
  }
  std::vector<double> g, dh, below;
  for (std::int64_t r = 0; r < batch; ++r) {
    g.assign(static_cast<std::size_t>(out), 0.0);
    for (std::int64_t n = 0; n < out; ++n)
      g[static_cast<std::size_t>(n)] =
          round_to(dt, static_cast<float>(load(a.dy, r * out + n) *
                                          grad_from_output(a.layers.back().act, load(a.y, r * out + n))));
    for (std::size_t l = n_layers; l-- > 0;) {
      const MlpLayer& layer = a.layers[l];
      const std::int64_t n_out = layer.weight.size(0), n_in = layer.weight.size(1);
      // h_{l-1}: the layer's input row.
      below.assign(static_cast<std::size_t>(n_in), 0.0);
      for (std::int64_t k = 0; k < n_in; ++k)
        below[static_cast<std::size_t>(k)] =
            l == 0 ? load(a.x, r * in + k) : load(a.hidden, ((static_cast<std::int64_t>(l) - 1) * batch + r) * hidden + k);
      for (std::int64_t n = 0; n < n_out; ++n) {
        const double gn = g[static_cast<std::size_t>(n)];
        db[l][static_cast<std::size_t>(n)] += gn;
        for (std::int64_t k = 0; k < n_in; ++k)
          dw[l][static_cast<std::size_t>(n * n_in + k)] += gn * below[static_cast<std::size_t>(k)];
      }
      if (l == 0 && !a.dx) break;
      dh.assign(static_cast<std::size_t>(n_in), 0.0);
      for (std::int64_t n = 0; n < n_out; ++n)
        for (std::int64_t k = 0; k < n_in; ++k)
          dh[static_cast<std::size_t>(k)] += g[static_cast<std::size_t>(n)] * load(layer.weight, n * n_in + k);
      if (l == 0) {
        for (std::int64_t k = 0; k < in; ++k) store(*a.dx, r * in + k, dh[static_cast<std::size_t>(k)]);
        break;
      }
      // dh is held in fp32 by the kernel; g_{l-1} = dh ⊙ act'(h_{l-1}), rounded to the dtype.
      g.assign(static_cast<std::size_t>(n_in), 0.0);
      for (std::int64_t k = 0; k < n_in; ++k)
        g[static_cast<std::size_t>(k)] =
            round_to(dt, static_cast<float>(static_cast<float>(dh[static_cast<std::size_t>(k)]) *
                                            grad_from_output(a.layers[l - 1].act, below[static_cast<std::size_t>(k)])));
    }
  }
  for (std::size_t l = 0; l < n_layers; ++l) {
    for (std::size_t i = 0; i < dw[l].size(); ++i) store(a.dweight[l], static_cast<std::int64_t>(i), dw[l][i]);
    for (std::size_t i = 0; i < db[l].size(); ++i) store(a.dbias[l], static_cast<std::int64_t>(i), db[l][i]);
  }
}

}  // namespace fk::reference
