// The table of `fusekit train`'s settings, and the reader, flags, merge, validation and echo that
// derive from it.
#include "apps/train_config.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <type_traits>

#include "fusekit/core/device.hpp"
#include "fusekit/core/error.hpp"
#include "fusekit/data/criteo.hpp"
#include "fusekit/data/vocabulary.hpp"
#include "fusekit/models/dlrm.hpp"

namespace fk::app {

using nlohmann::json;

namespace {

constexpr const char* kOp = "fusekit train";

// A number as a message shows it: nan and inf, which JSON writes as null, included.
std::string shown(const json& v) { return v.is_number_float() ? fmt::format("{}", v.get<double>()) : v.dump(); }

// A check from the condition that accepts a number, and what it is called.
Check number_check(std::function<bool(double)> accepts, std::string expected) {
  return [accepts = std::move(accepts), expected = std::move(expected)](const json& v, const std::string& name) {
    FK_CHECK_ARG(v.is_number() && accepts(v.get<double>()), kOp, name, expected, shown(v));
  };
}

}  // namespace

Check at_least(double low) {
  return number_check([low](double x) { return x >= low; }, fmt::format(">= {}", low));
}

Check in_range(double low, double high) {
  return number_check([low, high](double x) { return x >= low && x <= high; }, fmt::format("in [{}, {}]", low, high));
}

Check fraction() {
  return number_check([](double x) { return x >= 0 && x < 1; }, "in [0, 1)");
}

Check one_of(std::vector<std::string> values) {
  return [values = std::move(values)](const json& v, const std::string& name) {
    const std::string got = v.get<std::string>();
    if (std::find(values.begin(), values.end(), got) != values.end()) return;
    std::string expected;
    for (const std::string& x : values) expected += (expected.empty() ? "" : ", ") + (x.empty() ? "\"\"" : x);
    throw Error(kOp, name, "one of " + expected, got);
  };
}

Check compression_bits() {
  return number_check([](double x) { return x == 0 || x == 8 || x == 4 || x == 2; }, "0 (off), 8, 4 or 2");
}

Check positive_finite() {
  return number_check([](double x) { return std::isfinite(x) && x > 0; }, "a finite number > 0");
}

Check layer_sizes() {
  return [](const json& v, const std::string& name) { parse_layer_sizes(v.get<std::string>(), name); };
}

Check parsed_by(std::function<void(std::string_view)> parse) {
  return [parse = std::move(parse)](const json& v, const std::string& name) {
    try {
      parse(v.get<std::string>());
    } catch (const Error& e) {
      throw Error(kOp, name, e.expected(), e.got());
    }
  };
}

std::vector<std::int64_t> parse_layer_sizes(const std::string& s, const std::string& name) {
  std::vector<std::int64_t> v;
  std::size_t start = 0;
  while (start <= s.size()) {
    const std::size_t dash = s.find('-', start);
    const std::string part = s.substr(start, dash == std::string::npos ? std::string::npos : dash - start);
    std::size_t used = 0;
    long long x = 0;
    try {
      x = std::stoll(part, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != part.size() || x < 1) throw Error(kOp, name, "layer sizes like 13-512-256-64-16", s);
    v.push_back(x);
    if (dash == std::string::npos) break;
    start = dash + 1;
  }
  return v;
}

// The settings of `fusekit train`, in the order of the echo's sections. A row's default is its
// member's initializer in TrainConfig; --help shows it.
const std::vector<Setting>& train_settings() {
  using C = TrainConfig;
  using data::parse_hash_mode, models::parse_impl, models::parse_interaction_op, models::parse_optimizer;
  static const std::vector<Setting> table = {
      // key                               member                          check (null: any value)
      //  flags                           help
      //                                  note (optional: where a spelling comes from, how it differs)
      {"model.arch_mlp_bot",               &C::arch_mlp_bot,               layer_sizes(),
       "--arch-mlp-bot",                  "Bottom MLP sizes, input first"},
      {"model.arch_mlp_top",               &C::arch_mlp_top,               layer_sizes(),
       "--arch-mlp-top",                  "Top MLP sizes after the interaction"},
      {"model.arch_sparse_feature_size",   &C::arch_sparse_feature_size,   at_least(1),
       "--arch-sparse-feature-size",      "Embedding dimension"},
      {"model.arch_interaction_op",        &C::arch_interaction_op,        parsed_by(parse_interaction_op),
       "--arch-interaction-op",           "dot | cat | outer | dcn (DCNv2's low-rank cross network)"},
      {"model.dcn_num_layers",             &C::dcn_num_layers,             at_least(1),
       "--dcn-num-layers",                "dcn: cross layers"},
      {"model.dcn_low_rank_dim",           &C::dcn_low_rank_dim,           at_least(1),
       "--dcn-low-rank-dim",              "dcn: rank r of each cross layer's U [F*D, r] and V [r, F*D]"},
      {"model.arch_interaction_itself",    &C::arch_interaction_itself,    {},
       "--arch-interaction-itself",       "dot: include each feature's dot with itself"},
      {"model.fused_mlp",                  &C::fused_mlp,                  {},
       "--fused-mlp",                     "--impl fused: run every MLP whose widths fit (in/out <= 128, one hidden "
                                          "width of 16/32/64/128) as one fused_mlp kernel, in bf16 with fp32 master "
                                          "weights"},
      {"model.compress_activations",       &C::compress_activations,       compression_bits(),
       "--compress-activations",          "Keep what the MLPs' backward needs compressed: each layer's input packed at "
                                          "8, 4 or 2 bits (stochastic rounding, reproducible from --seed), each hidden "
                                          "ReLU's mask at 1 bit, the weight gradients computed from the packed bits "
                                          "(0: off, the f32 activations). Not with --fused-mlp. See docs/dlrm.md"},
      {"model.embedding_dtype",            &C::embedding_dtype,            one_of({"f32", "bf16", "f16"}),
       "--embedding-dtype",               "The tables' dtype: f32, or bf16 / f16 (half the tables' memory; each "
                                          "update stored with stochastic rounding)"},
      {"model.seed",                       &C::model_seed,                 {},
       "--seed",                          "Model initialisation seed"},
      {"data.source",                      &C::data,                       {},
       "--data,--raw-data-file",          "synthetic, a directory written by fusekit data preprocess, or a Criteo "
                                          "TSV (.gz) / fusekit binary file"},
      {"data.cardinalities",               &C::cardinalities,              {},
       "",                                "Rows of each table (empty: the Criteo Kaggle ones)"},
      {"data.multi_hot_sizes",             &C::multi_hot_sizes,            {},
       "",                                "Multi-hot bag size of each of the 26 features (empty: one-hot); see "
                                          "docs/dlrm.md for how the extra rows are drawn"},
      {"data.max_ind_range",               &C::max_ind_range,              at_least(0),
       "--max-ind-range",                 "Cap on rows per table (0: the full cardinalities)"},
      {"data.hash",                        &C::data_hash,                  parsed_by(parse_hash_mode),
       "--data-hash",                     "seed: (v + 1) % rows; reference: v % rows"},
      {"data.vocabulary",                  &C::vocabulary,                 {},
       "--vocabulary",                    "A vocabulary file (fusekit data vocab): each categorical value becomes "
                                          "its dense id, the tables sized by it (data.max_ind_range and data.hash "
                                          "then have no effect)"},
      {"data.train_samples",               &C::train_samples,              at_least(1),
       "--train-samples",                 "Synthetic data: training samples per epoch"},
      {"data.test_samples",                &C::test_samples,               at_least(0),
       "--test-samples",                  "Synthetic data: test samples"},
      {"data.seed",                        &C::data_seed,                  {},
       "--data-seed",                     "Synthetic data: seed"},
      {"data.zipf_exponent",               &C::zipf_exponent,              positive_finite(),
       "",                                "Synthetic data: exponent of the categorical ids' Zipf law"},
      {"data.test_fraction",               &C::test_fraction,              fraction(),
       "--test-fraction",                 "File data: the last fraction of the records is the test set"},
      {"data.set",                         &C::data_set,                   one_of({"", "kaggle", "terabyte"}),
       "--data-set",                      "File data: kaggle splits the file as the DLRM reference does (7 days: "
                                          "0-5 train, day 6's first half test, second half validation) instead of "
                                          "--test-fraction; preprocessed data: the set it holds (checked)"},
      {"data.randomize",                   &C::data_randomize,             one_of({"total", "day", "none"}),
       "--data-randomize",                "File data: the training order: total (all training records permuted "
                                          "once), day (within each day), none (file order)"},
      {"data.shuffle_seed",                &C::shuffle_seed,               {},
       "--numpy-rand-seed",               "File data: the seed of the training order's permutation"},
      {"data.strict",                      &C::strict_data,                {},
       "--strict-data",                   "A malformed TSV line is an error (default: skipped and counted)"},
      {"data.workers",                     &C::data_workers,               in_range(1, 256),
       "--data-workers,--num-workers",    "Threads preparing batches"},
      {"training.optimizer",               &C::optimizer,                  parsed_by(parse_optimizer),
       "--optimizer",                     "sgd | adagrad"},
      {"training.rowwise_adagrad",         &C::rowwise_adagrad,            {},
       "--rowwise-adagrad",               "adagrad: the tables keep one accumulator per row (FBGEMM's row-wise "
                                          "Adagrad, the MLPerf DLRM-DCNv2 recipe); the MLPs stay element-wise"},
      {"training.learning_rate",           &C::learning_rate,              positive_finite(),
       "--learning-rate",                 "Learning rate"},
      {"training.mini_batch_size",         &C::mini_batch_size,            at_least(1),
       "--mini-batch-size",               "Training batch size"},
      {"training.test_mini_batch_size",    &C::test_mini_batch_size,       at_least(1),
       "--test-mini-batch-size",          "Evaluation batch size"},
      {"training.epochs",                  &C::epochs,                     at_least(0),
       "--epochs,--nepochs",              "Passes over the training data"},
      {"training.steps",                   &C::steps,                      at_least(0),
       "--steps",                         "Stop after this many training steps (0: the epochs decide)"},
      {"training.num_batches",             &C::num_batches,                at_least(0),
       "--num-batches",                   "Batches of each epoch (0: all), as dlrm_s_pytorch.py counts them"},
      {"training.loss_function",           &C::loss_function,              one_of({"bce"}),
       "--loss-function",                 "The DLRM reference's loss: bce (sigmoid binary cross-entropy) only"},
      {"data.generation",                  &C::data_generation,            one_of({"", "dataset"}),
       "--data-generation",               "The DLRM reference's data source: dataset (a Criteo file: --data or "
                                          "--raw-data-file); fusekit's own synthetic data is --data synthetic"},
      {"training.lr_num_warmup_steps",     &C::lr_num_warmup_steps,        at_least(0),
       "--lr-num-warmup-steps",           "Learning-rate warmup steps (dlrm_s_pytorch.py's schedule)"},
      {"training.lr_decay_start_step",     &C::lr_decay_start_step,        at_least(0),
       "--lr-decay-start-step",           "Step the polynomial (power 2) learning-rate decay starts at"},
      {"training.lr_num_decay_steps",      &C::lr_num_decay_steps,         at_least(0),
       "--lr-num-decay-steps",            "Steps of the learning-rate decay (0: none)"},
      {"training.device", {}, {}, "--use-gpu", "The reference's spelling of --device cuda", {},
       [](const std::string&) { return json("cuda"); }, false},
      // The DLRM reference's flags that change nothing here: accepted, and named in one warning line.
      {"data.processed",                   &C::processed_data,             {},
       "--processed-data-file",           "The DLRM reference's preprocessed data: a fusekit data preprocess "
                                          "directory, trained from; written first from --data (a Criteo TSV) "
                                          "unless it holds that file preprocessed (the reference's split, its "
                                          "dictionaries over every day, --max-ind-range when given)"},
      {"", {}, {}, "--memory-map", "The reference's memory mapping (fusekit reads files with pread)", {}, nullptr, false},
      {"", {}, {}, "--print-time", "The reference's timing in progress lines (always printed here)", {}, nullptr, false},
      {"", {}, {}, "--test-num-workers", "The reference's evaluation loader workers (see --data-workers)"},
      {"", {}, {}, "--round-targets", "The reference's label rounding (Criteo labels are 0 or 1 already)"},
      {"", {}, {}, "--mlperf-logging", "The reference's MLPerf logging (fusekit always computes the AUC)", {}, nullptr,
       false},
      {"", {}, {}, "--dataset-multiprocessing", "The reference's preprocessing processes", {}, nullptr, false},
      {"", {}, {}, "--mlperf-bin-loader", "The reference's binary data loader (fusekit reads its own day files)", {},
       nullptr, false},
      {"", {}, {}, "--mlperf-bin-shuffle", "The reference's shuffle of the binary loader's batches (see "
                                           "--data-randomize, total by default)", {}, nullptr, false},
      {"training.auc_threshold",           &C::auc_threshold,              fraction(),
       "--auc-threshold,--mlperf-auc-threshold", "Stop at the first evaluation whose test AUC reaches this (0: never)"},
      {"training.accuracy_threshold",      &C::accuracy_threshold,         fraction(),
       "--accuracy-threshold,--mlperf-acc-threshold",
                                          "Stop at the first evaluation whose test accuracy reaches this (0: never)"},
      {"training.eval_every",              &C::eval_every,                 at_least(0),
       "--eval-every,--test-freq",        "Evaluate every this many steps (0: at the end only)"},
      {"training.print_every",             &C::print_every,                at_least(0),
       "--print-every,--print-freq",      "Progress line every this many steps (0: none)"},
      {"training.device",                  &C::device,                     parsed_by(&Device::parse),
       "--device",                        "cpu | cuda | cuda:N"},
      {"training.impl",                    &C::impl,                       parsed_by(parse_impl),
       "--impl",                          "fused | reference: the fused ops (one-launch embeddings with the hash fused "
                                          "in, the sparse backward fused with the optimizer, fused epilogues, loss and "
                                          "interaction; on a GPU a CUDA graph of the step) or the unfused baseline "
                                          "(dense table gradients). Both run on every device; on the CPU they run the "
                                          "same specs, the fused one updating only the rows a batch touches"},
      {"training.metrics_json",            &C::metrics_json,               {},
       "--metrics-json",                  "Write the run's configuration, progress windows, evaluations and summary here"},
      {"training.checkpoint",              &C::checkpoint,                 {},
       "--checkpoint,--save-model",       "Save the training state here (atomically) at the end and at evaluations"},
      {"training.trace",                   &C::trace,                      {},
       "--trace",                         "Chrome trace-event JSON of the step phases (chrome://tracing, Perfetto)"},
      {"training.trace_steps",             &C::trace_steps,                at_least(0),
       "--trace-steps",                   "Steps recorded in the trace"},
      {"training.checkpoint_every",        &C::checkpoint_every,           at_least(0),
       "--checkpoint-every",              "Also save every this many steps"},
      {"training.bucket_cap_mb",           &C::bucket_cap_mb,              at_least(0),
       "--bucket-cap-mb",                 "--distributed, --gpus: all-reduce the dense gradients in buckets of at most "
                                          "this many MiB, each as soon as the backward has made it (0: one all-reduce "
                                          "after the backward)"},
  };
  return table;
}

namespace {

template <class... F>
struct overloaded : F... {
  using F::operator()...;
};
template <class... F>
overloaded(F...) -> overloaded<F...>;  // for compilers without C++20's aggregate deduction (clang 14)

bool has_member(const Setting& s) { return !std::holds_alternative<std::monostate>(s.member); }

std::pair<std::string, std::string> split_key(const std::string& key) {
  const std::size_t dot = key.find('.');
  return {key.substr(0, dot), key.substr(dot + 1)};
}

// The place of `key` ("training.steps") in a sectioned config object.
json& slot(json& root, const std::string& key) {
  const auto [section, name] = split_key(key);
  return root[section][name];
}

const Setting* find_setting(const std::string& key) {
  for (const Setting& s : train_settings())
    if (has_member(s) && s.key == key) return &s;
  return nullptr;
}

// "training.steps (--steps)": what an error about the setting names.
std::string display_name(const Setting& s) {
  if (s.flags.empty()) return s.key;
  return fmt::format("{} ({})", s.key, s.flags.substr(0, s.flags.find(',')));
}

template <class T>
T read_value(const json& v, const std::string& key, const char* op) {
  auto require = [&](bool ok, const char* expected) {
    if (!ok) throw Error(op, key, expected, shown(v));
  };
  if constexpr (std::is_same_v<T, std::string>) {
    require(v.is_string(), "a string");
  } else if constexpr (std::is_same_v<T, bool>) {
    require(v.is_boolean(), "true or false");
  } else if constexpr (std::is_same_v<T, std::uint64_t>) {
    require(v.is_number_unsigned(), "an integer >= 0");
  } else if constexpr (std::is_same_v<T, std::int64_t>) {
    require(v.is_number_integer(), "an integer");
  } else if constexpr (std::is_same_v<T, double>) {
    require(v.is_number(), "a number");
  } else {
    static_assert(std::is_same_v<T, std::vector<std::int64_t>>);
    require(v.is_array() && std::all_of(v.begin(), v.end(), [](const json& x) { return x.is_number_integer(); }),
            "an array of integers");
  }
  return v.get<T>();
}

// Sets the settings present in the sectioned object `j`; `op` names where it came from.
void apply(const json& j, TrainConfig& c, const char* op) {
  if (!j.is_object()) throw Error(op, "file", "a JSON object", j.type_name());
  std::vector<std::string> sections;
  for (const Setting& s : train_settings())
    if (const std::string section = split_key(s.key).first;
        has_member(s) && std::find(sections.begin(), sections.end(), section) == sections.end())
      sections.push_back(section);
  for (const auto& [section, entries] : j.items()) {
    if (section == "comment") continue;
    if (std::find(sections.begin(), sections.end(), section) == sections.end())
      throw Error(op, section, fmt::format("a section: {} (and comment)", fmt::join(sections, ", ")), section);
    if (!entries.is_object()) throw Error(op, section, "an object of settings", entries.type_name());
    for (const auto& item : entries.items()) {
      const std::string& name = item.key();
      const nlohmann::json& value = item.value();  // a lambda may capture it (not a structured binding)
      const std::string key = section + "." + name;
      const Setting* s = find_setting(key);
      if (!s) throw Error(op, key, "a known key (see docs/dlrm.md)", name);
      std::visit(overloaded{[](std::monostate) {},
                            [&](auto TrainConfig::*m) {
                              c.*m = read_value<std::remove_cvref_t<decltype(c.*m)>>(value, key, op);
                            }},
                 s->member);
    }
  }
}

json read_json_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw Error(kOp, "--config", "a readable file", path);
  try {
    return json::parse(in, nullptr, true, /*ignore_comments=*/true);
  } catch (const json::exception& e) {
    throw Error(kOp, "--config", "a JSON file", fmt::format("{}: {}", path, e.what()));
  }
}

// --help's text of a row: its help, its note.
std::string help_text(const Setting& s) { return s.note.empty() ? s.help : fmt::format("{}. {}", s.help, s.note); }

}  // namespace

void from_json(const json& j, TrainConfig& c) { apply(j, c, "fusekit train --config"); }

json to_json(const TrainConfig& c) {
  json j = json::object();
  for (const Setting& s : train_settings())
    std::visit(overloaded{[](std::monostate) {}, [&](auto TrainConfig::*m) { slot(j, s.key) = c.*m; }}, s.member);
  return j;
}

void validate(const TrainConfig& c) {
  const json j = to_json(c);
  for (const Setting& s : train_settings()) {
    if (!has_member(s) || !s.check) continue;
    const auto [section, name] = split_key(s.key);
    s.check(j.at(section).at(name), display_name(s));
  }
  FK_CHECK_ARG(c.epochs >= 1 || c.steps > 0, kOp, "training.epochs (--epochs)", ">= 1 (or steps > 0)",
               fmt::format("{}", c.epochs));
  FK_CHECK_ARG(c.lr_decay_start_step >= c.lr_num_warmup_steps, kOp, "training.lr_decay_start_step (--lr-decay-start-step)",
               fmt::format("at least the warmup's {} steps (the warmup must end before the decay starts)",
                           c.lr_num_warmup_steps),
               std::to_string(c.lr_decay_start_step));
  FK_CHECK_ARG(c.data_generation != "dataset" || c.data != "synthetic" || !c.processed_data.empty(), kOp,
               "data.generation (--data-generation)",
               "a Criteo file given with --data or --raw-data-file, or --processed-data-file (dataset)",
               "no file (data.source synthetic)");
}

void add_config_flags(CLI::App& cmd, ConfigFlags& f, std::span<const Setting> table) {
  cmd.add_option("--config", f.config, "JSON file with the hyperparameters (configs/*.json); flags override it")
      ->check(CLI::ExistingFile);
  const TrainConfig defaults;
  json& given = f.given;
  for (const Setting& s : table) {
    if (s.flags.empty()) continue;
    std::visit(overloaded{
                   [&](std::monostate) {
                     auto set = [&given, &no_effect = f.no_effect, key = s.key, translate = s.translate,
                                 flag = s.flags.substr(0, s.flags.find(','))](const std::string& text) {
                       if (!key.empty()) slot(given, key) = translate ? translate(text) : json(text);
                       else no_effect.push_back(text.empty() ? flag : flag + "=" + text);
                     };
                     if (s.takes_value)
                       cmd.add_option_function<std::string>(s.flags, set, help_text(s));
                     else
                       cmd.add_flag_callback(s.flags, [set] { set(""); }, help_text(s));
                   },
                   [&](bool TrainConfig::*) {
                     auto set = [&given, key = s.key](std::int64_t count) { slot(given, key) = count > 0; };
                     cmd.add_flag_function(s.flags, set, help_text(s));
                   },
                   [&](auto TrainConfig::*m) {
                     using T = std::remove_cvref_t<decltype(defaults.*m)>;
                     const json d = defaults.*m;
                     cmd.add_option_function<T>(
                            s.flags, [&given, key = s.key](const T& v) { slot(given, key) = v; }, help_text(s))
                         ->default_str(d.is_string() ? d.get<std::string>() : d.dump());
                   }},
               s.member);
  }
}

bool set_explicitly(const ConfigFlags& f, const std::string& key) {
  const std::pair<std::string, std::string> at = split_key(key);  // no structured binding: clang 14 cannot capture one
  const auto in = [&](const json& j) { return j.contains(at.first) && j.at(at.first).contains(at.second); };
  return in(f.given) || (!f.config.empty() && in(read_json_file(f.config)));
}

TrainConfig resolve(const ConfigFlags& f) {
  TrainConfig c;
  if (!f.config.empty()) from_json(read_json_file(f.config), c);
  apply(f.given, c, kOp);
  validate(c);
  return c;
}

void add_run_flags(CLI::App& cmd, RunFlags& f) {
  cmd.add_flag("--dry-run", f.dry_run, "Check the configuration, print the model and data it describes, exit");
  cmd.add_flag("--distributed", f.distributed,
               "Train over the ranks of `mpirun -np N` (tables sharded over the ranks, MLPs data-parallel; on the "
               "CPU through MPI, or with --device cuda a GPU a rank through NCCL; one process in a build without MPI)");
  cmd.add_option("--gpus", f.gpus,
                 "Train over N GPUs of this machine (0 to N-1) in this process, a thread and an NCCL rank each: "
                 "the --distributed run without mpirun (implies --device cuda)")
      ->check(CLI::PositiveNumber);
  cmd.add_option("--max-shard-rows", f.max_shard_rows,
                 "With --distributed or --gpus: split every table of more rows into row ranges of at most this many, "
                 "placed on several ranks (0, the default: tables whole, one rank each)")
      ->check(CLI::NonNegativeNumber);
  cmd.add_flag("--resume", f.resume, "Continue from --checkpoint when it exists (same losses as an unbroken run)");
  cmd.add_flag("--resume-override", f.resume_override,
               "Resume (or --load-model) even when settings differ from those stored in the checkpoint (the run is "
               "then not the unbroken run's continuation)");
  cmd.add_option("--load-model", f.load_model,
                 "Continue from this checkpoint (weights, optimizer state, step), as --resume does from --checkpoint; "
                 "it is written only when --checkpoint/--save-model names it. The DLRM reference's flag")
      ->check(CLI::ExistingFile);
  cmd.add_flag("--inference-only", f.inference_only,
               "Evaluate on the test set and exit, training nothing: the --load-model model, or the freshly "
               "initialised one. The DLRM reference's flag; writes --metrics-json, no checkpoint or trace");
}

StartState start_state(const RunFlags& f, const TrainConfig& c) {
  FK_CHECK_ARG(!f.resume || f.load_model.empty(), kOp, "--resume",
               "either --resume (from --checkpoint) or --load-model FILE, not both", "both");
  FK_CHECK_ARG(!f.resume || !c.checkpoint.empty(), kOp, "--resume", "a --checkpoint path", "none");
  if (!f.load_model.empty()) return {.path = f.load_model, .must_exist = true, .flag = "--load-model"};
  if (f.resume) return {.path = c.checkpoint, .must_exist = false, .flag = "--resume"};
  return {};
}

bool has_learning_rate_schedule(const TrainConfig& c) { return c.lr_num_warmup_steps > 0 || c.lr_num_decay_steps > 0; }

double scheduled_learning_rate(const TrainConfig& c, std::int64_t step) {
  const double base = c.learning_rate;
  const std::int64_t w = c.lr_num_warmup_steps, d = c.lr_decay_start_step, n = c.lr_num_decay_steps;
  const auto warmup = [&](std::int64_t s) { return base * (1.0 - static_cast<double>(w - s) / static_cast<double>(w)); };
  const auto decay = [&](std::int64_t s) {
    const double k = static_cast<double>(n - (s - d)) / static_cast<double>(n);
    return std::max(1e-7, base * k * k);
  };
  const std::int64_t s = step + 1;  // the scheduler's count when step `step` runs
  if (s < w) return warmup(s);
  if (d <= s && s < d + n) return decay(s);
  if (n == 0) return base;
  if (s >= d + n) return decay(d + n - 1);  // frozen at the decay's last rate
  return w >= 2 ? warmup(w - 1) : base;     // between the phases: the warmup's last rate, if it gave one
}

std::shared_ptr<const data::Vocabulary> load_vocabulary(const TrainConfig& c) {
  if (c.vocabulary.empty()) return nullptr;
  return std::make_shared<const data::Vocabulary>(data::Vocabulary::load(c.vocabulary));
}

data::Featurizer make_featurizer(const TrainConfig& c, std::shared_ptr<const data::Vocabulary> vocabulary,
                                 bool premapped) {
  data::Featurizer feat;
  if (!c.cardinalities.empty()) feat.cardinalities = c.cardinalities;
  feat.multi_hot_sizes = c.multi_hot_sizes;
  feat.validate();
  feat.max_ind_range = c.max_ind_range;
  feat.hash = data::parse_hash_mode(c.data_hash);
  feat.vocabulary = std::move(vocabulary);
  feat.premapped = premapped;
  if (feat.vocabulary) {
    feat.hash = data::HashMode::reference;  // the identity on ids
    feat.max_ind_range = feat.vocabulary->options().max_ind_range;
  }
  feat.validate();
  return feat;
}

models::DlrmConfig make_model_config(const TrainConfig& c, const data::Featurizer& feat) {
  models::DlrmConfig mc;
  mc.bottom_mlp = parse_layer_sizes(c.arch_mlp_bot, "model.arch_mlp_bot (--arch-mlp-bot)");
  mc.top_mlp = parse_layer_sizes(c.arch_mlp_top, "model.arch_mlp_top (--arch-mlp-top)");
  mc.embedding_dim = c.arch_sparse_feature_size;
  mc.interaction = models::parse_interaction_op(c.arch_interaction_op);
  mc.interaction_itself = c.arch_interaction_itself;
  mc.dcn_num_layers = c.dcn_num_layers;
  mc.dcn_low_rank_dim = c.dcn_low_rank_dim;
  FK_CHECK_ARG(!c.rowwise_adagrad || c.optimizer == "adagrad", "fusekit train", "training.rowwise_adagrad (--rowwise-adagrad)",
               "training.optimizer adagrad", c.optimizer);
  mc.rowwise_adagrad = c.rowwise_adagrad;
  mc.fused_mlp = c.fused_mlp;
  FK_CHECK_ARG(c.compress_activations == 0 || !c.fused_mlp, "fusekit train",
               "model.compress_activations (--compress-activations)",
               "0 with model.fused_mlp (--fused-mlp): the one-kernel MLP keeps its own bf16 activations",
               std::to_string(c.compress_activations));
  mc.compress_activations_bits = static_cast<int>(c.compress_activations);
  mc.embedding_dtype = parse_dtype(c.embedding_dtype);
  mc.table_rows = feat.table_rows();
  mc.seed = c.model_seed;
  mc.raw_hash = feat.hash;
  // The rate changes every step under a schedule; the graph of a step holds its rate.
  if (has_learning_rate_schedule(c)) mc.cuda_graph = false;
  FK_CHECK_ARG(mc.bottom_mlp.front() == data::kNumDense, "fusekit train", "--arch-mlp-bot",
               "13 inputs (Criteo's integer features)", c.arch_mlp_bot);
  mc.validate();
  return mc;
}

}  // namespace fk::app
