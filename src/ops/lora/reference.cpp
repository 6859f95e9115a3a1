// The spec of the lora family: plain loops on host tensors, double accumulation, one rounding to
// the dtype at each store. It is also the CPU backend.
#include <vector>

#include "fusekit/ops/lora.hpp"
#include "ops/common/reference_io.hpp"

namespace fk::reference {
namespace {

// t [M, r] = s x Aᵀ in double, or the caller's t as given.
std::vector<double> lowrank_input(const TensorView& x, const TensorView& a, const std::optional<TensorView>& given,
                                  double s) {
  const std::int64_t m = x.size(0), k = x.size(1), r = a.size(0);
  std::vector<double> t(static_cast<std::size_t>(m * r), 0.0);
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < r; ++j) {
      double acc = 0.0;
      if (given) {
        acc = load(*given, i * r + j);
      } else {
        for (std::int64_t p = 0; p < k; ++p) acc += load(x, i * k + p) * load(a, j * k + p);
        acc *= s;
      }
      t[static_cast<std::size_t>(i * r + j)] = acc;
    }
  return t;
}

}  // namespace

void lora_forward(const LoraForwardArgs& args, const LoraParams& p) {
  const std::int64_t m = args.x.size(0), k = args.x.size(1), n = args.w.size(0), r = args.a.size(0);
  const std::vector<double> t = lowrank_input(args.x, args.a, std::nullopt, p.scale);
  if (args.t)
    for (std::int64_t i = 0; i < m * r; ++i) store(*args.t, i, t[static_cast<std::size_t>(i)]);
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t c = 0; c < n; ++c) {
      double z = args.bias ? load(*args.bias, c) : 0.0;
      for (std::int64_t q = 0; q < k; ++q) z += load(args.x, i * k + q) * load(args.w, c * k + q);
      for (std::int64_t j = 0; j < r; ++j) z += t[static_cast<std::size_t>(i * r + j)] * load(args.b, c * r + j);
      z = static_cast<float>(z);  // the kernels hold z in fp32 before the activation
      if (args.preact) store(*args.preact, i * n + c, z);
      store(args.y, i * n + c, activation(p.act, z));
    }
}

void lora_backward(const LoraBackwardArgs& args, const LoraParams& p) {
  const std::int64_t m = args.x.size(0), k = args.x.size(1), n = args.w.size(0), r = args.a.size(0);
  const double s = p.scale;
  // g = dy ⊙ act'(z) (and db) is the pointwise family's backward; g kept in f32.
  const Tensor g = Tensor::empty({m, n}, DType::f32, Device::cpu());
  bias_act_backward({args.dy, args.saved, args.saved_kind, g.view(), std::nullopt, args.dbias}, {p.act, 1.0f});
  const float* gv = g.data_as<float>();
  const std::vector<double> t = lowrank_input(args.x, args.a, args.t, s);
  std::vector<double> u(static_cast<std::size_t>(m * r), 0.0);  // g B
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < r; ++j) {
      double acc = 0.0;
      for (std::int64_t c = 0; c < n; ++c) acc += gv[i * n + c] * load(args.b, c * r + j);
      u[static_cast<std::size_t>(i * r + j)] = acc;
    }
  for (std::int64_t c = 0; c < n; ++c)
    for (std::int64_t j = 0; j < r; ++j) {
      double acc = 0.0;
      for (std::int64_t i = 0; i < m; ++i) acc += gv[i * n + c] * t[static_cast<std::size_t>(i * r + j)];
      store(args.db, c * r + j, acc);
    }
  for (std::int64_t j = 0; j < r; ++j)
    for (std::int64_t q = 0; q < k; ++q) {
      double acc = 0.0;
      for (std::int64_t i = 0; i < m; ++i) acc += u[static_cast<std::size_t>(i * r + j)] * load(args.x, i * k + q);
      store(args.da, j * k + q, s * acc);
    }
  if (!args.dx) return;
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t q = 0; q < k; ++q) {
      double acc = 0.0;
      for (std::int64_t c = 0; c < n; ++c) acc += gv[i * n + c] * load(args.w, c * k + q);
      for (std::int64_t j = 0; j < r; ++j) acc += s * u[static_cast<std::size_t>(i * r + j)] * load(args.a, j * k + q);
      store(*args.dx, i * k + q, acc);
    }
}

}  // namespace fk::reference
