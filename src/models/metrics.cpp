#include "fusekit/models/metrics.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "fusekit/core/error.hpp"

namespace fk::models {

namespace {

void check_sizes(std::size_t a, std::size_t b, const char* op) {
  FK_CHECK_ARG(a == b, op, "labels", fmt::format("{} labels (one per score)", a), fmt::format("{}", b));
}

bool positive(float y) { return y > 0.5f; }

// Metrics are defined on finite scores only: a NaN has no rank (and would leave the AUC's sort
// without an order), an infinite probability no log loss.
void check_finite(std::span<const float> scores, const char* op) {
  for (std::size_t i = 0; i < scores.size(); ++i)
    FK_CHECK_ARG(std::isfinite(scores[i]), op, "scores", "finite scores (a diverged model gives NaN or inf)",
                 fmt::format("{} at index {}", scores[i], i));
}

}  // namespace

double roc_auc(std::span<const float> scores, std::span<const float> labels) {
  check_sizes(scores.size(), labels.size(), "models::roc_auc");
  check_finite(scores, "models::roc_auc");
  const std::size_t n = scores.size();
  std::vector<std::size_t> order(n);
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return scores[a] < scores[b]; });
  // Sum of the (1-based, tie-averaged) ranks of the positives.
  double rank_sum = 0;
  std::int64_t pos = 0;
  for (std::size_t i = 0; i < n;) {
    std::size_t j = i;
    while (j < n && scores[order[j]] == scores[order[i]]) ++j;
    const double avg_rank = 0.5 * static_cast<double>(i + 1 + j);  // mean of i+1 .. j
    for (std::size_t k = i; k < j; ++k)
      if (positive(labels[order[k]])) {
        rank_sum += avg_rank;
        ++pos;
      }
    i = j;
  }
  const std::int64_t neg = static_cast<std::int64_t>(n) - pos;
  if (pos == 0 || neg == 0) return std::numeric_limits<double>::quiet_NaN();
  const double p = static_cast<double>(pos);
  return (rank_sum - p * (p + 1) / 2) / (p * static_cast<double>(neg));
}

double log_loss(std::span<const float> probabilities, std::span<const float> labels) {
  check_sizes(probabilities.size(), labels.size(), "models::log_loss");
  check_finite(probabilities, "models::log_loss");
  if (probabilities.empty()) return 0;
  constexpr double eps = 1e-7;
  double sum = 0;
  for (std::size_t i = 0; i < probabilities.size(); ++i) {
    const double p = std::clamp(static_cast<double>(probabilities[i]), eps, 1 - eps);
    sum -= positive(labels[i]) ? std::log(p) : std::log1p(-p);
  }
  return sum / static_cast<double>(probabilities.size());
}

double accuracy(std::span<const float> probabilities, std::span<const float> labels, float threshold) {
  check_sizes(probabilities.size(), labels.size(), "models::accuracy");
  check_finite(probabilities, "models::accuracy");
  if (probabilities.empty()) return 0;
  std::int64_t right = 0;
  for (std::size_t i = 0; i < probabilities.size(); ++i) right += (probabilities[i] > threshold) == positive(labels[i]);
  return static_cast<double>(right) / static_cast<double>(probabilities.size());
}

BinaryMetrics evaluate_binary(std::span<const float> probabilities, std::span<const float> labels) {
  BinaryMetrics m;
  m.samples = static_cast<std::int64_t>(probabilities.size());
  std::int64_t pos = 0;
  for (float y : labels) pos += positive(y);
  m.positive_rate = m.samples ? static_cast<double>(pos) / static_cast<double>(m.samples) : 0;
  m.log_loss = log_loss(probabilities, labels);
  m.auc = roc_auc(probabilities, labels);
  m.accuracy = accuracy(probabilities, labels);
  return m;
}

}  // namespace fk::models
