// Fuzz target: the vocabulary file reader (data::Vocabulary::parse, what load reads).
//
// Each input is read as it is (the trailing CRC-32 refuses nearly every mutation) and with its CRC
// recomputed, so that the fuzzer also reaches the header, size and duplicate-value checks behind
// it. A vocabulary the reader accepts must be consistent: every id's value looks up to that id,
// and the fingerprint is the file's CRC.
#include <zlib.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <span>
#include <vector>

#include "fusekit/core/error.hpp"
#include "fusekit/data/vocabulary.hpp"
#include "fuzz_util.hpp"

using namespace fk;

namespace {

void read_vocabulary(const std::vector<std::uint8_t>& bytes) {
  data::Vocabulary v;
  try {
    v = data::Vocabulary::parse(std::as_bytes(std::span(bytes)), "fuzz input");
  } catch (const Error&) {
    return;
  }
  std::uint32_t stored;
  std::memcpy(&stored, bytes.data() + bytes.size() - 4, 4);
  if (v.fingerprint() != stored) std::abort();
  for (int t = 0; t < data::kNumSparse; ++t) {
    if (v.rows(t) != v.kept(t) + 1) std::abort();
    for (std::int64_t id = 1; id <= v.kept(t); ++id)
      if (v.id(t, v.key_of(t, static_cast<std::uint32_t>(id))) != id) std::abort();
  }
}

void repair_crc(std::vector<std::uint8_t>& bytes) {
  if (bytes.size() < 4) return;
  const auto crc = static_cast<std::uint32_t>(::crc32_z(0, bytes.data(), bytes.size() - 4));
  std::memcpy(bytes.data() + bytes.size() - 4, &crc, 4);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  return fuzz::run_raw_then_repaired(data, size, read_vocabulary, repair_crc);
}
