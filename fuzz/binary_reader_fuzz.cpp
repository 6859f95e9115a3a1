// Fuzz target: the fusekit binary Criteo reader (data::binary_source).
//
// Each input is read twice: as it is (mostly refused by the header's CRC-32, which tests that
// nothing damaged gets through), and with its checksums recomputed, so that the fuzzer also
// reaches the field, size, block and label checks behind them. Either way the reader must
// refuse with fk::Error or return exactly the records stored at their offsets in the file.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "fusekit/core/error.hpp"
#include "fusekit/data/criteo.hpp"
#include "fuzz_util.hpp"

using namespace fk;

namespace {

constexpr std::size_t kHeader = 64, kRecord = 160;

void read_all(const std::vector<std::uint8_t>& bytes) {
  const auto path = fuzz::write_file("in.bin", bytes.data(), bytes.size());
  std::shared_ptr<data::RecordSource> src;
  try {
    src = data::binary_source(path);
  } catch (const Error&) {
    return;
  }
  const std::int64_t n = src->size();
  if (n < 0 || static_cast<std::uint64_t>(n) > (bytes.size() - kHeader) / kRecord) std::abort();
  std::vector<data::RawRecord> out(static_cast<std::size_t>(std::min<std::int64_t>(n, 97)));
  // Reads of 97 records (the last one shorter), so that reads straddle blocks of any size.
  for (std::int64_t at = 0; at < n; at += 97) {
    const auto part = std::span(out).first(static_cast<std::size_t>(std::min<std::int64_t>(97, n - at)));
    try {
      src->read(at, part);
    } catch (const Error&) {
      return;
    }
    if (std::memcmp(part.data(), bytes.data() + kHeader + static_cast<std::size_t>(at) * kRecord, part.size_bytes()) != 0)
      std::abort();
    for (const data::RawRecord& r : part)
      if (r.label != 0 && r.label != 1) std::abort();
  }
  // A range outside the file is refused, never read.
  try {
    src->read(n, std::span(out).first(out.empty() ? 0 : 1));
    if (!out.empty()) std::abort();
  } catch (const Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  return fuzz::run_raw_then_repaired(data, size, read_all, fuzz::repair_binary);
}
