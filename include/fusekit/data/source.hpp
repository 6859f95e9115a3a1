// Whatever data a user names, opened by one call: a Criteo TSV file (plain or gzip), a fusekit
// binary file (criteo.hpp) or a directory of `fusekit data preprocess` shards (preprocess.hpp).
// open_source decides which from what is there (never from the name), opens it, and says what it
// opened, so that a program decides the kind of its data in one place.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "fusekit/data/criteo.hpp"
#include "fusekit/data/preprocess.hpp"

namespace fk::data {

enum class SourceKind {
  tsv,       // a Criteo TSV file
  gzip_tsv,  // the same, gzip-compressed
  binary,    // the fusekit binary format
  shards,    // a directory of fusekit data preprocess (manifest.json, vocabulary, day files)
};
std::string_view source_kind_name(SourceKind kind);  // "Criteo TSV", "Criteo TSV, gzip", ...

// The kind of data at `path`, from its content: a directory with a manifest.json is shards, a file
// with the binary format's header is binary, a file opening with gzip's magic bytes is gzip_tsv,
// any other regular file is tsv. nullopt when the path is none of them (missing, a directory
// without a manifest, not a regular file).
std::optional<SourceKind> find_source_kind(const std::filesystem::path& path);

struct SourceOptions {
  bool strict = false;  // TSV: throw fk::Error at the first malformed line (default: skip, count)
  // shards: used instead of the directory's vocabulary (it must have the manifest's fingerprint).
  std::shared_ptr<const Vocabulary> vocabulary;
  // false: a TSV is identified but not read (no records, records = -1): a dry run checks the
  // path and its kind without reading gigabytes of text. Binary files and shards are opened
  // either way (their headers are read, their records mapped, not read).
  bool read_text = true;
};

struct DataSource {
  SourceKind kind = SourceKind::tsv;
  std::filesystem::path path;
  std::shared_ptr<RecordSource> records;  // every record, in file (day) order; null for an unread TSV
  std::int64_t size = 0;                  // records; -1 for an unread TSV
  std::optional<ShardSet> shards;         // shards: the days and the vocabulary
  std::optional<ReadReport> report;       // a TSV that was read: the reader's report
  // What was opened: "PATH (Criteo TSV, gzip)", "DIR (fusekit data preprocess, kaggle, 7 days)".
  std::string name() const;
  // name() and the records: "PATH (Criteo TSV, gzip): 1000 records" ("not read" for an unread TSV).
  std::string description() const;
};

// Opens the data at `path` (find_source_kind says which kind). Throws fk::Error naming the path
// and what was expected when it is none of the kinds, and the errors of the kind's reader
// (read_tsv, binary_source, open_shards) when it cannot be read.
DataSource open_source(const std::filesystem::path& path, const SourceOptions& options = {});

}  // namespace fk::data
