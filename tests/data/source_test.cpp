// data::open_source: each kind of data a user may name (Criteo TSV, gzip TSV, fusekit binary, a
// directory of preprocessed shards) is recognised from its content and opened with the same
// records; a path that is none of them is refused naming the path and what was expected.
#include <gtest/gtest.h>
#include <zlib.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "fusekit/core/error.hpp"
#include "fusekit/data/criteo.hpp"
#include "fusekit/data/preprocess.hpp"
#include "fusekit/data/source.hpp"
#include "fusekit/data/vocabulary.hpp"
#include "test_util.hpp"

namespace fk::data {
namespace {

namespace fs = std::filesystem;
using test::expect_arg_error;
using test::expect_error_mentions;

fs::path scratch(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("fusekit_source_test_" + name);
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

std::vector<RawRecord> some_records(std::int64_t n) {
  std::vector<RawRecord> out(static_cast<std::size_t>(n));
  SyntheticCriteo(SyntheticConfig{.seed = 5}).generate(0, out);
  return out;
}

std::vector<RawRecord> all_records(const DataSource& s) {
  std::vector<RawRecord> out(static_cast<std::size_t>(s.size));
  s.records->read(0, out);
  return out;
}

void expect_same(const std::vector<RawRecord>& a, const std::vector<RawRecord>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_EQ(std::memcmp(&a[i], &b[i], sizeof(RawRecord)), 0) << i;
}

void write_gzip(const fs::path& gz, const fs::path& plain) {
  std::ifstream in(plain, std::ios::binary);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  gzFile f = gzopen(gz.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(gzwrite(f, text.data(), static_cast<unsigned>(text.size())), static_cast<int>(text.size()));
  gzclose(f);
}

TEST(OpenSource, TsvFile) {
  const fs::path dir = scratch("tsv");
  const auto records = some_records(50);
  write_tsv(dir / "data.txt", records);
  EXPECT_EQ(find_source_kind(dir / "data.txt"), SourceKind::tsv);
  const DataSource s = open_source(dir / "data.txt");
  EXPECT_EQ(s.kind, SourceKind::tsv);
  EXPECT_EQ(s.path, dir / "data.txt");
  EXPECT_EQ(s.size, 50);
  ASSERT_TRUE(s.report.has_value());
  EXPECT_EQ(s.report->records, 50);
  EXPECT_FALSE(s.shards.has_value());
  EXPECT_EQ(s.description(), (dir / "data.txt").string() + " (Criteo TSV): 50 records");
  expect_same(all_records(s), records);
}

TEST(OpenSource, GzipTsvIsRecognisedFromItsContentNotItsName) {
  const fs::path dir = scratch("gzip");
  const auto records = some_records(40);
  write_tsv(dir / "plain.tsv", records);
  write_gzip(dir / "compressed.tsv", dir / "plain.tsv");  // no .gz suffix
  const DataSource s = open_source(dir / "compressed.tsv");
  EXPECT_EQ(s.kind, SourceKind::gzip_tsv);
  EXPECT_EQ(s.size, 40);
  EXPECT_NE(s.description().find("(Criteo TSV, gzip): 40 records"), std::string::npos) << s.description();
  expect_same(all_records(s), records);
}

TEST(OpenSource, BinaryFile) {
  const fs::path dir = scratch("binary");
  const auto records = some_records(30);
  write_binary(dir / "data.tsv", records);  // the header decides, not the name
  const DataSource s = open_source(dir / "data.tsv");
  EXPECT_EQ(s.kind, SourceKind::binary);
  EXPECT_EQ(s.size, 30);
  EXPECT_FALSE(s.report.has_value());
  EXPECT_NE(s.description().find("(fusekit binary): 30 records"), std::string::npos) << s.description();
  expect_same(all_records(s), records);
}

TEST(OpenSource, ShardDirectory) {
  const fs::path dir = scratch("shards");
  write_tsv(dir / "raw.tsv", some_records(700));
  PreprocessOptions o;
  o.inputs = {dir / "raw.tsv"};
  o.out = dir / "shards";
  o.threads = 2;
  preprocess(o);
  EXPECT_EQ(find_source_kind(dir / "shards"), SourceKind::shards);
  const DataSource s = open_source(dir / "shards");
  EXPECT_EQ(s.kind, SourceKind::shards);
  ASSERT_TRUE(s.shards.has_value());
  EXPECT_EQ(s.shards->days.size(), 7u);
  EXPECT_NE(s.shards->vocabulary, nullptr);
  EXPECT_EQ(s.size, 700);
  EXPECT_EQ(s.records->size(), 700);
  EXPECT_NE(s.name().find("(fusekit data preprocess, kaggle, 7 days)"), std::string::npos) << s.name();
}

TEST(OpenSource, UnreadTextIsIdentifiedOnly) {
  const fs::path dir = scratch("unread");
  write_tsv(dir / "data.tsv", some_records(10));
  const DataSource s = open_source(dir / "data.tsv", {.read_text = false});
  EXPECT_EQ(s.kind, SourceKind::tsv);
  EXPECT_EQ(s.size, -1);
  EXPECT_EQ(s.records, nullptr);
  EXPECT_NE(s.description().find("not read"), std::string::npos);
}

TEST(OpenSource, StrictTsvStopsAtAMalformedLine) {
  const fs::path dir = scratch("strict");
  std::ofstream(dir / "bad.tsv") << "1\t2\n";
  EXPECT_EQ(open_source(dir / "bad.tsv").size, 0);  // skipped and counted
  expect_error_mentions([&] { open_source(dir / "bad.tsv", {.strict = true}); }, {"bad.tsv", "line 1"});
}

TEST(OpenSource, APathThatIsNoneOfThemIsRefusedNamingItAndWhatWasExpected) {
  const fs::path dir = scratch("none");
  EXPECT_EQ(find_source_kind(dir / "missing"), std::nullopt);
  EXPECT_EQ(find_source_kind(dir), std::nullopt);  // a directory without a manifest
  expect_arg_error([&] { open_source(dir / "missing"); }, "data::open_source", "path");
  expect_error_mentions([&] { open_source(dir / "missing"); },
                        {(dir / "missing").string(), "no such file or directory", "Criteo TSV file (plain or gzip)",
                         "fusekit binary file", "directory of fusekit data preprocess"});
  expect_error_mentions([&] { open_source(dir); }, {dir.string(), "a directory without a manifest.json"});
}

}  // namespace
}  // namespace fk::data
