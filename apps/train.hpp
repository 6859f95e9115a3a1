// `fusekit train` (DLRM on Criteo data) and `fusekit data` (synthetic data out as TSV, TSV to the
// binary format): the subcommands and the configuration they share.
#pragma once

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace fk::app {

// Every hyperparameter of a training run. A --config JSON file sets any of them (sections
// "model", "data", "training"; unknown keys are an error); command-line flags override the file.
struct TrainConfig {
  // model (flag names as dlrm_s_pytorch.py's)
  std::string arch_mlp_bot = "13-512-256-64-16";
  std::string arch_mlp_top = "512-256-1";
  std::int64_t arch_sparse_feature_size = 16;
  std::string arch_interaction_op = "dot";
  bool arch_interaction_itself = false;
  bool fused_mlp = false;  // GPU fused: MLPs whose widths fit run through fused_mlp (bf16)
  std::uint64_t model_seed = 1;
  // data
  std::string data = "synthetic";           // "synthetic" or a file: Criteo TSV (.gz too) or fusekit binary
  std::vector<std::int64_t> cardinalities;  // empty: the Kaggle ones
  std::int64_t max_ind_range = 100000;      // cap on table rows (0: none). See docs/dlrm.md.
  std::string data_hash = "seed";           // "seed": (v + 1) % rows, "reference": v % rows
  std::int64_t train_samples = 1 << 18;     // synthetic data
  std::int64_t test_samples = 1 << 15;      // synthetic data
  std::uint64_t data_seed = 2024;           // synthetic data
  double zipf_exponent = 1.1;               // synthetic data
  double test_fraction = 0.1;               // file data: the last fraction of the records is the test set
  bool strict_data = false;                 // file data: a malformed line is an error, not skipped
  std::int64_t data_workers = 1;            // threads preparing batches
  // training
  std::string optimizer = "sgd";
  double learning_rate = 0.1;
  std::int64_t mini_batch_size = 128;
  std::int64_t test_mini_batch_size = 4096;
  std::int64_t epochs = 1;
  std::int64_t steps = 0;       // > 0: stop after this many steps (overrides epochs)
  std::int64_t eval_every = 0;  // > 0: evaluate on the test set every this many steps
  std::int64_t print_every = 200;
  std::string device = "cpu";
  std::string impl = "reference";
  std::string metrics_json;
  std::string trace;                 // Chrome trace-event JSON of the step phases
  std::int64_t trace_steps = 50;     // steps recorded in the trace (the first ones)
  std::string checkpoint;            // saved at the end, at each evaluation and every checkpoint_every steps
  std::int64_t checkpoint_every = 0;
};

void from_json(const nlohmann::json& j, TrainConfig& c);  // sets the keys present
nlohmann::json to_json(const TrainConfig& c);              // sectioned, as a config file

// The command line: flags left unset do not override the config file.
struct TrainFlags {
  std::string config;
  std::optional<std::string> arch_mlp_bot, arch_mlp_top, arch_interaction_op, data, data_hash, optimizer, device, impl,
      metrics_json, checkpoint, trace;
  std::optional<std::int64_t> data_workers, trace_steps, checkpoint_every, arch_sparse_feature_size, max_ind_range, train_samples, test_samples, mini_batch_size,
      test_mini_batch_size, epochs, steps, eval_every, print_every;
  std::optional<std::uint64_t> model_seed, data_seed;
  std::optional<double> learning_rate, test_fraction;
  bool interaction_itself = false, strict_data = false, resume = false, dry_run = false, fused_mlp = false;
};

CLI::App* add_train_command(CLI::App& app, TrainFlags& flags);
int run_train(const TrainFlags& flags);

// `fusekit eval --checkpoint PATH`: the test metrics of a saved model, on the data of its run or
// on --data.
struct EvalFlags {
  std::string checkpoint;
  std::optional<std::string> data;
  std::optional<std::int64_t> test_mini_batch_size;
  std::string device = "cpu";
};
CLI::App* add_eval_command(CLI::App& app, EvalFlags& flags);
int run_eval(const EvalFlags& flags);

struct DataFlags {
  std::string in, out;
  std::int64_t rows = 100000;
  std::uint64_t seed = 2024;
  bool strict = false;
};
// `fusekit data synth --rows N --out FILE.tsv` and `fusekit data convert IN.tsv[.gz] OUT.bin`.
CLI::App* add_data_command(CLI::App& app, DataFlags& flags);
int run_data(CLI::App& data_cmd, const DataFlags& flags);

}  // namespace fk::app
