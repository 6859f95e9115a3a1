// The spec of `gemm`: plain loops, double accumulation, the epilogue applied to each element as
// gemm.hpp defines it, one rounding to c's dtype at the store.
#include <algorithm>
#include <cmath>
#include <vector>

#include "ops/gemm/gemm_impl.hpp"
#include "fusekit/core/error.hpp"

namespace fk::gemm_detail {

namespace {

constexpr double kGeluC = 0.7978845608028654;  // sqrt(2 / pi)
constexpr double kGeluA = 0.044715;

double gelu(double u) { return 0.5 * u * (1.0 + std::tanh(kGeluC * (u + kGeluA * u * u * u))); }

double gelu_derivative(double u) {
  const double t = std::tanh(kGeluC * (u + kGeluA * u * u * u));
  return 0.5 * (1.0 + t) + 0.5 * u * (1.0 - t * t) * kGeluC * (1.0 + 3.0 * kGeluA * u * u);
}

// Element e of a matrix of dtype t at `data` (an offset in elements), as double; stored rounded
// once to t through float (the kernels hold fp32 values and round once at the store).
double load(DType t, const void* data, std::int64_t e) {
  switch (t) {
    case DType::f32: return static_cast<const float*>(data)[e];
    case DType::bf16: return static_cast<float>(static_cast<const bf16*>(data)[e]);
    case DType::f16: return static_cast<float>(static_cast<const f16*>(data)[e]);
    default: throw_internal("gemm_reference: dtype not checked by the caller");
  }
}
void store(DType t, void* data, std::int64_t e, double v) {
  const float f = static_cast<float>(v);
  switch (t) {
    case DType::f32: static_cast<float*>(data)[e] = f; return;
    case DType::bf16: static_cast<bf16*>(data)[e] = bf16(f); return;
    case DType::f16: static_cast<f16*>(data)[e] = f16(f); return;
    default: throw_internal("gemm_reference: dtype not checked by the caller");
  }
}

}  // namespace

namespace {

// The epilogue of element (i, j) from its z = alpha op(a) op(b) + beta c; returns c's value.
double finish(const Problem& q, std::int64_t i, std::int64_t j, double z, std::vector<double>& col_sum) {
  const GemmEpilogue epi = q.p.epilogue;
  if (epi == GemmEpilogue::bias || epi == GemmEpilogue::relu_bias || epi == GemmEpilogue::gelu_bias ||
      epi == GemmEpilogue::gelu_aux_bias)
    z += load(q.out_type, q.bias, j);
  double out = z;
  switch (epi) {
    case GemmEpilogue::relu:
    case GemmEpilogue::relu_bias: out = z > 0.0 ? z : 0.0; break;
    case GemmEpilogue::gelu:
    case GemmEpilogue::gelu_bias: out = gelu(z); break;
    case GemmEpilogue::gelu_aux_bias:
      store(q.out_type, q.aux.data, i * q.aux.ld + j, z);
      out = gelu(z);
      break;
    case GemmEpilogue::dgelu:
    case GemmEpilogue::dgelu_bgrad: out = z * gelu_derivative(load(q.out_type, q.aux.data, i * q.aux.ld + j)); break;
    default: break;
  }
  if (epi == GemmEpilogue::dgelu_bgrad) col_sum[static_cast<std::size_t>(j)] += out;
  return out;
}

// The bias gradients, once every element is final.
void finish_bias_grads(const Problem& q, const std::vector<double>& col_sum) {
  if (q.p.epilogue == GemmEpilogue::dgelu_bgrad)
    for (std::int64_t j = 0; j < q.n; ++j) store(q.out_type, q.bias_grad, j, col_sum[static_cast<std::size_t>(j)]);
  if (q.p.epilogue == GemmEpilogue::bgrad_a)
    for (std::int64_t i = 0; i < q.m; ++i) {
      double s = 0.0;
      for (std::int64_t l = 0; l < q.k; ++l)
        s += load(q.in_type, q.a.data, q.p.trans_a == Trans::n ? i * q.a.ld + l : l * q.a.ld + i);
      store(q.out_type, q.bias_grad, i, s);
    }
}

}  // namespace

void gemm_reference(const Problem& q) {
  const GemmParams& p = q.p;
  std::vector<double> col_sum(static_cast<std::size_t>(q.n), 0.0);
  for (std::int64_t g = 0; g < q.batch; ++g) {
    const std::int64_t ab = g * q.a.batch_stride, bb = g * q.b.batch_stride, cb = g * q.c.batch_stride;
    for (std::int64_t i = 0; i < q.m; ++i)
      for (std::int64_t j = 0; j < q.n; ++j) {
        double z = 0.0;
        for (std::int64_t l = 0; l < q.k; ++l) {
          const std::int64_t ea = p.trans_a == Trans::n ? i * q.a.ld + l : l * q.a.ld + i;
          const std::int64_t eb = p.trans_b == Trans::n ? l * q.b.ld + j : j * q.b.ld + l;
          z += load(q.in_type, q.a.data, ab + ea) * load(q.in_type, q.b.data, bb + eb);
        }
        const std::int64_t ec = cb + i * q.c.ld + j;
        z *= p.alpha;
        if (p.beta != 0.0f) z += static_cast<double>(p.beta) * load(q.out_type, q.c.data, ec);
        store(q.out_type, q.c.data, ec, finish(q, i, j, z, col_sum));
      }
  }
  finish_bias_grads(q, col_sum);
}

void epilogue_in_place(const Problem& q) {
  const GemmEpilogue e = q.p.epilogue;
  if (q.out_type == DType::f32 &&
      (e == GemmEpilogue::bias || e == GemmEpilogue::relu || e == GemmEpilogue::relu_bias)) {
    // The training epilogues of f32 layers as float loops the compiler vectorises: the values of
    // the general path below (one float addition, then the ReLU), without its per-element switch.
    const auto* bias = e == GemmEpilogue::relu ? nullptr : static_cast<const float*>(q.bias);
    const bool relu = e != GemmEpilogue::bias;
    for (std::int64_t i = 0; i < q.m; ++i) {
      float* row = static_cast<float*>(q.c.data) + i * q.c.ld;
      for (std::int64_t j = 0; j < q.n; ++j) {
        const float z = bias ? row[j] + bias[j] : row[j];
        row[j] = relu ? std::max(z, 0.0f) : z;
      }
    }
    return;
  }
  std::vector<double> col_sum(static_cast<std::size_t>(q.n), 0.0);
  for (std::int64_t i = 0; i < q.m; ++i)
    for (std::int64_t j = 0; j < q.n; ++j) {
      const std::int64_t ec = i * q.c.ld + j;
      store(q.out_type, q.c.data, ec, finish(q, i, j, load(q.out_type, q.c.data, ec), col_sum));
    }
  finish_bias_grads(q, col_sum);
}

}  // namespace fk::gemm_detail
