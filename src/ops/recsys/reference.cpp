// The spec of the recsys family: plain loops over host tensors, double accumulation, one rounding
// to f32 at each store. It is also the CPU backend. Arguments were checked by recsys.cpp.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "fusekit/core/error.hpp"
#include "fusekit/ops/recsys.hpp"
#include "ops/common/stochastic_round.hpp"

namespace fk::reference {
namespace {

// Element i of a table buffer of any of its dtypes (f32, bf16, f16), as a float.
float table_value(const TensorView& w, std::int64_t i) {
  switch (w.dtype()) {
    case DType::bf16: return static_cast<float>(w.data_as<const bf16>()[i]);
    case DType::f16: return static_cast<float>(w.data_as<const f16>()[i]);
    default: return w.data_as<const float>()[i];
  }
}

// Stores v into element i of a table buffer: as is (f32), or stochastically rounded with the
// draw of element `draw` of the stream (seed, offset).
void store_table_value(const TensorView& w, std::int64_t i, std::int64_t draw, float v, std::uint64_t seed,
                       std::uint64_t offset) {
  if (w.dtype() == DType::f32) {
    w.data_as<float>()[i] = v;
    return;
  }
  const auto flat = static_cast<std::uint64_t>(draw);
  const std::uint32_t h = sround::draw_bits(philox::random_block(seed, offset, flat >> 3), flat);
  const std::uint16_t bits = w.dtype() == DType::bf16 ? sround::to_bf16(v, h) : sround::to_f16(v, h);
  std::memcpy(static_cast<std::uint16_t*>(w.data()) + i, &bits, 2);
}

// The pooled row of bag (t, b) in an out / dout view [B, T, D] with strides (row, D, 1).
float* pooled_row(const TensorView& out, std::int64_t t, std::int64_t b) {
  return out.data_as<float>() + b * out.strides()[0] + t * out.strides()[1];
}

// The row stride of R / dR [B, L]: L (contiguous).
std::int64_t row_stride(const TensorView& r) { return r.size(1); }

}  // namespace

std::int64_t hash_row(std::uint32_t v, std::int64_t rows, RowHash hash) {
  const std::uint64_t x = hash == RowHash::seed ? std::uint64_t{v} + 1 : std::uint64_t{v};
  return static_cast<std::int64_t>(x % static_cast<std::uint64_t>(rows));
}

void embedding_bag_forward(const TableLayout& layout, const EmbeddingBagForwardArgs& a, const EmbeddingBagParams& p) {
  const std::int64_t nt = layout.num_tables(), batch = a.out.size(0), dim = a.weights.size(1);
  std::int32_t* keys = a.keys ? a.keys->data_as<std::int32_t>() : nullptr;
  std::int32_t* bags = a.bags ? a.bags->data_as<std::int32_t>() : nullptr;
  std::vector<double> acc(static_cast<std::size_t>(dim));
  for (std::int64_t t = 0; t < nt; ++t) {
    for (std::int64_t b = 0; b < batch; ++b) {
      const std::int64_t q = t * batch + b;
      // The bag's global rows, in input order.
      std::vector<std::int64_t> rows;
      std::int64_t first = q;  // the bag's first entry (raw input: entry q)
      if (a.raw) {
        const auto v = static_cast<std::uint32_t>(a.raw->data_as<std::int32_t>()[q]);
        rows.push_back(layout.base(static_cast<int>(t)) + hash_row(v, layout.rows(static_cast<int>(t)), p.hash));
      } else {
        const std::int64_t* off = a.offsets->data_as<std::int64_t>();
        const std::int64_t* idx = a.indices->data_as<std::int64_t>();
        first = off[q];
        for (std::int64_t k = off[q]; k < off[q + 1]; ++k) rows.push_back(layout.base(static_cast<int>(t)) + idx[k]);
      }
      std::fill(acc.begin(), acc.end(), 0.0);
      for (std::size_t k = 0; k < rows.size(); ++k) {
        for (std::int64_t c = 0; c < dim; ++c)
          acc[static_cast<std::size_t>(c)] += table_value(a.weights, rows[k] * dim + c);
        if (keys) {
          keys[first + static_cast<std::int64_t>(k)] = static_cast<std::int32_t>(static_cast<std::uint32_t>(rows[k]));
          bags[first + static_cast<std::int64_t>(k)] = static_cast<std::int32_t>(q);
        }
      }
      const double scale = p.pooling == Pooling::mean && !rows.empty() ? 1.0 / static_cast<double>(rows.size()) : 1.0;
      float* dst = pooled_row(a.out, t, b);
      for (std::int64_t c = 0; c < dim; ++c) dst[c] = static_cast<float>(acc[static_cast<std::size_t>(c)] * scale);
    }
  }
}

void embedding_bag_backward_update(const TableLayout& layout, const EmbeddingBagBackwardArgs& a,
                                   const EmbeddingOptimizerParams& p) {
  const std::int64_t nnz = a.keys.numel(), dim = a.weights.size(1);
  const std::int64_t batch = a.dout.size(0);
  const auto* keys = a.keys.data_as<std::int32_t>();
  const auto* bags = a.bags.data_as<std::int32_t>();
  // Entries grouped by row, in entry order within a row.
  std::vector<std::int64_t> order(static_cast<std::size_t>(nnz));
  for (std::int64_t k = 0; k < nnz; ++k) order[static_cast<std::size_t>(k)] = k;
  const auto key_of = [&](std::int64_t k) { return static_cast<std::uint32_t>(keys[k]); };
  std::stable_sort(order.begin(), order.end(), [&](std::int64_t x, std::int64_t y) { return key_of(x) < key_of(y); });

  float* state = a.state ? a.state->data_as<float>() : nullptr;
  if (p.update == EmbeddingUpdate::dense_gradient) fill(a.weights, 0.0);
  const bool rounds = a.weights.dtype() != DType::f32;
  const std::uint64_t offset =
      p.offset + (rounds && p.offset_counter.data() != nullptr ? *p.offset_counter.data_as<const std::uint64_t>() : 0);
  // Element c of the row: its value, and the store of its new value (the double result rounded
  // to f32, the value the GPU computes, then stored in the table's dtype).
  const auto get = [&](std::uint32_t row, std::int64_t c) {
    return static_cast<double>(table_value(a.weights, std::int64_t{row} * dim + c));
  };
  // The row's place at the layout's draw bases (its table: that of any of its bags).
  std::int64_t draw_row = 0;
  const auto set = [&](std::uint32_t row, std::int64_t c, double v) {
    const std::int64_t at = std::int64_t{row} * dim + c;
    store_table_value(a.weights, at, draw_row * dim + c, static_cast<float>(v), p.seed, offset);
  };
  std::vector<double> g(static_cast<std::size_t>(dim));
  for (std::size_t s = 0; s < order.size();) {
    const std::uint32_t row = key_of(order[s]);
    const auto t = static_cast<int>(static_cast<std::uint32_t>(bags[order[s]]) / static_cast<std::uint64_t>(batch));
    draw_row = std::int64_t{row} - layout.base(t) + layout.draw_base(t);
    std::fill(g.begin(), g.end(), 0.0);
    for (; s < order.size() && key_of(order[s]) == row; ++s) {
      const auto q = static_cast<std::int64_t>(static_cast<std::uint32_t>(bags[order[s]]));
      double scale = 1.0;
      if (p.pooling == Pooling::mean) {
        const std::int64_t* off = a.offsets->data_as<std::int64_t>();
        scale = 1.0 / static_cast<double>(off[q + 1] - off[q]);
      }
      const float* src = pooled_row(a.dout, q / batch, q % batch);
      for (std::int64_t c = 0; c < dim; ++c) g[static_cast<std::size_t>(c)] += src[c] * scale;
    }
    switch (p.update) {
      case EmbeddingUpdate::sgd:
        for (std::int64_t c = 0; c < dim; ++c) set(row, c, get(row, c) - p.lr * g[static_cast<std::size_t>(c)]);
        break;
      case EmbeddingUpdate::adagrad:
        for (std::int64_t c = 0; c < dim; ++c) {
          const double gc = g[static_cast<std::size_t>(c)];
          float& st = state[std::int64_t{row} * dim + c];
          st = static_cast<float>(st + gc * gc);
          set(row, c, get(row, c) - p.lr * gc / (std::sqrt(static_cast<double>(st)) + p.eps));
        }
        break;
      case EmbeddingUpdate::rowwise_adagrad: {
        double sumsq = 0;
        for (double gc : g) sumsq += gc * gc;
        float& st = state[row];
        st = static_cast<float>(st + sumsq / static_cast<double>(dim));
        const double step = p.lr / (std::sqrt(static_cast<double>(st)) + p.eps);
        for (std::int64_t c = 0; c < dim; ++c) set(row, c, get(row, c) - step * g[static_cast<std::size_t>(c)]);
        break;
      }
      case EmbeddingUpdate::store_gradient:
      case EmbeddingUpdate::dense_gradient:
        for (std::int64_t c = 0; c < dim; ++c) set(row, c, g[static_cast<std::size_t>(c)]);
        break;
    }
  }
}

void dense_optimizer_update(const DenseOptimizerArgs& a, const DenseOptimizerParams& p) {
  // In float, as the CUDA kernel computes it (not in double: this is what the GPU must match).
  const std::int64_t n = a.param.numel();
  float* param = a.param.data_as<float>();
  const float* grad = a.grad.data_as<float>();
  if (!p.adagrad) {
    for (std::int64_t i = 0; i < n; ++i) param[i] -= p.lr * grad[i];
    return;
  }
  float* state = a.state->data_as<float>();
  for (std::int64_t i = 0; i < n; ++i) {
    state[i] += grad[i] * grad[i];
    param[i] -= p.lr * grad[i] / (std::sqrt(state[i]) + p.eps);
  }
}

void interaction_forward(const InteractionForwardArgs& a, const InteractionParams& p) {
  const std::int64_t batch = a.z.size(0), nf = a.z.size(1), dim = a.z.size(2), n = nf * dim;
  const std::int64_t size = interaction_size(p, nf, dim), ldr = row_stride(a.r);
  for (std::int64_t b = 0; b < batch; ++b) {
    const float* zb = a.z.data_as<float>() + b * n;
    float* rb = a.r.data_as<float>() + b * ldr;
    switch (p.kind) {
      case InteractionKind::dot: {
        std::copy(zb, zb + dim, rb);
        std::int64_t k = dim;
        for (std::uint32_t pair : a.pairs->host()) {
          const std::int64_t i = pair >> 16, j = pair & 0xffffu;
          double s = 0;
          for (std::int64_t c = 0; c < dim; ++c) s += static_cast<double>(zb[i * dim + c]) * zb[j * dim + c];
          rb[k++] = static_cast<float>(s);
        }
        break;
      }
      case InteractionKind::cat: std::copy(zb, zb + n, rb); break;
      case InteractionKind::outer:
        for (std::int64_t i = 0; i < n; ++i)
          for (std::int64_t j = 0; j < n; ++j) rb[i * n + j] = static_cast<float>(static_cast<double>(zb[i]) * zb[j]);
        break;
    }
    std::fill(rb + size, rb + ldr, 0.0f);  // padding columns
  }
}

void interaction_backward(const InteractionBackwardArgs& a, const InteractionParams& p) {
  const std::int64_t batch = a.z.size(0), nf = a.z.size(1), dim = a.z.size(2), n = nf * dim;
  const std::int64_t ldr = row_stride(a.dr);
  std::vector<double> acc(static_cast<std::size_t>(n));
  for (std::int64_t b = 0; b < batch; ++b) {
    const float* zb = a.z.data_as<float>() + b * n;
    const float* gb = a.dr.data_as<float>() + b * ldr;
    float* db = a.dz.data_as<float>() + b * n;
    std::fill(acc.begin(), acc.end(), 0.0);
    switch (p.kind) {
      case InteractionKind::dot: {
        for (std::int64_t c = 0; c < dim; ++c) acc[static_cast<std::size_t>(c)] = gb[c];
        std::int64_t k = dim;
        for (std::uint32_t pair : a.pairs->host()) {
          const std::int64_t i = pair >> 16, j = pair & 0xffffu;
          const double g = gb[k++];
          for (std::int64_t c = 0; c < dim; ++c) {
            acc[static_cast<std::size_t>(i * dim + c)] += g * zb[j * dim + c];
            acc[static_cast<std::size_t>(j * dim + c)] += g * zb[i * dim + c];
          }
        }
        if (a.relu_x)
          for (std::int64_t c = 0; c < dim; ++c)
            if (!(zb[c] > 0.0f)) acc[static_cast<std::size_t>(c)] = 0.0;
        break;
      }
      case InteractionKind::cat:
        for (std::int64_t i = 0; i < n; ++i) acc[static_cast<std::size_t>(i)] = gb[i];
        break;
      case InteractionKind::outer:
        // r_ij = c_i c_j: dc_i = sum_j (g_ij + g_ji) c_j.
        for (std::int64_t i = 0; i < n; ++i)
          for (std::int64_t j = 0; j < n; ++j)
            acc[static_cast<std::size_t>(i)] += (static_cast<double>(gb[i * n + j]) + gb[j * n + i]) * zb[j];
        break;
    }
    for (std::int64_t i = 0; i < n; ++i) db[i] = static_cast<float>(acc[static_cast<std::size_t>(i)]);
  }
}

void sigmoid_bce_forward_backward(const SigmoidBceArgs& a, const SigmoidBceParams& p) {
  if (!p.unfused) return reference::sigmoid_bce_forward_backward(a);
  // PyTorch's BCELoss on p = sigmoid(x): p is rounded to f32 (it is a tensor there), each log
  // clamped at -100.
  const std::int64_t n = a.logits.numel();
  const float* x = a.logits.data_as<float>();
  const float* y = a.labels.data_as<float>();
  float* prob = a.probabilities->data_as<float>();
  float* dx = a.dlogits.data_as<float>();
  double sum = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const float pi = static_cast<float>(1.0 / (1.0 + std::exp(-static_cast<double>(x[i]))));
    prob[i] = pi;
    const double yi = y[i];
    sum -= yi * std::max(std::log(static_cast<double>(pi)), -100.0) +
           (1.0 - yi) * std::max(std::log(1.0 - static_cast<double>(pi)), -100.0);
    dx[i] = static_cast<float>((static_cast<double>(pi) - yi) / static_cast<double>(n));
  }
  double* acc = a.accumulator.data_as<double>();
  acc[0] += sum / static_cast<double>(n);
  acc[1] += 1.0;
}

void sigmoid_bce_forward_backward(const SigmoidBceArgs& a) {
  const std::int64_t n = a.logits.numel();
  const float* x = a.logits.data_as<float>();
  const float* y = a.labels.data_as<float>();
  float* dx = a.dlogits.data_as<float>();
  double sum = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const double xi = x[i];
    sum += std::max(xi, 0.0) - xi * y[i] + std::log1p(std::exp(-std::fabs(xi)));
    dx[i] = static_cast<float>((1.0 / (1.0 + std::exp(-xi)) - y[i]) / static_cast<double>(n));
  }
  double* acc = a.accumulator.data_as<double>();
  acc[0] += sum / static_cast<double>(n);
  acc[1] += 1.0;
}

// ---- DCNv2 cross layer ----------------------------------------------------------------------------
// Sample by sample, everything in double from the f32 inputs; one rounding at each store. The
// backward reads a row of dy before it writes that row of dL/dx_l over it.

namespace {
// Element (i, j) of a matrix view with unit column stride.
inline float at(const TensorView& m, std::int64_t i, std::int64_t j) {
  return m.data_as<float>()[i * m.strides()[0] + j];
}
inline float* row_of(const TensorView& m, std::int64_t i) { return m.data_as<float>() + i * m.strides()[0]; }
}  // namespace

void cross_layer_forward(const CrossLayerForwardArgs& a) {
  const std::int64_t batch = a.x0.size(0), n = a.x0.size(1), rank = a.u.size(1);
  const float* bias = a.bias.data_as<float>();
  std::vector<double> h(static_cast<std::size_t>(rank));
  for (std::int64_t b = 0; b < batch; ++b) {
    for (std::int64_t k = 0; k < rank; ++k) {
      double acc = 0;
      for (std::int64_t j = 0; j < n; ++j) acc += double{at(a.v, k, j)} * at(a.xl, b, j);
      h[static_cast<std::size_t>(k)] = acc;
      row_of(a.h, b)[k] = static_cast<float>(acc);
    }
    float* out = row_of(a.out, b);
    for (std::int64_t j = 0; j < n; ++j) {
      double p = 0;
      for (std::int64_t k = 0; k < rank; ++k) p += double{at(a.u, j, k)} * h[static_cast<std::size_t>(k)];
      out[j] = static_cast<float>(double{at(a.x0, b, j)} * (p + bias[j]) + at(a.xl, b, j));
    }
  }
}

void cross_layer_backward(const CrossLayerBackwardArgs& a) {
  const std::int64_t batch = a.x0.size(0), n = a.x0.size(1), rank = a.u.size(1);
  const auto un = static_cast<std::size_t>(n), ur = static_cast<std::size_t>(rank);
  const float* bias = a.bias.data_as<float>();
  std::vector<double> du(un * ur, 0.0), dv(ur * un, 0.0), db(un, 0.0);
  std::vector<double> dy(un), pb(un), dh(ur);
  for (std::int64_t b = 0; b < batch; ++b) {
    const float* hb = row_of(a.h, b);
    float* dyb = row_of(a.dy, b);
    float* dx0 = row_of(a.dx0, b);
    for (std::size_t j = 0; j < un; ++j) dy[j] = dyb[j];
    std::fill(dh.begin(), dh.end(), 0.0);
    for (std::int64_t j = 0; j < n; ++j) {
      const auto uj = static_cast<std::size_t>(j);
      double p = 0;
      for (std::int64_t k = 0; k < rank; ++k) p += double{at(a.u, j, k)} * hb[k];
      pb[uj] = p + bias[j];
      const double dp = dy[uj] * at(a.x0, b, j);
      db[uj] += dp;
      for (std::int64_t k = 0; k < rank; ++k) {
        du[uj * ur + static_cast<std::size_t>(k)] += dp * hb[k];
        dh[static_cast<std::size_t>(k)] += dp * at(a.u, j, k);
      }
    }
    for (std::int64_t j = 0; j < n; ++j) {
      double dxl = 0;  // (dh V)_j; dL/dx_l = dy + (dh V)
      for (std::int64_t k = 0; k < rank; ++k) {
        const double dhk = dh[static_cast<std::size_t>(k)];
        dxl += dhk * at(a.v, k, j);
        dv[static_cast<std::size_t>(k) * un + static_cast<std::size_t>(j)] += dhk * at(a.xl, b, j);
      }
      const double dyj = dy[static_cast<std::size_t>(j)];
      const double own = dyj * pb[static_cast<std::size_t>(j)];
      if (a.first_layer) {
        dx0[j] = static_cast<float>(dx0[j] + own + dyj + dxl);
      } else {
        dx0[j] = static_cast<float>(dx0[j] + own);
        dyb[j] = static_cast<float>(dyj + dxl);
      }
    }
  }
  for (std::int64_t j = 0; j < n; ++j) {
    a.dbias.data_as<float>()[j] = static_cast<float>(db[static_cast<std::size_t>(j)]);
    for (std::int64_t k = 0; k < rank; ++k) {
      row_of(a.du, j)[k] = static_cast<float>(du[static_cast<std::size_t>(j) * ur + static_cast<std::size_t>(k)]);
      row_of(a.dv, k)[j] = static_cast<float>(dv[static_cast<std::size_t>(k) * un + static_cast<std::size_t>(j)]);
    }
  }
}

void permute_bags(const PermuteBagsArgs& a) {
  const std::int64_t n = a.lengths.numel();
  const auto* len = a.lengths.data_as<const std::int64_t>();
  const auto* perm = a.permutation.data_as<const std::int64_t>();
  const auto* in = a.indices.data_as<const std::int64_t>();
  auto* off = a.out_offsets.data_as<std::int64_t>();
  auto* out = a.out_indices.data_as<std::int64_t>();
  std::vector<std::int64_t> start(static_cast<std::size_t>(n) + 1, 0);  // the input bags' offsets
  for (std::int64_t q = 0; q < n; ++q) start[static_cast<std::size_t>(q) + 1] = start[static_cast<std::size_t>(q)] + len[q];
  off[0] = 0;
  for (std::int64_t k = 0; k < n; ++k) {
    const std::int64_t* bag = in + start[static_cast<std::size_t>(perm[k])];
    off[k + 1] = off[k] + len[perm[k]];
    std::copy(bag, bag + len[perm[k]], out + off[k]);
  }
}

}  // namespace fk::reference
