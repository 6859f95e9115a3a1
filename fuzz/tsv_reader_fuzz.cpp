// Fuzz target: the Criteo TSV reader (plain and gzip; zlib detects which from the bytes).
//
// Any input must be read, or refused with fk::Error (a damaged gzip stream, an overlong line);
// nothing else may escape, and the sanitizers watch every access. On a file that reads, the
// report must account for every line, and the records must survive a write and a strict re-read
// unchanged (the writer and the parser agree).
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "fusekit/core/error.hpp"
#include "fusekit/data/criteo.hpp"
#include "fuzz_util.hpp"

using namespace fk;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto path = fuzz::write_file("in.tsv", data, size);
  data::ReadReport report;
  std::vector<data::RawRecord> records;
  try {
    records = data::read_tsv(path, {}, report);
  } catch (const Error&) {
    return 0;
  }
  if (report.records != static_cast<std::int64_t>(records.size()) || report.records + report.malformed > report.lines)
    std::abort();
  std::int64_t by_error = 0;
  for (std::int64_t n : report.by_error) by_error += n;
  if (by_error != report.malformed) std::abort();
  for (const data::RawRecord& r : records)
    if (r.label != 0 && r.label != 1) std::abort();

  // Strict mode stops at the first malformed line, or reads the same records.
  data::ReadReport strict_report;
  try {
    const auto strict = data::read_tsv(path, {.strict = true}, strict_report);
    if (report.malformed != 0 || strict.size() != records.size()) std::abort();
  } catch (const Error&) {
    if (report.malformed == 0) std::abort();
  }

  const auto copy = fuzz::scratch_dir() / "copy.tsv";
  data::write_tsv(copy, records);
  data::ReadReport again_report;
  const auto again = data::read_tsv(copy, {.strict = true}, again_report);
  if (again.size() != records.size() ||
      (!records.empty() && std::memcmp(again.data(), records.data(), records.size() * sizeof(data::RawRecord)) != 0))
    std::abort();
  return 0;
}
