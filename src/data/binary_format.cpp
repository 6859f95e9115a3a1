// The fusekit binary format (criteo.hpp): its header and checksums, write_binary, RecordWriter (TSV or binary,
// streamed through a temporary file), and binary_source, the memory-mapped reader.
#include "fusekit/data/criteo.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>
#include <zlib.h>
#define XXH_INLINE_ALL  // header only: no library to link
#include <xxhash.h>

#include <algorithm>
#include <limits>
#include <atomic>
#include <cerrno>
#include <bit>
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

namespace fk::data {

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

}  // namespace

std::shared_ptr<RecordSource> binary_source(const std::filesystem::path& path) {
  return std::make_shared<BinarySource>(path);
}
BinaryContent binary_content(const std::filesystem::path& path) {
  std::uint64_t bytes = 0;
  const Header h = checked_header(path, bytes);
  return h.version >= 3 && h.content == 1 ? BinaryContent{true, h.vocabulary} : BinaryContent{};
}

}  // namespace fk::data
