// Binary classification metrics for click prediction, computed exactly on the host.
//   roc_auc   area under the ROC curve: the probability that a random positive scores above a
//             random negative, ties counting one half (Mann-Whitney U from average ranks, after
//             one sort). NaN when the labels are all of one class.
//   log_loss  mean of -(y log p + (1 - y) log(1 - p)), p clamped to [1e-7, 1 - 1e-7].
//   accuracy  fraction of samples whose prediction (p > threshold) equals the label.
// Labels are 0 or 1 (any value > 0.5 counts as 1). Scores must be finite: a NaN or infinite score
// (a diverged model) is an fk::Error naming its index.
#pragma once

#include <cstdint>
#include <span>

namespace fk::models {

double roc_auc(std::span<const float> scores, std::span<const float> labels);
double log_loss(std::span<const float> probabilities, std::span<const float> labels);
double accuracy(std::span<const float> probabilities, std::span<const float> labels, float threshold = 0.5f);

struct BinaryMetrics {
  std::int64_t samples = 0;
  double positive_rate = 0;
  double log_loss = 0;
  double auc = 0;
  double accuracy = 0;
};
BinaryMetrics evaluate_binary(std::span<const float> probabilities, std::span<const float> labels);

}  // namespace fk::models
