// open_source: the one place that decides what kind of data a path holds (source.hpp).
#include "fusekit/data/source.hpp"

#include <fmt/format.h>

#include <fstream>
#include <system_error>

#include "fusekit/core/error.hpp"

namespace fk::data {

namespace {

constexpr const char* kOp = "data::open_source";
constexpr const char* kExpected =
    "a Criteo TSV file (plain or gzip), a fusekit binary file, or a directory of fusekit data preprocess "
    "(with a manifest.json)";

bool starts_with_gzip_magic(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  unsigned char magic[2] = {0, 0};
  in.read(reinterpret_cast<char*>(magic), 2);
  return in.gcount() == 2 && magic[0] == 0x1f && magic[1] == 0x8b;
}

// Why `path` is none of the kinds, for the error.
std::string what_is_there(const std::filesystem::path& path) {
  std::error_code ec;
  const std::filesystem::file_status s = std::filesystem::status(path, ec);
  if (!std::filesystem::exists(s)) return fmt::format("{} (no such file or directory)", path.string());
  if (std::filesystem::is_directory(s)) return fmt::format("{} (a directory without a manifest.json)", path.string());
  return fmt::format("{} (not a regular file)", path.string());
}

}  // namespace

std::string_view source_kind_name(SourceKind kind) {
  switch (kind) {
    case SourceKind::tsv: return "Criteo TSV";
    case SourceKind::gzip_tsv: return "Criteo TSV, gzip";
    case SourceKind::binary: return "fusekit binary";
    case SourceKind::shards: return "fusekit data preprocess";
  }
  return "?";
}

std::optional<SourceKind> find_source_kind(const std::filesystem::path& path) {
  std::error_code ec;
  if (is_shard_directory(path)) return SourceKind::shards;
  if (!std::filesystem::is_regular_file(path, ec)) return std::nullopt;
  if (is_binary_file(path)) return SourceKind::binary;
  return starts_with_gzip_magic(path) ? SourceKind::gzip_tsv : SourceKind::tsv;
}

DataSource open_source(const std::filesystem::path& path, const SourceOptions& options) {
  const std::optional<SourceKind> kind = find_source_kind(path);
  FK_CHECK_ARG(kind.has_value(), kOp, "path", kExpected, what_is_there(path));
  DataSource s;
  s.kind = *kind;
  s.path = path;
  switch (*kind) {
    case SourceKind::shards:
      s.shards = open_shards(path, options.vocabulary);
      s.records = s.shards->all();
      break;
    case SourceKind::binary:
      s.records = binary_source(path);
      break;
    case SourceKind::tsv:
    case SourceKind::gzip_tsv:
      if (!options.read_text) {
        s.size = -1;
        return s;
      }
      s.report.emplace();
      s.records = memory_source(read_tsv(path, {.strict = options.strict}, *s.report));
      break;
  }
  s.size = s.records->size();
  return s;
}

std::string DataSource::name() const {
  if (shards)
    return fmt::format("{} ({}, {}, {} days)", path.string(), source_kind_name(kind), shards->data_set,
                       shards->days.size());
  return fmt::format("{} ({})", path.string(), source_kind_name(kind));
}

std::string DataSource::description() const {
  return size < 0 ? name() + ": not read" : fmt::format("{}: {} records", name(), size);
}

}  // namespace fk::data
