// fusekit data preprocess against hand-worked vocabularies and against its spec (read the file,
// count the training days, map every record); the reference's day split; input across chunk
// boundaries and threads; gzip; malformed lines; damaged and mismatched shards refused.
#include <gtest/gtest.h>
#include <zlib.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "fusekit/core/error.hpp"
#include "fusekit/data/criteo.hpp"
#include "fusekit/data/preprocess.hpp"
#include "fusekit/data/vocabulary.hpp"
#include "test_util.hpp"

namespace fk::data {
namespace {

namespace fs = std::filesystem;

fs::path scratch(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("fusekit_preprocess_test_" + name);
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

// Record i: label i % 2, dense i, feature 0 the given value, every other feature i % 3.
std::vector<RawRecord> records_with_feature0(const std::vector<std::uint32_t>& values) {
  std::vector<RawRecord> out;
  for (std::size_t i = 0; i < values.size(); ++i) {
    RawRecord r;
    r.label = static_cast<std::int32_t>(i % 2);
    r.dense.fill(static_cast<std::int32_t>(i));
    r.sparse.fill(static_cast<std::uint32_t>(i % 3));
    r.sparse[0] = values[i];
    out.push_back(r);
  }
  return out;
}

std::vector<RawRecord> read_all(const RecordSource& s) {
  std::vector<RawRecord> out(static_cast<std::size_t>(s.size()));
  s.read(0, out);
  return out;
}

TEST(Preprocess, KaggleHandWorked) {
  // 15 records: 7 days of 3, 2, 2, 2, 2, 2, 2 (15 = 7 * 2 + 1); days 0-5 (records 0-12) train.
  // Feature 0 there: 0x50 five times, 0x20 three times, 0x30 twice, 0x40, 0x60 and 0x99 once.
  // Day 6 (records 13, 14): 0x40 and 0x77 (never seen in training).
  const std::vector<std::uint32_t> f0 = {0x50, 0x20, 0x50, 0x30, 0x20, 0x50, 0x40, 0x30, 0x20, 0x50, 0x60,
                                         0x50, 0x99, 0x40, 0x77};
  const fs::path dir = scratch("kaggle");
  write_tsv(dir / "in.tsv", records_with_feature0(f0));
  PreprocessOptions o{.inputs = {dir / "in.tsv"}, .out = dir / "out", .threads = 2};
  o.vocabulary.min_count = 2;
  const PreprocessReport rep = preprocess(o);
  EXPECT_EQ(rep.day_records, (std::vector<std::int64_t>{3, 2, 2, 2, 2, 2, 2}));
  EXPECT_EQ(rep.inputs.at(0).records, 15);

  const ShardSet s = open_shards(dir / "out");
  EXPECT_EQ(s.data_set, "kaggle");
  EXPECT_EQ(s.day_begin, (std::vector<std::int64_t>{0, 3, 5, 7, 9, 11, 13, 15}));
  EXPECT_EQ(s.train_end(), 13);
  EXPECT_EQ(s.test_begin(), 13);
  EXPECT_EQ(s.test_end(), 14);
  EXPECT_EQ(s.val_end(), 15);
  // Ids by decreasing count: 0x50 1, 0x20 2, 0x30 3; 0x40, 0x60 and 0x99 (once) are below the
  // threshold: the unknown id 0, as the test day's 0x77.
  const Vocabulary& v = *s.vocabulary;
  EXPECT_EQ(v.records(), 13);
  EXPECT_EQ(v.rows(0), 4);
  EXPECT_EQ(v.id(0, 0x50), 1u);
  EXPECT_EQ(v.id(0, 0x20), 2u);
  EXPECT_EQ(v.id(0, 0x30), 3u);
  const std::vector<RawRecord> got = read_all(*s.all());
  const std::vector<std::uint32_t> want_ids = {1, 2, 1, 3, 2, 1, 0, 3, 2, 1, 0, 1, 0, 0, 0};
  ASSERT_EQ(got.size(), 15u);
  for (std::size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].sparse[0], want_ids[i]) << "record " << i;
    EXPECT_EQ(got[i].label, static_cast<std::int32_t>(i % 2));
    EXPECT_EQ(got[i].dense[5], static_cast<std::int32_t>(i));
    // Feature 1 is i % 3 everywhere: 0 (5 times in days 0-5), 1 (4), 2 (4): ids 1, 2, 3.
    EXPECT_EQ(got[i].sparse[1], (i % 3) + 1);
  }
}

TEST(Preprocess, MaxIndRangeAppliesBeforeTheVocabulary) {
  // Modulo 16: 0x11 and 0x21 are both key 1; 0x05 is key 5.
  const fs::path dir = scratch("range");
  write_tsv(dir / "in.tsv", records_with_feature0({0x11, 0x21, 0x05, 0x11, 0x05, 0x21, 0x31, 0x05, 0x05, 0x05,
                                                   0x05, 0x05, 0x05, 0x05}));
  PreprocessOptions o{.inputs = {dir / "in.tsv"}, .out = dir / "out", .threads = 3};
  o.vocabulary.max_ind_range = 16;
  preprocess(o);
  const ShardSet s = open_shards(dir / "out");
  // Days of 2: training records 0-11. Key 5: 7 times (id 1), key 1: 5 times (id 2).
  EXPECT_EQ(s.vocabulary->rows(0), 3);
  const std::vector<RawRecord> got = read_all(*s.all());
  EXPECT_EQ(got[0].sparse[0], 2u);
  EXPECT_EQ(got[1].sparse[0], 2u);
  EXPECT_EQ(got[2].sparse[0], 1u);
  EXPECT_EQ(got[6].sparse[0], 2u);  // 0x31 % 16 = 1
}

TEST(Preprocess, TerabyteDaysCountOnlyTrainingDaysUnlessAskedTo) {
  const fs::path dir = scratch("terabyte");
  write_tsv(dir / "day_0.tsv", records_with_feature0({1, 2, 2}));
  write_tsv(dir / "day_1.tsv", records_with_feature0({3, 2}));
  write_tsv(dir / "day_2.tsv", records_with_feature0({4, 4, 4, 4, 1}));
  PreprocessOptions o{.inputs = {dir / "day_0.tsv", dir / "day_1.tsv", dir / "day_2.tsv"},
                      .out = dir / "out",
                      .data_set = "terabyte",
                      .threads = 2};
  PreprocessReport rep = preprocess(o);
  EXPECT_EQ(rep.day_records, (std::vector<std::int64_t>{3, 2, 5}));
  ShardSet s = open_shards(dir / "out");
  EXPECT_EQ(s.data_set, "terabyte");
  EXPECT_EQ(s.train_end(), 5);
  EXPECT_EQ(s.test_end(), 8);  // day 2's first half (3 of 5 records)
  EXPECT_EQ(s.vocabulary->records(), 5);
  EXPECT_EQ(s.vocabulary->id(0, 2), 1u);
  EXPECT_EQ(s.vocabulary->id(0, 4), 0u);  // only in the test day
  std::vector<RawRecord> got = read_all(*s.all());
  EXPECT_EQ(got[5].sparse[0], 0u);
  EXPECT_EQ(got[9].sparse[0], s.vocabulary->id(0, 1));

  o.vocabulary_all_days = true;
  preprocess(o);  // over the same directory: replaced
  s = open_shards(dir / "out");
  EXPECT_EQ(s.vocabulary->records(), 10);
  EXPECT_EQ(s.vocabulary->id(0, 4), 1u);  // four times
  got = read_all(*s.all());
  EXPECT_EQ(got[5].sparse[0], 1u);
}

// The spec: read the whole file, count the training days' values, map every record.
TEST(Preprocess, MatchesTheInMemorySpecAcrossChunksAndThreads) {
  const fs::path dir = scratch("spec");
  // ~11 MB of text: more than one 8 MiB chunk, so chunk boundaries and the ordered write run.
  SyntheticConfig sc;
  sc.seed = 11;
  const SyntheticCriteo gen(sc);
  std::vector<RawRecord> records(40001);
  gen.generate(0, records);
  write_tsv(dir / "in.tsv", records);
  // The same records gzip-compressed.
  {
    std::ifstream in(dir / "in.tsv", std::ios::binary);
    const std::string text((std::istreambuf_iterator<char>(in)), {});
    ASSERT_GT(text.size(), std::size_t{8} << 20);
    gzFile gz = gzopen((dir / "in.tsv.gz").c_str(), "wb");
    ASSERT_EQ(gzwrite(gz, text.data(), static_cast<unsigned>(text.size())), static_cast<int>(text.size()));
    gzclose(gz);
  }
  const VocabularyOptions vo{.max_ind_range = 1 << 20, .min_count = 2};
  const ReferenceSplit sp = kaggle_split(static_cast<std::int64_t>(records.size()));
  VocabularyCounter counter(vo);
  counter.add(std::span(records).first(static_cast<std::size_t>(sp.train_end)));
  const Vocabulary want = Vocabulary::build(counter);

  for (const char* input : {"in.tsv", "in.tsv.gz"})
    for (const int threads : {1, 3}) {
      SCOPED_TRACE(std::string(input) + ", threads " + std::to_string(threads));
      PreprocessOptions o{.inputs = {dir / input}, .out = dir / "out", .vocabulary = vo, .threads = threads};
      int calls = 0;
      o.progress = [&](const PreprocessProgress& p) {
        ++calls;
        EXPECT_LE(p.bytes, p.total_bytes);
      };
      preprocess(o);
      EXPECT_GE(calls, 3);  // at least each pass's end
      const ShardSet s = open_shards(dir / "out");
      EXPECT_EQ(*s.vocabulary, want);
      EXPECT_EQ(s.day_begin, sp.day_begin);
      const std::vector<RawRecord> got = read_all(*s.all());
      ASSERT_EQ(got.size(), records.size());
      for (std::size_t i = 0; i < got.size(); ++i) {
        RawRecord r = records[i];
        for (int t = 0; t < kNumSparse; ++t) r.sparse[static_cast<std::size_t>(t)] = want.id(t, r.sparse[static_cast<std::size_t>(t)]);
        ASSERT_EQ(std::memcmp(&got[i], &r, sizeof r), 0) << "record " << i;
      }
    }
}

TEST(Preprocess, MalformedLinesAreCountedOrRefusedByLine) {
  const fs::path dir = scratch("malformed");
  SyntheticConfig sc;
  const SyntheticCriteo gen(sc);
  std::vector<RawRecord> records(40000);
  gen.generate(0, records);
  write_tsv(dir / "good.tsv", records);
  // Line 35001, in the second chunk, loses a field; line 3 gets a bad label.
  {
    std::ifstream in(dir / "good.tsv");
    std::ofstream out(dir / "bad.tsv");
    std::string line;
    for (int n = 1; std::getline(in, line); ++n) {
      if (n == 35001) line = line.substr(0, line.rfind('\t'));
      if (n == 3) line[0] = '7';
      out << line << '\n';
    }
  }
  PreprocessOptions o{.inputs = {dir / "bad.tsv"}, .out = dir / "out", .threads = 3};
  const PreprocessReport rep = preprocess(o);
  EXPECT_EQ(rep.inputs.at(0).records, 39998);
  EXPECT_EQ(rep.inputs.at(0).malformed, 2);
  ASSERT_EQ(rep.inputs.at(0).first.size(), 2u);
  EXPECT_EQ(rep.inputs.at(0).first[0].line, 3);
  EXPECT_EQ(rep.inputs.at(0).first[1].line, 35001);
  EXPECT_EQ(rep.inputs.at(0).first[1].error, LineError::field_count);
  // Strict: an error naming the file and the line, from the second chunk's worker.
  {
    std::ifstream in(dir / "bad.tsv");
    std::ofstream out(dir / "bad2.tsv");
    std::string line;
    for (int n = 1; std::getline(in, line); ++n) out << (n == 3 ? "0" + line.substr(1) : line) << '\n';
  }
  o.inputs = {dir / "bad2.tsv"};
  o.strict = true;
  fk::test::expect_error_mentions([&] { preprocess(o); }, {"bad2.tsv", "line 35001", "field_count"});
  EXPECT_FALSE(is_shard_directory(dir / "out"));  // the old manifest went first
}

TEST(Preprocess, BadOptionsAreRefused) {
  const fs::path dir = scratch("options");
  write_tsv(dir / "a.tsv", records_with_feature0({1, 2, 3, 4, 5, 6, 7}));
  fk::test::expect_error_mentions([&] { preprocess({.out = dir / "out"}); }, {"inputs"});
  fk::test::expect_error_mentions([&] { preprocess({.inputs = {dir / "a.tsv", dir / "a.tsv"}, .out = dir / "out"}); },
                                  {"inputs", "kaggle"});
  fk::test::expect_error_mentions(
      [&] { preprocess({.inputs = {dir / "a.tsv"}, .out = dir / "out", .data_set = "terabyte"}); }, {"terabyte"});
  fk::test::expect_error_mentions([&] { preprocess({.inputs = {dir / "a.tsv"}, .out = dir / "out", .data_set = "x"}); },
                                  {"data_set"});
  fk::test::expect_error_mentions([&] { preprocess({.inputs = {dir / "missing.tsv"}, .out = dir / "out"}); },
                                  {"missing.tsv"});
  // An output path that is a file (the reference's .npz name, say).
  write_tsv(dir / "processed.npz", records_with_feature0({1}));
  fk::test::expect_error_mentions([&] { preprocess({.inputs = {dir / "a.tsv"}, .out = dir / "processed.npz"}); },
                                  {"out", "processed.npz", "a file"});
  // An input that is one of the outputs.
  fs::create_directories(dir / "out");
  write_tsv(dir / "out" / "day_3.bin", records_with_feature0({1, 2, 3, 4, 5, 6, 7}));
  fk::test::expect_error_mentions([&] { preprocess({.inputs = {dir / "out" / "day_3.bin"}, .out = dir / "out"}); },
                                  {"day_3.bin"});
}

class Shards : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = scratch("shards");
    write_tsv(dir_ / "in.tsv", records_with_feature0({1, 2, 2, 3, 3, 3, 4, 4, 4, 4, 5, 6, 7, 8}));
    preprocess({.inputs = {dir_ / "in.tsv"}, .out = dir_ / "out"});
    ASSERT_NO_THROW(open_shards(dir_ / "out"));
  }
  void flip(const fs::path& p, std::streamoff at) {
    std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(at);
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x10);
    f.seekp(at);
    f.write(&c, 1);
  }
  fs::path dir_;
};

TEST_F(Shards, ADamagedVocabularyIsRefused) {
  flip(dir_ / "out" / "vocabulary.fkv", 100);
  fk::test::expect_error_mentions([&] { open_shards(dir_ / "out"); }, {"vocabulary.fkv"});
}

TEST_F(Shards, AnotherVocabularyIsRefused) {
  // A valid vocabulary of other data in place of the shards' own.
  VocabularyCounter c;
  c.add(records_with_feature0({9, 9, 9}));
  Vocabulary::build(c).save(dir_ / "out" / "vocabulary.fkv");
  fk::test::expect_error_mentions([&] { open_shards(dir_ / "out"); }, {"vocabulary", "fingerprint"});
  // And through the caller's vocabulary.
  fk::test::expect_error_mentions(
      [&] { open_shards(dir_ / "out", std::make_shared<const Vocabulary>(Vocabulary::build(c))); },
      {"vocabulary", "fingerprint"});
}

TEST_F(Shards, ADayOfAnotherVocabularyOrSizeIsRefused) {
  // Raw values in place of day 2.
  write_binary(dir_ / "out" / "day_2.bin", records_with_feature0({1, 2}));
  fk::test::expect_error_mentions([&] { open_shards(dir_ / "out"); }, {"day_2.bin", "raw values"});
  write_binary(dir_ / "out" / "day_2.bin", records_with_feature0({1, 2}), {true, 0x1234});
  fk::test::expect_error_mentions([&] { open_shards(dir_ / "out"); }, {"day_2.bin", "00001234"});
}

TEST_F(Shards, ADamagedDayOrManifestIsRefused) {
  flip(dir_ / "out" / "day_1.bin", 64 + 20);  // a record: the block's CRC
  const ShardSet s = open_shards(dir_ / "out");
  std::vector<RawRecord> r(2);
  fk::test::expect_error_mentions([&] { s.days[1]->read(0, r); }, {"day_1.bin", "damaged"});
  flip(dir_ / "out" / "day_1.bin", 64 + 20);
  flip(dir_ / "out" / "day_4.bin", 40);  // the header's fingerprint: the header CRC
  fk::test::expect_error_mentions([&] { open_shards(dir_ / "out"); }, {"day_4.bin", "header"});
  flip(dir_ / "out" / "day_4.bin", 40);
  std::ofstream(dir_ / "out" / "manifest.json") << "{\"format\": \"other\"}";
  fk::test::expect_error_mentions([&] { open_shards(dir_ / "out"); }, {"manifest.json", "format"});
  std::ofstream(dir_ / "out" / "manifest.json") << "not json";
  fk::test::expect_error_mentions([&] { open_shards(dir_ / "out"); }, {"manifest.json"});
  fs::remove(dir_ / "out" / "manifest.json");
  fk::test::expect_error_mentions([&] { open_shards(dir_ / "out"); }, {"preprocess"});
}

TEST(ConcatSource, ReadsAcrossSourcesAndRefusesRangesOutside) {
  const auto a = memory_source(records_with_feature0({1, 2, 3}));
  const auto empty = memory_source({});
  const auto b = memory_source(records_with_feature0({4, 5}));
  const auto all = concat_source({a, empty, b});
  EXPECT_EQ(all->size(), 5);
  std::vector<RawRecord> r(3);
  all->read(2, r);
  EXPECT_EQ(r[0].sparse[0], 3u);
  EXPECT_EQ(r[1].sparse[0], 4u);
  EXPECT_EQ(r[2].sparse[0], 5u);
  fk::test::expect_error_mentions([&] { all->read(3, r); }, {"concat_source"});
  EXPECT_THROW(concat_source({a, nullptr}), Error);
}

TEST(OrderedSource, GathersFromMappedRecordsAsFromReadOnes) {
  // The same records in memory (gathered with prefetching) and generated on demand (read one run
  // at a time), in one random order.
  SyntheticConfig sc;
  sc.seed = 5;
  std::vector<RawRecord> records(5000);
  SyntheticCriteo(sc).generate(0, records);
  const std::vector<std::int64_t> order = training_order(std::vector<std::int64_t>{0, 5000}, "total", 9);
  const auto mapped = ordered_source(memory_source(records), order);
  const auto generated = ordered_source(synthetic_source(sc, 5000), order);
  ASSERT_NE(memory_source(records)->mapped(0), nullptr);
  ASSERT_EQ(synthetic_source(sc, 5000)->mapped(0), nullptr);
  std::vector<RawRecord> a(4321), b(4321);
  mapped->read(77, a);
  generated->read(77, b);
  for (std::size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(std::memcmp(&a[i], &b[i], sizeof(RawRecord)), 0) << i;
    ASSERT_EQ(std::memcmp(&a[i], &records[static_cast<std::size_t>(order[77 + i])], sizeof(RawRecord)), 0) << i;
  }
}

TEST(Featurizer, DenseTransformIsLog1pOfTheClampedCount) {
  for (const std::int32_t x : {-5, -1, 0, 1, 2, 7, 4095, 4096, 4097, 123456, 2147483647})
    EXPECT_EQ(Featurizer::dense_transform(x), std::log1p(static_cast<float>(std::max(x, 0)))) << x;
}

TEST(Featurizer, PremappedIdsAreCheckedAgainstTheirTables) {
  VocabularyCounter c;
  c.add(records_with_feature0({5, 6}));
  Featurizer f;
  f.vocabulary = std::make_shared<const Vocabulary>(Vocabulary::build(c));
  f.hash = HashMode::reference;
  f.premapped = true;
  EXPECT_EQ(f.hash_index(0, 2), 2);  // ids 0-2 in a 3-row table
  fk::test::expect_error_mentions([&] { f.hash_index(0, 3); }, {"ids", "3"});
  f.vocabulary = nullptr;
  EXPECT_THROW(f.validate(), Error);
}

}  // namespace
}  // namespace fk::data
