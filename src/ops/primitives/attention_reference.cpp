// The spec of attention_forward and attention_backward: for each (batch, head) and query row i, the
// scores s_j over the visible keys (AttentionOptions: causal top-left or bottom-right, sliding
// window, softcap; grouped-query heads) in double, a max-shifted softmax in double, out_i = sum_j
// p_j v_j rounded once to out's dtype (through float, as the kernels round their fp32
// accumulators), lse_i = max + log(sum exp(s_j - max)). The backward recomputes p_ij = exp(s_ij -
// lse_i) from the lse it is given, as the kernels do. Written to be obviously right: one row of
// scores at a time, O(Sq * Sk * D) work. It is also the CPU backend. A packed (varlen) batch is
// the same loops over each sequence's rows: only where the rows are differs (Rows).
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

// Where one sequence's rows are, in elements (a row of D is contiguous in every layout): q, out,
// dout and dq row (h, i) at q0 + h * q_head + i * q_tok; k, v, dk and dv row (kh, j) at kv0 + kh *
// kv_head + j * kv_tok; lse (h, i) at l0 + h * l_head + i. Dense (a batch entry of q [B, H, Sq, D],
// k/v [B, Hk, Sk, D], lse [B, H, Sq]) and packed (a sequence of q [total_q, H, D], k/v
// [total_k, Hk, D], lse [H, total_q]) differ only in these numbers.
struct Rows {
  std::int64_t sq, sk;
  std::int64_t q0, q_head, q_tok, kv0, kv_head, kv_tok, l0, l_head;
  std::int64_t q(std::int64_t h, std::int64_t i) const { return q0 + h * q_head + i * q_tok; }
  std::int64_t kv(std::int64_t kh, std::int64_t j) const { return kv0 + kh * kv_head + j * kv_tok; }
  std::int64_t l(std::int64_t h, std::int64_t i) const { return l0 + h * l_head + i; }
};

// The heads of one call: H, Hk, D, and the group size H / Hk.
struct Heads {
  std::int64_t h, hk, d;
  std::int64_t group() const { return h / hk; }
};

Rows dense_rows(std::int64_t b, const Heads& n, std::int64_t sq, std::int64_t sk) {
  return {sq, sk, b * n.h * sq * n.d, sq * n.d, n.d, b * n.hk * sk * n.d, sk * n.d, n.d, b * n.h * sq, sq};
}

Rows packed_rows(std::int64_t b, const Heads& n, const AttentionVarlen& seqs, std::int64_t total_q) {
  const std::int32_t* cq = seqs.cu_seqlens_q.data_as<const std::int32_t>();
  const std::int32_t* ck = seqs.cu_seqlens_k.data_as<const std::int32_t>();
  return {cq[b + 1] - cq[b], ck[b + 1] - ck[b], cq[b] * n.h * n.d, n.d, n.h * n.d, ck[b] * n.hk * n.d, n.d,
          n.hk * n.d, cq[b], total_q};
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

// Every head of one sequence.
void forward_sequence(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                      const TensorView& lse, const Rows& r, const Heads& n, const AttentionOptions& opt) {
  std::vector<double> s(static_cast<std::size_t>(r.sk)), o(static_cast<std::size_t>(n.d));
  for (std::int64_t hi = 0; hi < n.h; ++hi) {
    const std::int64_t kh = hi / n.group();
    for (std::int64_t i = 0; i < r.sq; ++i) {
      const KeyRange keys = visible_keys(i, r.sq, r.sk, opt);
      const std::int64_t qi = r.q(hi, i);
      double mx = kNegInf;
      for (std::int64_t j = keys.lo; j < keys.hi; ++j) {
        s[j] = capped(raw_score(q, k, qi, r.kv(kh, j), n.d, opt.scale), opt.softcap);
        mx = std::max(mx, s[j]);
      }
      double sum = 0.0;
      std::fill(o.begin(), o.end(), 0.0);
      for (std::int64_t j = keys.lo; j < keys.hi; ++j) {
        const double p = std::exp(s[j] - mx);
        sum += p;
        for (std::int64_t c = 0; c < n.d; ++c) o[c] += p * load(v, r.kv(kh, j) + c);
      }
      const bool any = keys.hi > keys.lo;
      for (std::int64_t c = 0; c < n.d; ++c) store(out, qi + c, any ? o[c] / sum : 0.0);
      lse.data_as<float>()[r.l(hi, i)] = static_cast<float>(any ? mx + std::log(sum) : kNegInf);
    }
  }
}

// Every head of one sequence; dk and dv accumulated into dk_acc and dv_acc (dk's elements).
void backward_sequence(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                       const TensorView& dout, const TensorView& lse, const TensorView& dq, std::vector<double>& dk_acc,
                       std::vector<double>& dv_acc, const Rows& r, const Heads& n, const AttentionOptions& opt) {
  std::vector<double> dq_row(static_cast<std::size_t>(n.d));
  for (std::int64_t hi = 0; hi < n.h; ++hi) {
    const std::int64_t kh = hi / n.group();
    for (std::int64_t i = 0; i < r.sq; ++i) {
      const KeyRange keys = visible_keys(i, r.sq, r.sk, opt);
      const std::int64_t qi = r.q(hi, i);
      const double l = lse.data_as<const float>()[r.l(hi, i)];
      double delta = 0.0;  // rowsum(dout_i ⊙ out_i)
      for (std::int64_t c = 0; c < n.d; ++c) delta += load(dout, qi + c) * load(out, qi + c);
      std::fill(dq_row.begin(), dq_row.end(), 0.0);
      for (std::int64_t j = keys.lo; j < keys.hi && std::isfinite(l); ++j) {
        const std::int64_t kj = r.kv(kh, j);
        const double raw = raw_score(q, k, qi, kj, n.d, opt.scale);
        const double p = std::exp(capped(raw, opt.softcap) - l);
        double dp = 0.0;
        for (std::int64_t c = 0; c < n.d; ++c) dp += load(dout, qi + c) * load(v, kj + c);
        const double ds = p * (dp - delta) * capped_slope(raw, opt.softcap) * opt.scale;
        for (std::int64_t c = 0; c < n.d; ++c) {
          dq_row[c] += ds * load(k, kj + c);
          dk_acc[static_cast<std::size_t>(kj + c)] += ds * load(q, qi + c);
          dv_acc[static_cast<std::size_t>(kj + c)] += p * load(dout, qi + c);
        }
      }
      for (std::int64_t c = 0; c < n.d; ++c) store(dq, qi + c, dq_row[c]);
    }
  }
}

// dk and dv, summed in double over each group's q heads, stored once.
void store_kv_grads(const TensorView& dk, const TensorView& dv, const std::vector<double>& dk_acc,
                    const std::vector<double>& dv_acc) {
  for (std::int64_t e = 0; e < dk.numel(); ++e) {
    store(dk, e, dk_acc[static_cast<std::size_t>(e)]);
    store(dv, e, dv_acc[static_cast<std::size_t>(e)]);
  }
}

}  // namespace

void attention_forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                       const TensorView& lse, const AttentionOptions& opt) {
  const Heads n{q.size(1), k.size(1), q.size(3)};
  for (std::int64_t b = 0; b < q.size(0); ++b)
    forward_sequence(q, k, v, out, lse, dense_rows(b, n, q.size(2), k.size(2)), n, opt);
}

void attention_forward_varlen(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                              const TensorView& lse, const AttentionVarlen& seqs, const AttentionOptions& opt) {
  const Heads n{q.size(1), k.size(1), q.size(2)};
  for (std::int64_t b = 0; b + 1 < seqs.cu_seqlens_q.numel(); ++b)
    forward_sequence(q, k, v, out, lse, packed_rows(b, n, seqs, q.size(0)), n, opt);
}

void attention_forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                       const TensorView& lse, bool causal, float scale) {
  reference::attention_forward(q, k, v, out, lse, AttentionOptions{.causal = causal, .scale = scale});
}

void attention_backward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                        const TensorView& dout, const TensorView& lse, const TensorView& dq, const TensorView& dk,
                        const TensorView& dv, const AttentionOptions& opt) {
  const Heads n{q.size(1), k.size(1), q.size(3)};
  std::vector<double> dk_acc(static_cast<std::size_t>(dk.numel()), 0.0), dv_acc(dk_acc);
  for (std::int64_t b = 0; b < q.size(0); ++b)
    backward_sequence(q, k, v, out, dout, lse, dq, dk_acc, dv_acc, dense_rows(b, n, q.size(2), k.size(2)), n, opt);
  store_kv_grads(dk, dv, dk_acc, dv_acc);
}

void attention_backward_varlen(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                               const TensorView& dout, const TensorView& lse, const TensorView& dq,
                               const TensorView& dk, const TensorView& dv, const AttentionVarlen& seqs,
                               const AttentionOptions& opt) {
  const Heads n{q.size(1), k.size(1), q.size(2)};
  std::vector<double> dk_acc(static_cast<std::size_t>(dk.numel()), 0.0), dv_acc(dk_acc);
  for (std::int64_t b = 0; b + 1 < seqs.cu_seqlens_q.numel(); ++b)
    backward_sequence(q, k, v, out, dout, lse, dq, dk_acc, dv_acc, packed_rows(b, n, seqs, q.size(0)), n, opt);
  store_kv_grads(dk, dv, dk_acc, dv_acc);
}

}  // namespace fk::reference
