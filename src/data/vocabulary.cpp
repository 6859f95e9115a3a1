// Vocabularies of the Criteo categorical features: see vocabulary.hpp.
#include "fusekit/data/vocabulary.hpp"

#include <fmt/format.h>
#include <zlib.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>

#include "fusekit/core/error.hpp"

namespace fk::data {
namespace {

constexpr char kMagic[8] = {'F', 'K', 'V', 'O', 'C', 'A', 'B', '1'};
constexpr std::uint32_t kVersion = 1;
// magic, version, features, max_ind_range, min_count, records, kept[26]
constexpr std::size_t kHeaderBytes = 8 + 4 + 4 + 8 + 8 + 8 + 8 * kNumSparse;

std::uint32_t crc32_of(std::span<const std::byte> bytes) {
  return static_cast<std::uint32_t>(::crc32_z(0, reinterpret_cast<const Bytef*>(bytes.data()), bytes.size()));
}

template <class T>
void put(std::vector<std::byte>& out, T v) {
  const auto* p = reinterpret_cast<const std::byte*>(&v);
  out.insert(out.end(), p, p + sizeof(T));
}

// Reads little-endian values from a byte span, refusing to read past its end.
class Reader {
 public:
  Reader(std::span<const std::byte> bytes, const std::string& what) : bytes_(bytes), what_(what) {}
  template <class T>
  T get(const char* field) {
    if (bytes_.size() - pos_ < sizeof(T))
      throw Error("data::Vocabulary::load", fmt::format("{}: truncated in {} (at byte {} of {})", what_, field, pos_,
                                                        bytes_.size()));
    T v;
    std::memcpy(&v, bytes_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }

 private:
  std::span<const std::byte> bytes_;
  std::string what_;
  std::size_t pos_ = 0;
};

void check_feature(int feature, const char* op) {
  FK_CHECK_ARG(feature >= 0 && feature < kNumSparse, op, "feature", "0 <= feature < 26", std::to_string(feature));
}

}  // namespace

void VocabularyOptions::validate() const {
  FK_CHECK_ARG(min_count >= 1, "data::Vocabulary", "min_count", ">= 1", std::to_string(min_count));
  FK_CHECK_ARG(max_ind_range < (std::int64_t{1} << 32), "data::Vocabulary", "max_ind_range",
               "below 2^32 (<= 0: none)", std::to_string(max_ind_range));
}

VocabularyCounter::VocabularyCounter(VocabularyOptions options) : options_(options) { options_.validate(); }

void VocabularyCounter::add(std::span<const RawRecord> records, int threads) {
  const auto count = [&](int first, int step) {
    for (int t = first; t < kNumSparse; t += step) add_feature(t, records);
  };
  threads = std::clamp(threads, 1, kNumSparse);
  if (threads == 1) {
    count(0, 1);
  } else {
    std::vector<std::thread> pool;
    for (int i = 0; i < threads; ++i) pool.emplace_back(count, i, threads);
    for (std::thread& th : pool) th.join();
  }
  add_records(static_cast<std::int64_t>(records.size()));
}

namespace {

// A hash map entry costs about 40 bytes, a dense slot 4: a feature switches to an array of
// max_ind_range counts once its map holds more than max_ind_range / 10 keys.
constexpr std::int64_t kDenseRatio = 10;

void add_saturating(std::uint32_t& slot, std::int64_t n) {
  slot = static_cast<std::uint32_t>(std::min<std::int64_t>(std::int64_t{slot} + n, UINT32_MAX));
}

}  // namespace

void VocabularyCounter::add_feature(int feature, std::span<const RawRecord> records) {
  check_feature(feature, "data::VocabularyCounter::add_feature");
  const std::size_t t = static_cast<std::size_t>(feature);
  if (dense_[t].empty()) {
    auto& counts = counts_[t];
    for (const RawRecord& r : records) ++counts[options_.key(r.sparse[t])];
    if (options_.max_ind_range > 0 && static_cast<std::int64_t>(counts.size()) * kDenseRatio > options_.max_ind_range)
      make_dense(feature);
    return;
  }
  std::vector<std::uint32_t>& dense = dense_[t];
  for (const RawRecord& r : records) {
    std::uint32_t& slot = dense[options_.key(r.sparse[t])];
    if (slot != UINT32_MAX) ++slot;
  }
}

void VocabularyCounter::make_dense(int feature) {
  const std::size_t t = static_cast<std::size_t>(feature);
  if (!dense_[t].empty()) return;
  dense_[t].assign(static_cast<std::size_t>(options_.max_ind_range), 0);
  for (const auto& [key, n] : counts_[t]) add_saturating(dense_[t][key], n);
  std::unordered_map<std::uint32_t, std::int64_t>().swap(counts_[t]);  // its memory back
}

void VocabularyCounter::add_records(std::int64_t n) {
  FK_CHECK_ARG(n >= 0, "data::VocabularyCounter::add_records", "n", ">= 0", std::to_string(n));
  records_ += n;
}

void VocabularyCounter::merge(const VocabularyCounter& other) {
  FK_CHECK_ARG(other.options_.max_ind_range == options_.max_ind_range && other.options_.min_count == options_.min_count,
               "data::VocabularyCounter::merge", "other", "a counter with the same options",
               fmt::format("max_ind_range {}, min_count {}", other.options_.max_ind_range, other.options_.min_count));
  for (std::size_t t = 0; t < counts_.size(); ++t) {
    if (!other.dense_[t].empty()) make_dense(static_cast<int>(t));
    if (dense_[t].empty()) {
      for (const auto& [key, n] : other.counts_[t]) counts_[t][key] += n;
      continue;
    }
    for (const auto& [key, n] : other.counts_[t]) add_saturating(dense_[t][key], n);
    for (std::size_t key = 0; key < other.dense_[t].size(); ++key) add_saturating(dense_[t][key], other.dense_[t][key]);
  }
  records_ += other.records_;
}

std::int64_t VocabularyCounter::distinct(int feature) const {
  check_feature(feature, "data::VocabularyCounter::distinct");
  const std::size_t t = static_cast<std::size_t>(feature);
  if (dense_[t].empty()) return static_cast<std::int64_t>(counts_[t].size());
  return static_cast<std::int64_t>(dense_[t].size() - static_cast<std::size_t>(std::count(dense_[t].begin(), dense_[t].end(), 0u)));
}

namespace {

// The keys of a feature seen at least min_count times, by decreasing count then key.
std::vector<std::uint32_t> keys_by_count(const std::unordered_map<std::uint32_t, std::int64_t>& counts,
                                         const std::vector<std::uint32_t>& dense, std::int64_t min_count) {
  std::vector<std::pair<std::int64_t, std::uint32_t>> kept;  // (count, key)
  for (const auto& [key, n] : counts)
    if (n >= min_count) kept.emplace_back(n, key);
  for (std::size_t key = 0; key < dense.size(); ++key)
    if (dense[key] != 0 && dense[key] >= min_count) kept.emplace_back(dense[key], static_cast<std::uint32_t>(key));
  std::sort(kept.begin(), kept.end(), [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  });
  std::vector<std::uint32_t> keys;
  keys.reserve(kept.size());
  for (const auto& [n, key] : kept) keys.push_back(key);
  return keys;
}

}  // namespace

Vocabulary Vocabulary::build(const VocabularyCounter& counter) {
  Vocabulary v;
  v.options_ = counter.options_;
  v.records_ = counter.records_;
  for (std::size_t t = 0; t < counter.counts_.size(); ++t)
    v.by_id_[t] = keys_by_count(counter.counts_[t], counter.dense_[t], v.options_.min_count);
  v.index();
  return v;
}

Vocabulary Vocabulary::build(VocabularyCounter&& counter) {
  Vocabulary v;
  v.options_ = counter.options_;
  v.records_ = counter.records_;
  for (std::size_t t = 0; t < counter.counts_.size(); ++t) {
    v.by_id_[t] = keys_by_count(counter.counts_[t], counter.dense_[t], v.options_.min_count);
    std::unordered_map<std::uint32_t, std::int64_t>().swap(counter.counts_[t]);
    std::vector<std::uint32_t>().swap(counter.dense_[t]);
  }
  counter.records_ = 0;
  v.index();
  return v;
}

namespace {

// Open addressing with linear probing: the slot of a key starts at the top bits of its
// Fibonacci hash.
std::size_t slot_of(std::uint64_t key, int shift) {
  return static_cast<std::size_t>((key * 0x9E3779B97F4A7C15ull) >> shift);
}

}  // namespace

void Vocabulary::index() {
  for (std::size_t t = 0; t < by_id_.size(); ++t) {
    const std::vector<std::uint32_t>& keys = by_id_[t];
    FK_CHECK_ARG(keys.size() < (std::size_t{1} << 32) - 1, "data::Vocabulary", "kept",
                 "fewer than 2^32 - 1 values a feature", std::to_string(keys.size()));
    // At most 3/4 full; a slot holds key << 32 | id, and 0 (id 0 never stored) is empty.
    int bits = 1;
    while ((std::size_t{1} << bits) * 3 < keys.size() * 4) ++bits;
    shift_[t] = 64 - bits;
    for (const std::uint64_t key : keys)
      if (options_.max_ind_range > 0 && static_cast<std::int64_t>(key) >= options_.max_ind_range)
        throw Error("data::Vocabulary", fmt::format("feature {}: value {:#x} is not below max_ind_range {}", t, key,
                                                    options_.max_ind_range));
    auto& slots = slots_[t];
    auto& id_of_key = id_of_key_[t];
    slots.clear();
    id_of_key.clear();
    // Under max_ind_range every key is below it: an array of max_ind_range ids where that takes
    // less memory than the table (the MLPerf model's large features: 160 MB against 537 MB).
    const std::uint64_t range = options_.max_ind_range > 0 ? static_cast<std::uint64_t>(options_.max_ind_range) : 0;
    if (range > 0 && range <= (std::uint64_t{1} << bits) * 2) {  // 4 bytes a key against 8 a slot
      id_of_key.assign(range, 0);
      for (std::size_t i = 0; i < keys.size(); ++i) {
        if (id_of_key[keys[i]] != 0)
          throw Error("data::Vocabulary", fmt::format("feature {}: value {:#x} appears twice", t, keys[i]));
        id_of_key[keys[i]] = static_cast<std::uint32_t>(i + 1);
      }
      continue;
    }
    slots.assign(std::size_t{1} << bits, 0);
    const std::size_t mask = slots.size() - 1;
    for (std::size_t i = 0; i < keys.size(); ++i) {
      const std::uint64_t key = keys[i];
      std::size_t at = slot_of(key, shift_[t]);
      for (; slots[at] != 0; at = (at + 1) & mask)
        if (slots[at] >> 32 == key)
          throw Error("data::Vocabulary", fmt::format("feature {}: value {:#x} appears twice", t, key));
      slots[at] = key << 32 | (i + 1);
    }
  }
  const std::vector<std::byte> bytes = serialize();
  std::memcpy(&fingerprint_, bytes.data() + bytes.size() - 4, 4);
}

std::int64_t Vocabulary::kept(int feature) const {
  check_feature(feature, "data::Vocabulary::kept");
  return static_cast<std::int64_t>(by_id_[static_cast<std::size_t>(feature)].size());
}

std::vector<std::int64_t> Vocabulary::table_rows() const {
  std::vector<std::int64_t> r(kNumSparse);
  for (int t = 0; t < kNumSparse; ++t) r[static_cast<std::size_t>(t)] = rows(t);
  return r;
}

std::uint32_t Vocabulary::id(int feature, std::uint32_t raw) const {
  const std::uint64_t key = options_.key(raw);
  const auto& id_of_key = id_of_key_[static_cast<std::size_t>(feature)];
  if (!id_of_key.empty()) return id_of_key[key];  // key < max_ind_range
  const auto& slots = slots_[static_cast<std::size_t>(feature)];
  const std::size_t mask = slots.size() - 1;
  for (std::size_t at = slot_of(key, shift_[static_cast<std::size_t>(feature)]);; at = (at + 1) & mask) {
    const std::uint64_t v = slots[at];
    if (v == 0) return 0u;
    if (v >> 32 == key) return static_cast<std::uint32_t>(v);
  }
}

std::uint32_t Vocabulary::key_of(int feature, std::uint32_t id) const {
  check_feature(feature, "data::Vocabulary::key_of");
  const auto& keys = by_id_[static_cast<std::size_t>(feature)];
  FK_CHECK_ARG(id >= 1 && id <= keys.size(), "data::Vocabulary::key_of", "id",
               fmt::format("1 .. {} (0 is the unknown id)", keys.size()), std::to_string(id));
  return keys[id - 1];
}

std::vector<std::byte> Vocabulary::serialize() const {
  std::vector<std::byte> out;
  std::size_t values = 0;
  for (const auto& k : by_id_) values += k.size();
  out.reserve(kHeaderBytes + 4 * values + 4);
  out.insert(out.end(), reinterpret_cast<const std::byte*>(kMagic), reinterpret_cast<const std::byte*>(kMagic) + 8);
  put<std::uint32_t>(out, kVersion);
  put<std::uint32_t>(out, kNumSparse);
  put<std::int64_t>(out, options_.max_ind_range);
  put<std::int64_t>(out, options_.min_count);
  put<std::int64_t>(out, records_);
  for (const auto& k : by_id_) put<std::uint64_t>(out, k.size());
  for (const auto& k : by_id_) {
    const auto* p = reinterpret_cast<const std::byte*>(k.data());
    out.insert(out.end(), p, p + 4 * k.size());
  }
  put<std::uint32_t>(out, crc32_of(out));
  return out;
}

void Vocabulary::save(const std::filesystem::path& path) const {
  const std::vector<std::byte> bytes = serialize();
  std::filesystem::path tmp = path;
  tmp += ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) throw Error("data::Vocabulary::save", fmt::format("cannot write {}", tmp.string()));
    f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    if (!f.flush()) throw Error("data::Vocabulary::save", fmt::format("write failed: {}", tmp.string()));
  }
  std::filesystem::rename(tmp, path);
}

Vocabulary Vocabulary::load(const std::filesystem::path& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw Error("data::Vocabulary::load", fmt::format("cannot open {}", path.string()));
  std::vector<char> chars((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  return parse(std::as_bytes(std::span<const char>(chars)), path.string());
}

Vocabulary Vocabulary::parse(std::span<const std::byte> bytes, const std::string& what) {
  constexpr const char* op = "data::Vocabulary::load";
  if (bytes.size() < 8 || std::memcmp(bytes.data(), kMagic, 8) != 0)
    throw Error(op, fmt::format("{}: not a fusekit vocabulary (no FKVOCAB1 magic)", what));
  Reader in(bytes.subspan(8), what);
  const auto version = in.get<std::uint32_t>("version");
  if (version != kVersion) throw Error(op, fmt::format("{}: version {}, expected {}", what, version, kVersion));
  const auto features = in.get<std::uint32_t>("features");
  if (features != kNumSparse) throw Error(op, fmt::format("{}: {} features, expected 26", what, features));
  Vocabulary v;
  v.options_.max_ind_range = in.get<std::int64_t>("max_ind_range");
  v.options_.min_count = in.get<std::int64_t>("min_count");
  v.records_ = in.get<std::int64_t>("records");
  if (v.options_.min_count < 1 || v.options_.max_ind_range >= (std::int64_t{1} << 32) || v.records_ < 0)
    throw Error(op, fmt::format("{}: options out of range (max_ind_range {}, min_count {}, records {})", what,
                                v.options_.max_ind_range, v.options_.min_count, v.records_));
  std::array<std::uint64_t, kNumSparse> kept{};
  std::uint64_t values = 0;
  for (auto& k : kept) {
    k = in.get<std::uint64_t>("kept");
    if (k > (bytes.size() - kHeaderBytes) / 4) throw Error(op, fmt::format("{}: kept count {} exceeds the file", what, k));
    values += k;
  }
  if (bytes.size() != kHeaderBytes + 4 * values + 4)
    throw Error(op, fmt::format("{}: {} bytes, the header says {}", what, bytes.size(), kHeaderBytes + 4 * values + 4));
  const std::uint32_t want = crc32_of(bytes.first(bytes.size() - 4));
  std::uint32_t crc;
  std::memcpy(&crc, bytes.data() + bytes.size() - 4, 4);
  if (crc != want) throw Error(op, fmt::format("{}: CRC mismatch (stored {:#010x}, computed {:#010x})", what, crc, want));
  std::size_t pos = kHeaderBytes;
  for (std::size_t t = 0; t < kept.size(); ++t) {
    v.by_id_[t].resize(kept[t]);
    if (kept[t] > 0) std::memcpy(v.by_id_[t].data(), bytes.data() + pos, 4 * kept[t]);  // (data() may be null)
    pos += 4 * kept[t];
  }
  v.index();  // refuses a value listed twice
  return v;
}

}  // namespace fk::data
