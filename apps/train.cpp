// `fusekit train`: DLRM trained on synthetic or real Criteo data, configured by a JSON file and the
// DLRM reference's flags (apps/train_config.cpp), with progress lines, periodic evaluation and a
// metrics JSON; `fusekit eval`; `fusekit data`.
#include "apps/train.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/resource.h>
#include <unistd.h>
#include <time.h>

#include <charconv>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <thread>

#include "apps/checkpoint.hpp"
#include "apps/output_file.hpp"
#include "fusekit/core/error.hpp"
#include "fusekit/data/criteo.hpp"
#include "fusekit/data/preprocess.hpp"
#include "fusekit/data/vocabulary.hpp"
#include "fusekit/fusekit.hpp"
#include "fusekit/models/dlrm.hpp"
#include "fusekit/models/metrics.hpp"

#if FUSEKIT_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace fk::app {

using nlohmann::json;

CLI::App* add_train_command(CLI::App& app, TrainFlags& f) {
  CLI::App* cmd = app.add_subcommand("train", "Train DLRM on synthetic or Criteo data (docs/dlrm.md)");
  add_config_flags(*cmd, f.config);
  add_run_flags(*cmd, f.run);
  return cmd;
}

namespace {

struct Split {
  std::shared_ptr<data::RecordSource> train, test;
  std::string description;
};

// The records of a Criteo TSV (.gz) or fusekit binary file, and what they are.
std::shared_ptr<data::RecordSource> open_file(const std::string& path, bool strict, std::string& description) {
  if (data::is_binary_file(path)) {
    description = fmt::format("{} (fusekit binary): ", path);
    return data::binary_source(path);
  }
  data::ReadReport report;
  std::vector<data::RawRecord> records = data::read_tsv(path, {.strict = strict}, report);
  fmt::print("data: {}: {}\n", path, report.summary());
  description = fmt::format("{} (Criteo TSV): ", path);
  return data::memory_source(std::move(records));
}

// Records [0, n - test) train and the last `test` records test: test = floor(n * fraction).
std::int64_t test_records(std::int64_t n, double fraction) {
  return static_cast<std::int64_t>(std::floor(static_cast<double>(n) * fraction));
}

Split load_data(const TrainConfig& c, const data::Featurizer& feat) {
  Split s;
  if (c.data == "synthetic") {
    data::SyntheticConfig sc;
    sc.seed = c.data_seed;
    if (!c.cardinalities.empty()) sc.cardinalities = c.cardinalities;
    sc.zipf_exponent = c.zipf_exponent;
    auto all = data::synthetic_source(sc, c.train_samples + c.test_samples);
    FK_CHECK_ARG(c.train_samples >= 1 && c.test_samples >= 1, "fusekit train", "data.train_samples / data.test_samples",
                 "at least one sample in each split", fmt::format("{} / {}", c.train_samples, c.test_samples));
    s.train = data::slice_source(all, 0, c.train_samples);
    s.test = data::slice_source(all, c.train_samples, c.train_samples + c.test_samples);
    s.description = fmt::format("synthetic Criteo-like data (seed {}, zipf {}): {} train, {} test samples", sc.seed,
                                sc.zipf_exponent, c.train_samples, c.test_samples);
    return s;
  }
  if (data::is_shard_directory(c.data)) {
    const data::ShardSet set = data::open_shards(c.data, feat.vocabulary);
    FK_CHECK_ARG(c.data_set.empty() || c.data_set == set.data_set, "fusekit train", "data.set (--data-set)",
                 fmt::format("the data set {} holds ({})", c.data, set.data_set), c.data_set);
    const std::shared_ptr<data::RecordSource> all = set.all();
    const std::vector<std::int64_t> days(set.day_begin.begin(), set.day_begin.end() - 1);  // the training days
    FK_CHECK_ARG(set.train_end() >= 1 && set.test_end() > set.test_begin(), "fusekit train", "data",
                 "preprocessed data with training records and a test half-day", c.data);
    s.train = data::ordered_source(all, data::training_order(days, c.data_randomize, c.shuffle_seed));
    s.test = data::slice_source(all, set.test_begin(), set.test_end());
    s.description = fmt::format("{} (fusekit data preprocess, {}, {} days): days 0-{} train ({} records, order {}, "
                                "seed {}), day {}'s first half test ({}), its second half validation ({}, not used)",
                                c.data, set.data_set, set.days.size(), set.days.size() - 2, set.train_end(),
                                c.data_randomize, c.shuffle_seed, set.days.size() - 1,
                                set.test_end() - set.test_begin(), set.val_end() - set.test_end());
    return s;
  }
  FK_CHECK_ARG(c.data_set != "terabyte", "fusekit train", "data.set (--data-set terabyte)",
               "a directory of fusekit data preprocess (the Terabyte day files preprocessed)", c.data);
  const std::shared_ptr<data::RecordSource> all = open_file(c.data, c.strict_data, s.description);
  const std::int64_t n = all->size();
  if (c.data_set == "kaggle") {
    const data::ReferenceSplit sp = data::kaggle_split(n);
    FK_CHECK_ARG(sp.train_end >= 1 && sp.test_end > sp.test_begin, "fusekit train", "data.set (--data-set kaggle)",
                 "a file of at least 7 records (6 training days and a test half-day)", fmt::format("{} records", n));
    const std::vector<std::int64_t> days(sp.day_begin.begin(), sp.day_begin.end() - 1);  // the 6 training days
    s.train = data::ordered_source(all, data::training_order(days, c.data_randomize, c.shuffle_seed));
    s.test = data::slice_source(all, sp.test_begin, sp.test_end);
    s.description += fmt::format("the reference's Kaggle split: days 0-5 train ({} records, order {}, seed {}), day 6's "
                                 "first half test ({}), its second half validation ({}, not used)",
                                 sp.train_end, c.data_randomize, c.shuffle_seed, sp.test_end - sp.test_begin,
                                 sp.val_end - sp.val_begin);
    return s;
  }
  const std::int64_t n_test = test_records(n, c.test_fraction);
  FK_CHECK_ARG(n - n_test >= 1, "fusekit train", "data", "at least one training record", fmt::format("{} records", n));
  FK_CHECK_ARG(n_test >= 1, "fusekit train", "training.test_fraction (--test-fraction)",
               "a test split of at least one record", fmt::format("{} of {} records", n_test, n));
  const std::vector<std::int64_t> days{0, n - n_test};
  s.train = data::ordered_source(all, data::training_order(days, c.data_randomize, c.shuffle_seed));
  s.test = data::slice_source(all, n - n_test, n);
  s.description += fmt::format("{} train (order {}, seed {}), {} test records (the last {:.0f}%)", n - n_test,
                               c.data_randomize, c.shuffle_seed, n_test, 100 * c.test_fraction);
  return s;
}

// Page-locked host memory for the batch slots when the model runs on the GPU (asynchronous
// copies); plain host memory otherwise.
data::HostAllocator batch_allocator(const models::Dlrm& model) {
  return model.device().is_cuda() ? data::pinned_host_allocator() : data::HostAllocator{};
}

models::DlrmInput model_input(const data::Batch& b) { return {b.dense, b.indices, b.offsets, b.raw_sparse}; }

// The model's click probability and the label of every test sample, in test-set order.
struct Predictions {
  std::vector<float> probs, labels;
};

Predictions predict(models::Dlrm& model, const std::shared_ptr<data::RecordSource>& test, const data::Featurizer& feat,
                    std::int64_t batch, int workers) {
  data::BatchLoader loader(test, feat, {.batch_size = batch, .workers = workers, .allocate = batch_allocator(model)});
  Predictions out;
  out.probs.reserve(static_cast<std::size_t>(test->size()));
  out.labels.reserve(static_cast<std::size_t>(test->size()));
  Tensor p;
  while (const data::Batch* b = loader.next()) {
    if (p.shape() != Dims{b->size}) p = Tensor::empty({b->size}, DType::f32, Device::cpu());
    model.predict(model_input(*b), p);
    out.probs.insert(out.probs.end(), p.data_as<float>(), p.data_as<float>() + b->size);
    out.labels.insert(out.labels.end(), b->labels.data_as<float>(), b->labels.data_as<float>() + b->size);
  }
  return out;
}

models::BinaryMetrics evaluate(models::Dlrm& model, const std::shared_ptr<data::RecordSource>& test,
                               const data::Featurizer& feat, std::int64_t batch, int workers) {
  const Predictions p = predict(model, test, feat, batch, workers);
  return models::evaluate_binary(p.probs, p.labels);
}

json metrics_record(const models::BinaryMetrics& m) {
  return {{"samples", m.samples}, {"positive_rate", m.positive_rate}, {"logloss", m.log_loss},
          {"auc", std::isnan(m.auc) ? json(nullptr) : json(m.auc)}, {"accuracy", m.accuracy}};
}

// CPU time of the calling thread: on a shared machine, samples per CPU-second of the training
// thread says what the code does when wall-clock samples/s says what the machine allowed.
double thread_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

double peak_host_mb() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;  // Linux: KiB
}

// The process's resident anonymous memory now, in MB (/proc/self/status RssAnon; 0 where there is
// none): its own memory, without the mapped data files' pages, which belong to the page cache.
double anonymous_host_mb() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.starts_with("RssAnon:")) return std::strtod(line.c_str() + 8, nullptr) / 1024.0;
  return 0.0;
}

std::string progress_bar(double fraction, int width = 24) {
  const int filled = static_cast<int>(fraction * width);
  std::string s(static_cast<std::size_t>(width), ' ');
  for (int i = 0; i < filled && i < width; ++i) s[static_cast<std::size_t>(i)] = '=';
  if (filled < width) s[static_cast<std::size_t>(filled)] = '>';
  return "[" + s + "]";
}

}  // namespace

namespace {

// The device and implementation asked for, or fk::Error naming what is missing.
std::pair<Device, models::DlrmImpl> pick_device(const TrainConfig& c, const char* command) {
  const Device dev = Device::parse(c.device);
  const models::DlrmImpl impl = models::parse_impl(c.impl);
  if (dev.is_cuda()) {
    int count = 0;
#if FUSEKIT_WITH_CUDA
    if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
#endif
    FK_CHECK_ARG(dev.index < count, command, "--device", "a CUDA device that exists (--device cpu otherwise)",
                 fmt::format("{} ({} CUDA devices)", c.device, count));
  }
  return {dev, impl};
}

void save_checkpoint(const std::string& path, std::int64_t step, const TrainConfig& c, const models::Dlrm& model) {
  apps::write_checkpoint(path, step, to_json(c), [&](std::ostream& out) { model.save_state(out); });
}

}  // namespace

namespace {

// Whether `dir` holds `raw` preprocessed as --processed-data-file asks: the same file (path and
// size), data set and vocabulary options.
bool holds_preprocessed(const std::filesystem::path& dir, const std::vector<std::filesystem::path>& raw,
                        const std::string& set, std::int64_t max_ind_range) {
  if (!data::is_shard_directory(dir)) return false;
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

// The reference's --processed-data-file: training reads the preprocessed directory, written first
// from --data (a Criteo TSV file) unless it already holds it. As the reference prepares Kaggle:
// its split (--data-set, kaggle by default), dictionaries over every day, --max-ind-range when
// given (fusekit's default cap is for its synthetic data).
void use_processed_data(TrainConfig& c, const ConfigFlags& flags) {
  constexpr const char* op = "fusekit train";
  const std::filesystem::path dir = c.processed_data;
  if (c.data == "synthetic" || data::is_shard_directory(c.data)) {
    FK_CHECK_ARG(data::is_shard_directory(c.data) || data::is_shard_directory(dir), op,
                 "data.processed (--processed-data-file)",
                 "a preprocessed directory, or a Criteo file to preprocess into it (--raw-data-file)", c.processed_data);
    if (c.data == "synthetic") c.data = c.processed_data;
    return;
  }
  const std::string set = c.data_set.empty() ? "kaggle" : c.data_set;
  // Terabyte's days are the files DATA_0, DATA_1, ... (the reference's naming; .gz too).
  std::vector<std::filesystem::path> inputs;
  if (set == "terabyte" && !std::filesystem::is_regular_file(c.data)) {
    for (int d = 0;; ++d) {
      const std::string day = fmt::format("{}_{}", c.data, d);
      if (std::filesystem::is_regular_file(day)) inputs.emplace_back(day);
      else if (std::filesystem::is_regular_file(day + ".gz")) inputs.emplace_back(day + ".gz");
      else break;
    }
    FK_CHECK_ARG(inputs.size() >= 2, op, "data.source (--raw-data-file)",
                 "the Terabyte day files PATH_0, PATH_1, ... (at least 2; .gz too)",
                 fmt::format("{} ({} day files)", c.data, inputs.size()));
  } else {
    inputs = {c.data};
  }
  for (const std::filesystem::path& in : inputs)
    FK_CHECK_ARG(!data::is_binary_file(in), op, "data.source (--raw-data-file)",
                 "Criteo TSV (.gz) files to preprocess into --processed-data-file", in.string());
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

}  // namespace

int run_train(const TrainFlags& flags) {
  using clock = std::chrono::steady_clock;
  TrainConfig c = resolve(flags.config);
  if (!c.processed_data.empty() && !flags.run.dry_run) use_processed_data(c, flags.config);
  if (!flags.config.no_effect.empty())
    fmt::print("fusekit train: warning: the DLRM reference's {} {} no effect here (see --help)\n",
               fmt::join(flags.config.no_effect, " "), flags.config.no_effect.size() == 1 ? "has" : "have");
  const StartState start = start_state(flags.run, c);
  const bool train = !flags.run.inference_only;  // --inference-only writes no checkpoint and no trace
  // Every output is checked before the run, not found unwritable after it has trained.
  if (!flags.run.dry_run) {
    if (train && !c.checkpoint.empty()) apps::check_writable(c.checkpoint, "fusekit train", "--checkpoint");
    if (!c.metrics_json.empty()) apps::check_writable(c.metrics_json, "fusekit train", "--metrics-json");
    if (train && !c.trace.empty()) apps::check_writable(c.trace, "fusekit train", "--trace");
  }
  const data::Featurizer feat = make_featurizer(c);
  const models::DlrmConfig mc = make_model_config(c, feat);
  models::OptimizerConfig opt{.kind = models::parse_optimizer(c.optimizer),
                              .learning_rate = static_cast<float>(c.learning_rate)};
  const bool scheduled = has_learning_rate_schedule(c);

  std::int64_t rows = 0;
  for (std::int64_t r : mc.table_rows) rows += r;
  if (flags.run.dry_run) {
    fmt::print("fusekit train --dry-run: DLRM bot {} top {}-{} D {} interaction {}, {} tables ({} rows), {:.1f}M "
               "parameters ({:.0f} MB), {} lr {} batch {}, data {}, device {}, impl {}\n",
               c.arch_mlp_bot, mc.interaction_size(), c.arch_mlp_top, mc.embedding_dim, c.arch_interaction_op,
               mc.table_rows.size(), rows, static_cast<double>(mc.parameter_count()) / 1e6,
               static_cast<double>(mc.parameter_count()) * 4 / 1e6, c.optimizer, c.learning_rate, c.mini_batch_size,
               c.data, c.device, c.impl);
    fmt::print("{}\n", to_json(c).dump(2));
    return 0;
  }
  const auto [device, impl] = pick_device(c, "fusekit train");
  const Split split = load_data(c, feat);
  const auto t_init = clock::now();
  models::Dlrm model(mc, device, impl);
  const std::string vocabulary_name =
      feat.premapped ? (std::filesystem::path(c.data) / "vocabulary.fkv").string() : c.vocabulary;
  const std::string ids =
      feat.vocabulary ? fmt::format("vocabulary {} (max_ind_range {}, min_count {}, fingerprint {:08x})", vocabulary_name,
                                    feat.vocabulary->options().max_ind_range, feat.vocabulary->options().min_count,
                                    feat.vocabulary->fingerprint())
                      : fmt::format("hash {}, max_ind_range {}", c.data_hash, c.max_ind_range);
  if (feat.vocabulary && (c.data_hash != "seed" || (c.max_ind_range != TrainConfig{}.max_ind_range &&
                                                    c.max_ind_range != feat.vocabulary->options().max_ind_range)))
    fmt::print("fusekit train: warning: with the vocabulary {}, --data-hash {} and --max-ind-range {} have no effect "
               "(its ids and its max_ind_range {} apply)\n",
               vocabulary_name, c.data_hash, c.max_ind_range, feat.vocabulary->options().max_ind_range);
  fmt::print("fusekit train: DLRM bot {} top {}-{} D {} interaction {}, {} tables ({} rows, {}), "
             "{:.1f}M parameters ({:.0f} MB), {} lr {} batch {}, device {}, impl {}{}\n",
             c.arch_mlp_bot, mc.interaction_size(), c.arch_mlp_top, mc.embedding_dim, c.arch_interaction_op,
             mc.table_rows.size(), rows, ids, static_cast<double>(mc.parameter_count()) / 1e6,
             static_cast<double>(mc.parameter_count()) * 4 / 1e6, c.optimizer, c.learning_rate, c.mini_batch_size,
             device.str(), models::impl_name(impl), device.is_cuda() ? " (fp32 parameters, TF32 MLP GEMMs)" : "");
  fmt::print("data: {}\n", split.description);
  fmt::print("init: {:.1f} s\n", std::chrono::duration<double>(clock::now() - t_init).count());

  // Steps per epoch: whole batches plus a partial one (no size + B - 1 that could wrap).
  const std::int64_t n_train = split.train->size();
  const std::int64_t all_batches = n_train / c.mini_batch_size + (n_train % c.mini_batch_size != 0 ? 1 : 0);
  // --num-batches caps an epoch at its first batches (every one of them whole), as the reference does.
  const std::int64_t per_epoch = c.num_batches > 0 ? std::min(c.num_batches, all_batches) : all_batches;
  const std::int64_t epoch_records = std::min(n_train, per_epoch * c.mini_batch_size);
  std::int64_t total = c.steps;
  FK_CHECK_ARG(c.steps > 0 || !__builtin_mul_overflow(per_epoch, c.epochs, &total), "fusekit train",
               "training.epochs (--epochs)", fmt::format("at most {} epochs of {} steps (2^63 steps)", INT64_MAX / per_epoch, per_epoch),
               fmt::format("{}", c.epochs));
  // The training records of the steps before `step` (batch k of an epoch is records [kB, (k+1)B)
  // of its first epoch_records): the samples a run has seen, whole or resumed.
  const auto samples_before = [&](std::int64_t s) {
    return s / per_epoch * epoch_records + std::min(s % per_epoch * c.mini_batch_size, epoch_records);
  };
  // The (0-based) epoch of the step before `step`: the one the progress line names.
  const auto epoch_of_last_step = [&](std::int64_t s) { return s > 0 ? (s - 1) / per_epoch : 0; };
  std::int64_t step = 0, samples = 0;
  if (!start.path.empty() && (start.must_exist || std::filesystem::exists(start.path))) {
    std::ifstream in;
    apps::CheckpointHeader h;
    try {
      h = apps::open_checkpoint(start.path, in, "fusekit train");
    } catch (const Error& e) {
      if (!start.must_exist) throw;
      throw Error(e.op(), start.flag, e.expected(), e.got());  // the file is --load-model's, not --checkpoint's
    }
    const std::string diff = apps::config_differences(h.config, to_json(c));
    FK_CHECK_ARG(diff.empty() || flags.run.resume_override, "fusekit train", start.flag,
                 fmt::format("the configuration stored in {} (--resume-override resumes with the new settings)",
                             start.path),
                 diff);
    step = h.step;
    FK_CHECK_ARG(!train || step <= total, "fusekit train", start.flag,
                 fmt::format("a checkpoint at most at step {} (the run's end)", total),
                 fmt::format("{} at step {}", start.path, step));
    model.load_state(in);
    fmt::print("{} {} at step {}\n", start.must_exist ? "loaded" : "resumed from", start.path, step);
  }
  std::unique_ptr<TraceRecorder> trace;
  if (train && !c.trace.empty()) {
    trace = std::make_unique<TraceRecorder>();
    model.set_trace(trace.get());
  }
  const std::int64_t resumed_at = step;  // 0 unless resumed: an epoch begun before covers only this run's steps
  std::int64_t samples_seen = samples_before(step);  // since the run's start, a resumed one's too
  const std::int64_t trace_until = step + c.trace_steps;
  json evals = json::array(), windows = json::array();
  double train_seconds = 0, train_cpu_seconds = 0, window_loss = 0, epoch_loss = 0, last_epoch_loss = 0;
  double data_wait_seconds = 0;  // the training thread waiting for the loader's next batch
  double peak_anonymous_mb = anonymous_host_mb();  // sampled at each progress line and at the end
  std::int64_t last_epoch_steps = 0;  // the steps last_epoch_loss covers (after a resume: this run's only)
  std::int64_t window_steps = 0, window_samples = 0, epoch_steps = 0, drained_steps = 0;
  auto window_start = clock::now();
  double window_seconds = 0;  // the window's training time before its last evaluation or checkpoint
  auto run_eval = [&](const char* when) {
    const auto t0 = clock::now();
    const models::BinaryMetrics m = evaluate(model, split.test, feat, c.test_mini_batch_size, static_cast<int>(c.data_workers));
    const double secs = std::chrono::duration<double>(clock::now() - t0).count();
    fmt::print("eval {} step {}: test logloss {:.5f}, AUC {:.5f}, accuracy {:.5f} ({} samples, {:.1f}% positive, {:.1f} s)\n",
               when, step, m.log_loss, m.auc, m.accuracy, m.samples, 100 * m.positive_rate, secs);
    json r = metrics_record(m);
    r["step"] = step;
    r["samples_seen"] = samples_seen;
    r["epoch"] = epoch_of_last_step(step);
    evals.push_back(r);
    return m;
  };
  // A non-finite loss stops the run before anything is evaluated or saved: the last checkpoint
  // written stays the last good state.
  auto finite_loss = [&](double mean, std::int64_t at) {
    FK_CHECK_ARG(std::isfinite(mean), "fusekit train", "loss",
                 "a finite training loss (the run diverged; the last checkpoint, if any, is the last good "
                 "state; try a lower --learning-rate)",
                 fmt::format("{} (mean of the steps up to step {})", mean, at));
    return mean;
  };
  auto checkpoint = [&] {
    if (c.checkpoint.empty()) return;
    save_checkpoint(c.checkpoint, step, c, model);
    fmt::print("checkpoint: step {} saved to {}\n", step, c.checkpoint);
  };
  // Copied out of the structured binding: clang before 16 cannot capture one in a lambda.
  const std::string device_name = device.str(), impl_name(models::impl_name(impl));
  auto write_metrics = [&](json summary) {
    if (c.metrics_json.empty()) return;
    const json out = {{"config", to_json(c)},
                      {"device", device_name},
                      {"impl", impl_name},
                      {"commit", fk::build_info().commit},
                      {"train", windows},
                      {"evaluations", evals},
                      {"summary", std::move(summary)}};
    apps::write_file_atomically(c.metrics_json, "fusekit train", "--metrics-json",
                                [&](std::ostream& f) { f << out.dump(2) << "\n"; });
    fmt::print("metrics: {}\n", c.metrics_json);
  };
  if (!train) {
    const models::BinaryMetrics m = run_eval("inference-only,");
    write_metrics({{"inference_only", true}, {"test", metrics_record(m)}, {"steps", step}});
    return 0;
  }
  // One loader for the run: batch k of an epoch is records [k B, (k + 1) B), and a resumed run
  // starts mid-epoch exactly where the interrupted one stopped.
  data::BatchLoader loader(data::slice_source(split.train, 0, epoch_records), feat,
                           {.batch_size = c.mini_batch_size, .workers = static_cast<int>(c.data_workers),
                            .allocate = batch_allocator(model), .bags = impl != models::DlrmImpl::fused,
                            .epochs = total / per_epoch + (total % per_epoch != 0) - step / per_epoch,
                            .first_batch = step % per_epoch});
  while (step < total) {
    const std::int64_t epoch = step / per_epoch;
    epoch_loss = 0;
    epoch_steps = 0;
    auto epoch_start = clock::now();
    double epoch_cpu_start = thread_cpu_seconds();
    while (step < total) {
      if (trace && step == trace_until) model.set_trace(nullptr);
      TraceRecorder* tr = step < trace_until ? trace.get() : nullptr;
      const data::Batch* b = nullptr;
      {
        const auto scope = trace_scope(tr, "data.wait");
        const auto t_wait = clock::now();
        b = loader.next();
        data_wait_seconds += std::chrono::duration<double>(clock::now() - t_wait).count();
      }
      if (!b) break;
      {
        // On the GPU this returns once the batch is on the device; the loss is read at the
        // next progress line (drain_loss), so the host never waits for a step to finish.
        const auto scope = trace_scope(tr, "train_step", "train");
        if (scheduled) opt.learning_rate = static_cast<float>(scheduled_learning_rate(c, step));
        model.enqueue_train_step(model_input(*b), b->labels, opt);
      }
      ++step;
      samples += b->size;
      samples_seen += b->size;
      ++window_steps;
      window_samples += b->size;
      const bool print_now = c.print_every > 0 && (step % c.print_every == 0 || step == total);
      const bool eval_now = c.eval_every > 0 && step % c.eval_every == 0 && step < total;
      const bool save_now = c.checkpoint_every > 0 && step % c.checkpoint_every == 0 && step < total;
      if (print_now || eval_now || save_now || step == total) {
        const double mean = finite_loss(model.drain_loss(), step);
        window_loss += mean * static_cast<double>(window_steps - drained_steps);
        epoch_loss += mean * static_cast<double>(window_steps - drained_steps);
        epoch_steps += window_steps - drained_steps;
        drained_steps = window_steps;
      }
      if (print_now) {
        peak_anonymous_mb = std::max(peak_anonymous_mb, anonymous_host_mb());
        const double secs = window_seconds + std::chrono::duration<double>(clock::now() - window_start).count();
        const double loss = window_loss / static_cast<double>(window_steps);
        const double sps = static_cast<double>(window_samples) / secs;
        fmt::print("epoch {} step {}/{} {} {:5.1f}%  loss {:.5f}  {:.0f} samples/s\n", epoch, step, total,
                   progress_bar(static_cast<double>(step) / static_cast<double>(total)),
                   100.0 * static_cast<double>(step) / static_cast<double>(total), loss, sps);
        windows.push_back({{"step", step},
                           {"samples_seen", samples_seen},
                           {"epoch", epoch},
                           {"loss", loss},
                           {"samples_per_s", sps},
                           {"learning_rate", scheduled ? scheduled_learning_rate(c, step - 1) : c.learning_rate}});
        std::fflush(stdout);
        window_loss = 0;
        window_steps = 0;
        drained_steps = 0;
        window_samples = 0;
        window_seconds = 0;
        window_start = clock::now();
      }
      if (eval_now || save_now) {
        // Evaluation and checkpoint time is not training time.
        train_seconds += std::chrono::duration<double>(clock::now() - epoch_start).count();
        train_cpu_seconds += thread_cpu_seconds() - epoch_cpu_start;
        window_seconds += std::chrono::duration<double>(clock::now() - window_start).count();
        if (eval_now) {
          const models::BinaryMetrics m = run_eval("at");
          const bool auc = c.auc_threshold > 0 && m.auc >= c.auc_threshold;
          if (auc || (c.accuracy_threshold > 0 && m.accuracy >= c.accuracy_threshold)) {
            fmt::print("stop: the test {} reached {} at step {}\n", auc ? "AUC" : "accuracy",
                       auc ? c.auc_threshold : c.accuracy_threshold, step);
            total = step;  // the final evaluation and checkpoint follow, as at the run's end
          }
        }
        checkpoint();
        epoch_start = clock::now();
        epoch_cpu_start = thread_cpu_seconds();
        window_start = clock::now();
      }
      if (step % per_epoch == 0) break;  // the epoch's last batch
    }
    {
      // The epoch's last steps (since the last progress line).
      const double mean = finite_loss(model.drain_loss(), step);
      epoch_loss += mean * static_cast<double>(window_steps - drained_steps);
      epoch_steps += window_steps - drained_steps;
      window_loss += mean * static_cast<double>(window_steps - drained_steps);
      drained_steps = window_steps;
    }
    train_seconds += std::chrono::duration<double>(clock::now() - epoch_start).count();
    train_cpu_seconds += thread_cpu_seconds() - epoch_cpu_start;
    if (epoch_steps > 0) {
      last_epoch_loss = epoch_loss / static_cast<double>(epoch_steps);
      last_epoch_steps = epoch_steps;
    }
    if (epoch_steps == 0) break;
  }
  peak_anonymous_mb = std::max(peak_anonymous_mb, anonymous_host_mb());
  const models::BinaryMetrics final_m = run_eval("final,");
  peak_anonymous_mb = std::max(peak_anonymous_mb, anonymous_host_mb());
  checkpoint();
  if (trace) {
    trace->write(c.trace);
    fmt::print("trace: {} events of the first {} steps in {}\n", trace->size(), std::min(c.trace_steps, step), c.trace);
  }
  const double sps = train_seconds > 0 ? static_cast<double>(samples) / train_seconds : 0.0;
  const double cpu_sps = train_cpu_seconds > 0 ? static_cast<double>(samples) / train_cpu_seconds : 0.0;
  fmt::print("summary: train loss {:.5f} (mean over the last epoch's {} steps{}), test logloss {:.5f}, AUC {:.5f}, "
             "accuracy {:.5f}, {:.0f} samples/s ({} steps, {} samples, {:.1f} s training, {:.1f} s of it waiting for "
             "data; {:.0f} samples per CPU-second of the training thread), peak host memory {:.0f} MB (anonymous at "
             "most {:.0f} MB, the rest mapped data pages), peak GPU memory {:.0f} MB\n",
             last_epoch_loss, last_epoch_steps,
             resumed_at % per_epoch != 0 && step - last_epoch_steps == resumed_at ? " run since the resume" : "",
             final_m.log_loss, final_m.auc, final_m.accuracy, sps, step, samples, train_seconds, data_wait_seconds,
             cpu_sps, peak_host_mb(), peak_anonymous_mb, static_cast<double>(model.peak_device_bytes()) / 1e6);
  write_metrics({{"train_loss", last_epoch_loss},
                 {"train_loss_steps", last_epoch_steps},
                 {"test", metrics_record(final_m)},
                 {"samples_per_s", sps},
                 {"samples_per_cpu_s", cpu_sps},
                 {"steps", step},
                 {"samples", samples},
                 {"train_seconds", train_seconds},
                 {"data_wait_seconds", data_wait_seconds},
                 {"peak_host_mb", peak_host_mb()},
                 {"peak_anonymous_host_mb", peak_anonymous_mb},
                 {"peak_gpu_mb", static_cast<double>(model.peak_device_bytes()) / 1e6}});
  return 0;
}

// ---------------------------------------------------------------------------------------------
// fusekit eval
// ---------------------------------------------------------------------------------------------

CLI::App* add_eval_command(CLI::App& app, EvalFlags& f) {
  CLI::App* cmd = app.add_subcommand("eval", "Test metrics of a DLRM checkpoint (from fusekit train --checkpoint)");
  cmd->add_option("--checkpoint", f.checkpoint, "Checkpoint file")->required()->check(CLI::ExistingFile);
  cmd->add_option("--data", f.data, "Evaluate on this data's test split instead of the run's");
  cmd->add_option("--test-mini-batch-size", f.test_mini_batch_size, "Evaluation batch size");
  cmd->add_option("--device", f.device, "cpu (default) | cuda: where the model is evaluated");
  cmd->add_option("--predictions", f.predictions,
                  "Write label<TAB>probability for every test sample here, in test-set order (atomically)");
  return cmd;
}

int run_eval(const EvalFlags& f) {
  if (!f.predictions.empty()) apps::check_writable(f.predictions, "fusekit eval", "--predictions");
  std::ifstream in;
  const apps::CheckpointHeader h = apps::open_checkpoint(f.checkpoint, in, "fusekit eval");
  TrainConfig c;
  from_json(h.config, c);
  if (f.data) c.data = *f.data;
  if (f.test_mini_batch_size) c.test_mini_batch_size = *f.test_mini_batch_size;
  c.device = f.device;
  // Evaluation is a forward pass, the same function in both implementations: the fused one (it
  // keeps no dense table gradients).
  c.impl = "fused";
  validate(c);
  const auto [device, impl] = pick_device(c, "fusekit eval");
  const data::Featurizer feat = make_featurizer(c);
  models::Dlrm model(make_model_config(c, feat), device, impl);
  model.load_state(in);
  const Split split = load_data(c, feat);
  fmt::print("fusekit eval: {} (step {}), {}, device {}\n", f.checkpoint, h.step, split.description, device.str());
  const Predictions p = predict(model, split.test, feat, c.test_mini_batch_size, static_cast<int>(c.data_workers));
  const models::BinaryMetrics m = models::evaluate_binary(p.probs, p.labels);
  if (!f.predictions.empty()) {
    apps::write_file_atomically(f.predictions, "fusekit eval", "--predictions", [&](std::ostream& out) {
      // 9 significant digits give back the float exactly.
      fmt::memory_buffer line;
      for (std::size_t i = 0; i < p.probs.size(); ++i) {
        line.clear();
        fmt::format_to(std::back_inserter(line), "{:g}\t{:.9g}\n", p.labels[i], p.probs[i]);
        out.write(line.data(), static_cast<std::streamsize>(line.size()));
      }
    });
    fmt::print("predictions: {} lines in {}\n", p.probs.size(), f.predictions);
  }
  fmt::print("eval: test logloss {:.5f}, AUC {:.5f}, accuracy {:.5f} ({} samples, {:.1f}% positive)\n", m.log_loss, m.auc,
             m.accuracy, m.samples, 100 * m.positive_rate);
  return 0;
}

// ---------------------------------------------------------------------------------------------
// fusekit data
// ---------------------------------------------------------------------------------------------

namespace {

// 26 sizes joined by '-', as the reference's --arch-embedding-size.
std::vector<std::int64_t> parse_cardinalities(const std::string& s) {
  std::vector<std::int64_t> v;
  const char* p = s.data();
  const char* end = s.data() + s.size();
  while (true) {
    std::int64_t x = 0;
    const auto [next, ec] = std::from_chars(p, end, x);
    if (ec != std::errc{} || x < 1 || (next != end && *next != '-')) {
      v.clear();
      break;
    }
    v.push_back(x);
    if (next == end) break;
    p = next + 1;
  }
  FK_CHECK_ARG(v.size() == data::kNumSparse, "fusekit data synth", "--cardinalities",
               "kaggle, mlperf-terabyte or 26 positive sizes joined by '-'", s);
  return v;
}

}  // namespace

CLI::App* add_data_command(CLI::App& app, DataFlags& f) {
  CLI::App* cmd = app.add_subcommand("data", "Criteo data tools: synthetic data, TSV to binary, vocabularies, preprocessing into day shards, the loader's rate");
  cmd->require_subcommand(1);
  CLI::App* synth = cmd->add_subcommand("synth", "Write synthetic Criteo-like samples as a Criteo TSV file");
  synth->add_option("--rows", f.rows, "Samples to write")->check(CLI::PositiveNumber);
  synth->add_option("--seed", f.seed, "Generator seed (as fusekit train --data-seed)");
  synth->add_option("--cardinalities", f.cardinalities,
                    "Each feature's distinct values: kaggle (Kaggle's), mlperf-terabyte (the MLPerf model's: "
                    "Terabyte's under --max-ind-range 40000000) or 26 sizes joined by '-'");
  synth->add_option("--zipf-exponent", f.zipf_exponent,
                    "s of the values' ranks' density ~ r^-s (1.1; near 0: near uniform, every value seen)")
      ->check(CLI::PositiveNumber);
  synth->add_option("--out", f.out, "Output file: Criteo TSV, or the fusekit binary format when it ends in .bin")
      ->required();
  CLI::App* convert = cmd->add_subcommand("convert", "Convert a Criteo TSV (.gz) file to the fusekit binary format");
  convert->add_option("in", f.in, "Criteo TSV file, plain or gzip")->required()->check(CLI::ExistingFile);
  convert->add_option("out", f.out, "Binary output file")->required();
  convert->add_flag("--strict", f.strict, "Stop at the first malformed line");
  CLI::App* vocab = cmd->add_subcommand(
      "vocab", "Build the categorical features' vocabulary (raw value -> dense id) from a file's training records");
  vocab->add_option("in", f.in, "Criteo TSV (.gz) or fusekit binary file")->required()->check(CLI::ExistingFile);
  vocab->add_option("--out", f.out, "Vocabulary file to write (for fusekit train --vocabulary)")->required();
  vocab->add_option("--test-fraction", f.test_fraction,
                    "The last fraction of the records is the test set, left out of the counts (as fusekit train)")
      ->check(CLI::Range(0.0, 1.0));
  vocab->add_option("--data-set", f.data_set, "kaggle: count the reference's training days 0-5 (as fusekit train "
                                              "--data-set kaggle) instead of all but --test-fraction")
      ->check(CLI::IsMember({"kaggle"}));
  vocab->add_option("--max-ind-range", f.max_ind_range, "> 0: raw values modulo this before the vocabulary")
      ->check(CLI::NonNegativeNumber);
  vocab->add_option("--min-count", f.min_count, "Values seen fewer times share the unknown id 0")
      ->check(CLI::PositiveNumber);
  vocab->add_flag("--strict", f.strict, "Stop at the first malformed line");
  CLI::App* pre = cmd->add_subcommand(
      "preprocess", "Criteo TSV (.gz) files -> a directory of shards of vocabulary ids for fusekit train --data DIR");
  pre->add_option("in", f.inputs, "One Criteo file (kaggle) or the day files in order (terabyte: day_0 ... day_23)")
      ->required()
      ->check(CLI::ExistingFile);
  pre->add_option("--out", f.out, "Output directory (created; a data set already there is replaced)")->required();
  pre->add_option("--data-set", f.preprocess_set, "kaggle: one file cut into 7 days; terabyte: a file per day; the "
                                                  "last day is the test day")
      ->check(CLI::IsMember({"kaggle", "terabyte"}));
  pre->add_option("--max-ind-range", f.max_ind_range, "> 0: raw values modulo this before the vocabulary")
      ->check(CLI::NonNegativeNumber);
  pre->add_option("--min-count", f.min_count, "Values seen fewer times in the training days share the unknown id 0")
      ->check(CLI::PositiveNumber);
  pre->add_flag("--vocabulary-all-days", f.all_days,
                "Count the test day's values too, as the DLRM reference's dictionaries do (default: training days)");
  pre->add_option("--threads", f.threads, "Worker threads (0: every core)")->check(CLI::NonNegativeNumber);
  pre->add_flag("--strict", f.strict, "Stop at the first malformed line");
  CLI::App* rate = cmd->add_subcommand(
      "loader-rate", "How fast the batch loader reads a preprocessed data set's training days (no model)");
  rate->add_option("dir", f.in, "A directory written by fusekit data preprocess")->required();
  rate->add_option("--mini-batch-size", f.batch, "Batch size")->check(CLI::PositiveNumber);
  rate->add_option("--data-workers", f.workers, "Threads preparing batches")->check(CLI::Range(1, 256));
  rate->add_option("--batches", f.batches, "Batches an epoch (0: every whole batch of the training days)")
      ->check(CLI::NonNegativeNumber);
  rate->add_option("--epochs", f.epochs, "Epochs to read, each timed (the first maps and checks the pages)")
      ->check(CLI::Range(1, 1000));
  return cmd;
}

int run_data(CLI::App& data_cmd, const DataFlags& f) {
  if (*data_cmd.get_subcommand("synth")) {
    data::SyntheticConfig sc;
    sc.seed = f.seed;
    sc.zipf_exponent = f.zipf_exponent;
    if (f.cardinalities == "mlperf-terabyte")
      sc.cardinalities.assign(data::kMlperfTerabyteCardinalities.begin(), data::kMlperfTerabyteCardinalities.end());
    else if (f.cardinalities != "kaggle")
      sc.cardinalities = parse_cardinalities(f.cardinalities);
    const data::SyntheticCriteo gen(sc);
    const bool binary = std::filesystem::path(f.out).extension() == ".bin";
    data::RecordWriter writer(f.out, binary ? data::FileFormat::binary : data::FileFormat::tsv);
    // Chunks of 1M samples, each generated on every core (samples are independent), then written.
    const std::int64_t threads = std::clamp<std::int64_t>(std::thread::hardware_concurrency(), 1, 64);
    std::vector<data::RawRecord> records;
    for (std::int64_t begin = 0; begin < f.rows; begin += std::int64_t{1} << 20) {
      const std::int64_t n = std::min(std::int64_t{1} << 20, f.rows - begin);
      records.resize(static_cast<std::size_t>(n));
      const std::int64_t chunk = (n + threads - 1) / threads;
      std::vector<std::thread> pool;
      for (std::int64_t t = 0; t * chunk < n; ++t)
        pool.emplace_back([&, t] {
          const std::int64_t b = t * chunk, m = std::min(chunk, n - b);
          gen.generate(begin + b, std::span(records).subspan(static_cast<std::size_t>(b), static_cast<std::size_t>(m)));
        });
      for (std::thread& th : pool) th.join();
      writer.write(records, static_cast<int>(threads));
    }
    writer.close();
    fmt::print("data: wrote {} synthetic samples (seed {}) to {} ({})\n", f.rows, f.seed, f.out,
               binary ? "fusekit binary" : "Criteo TSV");
    return 0;
  }
  if (*data_cmd.get_subcommand("loader-rate")) {
    // The training loop's loader exactly: the training days in a total random order, batches of
    // the fused implementation (no bags) in page-locked memory where CUDA is built in.
    TrainConfig c;
    c.data = f.in;
    const data::Featurizer feat = make_featurizer(c);  // as fusekit train --data DIR makes it
    const data::ShardSet set = data::open_shards(f.in, feat.vocabulary);
    const std::vector<std::int64_t> days(set.day_begin.begin(), set.day_begin.end() - 1);
    const auto source = data::ordered_source(set.all(), data::training_order(days, c.data_randomize, c.shuffle_seed));
    const std::int64_t epoch = source->size() / f.batch;
    const std::int64_t n = f.batches > 0 ? std::min(f.batches, epoch) : epoch;
    FK_CHECK_ARG(n >= 1, "fusekit data loader-rate", "--mini-batch-size", "at most the training records",
                 std::to_string(f.batch));
    int devices = 0;
#if FUSEKIT_WITH_CUDA
    if (cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;
#endif
    data::BatchLoader loader(data::slice_source(source, 0, n * f.batch), feat,
                             {.batch_size = f.batch, .workers = f.workers,
                              .allocate = devices > 0 ? data::pinned_host_allocator() : data::HostAllocator{},
                              .bags = false, .epochs = f.epochs});
    const auto print_rate = [&](const std::string& what, std::int64_t batches, double secs) {
      fmt::print("loader-rate: {}{} batches of {} from {} with {} workers ({} memory) in {:.2f} s: {:.2f}M samples/s, "
                 "{:.0f} batches/s, {:.1f} µs a batch\n",
                 what, batches, f.batch, f.in, f.workers, devices > 0 ? "page-locked" : "plain", secs,
                 static_cast<double>(batches * f.batch) / secs / 1e6, static_cast<double>(batches) / secs,
                 1e6 * secs / static_cast<double>(batches));
    };
    const auto t0 = std::chrono::steady_clock::now();
    auto epoch_start = t0;
    std::int64_t read = 0;
    while (loader.next()) {
      if (++read % n != 0) continue;
      const auto now = std::chrono::steady_clock::now();
      if (f.epochs > 1)
        print_rate(fmt::format("epoch {}: ", read / n - 1), n, std::chrono::duration<double>(now - epoch_start).count());
      epoch_start = now;
    }
    print_rate(f.epochs > 1 ? fmt::format("{} epochs: ", f.epochs) : "", read,
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    return 0;
  }
  if (*data_cmd.get_subcommand("preprocess")) {
    data::PreprocessOptions o;
    for (const std::string& in : f.inputs) o.inputs.emplace_back(in);
    o.out = f.out;
    o.data_set = f.preprocess_set;
    o.vocabulary = {.max_ind_range = f.max_ind_range, .min_count = f.min_count};
    o.vocabulary_all_days = f.all_days;
    o.threads = f.threads;
    o.strict = f.strict;
    const bool tty = isatty(fileno(stdout)) != 0;
    auto last = std::chrono::steady_clock::now() - std::chrono::hours(1);
    o.progress = [&](const data::PreprocessProgress& p) {
      const bool final = p.bytes >= p.total_bytes;
      const auto now = std::chrono::steady_clock::now();
      if (!final && now - last < std::chrono::seconds(tty ? 0 : 5)) return;
      last = now;
      const double secs = std::max(p.seconds, 1e-9);
      const double frac = p.total_bytes > 0 ? static_cast<double>(p.bytes) / static_cast<double>(p.total_bytes) : 1.0;
      fmt::print("{}preprocess: pass {}/{} {:<10} {} {:5.1f}%  {:.2f} of {:.2f} GB, {} records, {:.2f}M rows/s, "
                 "{:.0f} MB/s{}",
                 tty ? "\r" : "", p.pass, p.passes, p.what, progress_bar(frac), 100 * frac, p.bytes / 1e9,
                 p.total_bytes / 1e9, p.records, static_cast<double>(p.records) / secs / 1e6, p.bytes / secs / 1e6,
                 tty && !final ? "" : "\n");
      std::fflush(stdout);
    };
    const data::PreprocessReport r = data::preprocess(o);
    for (std::size_t i = 0; i < o.inputs.size(); ++i) fmt::print("data: {}: {}\n", f.inputs[i], r.inputs[i].summary());
    std::int64_t records = 0;
    for (const std::int64_t n : r.day_records) records += n;
    fmt::print("data: wrote {} ({} days, {} records: {}), vocabulary of {} table rows (max_ind_range {}, min_count {}, "
               "counted over {} days, fingerprint {:08x}) in {:.1f} s: {:.2f}M rows/s, {:.0f} MB/s of input; peak host "
               "memory {:.0f} MB\n",
               f.out, r.day_records.size(), records, fmt::join(r.day_records, " "), r.table_rows, f.max_ind_range,
               f.min_count, f.all_days ? "all" : "the training", r.fingerprint, r.seconds,
               static_cast<double>(records) / r.seconds / 1e6, static_cast<double>(r.input_bytes) / r.seconds / 1e6,
               peak_host_mb());
    return 0;
  }
  if (*data_cmd.get_subcommand("vocab")) {
    std::string description;
    const std::shared_ptr<data::RecordSource> all = open_file(f.in, f.strict, description);
    const std::int64_t n_train = f.data_set == "kaggle" ? data::kaggle_split(all->size()).train_end
                                                        : all->size() - test_records(all->size(), f.test_fraction);
    const data::VocabularyOptions options{.max_ind_range = f.max_ind_range, .min_count = f.min_count};
    // Chunks of 1M records, each counted with the features split among every core.
    const int threads = static_cast<int>(std::clamp<unsigned>(std::thread::hardware_concurrency(), 1, 26));
    data::VocabularyCounter counter(options);
    std::vector<data::RawRecord> chunk(std::size_t{1} << 20);
    for (std::int64_t b = 0; b < n_train; b += std::ssize(chunk)) {
      const auto part = std::span(chunk).first(static_cast<std::size_t>(std::min(std::ssize(chunk), n_train - b)));
      all->read(b, part);
      counter.add(part, threads);
    }
    const data::Vocabulary v = data::Vocabulary::build(counter);
    v.save(f.out);
    std::int64_t rows = 0;
    for (const std::int64_t r : v.table_rows()) rows += r;
    fmt::print("data: {}{} training records counted (max_ind_range {}, min_count {}): {} table rows in all, "
               "fingerprint {:08x}; wrote {}\n",
               description, n_train, f.max_ind_range, f.min_count, rows, v.fingerprint(), f.out);
    return 0;
  }
  const data::ReadReport report = data::convert_tsv_to_binary(f.in, f.out, {.strict = f.strict});
  fmt::print("data: {}: {}\ndata: wrote {} records to {}\n", f.in, report.summary(), report.records, f.out);
  return 0;
}

}  // namespace fk::app
