// What the fuzz targets share: a scratch folder for the files they hand to the readers (which
// take paths), the small DLRM whose checkpoints the checkpoint targets load, and the repairs that
// recompute an input's checksums.
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

#include <nlohmann/json.hpp>

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

// The distributed checkpoint target's run: the same tables with one-layer MLPs (a dense state of
// 1.6 KB, so that mutations land in the manifest's and shard files' headers more often), trained
// with Adagrad, element-wise or row-wise (whose accumulators have a float a row).
inline app::TrainConfig fuzz_dist_train_config(bool rowwise) {
  app::TrainConfig c = fuzz_train_config();
  c.arch_mlp_bot = "13-4";
  c.arch_mlp_top = "1";
  c.optimizer = "adagrad";
  c.rowwise_adagrad = rowwise;
  c.mini_batch_size = 16;
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

// A fuzz input holding several files (dist_checkpoint_fuzz: a manifest and its shard files):
// pieces of a u32 length (little-endian) and that many bytes, the last piece cut short where the
// input ends; at most `max_pieces`, any bytes after them ignored.
inline std::vector<std::vector<std::uint8_t>> split_pieces(const std::vector<std::uint8_t>& b, std::size_t max_pieces) {
  std::vector<std::vector<std::uint8_t>> out;
  for (std::size_t at = 0; at + 4 <= b.size() && out.size() < max_pieces;) {
    const std::size_t n = std::min<std::size_t>(load<std::uint32_t>(b, at), b.size() - at - 4);
    out.emplace_back(b.begin() + static_cast<std::ptrdiff_t>(at + 4), b.begin() + static_cast<std::ptrdiff_t>(at + 4 + n));
    at += 4 + n;
  }
  return out;
}
inline std::vector<std::uint8_t> join_pieces(const std::vector<std::vector<std::uint8_t>>& pieces) {
  std::vector<std::uint8_t> out;
  for (const auto& p : pieces) {
    out.resize(out.size() + 4);
    store(out, out.size() - 4, static_cast<std::uint32_t>(p.size()));
    out.insert(out.end(), p.begin(), p.end());
  }
  return out;
}

// A distributed checkpoint's pieces (the manifest, then shard files; apps/checkpoint_distributed.hpp)
// with the manifest's config_crc recomputed and copied into every shard file's, then each piece's
// FKCKPT02 checksums (repair_checkpoint), so that the fuzzer reaches the plan, the shard files'
// identity checks and the states behind them. Pieces whose configuration is not a JSON object are
// left as they are.
inline void repair_distributed_checkpoint(std::vector<std::uint8_t>& b) {
  auto pieces = split_pieces(b, SIZE_MAX);
  // A piece's configuration as JSON (the FKCKPT02 header's), or null.
  const auto config_of = [](const std::vector<std::uint8_t>& p) -> nlohmann::json {
    if (p.size() < 24 || std::memcmp(p.data(), "FKCKPT02", 8) != 0) return nullptr;
    const std::uint64_t len = load<std::uint64_t>(p, 16);
    if (len > p.size() - 24) return nullptr;
    const nlohmann::json j = nlohmann::json::parse(p.begin() + 24, p.begin() + 24 + static_cast<std::ptrdiff_t>(len),
                                                   nullptr, false);
    return j.is_object() ? j : nlohmann::json();
  };
  const auto with_config = [](std::vector<std::uint8_t>& p, const nlohmann::json& j) {
    const std::uint64_t old = load<std::uint64_t>(p, 16);
    const std::string text = j.dump();
    std::vector<std::uint8_t> q(p.begin(), p.begin() + 16);
    q.resize(24);
    store<std::uint64_t>(q, 16, text.size());
    q.insert(q.end(), text.begin(), text.end());
    q.insert(q.end(), p.begin() + 24 + static_cast<std::ptrdiff_t>(old), p.end());
    p = std::move(q);
  };
  nlohmann::json crc_value;
  if (!pieces.empty()) {
    nlohmann::json m = config_of(pieces[0]);
    if (m.is_object() && m.contains("distributed") && m["distributed"].is_object()) {
      nlohmann::json rest = m;
      rest.erase("distributed");
      const std::string text = rest.dump();
      crc_value = crc(reinterpret_cast<const std::uint8_t*>(text.data()), text.size());
      m["distributed"]["config_crc"] = crc_value;
      with_config(pieces[0], m);
    }
  }
  for (std::size_t i = 1; i < pieces.size() && !crc_value.is_null(); ++i) {
    nlohmann::json s = config_of(pieces[i]);
    if (!s.is_object()) continue;
    s["config_crc"] = crc_value;
    with_config(pieces[i], s);
  }
  for (auto& p : pieces) repair_checkpoint(p);
  b = join_pieces(pieces);
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
