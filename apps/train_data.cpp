// `fusekit train`'s data: open_data, and the reference's --processed-data-file (train_data.hpp).
#include "apps/train_data.hpp"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <vector>

#include "fusekit/core/error.hpp"
#include "fusekit/data/preprocess.hpp"
#include "fusekit/data/vocabulary.hpp"

namespace fk::app {

using nlohmann::json;

namespace {

constexpr const char* kOp = "fusekit train";

Split synthetic_split(const TrainConfig& c) {
  data::SyntheticConfig sc;
  sc.seed = c.data_seed;
  if (!c.cardinalities.empty()) sc.cardinalities = c.cardinalities;
  sc.zipf_exponent = c.zipf_exponent;
  auto all = data::synthetic_source(sc, c.train_samples + c.test_samples);
  FK_CHECK_ARG(c.train_samples >= 1 && c.test_samples >= 1, kOp, "data.train_samples / data.test_samples",
               "at least one sample in each split", fmt::format("{} / {}", c.train_samples, c.test_samples));
  return {.train = data::slice_source(all, 0, c.train_samples),
          .test = data::slice_source(all, c.train_samples, c.train_samples + c.test_samples),
          .description = fmt::format("synthetic Criteo-like data (seed {}, zipf {}): {} train, {} test samples",
                                     sc.seed, sc.zipf_exponent, c.train_samples, c.test_samples)};
}

// A preprocessed data set: its days as the reference splits them.
Split shard_split(const TrainConfig& c, const data::DataSource& s) {
  const data::ShardSet& set = *s.shards;
  FK_CHECK_ARG(c.data_set.empty() || c.data_set == set.data_set, kOp, "data.set (--data-set)",
               fmt::format("the data set {} holds ({})", c.data, set.data_set), c.data_set);
  const std::vector<std::int64_t> days(set.day_begin.begin(), set.day_begin.end() - 1);  // the training days
  FK_CHECK_ARG(set.train_end() >= 1 && set.test_end() > set.test_begin(), kOp, "data",
               "preprocessed data with training records and a test half-day", c.data);
  return {.train = data::ordered_source(s.records, data::training_order(days, c.data_randomize, c.shuffle_seed)),
          .test = data::slice_source(s.records, set.test_begin(), set.test_end()),
          .description = fmt::format("{}: days 0-{} train ({} records, order {}, seed {}), day {}'s first half test "
                                     "({}), its second half validation ({}, not used)",
                                     s.name(), set.days.size() - 2, set.train_end(), c.data_randomize,
                                     c.shuffle_seed, set.days.size() - 1, set.test_end() - set.test_begin(),
                                     set.val_end() - set.test_end())};
}

// One file: the reference's Kaggle split (--data-set kaggle), or the last --test-fraction tests.
Split file_split(const TrainConfig& c, const data::DataSource& s) {
  FK_CHECK_ARG(c.data_set != "terabyte", kOp, "data.set (--data-set terabyte)",
               "a directory of fusekit data preprocess (the Terabyte day files preprocessed)", c.data);
  const std::int64_t n = s.size;
  if (c.data_set == "kaggle") {
    const data::ReferenceSplit sp = data::kaggle_split(n);
    FK_CHECK_ARG(sp.train_end >= 1 && sp.test_end > sp.test_begin, kOp, "data.set (--data-set kaggle)",
                 "a file of at least 7 records (6 training days and a test half-day)", fmt::format("{} records", n));
    const std::vector<std::int64_t> days(sp.day_begin.begin(), sp.day_begin.end() - 1);  // the 6 training days
    return {.train = data::ordered_source(s.records, data::training_order(days, c.data_randomize, c.shuffle_seed)),
            .test = data::slice_source(s.records, sp.test_begin, sp.test_end),
            .description = fmt::format("{}: the reference's Kaggle split: days 0-5 train ({} records, order {}, seed "
                                       "{}), day 6's first half test ({}), its second half validation ({}, not used)",
                                       s.name(), sp.train_end, c.data_randomize, c.shuffle_seed,
                                       sp.test_end - sp.test_begin, sp.val_end - sp.val_begin)};
  }
  const std::int64_t n_test = test_records(n, c.test_fraction);
  FK_CHECK_ARG(n - n_test >= 1, kOp, "data", "at least one training record", fmt::format("{} records", n));
  FK_CHECK_ARG(n_test >= 1, kOp, "training.test_fraction (--test-fraction)", "a test split of at least one record",
               fmt::format("{} of {} records", n_test, n));
  const std::vector<std::int64_t> days{0, n - n_test};
  return {.train = data::ordered_source(s.records, data::training_order(days, c.data_randomize, c.shuffle_seed)),
          .test = data::slice_source(s.records, n - n_test, n),
          .description = fmt::format("{}: {} train (order {}, seed {}), {} test records (the last {:.0f}%)", s.name(),
                                     n - n_test, c.data_randomize, c.shuffle_seed, n_test, 100 * c.test_fraction)};
}

}  // namespace

std::int64_t test_records(std::int64_t n, double fraction) {
  return static_cast<std::int64_t>(std::floor(static_cast<double>(n) * fraction));
}

RunData open_data(const TrainConfig& c, bool read) {
  RunData d;
  std::shared_ptr<const data::Vocabulary> vocabulary = load_vocabulary(c);
  if (c.data == "synthetic" || (!read && !c.processed_data.empty())) {
    d.featurizer = make_featurizer(c, std::move(vocabulary));
    if (read) d.split = synthetic_split(c);
    return d;
  }
  d.source = data::open_source(c.data, {.strict = c.strict_data, .vocabulary = vocabulary, .read_text = read});
  const data::DataSource& s = *d.source;
  if (s.report) fmt::print("data: {}: {}\n", c.data, s.report->summary());
  // Preprocessed shards hold their vocabulary's ids (checked against --vocabulary's when given).
  d.featurizer = s.shards ? make_featurizer(c, s.shards->vocabulary, /*premapped=*/true)
                          : make_featurizer(c, std::move(vocabulary));
  if (read) d.split = s.shards ? shard_split(c, s) : file_split(c, s);
  return d;
}

namespace {

// Whether `dir` holds `raw` preprocessed as --processed-data-file asks: the same file (path and
// size), data set and vocabulary options.
bool holds_preprocessed(const std::filesystem::path& dir, const std::vector<std::filesystem::path>& raw,
                        const std::string& set, std::int64_t max_ind_range) {
  if (data::find_source_kind(dir) != data::SourceKind::shards) return false;
  std::ifstream in(dir / "manifest.json");
  const json m = json::parse(in, nullptr, false);
  if (m.is_discarded()) return false;
  json want_inputs = json::array();
  for (const std::filesystem::path& r : raw)
    want_inputs.push_back({{"path", std::filesystem::absolute(r).string()}, {"bytes", std::filesystem::file_size(r)}});
  json inputs = json::array();
  for (const json& i : m.value("inputs", json::array()))
    if (i.is_object()) inputs.push_back({{"path", i.value("path", json())}, {"bytes", i.value("bytes", json())}});
  const json v = m.value("vocabulary", json::object());
  return inputs == want_inputs && m.value("data_set", json()) == set && v.value("max_ind_range", json()) == max_ind_range &&
         v.value("min_count", json()) == 1 && v.value("days", json()) == "all";
}

// The Criteo files --data names for preprocessing: the file itself, or for Terabyte the day files
// DATA_0, DATA_1, ... (the reference's naming; .gz too).
std::vector<std::filesystem::path> raw_inputs(const TrainConfig& c, const std::string& set) {
  std::vector<std::filesystem::path> inputs;
  if (set == "terabyte" && !std::filesystem::is_regular_file(c.data)) {
    for (int d = 0;; ++d) {
      const std::string day = fmt::format("{}_{}", c.data, d);
      if (std::filesystem::is_regular_file(day)) inputs.emplace_back(day);
      else if (std::filesystem::is_regular_file(day + ".gz")) inputs.emplace_back(day + ".gz");
      else break;
    }
    FK_CHECK_ARG(inputs.size() >= 2, kOp, "data.source (--raw-data-file)",
                 "the Terabyte day files PATH_0, PATH_1, ... (at least 2; .gz too)",
                 fmt::format("{} ({} day files)", c.data, inputs.size()));
  } else {
    inputs = {c.data};
  }
  for (const std::filesystem::path& in : inputs)
    FK_CHECK_ARG(data::find_source_kind(in) != data::SourceKind::binary, kOp, "data.source (--raw-data-file)",
                 "Criteo TSV (.gz) files to preprocess into --processed-data-file", in.string());
  return inputs;
}

}  // namespace

// As the reference prepares Kaggle: its split (--data-set, kaggle by default), dictionaries over
// every day, --max-ind-range when given (fusekit's default cap is for its synthetic data).
void use_processed_data(TrainConfig& c, const ConfigFlags& flags) {
  const std::filesystem::path dir = c.processed_data;
  const bool data_is_shards = data::find_source_kind(c.data) == data::SourceKind::shards;
  if (c.data == "synthetic" || data_is_shards) {
    FK_CHECK_ARG(data_is_shards || data::find_source_kind(dir) == data::SourceKind::shards, kOp,
                 "data.processed (--processed-data-file)",
                 "a preprocessed directory, or a Criteo file to preprocess into it (--raw-data-file)", c.processed_data);
    if (c.data == "synthetic") c.data = c.processed_data;
    return;
  }
  const std::string set = c.data_set.empty() ? "kaggle" : c.data_set;
  const std::vector<std::filesystem::path> inputs = raw_inputs(c, set);
  const std::int64_t range = set_explicitly(flags, "data.max_ind_range") ? c.max_ind_range : 0;
  if (holds_preprocessed(dir, inputs, set, range)) {
    fmt::print("data: {} holds {} preprocessed (the manifest's files, sizes and options)\n", dir.string(), c.data);
  } else {
    fmt::print("data: preprocessing {} into {} (--processed-data-file; {} input {})\n", c.data, dir.string(),
               inputs.size(), inputs.size() == 1 ? "file" : "files");
    data::PreprocessOptions o;
    o.inputs = inputs;
    o.out = dir;
    o.data_set = set;
    o.vocabulary = {.max_ind_range = range, .min_count = 1};
    o.vocabulary_all_days = true;
    o.strict = c.strict_data;
    const data::PreprocessReport r = data::preprocess(o);
    for (std::size_t i = 0; i < inputs.size(); ++i)
      fmt::print("data: {}: {}\n", inputs[i].string(), r.inputs.at(i).summary());
    fmt::print("data: preprocessed in {:.1f} s, vocabulary fingerprint {:08x}\n", r.seconds, r.fingerprint);
  }
  c.data = c.processed_data;
}

}  // namespace fk::app
