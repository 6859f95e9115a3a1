// Vocabularies against hand-worked cases: ids by count then value, the threshold, unknown values,
// max_ind_range; counters merged; the file refused when damaged; the featurizer and batches.
#include <gtest/gtest.h>

#include <filesystem>
#include <limits>
#include <fstream>
#include <vector>

#include "fusekit/data/criteo.hpp"
#include "fusekit/data/vocabulary.hpp"
#include "fusekit/ops/recsys.hpp"  // reference::hash_row
#include "test_util.hpp"

namespace fk::data {
namespace {

// Records whose feature 0 takes the given values and every other feature the value 7.
std::vector<RawRecord> feature0(std::initializer_list<std::uint32_t> values) {
  std::vector<RawRecord> out;
  for (const std::uint32_t v : values) {
    RawRecord r;
    r.sparse.fill(7);
    r.sparse[0] = v;
    out.push_back(r);
  }
  return out;
}

Vocabulary build(const std::vector<RawRecord>& records, VocabularyOptions options = {}) {
  VocabularyCounter c(options);
  c.add(records);
  return Vocabulary::build(c);
}

TEST(Vocabulary, IdsByDecreasingCountThenValue) {
  // 9 three times, 5 and 2 twice each (tie: 2 first), 11 once.
  const Vocabulary v = build(feature0({5, 9, 2, 9, 11, 5, 9, 2}));
  EXPECT_EQ(v.records(), 8);
  EXPECT_EQ(v.kept(0), 4);
  EXPECT_EQ(v.rows(0), 5);
  EXPECT_EQ(v.id(0, 9), 1u);
  EXPECT_EQ(v.id(0, 2), 2u);
  EXPECT_EQ(v.id(0, 5), 3u);
  EXPECT_EQ(v.id(0, 11), 4u);
  EXPECT_EQ(v.id(0, 12), 0u);  // never seen: the unknown id
  EXPECT_EQ(v.key_of(0, 3), 5u);
  EXPECT_THROW(v.key_of(0, 0), Error);
  EXPECT_THROW(v.key_of(0, 5), Error);
  EXPECT_EQ(v.kept(1), 1);  // every record's 7
  EXPECT_EQ(v.id(1, 7), 1u);
  EXPECT_EQ(v.table_rows().size(), 26u);
}

TEST(Vocabulary, ValuesBelowTheThresholdShareTheUnknownId) {
  const Vocabulary v = build(feature0({5, 9, 2, 9, 11, 5, 9, 2}), {.max_ind_range = 0, .min_count = 2});
  EXPECT_EQ(v.kept(0), 3);
  EXPECT_EQ(v.id(0, 9), 1u);
  EXPECT_EQ(v.id(0, 2), 2u);
  EXPECT_EQ(v.id(0, 5), 3u);
  EXPECT_EQ(v.id(0, 11), 0u);  // seen once
  EXPECT_EQ(build(feature0({1, 2}), {.max_ind_range = 0, .min_count = 3}).rows(0), 1);  // only the unknown row
}

TEST(Vocabulary, MaxIndRangeFoldsValuesBeforeCounting) {
  // Range 4: 5 and 9 are both key 1 (count 2), 6 is key 2, 4 is key 0.
  const Vocabulary v = build(feature0({5, 9, 6, 4}), {.max_ind_range = 4, .min_count = 1});
  EXPECT_EQ(v.kept(0), 3);
  EXPECT_EQ(v.id(0, 5), 1u);
  EXPECT_EQ(v.id(0, 13), 1u);  // 13 % 4 = 1: the same key at lookup
  EXPECT_EQ(v.id(0, 4), 2u);   // keys 0 and 2 tie at one: 0 first
  EXPECT_EQ(v.id(0, 6), 3u);
  EXPECT_EQ(v.id(0, 7), 0u);   // key 3, never seen
  EXPECT_EQ(v.key_of(0, 1), 1u);
}

TEST(Vocabulary, MergedCountersBuildTheSameVocabulary) {
  const std::vector<RawRecord> all = feature0({5, 9, 2, 9, 11, 5, 9, 2, 3, 3, 3, 3});
  VocabularyCounter a, b;
  a.add(std::span(all).first(5));
  b.add(std::span(all).subspan(5));
  a.merge(b);
  EXPECT_EQ(a.records(), 12);
  EXPECT_EQ(a.distinct(0), 5);
  const Vocabulary merged = Vocabulary::build(a);
  EXPECT_EQ(merged, build(all));
  EXPECT_EQ(merged.id(0, 3), 1u);
  VocabularyCounter other({.max_ind_range = 10, .min_count = 1});
  EXPECT_THROW(a.merge(other), Error);
}

TEST(Vocabulary, CountsMoveToAnArrayUnderMaxIndRangeWithTheSameIds) {
  // max_ind_range 64: feature 0 switches to 64 dense counts past 6 distinct keys; feature 1 (the
  // value 7 only) stays a map. Key k (0..19) appears k % 5 + 1 times; 70 is key 6 once more.
  std::vector<std::uint32_t> values;
  for (std::uint32_t k = 0; k < 20; ++k)
    for (std::uint32_t i = 0; i <= k % 5; ++i) values.push_back(k);
  values.push_back(70);
  std::vector<RawRecord> all;
  for (const std::uint32_t v : values) all.push_back(feature0({v})[0]);
  const VocabularyOptions o{.max_ind_range = 64, .min_count = 2};
  VocabularyCounter one(o);
  one.add(std::span(all).first(20));  // keys 0-7: past 6 keys, the array from here on
  one.add(std::span(all).subspan(20));
  EXPECT_EQ(one.distinct(0), 20);
  EXPECT_EQ(one.distinct(1), 1);
  const Vocabulary v = Vocabulary::build(one);
  // Counts: five times 4, 9, 14, 19; four times 3, 8, 13, 18; three times 2, 7, 12, 17 and key 6
  // (twice, and 70 % 64); twice 1, 11, 16; once 0, 5, 10, 15, below min_count.
  const std::vector<std::uint32_t> want = {4, 9, 14, 19, 3, 8, 13, 18, 2, 6, 7, 12, 17, 1, 11, 16};
  ASSERT_EQ(v.kept(0), static_cast<std::int64_t>(want.size()));
  for (std::size_t i = 0; i < want.size(); ++i) EXPECT_EQ(v.key_of(0, static_cast<std::uint32_t>(i + 1)), want[i]) << i;
  EXPECT_EQ(v.id(0, 0), 0u);
  EXPECT_EQ(v.id(0, 70), v.id(0, 6));
  // Merging a map counter and an array counter, either way round, gives the same vocabulary.
  VocabularyCounter small(o), big(o);
  small.add(std::span(all).first(5));  // keys 0-2: a map
  big.add(std::span(all).subspan(5));  // an array
  VocabularyCounter a = small, b = big;
  a.merge(big);
  b.merge(small);
  EXPECT_EQ(Vocabulary::build(a), v);
  EXPECT_EQ(Vocabulary::build(b), v);
  EXPECT_EQ(a.distinct(0), 20);
}

TEST(Vocabulary, BothLookupsGiveEveryRawValueItsId) {
  // max_ind_range 1000: 10 kept keys take a hash table (16 slots, 128 bytes), 900 an array of
  // 1000 ids (4000 bytes against 2048 slots). Every raw value in [0, 3000) gets the id of its key
  // raw % 1000, or 0 when that key was not kept.
  for (const std::uint32_t distinct : {10u, 900u}) {
    SCOPED_TRACE(distinct);
    std::vector<RawRecord> records;
    for (std::uint32_t k = 0; k < distinct; ++k)
      for (std::uint32_t i = 0; i <= k % 3; ++i) records.push_back(feature0({k * 7 % 1000 + 1000 * i})[0]);
    VocabularyCounter c({.max_ind_range = 1000, .min_count = 1});
    c.add(records);
    const Vocabulary v = Vocabulary::build(c);
    ASSERT_EQ(v.kept(0), distinct);
    std::vector<std::uint32_t> want(1000, 0);
    for (std::uint32_t id = 1; id <= distinct; ++id) want[v.key_of(0, id)] = id;
    for (std::uint32_t raw = 0; raw < 3000; ++raw) ASSERT_EQ(v.id(0, raw), want[raw % 1000]) << raw;
    // Built from the counter given up: the same vocabulary, and the counter left empty.
    EXPECT_EQ(Vocabulary::build(std::move(c)), v);
    EXPECT_EQ(c.distinct(0), 0);
    EXPECT_EQ(c.records(), 0);
  }
}

TEST(Vocabulary, AMaxIndRangeBelowOneIsNone) {
  // Keys 5, 6, 7 once each: a hash table of 4 slots, whatever max_ind_range <= 0 says.
  const std::vector<RawRecord> records = feature0({5, 6, 7});
  const Vocabulary none = build(records);
  for (const std::int64_t r : {std::int64_t{-1}, -(std::int64_t{1} << 62), std::numeric_limits<std::int64_t>::min()}) {
    const Vocabulary v = build(records, {.max_ind_range = r, .min_count = 1});
    for (std::uint32_t raw = 0; raw < 10; ++raw) EXPECT_EQ(v.id(0, raw), none.id(0, raw)) << r << " " << raw;
  }
}

TEST(Vocabulary, OptionsAreChecked) {
  EXPECT_THROW(VocabularyCounter({.max_ind_range = 0, .min_count = 0}), Error);
  EXPECT_THROW(VocabularyCounter({.max_ind_range = std::int64_t{1} << 32, .min_count = 1}), Error);
}

TEST(Vocabulary, FileRoundTripsAndEveryDamageIsRefused) {
  const Vocabulary v = build(feature0({5, 9, 2, 9, 11, 5, 9, 2}), {.max_ind_range = 1000, .min_count = 1});
  const auto path = std::filesystem::temp_directory_path() / "fusekit_vocabulary_test.fkv";
  v.save(path);
  const Vocabulary back = Vocabulary::load(path);
  EXPECT_EQ(back, v);
  EXPECT_EQ(back.fingerprint(), v.fingerprint());
  EXPECT_EQ(back.options().max_ind_range, 1000);
  EXPECT_EQ(back.id(0, 1011), v.id(0, 11));
  std::ifstream f(path, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::filesystem::remove(path);
  const auto parse = [](const std::vector<char>& b) { return Vocabulary::parse(std::as_bytes(std::span(b)), "t"); };
  EXPECT_EQ(parse(bytes), v);
  for (std::size_t i = 0; i < bytes.size(); ++i) {  // every flipped bit of every byte
    for (int bit = 0; bit < 8; ++bit) {
      std::vector<char> d = bytes;
      d[i] = static_cast<char>(d[i] ^ (1 << bit));
      EXPECT_THROW(parse(d), Error) << "byte " << i << " bit " << bit;
    }
  }
  for (const std::size_t n : {std::size_t{0}, std::size_t{7}, std::size_t{40}, bytes.size() - 1}) {
    EXPECT_THROW(parse(std::vector<char>(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(n))), Error);
  }
  std::vector<char> longer = bytes;
  longer.push_back(0);
  EXPECT_THROW(parse(longer), Error);
  EXPECT_THROW(Vocabulary::load("/nonexistent/vocabulary.fkv"), Error);
  // A feature with no kept value (the fuzzer's first finding: a copy into an empty vector's null
  // data, undefined even for zero bytes).
  const Vocabulary empty0 = build(feature0({1, 2}), {.max_ind_range = 0, .min_count = 3});
  empty0.save(path);
  EXPECT_EQ(Vocabulary::load(path), empty0);
  EXPECT_EQ(Vocabulary::load(path).rows(0), 1);
  std::filesystem::remove(path);
}

TEST(Vocabulary, TheFeaturizerAndBatchesUseTheIds) {
  auto v = std::make_shared<const Vocabulary>(build(feature0({5, 9, 9})));
  Featurizer f;
  f.vocabulary = v;
  EXPECT_THROW(f.validate(), Error);  // the seed hash would shift the ids
  f.hash = HashMode::reference;
  f.validate();
  EXPECT_EQ(f.rows(0), 3);
  EXPECT_EQ(f.rows(1), 2);
  EXPECT_EQ(f.hash_index(0, 9), 1);
  EXPECT_EQ(f.hash_index(0, 5), 2);
  EXPECT_EQ(f.hash_index(0, 4), 0);
  const std::vector<RawRecord> recs = feature0({4, 5, 9});
  Batch b;
  make_batch(recs, f, b);
  const auto* idx = b.indices.data_as<std::int64_t>();
  const auto* raw = static_cast<const std::uint32_t*>(b.raw_sparse.data());
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(idx[i], f.hash_index(0, recs[static_cast<std::size_t>(i)].sparse[0]));
    // The raw path hashes raw_sparse by v % rows in the kernel: the id must come through it as is.
    EXPECT_EQ(reference::hash_row(raw[i], f.rows(0), HashMode::reference), idx[i]);
  }
}

}  // namespace
}  // namespace fk::data
