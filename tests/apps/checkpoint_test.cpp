// fusekit train's checkpoint file: every part checked (issue 27 item 7). A flipped bit anywhere,
// a truncation, a file that is not a checkpoint or that cannot be opened is an error naming the
// path and what is wrong, before any of the state is used; the configuration differences a
// resume refuses are named field by field.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "apps/checkpoint.hpp"
#include "fusekit/core/error.hpp"

namespace fk::apps {
namespace {

namespace fs = std::filesystem;

std::string scratch(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / "fusekit_checkpoint_test";
  fs::create_directories(dir);
  return (dir / name).string();
}

std::vector<char> bytes_of(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const std::string& path, const std::vector<char>& b) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(b.data(), static_cast<std::streamsize>(b.size()));
}

const nlohmann::json kConfig = {{"model", {{"seed", 1}}}, {"data", {{"hash", "seed"}, {"seed", 3}}},
                                {"training", {{"steps", 40}, {"learning_rate", 0.1}}}};
const std::string kState(5000, 'x');

std::string good_checkpoint() {
  const std::string path = scratch("good.ckpt");
  write_checkpoint(path, 20, kConfig, [](std::ostream& out) { out << kState; });
  return path;
}

std::string expect_refused(const std::string& path) {
  std::ifstream in;
  try {
    open_checkpoint(path, in, "test");
  } catch (const Error& e) {
    EXPECT_EQ(e.arg(), "--checkpoint");
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "accepted: " << path;
  return {};
}

TEST(Checkpoint, RoundTrip) {
  const std::string path = good_checkpoint();
  std::ifstream in;
  const CheckpointHeader h = open_checkpoint(path, in, "test");
  EXPECT_EQ(h.step, 20);
  EXPECT_EQ(h.config, kConfig);
  std::string state(kState.size(), '\0');
  in.read(state.data(), static_cast<std::streamsize>(state.size()));
  EXPECT_EQ(state, kState);
  EXPECT_FALSE(fs::exists(path + ".tmp"));
}

// A flipped bit in every byte of the file (the step, the configuration, the state, the trailer)
// is caught.
TEST(Checkpoint, EveryFlippedByteIsCaught) {
  const std::vector<char> good = bytes_of(good_checkpoint());
  const std::string path = scratch("flipped.ckpt");
  int caught = 0;
  for (std::size_t i = 0; i < good.size(); i += (i < 200 || i + 40 > good.size()) ? 1 : 97) {
    std::vector<char> b = good;
    b[i] = static_cast<char>(b[i] ^ 0x10);
    write_bytes(path, b);
    std::ifstream in;
    try {
      open_checkpoint(path, in, "test");
      ADD_FAILURE() << "a flipped bit at byte " << i << " loaded";
    } catch (const Error&) {
      ++caught;
    }
  }
  EXPECT_GT(caught, 200);
}

TEST(Checkpoint, TruncationsAndStrangersAreRefused) {
  const std::vector<char> good = bytes_of(good_checkpoint());
  const std::string path = scratch("cut.ckpt");
  for (std::size_t n : {std::size_t{0}, std::size_t{5}, std::size_t{12}, std::size_t{30}, good.size() / 2, good.size() - 1}) {
    write_bytes(path, std::vector<char>(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(n)));
    expect_refused(path);
  }
  write_bytes(path, std::vector<char>(good.begin(), good.end()) /* + trailing garbage */);
  {
    std::ofstream out(path, std::ios::binary | std::ios::app);
    out << "trailing";
  }
  expect_refused(path);
  EXPECT_NE(expect_refused(scratch("missing.ckpt")).find("No such file"), std::string::npos);
}

TEST(Checkpoint, ConfigDifferencesNameEachField) {
  nlohmann::json requested = kConfig;
  EXPECT_EQ(config_differences(kConfig, requested), "");
  requested["training"]["steps"] = 80;  // a resumed run may go on longer
  EXPECT_EQ(config_differences(kConfig, requested), "");
  requested["data"]["hash"] = "reference";
  requested["model"]["seed"] = 2;
  const std::string d = config_differences(kConfig, requested);
  EXPECT_NE(d.find("data.hash: stored \"seed\", requested \"reference\""), std::string::npos) << d;
  EXPECT_NE(d.find("model.seed: stored 1, requested 2"), std::string::npos) << d;
}

// A checkpoint written before a setting existed resumes when the setting is at its default.
TEST(Checkpoint, ASettingTheCheckpointLacksComparesAsItsDefault) {
  nlohmann::json requested = kConfig, defaults = kConfig;
  requested["model"]["compress_activations"] = 0;
  defaults["model"]["compress_activations"] = 0;
  EXPECT_EQ(config_differences(kConfig, requested, defaults), "");
  EXPECT_NE(config_differences(kConfig, requested), "");  // without the defaults: stored (none)
  requested["model"]["compress_activations"] = 4;
  const std::string d = config_differences(kConfig, requested, defaults);
  EXPECT_NE(d.find("model.compress_activations: stored 0 (absent: the default), requested 4"), std::string::npos) << d;
}

}  // namespace
}  // namespace fk::apps
