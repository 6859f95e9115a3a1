// Fuzz target: the preprocessed data set's manifest (data::open_shards). A directory of real day
// files and vocabulary is written once; each input becomes its manifest.json. An accepted data set
// must be consistent: days at least 2, boundaries that add up to its records, and every record's
// ids below its tables' rows.
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <vector>

#include "fusekit/core/error.hpp"
#include "fusekit/data/preprocess.hpp"
#include "fuzz_util.hpp"

using namespace fk;

namespace {

const std::filesystem::path& data_set_dir() {
  static const std::filesystem::path dir = [] {
    const std::filesystem::path d = fuzz::scratch_dir() / "shards";
    data::SyntheticConfig sc;
    std::vector<data::RawRecord> records(50);
    data::SyntheticCriteo(sc).generate(0, records);
    data::write_tsv(fuzz::scratch_dir() / "shards.tsv", records);
    data::preprocess({.inputs = {fuzz::scratch_dir() / "shards.tsv"}, .out = d, .threads = 1});
    return d;
  }();
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::filesystem::path& dir = data_set_dir();
  {
    std::ofstream out(dir / "manifest.json", std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  data::ShardSet s;
  try {
    s = data::open_shards(dir);
  } catch (const Error&) {
    return 0;
  }
  if (s.days.size() < 2 || s.day_begin.size() != s.days.size() + 1 || s.day_begin.front() != 0) std::abort();
  for (std::size_t d = 0; d < s.days.size(); ++d)
    if (s.day_begin[d + 1] - s.day_begin[d] != s.days[d]->size()) std::abort();
  std::vector<data::RawRecord> all(static_cast<std::size_t>(s.all()->size()));
  s.all()->read(0, all);
  for (const data::RawRecord& r : all)
    for (int t = 0; t < data::kNumSparse; ++t)
      if (static_cast<std::int64_t>(r.sparse[static_cast<std::size_t>(t)]) >= s.vocabulary->rows(t)) std::abort();
  return 0;
}
