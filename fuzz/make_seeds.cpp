// Writes the fuzz targets' generated seed corpus into OUT/{tsv,binary,checkpoint,vocabulary,shards}:
// files made by fusekit's own writers (synthetic TSV records plain and gzip-compressed, binary
// files of both versions and several block sizes, checkpoints of both formats of the checkpoint
// target's model, vocabularies of the synthetic records). The hand-written edge cases are committed under fuzz/corpus/.
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

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: fuzz_make_seeds OUT criteo_malformed.tsv\n");
    return 2;
  }
  const fs::path out = argv[1];
  for (const char* d : {"tsv", "binary", "checkpoint", "vocabulary", "shards"}) fs::create_directories(out / d);

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
  std::printf("fuzz seeds written to %s\n", out.c_str());
  return 0;
}
