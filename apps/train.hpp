// `fusekit train` (DLRM on Criteo data) and `fusekit data` (synthetic data out as TSV, TSV to the
// binary format): the subcommands. The training configuration is apps/train_config.hpp.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <optional>
#include <string>

#include "apps/train_config.hpp"

namespace fk::app {

// The command line of `fusekit train`: the configuration's part and what is not configuration
// (apps/train_config.hpp).
struct TrainFlags {
  ConfigFlags config;
  RunFlags run;
};

CLI::App* add_train_command(CLI::App& app, TrainFlags& flags);
int run_train(const TrainFlags& flags);
// --distributed: the run over MPI's ranks (apps/train_distributed.cpp): CPU, or --device cuda a GPU a rank.
// max_shard_rows > 0: tables of more rows split by rows over several ranks (--max-shard-rows).
// start: --resume / --load-model (a checkpoint saved by a run on as many ranks).
int run_train_distributed(const TrainConfig& config, std::int64_t max_shard_rows = 0, const StartState& start = {},
                          bool resume_override = false);
// --gpus N: the same run in this process on GPUs 0 .. N-1, a thread and an NCCL communicator each
// (apps/train_distributed.cpp).
int run_train_gpus(const TrainConfig& config, int gpus, std::int64_t max_shard_rows = 0, const StartState& start = {},
                   bool resume_override = false);

// `fusekit eval --checkpoint PATH`: the test metrics of a saved model, on the data of its run or
// on --data; --predictions FILE also writes each test sample's label and probability.
struct EvalFlags {
  std::string checkpoint;
  std::string predictions;
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
  std::string cardinalities = "kaggle";  // synth: kaggle, mlperf-terabyte or 26 sizes joined by '-'
  double zipf_exponent = 1.1;            // synth
  bool strict = false;
  double test_fraction = 0.1;       // vocab: as fusekit train's
  std::string data_set;             // vocab: "kaggle": the reference's training days
  std::int64_t max_ind_range = 0;   // vocab
  std::int64_t min_count = 1;       // vocab, preprocess
  std::vector<std::string> inputs;  // preprocess
  std::string preprocess_set = "kaggle";
  bool all_days = false;            // preprocess: the vocabulary counts the test day too
  int threads = 0;                  // preprocess: 0, every core
  std::int64_t batch = 32768;       // loader-rate
  int workers = 8;                  // loader-rate
  std::int64_t batches = 0;         // loader-rate: 0, one epoch
  std::int64_t epochs = 1;          // loader-rate
};
// `fusekit data synth --rows N --out FILE.tsv`, `fusekit data convert IN.tsv[.gz] OUT.bin`,
// `fusekit data vocab IN --out VOCAB [--max-ind-range R] [--min-count T]` and
// `fusekit data preprocess IN... --out DIR [--data-set kaggle|terabyte] ...`.
CLI::App* add_data_command(CLI::App& app, DataFlags& flags);
int run_data(CLI::App& data_cmd, const DataFlags& flags);

}  // namespace fk::app
