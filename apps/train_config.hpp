// The configuration of `fusekit train`: TrainConfig, and the one table of its settings from which
// everything else derives: the --config JSON reader (unknown keys are an error), the command-line
// flags (which override the file), their merge, the validation, and the config echo written into
// --metrics-json, checkpoints and --dry-run's output. Also the flags that are not configuration
// (RunFlags: --resume, --load-model, --inference-only, ...) and the start they ask for.
#pragma once

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "fusekit/data/criteo.hpp"
#include "fusekit/models/dlrm.hpp"

namespace fk::app {

// Every hyperparameter of a training run. Each member has one row in train_settings(); its type
// and initializer (the default) are the row's.
struct TrainConfig {
  // model (flag names as dlrm_s_pytorch.py's)
  std::string arch_mlp_bot = "13-512-256-64-16";
  std::string arch_mlp_top = "512-256-1";
  std::int64_t arch_sparse_feature_size = 16;
  std::string arch_interaction_op = "dot";
  bool arch_interaction_itself = false;
  std::int64_t dcn_num_layers = 3;      // dcn: cross layers
  std::int64_t dcn_low_rank_dim = 512;  // dcn: rank of each cross layer
  bool fused_mlp = false;  // GPU fused: MLPs whose widths fit run through fused_mlp (bf16)
  std::int64_t compress_activations = 0;  // 8, 4 or 2: the MLPs keep their activations packed (0: off)
  std::string embedding_dtype = "f32";    // the tables' dtype: f32 | bf16 | f16 (stochastic rounding)
  std::uint64_t model_seed = 1;
  // data
  std::string data = "synthetic";           // "synthetic", or what data::open_source opens: a Criteo TSV (.gz too), a fusekit binary file, a preprocessed directory
  std::vector<std::int64_t> cardinalities;  // empty: the Kaggle ones
  std::vector<std::int64_t> multi_hot_sizes;  // empty: one-hot; else 26 bag sizes
  std::int64_t max_ind_range = 100000;      // cap on table rows (0: none). See docs/dlrm.md.
  std::string data_hash = "seed";           // "seed": (v + 1) % rows, "reference": v % rows
  std::string vocabulary;                   // a vocabulary file: dense ids, tables sized by it
  std::string processed_data;               // the reference's --processed-data-file: a preprocessed directory
  std::int64_t train_samples = 1 << 18;     // synthetic data
  std::int64_t test_samples = 1 << 15;      // synthetic data
  std::uint64_t data_seed = 2024;           // synthetic data
  double zipf_exponent = 1.1;               // synthetic data
  double test_fraction = 0.1;               // file data: the last fraction of the records is the test set
  std::string data_set;                     // file data: "kaggle": the DLRM reference's 7-day split instead
  std::string data_randomize = "total";     // file data: training order: total | day | none (as the reference)
  std::uint64_t shuffle_seed = 123;         // file data: the training order's seed
  bool strict_data = false;                 // file data: a malformed line is an error, not skipped
  std::int64_t data_workers = 1;            // threads preparing batches
  // training
  std::string optimizer = "sgd";
  bool rowwise_adagrad = false;  // adagrad: one accumulator per table row
  double learning_rate = 0.1;
  std::int64_t mini_batch_size = 128;
  std::int64_t test_mini_batch_size = 4096;
  std::int64_t epochs = 1;
  std::int64_t steps = 0;       // > 0: stop after this many steps (overrides epochs)
  std::int64_t num_batches = 0; // > 0: batches of each epoch (the reference's --num-batches)
  std::string loss_function = "bce";     // the reference's --loss-function: bce only
  std::string data_generation;           // the reference's --data-generation: "" or dataset
  std::int64_t lr_num_warmup_steps = 0;  // the reference's learning-rate schedule (scheduled_learning_rate)
  std::int64_t lr_decay_start_step = 0;
  std::int64_t lr_num_decay_steps = 0;
  std::int64_t eval_every = 0;  // > 0: evaluate on the test set every this many steps
  double auc_threshold = 0;       // > 0: stop at the first evaluation whose test AUC reaches it (the reference's)
  double accuracy_threshold = 0;  // > 0: the same for the test accuracy
  std::int64_t print_every = 200;
  std::string device = "cpu";
  std::string impl = "fused";  // the fused ops wherever they exist (the CPU runs their specs)
  std::string metrics_json;
  std::string trace;                 // Chrome trace-event JSON of the step phases
  std::int64_t trace_steps = 50;     // steps recorded in the trace (the first ones)
  std::string checkpoint;            // saved at the end, at each evaluation and every checkpoint_every steps
  std::int64_t checkpoint_every = 0;
  // --distributed, --gpus: the dense gradients all-reduced in buckets of at most this many MiB, each
  // started as the backward makes it (models::DistributedDlrmOptions); 0: one all-reduce after it.
  double bucket_cap_mb = 25;

  bool operator==(const TrainConfig&) const = default;
};

// The member a setting binds to; std::monostate on an alias row.
using Member = std::variant<std::monostate, std::string TrainConfig::*, bool TrainConfig::*, std::int64_t TrainConfig::*,
                            std::uint64_t TrainConfig::*, double TrainConfig::*, std::vector<std::int64_t> TrainConfig::*>;

// Throws fk::Error naming `name` (and saying what was expected, and what was got) unless `value`,
// the setting's value as written in the echo, is accepted.
using Check = std::function<void(const nlohmann::json& value, const std::string& name)>;
Check at_least(double low);                  // low <= value
Check in_range(double low, double high);     // low <= value <= high
Check fraction();                            // 0 <= value < 1
Check positive_finite();                     // a finite number > 0
Check compression_bits();                    // 0 (off), 8, 4 or 2
Check layer_sizes();                         // "13-512-256-64-16"
// What the library's parser (models::parse_optimizer, Device::parse, ...) accepts; its fk::Error
// says what that is.
Check parsed_by(std::function<void(std::string_view)> parse);

// One row of the table.
//
// A setting row binds `member` and is read from and echoed to `key` in a --config file. An alias
// row has no member and flags only, for the DLRM reference's flags that mean something else here:
// given, it sets the setting `key` to translate(the flag's text) (the text itself when translate
// is null), e.g. {.key = "training.device", .flags = "--use-gpu", .help = ..., .note = ...,
// .translate = [](const std::string&) { return "cuda"; }, .takes_value = false}; with `key` empty
// it is accepted and changes nothing, and its note says why.
struct Setting {
  std::string key;        // "training.steps": section and name in a --config file and in the echo
  Member member;          // &TrainConfig::steps
  Check check;            // the values accepted; null: any value of the member's type
  std::string flags;      // "--steps,--num-batches": the command-line spellings, all the same; "": file only
  std::string help;       // --help's text (the default is shown from the member's initializer)
  std::string note = {};  // where a spelling comes from, how it differs from the DLRM reference; in --help
  std::function<nlohmann::json(const std::string& text)> translate = nullptr;  // alias rows
  bool takes_value = true;                                                     // alias rows: false for a bare flag
};

const std::vector<Setting>& train_settings();

void from_json(const nlohmann::json& j, TrainConfig& c);  // sets the keys present; unknown keys are an error
nlohmann::json to_json(const TrainConfig& c);              // every setting, sectioned as a config file
void validate(const TrainConfig& c);                       // every row's check, then those across settings

// --vocabulary's file, loaded (null when none is given).
std::shared_ptr<const data::Vocabulary> load_vocabulary(const TrainConfig& c);
// The featurizer (tables, hash) and the model of a run's settings; fk::Error naming the setting
// that is inconsistent. `vocabulary`: the ids' vocabulary (--vocabulary's, or the preprocessed
// data's own); `premapped`: the data holds that vocabulary's ids already (preprocessed shards).
data::Featurizer make_featurizer(const TrainConfig& c, std::shared_ptr<const data::Vocabulary> vocabulary = nullptr,
                                 bool premapped = false);

// The learning rate of training step `step` (0-based) under dlrm_s_pytorch.py's LRPolicyScheduler
// (W warmup steps, decay from step D over N steps; the scheduler's count is step + 1): s / W
// times the rate while s < W; ((N - (s - D)) / N)^2 times it, at least 1e-7, while D <= s < D + N;
// otherwise, when N > 0, the last rate either phase gave (between them the warmup's last one,
// after the decay its last one), and the rate itself when no phase has given one yet (where the
// reference fails); when N = 0, the rate itself.
double scheduled_learning_rate(const TrainConfig& c, std::int64_t step);
bool has_learning_rate_schedule(const TrainConfig& c);
models::DlrmConfig make_model_config(const TrainConfig& c, const data::Featurizer& feat);

// "13-512-256-64-16" -> {13, 512, 256, 64, 16}; fk::Error naming `name` otherwise.
std::vector<std::int64_t> parse_layer_sizes(const std::string& s, const std::string& name);

// The command line's part of the configuration: --config, and the flags given, kept as a config
// fragment that resolve() applies after the file.
struct ConfigFlags {
  std::string config;
  nlohmann::json given = nlohmann::json::object();
  // The DLRM reference's flags given that have no effect here ("--print-time", ...), in the
  // settings table's order: fusekit train names them in one warning line.
  std::vector<std::string> no_effect;
};
// --config and a flag for every row of `table` that has flags.
void add_config_flags(CLI::App& cmd, ConfigFlags& flags, std::span<const Setting> table = train_settings());
// The defaults, then the --config file, then the flags given; validated.
TrainConfig resolve(const ConfigFlags& flags);
// Whether the --config file or a flag set `key` ("data.max_ind_range"), rather than the default.
bool set_explicitly(const ConfigFlags& flags, const std::string& key);

// The command line of `fusekit train` that is not configuration (never in the echo): where the
// run's state comes from and whether it trains. The DLRM reference's --load-model FILE continues
// from FILE (its weights, optimizer state and step) and writes it only when --checkpoint
// (--save-model) names it too; --inference-only evaluates the loaded model, or the freshly
// initialised one, on the test set and trains nothing.
struct RunFlags {
  bool dry_run = false, resume = false, resume_override = false, inference_only = false;
  bool distributed = false;  // the run over MPI's ranks (apps/train_distributed.cpp)
  int gpus = 0;              // > 0: the distributed run on GPUs 0 .. gpus-1, a thread each, in this process
  std::int64_t max_shard_rows = 0;  // --distributed, --gpus: > 0 splits tables with more rows by rows
  std::string load_model;
};
void add_run_flags(CLI::App& cmd, RunFlags& flags);

// The checkpoint a run starts from: --load-model's file (which must exist: its flag checks it),
// or with --resume the configuration's checkpoint when it exists.
struct StartState {
  std::string path;            // "": a freshly initialised model
  bool must_exist = false;     // --load-model
  std::string flag;            // "--load-model" or "--resume": what errors about it name
};
// fk::Error for flags that contradict each other (--resume with --load-model, --resume without a
// checkpoint).
StartState start_state(const RunFlags& flags, const TrainConfig& c);

}  // namespace fk::app
