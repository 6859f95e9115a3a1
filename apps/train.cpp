// `fusekit train`: DLRM trained on synthetic or real Criteo data, configured by a JSON file and the
// DLRM reference's flags (apps/train_config.cpp), with progress lines, periodic evaluation and a
// metrics JSON; and `fusekit eval`. A run is a sequence of steps, each a function below: resolve
// the settings, open the data (apps/train_data.cpp), build the model, train, evaluate, save.
#include "apps/train.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <iostream>
#include <memory>

#include "apps/checkpoint.hpp"
#include "apps/checkpoint_distributed.hpp"
#include "apps/host_stats.hpp"
#include "apps/output_file.hpp"
#include "apps/train_data.hpp"
#include "fusekit/core/error.hpp"
#include "fusekit/data/criteo.hpp"
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

constexpr const char* kOp = "fusekit train";
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// ---------------------------------------------------------------------------------------------
// Prediction and metrics (train and eval)
// ---------------------------------------------------------------------------------------------

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

json metrics_record(const models::BinaryMetrics& m) {
  return {{"samples", m.samples}, {"positive_rate", m.positive_rate}, {"logloss", m.log_loss},
          {"auc", std::isnan(m.auc) ? json(nullptr) : json(m.auc)}, {"accuracy", m.accuracy}};
}

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

// ---------------------------------------------------------------------------------------------
// Step 1: the settings
// ---------------------------------------------------------------------------------------------

struct Settings {
  TrainConfig config;
  StartState start;
  bool train = true;        // false: --inference-only (no checkpoint, no trace)
  bool impl_given = false;  // --impl or the --config file chose the implementation
};

Settings resolve_settings(const TrainFlags& flags) {
  Settings s{.config = resolve(flags.config)};
  TrainConfig& c = s.config;
  if (!c.processed_data.empty() && !flags.run.dry_run) use_processed_data(c, flags.config);
  if (!flags.config.no_effect.empty())
    fmt::print("fusekit train: warning: the DLRM reference's {} {} no effect here (see --help)\n",
               fmt::join(flags.config.no_effect, " "), flags.config.no_effect.size() == 1 ? "has" : "have");
  s.start = start_state(flags.run, c);
  s.train = !flags.run.inference_only;
  s.impl_given = set_explicitly(flags.config, "training.impl");
  // Every output is checked before the run, not found unwritable after it has trained.
  if (!flags.run.dry_run) {
    if (s.train && !c.checkpoint.empty()) apps::check_writable(c.checkpoint, kOp, "--checkpoint");
    if (!c.metrics_json.empty()) apps::check_writable(c.metrics_json, kOp, "--metrics-json");
    if (s.train && !c.trace.empty()) apps::check_writable(c.trace, kOp, "--trace");
  }
  return s;
}

std::int64_t table_rows(const models::DlrmConfig& mc) {
  std::int64_t rows = 0;
  for (const std::int64_t r : mc.table_rows) rows += r;
  return rows;
}

// The parameters' megabytes: f32, the tables in their dtype.
double parameter_megabytes(const models::DlrmConfig& mc) {
  const double table_values = static_cast<double>(table_rows(mc)) * static_cast<double>(mc.embedding_dim);
  return ((static_cast<double>(mc.parameter_count()) - table_values) * 4 +
          table_values * static_cast<double>(dtype_size(mc.embedding_dtype))) / 1e6;
}

// --dry-run: the model and data the settings describe, and the settings themselves.
int dry_run(const TrainConfig& c) {
  const RunData data = open_data(c, /*read=*/false);
  const models::DlrmConfig mc = make_model_config(c, data.featurizer);
  fmt::print("fusekit train --dry-run: DLRM bot {} top {}-{} D {} interaction {}, {} tables ({} rows), {:.1f}M "
             "parameters ({:.0f} MB), {} lr {} batch {}, data {}, device {}, impl {}\n",
             c.arch_mlp_bot, mc.interaction_size(), c.arch_mlp_top, mc.embedding_dim, c.arch_interaction_op,
             mc.table_rows.size(), table_rows(mc), static_cast<double>(mc.parameter_count()) / 1e6,
             parameter_megabytes(mc), c.optimizer, c.learning_rate, c.mini_batch_size,
             data.source ? data.source->description() : c.data, c.device, c.impl);
  fmt::print("{}\n", to_json(c).dump(2));
  return 0;
}

// ---------------------------------------------------------------------------------------------
// Step 3: the model
// ---------------------------------------------------------------------------------------------

// The run's first lines: the model, where its ids come from, the device and implementation, the data.
void print_banner(const TrainConfig& c, const RunData& data, const models::Dlrm& model, bool impl_given) {
  const data::Featurizer& feat = data.featurizer;
  const models::DlrmConfig& mc = model.config();
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
  std::vector<std::string> impl_notes;
  if (!impl_given) impl_notes.emplace_back("the default");
  if (model.device().is_cuda()) impl_notes.emplace_back("fp32 parameters, TF32 MLP GEMMs");
  if (mc.compress_activations_bits != 0)
    impl_notes.emplace_back(fmt::format("MLP activations kept at {} bits", mc.compress_activations_bits));
  fmt::print("fusekit train: DLRM bot {} top {}-{} D {} interaction {}, {} tables ({} rows, {}), "
             "{:.1f}M parameters ({:.0f} MB), {} lr {} batch {}, device {}, impl {}{}\n",
             c.arch_mlp_bot, mc.interaction_size(), c.arch_mlp_top, mc.embedding_dim, c.arch_interaction_op,
             mc.table_rows.size(), table_rows(mc), ids, static_cast<double>(mc.parameter_count()) / 1e6,
             parameter_megabytes(mc), c.optimizer, c.learning_rate, c.mini_batch_size,
             model.device().str(), models::impl_name(model.impl()),
             impl_notes.empty() ? std::string() : fmt::format(" ({})", fmt::join(impl_notes, "; ")));
  fmt::print("data: {}\n", data.split.description);
}

models::Dlrm build_model(const Settings& s, const RunData& data, Device device, models::DlrmImpl impl) {
  const auto t_init = Clock::now();
  models::Dlrm model(make_model_config(s.config, data.featurizer), device, impl);
  print_banner(s.config, data, model, s.impl_given);
  fmt::print("init: {:.1f} s\n", seconds_since(t_init));
  return model;
}

// The steps of a run: batch k of an epoch is records [kB, (k+1)B) of its first epoch_records.
struct Schedule {
  std::int64_t batch = 0, per_epoch = 0, epoch_records = 0, total = 0;
  // The training records of the steps before `step`: the samples a run has seen, whole or resumed.
  std::int64_t samples_before(std::int64_t s) const {
    return s / per_epoch * epoch_records + std::min(s % per_epoch * batch, epoch_records);
  }
  // The (0-based) epoch of the step before `step`: the one the progress line names.
  std::int64_t epoch_of_last_step(std::int64_t s) const { return s > 0 ? (s - 1) / per_epoch : 0; }
};

Schedule make_schedule(const TrainConfig& c, std::int64_t n_train) {
  Schedule s{.batch = c.mini_batch_size};
  // Steps per epoch: whole batches plus a partial one (no size + B - 1 that could wrap).
  const std::int64_t all_batches = n_train / c.mini_batch_size + (n_train % c.mini_batch_size != 0 ? 1 : 0);
  // --num-batches caps an epoch at its first batches (every one of them whole), as the reference does.
  s.per_epoch = c.num_batches > 0 ? std::min(c.num_batches, all_batches) : all_batches;
  s.epoch_records = std::min(n_train, s.per_epoch * c.mini_batch_size);
  s.total = c.steps;
  FK_CHECK_ARG(c.steps > 0 || !__builtin_mul_overflow(s.per_epoch, c.epochs, &s.total), kOp,
               "training.epochs (--epochs)",
               fmt::format("at most {} epochs of {} steps (2^63 steps)", INT64_MAX / s.per_epoch, s.per_epoch),
               fmt::format("{}", c.epochs));
  return s;
}

// Where the time and the loss of the training went: the progress window (since the last progress
// line), the epoch, the run.
struct Meter {
  double train_seconds = 0, train_cpu_seconds = 0;
  double data_wait_seconds = 0;  // the training thread waiting for the loader's next batch
  double peak_anonymous_mb = 0;  // sampled at each progress line and at the end
  double window_loss = 0, epoch_loss = 0, last_epoch_loss = 0;
  std::int64_t last_epoch_steps = 0;  // the steps last_epoch_loss covers (after a resume: this run's only)
  std::int64_t window_steps = 0, window_samples = 0, epoch_steps = 0, drained_steps = 0;
  Clock::time_point window_start = Clock::now(), epoch_start = Clock::now();
  double window_seconds = 0;  // the window's training time before its last evaluation or checkpoint
  double epoch_cpu_start = 0;

  // The steps since the last drain had the mean loss `mean`.
  void add_loss(double mean) {
    const std::int64_t n = window_steps - drained_steps;
    window_loss += mean * static_cast<double>(n);
    epoch_loss += mean * static_cast<double>(n);
    epoch_steps += n;
    drained_steps = window_steps;
  }
  void start_clock() {
    epoch_start = Clock::now();
    epoch_cpu_start = thread_cpu_seconds();
  }
  void stop_clock() {
    train_seconds += seconds_since(epoch_start);
    train_cpu_seconds += thread_cpu_seconds() - epoch_cpu_start;
  }
  void sample_memory() { peak_anonymous_mb = std::max(peak_anonymous_mb, anonymous_host_mb()); }
};

// A training run in progress.
struct Run {
  const TrainConfig& c;
  RunData data;
  models::Dlrm model;
  Schedule schedule;
  models::OptimizerConfig opt;
  bool scheduled_rate = false;  // the reference's learning-rate schedule
  std::int64_t step = 0, samples = 0;
  std::int64_t resumed_at = 0;    // 0 unless resumed: an epoch begun before covers only this run's steps
  std::int64_t samples_seen = 0;  // since the run's start, a resumed one's too
  std::unique_ptr<TraceRecorder> trace;
  std::int64_t trace_until = 0;
  json evals = json::array(), windows = json::array();
  Meter meter;

  Run(const Settings& s, Device device, models::DlrmImpl impl, RunData d)
      : c(s.config),
        data(std::move(d)),
        model(build_model(s, data, device, impl)),
        schedule(make_schedule(c, data.split.train->size())),
        opt{.kind = models::parse_optimizer(c.optimizer), .learning_rate = static_cast<float>(c.learning_rate)},
        scheduled_rate(has_learning_rate_schedule(c)) {}

  TraceRecorder* tracing() const { return step < trace_until ? trace.get() : nullptr; }
};

// The checkpoint the run starts from (--resume, --load-model), then the trace the run records.
void start(Run& r, const Settings& s, bool resume_override) {
  const StartState& start = s.start;
  if (!start.path.empty() && (start.must_exist || std::filesystem::exists(start.path))) {
    std::ifstream in;
    apps::CheckpointHeader h;
    try {
      h = apps::open_checkpoint(start.path, in, kOp);
    } catch (const Error& e) {
      if (!start.must_exist) throw;
      throw Error(e.op(), start.flag, e.expected(), e.got());  // the file is --load-model's, not --checkpoint's
    }
    const std::string diff = apps::config_differences(h.config, to_json(r.c), to_json(TrainConfig{}));
    FK_CHECK_ARG(diff.empty() || resume_override, kOp, start.flag,
                 fmt::format("the configuration stored in {} (--resume-override resumes with the new settings)",
                             start.path),
                 diff);
    r.step = h.step;
    FK_CHECK_ARG(!s.train || r.step <= r.schedule.total, kOp, start.flag,
                 fmt::format("a checkpoint at most at step {} (the run's end)", r.schedule.total),
                 fmt::format("{} at step {}", start.path, r.step));
    if (apps::is_distributed(h)) {  // a --distributed run's: its shards gathered into one state
      std::stringstream whole;
      apps::consolidate_checkpoint(start.path, h, in, r.model.config(), whole, kOp, start.flag.c_str());
      r.model.load_state(whole);
    } else {
      r.model.load_state(in);
    }
    fmt::print("{} {} at step {}\n", start.must_exist ? "loaded" : "resumed from", start.path, r.step);
  }
  if (s.train && !r.c.trace.empty()) {
    r.trace = std::make_unique<TraceRecorder>();
    r.model.set_trace(r.trace.get());
  }
  r.resumed_at = r.step;
  r.samples_seen = r.schedule.samples_before(r.step);
  r.trace_until = r.step + r.c.trace_steps;
  r.meter.peak_anonymous_mb = anonymous_host_mb();
  r.meter.window_start = Clock::now();
}

// ---------------------------------------------------------------------------------------------
// Steps 5 and 6: evaluate, save
// ---------------------------------------------------------------------------------------------

models::BinaryMetrics evaluate(Run& r, const char* when) {
  const auto t0 = Clock::now();
  const Predictions p = predict(r.model, r.data.split.test, r.data.featurizer, r.c.test_mini_batch_size,
                                static_cast<int>(r.c.data_workers));
  const models::BinaryMetrics m = models::evaluate_binary(p.probs, p.labels);
  fmt::print("eval {} step {}: test logloss {:.5f}, AUC {:.5f}, accuracy {:.5f} ({} samples, {:.1f}% positive, {:.1f} s)\n",
             when, r.step, m.log_loss, m.auc, m.accuracy, m.samples, 100 * m.positive_rate, seconds_since(t0));
  json record = metrics_record(m);
  record["step"] = r.step;
  record["samples_seen"] = r.samples_seen;
  record["epoch"] = r.schedule.epoch_of_last_step(r.step);
  r.evals.push_back(record);
  return m;
}

void save(const Run& r) {
  if (r.c.checkpoint.empty()) return;
  apps::write_checkpoint(r.c.checkpoint, r.step, to_json(r.c), [&](std::ostream& out) { r.model.save_state(out); });
  fmt::print("checkpoint: step {} saved to {}\n", r.step, r.c.checkpoint);
}

void write_metrics(const Run& r, json summary) {
  if (r.c.metrics_json.empty()) return;
  const json out = {{"config", to_json(r.c)},
                    {"device", r.model.device().str()},
                    {"impl", models::impl_name(r.model.impl())},
                    {"commit", fk::build_info().commit},
                    {"train", r.windows},
                    {"evaluations", r.evals},
                    {"summary", std::move(summary)}};
  apps::write_file_atomically(r.c.metrics_json, kOp, "--metrics-json",
                              [&](std::ostream& f) { f << out.dump(2) << "\n"; });
  fmt::print("metrics: {}\n", r.c.metrics_json);
}

// ---------------------------------------------------------------------------------------------
// Step 4: train
// ---------------------------------------------------------------------------------------------

// A non-finite loss stops the run before anything is evaluated or saved: the last checkpoint
// written stays the last good state.
double finite_loss(double mean, std::int64_t at) {
  FK_CHECK_ARG(std::isfinite(mean), kOp, "loss",
               "a finite training loss (the run diverged; the last checkpoint, if any, is the last good "
               "state; try a lower --learning-rate)",
               fmt::format("{} (mean of the steps up to step {})", mean, at));
  return mean;
}

const data::Batch* next_batch(Run& r, data::BatchLoader& loader) {
  if (r.trace && r.step == r.trace_until) r.model.set_trace(nullptr);
  const auto scope = trace_scope(r.tracing(), "data.wait");
  const auto t_wait = Clock::now();
  const data::Batch* b = loader.next();
  r.meter.data_wait_seconds += seconds_since(t_wait);
  return b;
}

void train_step(Run& r, const data::Batch& b) {
  {
    // On the GPU this returns once the batch is on the device; the loss is read at the next
    // progress line (drain_loss), so the host never waits for a step to finish.
    const auto scope = trace_scope(r.tracing(), "train_step", "train");
    if (r.scheduled_rate) r.opt.learning_rate = static_cast<float>(scheduled_learning_rate(r.c, r.step));
    r.model.enqueue_train_step(model_input(b), b.labels, r.opt);
  }
  ++r.step;
  r.samples += b.size;
  r.samples_seen += b.size;
  ++r.meter.window_steps;
  r.meter.window_samples += b.size;
}

// The progress line of the window that ends at this step.
void print_progress(Run& r, std::int64_t epoch) {
  Meter& m = r.meter;
  m.sample_memory();
  const double secs = m.window_seconds + seconds_since(m.window_start);
  const double loss = m.window_loss / static_cast<double>(m.window_steps);
  const double sps = static_cast<double>(m.window_samples) / secs;
  const std::int64_t total = r.schedule.total;
  fmt::print("epoch {} step {}/{} {} {:5.1f}%  loss {:.5f}  {:.0f} samples/s\n", epoch, r.step, total,
             progress_bar(static_cast<double>(r.step) / static_cast<double>(total)),
             100.0 * static_cast<double>(r.step) / static_cast<double>(total), loss, sps);
  r.windows.push_back({{"step", r.step},
                       {"samples_seen", r.samples_seen},
                       {"epoch", epoch},
                       {"loss", loss},
                       {"samples_per_s", sps},
                       {"learning_rate", r.scheduled_rate ? scheduled_learning_rate(r.c, r.step - 1) : r.c.learning_rate}});
  std::fflush(stdout);
  m.window_loss = 0;
  m.window_steps = 0;
  m.drained_steps = 0;
  m.window_samples = 0;
  m.window_seconds = 0;
  m.window_start = Clock::now();
}

// An evaluation (which may stop the run at a threshold) and a checkpoint within the run; their
// time is not training time.
void evaluate_and_save_midway(Run& r, bool eval_now) {
  Meter& m = r.meter;
  m.stop_clock();
  m.window_seconds += seconds_since(m.window_start);
  if (eval_now) {
    const models::BinaryMetrics e = evaluate(r, "at");
    const bool auc = r.c.auc_threshold > 0 && e.auc >= r.c.auc_threshold;
    if (auc || (r.c.accuracy_threshold > 0 && e.accuracy >= r.c.accuracy_threshold)) {
      fmt::print("stop: the test {} reached {} at step {}\n", auc ? "AUC" : "accuracy",
                 auc ? r.c.auc_threshold : r.c.accuracy_threshold, r.step);
      r.schedule.total = r.step;  // the final evaluation and checkpoint follow, as at the run's end
    }
  }
  save(r);
  m.start_clock();
  m.window_start = Clock::now();
}

// What follows a step: the loss read back when something reports it, the progress line, an
// evaluation, a checkpoint.
void after_step(Run& r, std::int64_t epoch) {
  const TrainConfig& c = r.c;
  const std::int64_t step = r.step, total = r.schedule.total;
  const bool print_now = c.print_every > 0 && (step % c.print_every == 0 || step == total);
  const bool eval_now = c.eval_every > 0 && step % c.eval_every == 0 && step < total;
  const bool save_now = c.checkpoint_every > 0 && step % c.checkpoint_every == 0 && step < total;
  if (print_now || eval_now || save_now || step == total) r.meter.add_loss(finite_loss(r.model.drain_loss(), step));
  if (print_now) print_progress(r, epoch);
  if (eval_now || save_now) evaluate_and_save_midway(r, eval_now);
}

// One epoch (the rest of it, when resumed mid-epoch); false when it had no step.
bool train_epoch(Run& r, data::BatchLoader& loader) {
  Meter& m = r.meter;
  const std::int64_t epoch = r.step / r.schedule.per_epoch;
  m.epoch_loss = 0;
  m.epoch_steps = 0;
  m.start_clock();
  while (r.step < r.schedule.total) {
    const data::Batch* b = next_batch(r, loader);
    if (!b) break;
    train_step(r, *b);
    after_step(r, epoch);
    if (r.step % r.schedule.per_epoch == 0) break;  // the epoch's last batch
  }
  m.add_loss(finite_loss(r.model.drain_loss(), r.step));  // the epoch's last steps (since the last progress line)
  m.stop_clock();
  if (m.epoch_steps > 0) {
    m.last_epoch_loss = m.epoch_loss / static_cast<double>(m.epoch_steps);
    m.last_epoch_steps = m.epoch_steps;
  }
  return m.epoch_steps > 0;
}

void train(Run& r) {
  // One loader for the run: batch k of an epoch is records [k B, (k + 1) B), and a resumed run
  // starts mid-epoch exactly where the interrupted one stopped.
  const Schedule& s = r.schedule;
  data::BatchLoader loader(data::slice_source(r.data.split.train, 0, s.epoch_records), r.data.featurizer,
                           {.batch_size = s.batch, .workers = static_cast<int>(r.c.data_workers),
                            .allocate = batch_allocator(r.model), .bags = r.model.impl() != models::DlrmImpl::fused || r.data.featurizer.multi_hot(),
                            .epochs = s.total / s.per_epoch + (s.total % s.per_epoch != 0) - r.step / s.per_epoch,
                            .first_batch = r.step % s.per_epoch});
  while (r.step < r.schedule.total && train_epoch(r, loader)) {
  }
}

// The run's end: the final evaluation and checkpoint, the trace, the summary line and metrics.
void finish(Run& r) {
  Meter& m = r.meter;
  m.sample_memory();
  const models::BinaryMetrics final_m = evaluate(r, "final,");
  m.sample_memory();
  save(r);
  if (r.trace) {
    r.trace->write(r.c.trace);
    fmt::print("trace: {} events of the first {} steps in {}\n", r.trace->size(), std::min(r.c.trace_steps, r.step),
               r.c.trace);
  }
  const double sps = m.train_seconds > 0 ? static_cast<double>(r.samples) / m.train_seconds : 0.0;
  const double cpu_sps = m.train_cpu_seconds > 0 ? static_cast<double>(r.samples) / m.train_cpu_seconds : 0.0;
  const double peak_gpu_mb = static_cast<double>(r.model.peak_device_bytes()) / 1e6;
  fmt::print("summary: train loss {:.5f} (mean over the last epoch's {} steps{}), test logloss {:.5f}, AUC {:.5f}, "
             "accuracy {:.5f}, {:.0f} samples/s ({} steps, {} samples, {:.1f} s training, {:.1f} s of it waiting for "
             "data; {:.0f} samples per CPU-second of the training thread), peak host memory {:.0f} MB (anonymous at "
             "most {:.0f} MB, the rest mapped data pages), peak GPU memory {:.0f} MB\n",
             m.last_epoch_loss, m.last_epoch_steps,
             r.resumed_at % r.schedule.per_epoch != 0 && r.step - m.last_epoch_steps == r.resumed_at
                 ? " run since the resume"
                 : "",
             final_m.log_loss, final_m.auc, final_m.accuracy, sps, r.step, r.samples, m.train_seconds,
             m.data_wait_seconds, cpu_sps, peak_host_mb(), m.peak_anonymous_mb, peak_gpu_mb);
  // What the MLPs keep from the forward to the backward of a training batch (a formula of the
  // shapes: the same on every device), and the scratch their calls use meanwhile.
  const nn::MLP::SavedActivationBytes act = r.model.mlp_activation_bytes(r.c.mini_batch_size);
  const int bits = r.model.config().compress_activations_bits;
  fmt::print("activations: the MLPs keep {:.2f} MB for the backward of a batch of {} ({}; {:.2f} MB as f32, {:.3f} of "
             "it), and use {:.2f} MB of scratch while they run\n",
             static_cast<double>(act.kept) / 1e6, r.c.mini_batch_size,
             bits != 0 ? fmt::format("packed at {} bits, ReLU masks at 1", bits) : std::string("f32, uncompressed"),
             static_cast<double>(act.whole) / 1e6, static_cast<double>(act.kept) / static_cast<double>(act.whole),
             static_cast<double>(act.scratch) / 1e6);
  write_metrics(r, {{"train_loss", m.last_epoch_loss},
                    {"train_loss_steps", m.last_epoch_steps},
                    {"test", metrics_record(final_m)},
                    {"samples_per_s", sps},
                    {"samples_per_cpu_s", cpu_sps},
                    {"steps", r.step},
                    {"samples", r.samples},
                    {"train_seconds", m.train_seconds},
                    {"data_wait_seconds", m.data_wait_seconds},
                    {"peak_host_mb", peak_host_mb()},
                    {"peak_anonymous_host_mb", m.peak_anonymous_mb},
                    {"peak_gpu_mb", peak_gpu_mb},
                    {"mlp_activations", {{"bits", bits == 0 ? 32 : bits},
                                         {"batch", r.c.mini_batch_size},
                                         {"whole_bytes", act.whole},
                                         {"kept_bytes", act.kept},
                                         {"scratch_bytes", act.scratch}}}});
}

}  // namespace

int run_train(const TrainFlags& flags) {
  const Settings s = resolve_settings(flags);
  if (flags.run.dry_run) return dry_run(s.config);
  const bool sharded = flags.run.distributed || flags.run.gpus > 0;
  FK_CHECK_ARG(sharded || flags.run.max_shard_rows == 0, kOp, "--max-shard-rows", "--distributed or --gpus",
               "a one-process run");
  if (sharded) {
    const char* flag = flags.run.distributed ? "--distributed" : "--gpus";
    FK_CHECK_ARG(!(flags.run.distributed && flags.run.gpus > 0), kOp, "--gpus",
                 "no --distributed (--gpus N runs every rank in this process; mpirun ... --distributed --device cuda "
                 "runs a process a GPU)",
                 "both");
    FK_CHECK_ARG(s.train && s.config.metrics_json.empty() && s.config.trace.empty(), kOp, flag,
                 "no --inference-only, metrics JSON or trace (not yet)", "one of them");
    if (flags.run.distributed)
      return run_train_distributed(s.config, flags.run.max_shard_rows, s.start, flags.run.resume_override);
    // --gpus means GPUs, whatever device a --config file names; a --device flag must agree.
    const nlohmann::json& given = flags.config.given;
    const bool device_flag = given.contains("training") && given.at("training").contains("device");
    TrainConfig c = s.config;
    if (!device_flag) c.device = "cuda";
    return run_train_gpus(c, flags.run.gpus, flags.run.max_shard_rows, s.start, flags.run.resume_override);
  }
  const auto [device, impl] = pick_device(s.config, kOp);
  Run r(s, device, impl, open_data(s.config));
  start(r, s, flags.run.resume_override);
  if (!s.train) {
    const models::BinaryMetrics m = evaluate(r, "inference-only,");
    write_metrics(r, {{"inference_only", true}, {"test", metrics_record(m)}, {"steps", r.step}});
    return 0;
  }
  train(r);
  finish(r);
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
  from_json(apps::stored_run_config(h), c);
  if (f.data) c.data = *f.data;
  if (f.test_mini_batch_size) c.test_mini_batch_size = *f.test_mini_batch_size;
  c.device = f.device;
  // Evaluation is a forward pass, the same function in both implementations: the fused one (it
  // keeps no dense table gradients).
  c.impl = "fused";
  validate(c);
  const auto [device, impl] = pick_device(c, "fusekit eval");
  const RunData data = open_data(c);
  models::Dlrm model(make_model_config(c, data.featurizer), device, impl);
  if (apps::is_distributed(h)) {
    std::stringstream whole;
    apps::consolidate_checkpoint(f.checkpoint, h, in, model.config(), whole, "fusekit eval", "--checkpoint");
    model.load_state(whole);
  } else {
    model.load_state(in);
  }
  fmt::print("fusekit eval: {} (step {}), {}, device {}\n", f.checkpoint, h.step, data.split.description,
             device.str());
  const Predictions p = predict(model, data.split.test, data.featurizer, c.test_mini_batch_size,
                                static_cast<int>(c.data_workers));
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

}  // namespace fk::app
