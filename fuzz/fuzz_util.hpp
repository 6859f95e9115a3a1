// What the fuzz targets share: a scratch folder for the files they hand to the readers (which
// take paths), and the small DLRM whose checkpoints the checkpoint target loads.
#pragma once

#include <zlib.h>
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include "apps/train_config.hpp"
#include "fusekit/core/device.hpp"
#include "fusekit/models/dlrm.hpp"

namespace fk::fuzz {

// A folder of this process's own (fuzzing with -jobs runs several processes), made once.
inline const std::filesystem::path& scratch_dir() {
  static const std::filesystem::path dir = [] {
    std::string tmpl = (std::filesystem::temp_directory_path() / "fusekit-fuzz-XXXXXX").string();
    if (!::mkdtemp(tmpl.data())) std::abort();
    return std::filesystem::path(tmpl);
  }();
  return dir;
}

inline std::filesystem::path write_file(std::string_view name, const void* data, std::size_t size) {
  const std::filesystem::path p = scratch_dir() / name;
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(size));
  if (!out) std::abort();
  return p;
}

// The checkpoint target's run: tiny.json's settings with 26 tables of 7 rows (a state of a few
// kilobytes, so that a fuzz iteration is cheap).
inline app::TrainConfig fuzz_train_config() {
  app::TrainConfig c;
  c.arch_mlp_bot = "13-8-4";
  c.arch_mlp_top = "8-1";
  c.arch_sparse_feature_size = 4;
  c.max_ind_range = 7;
  c.impl = "fused";
  return c;
}

inline models::Dlrm make_fuzz_model(const app::TrainConfig& c) {
  return models::Dlrm(app::make_model_config(c, app::make_featurizer(c)), Device::cpu(), models::DlrmImpl::fused);
}

template <class T>
inline T load(const std::vector<std::uint8_t>& b, std::size_t at) {
  T v;
  std::memcpy(&v, b.data() + at, sizeof v);
  return v;
}
template <class T>
inline void store(std::vector<std::uint8_t>& b, std::size_t at, T v) {
  std::memcpy(b.data() + at, &v, sizeof v);
}
inline std::uint32_t crc(const std::uint8_t* p, std::size_t n) { return static_cast<std::uint32_t>(crc32_z(0, p, n)); }

// Recomputes the checksums of a file in the binary format's versions 2 to 4, or of an FKCKPT02
// checkpoint, so that the fuzzer reaches the checks behind them (a no-op on other bytes).
//
// The layout as docs/dlrm.md gives it: the header's CRC-32 over bytes [0, 60); after the records,
// one checksum per block of records and the table's own: CRC-32s in versions 2 and 3, XXH3-64s
// in version 4.
inline void repair_binary(std::vector<std::uint8_t>& b) {
  constexpr std::size_t kHeader = 64, kRecord = 160;
  if (b.size() < kHeader) return;
  const std::uint32_t version = load<std::uint32_t>(b, 8);
  if (version < 2 || version > 4) return;
  store(b, 60, crc(b.data(), 60));
  const std::size_t width = version == 4 ? 8 : 4;
  auto sum = [&](const std::uint8_t* p, std::size_t n) -> std::uint64_t {
    return version == 4 ? XXH3_64bits(p, n) : crc(p, n);
  };
  auto put = [&](std::size_t at, std::uint64_t v) { std::memcpy(b.data() + at, &v, width); };  // little-endian
  const std::uint64_t count = load<std::uint64_t>(b, 24);
  const std::uint32_t per = load<std::uint32_t>(b, 32);
  if (per == 0 || count > (b.size() - kHeader) / kRecord) return;
  const std::uint64_t blocks = count / per + (count % per != 0);
  const std::uint64_t table_at = kHeader + count * kRecord;
  if (blocks > (b.size() - table_at) / width || b.size() - table_at - blocks * width < width) return;
  for (std::uint64_t k = 0; k < blocks; ++k) {
    const std::uint64_t n = std::min<std::uint64_t>(per, count - k * per);
    put(table_at + width * k, sum(b.data() + kHeader + k * per * kRecord, n * kRecord));
  }
  put(table_at + width * blocks, sum(b.data() + table_at, blocks * width));
}

// The FKCKPT02 layout as apps/checkpoint.hpp gives it.
inline void repair_checkpoint(std::vector<std::uint8_t>& b) {
  if (b.size() < 24 + 4 + 20 || std::memcmp(b.data(), "FKCKPT02", 8) != 0) return;
  std::uint64_t len = 0;
  std::memcpy(&len, b.data() + 16, 8);
  if (len > b.size() - 48) return;
  const std::size_t state = 24 + len + 4;
  std::uint32_t c = crc(b.data() + 8, 16 + len);
  std::memcpy(b.data() + 24 + len, &c, 4);
  const std::uint64_t state_bytes = b.size() - 20 - state;
  c = crc(b.data() + state, state_bytes);
  std::memcpy(b.data() + b.size() - 20, &state_bytes, 8);
  std::memcpy(b.data() + b.size() - 12, &c, 4);
  std::memcpy(b.data() + b.size() - 8, "FKCKEND2", 8);
}

// A target's whole run: `run` on the input as it is (mostly refused by its checksums, which tests
// that nothing damaged gets through), then on a copy whose checksums `repair` recomputed.
template <class Run, class Repair>
int run_raw_then_repaired(const std::uint8_t* data, std::size_t size, Run run, Repair repair) {
  std::vector<std::uint8_t> bytes(data, data + size);
  run(bytes);
  repair(bytes);
  run(bytes);
  return 0;
}

}  // namespace fk::fuzz
