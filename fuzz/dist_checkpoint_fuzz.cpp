// Fuzz target: the distributed checkpoint's readers (apps/checkpoint_distributed.hpp), as `fusekit
// train --resume` (one process, or --distributed on any number of ranks) and `fusekit eval` use
// them: apps::open_checkpoint on the manifest, the stored configuration read back, is_distributed,
// manifest_plan against the fuzz model's tables, open_shard_file for each rank,
// consolidate_checkpoint (N -> 1) into the small model's load_state, and load_distributed (N -> M,
// or 1 -> M from a one-process checkpoint) into a one-rank DistributedDlrm whose tables are split
// otherwise than the seeds' (f32 tables, or bf16 ones for a configuration that names them: their
// shard files end with the tables' rounding step).
//
// An input is a few files (fuzz::split_pieces): the manifest, then up to 4 shard files, written to
// a scratch folder under the names apps::shard_file_path gives for the step and world size the
// manifest states. Each input is loaded twice: as it is, and with the manifest's config_crc and
// every piece's checksums recomputed (fuzz::repair_distributed_checkpoint), so that the fuzzer
// reaches the plan, the shard files' identity checks and the states behind the CRCs. Anything may
// be refused with fk::Error; nothing else may escape.
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <vector>

#include "apps/checkpoint.hpp"
#include "apps/checkpoint_distributed.hpp"
#include "fusekit/core/error.hpp"
#include "fusekit/dist/communicator.hpp"
#include "fusekit/models/dlrm_distributed.hpp"
#include "fuzz_util.hpp"

using namespace fk;

namespace {

constexpr std::size_t kMaxPieces = 5;  // the manifest and 4 shard files

// The fuzz model (fuzz::fuzz_train_config) with Adagrad, element-wise or row-wise: a checkpoint
// loads into the one its configuration names, as fusekit eval builds the model it names.
app::TrainConfig with_tables(app::TrainConfig c, const char* embedding_dtype) {
  c.embedding_dtype = embedding_dtype;
  return c;
}

struct Models {
  app::TrainConfig config;
  models::DlrmConfig model_config;
  models::Dlrm one;
  std::unique_ptr<dist::Communicator> comm = dist::make_single_communicator();
  models::DistributedDlrm sharded;

  explicit Models(bool rowwise, const char* embedding_dtype = "f32")
      : config(with_tables(fuzz::fuzz_dist_train_config(rowwise), embedding_dtype)),
        model_config(app::make_model_config(config, app::make_featurizer(config))),
        one(model_config, Device::cpu(), models::DlrmImpl::fused),
        sharded(model_config, *comm,
                models::plan_dlrm_sharding(model_config, 1, config.mini_batch_size, models::OptimizerKind::adagrad, {},
                                           {.max_shard_rows = 3}),
                models::DlrmImpl::fused) {}
};

void load(const std::vector<std::uint8_t>& bytes) {
  static Models elementwise(false), rowwise(true), rowwise_bf16(true, "bf16");
  const auto pieces = fuzz::split_pieces(bytes, kMaxPieces);
  if (pieces.empty()) return;
  const std::filesystem::path dir = fuzz::scratch_dir() / "dist";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string manifest = (dir / "in.ckpt").string();
  fuzz::write_file("dist/in.ckpt", pieces[0].data(), pieces[0].size());
  std::ifstream in;
  apps::CheckpointHeader h;
  try {
    h = apps::open_checkpoint(manifest, in, "fuzz");
  } catch (const Error&) {
    return;
  }
  // The shard files under the names the manifest's step and world size give.
  int ranks = static_cast<int>(pieces.size()) - 1;
  if (apps::is_distributed(h) && h.config["distributed"].is_object()) {
    const nlohmann::json& w = h.config["distributed"].value("world_size", nlohmann::json());
    if (w.is_number_integer() && w.get<std::int64_t>() >= 1 && w.get<std::int64_t>() <= 4) ranks = w.get<int>();
  }
  for (int r = 0; r < ranks && static_cast<std::size_t>(r) + 1 < pieces.size(); ++r) {
    const std::string name = std::filesystem::path(apps::shard_file_path(manifest, h.step, r, ranks)).filename().string();
    fuzz::write_file("dist/" + name, pieces[static_cast<std::size_t>(r) + 1].data(),
                     pieces[static_cast<std::size_t>(r) + 1].size());
  }
  const auto field = [&](const char* section, const char* key) {
    return h.config.is_object() && h.config.contains(section) && h.config[section].is_object()
               ? h.config[section].value(key, nlohmann::json())
               : nlohmann::json();
  };
  Models& m = field("training", "rowwise_adagrad") != true ? elementwise
              : field("model", "embedding_dtype") == "bf16" ? rowwise_bf16
                                                             : rowwise;
  try {  // fusekit eval: the stored configuration, without the distributed section
    app::TrainConfig c;
    app::from_json(apps::stored_run_config(h), c);
    app::validate(c);
  } catch (const Error&) {
  }
  if (apps::is_distributed(h)) {
    try {
      apps::manifest_plan(manifest, h, m.model_config.table_rows, "fuzz", "--checkpoint");
    } catch (const Error&) {
    }
    for (int r = 0; r < ranks; ++r) try {
        std::ifstream shard;
        apps::open_shard_file(manifest, h, r, shard, "fuzz", "--checkpoint");
      } catch (const Error&) {
      }
    try {  // N -> 1: fusekit eval, the one-process fusekit train --resume
      std::stringstream whole;
      apps::consolidate_checkpoint(manifest, h, in, m.model_config, whole, "fuzz", "--checkpoint");
      m.one.load_state(whole);
    } catch (const Error&) {
    }
  }
  try {  // N -> M (and 1 -> M): fusekit train --distributed --resume
    std::ifstream again;
    const apps::CheckpointHeader h2 = apps::open_checkpoint(manifest, again, "fuzz");
    apps::load_distributed(manifest, h2, again, m.sharded, "fuzz", "--resume");
  } catch (const Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  return fuzz::run_raw_then_repaired(data, size, load, fuzz::repair_distributed_checkpoint);
}
