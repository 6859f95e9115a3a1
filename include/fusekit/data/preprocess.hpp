// Criteo TSV files -> a directory of shards of vocabulary ids (`fusekit data preprocess`), and the
// data set such a directory holds.
//
// A data set is a sequence of days, as the DLRM reference splits Criteo:
//   kaggle    one file, cut into 7 days of n / 7 records (the first n % 7 one record more);
//   terabyte  one file per day (day_0 ... day_23, given in order; any number >= 2 is accepted);
// the last day is the test day, its first half (one record more when odd) the test set and its
// second half the validation set; the days before it train.
//
// Preprocessing streams the input in chunks (8 MiB of text) through every core, three passes at
// most: (kaggle only) count the records, to place the day boundaries; count each categorical
// feature's values over the training days (or every day); map every record to ids and write
// the day shards. Memory is bounded by the chunks in flight and the vocabulary, whatever the
// input's size. Output directory:
//   manifest.json    the data set, the days (file, records), the inputs (path, bytes, lines,
//                    records, malformed), the vocabulary's options and fingerprint
//   vocabulary.fkv   the vocabulary (vocabulary.hpp)
//   day_<d>.bin      day d's records: binary format version 4, content 1 (criteo.hpp), the
//                    categorical values replaced by their ids, the vocabulary's fingerprint in
//                    the header
// Every file is written through a temporary file renamed into place, the manifest last: a
// directory without a manifest is not a data set.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "fusekit/data/criteo.hpp"
#include "fusekit/data/vocabulary.hpp"

namespace fk::data {

struct PreprocessProgress {
  int pass = 0, passes = 0;       // 1-based
  const char* what = "";          // "records", "vocabulary", "shards"
  std::int64_t bytes = 0;         // input bytes read in this pass (compressed bytes of a .gz)
  std::int64_t total_bytes = 0;   // the inputs' sizes
  std::int64_t records = 0;       // records parsed in this pass
  double seconds = 0;             // since the pass began
};

struct PreprocessOptions {
  std::vector<std::filesystem::path> inputs;  // Criteo TSV files, plain or gzip
  std::filesystem::path out;                  // the output directory (created)
  std::string data_set = "kaggle";            // kaggle | terabyte (see the file comment)
  VocabularyOptions vocabulary;
  bool vocabulary_all_days = false;           // count the test day too (the reference's dictionaries do)
  int threads = 0;                            // 0: every core
  bool strict = false;                        // a malformed line is an error (default: skipped, counted)
  std::function<void(const PreprocessProgress&)> progress;  // called about twice a second, and at each pass's end
};

struct PreprocessReport {
  std::vector<ReadReport> inputs;        // per input file
  std::vector<std::int64_t> day_records;
  std::uint32_t fingerprint = 0;         // the vocabulary's
  std::int64_t table_rows = 0;           // the vocabulary's tables, all rows
  std::int64_t input_bytes = 0;          // the inputs' sizes
  std::vector<double> pass_seconds;
  double seconds = 0;
};

// Throws fk::Error naming the option for bad options (no input, kaggle with more than one, a
// terabyte set of fewer than 2 days, an output directory that is one of the inputs), and naming
// the file and line for unreadable input or, in strict mode, a malformed line.
PreprocessReport preprocess(const PreprocessOptions& options);

// A preprocessed data set, opened and checked: the manifest, the vocabulary's CRC and that its
// fingerprint is the manifest's, and every day file's header (vocabulary ids, that fingerprint,
// the manifest's record count). Records are read memory-mapped, each block's checksum checked on
// first use.
struct ShardSet {
  std::filesystem::path directory;
  std::string data_set;
  std::shared_ptr<const Vocabulary> vocabulary;
  std::vector<std::shared_ptr<RecordSource>> days;
  std::vector<std::int64_t> day_begin;  // day d is records [day_begin[d], day_begin[d + 1]) of all()
  std::shared_ptr<RecordSource> all() const;
  // The reference's split (file comment): training [0, train_end), test, validation.
  std::int64_t train_end() const { return day_begin[day_begin.size() - 2]; }
  std::int64_t test_begin() const { return train_end(); }
  std::int64_t test_end() const;
  std::int64_t val_end() const { return day_begin.back(); }
};

bool is_shard_directory(const std::filesystem::path& path);  // a directory with a manifest.json
// `vocabulary`, when given, is used instead of loading the directory's (it must have the
// manifest's fingerprint).
ShardSet open_shards(const std::filesystem::path& directory, std::shared_ptr<const Vocabulary> vocabulary = nullptr);

}  // namespace fk::data
