// The distributed checkpoint's files (apps/checkpoint_distributed.hpp) against inputs that once
// escaped as something other than fk::Error (found writing and running dist_checkpoint_fuzz; the
// fuzz inputs are in fuzz/corpus/dist_checkpoint/).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "apps/checkpoint_distributed.hpp"
#include "apps/train_config.hpp"
#include "fusekit/core/error.hpp"

namespace fk::apps {
namespace {

namespace fs = std::filesystem;

const nlohmann::json kConfig = {{"model", {{"seed", 1}}}, {"training", {{"steps", 4}}}};

// A manifest at step 3 of 2 tables (5 and 3 rows, split at 3 rows) on 2 ranks, its shard files
// holding a few placeholder bytes (the readers below do not parse the states).
std::string write_distributed(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / "fusekit_checkpoint_distributed_test" / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string manifest = (dir / "state.ckpt").string();
  const std::vector<dist::TableInfo> tables{{5, 2, 1}, {3, 2, 1}};
  const dist::ShardingPlan plan = dist::plan_sharding(tables, 2, {.batch = 4, .max_shard_rows = 3});
  for (int r = 0; r < 2; ++r)
    write_shard_file(manifest, 3, kConfig, plan, r, [](std::ostream& out) { out << "shards"; });
  write_manifest(manifest, 3, kConfig, plan, [](std::ostream& out) { out << "dense"; });
  return manifest;
}

// Rank 1's shard file, its stored identity given `key` = `value`.
void rewrite_rank1(const std::string& manifest, const char* key, const nlohmann::json& value) {
  const std::string file = shard_file_path(manifest, 3, 1, 2);
  std::ifstream in;
  CheckpointHeader s = open_checkpoint(file, in, "test");
  s.config[key] = value;
  write_checkpoint(file, 3, s.config, [](std::ostream& out) { out << "shards"; });
}

// A shard file whose world size, rank, shards or configuration CRC has another JSON type is another
// checkpoint's: fk::Error naming the flag (a string world size escaped as a JSON type error).
TEST(DistributedCheckpoint, ShardFileFieldsOfAnotherTypeAreRefused) {
  const std::string manifest = write_distributed("types");
  std::ifstream in;
  const CheckpointHeader h = open_checkpoint(manifest, in, "test");
  for (int r = 0; r < 2; ++r) {
    std::ifstream shard;
    open_shard_file(manifest, h, r, shard, "test", "--resume");
  }
  const std::vector<std::pair<const char*, nlohmann::json>> bad = {
      {"world_size", "2"}, {"world_size", 2.5},      {"world_size", nullptr}, {"rank", "1"},
      {"rank", nlohmann::json::array()}, {"shards", nlohmann::json::object()}, {"config_crc", "0"}};
  for (const auto& [key, value] : bad) {
    const std::string m = write_distributed("types");
    rewrite_rank1(m, key, value);
    std::ifstream shard;
    try {
      open_shard_file(m, h, 1, shard, "test", "--resume");
      ADD_FAILURE() << key << " = " << value.dump() << " accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.arg(), "--resume") << e.what();
      EXPECT_NE(std::string(e.what()).find("another checkpoint's"), std::string::npos) << e.what();
    }
  }
}

// fusekit eval reads the run's configuration from any checkpoint: one whose configuration is not
// a JSON object is refused by the configuration's reader (fk::Error), where removing the
// manifest's section escaped as a JSON type error.
TEST(DistributedCheckpoint, AStoredConfigurationThatIsNotAnObjectIsRefused) {
  for (const nlohmann::json& config : {nlohmann::json::array({1, 2}), nlohmann::json(7), nlohmann::json("x")}) {
    const CheckpointHeader h{.step = 1, .config = config};
    EXPECT_FALSE(is_distributed(h));
    const nlohmann::json stored = stored_run_config(h);
    EXPECT_EQ(stored, config);
    app::TrainConfig c;
    EXPECT_THROW(app::from_json(stored, c), Error) << config.dump();
  }
  const CheckpointHeader manifest{.step = 1, .config = {{"model", {{"seed", 2}}}, {"distributed", {{"world_size", 2}}}}};
  EXPECT_EQ(stored_run_config(manifest), (nlohmann::json{{"model", {{"seed", 2}}}}));
}

}  // namespace
}  // namespace fk::apps
