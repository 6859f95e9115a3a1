// Writes the fuzz targets' generated seed corpus into
// OUT/{tsv,binary,checkpoint,vocabulary,shards,dist_checkpoint}: files made by fusekit's own writers
// (synthetic TSV records plain and gzip-compressed, binary files of both versions and several block
// sizes, checkpoints of both formats of the checkpoint target's model, vocabularies of the
// synthetic records, distributed checkpoints of 2 and 3 ranks). The hand-written edge cases are
// committed under fuzz/corpus/.
//
//   fuzz_make_seeds OUT criteo_malformed.tsv
#include <zlib.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "apps/checkpoint.hpp"
#include "apps/checkpoint_distributed.hpp"
#include "fusekit/dist/communicator.hpp"
#include "fusekit/models/dlrm_distributed.hpp"
#include "fusekit/data/preprocess.hpp"
#include "fusekit/data/vocabulary.hpp"
#include "fusekit/data/criteo.hpp"
#include "fuzz_util.hpp"

using namespace fk;
namespace fs = std::filesystem;

namespace {

std::vector<std::uint8_t> slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}
void spill(const fs::path& p, const std::vector<std::uint8_t>& b) {
  std::ofstream(p, std::ios::binary | std::ios::trunc).write(reinterpret_cast<const char*>(b.data()),
                                                            static_cast<std::streamsize>(b.size()));
}
void gzip(const fs::path& from, const fs::path& to, std::size_t keep = SIZE_MAX) {
  const std::vector<std::uint8_t> plain = slurp(from);
  gzFile g = gzopen(to.c_str(), "wb");
  gzwrite(g, plain.data(), static_cast<unsigned>(plain.size()));
  gzclose(g);
  if (keep != SIZE_MAX) {  // a truncated stream
    std::vector<std::uint8_t> z = slurp(to);
    z.resize(std::min(keep, z.size()));
    spill(to, z);
  }
}

// A distributed checkpoint of the one-process state `state` (config `c`), saved as fusekit train
// --distributed saves it on `ranks` ranks with tables split at `max_shard_rows`: each rank's shards
// gathered from the state (ranks built offline), its shard file, then the manifest; the files as
// dist_checkpoint_fuzz's pieces (manifest first).
std::vector<std::uint8_t> distributed_seed(const app::TrainConfig& c, const std::string& state, int ranks,
                                           std::int64_t max_shard_rows, const fs::path& dir) {
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string manifest = (dir / "state.ckpt").string();
  const models::DlrmConfig mc = app::make_model_config(c, app::make_featurizer(c));
  const dist::ShardingPlan plan = models::plan_dlrm_sharding(mc, ranks, c.mini_batch_size, models::OptimizerKind::adagrad,
                                                             {}, {.max_shard_rows = max_shard_rows});
  std::string dense;
  for (int r = 0; r < ranks; ++r) {
    auto comm = dist::make_offline_communicator(r, ranks);
    models::DistributedDlrm m(mc, *comm, plan, models::DlrmImpl::fused);
    std::istringstream in(state);
    m.load(in, {models::one_process_plan(mc.table_rows), models::SavedTables::Layout::one_process,
                [&in](int) -> std::istream& {
                  in.clear();
                  in.seekg(0);
                  return in;
                }});
    apps::write_shard_file(manifest, 2, app::to_json(c), plan, r, [&](std::ostream& out) { m.save_shards(out); });
    std::ostringstream d;
    m.dense().save_state(d);
    dense = d.str();
  }
  apps::write_manifest(manifest, 2, app::to_json(c), plan, [&](std::ostream& out) { out << dense; });
  std::vector<std::vector<std::uint8_t>> pieces{slurp(manifest)};
  for (int r = 0; r < ranks; ++r) pieces.push_back(slurp(apps::shard_file_path(manifest, 2, r, ranks)));
  fs::remove_all(dir);
  return fuzz::join_pieces(pieces);
}

// The one-process state of the fuzz model with Adagrad after `steps` steps on synthetic records.
std::string trained_state(const app::TrainConfig& c, int steps) {
  const data::Featurizer feat = app::make_featurizer(c);
  models::Dlrm model(app::make_model_config(c, feat), Device::cpu(), models::DlrmImpl::fused);
  std::vector<data::RawRecord> recs(static_cast<std::size_t>(c.mini_batch_size * steps));
  data::SyntheticCriteo(data::SyntheticConfig{}).generate(0, recs);
  for (int k = 0; k < steps; ++k) {
    data::Batch b;
    data::make_batch(std::span(recs).subspan(static_cast<std::size_t>(k * c.mini_batch_size),
                                             static_cast<std::size_t>(c.mini_batch_size)),
                     feat, b);
    model.train_step({b.dense, b.indices, b.offsets}, b.labels,
                     {.kind = models::OptimizerKind::adagrad, .learning_rate = 0.05f});
  }
  std::ostringstream out;
  model.save_state(out);
  return out.str();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: fuzz_make_seeds OUT criteo_malformed.tsv\n");
    return 2;
  }
  const fs::path out = argv[1];
  for (const char* d : {"tsv", "binary", "checkpoint", "vocabulary", "shards", "dist_checkpoint"})
    fs::create_directories(out / d);

  data::SyntheticConfig sc;
  sc.seed = 7;
  std::vector<data::RawRecord> recs(12);
  data::SyntheticCriteo(sc).generate(0, recs);

  // TSV: the test fixture of malformed lines, synthetic records, both gzip-compressed, one cut.
  fs::copy_file(argv[2], out / "tsv/malformed.tsv", fs::copy_options::overwrite_existing);
  data::write_tsv(out / "tsv/synthetic.tsv", recs);
  gzip(out / "tsv/malformed.tsv", out / "tsv/malformed.tsv.gz");
  gzip(out / "tsv/synthetic.tsv", out / "tsv/synthetic.tsv.gz");
  gzip(out / "tsv/synthetic.tsv", out / "tsv/synthetic_cut.tsv.gz", 300);

  // Vocabularies of the records: every value, a threshold of 2, values folded by a range of 100.
  for (const data::VocabularyOptions o : {data::VocabularyOptions{0, 1}, data::VocabularyOptions{0, 2},
                                          data::VocabularyOptions{100, 1}}) {
    data::VocabularyCounter c(o);
    c.add(recs);
    data::Vocabulary::build(c).save(out / "vocabulary" /
                                    ("r" + std::to_string(o.max_ind_range) + "_t" + std::to_string(o.min_count) + ".fkv"));
  }

  // Shards: the manifest of the data set shards_fuzz writes (the same 50 records).
  {
    std::vector<data::RawRecord> fifty(50);
    data::SyntheticCriteo(data::SyntheticConfig{}).generate(0, fifty);
    data::write_tsv(out / "shards/input.tsv", fifty);
    data::preprocess({.inputs = {out / "shards/input.tsv"}, .out = out / "shards/set", .threads = 1});
    fs::copy_file(out / "shards/set/manifest.json", out / "shards/manifest.json", fs::copy_options::overwrite_existing);
    fs::remove_all(out / "shards/set");
    fs::remove(out / "shards/input.tsv");
  }

  // Binary: version 4 as written (raw values and vocabulary ids), with 5-record and 1-record
  // blocks; versions 3 and 2 (CRC-32s); version 1.
  data::write_binary(out / "binary/v4_ids.bin", std::span(recs).first(10), {true, 0x1234});
  data::write_binary(out / "binary/v4.bin", std::span(recs).first(10));
  for (std::uint32_t per : {5u, 1u}) {
    std::vector<std::uint8_t> b = slurp(out / "binary/v4.bin");
    const std::uint64_t count = 10, blocks = (count + per - 1) / per;
    b.resize(64 + count * 160 + blocks * 8 + 8);
    fuzz::store(b, 32, per);
    fuzz::repair_binary(b);
    spill(out / "binary" / ("v4_block" + std::to_string(per) + ".bin"), b);
  }
  for (const std::uint32_t version : {2u, 3u}) {
    std::vector<std::uint8_t> b = slurp(out / (version == 3 ? "binary/v4_ids.bin" : "binary/v4.bin"));
    b.resize(64 + 10 * 160 + 4 + 4);  // one block: its CRC-32, the table's
    fuzz::store(b, 8, version);
    fuzz::repair_binary(b);
    spill(out / "binary" / ("v" + std::to_string(version) + ".bin"), b);
  }
  {
    std::vector<std::uint8_t> b = slurp(out / "binary/v4.bin");
    b.resize(64 + 10 * 160);
    fuzz::store<std::uint32_t>(b, 8, 1);
    std::fill(b.begin() + 32, b.begin() + 64, 0);
    spill(out / "binary/v1.bin", b);
  }

  // Checkpoints of the checkpoint target's model, FKCKPT02 and FKCKPT01.
  const app::TrainConfig c = fuzz::fuzz_train_config();
  const models::Dlrm model = fuzz::make_fuzz_model(c);
  apps::write_checkpoint((out / "checkpoint/v2.ckpt").string(), 3, app::to_json(c),
                         [&](std::ostream& s) { model.save_state(s); });
  {
    std::ostringstream state;
    model.save_state(state);
    const std::string cfg = app::to_json(c).dump(), st = state.str();
    std::ofstream v1(out / "checkpoint/v1.ckpt", std::ios::binary | std::ios::trunc);
    const std::uint64_t step = 3, len = cfg.size();
    v1.write("FKCKPT01", 8);
    v1.write(reinterpret_cast<const char*>(&step), 8);
    v1.write(reinterpret_cast<const char*>(&len), 8);
    v1 << cfg << st;
  }
  // Distributed checkpoints (manifest and shard files as dist_checkpoint_fuzz's pieces) of the
  // fuzz model trained with Adagrad: 2 ranks, tables whole, element-wise accumulators; 2 and 3
  // ranks with the 7-row tables split (row-wise); 2 ranks before any step (no optimizer state);
  // and a one-process checkpoint on its own (1 -> M).
  for (const bool rowwise : {false, true}) {
    const app::TrainConfig dc = fuzz::fuzz_dist_train_config(rowwise);
    const std::string state = trained_state(dc, 2);
    const fs::path scratch = out / "dist_checkpoint/scratch";
    if (!rowwise) {
      spill(out / "dist_checkpoint/r2_whole.fz", distributed_seed(dc, state, 2, 0, scratch));
      spill(out / "dist_checkpoint/r2_step0.fz", distributed_seed(dc, trained_state(dc, 0), 2, 4, scratch));
      apps::write_checkpoint((scratch.parent_path() / "one.ckpt").string(), 2, app::to_json(dc),
                             [&](std::ostream& s) { s << state; });
      spill(out / "dist_checkpoint/one_process.fz", fuzz::join_pieces({slurp(scratch.parent_path() / "one.ckpt")}));
      fs::remove(scratch.parent_path() / "one.ckpt");
    } else {
      spill(out / "dist_checkpoint/r2_rowwise_split.fz", distributed_seed(dc, state, 2, 4, scratch));
      spill(out / "dist_checkpoint/r3_rowwise_split.fz", distributed_seed(dc, state, 3, 3, scratch));
      app::TrainConfig d16 = dc;  // bf16 tables: the shard files end with the tables' rounding step
      d16.embedding_dtype = "bf16";
      d16.impl = "fused";
      spill(out / "dist_checkpoint/r2_rowwise_split_bf16.fz", distributed_seed(d16, trained_state(d16, 2), 2, 4, scratch));
    }
  }
  std::printf("fuzz seeds written to %s\n", out.c_str());
  return 0;
}
