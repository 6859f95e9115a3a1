// Criteo data: the TSV reader on a fixture holding every kind of malformed line, the hash and
// the dense transform against hand-worked values, gzip input, synthetic data (determinism, label
// rate, learnable signal), and TSV -> binary -> batches round trips through the loader.
#include <gtest/gtest.h>
#include <zlib.h>
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <cstring>
#include <map>
#include <memory>
#include <set>

#include "fusekit/data/criteo.hpp"
#include "fusekit/core/error.hpp"
#include "test_util.hpp"

namespace fk::data {
namespace {

namespace fs = std::filesystem;

const fs::path kFixture = fs::path(FK_TEST_DATA_DIR) / "criteo_malformed.tsv";

fs::path temp_path(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / "fusekit_data_test";
  fs::create_directories(dir);
  return dir / name;
}

TEST(CriteoParse, HandWorkedLine) {
  RawRecord r;
  std::string line = "1\t5\t-3\t\t0\t1\t2\t3\t4\t5\t6\t7\t8\t9\t68fd1e64\t80E26C9B";
  for (int t = 2; t < kNumSparse; ++t) line += t == 5 ? "\t" : "\tff";
  ASSERT_FALSE(parse_line(line, r).has_value());
  EXPECT_EQ(r.label, 1);
  EXPECT_EQ(r.dense[0], 5);
  EXPECT_EQ(r.dense[1], -3);
  EXPECT_EQ(r.dense[2], 0);  // empty
  EXPECT_EQ(r.sparse[0], 0x68fd1e64u);
  EXPECT_EQ(r.sparse[1], 0x80e26c9bu);  // upper-case hex
  EXPECT_EQ(r.sparse[5], 0u);           // empty
  EXPECT_EQ(r.sparse[25], 0xffu);
}

TEST(CriteoParse, EachKindOfError) {
  RawRecord r;
  const std::string good_tail = [] {
    std::string s;
    for (int j = 0; j < kNumDense; ++j) s += "\t1";
    for (int t = 0; t < kNumSparse; ++t) s += "\ta";
    return s;
  }();
  EXPECT_FALSE(parse_line("0" + good_tail, r).has_value());
  EXPECT_FALSE(parse_line("0" + good_tail + "\r", r).has_value());
  auto error_of = [&](const std::string& line) { return parse_line(line, r).value().error; };
  EXPECT_EQ(error_of("0" + good_tail + "\t1"), LineError::field_count);
  // The count of a line with too many fields is its own (it was reported as 40).
  EXPECT_EQ(parse_line("0" + good_tail + "\t1", r).value().field, 41);
  EXPECT_EQ(parse_line("0" + good_tail + "\t1\t\t", r).value().field, 43);
  EXPECT_EQ(error_of("0"), LineError::field_count);
  EXPECT_EQ(error_of(""), LineError::field_count);
  EXPECT_EQ(error_of("x" + good_tail), LineError::bad_label);
  EXPECT_EQ(error_of("-1" + good_tail), LineError::bad_label);
  EXPECT_EQ(error_of("0\t1.5" + good_tail.substr(2)), LineError::bad_integer);
  EXPECT_EQ(error_of("0\t3000000000" + good_tail.substr(2)), LineError::bad_integer);  // > int32
  EXPECT_EQ(error_of("0\t+3" + good_tail.substr(2)), LineError::bad_integer);
  std::string hex_bad = "0" + good_tail;
  hex_bad.back() = 'g';
  EXPECT_EQ(error_of(hex_bad), LineError::bad_hex);
  EXPECT_EQ(error_of(hex_bad.substr(0, hex_bad.size() - 1) + "0x1"), LineError::bad_hex);
  EXPECT_EQ(error_of(hex_bad.substr(0, hex_bad.size() - 1) + "123456789"), LineError::bad_hex);  // > 32 bits
  const auto issue = parse_line(hex_bad, r).value();
  EXPECT_EQ(issue.field, 39);
}

TEST(CriteoFeaturize, HashAndDenseTransformHandWorked) {
  Featurizer f;  // Kaggle cardinalities: table 0 has 1460 rows, table 1 583
  // 0x68fd1e64 = 1761418852: (v + 1) % 1460 = 393, v % 1460 = 392.
  EXPECT_EQ(f.hash_index(0, 0x68fd1e64u), 393);
  f.hash = HashMode::reference;
  EXPECT_EQ(f.hash_index(0, 0x68fd1e64u), 392);
  // 0x80e26c9b = 2162322587 (>= 2^31): % 583 = 73.
  EXPECT_EQ(f.hash_index(1, 0x80e26c9bu), 73);
  // The largest value: (2^32 - 1 + 1) % 3 = 2^32 % 3 = 1 (no 32-bit overflow).
  f.hash = HashMode::seed;
  EXPECT_EQ(f.hash_index(8, 0xffffffffu), 1);
  // max_ind_range caps the tables: table 2 (10131227 rows) becomes 1000 rows, table 0 stays.
  f.max_ind_range = 1000;
  EXPECT_EQ(f.rows(2), 1000);
  EXPECT_EQ(f.rows(0), 1000);
  EXPECT_EQ(f.rows(8), 3);
  EXPECT_EQ(f.hash_index(0, 0x68fd1e64u), 853);  // 1761418853 % 1000
  EXPECT_FLOAT_EQ(Featurizer::dense_transform(0), 0.0f);
  EXPECT_FLOAT_EQ(Featurizer::dense_transform(-3), 0.0f);
  EXPECT_FLOAT_EQ(Featurizer::dense_transform(5), 1.7917595f);   // log 6
  EXPECT_FLOAT_EQ(Featurizer::dense_transform(9), 2.3025851f);   // log 10
  EXPECT_EQ(parse_hash_mode("reference"), HashMode::reference);
  Featurizer bad;
  bad.cardinalities[7] = 0;
  EXPECT_THROW(bad.validate(), Error);
  bad.cardinalities.pop_back();
  EXPECT_THROW(bad.validate(), Error);
  EXPECT_THROW(parse_hash_mode("md5"), Error);
}

TEST(CriteoReader, FixtureLenientCountsEveryMalformedLine) {
  ReadReport rep;
  const std::vector<RawRecord> recs = read_tsv(kFixture, {}, rep);
  // 14 lines: 3 good (1, 9, 14), 2 empty (8, 11), 9 malformed.
  EXPECT_EQ(rep.lines, 14);
  ASSERT_EQ(rep.records, 3);
  ASSERT_EQ(recs.size(), 3u);
  EXPECT_EQ(rep.malformed, 9);
  EXPECT_EQ(rep.by_error[static_cast<int>(LineError::field_count)], 2);
  EXPECT_EQ(rep.by_error[static_cast<int>(LineError::bad_label)], 2);
  EXPECT_EQ(rep.by_error[static_cast<int>(LineError::bad_integer)], 3);
  EXPECT_EQ(rep.by_error[static_cast<int>(LineError::bad_hex)], 2);
  std::vector<std::int64_t> lines;
  for (const auto& e : rep.first) lines.push_back(e.line);
  EXPECT_EQ(lines, (std::vector<std::int64_t>{2, 3, 4, 5, 6, 7, 10, 12, 13}));
  EXPECT_EQ(rep.first[4].error, LineError::bad_hex);
  EXPECT_EQ(rep.first[4].field, 20);
  EXPECT_NE(rep.summary().find("line 10: bad_integer in field 13"), std::string::npos) << rep.summary();
  // Line 1, hand-worked; line 9 (CRLF, every field empty) reads as zeros.
  EXPECT_EQ(recs[0].label, 0);
  EXPECT_EQ(recs[0].dense[1], -3);
  EXPECT_EQ(recs[0].sparse[0], 0x68fd1e64u);
  EXPECT_EQ(recs[0].sparse[21], 0u);
  EXPECT_EQ(recs[1].label, 1);
  EXPECT_TRUE(std::all_of(recs[1].dense.begin(), recs[1].dense.end(), [](int x) { return x == 0; }));
  EXPECT_TRUE(std::all_of(recs[1].sparse.begin(), recs[1].sparse.end(), [](std::uint32_t x) { return x == 0; }));
}

TEST(CriteoReader, ConvertingTheFixtureKeepsTheGoodRecordsOnly) {
  const fs::path bin = temp_path("fixture.bin");
  const ReadReport rep = convert_tsv_to_binary(kFixture, bin, {});
  EXPECT_EQ(rep.records, 3);
  EXPECT_EQ(rep.malformed, 9);
  auto source = binary_source(bin);
  ASSERT_EQ(source->size(), 3);
  std::vector<RawRecord> recs(3);
  source->read(0, recs);
  EXPECT_EQ(recs[0].sparse[0], 0x68fd1e64u);
  EXPECT_EQ(recs[2].label, 1);
  EXPECT_THROW(convert_tsv_to_binary(kFixture, temp_path("strict.bin"), {.strict = true}), Error);
  EXPECT_FALSE(fs::exists(temp_path("strict.bin")));  // nothing half-written
  EXPECT_FALSE(fs::exists(temp_path("strict.bin.tmp")));
}

TEST(CriteoReader, FixtureStrictThrowsAtTheFirstMalformedLine) {
  ReadReport rep;
  try {
    read_tsv(kFixture, {.strict = true}, rep);
    FAIL() << "no error in strict mode";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("line 2: field_count (39 fields, expected 40)"), std::string::npos) << e.what();
  }
  EXPECT_THROW(read_tsv(temp_path("does_not_exist.tsv"), {}, rep), Error);
}

// The fixture, gzip-compressed, at `gz`.
void write_fixture_gzip(const fs::path& gz) {
  std::ifstream in(kFixture, std::ios::binary);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  gzFile f = gzopen(gz.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(gzwrite(f, text.data(), static_cast<unsigned>(text.size())), static_cast<int>(text.size()));
  gzclose(f);
}

TEST(CriteoReader, GzipInputReadsLikeThePlainFile) {
  const fs::path gz = temp_path("fixture.tsv.gz");
  write_fixture_gzip(gz);
  ReadReport plain, zipped;
  const auto a = read_tsv(kFixture, {}, plain);
  const auto b = read_tsv(gz, {}, zipped);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(plain.summary(), zipped.summary());
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_EQ(std::memcmp(&a[i], &b[i], sizeof(RawRecord)), 0);
}

TEST(CriteoReader, TruncatedOrCorruptGzipIsAnErrorEvenWithoutStrict) {
  // Used to be read as a short file: "0 malformed", the last field cut short, exit 0.
  const fs::path gz = temp_path("whole.tsv.gz");
  write_fixture_gzip(gz);
  std::ifstream zin(gz, std::ios::binary);
  std::string zipped((std::istreambuf_iterator<char>(zin)), std::istreambuf_iterator<char>());
  const auto write = [](const fs::path& p, const std::string& bytes) {
    std::ofstream out(p, std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  };
  const fs::path cut = temp_path("cut.tsv.gz"), bad = temp_path("corrupt.tsv.gz");
  write(cut, zipped.substr(0, zipped.size() / 2));
  std::string flipped = zipped;
  flipped[flipped.size() / 2] = static_cast<char>(flipped[flipped.size() / 2] ^ 0x5a);
  write(bad, flipped);
  for (const fs::path& p : {cut, bad}) {
    ReadReport rep;
    try {
      (void)read_tsv(p, {}, rep);
      ADD_FAILURE() << "no error for " << p;
    } catch (const Error& e) {
      EXPECT_EQ(e.arg(), "path") << e.what();
      EXPECT_NE(std::string(e.what()).find(p.string()), std::string::npos) << e.what();
    }
  }
}

SyntheticConfig small_synthetic() {
  SyntheticConfig c;
  c.seed = 11;
  return c;
}

// The first n records of the small synthetic data set.
std::vector<RawRecord> synthetic_records(std::size_t n) {
  std::vector<RawRecord> recs(n);
  SyntheticCriteo(small_synthetic()).generate(0, recs);
  return recs;
}

TEST(Synthetic, DeterministicFromTheSeedAndRandomAccess) {
  const SyntheticCriteo a(small_synthetic()), b(small_synthetic());
  SyntheticConfig other = small_synthetic();
  other.seed = 12;
  const SyntheticCriteo c(other);
  std::vector<RawRecord> block(64);
  a.generate(1000, block);
  int differ = 0;
  for (int i = 0; i < 64; ++i) {
    const RawRecord r = b.record(1000 + i);
    EXPECT_EQ(std::memcmp(&r, &block[static_cast<std::size_t>(i)], sizeof r), 0) << i;
    const RawRecord s = c.record(1000 + i);
    differ += std::memcmp(&r, &s, sizeof r) != 0;
  }
  EXPECT_EQ(differ, 64);
}

// Area under the ROC curve by counting pairs (test-local, independent of the metrics code).
double pair_auc(const std::vector<double>& score, const std::vector<int>& label) {
  double num = 0, pairs = 0;
  for (std::size_t i = 0; i < score.size(); ++i)
    if (label[i])
      for (std::size_t j = 0; j < score.size(); ++j)
        if (!label[j]) {
          num += score[i] > score[j] ? 1.0 : score[i] == score[j] ? 0.5 : 0.0;
          pairs += 1;
        }
  return num / pairs;
}

TEST(Synthetic, CriteoLikeStatisticsAndALearnableLabel) {
  const SyntheticCriteo gen(small_synthetic());
  const int n = 4000;
  std::vector<double> logit(n);
  std::vector<int> label(n);
  std::int64_t positives = 0, empty_dense = 0, negative = 0;
  std::set<std::uint32_t> distinct_small, distinct_large;
  std::int64_t head_large = 0;
  std::map<std::uint32_t, int> counts_large;
  for (int i = 0; i < n; ++i) {
    const RawRecord r = gen.record(i);
    label[i] = r.label;
    logit[i] = gen.hidden_logit(i);
    positives += r.label;
    for (int x : r.dense) {
      empty_dense += x == 0;
      negative += x < 0;
    }
    distinct_small.insert(r.sparse[8]);  // 3 categories
    ++counts_large[r.sparse[2]];         // 10M categories
  }
  for (const auto& [v, c] : counts_large) head_large = std::max<std::int64_t>(head_large, c);
  EXPECT_NEAR(static_cast<double>(positives) / n, 0.25, 0.03);
  EXPECT_EQ(distinct_small.size(), 3u);
  // Zipf-like: the most frequent of 10M categories is seen many times, yet most are rare.
  EXPECT_GT(head_large, n / 50);
  EXPECT_GT(counts_large.size(), static_cast<std::size_t>(n / 4));
  EXPECT_GT(negative, 0);
  EXPECT_GT(empty_dense, 0);
  // The hidden logit ranks the labels well: a model has something to learn.
  EXPECT_GT(pair_auc(logit, label), 0.8);
}

TEST(BinaryFormat, TsvToBinaryToBatchesRoundTrip) {
  const std::vector<RawRecord> recs = synthetic_records(1000);
  const fs::path tsv = temp_path("synthetic.tsv"), bin = temp_path("synthetic.bin");
  write_tsv(tsv, recs);
  const ReadReport rep = convert_tsv_to_binary(tsv, bin, {.strict = true});
  EXPECT_EQ(rep.records, 1000);
  EXPECT_EQ(rep.malformed, 0);
  EXPECT_TRUE(is_binary_file(bin));
  EXPECT_FALSE(is_binary_file(tsv));
  EXPECT_EQ(fs::file_size(bin), 64u + 1000u * 160u + 8u + 8u);  // one block's checksum, the table's

  Featurizer f;
  f.max_ind_range = 5000;
  f.hash = HashMode::reference;
  BatchLoader loader(binary_source(bin), f, {.batch_size = 300, .drop_last = false, .prefetch = 2});
  ASSERT_EQ(loader.num_batches(), 4);
  std::int64_t seen = 0;
  while (const Batch* b = loader.next()) {
    const std::int64_t bs = b->size;
    EXPECT_EQ(bs, seen < 900 ? 300 : 100);
    for (std::int64_t i = 0; i < bs; ++i) {
      const RawRecord& r = recs[static_cast<std::size_t>(seen + i)];
      ASSERT_EQ(b->labels.data_as<float>()[i], static_cast<float>(r.label));
      for (int j = 0; j < kNumDense; ++j)
        ASSERT_EQ(b->dense.data_as<float>()[i * kNumDense + j], Featurizer::dense_transform(r.dense[j]));
      for (int t = 0; t < kNumSparse; ++t) {
        const std::int64_t idx = b->indices.data_as<std::int64_t>()[t * bs + i];
        ASSERT_EQ(idx, static_cast<std::int64_t>(r.sparse[t] % static_cast<std::uint64_t>(f.rows(t))));
        ASSERT_EQ(static_cast<std::uint32_t>(b->raw_sparse.data_as<std::int32_t>()[t * bs + i]), r.sparse[t]);
        ASSERT_LT(idx, f.rows(t));
      }
    }
    EXPECT_EQ(b->offsets.data_as<std::int64_t>()[kNumSparse * bs], kNumSparse * bs);
    seen += bs;
  }
  EXPECT_EQ(seen, 1000);
  EXPECT_EQ(loader.next(), nullptr);
}

TEST(BatchLoader, SyntheticSourceMatchesTheGeneratorAndDropsTheLastPartialBatch) {
  const SyntheticConfig cfg = small_synthetic();
  const SyntheticCriteo gen(cfg);
  auto source = slice_source(synthetic_source(cfg, 10000), 5000, 5250);
  Featurizer f;
  BatchLoader loader(source, f, {.batch_size = 100, .drop_last = true, .prefetch = 3});
  EXPECT_EQ(loader.num_batches(), 2);
  int batches = 0;
  while (const Batch* b = loader.next()) {
    const RawRecord r = gen.record(5000 + batches * 100 + 7);
    EXPECT_EQ(b->indices.data_as<std::int64_t>()[3 * 100 + 7], f.hash_index(3, r.sparse[3]));
    ++batches;
  }
  EXPECT_EQ(batches, 2);
}

TEST(Convert, RefusesToWriteOverItsInputUnderAnyName) {
  // `fusekit data convert X X` used to truncate X and exit 0.
  const fs::path tsv = temp_path("inplace.tsv"), link = temp_path("inplace_link.tsv");
  fs::copy_file(kFixture, tsv, fs::copy_options::overwrite_existing);
  const auto size = fs::file_size(tsv);
  fs::remove(link);
  fs::create_hard_link(tsv, link);
  const fs::path same_path_spelled_otherwise = tsv.parent_path() / "." / tsv.filename();
  for (const fs::path& out : {tsv, link, same_path_spelled_otherwise}) {
    fk::test::expect_arg_error([&] { convert_tsv_to_binary(tsv, out, {}); }, "data::convert_tsv_to_binary", "bin");
    EXPECT_EQ(fs::file_size(tsv), size) << out;
  }
}

TEST(BatchLoader, EpochsAreCutIntoTheirOwnBatchesFromTheFirstBatchOn) {
  // 10 records (dense[0] = i), batches of 4, three epochs from batch 1: [4, 8) [8, 10), then
  // [0, 4) [4, 8) [8, 10) twice.
  std::vector<RawRecord> recs(10);
  for (std::size_t i = 0; i < recs.size(); ++i) recs[i].dense[0] = static_cast<std::int32_t>(i);
  Featurizer f;
  for (const int workers : {1, 3}) {
    BatchLoader loader(memory_source(recs), f, {.batch_size = 4, .workers = workers, .epochs = 3, .first_batch = 1});
    EXPECT_EQ(loader.num_batches(), 8);
    std::vector<std::pair<std::int64_t, float>> got;  // (size, first record's dense[0] before the transform)
    while (const Batch* b = loader.next()) got.emplace_back(b->size, b->dense.data_as<float>()[0]);
    const auto first = [](int i) { return Featurizer::dense_transform(i); };
    const std::vector<std::pair<std::int64_t, float>> want = {{4, first(4)}, {2, first(8)}, {4, first(0)}, {4, first(4)},
                                                              {2, first(8)}, {4, first(0)}, {4, first(4)}, {2, first(8)}};
    EXPECT_EQ(got, want) << workers << " workers";
  }
  EXPECT_THROW(BatchLoader(memory_source(recs), f, {.batch_size = 4, .first_batch = 3}), Error);
  EXPECT_THROW(BatchLoader(memory_source(recs), f, {.batch_size = 4, .epochs = INT64_MAX}), Error);
  EXPECT_EQ(BatchLoader(memory_source(recs), f, {.batch_size = 4, .epochs = 0}).num_batches(), 0);
}

// Data-parallel slices (LoaderOptions::slice_rank): each rank's loader reads only its rows of
// every batch, and the slices of ranks 0..N-1, in rank order, are the whole batch: labels, dense
// features and every bag's ids (one-hot and multi-hot), over epochs, a first batch, a short last
// batch and batches with fewer samples than ranks (size 0 on the ranks past them).
TEST(BatchLoader, RankSlicesTogetherAreTheWholeBatch) {
  const SyntheticConfig cfg = small_synthetic();
  auto source = synthetic_source(cfg, 1003);
  Featurizer one_hot;
  one_hot.max_ind_range = 500;
  Featurizer multi = one_hot;
  multi.multi_hot_sizes.assign(kNumSparse, 2);
  multi.multi_hot_sizes[4] = 5;
  const auto bag = [](const Batch& b, int t, std::int64_t i) {
    const auto* off = b.offsets.data_as<const std::int64_t>();
    const auto* idx = b.indices.data_as<const std::int64_t>();
    return std::vector<std::int64_t>(idx + off[t * b.size + i], idx + off[t * b.size + i + 1]);
  };
  struct Case {
    std::int64_t batch, epochs, first;
  };
  for (const Featurizer& f : {one_hot, multi})
    for (const Case c : {Case{100, 2, 3}, Case{3, 1, 330}, Case{7, 1, 0}})
      for (const int ranks : {2, 3, 4}) {
        const LoaderOptions whole_opt{.batch_size = c.batch, .prefetch = 2, .epochs = c.epochs, .first_batch = c.first};
        BatchLoader whole(source, f, whole_opt);
        std::vector<std::unique_ptr<BatchLoader>> rank;
        for (int r = 0; r < ranks; ++r) {
          LoaderOptions o = whole_opt;
          o.slice_rank = r;
          o.slice_ranks = ranks;
          o.workers = 1 + r % 2;
          rank.push_back(std::make_unique<BatchLoader>(source, f, o));
          EXPECT_EQ(rank.back()->num_batches(), whole.num_batches());
        }
        std::int64_t batches = 0;
        while (const Batch* w = whole.next()) {
          std::int64_t at = 0;
          for (int r = 0; r < ranks; ++r) {
            const Batch* b = rank[static_cast<std::size_t>(r)]->next();
            ASSERT_NE(b, nullptr);
            const auto [lo, hi] = slice_of(w->size, r, ranks);
            ASSERT_EQ(lo, at);
            ASSERT_EQ(b->size, hi - lo) << "rank " << r << " of " << ranks << ", batch " << batches;
            ASSERT_EQ(b->global_size, w->size);
            for (std::int64_t i = 0; i < b->size; ++i, ++at) {
              ASSERT_EQ(b->labels.data_as<float>()[i], w->labels.data_as<float>()[at]);
              for (int j = 0; j < kNumDense; ++j)
                ASSERT_EQ(b->dense.data_as<float>()[i * kNumDense + j], w->dense.data_as<float>()[at * kNumDense + j]);
              for (int t = 0; t < kNumSparse; ++t) ASSERT_EQ(bag(*b, t, i), bag(*w, t, at)) << "table " << t;
            }
          }
          EXPECT_EQ(at, w->size);
          ++batches;
        }
        EXPECT_EQ(batches, whole.num_batches());
        for (auto& l : rank) EXPECT_EQ(l->next(), nullptr);
      }
  EXPECT_EQ(slice_of(10, 0, 4), std::make_pair(std::int64_t{0}, std::int64_t{3}));
  EXPECT_EQ(slice_of(10, 3, 4), std::make_pair(std::int64_t{8}, std::int64_t{10}));
  EXPECT_EQ(slice_of(2, 3, 4), std::make_pair(std::int64_t{2}, std::int64_t{2}));
  fk::test::expect_arg_error(
      [&] { BatchLoader(source, one_hot, {.batch_size = 4, .slice_rank = 2, .slice_ranks = 2}); }, "data::BatchLoader",
      "slice_rank");
}

TEST(BatchLoader, SeveralWorkersKeepTheOrder) {
  std::vector<RawRecord> recs(1000);
  for (std::size_t i = 0; i < recs.size(); ++i) recs[i].dense[0] = static_cast<std::int32_t>(i);
  for (int workers : {1, 2, 3, 5}) {
    BatchLoader loader(memory_source(recs), Featurizer{}, {.batch_size = 7, .prefetch = 2, .workers = workers});
    std::int64_t next_id = 0;
    while (const Batch* b = loader.next())
      for (std::int64_t i = 0; i < b->size; ++i, ++next_id)
        ASSERT_EQ(b->dense.data_as<float>()[i * kNumDense], Featurizer::dense_transform(static_cast<std::int32_t>(next_id)))
            << workers << " workers";
    EXPECT_EQ(next_id, 1000);
  }
}

TEST(BatchLoader, BatchMemoryComesFromTheGivenAllocatorAndIsReused) {
  std::atomic<int> calls{0};
  LoaderOptions opt{.batch_size = 50, .prefetch = 2};
  opt.allocate = [&](Dims shape, DType dtype) {
    ++calls;
    return Tensor::empty(shape, dtype, Device::cpu());
  };
  BatchLoader loader(synthetic_source(small_synthetic(), 1000), Featurizer{}, opt);
  int batches = 0;
  while (loader.next()) ++batches;
  EXPECT_EQ(batches, 20);
  EXPECT_EQ(calls.load(), 3 * 5);  // 3 slots x 5 tensors, allocated once
}

// A source that fails past a given record, as a truncated or unreadable file would.
class FailingSource final : public RecordSource {
 public:
  std::int64_t size() const override { return 1000; }
  void read(std::int64_t begin, std::span<RawRecord> out) const override {
    if (begin >= 500) throw Error("test::FailingSource", "begin", "< 500", std::to_string(begin));
    std::fill(out.begin(), out.end(), RawRecord{});
  }
};

TEST(BatchLoader, StopsCleanlyWhenDestroyedEarlyAndReportsSourceErrors) {
  { BatchLoader loader(synthetic_source(small_synthetic(), 100000), Featurizer{}, {.batch_size = 64, .workers = 2}); loader.next(); }
  EXPECT_THROW(binary_source(kFixture), Error);  // not a binary file
  BatchLoader loader(std::make_shared<FailingSource>(), Featurizer{}, {.batch_size = 100, .workers = 2});
  int good = 0;
  try {
    while (loader.next()) ++good;
    ADD_FAILURE() << "the source's error did not reach the consumer";
  } catch (const Error& e) {
    EXPECT_EQ(e.op(), "test::FailingSource");
  }
  EXPECT_LE(good, 5);
}

// A line past the reader's cap (1 MiB) is an error naming the file and the line, not a whole
// file read into memory as one line (issue 27 item 10).
// The binary reader trusts nothing in the file (issue 27 item 6): a record count whose byte size
// wraps or passes 2^63, a short or a long file, a label that is not 0/1 are errors naming the file.
TEST(BinaryFormat, DamagedFilesAreRefused) {
  const std::vector<RawRecord> recs = synthetic_records(10);
  const fs::path good = temp_path("ten.bin"), bad = temp_path("damaged.bin");
  write_binary(good, recs);
  std::vector<char> bytes(fs::file_size(good));
  std::ifstream(good, std::ios::binary).read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  auto with = [&](const std::vector<char>& b) {
    std::ofstream(bad, std::ios::binary | std::ios::trunc).write(b.data(), static_cast<std::streamsize>(b.size()));
    return bad;
  };
  auto set_count = [&](std::uint64_t n) {
    std::vector<char> b = bytes;
    std::memcpy(b.data() + 24, &n, 8);  // the header's count
    return b;
  };
  auto refused = [&](const std::vector<char>& b, const char* what) {
    try {
      auto src = binary_source(with(b));
      std::vector<RawRecord> out(static_cast<std::size_t>(std::min<std::int64_t>(src->size(), 10)));
      src->read(0, out);
      ADD_FAILURE() << what << ": accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(bad.string()), std::string::npos) << what << ": " << e.what();
    }
  };
  refused(set_count((std::uint64_t{1} << 60) + 10), "a count whose size wraps");
  refused(set_count(std::uint64_t{1} << 63), "a count past 2^63");
  refused(set_count(9), "a count short of the records");
  refused(std::vector<char>(bytes.begin(), bytes.end() - 1), "a truncated file");
  std::vector<char> longer = bytes;
  longer.push_back('x');
  refused(longer, "a trailing byte");
  // Checksums cover every byte: every single flipped bit is refused, wherever it is.
  ASSERT_EQ(bytes.size(), 64u + 10u * 160u + 16u);
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    std::vector<char> flipped = bytes;
    flipped[i] = static_cast<char>(flipped[i] ^ (1 << (i % 8)));
    refused(flipped, "a flipped bit");
  }
  EXPECT_EQ(binary_source(with(bytes))->size(), 10);
}

TEST(BinaryFormat, VersionOneFilesAreStillReadAndChecked) {
  // Version 1: the same header without block size or CRC, the records, nothing after them.
  const std::vector<RawRecord> recs = synthetic_records(5);
  auto v1 = [&](std::int32_t label3) {
    std::vector<char> b(64 + 5 * 160, 0);
    std::memcpy(b.data(), "FKCRITEO", 8);
    const std::uint32_t fields[4] = {1, 13, 26, 160};
    std::memcpy(b.data() + 8, fields, 16);
    const std::uint64_t count = 5;
    std::memcpy(b.data() + 24, &count, 8);
    std::memcpy(b.data() + 64, recs.data(), 5 * 160);
    std::memcpy(b.data() + 64 + 3 * 160, &label3, 4);
    const fs::path p = temp_path("v1.bin");
    std::ofstream(p, std::ios::binary | std::ios::trunc).write(b.data(), static_cast<std::streamsize>(b.size()));
    return p;
  };
  std::vector<RawRecord> out(5);
  binary_source(v1(recs[3].label))->read(0, out);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(std::memcmp(&out[i], &recs[i], sizeof(RawRecord)), 0) << i;
  EXPECT_THROW(binary_source(v1(7))->read(0, out), Error);  // v1's own check: labels 0 or 1
}

TEST(BinaryFormat, BlocksAreCheckedWhereverTheReadStarts) {
  // 10000 records: two full blocks of 4096 and a partial one; damage the last block only.
  const std::vector<RawRecord> recs = synthetic_records(10000);
  const fs::path p = temp_path("blocks.bin");
  write_binary(p, recs);
  EXPECT_EQ(fs::file_size(p), 64u + 10000u * 160u + 3u * 8u + 8u);
  {
    std::fstream f(p, std::ios::binary | std::ios::in | std::ios::out);
    f.seekp(64 + 9000 * 160 + 40);  // a dense value of record 9000
    f.put('\x55');
  }
  auto src = binary_source(p);
  std::vector<RawRecord> out(100);
  src->read(4000, out);  // blocks 0 and 1: intact
  EXPECT_EQ(std::memcmp(out.data(), &recs[4000], 100 * sizeof(RawRecord)), 0);
  try {
    src->read(9950, std::span(out).first(10));  // block 2, not the damaged record
    ADD_FAILURE() << "a damaged block was read";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("records 8192 to 9999 are damaged"), std::string::npos) << e.what();
  }
}

std::vector<char> slurp(const fs::path& p) {
  std::vector<char> b(fs::file_size(p));
  std::ifstream(p, std::ios::binary).read(b.data(), static_cast<std::streamsize>(b.size()));
  return b;
}
template <class T>
T field(const std::vector<char>& b, std::size_t at) {
  T v;
  std::memcpy(&v, b.data() + at, sizeof v);
  return v;
}

TEST(BinaryFormat, VersionFourLayoutByHand) {
  // 9000 records written in pieces that straddle the blocks of 4096: the table holds the XXH3-64
  // of records [0, 4096), [4096, 8192) and [8192, 9000), then the XXH3-64 of those 24 bytes.
  const std::vector<RawRecord> recs = synthetic_records(9000);
  const fs::path p = temp_path("v4.bin");
  {
    RecordWriter w(p, FileFormat::binary, {true, 0xabcdef01});
    const std::size_t pieces[] = {1000, 3, 3093, 4096, 1, 807};  // 9000 in all
    std::size_t at = 0;
    for (std::size_t n : pieces) {
      w.write(std::span(recs).subspan(at, n));
      at += n;
    }
    ASSERT_EQ(at, recs.size());
    w.close();
  }
  const std::vector<char> b = slurp(p);
  ASSERT_EQ(b.size(), 64u + 9000u * 160u + 3u * 8u + 8u);
  EXPECT_EQ(std::memcmp(b.data(), "FKCRITEO", 8), 0);
  EXPECT_EQ(field<std::uint32_t>(b, 8), 4u);            // version
  EXPECT_EQ(field<std::uint64_t>(b, 24), 9000u);        // records
  EXPECT_EQ(field<std::uint32_t>(b, 32), 4096u);        // records per block
  EXPECT_EQ(field<std::uint32_t>(b, 36), 1u);           // content: vocabulary ids
  EXPECT_EQ(field<std::uint32_t>(b, 40), 0xabcdef01u);  // the vocabulary's fingerprint
  EXPECT_EQ(field<std::uint32_t>(b, 60), static_cast<std::uint32_t>(crc32_z(0, reinterpret_cast<const Bytef*>(b.data()), 60)));
  EXPECT_EQ(std::memcmp(b.data() + 64, recs.data(), 9000 * 160), 0);
  const std::size_t table = 64 + 9000 * 160;
  const std::size_t first[] = {0, 4096, 8192, 9000};
  for (int k = 0; k < 3; ++k)
    EXPECT_EQ(field<std::uint64_t>(b, table + 8 * k),
              XXH3_64bits(b.data() + 64 + first[k] * 160, (first[k + 1] - first[k]) * 160)) << k;
  EXPECT_EQ(field<std::uint64_t>(b, table + 24), XXH3_64bits(b.data() + table, 24));
  EXPECT_EQ(binary_content(p), (BinaryContent{true, 0xabcdef01}));
  // Content is 0 (raw values, no fingerprint) or 1: anything else is refused, its header intact.
  for (const auto& [content, vocabulary] : {std::pair{2u, 0u}, std::pair{0u, 0xabcdef01u}}) {
    std::vector<char> bad = b;
    std::memcpy(bad.data() + 36, &content, 4);
    std::memcpy(bad.data() + 40, &vocabulary, 4);
    const auto crc = static_cast<std::uint32_t>(crc32_z(0, reinterpret_cast<const Bytef*>(bad.data()), 60));
    std::memcpy(bad.data() + 60, &crc, 4);
    const fs::path q = temp_path("v4_content.bin");
    std::ofstream(q, std::ios::binary | std::ios::trunc).write(bad.data(), static_cast<std::streamsize>(bad.size()));
    try {
      binary_source(q);
      ADD_FAILURE() << "content " << content << " accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("in a version 4 file"), std::string::npos) << e.what();
    }
  }
  write_binary(p, std::span(recs).first(5));
  EXPECT_EQ(binary_content(p), BinaryContent{});
  EXPECT_EQ(field<std::uint32_t>(slurp(p), 36), 0u);  // content: raw values
}

TEST(BinaryFormat, CrcVersionsTwoAndThreeAreStillReadAndChecked) {
  // The same records as versions 2 (raw values) and 3 (ids): the header's fields as version 4 has
  // them, then a CRC-32 per block of 4 records and the CRC-32 of that table.
  const std::vector<RawRecord> recs = synthetic_records(10);
  auto crc = [](const char* p, std::size_t n) {
    return static_cast<std::uint32_t>(crc32_z(0, reinterpret_cast<const Bytef*>(p), n));
  };
  auto old_version = [&](std::uint32_t version, std::uint32_t content) {
    std::vector<char> b(64 + 10 * 160, 0);
    std::memcpy(b.data(), "FKCRITEO", 8);
    const std::uint32_t fields[4] = {version, 13, 26, 160};
    std::memcpy(b.data() + 8, fields, 16);
    const std::uint64_t count = 10;
    const std::uint32_t per = 4, vocabulary = content ? 0x5eed5eedu : 0u;
    std::memcpy(b.data() + 24, &count, 8);
    std::memcpy(b.data() + 32, &per, 4);
    std::memcpy(b.data() + 36, &content, 4);
    std::memcpy(b.data() + 40, &vocabulary, 4);
    const std::uint32_t header = crc(b.data(), 60);
    std::memcpy(b.data() + 60, &header, 4);
    std::memcpy(b.data() + 64, recs.data(), 10 * 160);
    std::vector<std::uint32_t> sums;
    for (std::size_t r = 0; r < 10; r += 4) sums.push_back(crc(b.data() + 64 + r * 160, std::min<std::size_t>(4, 10 - r) * 160));
    sums.push_back(crc(reinterpret_cast<const char*>(sums.data()), sums.size() * 4));
    b.insert(b.end(), reinterpret_cast<const char*>(sums.data()), reinterpret_cast<const char*>(sums.data() + sums.size()));
    return b;
  };
  const fs::path p = temp_path("old.bin");
  auto write = [&](const std::vector<char>& b) {
    std::ofstream(p, std::ios::binary | std::ios::trunc).write(b.data(), static_cast<std::streamsize>(b.size()));
    return p;
  };
  for (const auto& [version, content] : {std::pair{2u, 0u}, std::pair{3u, 1u}}) {
    SCOPED_TRACE(version);
    const std::vector<char> good = old_version(version, content);
    std::vector<RawRecord> out(10);
    binary_source(write(good))->read(0, out);
    EXPECT_EQ(std::memcmp(out.data(), recs.data(), 10 * 160), 0);
    EXPECT_EQ(binary_content(p), (content ? BinaryContent{true, 0x5eed5eedu} : BinaryContent{}));
    std::vector<char> damaged = good;
    damaged[64 + 9 * 160 + 44] ^= 1;  // record 9, the last block
    auto src = binary_source(write(damaged));
    src->read(0, std::span(out).first(8));  // the first two blocks: intact
    try {
      src->read(8, std::span(out).first(2));
      ADD_FAILURE() << "a damaged block was read";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("CRC-32"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("records 8 to 9 are damaged"), std::string::npos) << e.what();
    }
  }
  // Version 3 holds ids only.
  EXPECT_THROW(binary_source(write(old_version(3, 0))), Error);
}

TEST(CriteoRead, OverlongLineIsRefused) {
  const auto path = std::filesystem::temp_directory_path() / "fusekit_overlong.tsv";
  {
    std::ofstream out(path, std::ios::binary);
    out << "0\t1\n";
    out << std::string((std::size_t{1} << 20) + 10, '\r');  // CR-only "lines": one long line
  }
  ReadReport rep;
  try {
    read_tsv(path, {}, rep);
    ADD_FAILURE() << "an overlong line was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("line 2 is longer"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(path.string()), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace fk::data

namespace fk::data {
namespace {

// The reference's Kaggle split by hand: divmod(n, 7) records a day, the first n % 7 days one
// more; days 0-5 train; day 6 halved by np.array_split (the first half takes the odd record).
TEST(ReferenceSplit, KaggleDaysByHand) {
  const ReferenceSplit a = kaggle_split(20);  // 20 = 7 * 2 + 6: days of 3, 3, 3, 3, 3, 3, 2
  EXPECT_EQ(a.day_begin, (std::vector<std::int64_t>{0, 3, 6, 9, 12, 15, 18, 20}));
  EXPECT_EQ(a.train_end, 18);
  EXPECT_EQ(a.test_begin, 18);
  EXPECT_EQ(a.test_end, 19);
  EXPECT_EQ(a.val_begin, 19);
  EXPECT_EQ(a.val_end, 20);
  const ReferenceSplit b = kaggle_split(21);  // 3 a day; day 6 = [18, 21): test [18, 20), validation [20, 21)
  EXPECT_EQ(b.train_end, 18);
  EXPECT_EQ(b.test_end, 20);
  EXPECT_EQ(b.val_begin, 20);
  const ReferenceSplit c = kaggle_split(10);  // 10 = 7 + 3: days of 2, 2, 2, 1, 1, 1, 1
  EXPECT_EQ(c.day_begin, (std::vector<std::int64_t>{0, 2, 4, 6, 7, 8, 9, 10}));
  EXPECT_EQ(c.test_end - c.test_begin, 1);
  EXPECT_EQ(c.val_end - c.val_begin, 0);
  EXPECT_EQ(kaggle_split(0).train_end, 0);
  EXPECT_THROW(kaggle_split(-1), Error);
}

TEST(ReferenceSplit, TrainingOrders) {
  const std::vector<std::int64_t> days{0, 30, 31, 100};
  const std::vector<std::int64_t> none = training_order(days, "none", 1);
  for (std::size_t i = 0; i < none.size(); ++i) EXPECT_EQ(none[i], static_cast<std::int64_t>(i));
  const std::vector<std::int64_t> total = training_order(days, "total", 1);
  std::vector<std::int64_t> sorted = total;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(sorted, none);  // a permutation
  EXPECT_NE(total, none);
  EXPECT_EQ(training_order(days, "total", 1), total);  // deterministic in the seed
  EXPECT_NE(training_order(days, "total", 2), total);
  bool crossed = false;  // total mixes the days
  for (std::size_t i = 0; i < 30; ++i) crossed |= total[i] >= 30;
  EXPECT_TRUE(crossed);
  const std::vector<std::int64_t> day = training_order(days, "day", 1);
  for (std::size_t d = 0; d + 1 < days.size(); ++d) {  // each day's records stay in the day, all of them
    std::vector<std::int64_t> part(day.begin() + days[d], day.begin() + days[d + 1]);
    std::sort(part.begin(), part.end());
    for (std::size_t i = 0; i < part.size(); ++i) EXPECT_EQ(part[i], days[d] + static_cast<std::int64_t>(i));
  }
  EXPECT_NE(day, none);
  EXPECT_THROW(training_order(days, "week", 1), Error);
  EXPECT_THROW(training_order(std::vector<std::int64_t>{0, 5, 3}, "none", 1), Error);
}

TEST(ReferenceSplit, OrderedAndSlicedSourcesReadWhatTheySayAndNothingElse) {
  const std::vector<RawRecord> recs = synthetic_records(12);
  const auto all = memory_source(recs);
  const auto ordered = ordered_source(all, {5, 6, 7, 0, 11});
  ASSERT_EQ(ordered->size(), 5);
  std::vector<RawRecord> out(5);
  ordered->read(0, out);
  for (std::size_t i = 0; i < out.size(); ++i)
    EXPECT_EQ(std::memcmp(&out[i], &recs[std::vector<std::size_t>{5, 6, 7, 0, 11}[i]], sizeof(RawRecord)), 0);
  EXPECT_THROW(ordered->read(1, out), Error);  // past the end
  EXPECT_THROW(ordered_source(all, {3, 12}), Error);
  EXPECT_THROW(ordered_source(all, {-1}), Error);
  // A slice refuses a read past its end even where its source has records (the test set).
  const auto train = slice_source(all, 0, 8);
  std::vector<RawRecord> two(2);
  EXPECT_NO_THROW(train->read(6, two));
  EXPECT_THROW(train->read(7, two), Error);
}

// Multi-hot bags (Featurizer::multi_hot_sizes): bag (t, i) holds sizes[t] rows, table-major, its
// first row the one-hot row, every row inside its table, the same rows on every call.
TEST(MakeBatch, MultiHotBagsHaveTheirSizesAndStartWithTheOneHotRow) {
  std::vector<RawRecord> recs(5);
  SyntheticCriteo(SyntheticConfig{}).generate(0, recs);
  Featurizer one_hot;
  one_hot.max_ind_range = 50;
  Featurizer multi = one_hot;
  multi.multi_hot_sizes.assign(kNumSparse, 1);
  multi.multi_hot_sizes[0] = 3;
  multi.multi_hot_sizes[25] = 7;
  Batch a, b, c;
  make_batch(recs, one_hot, a);
  make_batch(recs, multi, b);
  make_batch(recs, multi, c);
  const std::int64_t n = 5;
  ASSERT_EQ(b.indices.numel(), n * (24 + 3 + 7));
  ASSERT_EQ(b.offsets.numel(), kNumSparse * n + 1);
  EXPECT_EQ(b.raw_sparse.data(), nullptr);
  const auto* off = b.offsets.data_as<std::int64_t>();
  const auto* idx = b.indices.data_as<std::int64_t>();
  const auto* one = a.indices.data_as<std::int64_t>();
  for (int t = 0; t < kNumSparse; ++t)
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t q = t * n + i;
      EXPECT_EQ(off[q + 1] - off[q], multi.multi_hot_sizes[static_cast<std::size_t>(t)]) << "bag " << q;
      EXPECT_EQ(idx[off[q]], one[q]) << "bag " << q;
      for (std::int64_t k = off[q]; k < off[q + 1]; ++k) {
        EXPECT_GE(idx[k], 0);
        EXPECT_LT(idx[k], multi.rows(t));
      }
    }
  EXPECT_EQ(std::memcmp(b.indices.data(), c.indices.data(), b.indices.nbytes()), 0);
  // Entry k of a bag is (row + offset(t, k)) % rows: bags of different rows differ in every entry.
  EXPECT_EQ(multi.multi_hot_row(0, 7, 0), 7);
  EXPECT_EQ((multi.multi_hot_row(0, 8, 1) - multi.multi_hot_row(0, 7, 1) + 50) % 50, 1);
  EXPECT_EQ(std::memcmp(a.dense.data(), b.dense.data(), a.dense.nbytes()), 0);
  EXPECT_EQ(std::memcmp(a.labels.data(), b.labels.data(), a.labels.nbytes()), 0);
  Featurizer bad = one_hot;
  bad.multi_hot_sizes = {1, 2};
  test::expect_arg_error([&] { bad.validate(); }, "data::Featurizer", "multi_hot_sizes");
  bad.multi_hot_sizes.assign(kNumSparse, 1);
  bad.multi_hot_sizes[4] = 0;
  test::expect_arg_error([&] { bad.validate(); }, "data::Featurizer", "multi_hot_sizes");
}

}  // namespace
}  // namespace fk::data
