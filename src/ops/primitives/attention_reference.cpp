// The spec of attention_forward: for each (batch, head) and query row i, the scores
// s_j = scale * q_i · k_j in double over the visible keys (j <= i when causal), a max-shifted
// softmax in double, out_i = sum_j p_j v_j rounded once to out's dtype (through float, as the
// kernels round their fp32 accumulators), lse_i = max + log(sum exp(s_j - max)). Written to be
// obviously right: it holds one row of scores at a time, O(Sq * Sk * D) work. It is also the CPU
// backend.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "fusekit/ops/primitives.hpp"
#include "ops/common/reference_io.hpp"

namespace fk::reference {

void attention_forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                       const TensorView& lse, bool causal, float scale) {
  const std::int64_t bh = q.size(0) * q.size(1), sq = q.size(2), sk = k.size(2), d = q.size(3);
  std::vector<double> s(static_cast<std::size_t>(sk));
  std::vector<double> o(static_cast<std::size_t>(d));
  for (std::int64_t h = 0; h < bh; ++h) {
    const std::int64_t q0 = h * sq * d, k0 = h * sk * d;  // q: (Sq, D), k and v: (Sk, D) of head h
    for (std::int64_t i = 0; i < sq; ++i) {
      const std::int64_t visible = causal ? std::min(sk, i + 1) : sk;
      double mx = -std::numeric_limits<double>::infinity();
      for (std::int64_t j = 0; j < visible; ++j) {
        double dot = 0.0;
        for (std::int64_t c = 0; c < d; ++c) dot += load(q, q0 + i * d + c) * load(k, k0 + j * d + c);
        s[j] = static_cast<double>(scale) * dot;
        mx = std::max(mx, s[j]);
      }
      double sum = 0.0;
      std::fill(o.begin(), o.end(), 0.0);
      for (std::int64_t j = 0; j < visible; ++j) {
        const double p = std::exp(s[j] - mx);
        sum += p;
        for (std::int64_t c = 0; c < d; ++c) o[c] += p * load(v, k0 + j * d + c);
      }
      for (std::int64_t c = 0; c < d; ++c) store(out, q0 + i * d + c, visible > 0 ? o[c] / sum : 0.0);
      lse.data_as<float>()[h * sq + i] =
          static_cast<float>(visible > 0 ? mx + std::log(sum) : -std::numeric_limits<double>::infinity());
    }
  }
}

}  // namespace fk::reference
