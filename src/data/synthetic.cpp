// Synthetic Criteo-like data: Zipf-like categorical ids, log-normal counts, labels from a hidden
// logistic model. Everything is a function of (seed, sample index) through Philox, so any range of
// samples can be generated on any thread and the data set never needs storing.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numbers>

#include "fusekit/core/error.hpp"
#include "fusekit/core/philox.hpp"
#include "fusekit/data/criteo.hpp"

namespace fk::data {

namespace {

// Philox subsequences (under the config's seed) of the independent parts of the generator.
constexpr std::uint64_t kSampleStream = 0;               // + sample index: the per-sample draws
constexpr std::uint64_t kEffectStream = 1ull << 62;      // + table: per-category effects
constexpr std::uint64_t kLatentStream = 3ull << 61;      // + table: per-category latent vectors
constexpr std::uint64_t kModelStream = (1ull << 63) - 1; // the fixed dense weights and scrambles

constexpr int kLatentDim = 4;
// Pairs of tables whose categories interact in the hidden logit (a mix of small and large tables).
constexpr std::array<std::pair<int, int>, 8> kPairs = {{{0, 1}, {2, 3}, {4, 5}, {7, 9}, {10, 13}, {12, 16}, {14, 20}, {18, 23}}};

// Uniform and normal draws from one Philox stream.
class Draws {
 public:
  Draws(std::uint64_t seed, std::uint64_t subsequence, std::uint64_t first_block = 0)
      : seed_(seed), sub_(subsequence), block_(first_block) {}
  std::uint32_t u32() {
    if (used_ == 4) {
      words_ = philox::random_block(seed_, sub_, block_++);
      used_ = 0;
    }
    return words_.v[used_++];
  }
  // In (0, 1): never 0, so that logs are finite.
  double uniform() { return (static_cast<double>(u32()) + 0.5) * (1.0 / 4294967296.0); }
  double normal() {
    const double u1 = uniform(), u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
  }

 private:
  std::uint64_t seed_, sub_, block_;
  philox::U32x4 words_{};
  int used_ = 4;
};

// Dense feature j ~ floor(expm1(mu_j + sigma_j * z)): counts from about 1 to a few hundred.
double dense_mu(int j) { return 0.3 + 0.35 * j; }
constexpr double kDenseSigma = 1.0;

}  // namespace

struct SyntheticCriteo::Sample {
  RawRecord record;
  double logit;  // without the bias
  double label_uniform;
};

SyntheticCriteo::SyntheticCriteo(SyntheticConfig config) : config_(std::move(config)), bias_(0) {
  FK_CHECK_ARG(config_.cardinalities.size() == kNumSparse, "data::SyntheticCriteo", "cardinalities",
               "26 table sizes", fmt::format("{}", config_.cardinalities.size()));
  for (std::int64_t c : config_.cardinalities)
    FK_CHECK_ARG(c >= 1 && c <= (std::int64_t{1} << 32), "data::SyntheticCriteo", "cardinalities",
                 "sizes in [1, 2^32]", fmt::format("{}", c));
  FK_CHECK_ARG(config_.zipf_exponent > 0, "data::SyntheticCriteo", "zipf_exponent", "> 0",
               fmt::format("{}", config_.zipf_exponent));
  Draws model(config_.seed, kModelStream);
  for (double& w : dense_weight_) w = 0.35 * model.normal();
  for (int t = 0; t < kNumSparse; ++t) {
    scramble_mul_[t] = model.u32() | 1u;
    scramble_add_[t] = model.u32();
  }
  // The bias that gives ~25% positives, found by bisection on the mean of sigmoid over samples
  // taken far from the ones a run uses (a function of the seed only).
  std::vector<double> logits(8192);
  for (std::size_t i = 0; i < logits.size(); ++i) logits[i] = draw((std::int64_t{1} << 50) + static_cast<std::int64_t>(i)).logit;
  double lo = -20, hi = 20;
  for (int it = 0; it < 60; ++it) {
    const double mid = 0.5 * (lo + hi);
    double mean = 0;
    for (double l : logits) mean += 1.0 / (1.0 + std::exp(-(mid + l)));
    (mean / static_cast<double>(logits.size()) > 0.25 ? hi : lo) = mid;
  }
  bias_ = 0.5 * (lo + hi);
}

SyntheticCriteo::Sample SyntheticCriteo::draw(std::int64_t i) const {
  Sample s{};
  Draws d(config_.seed, kSampleStream + static_cast<std::uint64_t>(i));
  const double k = config_.signal;
  double logit = 0;
  for (int j = 0; j < kNumDense; ++j) {
    const double weight = dense_weight_[j];
    const double z = d.normal();
    if (d.uniform() < config_.missing_dense) {
      s.record.dense[j] = 0;
      continue;
    }
    const double x = std::floor(std::expm1(dense_mu(j) + kDenseSigma * z));
    s.record.dense[j] = static_cast<std::int32_t>(std::clamp(x, 0.0, 1e9));
    // Criteo's second integer feature holds some -1s: keep a few to exercise the clamp.
    if (j == 1 && s.record.dense[j] == 0 && d.uniform() < 0.3) s.record.dense[j] = -1;
    logit += k * weight * z;
  }
  std::array<std::uint64_t, kNumSparse> rank{};
  for (int t = 0; t < kNumSparse; ++t) {
    const double n = static_cast<double>(config_.cardinalities[t]);
    const double e = 1.0 - config_.zipf_exponent;
    // Inverse CDF of the density ~ x^-s on [1, n + 1).
    const double u = d.uniform();
    const double x = std::abs(e) < 1e-9 ? std::exp(u * std::log(n + 1)) : std::pow(1.0 + u * (std::pow(n + 1, e) - 1.0), 1.0 / e);
    rank[t] = std::min(static_cast<std::uint64_t>(std::max(x - 1.0, 0.0)), static_cast<std::uint64_t>(n - 1));
    // A fixed bijection of 32-bit values per table (odd multiplier, offset).
    s.record.sparse[t] = static_cast<std::uint32_t>(rank[t]) * scramble_mul_[t] + scramble_add_[t];
    // Frequent categories carry strong, learnable effects; the long tail weak ones.
    const double effect = philox::random_block(config_.seed ^ 0x5bd1e995u, kEffectStream + t, rank[t]).v[0] *
                              (1.0 / 4294967296.0) * 2.0 - 1.0;
    const double scale = rank[t] < 1000 ? 0.8 : 0.2;
    logit += k * scale * effect;
  }
  for (const auto& [a, b] : kPairs) {
    const philox::U32x4 ua = philox::random_block(config_.seed, kLatentStream + a, rank[a]);
    const philox::U32x4 ub = philox::random_block(config_.seed, kLatentStream + b, rank[b]);
    double dot = 0;
    for (int c = 0; c < kLatentDim; ++c) dot += (philox::to_unit_float(ua.v[c]) - 0.5) * (philox::to_unit_float(ub.v[c]) - 0.5);
    logit += k * 3.0 * dot;
  }
  s.logit = logit;
  s.label_uniform = d.uniform();
  return s;
}

RawRecord SyntheticCriteo::record(std::int64_t i) const {
  Sample s = draw(i);
  s.record.label = s.label_uniform < 1.0 / (1.0 + std::exp(-(bias_ + s.logit))) ? 1 : 0;
  return s.record;
}

double SyntheticCriteo::hidden_logit(std::int64_t i) const { return bias_ + draw(i).logit; }

void SyntheticCriteo::generate(std::int64_t begin, std::span<RawRecord> out) const {
  for (std::size_t k = 0; k < out.size(); ++k) out[k] = record(begin + static_cast<std::int64_t>(k));
}

namespace {

class SyntheticSource final : public RecordSource {
 public:
  SyntheticSource(SyntheticConfig c, std::int64_t n) : gen_(std::move(c)), n_(n) {}
  std::int64_t size() const override { return n_; }
  void read(std::int64_t begin, std::span<RawRecord> out) const override {
    FK_CHECK_ARG(begin >= 0 && begin + static_cast<std::int64_t>(out.size()) <= n_, "data::synthetic_source", "begin",
                 fmt::format("a range inside [0, {})", n_), fmt::format("[{}, {})", begin, begin + out.size()));
    gen_.generate(begin, out);
  }

 private:
  SyntheticCriteo gen_;
  std::int64_t n_;
};

}  // namespace

std::shared_ptr<RecordSource> synthetic_source(SyntheticConfig config, std::int64_t size) {
  return std::make_shared<SyntheticSource>(std::move(config), size);
}

}  // namespace fk::data
