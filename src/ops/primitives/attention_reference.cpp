// The spec of attention_forward and attention_backward: for each (batch, head) and query row i, the
// scores s_j over the visible keys (AttentionOptions: causal top-left or bottom-right, sliding
// window, softcap; grouped-query heads) in double, a max-shifted softmax in double, out_i = sum_j
// p_j v_j rounded once to out's dtype (through float, as the kernels round their fp32
// accumulators), lse_i = max + log(sum exp(s_j - max)). The backward recomputes p_ij = exp(s_ij -
// lse_i) from the lse it is given, as the kernels do. Written to be obviously right: one row of
// scores at a time, O(Sq * Sk * D) work. It is also the CPU backend.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "fusekit/ops/attention.hpp"
#include "fusekit/ops/primitives.hpp"
#include "ops/common/reference_io.hpp"

namespace fk::reference {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// The keys [lo, hi) query i sees (empty when lo >= hi).
struct KeyRange {
  std::int64_t lo, hi;
};

KeyRange visible_keys(std::int64_t i, std::int64_t sq, std::int64_t sk, const AttentionOptions& o) {
  const std::int64_t offset = o.bottom_right ? sk - sq : 0;
  const std::int64_t right = o.causal ? 0 : o.window_right;
  std::int64_t lo = 0, hi = sk;
  if (o.window_left >= 0) lo = std::max<std::int64_t>(lo, i + offset - o.window_left);
  if (right >= 0) hi = std::min<std::int64_t>(hi, i + offset + right + 1);
  return {lo, std::max(lo, hi)};
}

// The geometry of one call: B, H, Hk, Sq, Sk, D, and the group size H / Hk.
struct Shape {
  std::int64_t b, h, hk, sq, sk, d;
  std::int64_t q_base(std::int64_t bi, std::int64_t hi) const { return (bi * h + hi) * sq * d; }
  std::int64_t kv_base(std::int64_t bi, std::int64_t hi) const { return (bi * hk + hi / (h / hk)) * sk * d; }
};

Shape shape_of(const TensorView& q, const TensorView& k) {
  return {q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3)};
}

// The raw score scale * q_i · k_j, then the softcapped score and its derivative with respect to
// the raw one.
double raw_score(const TensorView& q, const TensorView& k, std::int64_t qi, std::int64_t kj, std::int64_t d,
                 double scale) {
  double dot = 0.0;
  for (std::int64_t c = 0; c < d; ++c) dot += load(q, qi + c) * load(k, kj + c);
  return scale * dot;
}

double capped(double raw, double cap) { return cap > 0.0 ? cap * std::tanh(raw / cap) : raw; }
double capped_slope(double raw, double cap) {
  if (cap <= 0.0) return 1.0;
  const double t = std::tanh(raw / cap);
  return 1.0 - t * t;
}

}  // namespace

void attention_forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                       const TensorView& lse, const AttentionOptions& opt) {
  const Shape g = shape_of(q, k);
  std::vector<double> s(static_cast<std::size_t>(g.sk)), o(static_cast<std::size_t>(g.d));
  for (std::int64_t bi = 0; bi < g.b; ++bi)
    for (std::int64_t hi = 0; hi < g.h; ++hi) {
      const std::int64_t q0 = g.q_base(bi, hi), k0 = g.kv_base(bi, hi);
      for (std::int64_t i = 0; i < g.sq; ++i) {
        const KeyRange r = visible_keys(i, g.sq, g.sk, opt);
        double mx = kNegInf;
        for (std::int64_t j = r.lo; j < r.hi; ++j) {
          s[j] = capped(raw_score(q, k, q0 + i * g.d, k0 + j * g.d, g.d, opt.scale), opt.softcap);
          mx = std::max(mx, s[j]);
        }
        double sum = 0.0;
        std::fill(o.begin(), o.end(), 0.0);
        for (std::int64_t j = r.lo; j < r.hi; ++j) {
          const double p = std::exp(s[j] - mx);
          sum += p;
          for (std::int64_t c = 0; c < g.d; ++c) o[c] += p * load(v, k0 + j * g.d + c);
        }
        const bool any = r.hi > r.lo;
        for (std::int64_t c = 0; c < g.d; ++c) store(out, q0 + i * g.d + c, any ? o[c] / sum : 0.0);
        lse.data_as<float>()[(bi * g.h + hi) * g.sq + i] = static_cast<float>(any ? mx + std::log(sum) : kNegInf);
      }
    }
}

void attention_forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                       const TensorView& lse, bool causal, float scale) {
  reference::attention_forward(q, k, v, out, lse, AttentionOptions{.causal = causal, .scale = scale});
}

void attention_backward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                        const TensorView& dout, const TensorView& lse, const TensorView& dq, const TensorView& dk,
                        const TensorView& dv, const AttentionOptions& opt) {
  const Shape g = shape_of(q, k);
  // dk and dv sum over the q heads of a group: accumulate in double, store once.
  std::vector<double> dk_acc(static_cast<std::size_t>(dk.numel()), 0.0), dv_acc(static_cast<std::size_t>(dv.numel()), 0.0);
  std::vector<double> dq_row(static_cast<std::size_t>(g.d));
  for (std::int64_t bi = 0; bi < g.b; ++bi)
    for (std::int64_t hi = 0; hi < g.h; ++hi) {
      const std::int64_t q0 = g.q_base(bi, hi), k0 = g.kv_base(bi, hi);
      for (std::int64_t i = 0; i < g.sq; ++i) {
        const KeyRange r = visible_keys(i, g.sq, g.sk, opt);
        const double l = lse.data_as<const float>()[(bi * g.h + hi) * g.sq + i];
        double delta = 0.0;  // rowsum(dout_i ⊙ out_i)
        for (std::int64_t c = 0; c < g.d; ++c) delta += load(dout, q0 + i * g.d + c) * load(out, q0 + i * g.d + c);
        std::fill(dq_row.begin(), dq_row.end(), 0.0);
        for (std::int64_t j = r.lo; j < r.hi && std::isfinite(l); ++j) {
          const double raw = raw_score(q, k, q0 + i * g.d, k0 + j * g.d, g.d, opt.scale);
          const double p = std::exp(capped(raw, opt.softcap) - l);
          double dp = 0.0;
          for (std::int64_t c = 0; c < g.d; ++c) dp += load(dout, q0 + i * g.d + c) * load(v, k0 + j * g.d + c);
          const double ds = p * (dp - delta) * capped_slope(raw, opt.softcap) * opt.scale;
          for (std::int64_t c = 0; c < g.d; ++c) {
            dq_row[c] += ds * load(k, k0 + j * g.d + c);
            dk_acc[static_cast<std::size_t>(k0 + j * g.d + c)] += ds * load(q, q0 + i * g.d + c);
            dv_acc[static_cast<std::size_t>(k0 + j * g.d + c)] += p * load(dout, q0 + i * g.d + c);
          }
        }
        for (std::int64_t c = 0; c < g.d; ++c) store(dq, q0 + i * g.d + c, dq_row[c]);
      }
    }
  for (std::int64_t e = 0; e < dk.numel(); ++e) {
    store(dk, e, dk_acc[static_cast<std::size_t>(e)]);
    store(dv, e, dv_acc[static_cast<std::size_t>(e)]);
  }
}

}  // namespace fk::reference
