// The spec of the primitives family: plain loops, double accumulation, one rounding to c's dtype
// (through float, as the kernels hold their fp32 accumulators) at each store. It is also the CPU
// backend.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "fusekit/core/error.hpp"
#include "ops/common/reference_io.hpp"
#include "fusekit/ops/primitives.hpp"

namespace fk::reference {
namespace {

// Element strides of `t` against z's dimensions under broadcasting: 0 where t is broadcast.
std::vector<std::int64_t> broadcast_strides(const TensorView& t, const Dims& z) {
  std::vector<std::int64_t> s(static_cast<std::size_t>(z.size()), 0);
  const Dims own = contiguous_strides(t.shape());
  for (int d = 0; d < z.size(); ++d) {
    const int td = d - (z.size() - t.rank());
    if (td >= 0 && t.size(td) != 1) s[static_cast<std::size_t>(d)] = own[td];
  }
  return s;
}

// Calls f(z_index, x_index, y_index) for every element of z, in row-major order.
template <class F>
void for_each_broadcast(const TensorView& x, const TensorView& y, const Dims& z, F&& f) {
  const std::vector<std::int64_t> xs = broadcast_strides(x, z), ys = broadcast_strides(y, z);
  std::vector<std::int64_t> idx(static_cast<std::size_t>(z.size()), 0);
  for (std::int64_t i = 0; i < z.numel(); ++i) {
    std::int64_t xi = 0, yi = 0;
    for (std::size_t d = 0; d < idx.size(); ++d) {
      xi += idx[d] * xs[d];
      yi += idx[d] * ys[d];
    }
    f(i, xi, yi);
    for (int d = z.size() - 1; d >= 0; --d) {  // odometer increment of the multi-index
      if (++idx[static_cast<std::size_t>(d)] < z[d]) break;
      idx[static_cast<std::size_t>(d)] = 0;
    }
  }
}

double relu(double v) { return (v > 0.0 || std::isnan(v)) ? v : 0.0; }

// The fp32 product of two values that came from fp32-or-narrower tensors, as the kernels form it.
bool product_positive(double x, double y) { return static_cast<float>(x) * static_cast<float>(y) > 0.0f; }

}  // namespace

void broadcast_binary(BinaryOp op, const TensorView& x, const TensorView& y, const TensorView& z) {
  // A product or sum of two floats is exact in double; the store rounds it through float, which
  // is the fp32 operation's correctly rounded result.
  for_each_broadcast(x, y, z.shape(), [&](std::int64_t zi, std::int64_t xi, std::int64_t yi) {
    const double a = load(x, xi), b = load(y, yi);
    switch (op) {
      case BinaryOp::add: store(z, zi, a + b); break;
      case BinaryOp::mul: store(z, zi, a * b); break;
      case BinaryOp::mul_relu: store(z, zi, relu(a * b)); break;
    }
  });
}

void broadcast_binary_backward(BinaryOp op, const TensorView& x, const TensorView& y, const TensorView& dz,
                               const std::optional<TensorView>& dx, const std::optional<TensorView>& dy) {
  std::vector<double> gx(static_cast<std::size_t>(x.numel()), 0.0), gy(static_cast<std::size_t>(y.numel()), 0.0);
  for_each_broadcast(x, y, dz.shape(), [&](std::int64_t zi, std::int64_t xi, std::int64_t yi) {
    const double a = load(x, xi), b = load(y, yi), g = load(dz, zi);
    switch (op) {
      case BinaryOp::add:
        gx[static_cast<std::size_t>(xi)] += g;
        gy[static_cast<std::size_t>(yi)] += g;
        break;
      case BinaryOp::mul:
        gx[static_cast<std::size_t>(xi)] += g * b;
        gy[static_cast<std::size_t>(yi)] += g * a;
        break;
      case BinaryOp::mul_relu:
        if (product_positive(a, b)) {
          gx[static_cast<std::size_t>(xi)] += g * b;
          gy[static_cast<std::size_t>(yi)] += g * a;
        }
        break;
    }
  });
  if (dx)
    for (std::size_t i = 0; i < gx.size(); ++i) store(*dx, static_cast<std::int64_t>(i), gx[i]);
  if (dy)
    for (std::size_t i = 0; i < gy.size(); ++i) store(*dy, static_cast<std::int64_t>(i), gy[i]);
}

void row_sum(const TensorView& x, const TensorView& out) {
  const std::int64_t rows = x.size(0), cols = x.size(1);  // x: (rows, cols), out: (rows)
  for (std::int64_t r = 0; r < rows; ++r) {
    double acc = 0.0;
    for (std::int64_t c = 0; c < cols; ++c) acc += load(x, r * cols + c);
    store(out, r, acc);
  }
}

void softmax(const TensorView& x, const TensorView& y) {
  const std::int64_t rows = x.size(0), cols = x.size(1);  // x, y: (rows, cols); y may be x
  std::vector<double> row(static_cast<std::size_t>(cols));
  for (std::int64_t r = 0; r < rows; ++r) {
    double m = -std::numeric_limits<double>::infinity();
    for (std::int64_t c = 0; c < cols; ++c) {
      row[static_cast<std::size_t>(c)] = load(x, r * cols + c);
      m = std::max(m, row[static_cast<std::size_t>(c)]);
    }
    double sum = 0.0;
    for (double& v : row) sum += (v = std::exp(v - m));  // a row of -inf: -inf - -inf = NaN
    for (std::int64_t c = 0; c < cols; ++c) store(y, r * cols + c, row[static_cast<std::size_t>(c)] / sum);
  }
}

void conv2d(const TensorView& x, const TensorView& w, const TensorView& y, Conv2dPadding padding) {
  // x: (N, C, H, W), w: (O, C, KH, KW), y: (N, O, Ho, Wo)
  const std::int64_t n_img = x.size(0), ch = x.size(1), h = x.size(2), wd = x.size(3);
  const std::int64_t outs = w.size(0), kh = w.size(2), kw = w.size(3), ho = y.size(2), wo = y.size(3);
  const std::int64_t top = padding == Conv2dPadding::same ? (kh - 1) / 2 : 0;
  const std::int64_t left = padding == Conv2dPadding::same ? (kw - 1) / 2 : 0;
  for (std::int64_t n = 0; n < n_img; ++n)
    for (std::int64_t o = 0; o < outs; ++o)
      for (std::int64_t i = 0; i < ho; ++i)
        for (std::int64_t j = 0; j < wo; ++j) {
          double acc = 0.0;
          for (std::int64_t c = 0; c < ch; ++c)
            for (std::int64_t a = 0; a < kh; ++a)
              for (std::int64_t b = 0; b < kw; ++b) {
                const std::int64_t r = i + a - top, q = j + b - left;
                if (r < 0 || r >= h || q < 0 || q >= wd) continue;
                acc += load(w, ((o * ch + c) * kh + a) * kw + b) * load(x, ((n * ch + c) * h + r) * wd + q);
              }
          store(y, ((n * outs + o) * ho + i) * wo + j, acc);
        }
}

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
