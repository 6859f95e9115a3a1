// A vocabulary per Criteo categorical feature: each raw 32-bit value the training data holds
// becomes a dense id, as the DLRM reference's data preparation maps values through a dictionary
// per feature (instead of taking the raw value modulo a table size, where distinct values
// collide). Options:
//   max_ind_range > 0   the raw value is taken modulo it first (the reference's --max-ind-range),
//                       at counting and at lookup alike;
//   min_count           values seen fewer times share the unknown id (the frequency threshold of
//                       TorchRec's and NVTabular's Criteo pipelines); 1 keeps every value.
// Ids: 0 is the unknown id (a value below the threshold, or first seen after the vocabulary was
// built); the kept values get 1, 2, ... in order of decreasing count, ties by smaller value, so
// the ids of a data set do not depend on its record order or on how counting was split across
// threads. A feature's embedding table has rows(feature) = 1 + kept(feature) rows.
//
// File (little-endian): "FKVOCAB1", u32 version 1, u32 26, i64 max_ind_range, i64 min_count,
// i64 records counted, u64 kept[26], then per feature its kept values as u32 in id order, then
// the CRC-32 of all the bytes before it. The CRC is the vocabulary's fingerprint, which data
// prepared with it records so that training can refuse a mismatch.
#pragma once

#include <array>
#include <cstdint>
#include <filesystem>
#include <span>
#include <unordered_map>
#include <vector>

#include "fusekit/data/criteo.hpp"

namespace fk::data {

struct VocabularyOptions {
  std::int64_t max_ind_range = 0;  // > 0: raw value % max_ind_range before counting and lookup
  std::int64_t min_count = 1;      // >= 1: values seen fewer times map to the unknown id

  // Throws fk::Error naming the option unless min_count >= 1 and max_ind_range < 2^32.
  void validate() const;
  std::uint32_t key(std::uint32_t raw) const noexcept {
    return max_ind_range > 0 ? static_cast<std::uint32_t>(raw % static_cast<std::uint64_t>(max_ind_range)) : raw;
  }
};

// Counts every feature's values over training records. Counters filled on separate threads
// merge into one; the vocabulary built from them is the same as from one counter. A feature's
// counts live in a hash map; with max_ind_range > 0 they move to an array of max_ind_range u32
// counts once the map holds more than max_ind_range / 10 keys, so that a feature never takes
// more than about 4 * max_ind_range bytes however many records are counted (counts saturate at
// 2^32 - 1: values seen more than 4.29 billion times then order among themselves by value).
class VocabularyCounter {
 public:
  explicit VocabularyCounter(VocabularyOptions options = {});
  // Counts the records' values; `threads` > 1 splits the features among that many threads (one
  // counter's memory, whatever the thread count).
  void add(std::span<const RawRecord> records, int threads = 1);
  // The two halves of add(), for callers that schedule the features themselves: counts one
  // feature's values (calls for distinct features may run concurrently), and the records count.
  void add_feature(int feature, std::span<const RawRecord> records);
  void add_records(std::int64_t n);
  // Throws fk::Error unless `other` has the same options.
  void merge(const VocabularyCounter& other);
  const VocabularyOptions& options() const noexcept { return options_; }
  std::int64_t records() const noexcept { return records_; }
  // Distinct keys of a feature so far (before the threshold).
  std::int64_t distinct(int feature) const;

 private:
  friend class Vocabulary;
  void make_dense(int feature);  // the feature's counts from the map into dense_
  VocabularyOptions options_;
  std::int64_t records_ = 0;
  std::array<std::unordered_map<std::uint32_t, std::int64_t>, kNumSparse> counts_;
  std::array<std::vector<std::uint32_t>, kNumSparse> dense_;  // when not empty: the counts by key
};

class Vocabulary {
 public:
  Vocabulary() = default;
  static Vocabulary build(const VocabularyCounter& counter);
  // The same, giving each feature's counts back as it goes (the counter is left empty): the
  // counts and the vocabulary are never both whole in memory.
  static Vocabulary build(VocabularyCounter&& counter);

  const VocabularyOptions& options() const noexcept { return options_; }
  std::int64_t records() const noexcept { return records_; }  // records it was counted from
  std::int64_t kept(int feature) const;                       // values with an id of their own
  std::int64_t rows(int feature) const { return kept(feature) + 1; }
  std::vector<std::int64_t> table_rows() const;
  // The id of a raw value of a feature (0 when unknown).
  std::uint32_t id(int feature, std::uint32_t raw) const;
  // The key (raw value after max_ind_range) that has id `id` >= 1.
  std::uint32_t key_of(int feature, std::uint32_t id) const;
  std::uint32_t fingerprint() const noexcept { return fingerprint_; }

  // Written through a temporary file renamed into place.
  void save(const std::filesystem::path& path) const;
  // Throws fk::Error naming the file for a missing file, another format or version, a size that
  // disagrees with the header, or a CRC mismatch.
  static Vocabulary load(const std::filesystem::path& path);
  static Vocabulary parse(std::span<const std::byte> bytes, const std::string& what = "vocabulary");

  friend bool operator==(const Vocabulary& a, const Vocabulary& b) {
    return a.fingerprint_ == b.fingerprint_ && a.by_id_ == b.by_id_;
  }

 private:
  void index();  // the lookups from by_id_ (checked: no value twice, each below max_ind_range), the fingerprint
  std::vector<std::byte> serialize() const;
  VocabularyOptions options_;
  std::int64_t records_ = 0;
  std::array<std::vector<std::uint32_t>, kNumSparse> by_id_;   // key of id i + 1
  // A feature's lookup: a hash table (key << 32 | id, 0 empty), or, under max_ind_range where that
  // is smaller, the id of every key below it (0 unknown).
  std::array<std::vector<std::uint64_t>, kNumSparse> slots_;
  std::array<std::vector<std::uint32_t>, kNumSparse> id_of_key_;
  std::array<int, kNumSparse> shift_{};
  std::uint32_t fingerprint_ = 0;
};

}  // namespace fk::data
