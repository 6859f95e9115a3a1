// Fuzz target: the checkpoint loader, as `fusekit train --resume` and `fusekit eval` use it:
// apps::open_checkpoint, the stored configuration read back into the run's settings and compared
// with the requested ones, then models::Dlrm::load_state into a small model.
//
// Each input is loaded twice: as it is, and (FKCKPT02) with its checksums and trailer recomputed,
// so that the fuzzer also reaches the configuration and the model state behind them. Anything
// may be refused with fk::Error; nothing else may escape.
#include <cstdint>
#include <cstring>
#include <fstream>
#include <vector>

#include "apps/checkpoint.hpp"
#include "fusekit/core/error.hpp"
#include "fuzz_util.hpp"

using namespace fk;

namespace {

void load(const std::vector<std::uint8_t>& bytes) {
  static const app::TrainConfig requested = fuzz::fuzz_train_config();
  static models::Dlrm model = fuzz::make_fuzz_model(requested);
  const auto path = fuzz::write_file("in.ckpt", bytes.data(), bytes.size());
  try {
    std::ifstream in;
    const apps::CheckpointHeader h = apps::open_checkpoint(path.string(), in, "fuzz");
    app::TrainConfig stored;
    app::from_json(h.config, stored);
    app::validate(stored);
    const std::string differences = apps::config_differences(h.config, app::to_json(requested));
    (void)differences;  // --resume-override loads the state whatever they are
    model.load_state(in);
  } catch (const Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  return fuzz::run_raw_then_repaired(data, size, load, fuzz::repair_checkpoint);
}
