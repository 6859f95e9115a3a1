// Criteo TSV reading and writing, and the featurizer (hash and dense transform).
#include "fusekit/data/criteo.hpp"
#include "fusekit/data/vocabulary.hpp"

#include <fmt/format.h>
#include <zlib.h>

#include <algorithm>
#include <limits>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <array>
#include <fstream>
#include <thread>

#include "fusekit/core/error.hpp"
#include "fusekit/ops/recsys.hpp"  // reference::hash_row

namespace fk::data {

static_assert(std::endian::native == std::endian::little, "the binary format is written in host order");

HashMode parse_hash_mode(std::string_view name) {
  if (name == "seed") return HashMode::seed;
  if (name == "reference") return HashMode::reference;
  throw Error("data::parse_hash_mode", "name", "seed | reference", std::string(name));
}

std::string_view hash_mode_name(HashMode m) { return m == HashMode::seed ? "seed" : "reference"; }

void Featurizer::validate() const {
  FK_CHECK_ARG(cardinalities.size() == kNumSparse, "data::Featurizer", "cardinalities", "26 table sizes",
               fmt::format("{}", cardinalities.size()));
  for (std::size_t t = 0; t < cardinalities.size(); ++t)
    FK_CHECK_ARG(cardinalities[t] >= 1, "data::Featurizer", "cardinalities", "sizes >= 1",
                 fmt::format("{} for table {}", cardinalities[t], t));
  FK_CHECK_ARG(!vocabulary || hash == HashMode::reference, "data::Featurizer", "hash",
               "reference with a vocabulary (ids pass through v % rows unchanged)", std::string(hash_mode_name(hash)));
  FK_CHECK_ARG(!premapped || vocabulary, "data::Featurizer", "premapped", "a vocabulary (the ids' tables)",
               "none");
  FK_CHECK_ARG(multi_hot_sizes.empty() || multi_hot_sizes.size() == kNumSparse, "data::Featurizer", "multi_hot_sizes",
               "none (one-hot) or 26 bag sizes", fmt::format("{} sizes", multi_hot_sizes.size()));
  for (std::size_t t = 0; t < multi_hot_sizes.size(); ++t)
    FK_CHECK_ARG(multi_hot_sizes[t] >= 1, "data::Featurizer", "multi_hot_sizes", "bag sizes >= 1",
                 fmt::format("{} for table {}", multi_hot_sizes[t], t));
}

std::int64_t Featurizer::multi_hot_row(int table, std::int64_t row, std::int64_t k) const {
  if (k == 0) return row;
  // splitmix64 of (table, k): a fixed offset per bag position.
  std::uint64_t x = (static_cast<std::uint64_t>(table) << 32 | static_cast<std::uint64_t>(k)) + 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  x ^= x >> 31;
  const auto rows_t = static_cast<std::uint64_t>(rows(table));
  return static_cast<std::int64_t>((static_cast<std::uint64_t>(row) + x % rows_t) % rows_t);
}

std::int64_t Featurizer::rows(int table) const {
  if (vocabulary) return vocabulary->rows(table);
  const std::int64_t c = cardinalities.at(static_cast<std::size_t>(table));
  return max_ind_range > 0 ? std::min(c, max_ind_range) : c;
}

std::vector<std::int64_t> Featurizer::table_rows() const {
  std::vector<std::int64_t> r(cardinalities.size());
  for (std::size_t t = 0; t < r.size(); ++t) r[t] = rows(static_cast<int>(t));
  return r;
}

std::int64_t Featurizer::hash_index(int table, std::uint32_t v) const {
  if (premapped) {
    FK_CHECK_ARG(static_cast<std::int64_t>(v) < vocabulary->rows(table), "data::Featurizer", "ids",
                 fmt::format("ids below the vocabulary's {} rows of table {}", vocabulary->rows(table), table),
                 std::to_string(v));
    return v;
  }
  if (vocabulary) return vocabulary->id(table, v);
  return reference::hash_row(v, rows(table), hash);
}

float Featurizer::dense_transform(std::int32_t x) {
  // Counts are mostly small: those below 4096 come from a table of the same log1p values.
  static const std::array<float, 4096> table = [] {
    std::array<float, 4096> t{};
    for (std::size_t i = 0; i < t.size(); ++i) t[i] = std::log1p(static_cast<float>(i));
    return t;
  }();
  if (x < 4096) return table[static_cast<std::size_t>(std::max(x, 0))];
  return std::log1p(static_cast<float>(x));
}

// ---------------------------------------------------------------------------------------------
// Parsing
// ---------------------------------------------------------------------------------------------

std::string_view line_error_name(LineError e) {
  switch (e) {
    case LineError::field_count: return "field_count";
    case LineError::bad_label: return "bad_label";
    case LineError::bad_integer: return "bad_integer";
    case LineError::bad_hex: return "bad_hex";
  }
  return "?";
}

namespace {

constexpr int kFields = 1 + kNumDense + kNumSparse;

bool parse_int(std::string_view s, std::int32_t& out) {
  if (s.empty()) {
    out = 0;
    return true;
  }
  const char* end = s.data() + s.size();
  auto [p, ec] = std::from_chars(s.data(), end, out, 10);
  return ec == std::errc() && p == end;
}

bool parse_hex(std::string_view s, std::uint32_t& out) {
  if (s.empty()) {
    out = 0;
    return true;
  }
  if (s.size() > 8) return false;
  const char* end = s.data() + s.size();
  auto [p, ec] = std::from_chars(s.data(), end, out, 16);
  return ec == std::errc() && p == end;
}

}  // namespace

std::optional<LineIssue> parse_line(std::string_view line, RawRecord& out) {
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  std::array<std::string_view, kFields> f;
  int n = 0;
  std::size_t start = 0;
  while (true) {
    const std::size_t tab = line.find('\t', start);
    if (n == kFields)  // one field more, and one more per tab after it
      return LineIssue{LineError::field_count,
                       kFields + 1 + static_cast<int>(std::min<std::ptrdiff_t>(
                                         std::count(line.begin() + static_cast<std::ptrdiff_t>(start), line.end(), '\t'),
                                         1 << 20))};
    f[n++] = line.substr(start, tab == std::string_view::npos ? std::string_view::npos : tab - start);
    if (tab == std::string_view::npos) break;
    start = tab + 1;
  }
  if (n != kFields) return LineIssue{LineError::field_count, n};
  if (f[0] != "0" && f[0] != "1") return LineIssue{LineError::bad_label, 0};
  out.label = f[0][0] - '0';
  for (int j = 0; j < kNumDense; ++j)
    if (!parse_int(f[1 + j], out.dense[j])) return LineIssue{LineError::bad_integer, 1 + j};
  for (int t = 0; t < kNumSparse; ++t)
    if (!parse_hex(f[1 + kNumDense + t], out.sparse[t])) return LineIssue{LineError::bad_hex, 1 + kNumDense + t};
  return std::nullopt;
}

namespace {

// "bad_hex in field 20", "field_count (39 fields, expected 40)".
std::string describe(LineError e, int field) {
  if (e == LineError::field_count) return fmt::format("field_count ({} fields, expected {})", field, kFields);
  return fmt::format("{} in field {}", line_error_name(e), field);
}

}  // namespace

std::string ReadReport::summary() const {
  std::string s = fmt::format("{} lines: {} records, {} malformed", lines, records, malformed);
  if (malformed > 0) {
    s += " (";
    bool first_kind = true;
    for (int e = 0; e < 4; ++e)
      if (by_error[e] > 0) {
        s += fmt::format("{}{} {}", first_kind ? "" : ", ", line_error_name(static_cast<LineError>(e)), by_error[e]);
        first_kind = false;
      }
    s += ")";
    for (const Entry& x : first)
      s += fmt::format("; line {}: {}", x.line, describe(x.error, x.field));
    if (static_cast<std::int64_t>(first.size()) < malformed) s += "; ...";
  }
  return s;
}

namespace {

// A line longer than this is refused: Criteo lines are a few hundred bytes, and a file without
// newlines (or with CR only) would otherwise be read whole into one line.
constexpr std::size_t kMaxLineBytes = std::size_t{1} << 20;
constexpr unsigned kReadBytes = 1u << 18;  // per read from zlib (and zlib's own buffer)

// Lines of a plain or gzip file (zlib reads plain files transparently).
class LineReader {
 public:
  explicit LineReader(const std::filesystem::path& path) : path_(path.string()), file_(gzopen(path.c_str(), "rb")) {
    if (!file_) throw Error("data::read_tsv", "path", "a readable file", path.string());
    gzbuffer(file_, kReadBytes);
  }
  ~LineReader() { gzclose(file_); }
  LineReader(const LineReader&) = delete;
  LineReader& operator=(const LineReader&) = delete;

  bool next(std::string_view& line) {
    while (true) {
      // Bytes before `searched_` hold no newline: each byte is scanned once (linear time).
      const std::size_t nl = buf_.find('\n', std::max(pos_, searched_));
      if (nl != std::string::npos) {
        line = std::string_view(buf_).substr(pos_, nl - pos_);
        pos_ = nl + 1;
        searched_ = pos_;
        ++lines_;
        return true;
      }
      searched_ = buf_.size();
      FK_CHECK_ARG(buf_.size() - pos_ <= kMaxLineBytes, "data::read_tsv", "path",
                   fmt::format("lines of at most {} bytes (a Criteo line is a few hundred)", kMaxLineBytes),
                   fmt::format("{}: line {} is longer", path_, lines_ + 1));
      if (eof_) {
        if (pos_ >= buf_.size()) return false;
        line = std::string_view(buf_).substr(pos_);
        pos_ = buf_.size();
        ++lines_;
        return true;
      }
      buf_.erase(0, pos_);
      searched_ -= pos_;
      pos_ = 0;
      const std::size_t old = buf_.size();
      buf_.resize(old + kReadBytes);
      const int got = gzread(file_, buf_.data() + old, kReadBytes);
      int code = Z_OK;
      const char* message = gzerror(file_, &code);
      // A truncated or corrupt gzip stream ends reads early with Z_BUF_ERROR or Z_DATA_ERROR:
      // never a silent end of file.
      if (got < 0 || (code != Z_OK && code != Z_STREAM_END))
        throw Error("data::read_tsv", "path", "a complete, uncorrupted (gzip) file",
                    fmt::format("{}: {}", path_, message));
      buf_.resize(old + static_cast<std::size_t>(got));
      if (got == 0) eof_ = true;
    }
  }

 private:
  std::string path_;
  gzFile file_;
  std::string buf_;
  std::size_t pos_ = 0, searched_ = 0;
  std::int64_t lines_ = 0;
  bool eof_ = false;
};

}  // namespace

namespace {

// Parses every line of `path`, handing each good record to `sink` and counting the bad ones.
template <class Sink>
void scan_tsv(const std::filesystem::path& path, const ReadOptions& options, ReadReport& report, Sink&& sink) {
  report = ReadReport{};
  LineReader reader(path);
  std::string_view line;
  RawRecord rec;
  while ((options.max_records < 0 || report.records < options.max_records) && reader.next(line)) {
    ++report.lines;
    if (line.empty() || line == "\r") continue;
    if (const auto issue = parse_line(line, rec)) {
      if (options.strict)
        throw Error("data::read_tsv", path.string(), "well-formed Criteo lines (strict mode)",
                    fmt::format("line {}: {}", report.lines, describe(issue->error, issue->field)));
      ++report.malformed;
      ++report.by_error[static_cast<int>(issue->error)];
      if (report.first.size() < options.max_reported) report.first.push_back({report.lines, issue->error, issue->field});
      continue;
    }
    sink(rec);
    ++report.records;
  }
}

}  // namespace

std::vector<RawRecord> read_tsv(const std::filesystem::path& path, const ReadOptions& options, ReadReport& report) {
  std::vector<RawRecord> out;
  scan_tsv(path, options, report, [&](const RawRecord& r) { out.push_back(r); });
  return out;
}

void write_tsv(const std::filesystem::path& path, std::span<const RawRecord> records) {
  RecordWriter w(path, FileFormat::tsv);
  w.write(records);
  w.close();
}


ReadReport convert_tsv_to_binary(const std::filesystem::path& tsv, const std::filesystem::path& bin,
                                 const ReadOptions& options) {
  // Streams: records go out in chunks as they are parsed (the Kaggle file is 45M records, 7 GB in
  // this format).
  // Writing the output would truncate the input before it is read: refuse the same file under any
  // name (the same path, a link, a hard link).
  std::error_code ec;
  const bool same = std::filesystem::equivalent(tsv, bin, ec);
  FK_CHECK_ARG(!ec ? !same : tsv.lexically_normal() != bin.lexically_normal(), "data::convert_tsv_to_binary", "bin",
               fmt::format("a file other than the input {}", tsv.string()), bin.string());
  ReadReport report;
  RecordWriter writer(bin, FileFormat::binary);
  std::vector<RawRecord> chunk;
  chunk.reserve(1 << 16);
  scan_tsv(tsv, options, report, [&](const RawRecord& r) {
    chunk.push_back(r);
    if (chunk.size() == chunk.capacity()) {
      writer.write(chunk);
      chunk.clear();
    }
  });
  writer.write(chunk);
  writer.close();
  return report;
}

}  // namespace fk::data
