// AUC, log loss and accuracy on hand-worked cases, ties included.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "fusekit/core/error.hpp"
#include "fusekit/models/metrics.hpp"
#include "test_util.hpp"

namespace fk::models {
namespace {

TEST(Metrics, AucHandWorked) {
  // Perfect, reversed, and the 3 positives x 2 negatives case: pairs (p, n) ordered correctly:
  // scores p = {0.9, 0.4, 0.2}, n = {0.5, 0.1}: 0.9 beats both, 0.4 beats 0.1, 0.2 beats 0.1 -> 4/6.
  EXPECT_DOUBLE_EQ(roc_auc(std::vector<float>{0.1f, 0.2f, 0.8f, 0.9f}, std::vector<float>{0, 0, 1, 1}), 1.0);
  EXPECT_DOUBLE_EQ(roc_auc(std::vector<float>{0.9f, 0.8f, 0.2f, 0.1f}, std::vector<float>{0, 0, 1, 1}), 0.0);
  EXPECT_DOUBLE_EQ(roc_auc(std::vector<float>{0.9f, 0.4f, 0.2f, 0.5f, 0.1f}, std::vector<float>{1, 1, 1, 0, 0}), 4.0 / 6);
}

TEST(Metrics, AucTiesCountOneHalf) {
  // All scores equal: 0.5. One tie between a positive and a negative among others:
  // p = {0.7, 0.3}, n = {0.3, 0.1}: (0.7 > both) 2 + (0.3 = 0.3) 0.5 + (0.3 > 0.1) 1 = 3.5 / 4.
  EXPECT_DOUBLE_EQ(roc_auc(std::vector<float>{0.5f, 0.5f, 0.5f}, std::vector<float>{1, 0, 1}), 0.5);
  EXPECT_DOUBLE_EQ(roc_auc(std::vector<float>{0.7f, 0.3f, 0.3f, 0.1f}, std::vector<float>{1, 1, 0, 0}), 3.5 / 4);
  EXPECT_TRUE(std::isnan(roc_auc(std::vector<float>{0.2f, 0.3f}, std::vector<float>{1, 1})));
}

TEST(Metrics, LogLossAndAccuracyHandWorked) {
  const std::vector<float> p = {0.8f, 0.3f, 0.6f, 0.1f}, y = {1, 0, 0, 1};
  const double want = -(std::log(0.8) + std::log(0.7) + std::log(0.4) + std::log(0.1)) / 4;
  EXPECT_NEAR(log_loss(p, y), want, 1e-6);
  // Predictions (p > 0.5): 1, 0, 1, 0 against 1, 0, 0, 1: two right.
  EXPECT_DOUBLE_EQ(accuracy(p, y), 0.5);
  // Accuracy is not the positive rate (a common mistake): an all-negative predictor on 25%
  // positives is 75% accurate while the positive rate is 25%.
  const std::vector<float> low(8, 0.1f), labels = {1, 1, 0, 0, 0, 0, 0, 0};
  const BinaryMetrics m = evaluate_binary(low, labels);
  EXPECT_DOUBLE_EQ(m.accuracy, 0.75);
  EXPECT_DOUBLE_EQ(m.positive_rate, 0.25);
  // Clamped: a confident wrong answer costs -log(1e-7), not infinity.
  EXPECT_NEAR(log_loss(std::vector<float>{0.0f}, std::vector<float>{1}), -std::log(1e-7), 1e-6);
  EXPECT_THROW(roc_auc(std::vector<float>{0.1f}, std::vector<float>{1, 0}), Error);
}

// A diverged model's scores: every metric refuses them, naming the first bad one, instead of
// hanging (the AUC's tie loop never advanced past a NaN) or printing nan.
TEST(Metrics, NonFiniteScoresAreRefused) {
  const std::vector<float> y = {1, 0, 0, 1};
  for (float bad : {std::nanf(""), std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()}) {
    const std::vector<float> p = {0.2f, bad, 0.6f, 0.1f};
    test::expect_arg_error([&] { roc_auc(p, y); }, "models::roc_auc", "scores");
    test::expect_arg_error([&] { log_loss(p, y); }, "models::log_loss", "scores");
    test::expect_arg_error([&] { accuracy(p, y); }, "models::accuracy", "scores");
  }
}

}  // namespace
}  // namespace fk::models
