// fusekit train --distributed's checkpoint: a manifest and one shard file per rank.
//
//   PATH                           an FKCKPT02 checkpoint (apps/checkpoint.hpp), written by rank 0
//                                  after every shard file is in place: the step, the run's
//                                  configuration plus a "distributed" section (world_size, shards:
//                                  [table, row_begin, row_end, rank] each, files, config_crc), and
//                                  the dense state (models::Dlrm::save_state of the dense part,
//                                  parameters and optimizer state, the same on every rank)
//   PATH.step<K>.rank<R>-of-<N>    FKCKPT02 each, written by rank R: the step, {world_size, rank,
//                                  shards, config_crc}, and the rank's table shards with their
//                                  optimizer state (models::DistributedDlrm::save_shards)
//
// Shard files carry the step in their names, and the manifest is renamed into place last: a crash
// during a save leaves the previous manifest and the shard files it names intact. Rank 0 removes
// the shard files of other steps once the new manifest is in place. config_crc (CRC-32 of the
// run's configuration, as JSON) ties each shard file to its manifest.
#pragma once

#include <cstdint>
#include <fstream>
#include <functional>
#include <ostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "apps/checkpoint.hpp"
#include "fusekit/dist/sharding.hpp"
#include "fusekit/models/dlrm.hpp"
#include "fusekit/models/dlrm_distributed.hpp"

namespace fk::apps {

std::string shard_file_path(const std::string& manifest, std::int64_t step, int rank, int ranks);

// Rank `rank`'s shard file of the checkpoint at `manifest` (atomically); `state` writes its shards.
void write_shard_file(const std::string& manifest, std::int64_t step, const nlohmann::json& config,
                      const dist::ShardingPlan& plan, int rank, const std::function<void(std::ostream&)>& state);
// The manifest (atomically; after every rank's write_shard_file), then the removal of shard files
// of other steps. `dense` writes the dense state.
void write_manifest(const std::string& manifest, std::int64_t step, const nlohmann::json& config,
                    const dist::ShardingPlan& plan, const std::function<void(std::ostream&)>& dense);

// Whether a checkpoint's header is a distributed manifest's.
bool is_distributed(const CheckpointHeader& h);
// The run's configuration stored in a checkpoint, as app::from_json reads it back: a manifest's
// without its "distributed" section; any other JSON (a damaged or foreign file's) as it is.
nlohmann::json stored_run_config(const CheckpointHeader& h);
// The manifest's world size and plan (its tables' shards), checked (fk::Error, argument `flag`,
// naming the path) against the configuration's tables `table_rows`.
dist::ShardingPlan manifest_plan(const std::string& path, const CheckpointHeader& h,
                                 const std::vector<std::int64_t>& table_rows, const char* op, const char* flag);
// Opens rank `rank`'s shard file of the manifest `h` at `path`, checks its checksums and that it
// belongs to the manifest (step, world size, rank, shards, config_crc), and leaves `in` at its
// shards. fk::Error (argument `flag`) naming the file for a missing, truncated or foreign one.
void open_shard_file(const std::string& path, const CheckpointHeader& h, int rank, std::ifstream& in, const char* op,
                     const char* flag);
// N -> 1: the single-process state (models::Dlrm::load_state's) of the distributed checkpoint at
// `path`, whose manifest `h` was opened with `dense` left at the dense state, gathered from the
// shard files (each opened with open_shard_file).
void consolidate_checkpoint(const std::string& path, const CheckpointHeader& h, std::istream& dense,
                            const models::DlrmConfig& config, std::ostream& out, const char* op, const char* flag);
// N -> M and 1 -> M: `model`'s whole state (the dense part, this rank's shards of its plan) from
// the checkpoint at `path` opened as `h` with `in` at its state: a manifest of any number of ranks
// and plan (the shard files holding rows of this rank's shards opened with open_shard_file, each
// checked whole, then read only where those rows are), or a one-process checkpoint (its tables'
// rows read from its state). Returns the saved plan (a one-process checkpoint's: one rank).
dist::ShardingPlan load_distributed(const std::string& path, const CheckpointHeader& h, std::ifstream& in,
                                    models::DistributedDlrm& model, const char* op, const char* flag);

}  // namespace fk::apps
