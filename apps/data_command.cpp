// `fusekit data`: synthetic data out as TSV or binary, TSV to binary, vocabularies, preprocessing
// into day shards, and the batch loader's rate (apps/train.hpp).
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <thread>

#include "apps/host_stats.hpp"
#include "apps/train.hpp"
#include "apps/train_data.hpp"
#include "fusekit/core/error.hpp"
#include "fusekit/data/criteo.hpp"
#include "fusekit/data/preprocess.hpp"
#include "fusekit/data/source.hpp"
#include "fusekit/data/vocabulary.hpp"

#if FUSEKIT_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace fk::app {

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

namespace {

// fusekit data synth: samples of the synthetic generator as Criteo TSV, or binary for a .bin name.
int run_synth(const DataFlags& f) {
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

// fusekit data loader-rate: the training loop's loader exactly, without a model.
int run_loader_rate(const DataFlags& f) {
  // The training loop's loader exactly: the training days in a total random order, batches of
  // the fused implementation (no bags) in page-locked memory where CUDA is built in.
  FK_CHECK_ARG(data::find_source_kind(f.in) == data::SourceKind::shards, "fusekit data loader-rate", "dir",
               "a directory written by fusekit data preprocess", f.in);
  TrainConfig c;
  c.data = f.in;
  const RunData run = open_data(c);  // as fusekit train --data DIR opens it
  const data::Featurizer& feat = run.featurizer;
  const std::shared_ptr<data::RecordSource>& source = run.split.train;
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

// fusekit data preprocess: Criteo TSV files -> a directory of day shards, with progress lines.
int run_preprocess(const DataFlags& f) {
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

// fusekit data vocab: the vocabulary of a file's training records.
int run_vocab(const DataFlags& f) {
  const data::DataSource source = data::open_source(f.in, {.strict = f.strict});
  FK_CHECK_ARG(!source.shards, "fusekit data vocab", "in", "a Criteo TSV (.gz) or fusekit binary file",
               source.name());
  if (source.report) fmt::print("data: {}: {}\n", f.in, source.report->summary());
  const std::shared_ptr<data::RecordSource>& all = source.records;
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
  fmt::print("data: {}: {} training records counted (max_ind_range {}, min_count {}): {} table rows in all, "
             "fingerprint {:08x}; wrote {}\n",
             source.name(), n_train, f.max_ind_range, f.min_count, rows, v.fingerprint(), f.out);
  return 0;
}

}  // namespace

int run_data(CLI::App& data_cmd, const DataFlags& f) {
  if (*data_cmd.get_subcommand("synth")) return run_synth(f);
  if (*data_cmd.get_subcommand("loader-rate")) return run_loader_rate(f);
  if (*data_cmd.get_subcommand("preprocess")) return run_preprocess(f);
  if (*data_cmd.get_subcommand("vocab")) return run_vocab(f);
  const data::ReadReport report = data::convert_tsv_to_binary(f.in, f.out, {.strict = f.strict});
  fmt::print("data: {}: {}\ndata: wrote {} records to {}\n", f.in, report.summary(), report.records, f.out);
  return 0;
}

}  // namespace fk::app
