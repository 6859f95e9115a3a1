// checkpoint_compare A B: the training states of two fusekit train checkpoints of one model
// (one-process or distributed: a manifest's shard files gathered as fusekit eval does) equal within
// the distributed tests' tolerance, |a - b| <= 1e-6 + 1e-5 |b| for every float (parameters and
// optimizer state), B the reference. The model is the one A's stored configuration gives. Prints
// "checkpoints: equal within tolerance (worst error / tolerance X over N floats)" or the first
// differences, exit status 1.
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "apps/checkpoint.hpp"
#include "apps/checkpoint_distributed.hpp"
#include "apps/train_config.hpp"
#include "fusekit/core/error.hpp"
#include "models/dlrm_state_io.hpp"

using namespace fk;

namespace {

models::DlrmConfig model_of(const std::string& path) {
  std::ifstream in;
  nlohmann::json stored = apps::open_checkpoint(path, in, "checkpoint_compare").config;
  stored.erase("distributed");
  app::TrainConfig c;
  app::from_json(stored, c);
  return app::make_model_config(c, app::make_featurizer(c));
}

// Every array of the checkpoint's one-process state.
std::vector<std::vector<float>> state_of(const std::string& path, const models::DlrmConfig& config) {
  std::ifstream in;
  const apps::CheckpointHeader h = apps::open_checkpoint(path, in, "checkpoint_compare");
  std::stringstream whole;
  if (apps::is_distributed(h)) {
    apps::consolidate_checkpoint(path, h, in, config, whole, "checkpoint_compare", "A/B");
  } else {
    whole << in.rdbuf();
  }
  std::uint64_t count = 0;
  models::detail::read_state_header(whole, count);
  std::vector<std::vector<float>> arrays;
  for (std::uint64_t i = 0; i < count; ++i)
    arrays.push_back(models::detail::read_state_array(whole, static_cast<std::uint64_t>(config.parameter_count()),
                                                      "checkpoint_compare", path.c_str()));
  return arrays;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: checkpoint_compare A B\n");
    return 2;
  }
  try {
    const models::DlrmConfig config = model_of(argv[1]);
    const auto a = state_of(argv[1], config), b = state_of(argv[2], config);
    if (a.size() != b.size()) {
      std::printf("checkpoints: %zu arrays against %zu\n", a.size(), b.size());
      return 1;
    }
    constexpr double kAtol = 1e-6, kRtol = 1e-5;  // tests/dist/distributed_run.hpp's, with its reason
    double worst = 0;
    std::size_t floats = 0, bad = 0;
    for (std::size_t i = 0; i < a.size(); ++i) {
      if (a[i].size() != b[i].size()) {
        std::printf("checkpoints: array %zu of %zu floats against %zu\n", i, a[i].size(), b[i].size());
        return 1;
      }
      for (std::size_t k = 0; k < a[i].size(); ++k, ++floats) {
        const double err = std::fabs(static_cast<double>(a[i][k]) - b[i][k]);
        const double ratio = err / (kAtol + kRtol * std::fabs(static_cast<double>(b[i][k])));
        worst = std::max(worst, std::isnan(ratio) ? INFINITY : ratio);
        if (!(ratio <= 1) && bad++ < 5) std::printf("checkpoints: array %zu [%zu]: %.9g against %.9g\n", i, k, a[i][k], b[i][k]);
      }
    }
    std::printf("checkpoints: %s (worst error / tolerance %.3g over %zu floats)\n",
                bad == 0 ? "equal within tolerance" : "differ", worst, floats);
    return bad == 0 ? 0 : 1;
  } catch (const Error& e) {
    std::fprintf(stderr, "checkpoint_compare: %s\n", e.what());
    return 1;
  }
}
