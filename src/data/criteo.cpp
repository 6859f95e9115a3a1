// Criteo TSV reading and writing, the featurizer (hash and dense transform), the binary format.
#include "fusekit/data/criteo.hpp"
#include "fusekit/data/vocabulary.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>
#include <zlib.h>
#define XXH_INLINE_ALL  // header only: no library to link
#include <xxhash.h>

#include <algorithm>
#include <limits>
#include <random>
#include <atomic>
#include <cerrno>
#include <bit>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <array>
#include <fstream>
#include <thread>
#include <sys/mman.h>
#include <sys/stat.h>

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

// ---------------------------------------------------------------------------------------------
// Binary format
// ---------------------------------------------------------------------------------------------

namespace {

constexpr char kMagic[8] = {'F', 'K', 'C', 'R', 'I', 'T', 'E', 'O'};
constexpr std::uint32_t kVersion = 4;  // written; versions 1 to 3 are still read
constexpr std::size_t kHeaderBytes = 64;
constexpr std::size_t kRecordBytes = 4 + 4 * kNumDense + 4 * kNumSparse;
constexpr std::uint32_t kBlockRecords = 4096;  // records per checksummed block (640 KiB)
constexpr std::uint32_t kMaxBlockRecords = 1u << 20;
static_assert(kRecordBytes == 160);
static_assert(sizeof(RawRecord) == kRecordBytes, "RawRecord is stored as is");

struct Header {
  char magic[8];
  std::uint32_t version, num_dense, num_sparse, record_bytes;
  std::uint64_t count;
  std::uint32_t block_records;  // version 2 on
  std::uint32_t content;        // version 3: 1; version 4: 0 raw values, 1 vocabulary ids
  std::uint32_t vocabulary;     // content 1: the vocabulary's fingerprint
  char pad[kHeaderBytes - 48];
  std::uint32_t header_crc;  // version 2 on: CRC-32 of the 60 bytes before it
};
static_assert(sizeof(Header) == kHeaderBytes);
static_assert(offsetof(Header, count) == 24 && offsetof(Header, block_records) == 32 &&
              offsetof(Header, content) == 36 && offsetof(Header, vocabulary) == 40 &&
              offsetof(Header, header_crc) == 60);

std::uint32_t crc32_of(std::uint32_t crc, const void* data, std::size_t bytes) {
  return static_cast<std::uint32_t>(::crc32_z(crc, static_cast<const Bytef*>(data), bytes));
}

std::uint32_t header_crc(const Header& h) { return crc32_of(0, &h, offsetof(Header, header_crc)); }

// The checksums after the records: one per block and the table's own, each a CRC-32 (versions 2
// and 3) or an XXH3-64 (version 4, which a core computes at memory speed: a first epoch in a
// random order checks every block at its start). None in version 1.
constexpr std::size_t checksum_bytes(std::uint32_t version) { return version >= 4 ? 8 : version >= 2 ? 4 : 0; }
std::uint64_t checksum(std::uint32_t version, const void* data, std::size_t bytes) {
  return version >= 4 ? XXH3_64bits(data, bytes) : crc32_of(0, data, bytes);
}
const char* checksum_name(std::uint32_t version) { return version >= 4 ? "XXH3-64" : "CRC-32"; }

Header make_header(std::uint64_t count, const BinaryContent& content) {
  Header h{};
  std::memcpy(h.magic, kMagic, 8);
  h.version = kVersion;
  h.content = content.ids ? 1 : 0;
  h.vocabulary = content.ids ? content.vocabulary : 0;
  h.num_dense = kNumDense;
  h.num_sparse = kNumSparse;
  h.record_bytes = kRecordBytes;
  h.count = count;
  h.block_records = kBlockRecords;
  h.header_crc = header_crc(h);
  return h;
}

std::uint64_t num_blocks(std::uint64_t count, std::uint32_t block_records) {
  return count / block_records + (count % block_records != 0);
}

std::optional<Header> read_header(const std::filesystem::path& path) {
  std::ifstream f(path, std::ios::binary);
  Header h{};
  if (!f.read(reinterpret_cast<char*>(&h), sizeof h)) return std::nullopt;
  if (std::memcmp(h.magic, kMagic, 8) != 0) return std::nullopt;
  return h;
}

}  // namespace

void write_binary(const std::filesystem::path& path, std::span<const RawRecord> records, BinaryContent content) {
  RecordWriter w(path, FileFormat::binary, content);
  w.write(records);
  w.close();
}

RecordWriter::RecordWriter(std::filesystem::path path, FileFormat format, BinaryContent content)
    : path_(std::move(path)), tmp_(path_.string() + ".tmp"), format_(format), content_(content) {
  FK_CHECK_ARG(format == FileFormat::binary || !content.ids, "data::RecordWriter", "content",
               "raw values in a TSV file", "vocabulary ids");
  out_ = std::make_unique<std::ofstream>(tmp_, std::ios::binary | std::ios::trunc);
  if (!*out_) throw Error("data::RecordWriter", "path", "a writable file", tmp_.string());
  if (format_ == FileFormat::binary) {
    const Header h = make_header(0, content_);  // the count is written at close()
    out_->write(reinterpret_cast<const char*>(&h), sizeof h);
  }
}

RecordWriter::~RecordWriter() {
  if (out_) {
    out_.reset();
    std::error_code ignored;
    std::filesystem::remove(tmp_, ignored);
  }
}

namespace {

void append_tsv(std::span<const RawRecord> records, std::string& out) {
  for (const RawRecord& r : records) {
    out += static_cast<char>('0' + r.label);
    for (std::int32_t x : r.dense) fmt::format_to(std::back_inserter(out), "\t{}", x);
    for (std::uint32_t v : r.sparse) fmt::format_to(std::back_inserter(out), "\t{:08x}", v);
    out += '\n';
  }
}

}  // namespace

void RecordWriter::write(std::span<const RawRecord> records, int threads) {
  FK_CHECK_ARG(out_ != nullptr, "data::RecordWriter::write", "this", "an open writer", "a closed one");
  if (format_ == FileFormat::binary) {
    out_->write(reinterpret_cast<const char*>(records.data()), static_cast<std::streamsize>(records.size_bytes()));
    // Whole blocks are summed where they lie; a block that spans calls is gathered first.
    for (std::size_t i = 0; i < records.size();) {
      const std::size_t n = std::min<std::size_t>(records.size() - i, kBlockRecords - open_block_.size());
      if (open_block_.empty() && n == kBlockRecords) {
        block_sums_.push_back(checksum(kVersion, records.data() + i, n * kRecordBytes));
      } else {
        open_block_.insert(open_block_.end(), records.begin() + static_cast<std::ptrdiff_t>(i),
                           records.begin() + static_cast<std::ptrdiff_t>(i + n));
        if (open_block_.size() == kBlockRecords) {
          block_sums_.push_back(checksum(kVersion, open_block_.data(), open_block_.size() * kRecordBytes));
          open_block_.clear();
        }
      }
      i += n;
    }
  } else {
    // Each thread formats a contiguous part; the parts are written in order.
    const std::size_t parts = std::clamp<std::size_t>(static_cast<std::size_t>(std::max(threads, 1)), 1,
                                                      std::max<std::size_t>(records.size() / 1024, 1));
    std::vector<std::string> text(parts);
    const std::size_t per = (records.size() + parts - 1) / parts;
    auto format = [&](std::size_t p) {
      const std::size_t b = std::min(records.size(), p * per);
      append_tsv(records.subspan(b, std::min(per, records.size() - b)), text[p]);
    };
    if (parts == 1) {
      format(0);
    } else {
      std::vector<std::thread> pool;
      for (std::size_t p = 0; p < parts; ++p) pool.emplace_back(format, p);
      for (std::thread& t : pool) t.join();
    }
    for (const std::string& t : text) out_->write(t.data(), static_cast<std::streamsize>(t.size()));
  }
  count_ += static_cast<std::int64_t>(records.size());
  if (!*out_) throw Error("data::RecordWriter::write", "path", "a complete write", tmp_.string());
}

void RecordWriter::close() {
  FK_CHECK_ARG(out_ != nullptr, "data::RecordWriter::close", "this", "an open writer", "a closed one");
  if (format_ == FileFormat::binary) {
    if (!open_block_.empty())
      block_sums_.push_back(checksum(kVersion, open_block_.data(), open_block_.size() * kRecordBytes));
    static_assert(checksum_bytes(kVersion) == sizeof(std::uint64_t));
    block_sums_.push_back(checksum(kVersion, block_sums_.data(), block_sums_.size() * sizeof(std::uint64_t)));  // the table's own
    out_->write(reinterpret_cast<const char*>(block_sums_.data()),
                static_cast<std::streamsize>(block_sums_.size() * sizeof(std::uint64_t)));
    const Header h = make_header(static_cast<std::uint64_t>(count_), content_);
    out_->seekp(0);
    out_->write(reinterpret_cast<const char*>(&h), sizeof h);
  }
  out_->flush();
  if (!*out_) throw Error("data::RecordWriter::close", "path", "a complete write", tmp_.string());
  out_.reset();
  std::filesystem::rename(tmp_, path_);
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

bool is_binary_file(const std::filesystem::path& path) { return read_header(path).has_value(); }

namespace {

// Opens and checks a binary file's header: the header and its CRC, the counts, the file's exact
// size. Returns the header; `bytes` gets the file's size.
Header checked_header(const std::filesystem::path& path, std::uint64_t& bytes) {
  const std::optional<Header> h = read_header(path);
  if (!h) throw Error("data::binary_source", "path", "a fusekit Criteo binary file (FKCRITEO header)", path.string());
  if (h->version >= 2 && h->header_crc != header_crc(*h))
    throw Error("data::binary_source", "path", "a header matching its CRC-32",
                fmt::format("{}: a damaged header", path.string()));
  if (h->version < 1 || h->version > kVersion || h->num_dense != kNumDense || h->num_sparse != kNumSparse ||
      h->record_bytes != kRecordBytes)
    throw Error("data::binary_source", "path", "version 1 to 4, 13 dense, 26 sparse, 160-byte records",
                fmt::format("{}: version {}, {} dense, {} sparse, {}-byte records", path.string(), h->version,
                            h->num_dense, h->num_sparse, h->record_bytes));
  if (h->version == 3 && h->content != 1)
    throw Error("data::binary_source", "path", "content 1 (vocabulary ids) in a version 3 file",
                fmt::format("{}: content {}", path.string(), h->content));
  if (h->version >= 4 && (h->content > 1 || (h->content == 0 && h->vocabulary != 0)))
    throw Error("data::binary_source", "path",
                "content 0 (raw values, no vocabulary) or 1 (vocabulary ids) in a version 4 file",
                fmt::format("{}: content {}, vocabulary {:08x}", path.string(), h->content, h->vocabulary));
  const std::uint32_t block_records = h->version >= 2 ? h->block_records : 0;
  if (h->version >= 2 && (block_records == 0 || block_records > kMaxBlockRecords))
    throw Error("data::binary_source", "path", fmt::format("1 to {} records per block", kMaxBlockRecords),
                fmt::format("{}: {}", path.string(), block_records));
  // The file holds exactly the header, `count` records and (version 2 on) the checksum table: no
  // product that could wrap (a 4.8 MB file claimed 1.15e17 records), no count past 2^63, no
  // short or trailing bytes.
  bytes = std::filesystem::file_size(path);
  const std::uint64_t max_count = static_cast<std::uint64_t>(INT64_MAX) / kRecordBytes;
  const std::uint64_t blocks = block_records ? num_blocks(h->count, block_records) : 0;
  const std::uint64_t trailer = block_records ? (blocks + 1) * checksum_bytes(h->version) : 0;
  const bool exact = h->count <= max_count && bytes >= kHeaderBytes + trailer &&
                     (bytes - kHeaderBytes - trailer) % kRecordBytes == 0 &&
                     (bytes - kHeaderBytes - trailer) / kRecordBytes == h->count;
  if (!exact)
    throw Error("data::binary_source", "path",
                fmt::format("a file of {} header bytes, {} records of {} bytes (the header's count) and {} "
                            "checksum bytes",
                            kHeaderBytes, h->count, kRecordBytes, trailer),
                fmt::format("{}: {} bytes", path.string(), bytes));
  return *h;
}

// A binary file mapped into memory (read-only, shared: the page cache is the only copy). A file
// truncated by another process while it is mapped ends the process with SIGBUS; files are
// written through a temporary file renamed into place, so fusekit's own writers never do that.
class BinarySource final : public RecordSource {
 public:
  explicit BinarySource(const std::filesystem::path& path) : path_(path) {
    std::uint64_t bytes = 0;
    const Header h = checked_header(path, bytes);
    version_ = h.version;
    block_records_ = h.version >= 2 ? h.block_records : 0;
    count_ = static_cast<std::int64_t>(h.count);
    const int fd = ::open(path.c_str(), O_RDONLY);
    if (fd < 0)
      throw Error("data::binary_source", "path", "a readable file",
                  fmt::format("{}: {}", path.string(), std::strerror(errno)));
    map_bytes_ = static_cast<std::size_t>(bytes);
    void* m = ::mmap(nullptr, map_bytes_, PROT_READ, MAP_SHARED, fd, 0);
    const int map_errno = errno;
    ::close(fd);
    if (m == MAP_FAILED)
      throw Error("data::binary_source", "path", "a file that can be mapped into memory",
                  fmt::format("{}: {}", path.string(), std::strerror(map_errno)));
    map_ = static_cast<const char*>(m);
    if (block_records_) {
      const std::uint64_t blocks = num_blocks(h.count, block_records_);
      const std::size_t sum_bytes = checksum_bytes(version_);
      const char* table = map_ + kHeaderBytes + h.count * kRecordBytes;
      block_sums_.resize(blocks + 1);
      for (std::uint64_t b = 0; b <= blocks; ++b) {  // little-endian u32 or u64
        std::uint64_t v = 0;
        std::memcpy(&v, table + b * sum_bytes, sum_bytes);
        block_sums_[b] = v;
      }
      if (block_sums_.back() != checksum(version_, table, blocks * sum_bytes)) {
        ::munmap(const_cast<char*>(map_), map_bytes_);
        throw Error("data::binary_source", "path",
                    fmt::format("a block checksum table matching its {}", checksum_name(version_)),
                    fmt::format("{}: a damaged table", path.string()));
      }
      block_sums_.pop_back();
      state_ = std::make_unique<std::atomic<std::uint8_t>[]>(blocks);
    }
  }
  ~BinarySource() override { ::munmap(const_cast<char*>(map_), map_bytes_); }
  std::int64_t size() const override { return count_; }
  const RawRecord* mapped(std::int64_t i) const override {
    if (block_records_) verify_block(static_cast<std::uint64_t>(i) / block_records_);
    return reinterpret_cast<const RawRecord*>(map_ + kHeaderBytes + static_cast<std::uint64_t>(i) * kRecordBytes);
  }
  void read(std::int64_t begin, std::span<RawRecord> out) const override {
    FK_CHECK_ARG(begin >= 0 && begin <= count_ && static_cast<std::int64_t>(out.size()) <= count_ - begin,
                 "data::binary_source", "begin", fmt::format("a range inside [0, {})", count_),
                 fmt::format("[{}, {})", begin, begin + static_cast<std::int64_t>(out.size())));
    if (out.empty()) return;
    if (block_records_) {
      const std::uint64_t end = static_cast<std::uint64_t>(begin) + out.size();
      for (std::uint64_t b = static_cast<std::uint64_t>(begin) / block_records_; b * block_records_ < end; ++b)
        verify_block(b);
    }
    std::memcpy(out.data(), map_ + kHeaderBytes + static_cast<std::uint64_t>(begin) * kRecordBytes, out.size_bytes());
    for (std::size_t i = 0; i < out.size(); ++i)  // a damaged record never reaches the model
      FK_CHECK_ARG(out[i].label == 0 || out[i].label == 1, "data::binary_source", "path", "labels 0 or 1",
                   fmt::format("{}: label {} in record {}", path_.string(), out[i].label, begin + static_cast<std::int64_t>(i)));
  }

 private:
  // Checks a block against its checksum the first time it is read. One thread checks a block; the
  // others that need it meanwhile wait for its result instead of checking it again (a random
  // order touches every block within its first batches).
  enum : std::uint8_t { kUnverified, kChecking, kVerified };
  void verify_block(std::uint64_t b) const {
    std::atomic<std::uint8_t>& state = state_[b];
    while (true) {
      std::uint8_t s = state.load(std::memory_order_acquire);
      if (s == kVerified) return;
      if (s == kChecking) {
        state.wait(kChecking, std::memory_order_acquire);
        continue;
      }
      if (!state.compare_exchange_strong(s, kChecking, std::memory_order_acq_rel)) continue;
      const std::uint64_t first = b * block_records_;
      const std::uint64_t n = std::min<std::uint64_t>(block_records_, static_cast<std::uint64_t>(count_) - first);
      const char* records = map_ + kHeaderBytes + first * kRecordBytes;
      const bool ok = checksum(version_, records, n * kRecordBytes) == block_sums_[b];
      state.store(ok ? kVerified : kUnverified, std::memory_order_release);  // a waiter rechecks a bad block
      state.notify_all();
      if (!ok)
        throw Error("data::binary_source", "path",
                    fmt::format("records matching their block's {}", checksum_name(version_)),
                    fmt::format("{}: records {} to {} are damaged", path_.string(), first, first + n - 1));
      return;
    }
  }

  std::filesystem::path path_;
  std::int64_t count_ = 0;
  std::uint32_t version_ = 0;
  std::uint32_t block_records_ = 0;  // 0: version 1, no checksums
  std::vector<std::uint64_t> block_sums_;
  std::unique_ptr<std::atomic<std::uint8_t>[]> state_;  // per block
  const char* map_ = nullptr;
  std::size_t map_bytes_ = 0;
};

class MemorySource final : public RecordSource {
 public:
  explicit MemorySource(std::vector<RawRecord> r) : records_(std::move(r)) {}
  std::int64_t size() const override { return static_cast<std::int64_t>(records_.size()); }
  const RawRecord* mapped(std::int64_t i) const override { return &records_[static_cast<std::size_t>(i)]; }
  void read(std::int64_t begin, std::span<RawRecord> out) const override {
    FK_CHECK_ARG(begin >= 0 && begin + static_cast<std::int64_t>(out.size()) <= size(), "data::memory_source", "begin",
                 fmt::format("a range inside [0, {})", size()), fmt::format("[{}, {})", begin, begin + out.size()));
    std::copy_n(records_.begin() + begin, out.size(), out.begin());
  }

 private:
  std::vector<RawRecord> records_;
};

class SliceSource final : public RecordSource {
 public:
  SliceSource(std::shared_ptr<RecordSource> s, std::int64_t begin, std::int64_t end)
      : source_(std::move(s)), begin_(begin), end_(end) {
    FK_CHECK_ARG(0 <= begin && begin <= end && end <= source_->size(), "data::slice_source", "end",
                 fmt::format("0 <= begin <= end <= {}", source_->size()), fmt::format("[{}, {})", begin, end));
  }
  std::int64_t size() const override { return end_ - begin_; }
  const RawRecord* mapped(std::int64_t i) const override { return source_->mapped(begin_ + i); }
  void read(std::int64_t begin, std::span<RawRecord> out) const override {
    // Inside the slice: a read past its end must not reach the records after it (the test set).
    FK_CHECK_ARG(begin >= 0 && begin <= size() && static_cast<std::int64_t>(out.size()) <= size() - begin,
                 "data::slice_source", "begin", fmt::format("a range inside [0, {})", size()),
                 fmt::format("{} records at {}", out.size(), begin));
    source_->read(begin_ + begin, out);
  }

 private:
  std::shared_ptr<RecordSource> source_;
  std::int64_t begin_, end_;
};

class OrderedSource final : public RecordSource {
 public:
  OrderedSource(std::shared_ptr<RecordSource> s, std::vector<std::int64_t> order)
      : source_(std::move(s)), order_(std::move(order)) {
    const std::int64_t n = source_->size();
    for (std::size_t i = 0; i < order_.size(); ++i)
      FK_CHECK_ARG(order_[i] >= 0 && order_[i] < n, "data::ordered_source", "order",
                   fmt::format("indices in [0, {})", n), fmt::format("{} at position {}", order_[i], i));
  }
  std::int64_t size() const override { return static_cast<std::int64_t>(order_.size()); }
  void read(std::int64_t begin, std::span<RawRecord> out) const override {
    FK_CHECK_ARG(begin >= 0 && begin <= size() && static_cast<std::int64_t>(out.size()) <= size() - begin,
                 "data::ordered_source", "begin", fmt::format("a range inside [0, {})", size()),
                 fmt::format("{} records at {}", out.size(), begin));
    if (out.empty()) return;
    if (source_->mapped(order_[static_cast<std::size_t>(begin)]) != nullptr) {
      // Records in memory: their addresses first (verifying their blocks), then copies that
      // prefetch a few records ahead, so that the random order's cache misses overlap.
      constexpr std::size_t kAhead = 12;
      thread_local std::vector<const RawRecord*> at;
      at.resize(out.size());
      for (std::size_t i = 0; i < out.size(); ++i) at[i] = source_->mapped(order_[static_cast<std::size_t>(begin) + i]);
      for (std::size_t i = 0; i < out.size(); ++i) {
        if (i + kAhead < out.size()) {
          const char* p = reinterpret_cast<const char*>(at[i + kAhead]);
          __builtin_prefetch(p);
          __builtin_prefetch(p + 64);
          __builtin_prefetch(p + sizeof(RawRecord) - 1);
        }
        out[i] = *at[i];
      }
      return;
    }
    // Runs of consecutive indices (the file order, or a day's) are read at once.
    for (std::size_t i = 0; i < out.size();) {
      const std::int64_t first = order_[static_cast<std::size_t>(begin) + i];
      std::size_t run = 1;
      while (i + run < out.size() && order_[static_cast<std::size_t>(begin) + i + run] == first + static_cast<std::int64_t>(run))
        ++run;
      source_->read(first, out.subspan(i, run));
      i += run;
    }
  }

 private:
  std::shared_ptr<RecordSource> source_;
  std::vector<std::int64_t> order_;
};

class ConcatSource final : public RecordSource {
 public:
  explicit ConcatSource(std::vector<std::shared_ptr<RecordSource>> s) : sources_(std::move(s)) {
    begin_.push_back(0);
    for (std::size_t i = 0; i < sources_.size(); ++i) {
      FK_CHECK_ARG(sources_[i] != nullptr, "data::concat_source", "sources", "non-null sources",
                   fmt::format("null at {}", i));
      begin_.push_back(begin_.back() + sources_[i]->size());
    }
  }
  std::int64_t size() const override { return begin_.back(); }
  const RawRecord* mapped(std::int64_t i) const override {
    const std::size_t s = static_cast<std::size_t>(std::upper_bound(begin_.begin(), begin_.end(), i) - begin_.begin()) - 1;
    return sources_[s]->mapped(i - begin_[s]);
  }
  void read(std::int64_t begin, std::span<RawRecord> out) const override {
    FK_CHECK_ARG(begin >= 0 && begin <= size() && static_cast<std::int64_t>(out.size()) <= size() - begin,
                 "data::concat_source", "begin", fmt::format("a range inside [0, {})", size()),
                 fmt::format("{} records at {}", out.size(), begin));
    // The source holding `begin`: the last one starting at or before it (empty ones skipped).
    std::size_t s = static_cast<std::size_t>(std::upper_bound(begin_.begin(), begin_.end(), begin) - begin_.begin()) - 1;
    for (std::size_t i = 0; i < out.size(); ++s) {
      const std::int64_t at = begin + static_cast<std::int64_t>(i);
      const std::size_t n = static_cast<std::size_t>(std::min<std::int64_t>(begin_[s + 1] - at, static_cast<std::int64_t>(out.size() - i)));
      if (n == 0) continue;
      sources_[s]->read(at - begin_[s], out.subspan(i, n));
      i += n;
    }
  }

 private:
  std::vector<std::shared_ptr<RecordSource>> sources_;
  std::vector<std::int64_t> begin_;  // source i holds records [begin_[i], begin_[i + 1])
};

}  // namespace

std::shared_ptr<RecordSource> memory_source(std::vector<RawRecord> records) {
  return std::make_shared<MemorySource>(std::move(records));
}
std::shared_ptr<RecordSource> binary_source(const std::filesystem::path& path) {
  return std::make_shared<BinarySource>(path);
}
std::shared_ptr<RecordSource> concat_source(std::vector<std::shared_ptr<RecordSource>> sources) {
  return std::make_shared<ConcatSource>(std::move(sources));
}
BinaryContent binary_content(const std::filesystem::path& path) {
  std::uint64_t bytes = 0;
  const Header h = checked_header(path, bytes);
  return h.version >= 3 && h.content == 1 ? BinaryContent{true, h.vocabulary} : BinaryContent{};
}
std::shared_ptr<RecordSource> slice_source(std::shared_ptr<RecordSource> source, std::int64_t begin, std::int64_t end) {
  return std::make_shared<SliceSource>(std::move(source), begin, end);
}
std::shared_ptr<RecordSource> ordered_source(std::shared_ptr<RecordSource> source, std::vector<std::int64_t> order) {
  return std::make_shared<OrderedSource>(std::move(source), std::move(order));
}

ReferenceSplit kaggle_split(std::int64_t records) {
  FK_CHECK_ARG(records >= 0, "data::kaggle_split", "records", ">= 0", std::to_string(records));
  constexpr std::int64_t kDays = 7;
  ReferenceSplit s;
  s.day_begin.assign(kDays + 1, 0);
  for (std::int64_t d = 0; d < kDays; ++d)
    s.day_begin[static_cast<std::size_t>(d + 1)] = s.day_begin[static_cast<std::size_t>(d)] + records / kDays +
                                                   (d < records % kDays ? 1 : 0);
  s.train_end = s.day_begin[kDays - 1];
  const std::int64_t last = records - s.train_end;
  s.test_begin = s.train_end;
  s.test_end = s.test_begin + (last + 1) / 2;  // np.array_split: the first part takes the extra record
  s.val_begin = s.test_end;
  s.val_end = records;
  return s;
}

std::vector<std::int64_t> training_order(std::span<const std::int64_t> day_begin, std::string_view randomize,
                                         std::uint64_t seed) {
  FK_CHECK_ARG(!day_begin.empty() && day_begin.front() == 0, "data::training_order", "day_begin",
               "day boundaries starting at 0", fmt::format("{} entries", day_begin.size()));
  for (std::size_t d = 1; d < day_begin.size(); ++d)
    FK_CHECK_ARG(day_begin[d] >= day_begin[d - 1], "data::training_order", "day_begin", "non-decreasing boundaries",
                 fmt::format("{} after {}", day_begin[d], day_begin[d - 1]));
  std::vector<std::int64_t> order(static_cast<std::size_t>(day_begin.back()));
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = static_cast<std::int64_t>(i);
  std::mt19937_64 engine(seed);
  // Fisher-Yates over [first, last) with unbiased bounded draws (rejection).
  const auto shuffle = [&](std::int64_t first, std::int64_t last) {
    for (std::int64_t i = last - first - 1; i > 0; --i) {
      const std::uint64_t bound = static_cast<std::uint64_t>(i) + 1;
      const std::uint64_t limit = std::numeric_limits<std::uint64_t>::max() - std::numeric_limits<std::uint64_t>::max() % bound;
      std::uint64_t x;
      do x = engine(); while (x >= limit);
      std::swap(order[static_cast<std::size_t>(first + i)], order[static_cast<std::size_t>(first) + x % bound]);
    }
  };
  if (randomize == "total") {
    shuffle(0, day_begin.back());
  } else if (randomize == "day") {
    for (std::size_t d = 0; d + 1 < day_begin.size(); ++d) shuffle(day_begin[d], day_begin[d + 1]);
  } else if (randomize != "none") {
    throw Error("data::training_order", "randomize", "total, day or none", std::string(randomize));
  }
  return order;
}

}  // namespace fk::data
