// fusekit train's checkpoint file: the step, the run's configuration (JSON) and the model's
// training state, each part covered by a CRC-32 so that a flipped bit or a truncation is an error,
// never a silently different run.
//
//   "FKCKPT02"  u64 step  u64 n  config[n]  u32 crc32(step, n, config)
//   state (models::Dlrm::save_state)  u64 state_bytes  u32 crc32(state)  "FKCKEND2"
//
// (little-endian). Files of the first format ("FKCKPT01": no checksums) are still read.
#pragma once

#include <cstdint>
#include <fstream>
#include <functional>
#include <string>

#include <nlohmann/json.hpp>

namespace fk::apps {

struct CheckpointHeader {
  std::int64_t step = 0;
  nlohmann::json config;
};

// Writes the checkpoint atomically (see output_file.hpp); `state` writes the model's state.
void write_checkpoint(const std::string& path, std::int64_t step, const nlohmann::json& config,
                      const std::function<void(std::ostream&)>& state);

// Opens `path`, checks every checksum and the trailer, and leaves `in` at the model state.
// Throws fk::Error (op `op`, argument --checkpoint) naming the path and what is wrong: the OS
// error when it cannot be opened, the part whose checksum fails, a truncation.
CheckpointHeader open_checkpoint(const std::string& path, std::ifstream& in, const char* op);

// The settings of `stored` (a checkpoint's configuration) that differ from `requested`, ignoring
// those a resumed run may change (steps, epochs, intervals, output paths, device, implementation,
// data workers, evaluation batch): "data.hash: stored \"seed\", requested \"reference\"" per line.
// A setting `stored` lacks (a checkpoint older than the setting) compares as its value in
// `defaults`, the configuration that run had without it.
std::string config_differences(const nlohmann::json& stored, const nlohmann::json& requested,
                               const nlohmann::json& defaults = nlohmann::json::object());

}  // namespace fk::apps
