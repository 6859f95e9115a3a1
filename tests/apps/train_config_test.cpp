// fusekit train's configuration table (apps/train_config.hpp): the --config reader refuses what it
// does not know, flags override the file, the echo reads back as the same configuration, the
// checks refuse what is clearly invalid, alias rows set their setting, and every TrainConfig
// member has its row.
#include "apps/train_config.hpp"

#include <gtest/gtest.h>

#include <set>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "test_util.hpp"

namespace fk::app {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

template <class... F>
struct overloaded : F... {
  using F::operator()...;
};
template <class... F>
overloaded(F...) -> overloaded<F...>;  // clang 14 (the fuzz build) lacks aggregate deduction

fs::path write_config(const std::string& name, const json& j) {
  const fs::path dir = fs::temp_directory_path() / "fusekit_train_config_test";
  fs::create_directories(dir);
  const fs::path path = dir / name;
  std::ofstream(path) << j.dump(2);
  return path;
}

// `fusekit train ARGS`, through CLI11 as the program parses them, resolved.
TrainConfig resolve_args(std::vector<std::string> args, std::span<const Setting> table = train_settings()) {
  CLI::App app;
  ConfigFlags flags;
  add_config_flags(app, flags, table);
  std::reverse(args.begin(), args.end());  // CLI11 takes the arguments last first
  app.parse(args);
  return resolve(flags);
}

const json& at(const json& j, const std::string& key) {
  const std::size_t dot = key.find('.');
  return j.at(key.substr(0, dot)).at(key.substr(dot + 1));
}

// The fused implementation unless one is named: a reference command line with --use-gpu trains
// fused (on the CPU the fused ops run their specs, updating only the rows a batch touches).
TEST(TrainConfigDefaults, ImplementationIsFused) {
  EXPECT_EQ(TrainConfig{}.impl, "fused");
  EXPECT_EQ(to_json(TrainConfig{})["training"]["impl"], "fused");
}

TEST(TrainConfigFile, UnknownKeyIsRefusedNamingIt) {
  TrainConfig c;
  test::expect_arg_error([&] { from_json({{"training", {{"stpes", 5}}}}, c); }, "fusekit train --config",
                         "training.stpes");
  test::expect_arg_error([&] { from_json({{"trainig", {{"steps", 5}}}}, c); }, "fusekit train --config", "trainig");
  const fs::path path = write_config("unknown_key.json", {{"model", {{"arch_sparse_feature_sise", 8}}}});
  test::expect_arg_error([&] { resolve_args({"--config", path.string()}); }, "fusekit train --config",
                         "model.arch_sparse_feature_sise");
}

TEST(TrainConfigFile, ValueOfTheWrongTypeIsRefusedNamingTheKey) {
  TrainConfig c;
  test::expect_arg_error([&] { from_json({{"training", {{"steps", 1.5}}}}, c); }, "fusekit train --config",
                         "training.steps");
  test::expect_arg_error([&] { from_json({{"model", {{"seed", -1}}}}, c); }, "fusekit train --config", "model.seed");
}

TEST(TrainConfigFlags, FlagOverridesTheFile) {
  const fs::path path = write_config("override.json", {{"training", {{"steps", 7}, {"learning_rate", 0.3}}}});
  EXPECT_EQ(resolve_args({"--config", path.string()}).steps, 7);
  const TrainConfig c = resolve_args({"--config", path.string(), "--steps", "9"});
  EXPECT_EQ(c.steps, 9);
  EXPECT_EQ(c.learning_rate, 0.3);  // from the file: no flag given
  EXPECT_EQ(resolve_args({"--steps", "11", "--config", path.string()}).steps, 11);  // order does not matter
  // --num-batches is the reference's: batches per epoch, not the run's steps.
  const TrainConfig nb = resolve_args({"--num-batches", "11", "--config", path.string()});
  EXPECT_EQ(nb.num_batches, 11);
  EXPECT_EQ(nb.steps, 7);
}

TEST(TrainConfigFlags, BooleanFlagOverridesTheFileBothWays) {
  const fs::path path = write_config("bool.json", {{"data", {{"strict", true}}}});
  EXPECT_TRUE(resolve_args({"--config", path.string()}).strict_data);
  EXPECT_FALSE(resolve_args({"--config", path.string(), "--strict-data=false"}).strict_data);
  EXPECT_TRUE(resolve_args({"--strict-data"}).strict_data);
}

// A configuration with every setting off its default, at a value the setting's check accepts.
TrainConfig off_defaults() {
  TrainConfig c;
  const std::vector<std::string> strings = {"x.tsv", "adagrad", "outer", "reference", "fused", "cuda:1", "13-64-16",
                                            "kaggle", "day", "dataset", "bf16"};
  for (const Setting& s : train_settings()) {
    std::visit(overloaded{[](std::monostate) {},
                          [&](bool TrainConfig::*m) { c.*m = !(c.*m); },
                          [&](std::int64_t TrainConfig::*m) {
                            for (const std::int64_t v : {c.*m + 3, std::int64_t{8}}) {
                              try {  // the first value the setting's check accepts, or none
                                if (s.check) s.check(v, s.key);
                                c.*m = v;
                                break;
                              } catch (const Error&) {
                              }
                            }
                          },
                          [&](std::uint64_t TrainConfig::*m) { c.*m += 3; },
                          [&](double TrainConfig::*m) { c.*m = c.*m / 3 + 1.0 / 7; },  // not a short decimal
                          [&](std::vector<std::int64_t> TrainConfig::*m) { (c.*m).push_back(7); },
                          [&](std::string TrainConfig::*m) {
                            for (const std::string& v : strings) {
                              if (v == c.*m) continue;
                              try {
                                if (s.check) s.check(v, s.key);
                              } catch (const Error&) {
                                continue;
                              }
                              c.*m = v;
                              break;
                            }
                          }},
               s.member);
  }
  return c;
}

TEST(TrainConfigEcho, ReadsBackAsTheSameConfiguration) {
  const TrainConfig c = off_defaults();
  ASSERT_NO_THROW(validate(c));
  const json echo = to_json(c), defaults = to_json(TrainConfig{});
  // A setting that accepts its default alone: the reference's loss function (bce only).
  const std::set<std::string> single = {"training.loss_function"};
  for (const Setting& s : train_settings())
    if (!std::holds_alternative<std::monostate>(s.member) && !single.contains(s.key)) {
      EXPECT_NE(at(echo, s.key), at(defaults, s.key)) << s.key << " was not moved off its default";
    }
  const fs::path path = write_config("echo.json", echo);
  const TrainConfig back = resolve_args({"--config", path.string()});
  EXPECT_TRUE(back == c);
  for (const Setting& s : train_settings())
    std::visit(overloaded{[](std::monostate) {}, [&](auto TrainConfig::*m) { EXPECT_TRUE(back.*m == c.*m) << s.key; }},
               s.member);
}

TEST(TrainConfigChecks, NegativeStepsAreRefused) {
  test::expect_arg_error([] { resolve_args({"--steps", "-3"}); }, "fusekit train", "training.steps (--steps)");
  test::expect_arg_error([] { resolve_args({"--steps=-3"}); }, "fusekit train", "training.steps (--steps)");
  const fs::path path = write_config("negative_steps.json", {{"training", {{"steps", -3}}}});
  try {
    resolve_args({"--config", path.string()});
    ADD_FAILURE() << "steps -3 accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.expected(), ">= 0");
    EXPECT_EQ(e.got(), "-3");
  }
}

TEST(TrainConfigChecks, ClearlyInvalidValuesAreRefusedNamingTheSetting) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--epochs", "-1"}, "training.epochs (--epochs)"},
      {{"--epochs", "0"}, "training.epochs (--epochs)"},  // and no steps either
      {{"--mini-batch-size", "0"}, "training.mini_batch_size (--mini-batch-size)"},
      {{"--mini-batch-size", "-128"}, "training.mini_batch_size (--mini-batch-size)"},
      {{"--test-mini-batch-size", "0"}, "training.test_mini_batch_size (--test-mini-batch-size)"},
      {{"--learning-rate", "0"}, "training.learning_rate (--learning-rate)"},
      {{"--learning-rate", "-0.1"}, "training.learning_rate (--learning-rate)"},
      {{"--learning-rate", "nan"}, "training.learning_rate (--learning-rate)"},
      {{"--learning-rate", "inf"}, "training.learning_rate (--learning-rate)"},
      {{"--eval-every", "-1"}, "training.eval_every (--eval-every)"},
      {{"--optimizer", "adam"}, "training.optimizer (--optimizer)"},
      {{"--arch-mlp-bot", "13-x-16"}, "model.arch_mlp_bot (--arch-mlp-bot)"},
      {{"--compress-activations", "3"}, "model.compress_activations (--compress-activations)"},
      {{"--compress-activations", "1"}, "model.compress_activations (--compress-activations)"},
      {{"--compress-activations", "16"}, "model.compress_activations (--compress-activations)"},
      {{"--compress-activations", "-4"}, "model.compress_activations (--compress-activations)"},
  };
  for (const auto& c : cases)
    test::expect_arg_error([&] { resolve_args(c.first); }, "fusekit train", c.second);
  EXPECT_NO_THROW(resolve_args({"--epochs", "0", "--steps", "5"}));
}

TEST(TrainConfigChecks, CompressedActivations) {
  for (const int bits : {8, 4, 2})
    EXPECT_EQ(resolve_args({"--compress-activations", std::to_string(bits)}).compress_activations, bits);
  EXPECT_EQ(resolve_args({}).compress_activations, 0);
  try {
    resolve_args({"--compress-activations", "3"});
    ADD_FAILURE() << "3 bits accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.expected(), "0 (off), 8, 4 or 2");
    EXPECT_EQ(e.got(), "3");
  }
  const TrainConfig both = resolve_args({"--compress-activations", "4", "--fused-mlp"});
  test::expect_arg_error([&] { make_model_config(both, make_featurizer(both)); }, "fusekit train",
                         "model.compress_activations (--compress-activations)");
  const TrainConfig packed = resolve_args({"--compress-activations", "2"});
  EXPECT_EQ(make_model_config(packed, make_featurizer(packed)).compress_activations_bits, 2);
}

TEST(TrainConfigTable, AliasRowsSetTheirSettingOrNothing) {
  EXPECT_EQ(resolve_args({"--use-gpu"}).device, "cuda");
  EXPECT_EQ(resolve_args({"--raw-data-file", "x.tsv"}).data, "x.tsv");
  EXPECT_EQ(resolve_args({"--num-workers", "3"}).data_workers, 3);
  EXPECT_EQ(resolve_args({"--processed-data-file", "p.npz"}).processed_data, "p.npz");
  // Rows without a setting change nothing and are named for the warning line.
  CLI::App app;
  ConfigFlags flags;
  add_config_flags(app, flags);
  std::vector<std::string> args = {"--print-time", "--test-num-workers", "16", "--round-targets=True"};
  std::reverse(args.begin(), args.end());
  app.parse(args);
  EXPECT_EQ(to_json(resolve(flags)), to_json(TrainConfig{}));
  EXPECT_EQ(flags.no_effect,
            (std::vector<std::string>{"--print-time", "--test-num-workers=16", "--round-targets=True"}));  // table order
  EXPECT_FALSE(set_explicitly(flags, "data.max_ind_range"));  // the default, not given
  CLI::App app2;
  ConfigFlags given;
  add_config_flags(app2, given);
  app2.parse(std::vector<std::string>{"5", "--max-ind-range"});
  EXPECT_TRUE(set_explicitly(given, "data.max_ind_range"));
  // A decay starting inside the warmup is refused, as the reference refuses it; so is another loss.
  test::expect_arg_error([] { resolve_args({"--lr-num-warmup-steps", "100", "--lr-decay-start-step", "50"}); },
                         "fusekit train", "training.lr_decay_start_step (--lr-decay-start-step)");
  test::expect_arg_error([] { resolve_args({"--loss-function", "mse"}); }, "fusekit train",
                         "training.loss_function (--loss-function)");
  test::expect_arg_error([] { resolve_args({"--data-generation", "dataset"}); }, "fusekit train",
                         "data.generation (--data-generation)");
}

// `fusekit train ARGS` as the program parses them: the configuration and the run flags.
std::pair<TrainConfig, RunFlags> parse_train(std::vector<std::string> args) {
  CLI::App app;
  ConfigFlags config;
  RunFlags run;
  add_config_flags(app, config);
  add_run_flags(app, run);
  std::reverse(args.begin(), args.end());
  app.parse(args);
  return {resolve(config), run};
}

// The DLRM reference's --load-model FILE continues from FILE and writes it only when --save-model
// names it; --inference-only trains nothing, from a loaded model or a fresh one.
TEST(TrainRunFlags, LoadModelAndInferenceOnly) {
  const std::string model = write_config("model.ckpt", json::object()).string();  // exists: the flag checks that
  TrainConfig c;
  RunFlags run;
  std::tie(c, run) = parse_train({"--load-model", model});
  StartState s = start_state(run, c);
  EXPECT_EQ(s.path, model);
  EXPECT_TRUE(s.must_exist);
  EXPECT_EQ(s.flag, "--load-model");
  EXPECT_TRUE(c.checkpoint.empty()) << "--load-model alone must not write its file";
  EXPECT_FALSE(run.inference_only);

  std::tie(c, run) = parse_train({"--load-model", model, "--save-model", "next.ckpt"});
  EXPECT_EQ(start_state(run, c).path, model);
  EXPECT_EQ(c.checkpoint, "next.ckpt");

  std::tie(c, run) = parse_train({"--load-model", model, "--inference-only"});
  EXPECT_TRUE(run.inference_only);
  EXPECT_EQ(start_state(run, c).path, model);

  std::tie(c, run) = parse_train({"--inference-only"});  // the freshly initialised model, as the reference
  EXPECT_TRUE(run.inference_only);
  EXPECT_TRUE(start_state(run, c).path.empty());

  std::tie(c, run) = parse_train({"--checkpoint", "state.ckpt", "--resume"});
  s = start_state(run, c);
  EXPECT_EQ(s.path, "state.ckpt");
  EXPECT_FALSE(s.must_exist) << "--resume starts fresh when the checkpoint is not there yet";
  EXPECT_EQ(s.flag, "--resume");

  EXPECT_TRUE(start_state(parse_train({}).second, TrainConfig{}).path.empty());
  // Neither the run flags nor their values reach the configuration's echo.
  EXPECT_EQ(to_json(parse_train({"--load-model", model, "--inference-only"}).first), to_json(TrainConfig{}));

  EXPECT_THROW(parse_train({"--load-model", model + ".missing"}), CLI::ValidationError);
  for (const std::vector<std::string>& args : {std::vector<std::string>{"--load-model", model, "--resume", "--checkpoint", "x"},
                                               std::vector<std::string>{"--resume"}}) {
    std::tie(c, run) = parse_train(args);
    test::expect_arg_error([&] { start_state(run, c); }, "fusekit train", "--resume");
  }
}

// The number of members of the aggregate T: the most initializers T{...} accepts.
struct AnyValue {
  template <class T>
  operator T() const;
};
template <class T, class... Values>
constexpr std::size_t member_count() {
  if constexpr (requires { T{Values{}..., AnyValue{}}; })
    return member_count<T, Values..., AnyValue>();
  else
    return sizeof...(Values);
}

TEST(TrainConfigTable, EveryMemberHasOneRow) {
  std::vector<const Setting*> rows;
  for (const Setting& s : train_settings())
    if (!std::holds_alternative<std::monostate>(s.member)) rows.push_back(&s);
  EXPECT_EQ(rows.size(), member_count<TrainConfig>()) << "a TrainConfig member without its row, or the reverse";
  for (std::size_t i = 0; i < rows.size(); ++i)
    for (std::size_t j = i + 1; j < rows.size(); ++j)
      EXPECT_FALSE(rows[i]->member == rows[j]->member) << rows[i]->key << " and " << rows[j]->key << " bind one member";
}

}  // namespace
}  // namespace fk::app

namespace fk::app {
namespace {

// dlrm_s_pytorch.py's LRPolicyScheduler by hand: W = 4 warmup steps, decay from its count 6 over
// 4; the scheduler's count is the step + 1.
TEST(LearningRateSchedule, TheReferencesPolicyByHand) {
  TrainConfig c;
  c.learning_rate = 1.0;
  EXPECT_FALSE(has_learning_rate_schedule(c));
  EXPECT_EQ(scheduled_learning_rate(c, 5), 1.0);
  c.lr_num_warmup_steps = 4;
  c.lr_decay_start_step = 6;
  c.lr_num_decay_steps = 4;
  EXPECT_TRUE(has_learning_rate_schedule(c));
  const std::vector<double> want = {0.25, 0.5, 0.75,             // warmup: count / 4
                                    0.75, 0.75,                  // between: the warmup's last rate
                                    1.0, 0.5625, 0.25, 0.0625,   // decay: ((4 - k) / 4)^2
                                    0.0625, 0.0625};             // after: the decay's last rate
  for (std::size_t j = 0; j < want.size(); ++j)
    EXPECT_DOUBLE_EQ(scheduled_learning_rate(c, static_cast<std::int64_t>(j)), want[j]) << "step " << j;
  c.lr_num_decay_steps = 0;  // warmup alone: the rate itself afterwards
  c.lr_num_warmup_steps = 3;
  EXPECT_DOUBLE_EQ(scheduled_learning_rate(c, 0), 1.0 / 3);
  EXPECT_DOUBLE_EQ(scheduled_learning_rate(c, 2), 1.0);
  c.lr_num_warmup_steps = 0;  // decay alone, with its floor
  c.lr_decay_start_step = 1;
  c.lr_num_decay_steps = 1000;
  c.learning_rate = 1e-6;
  EXPECT_DOUBLE_EQ(scheduled_learning_rate(c, 0), 1e-6);
  EXPECT_DOUBLE_EQ(scheduled_learning_rate(c, 998), 1e-7);
  EXPECT_DOUBLE_EQ(scheduled_learning_rate(c, 5000), 1e-7);
}

}  // namespace
}  // namespace fk::app
