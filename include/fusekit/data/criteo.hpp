// Criteo click data (family `data`): the raw Kaggle/Terabyte TSV format, a synthetic Criteo-like
// generator whose labels a model can learn, a compact binary format, and a batch loader that
// prefetches on background threads.
//
// One sample of the Criteo format is a RawRecord: a 0/1 label, 13 integer ("count") features and
// 26 categorical features given as 32-bit hex strings. Turning a RawRecord into model input is
// the same everywhere (reader, binary file, synthetic data):
//   dense[j]  = log(1 + max(x_j, 0))       (missing integers are 0; negatives are clamped to 0)
//   sparse[t] = hash(v_t) in [0, rows_t)   (missing categoricals are 0)
// where rows_t = min(cardinality_t, max_ind_range) (max_ind_range <= 0: no cap) and the hash is
//   HashMode::seed       (v + 1) % rows_t   -- a plain modulus hash
//   HashMode::reference  v % rows_t         -- dlrm_s_pytorch.py's `% max_ind_range`
//
// Batches are host tensors laid out for the model and for a later copy to the GPU:
//   labels  f32 [B]
//   dense   f32 [B, 13]
//   indices i64 [nnz]        rows of all tables, table-major: table 0's bags, then table 1's, ...
//   offsets i64 [26 * B + 1] bag (t, b) is indices[offsets[t*B + b], offsets[t*B + b + 1])
//   raw_sparse i32 [26 * B]  the unhashed values, table-major (for a lookup with the hash fused in)
// (TorchRec's KeyedJaggedTensor layout; Criteo data has one index per bag, so offsets = 0..26B.)
#pragma once

#include <array>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <iosfwd>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fusekit/core/hash.hpp"
#include "fusekit/core/tensor.hpp"

namespace fk::data {

inline constexpr int kNumDense = 13;
inline constexpr int kNumSparse = 26;

// The 26 table sizes of the MLPerf DLRM model: the Criteo Terabyte data set's distinct values of
// each feature after the raw value modulo 40,000,000 (the reference's --max-ind-range=40000000).
inline constexpr std::array<std::int64_t, kNumSparse> kMlperfTerabyteCardinalities = {
    39884406, 39043, 17289, 7420, 20263, 3,  7120,     1543,     63,       38532951, 2953546, 403346, 10,
    2208,     11938, 155,   4,    976,   14, 39979771, 25641295, 39664984, 585935,   12972,   108,    36};

// The 26 table sizes of the Criteo Kaggle (Display Advertising Challenge) data set.
inline constexpr std::array<std::int64_t, kNumSparse> kKaggleCardinalities = {
    1460,   583,  10131227, 2202608, 305,     24,   12517, 633, 3,      93145, 5683, 8351593, 3194,
    27,     14992, 5461306, 10,      5652,    2173, 4,     7046547, 18, 15,    286181, 105, 142572};

struct RawRecord {
  std::int32_t label = 0;                         // 0 or 1
  std::array<std::int32_t, kNumDense> dense{};    // as written, may be negative
  std::array<std::uint32_t, kNumSparse> sparse{}; // the hex values
};

// The embedding lookup's own hash setting (core/hash.hpp): one enum from the data to the kernel.
using HashMode = RowHash;
HashMode parse_hash_mode(std::string_view name);  // "seed" | "reference"
std::string_view hash_mode_name(HashMode m);

class Vocabulary;  // vocabulary.hpp

// How raw values become model input (see the file comment). With a vocabulary, sparse[t] is the
// value's id in it instead (vocabulary.hpp) and the tables have its sizes; the hash must then be
// reference, under which the raw path's in-kernel v % rows passes the ids (written to
// raw_sparse too) through unchanged.
struct Featurizer {
  std::vector<std::int64_t> cardinalities = {kKaggleCardinalities.begin(), kKaggleCardinalities.end()};
  std::int64_t max_ind_range = 0;  // <= 0: tables as large as the cardinalities
  HashMode hash = HashMode::seed;
  std::shared_ptr<const Vocabulary> vocabulary;  // when set: ids and table sizes from it
  // The records' categorical values are this vocabulary's ids already (preprocessed shards):
  // each is checked to be below its table's rows and passed through.
  bool premapped = false;
  // Multi-hot bags (the MLPerf DLRM-DCNv2 model's): empty for one-hot, else 26 bag sizes >= 1.
  // Bag (t, b) holds multi_hot_sizes[t] rows: the record's row r (as one-hot), then
  // (r + offset(t, k)) % rows(t) for k = 1 .. size - 1, the offsets a fixed pseudo-random
  // function of (t, k). The extra rows are a function of the first, so the labels stay as learnable
  // as the one-hot data's. Batches then carry CSR bags only (no raw_sparse).
  std::vector<std::int64_t> multi_hot_sizes;

  // Throws fk::Error unless there are 26 cardinalities, all >= 1 (and, with a vocabulary, the
  // hash is reference; premapped needs a vocabulary; multi_hot_sizes empty or 26 sizes >= 1).
  void validate() const;
  std::int64_t rows(int table) const;      // min(cardinality, max_ind_range), or the vocabulary's
  std::vector<std::int64_t> table_rows() const;
  // The row of value v; premapped: v itself, or fk::Error when v is not below rows(table).
  std::int64_t hash_index(int table, std::uint32_t v) const;
  static float dense_transform(std::int32_t x);  // log(1 + max(x, 0))
  bool multi_hot() const noexcept { return !multi_hot_sizes.empty(); }
  // Entry k of a multi-hot bag of `table` whose first row is `row` (k = 0: row itself).
  std::int64_t multi_hot_row(int table, std::int64_t row, std::int64_t k) const;
};

// ---------------------------------------------------------------------------------------------
// TSV reader
// ---------------------------------------------------------------------------------------------

enum class LineError { field_count, bad_label, bad_integer, bad_hex };
std::string_view line_error_name(LineError e);

// Parses one line (without its newline; a trailing '\r' is accepted): label, 13 decimal integers,
// 26 hex strings of at most 8 digits, separated by single tabs; every field but the label may be
// empty. Returns the error and the 0-based field it is in when the line is malformed (for
// field_count: the number of fields found, or 41 when there are more than 40).
struct LineIssue {
  LineError error;
  int field;
};
std::optional<LineIssue> parse_line(std::string_view line, RawRecord& out);

struct ReadOptions {
  bool strict = false;            // throw fk::Error at the first malformed line instead of skipping it
  std::int64_t max_records = -1;  // stop after this many good records (< 0: all)
  std::size_t max_reported = 20;  // malformed lines kept (with line numbers) in the report
};

struct ReadReport {
  std::int64_t lines = 0;  // lines seen (empty lines included)
  std::int64_t records = 0;
  std::int64_t malformed = 0;
  std::array<std::int64_t, 4> by_error{};  // indexed by LineError
  struct Entry {
    std::int64_t line;  // 1-based
    LineError error;
    int field;
  };
  std::vector<Entry> first;  // the first max_reported malformed lines
  std::string summary() const;  // "1000 lines: 997 records, 3 malformed (field_count 1, ...); line 5: ..."
};

// Reads a Criteo TSV file, plain or gzip-compressed (detected from its content). Empty lines are
// skipped without counting as malformed. Throws fk::Error when the file cannot be opened, and in
// strict mode at the first malformed line, naming the file and the line number.
std::vector<RawRecord> read_tsv(const std::filesystem::path& path, const ReadOptions& options, ReadReport& report);
void write_tsv(const std::filesystem::path& path, std::span<const RawRecord> records);

// ---------------------------------------------------------------------------------------------
// Synthetic Criteo-like data
// ---------------------------------------------------------------------------------------------
//
// Sample i is a pure function of (seed, i) (Philox), so any range can be generated on any thread.
// Categorical ids follow a Zipf-like law over each table's cardinality (rank r has probability
// ~ (r + 1)^-zipf_exponent); the raw 32-bit value is a fixed scramble of the rank. Dense features
// are log-normal counts, some missing. The label is Bernoulli(sigmoid(logit)), with a hidden
// logit = bias + dense part + per-category effects + a few pairwise category interactions; the
// bias is solved for ~25% positives, as in Criteo. The AUC of the hidden logit itself, the
// ceiling any model can reach, is 0.913 for seed 2024 (the data tests require > 0.8).
struct SyntheticConfig {
  std::uint64_t seed = 2024;
  std::vector<std::int64_t> cardinalities = {kKaggleCardinalities.begin(), kKaggleCardinalities.end()};
  double zipf_exponent = 1.1;
  double missing_dense = 0.05;  // probability that an integer field is empty
  double signal = 1.0;          // scale of the hidden logit (larger: easier to learn)
};

class SyntheticCriteo {
 public:
  explicit SyntheticCriteo(SyntheticConfig config);
  const SyntheticConfig& config() const noexcept { return config_; }
  RawRecord record(std::int64_t i) const;
  // The hidden logit of sample i (what the label was drawn from).
  double hidden_logit(std::int64_t i) const;
  void generate(std::int64_t begin, std::span<RawRecord> out) const;

 private:
  struct Sample;
  Sample draw(std::int64_t i) const;
  SyntheticConfig config_;
  std::array<double, kNumDense> dense_weight_{};
  std::array<std::uint32_t, kNumSparse> scramble_mul_{}, scramble_add_{};
  double bias_;
};

// ---------------------------------------------------------------------------------------------
// Binary format
// ---------------------------------------------------------------------------------------------
//
// Version 4, the one written: a 64-byte header ("FKCRITEO", version, 13, 26, record size, record
// count, records per block, content, the vocabulary's fingerprint, the header's CRC-32), fixed
// 160-byte little-endian records (i32 label, i32 dense[13], u32 sparse[26]), then one XXH3-64 per
// block of records and the XXH3-64 of that table. Content 0 keeps the raw values (hashing happens
// at load time, so one file serves any table size or hash mode); content 1 holds the ids of the
// vocabulary whose fingerprint the header carries (the shards of `fusekit data preprocess`).
// binary_source maps the file into memory; it checks the header, the file's exact size and the
// table when it opens a file, and each block's checksum the first time a read touches it.
// Earlier versions are still read and checked the same way: version 3 (ids) and version 2 (raw
// values) carry CRC-32s where version 4 has XXH3-64s; version 1 has no checksums.
struct BinaryContent {
  bool ids = false;                // the sparse values are vocabulary ids
  std::uint32_t vocabulary = 0;    // that vocabulary's fingerprint (Vocabulary::fingerprint)
  friend bool operator==(const BinaryContent&, const BinaryContent&) = default;
};
void write_binary(const std::filesystem::path& path, std::span<const RawRecord> records, BinaryContent content = {});

// Streams records to a Criteo TSV or binary file, in order, through a temporary file that close()
// renames into place (an unclosed writer removes it): for data sets larger than memory.
enum class FileFormat { tsv, binary };
class RecordWriter {
 public:
  RecordWriter(std::filesystem::path path, FileFormat format, BinaryContent content = {});
  ~RecordWriter();
  RecordWriter(const RecordWriter&) = delete;
  RecordWriter& operator=(const RecordWriter&) = delete;
  // `threads` > 1 formats TSV lines on that many threads (binary records are written as they are).
  void write(std::span<const RawRecord> records, int threads = 1);
  void close();
  std::int64_t count() const noexcept { return count_; }

 private:
  std::filesystem::path path_, tmp_;
  FileFormat format_;
  BinaryContent content_;
  std::unique_ptr<std::ofstream> out_;
  std::int64_t count_ = 0;
  std::vector<std::uint64_t> block_sums_;  // binary: the finished blocks' checksums
  std::vector<RawRecord> open_block_;      // binary: the records of the block not yet finished
};
// Converts a TSV (or .gz) file; returns the reader's report. Written atomically (temp + rename).
ReadReport convert_tsv_to_binary(const std::filesystem::path& tsv, const std::filesystem::path& bin,
                                 const ReadOptions& options);
bool is_binary_file(const std::filesystem::path& path);
// What a binary file holds (its header, checked as binary_source checks it).
BinaryContent binary_content(const std::filesystem::path& path);

// ---------------------------------------------------------------------------------------------
// Record sources and the batch loader
// ---------------------------------------------------------------------------------------------

class RecordSource {
 public:
  virtual ~RecordSource() = default;
  virtual std::int64_t size() const = 0;
  // Records [begin, begin + out.size()); thread-safe.
  virtual void read(std::int64_t begin, std::span<RawRecord> out) const = 0;
  // Record i where the source holds its records in memory (a mapped file: its checksum block
  // verified first), so that a reader in another order can gather them with prefetching;
  // nullptr for sources that make or read records on demand. i must be in [0, size()).
  virtual const RawRecord* mapped(std::int64_t i) const { (void)i; return nullptr; }
};

std::shared_ptr<RecordSource> memory_source(std::vector<RawRecord> records);
std::shared_ptr<RecordSource> synthetic_source(SyntheticConfig config, std::int64_t size);
std::shared_ptr<RecordSource> binary_source(const std::filesystem::path& path);  // memory-mapped
// The records of several sources one after the other (a data set's day files).
std::shared_ptr<RecordSource> concat_source(std::vector<std::shared_ptr<RecordSource>> sources);
// Records [begin, end) of another source.
std::shared_ptr<RecordSource> slice_source(std::shared_ptr<RecordSource> source, std::int64_t begin, std::int64_t end);

// The source's records in the order `order` gives (a permutation of a subset of its indices,
// each checked to be in range): record i is source record order[i].
std::shared_ptr<RecordSource> ordered_source(std::shared_ptr<RecordSource> source, std::vector<std::int64_t> order);

// The DLRM reference's split of one Criteo Kaggle file (data_utils.py, --data-set kaggle): the
// records as 7 "days" of n / 7 records, the first n % 7 days one record more; days 0-5 train;
// day 6 halved as np.array_split does (the first half one record more when odd), test first,
// then validation.
struct ReferenceSplit {
  std::vector<std::int64_t> day_begin;  // 8 entries: day d is [day_begin[d], day_begin[d + 1])
  std::int64_t train_end = 0;           // train [0, train_end)
  std::int64_t test_begin = 0, test_end = 0, val_begin = 0, val_end = 0;
};
ReferenceSplit kaggle_split(std::int64_t records);

// The order training reads records [0, day_begin.back()) in, as the reference's --data-randomize:
// "none" the file order; "day" each day's records permuted within the day; "total" all of them
// permuted. Permutations are Fisher-Yates over a 64-bit Mersenne Twister seeded with `seed`
// (deterministic on every platform; not the reference's NumPy stream). Throws fk::Error naming
// `randomize` for another value.
std::vector<std::int64_t> training_order(std::span<const std::int64_t> day_begin, std::string_view randomize,
                                         std::uint64_t seed);

// One batch, in the layout of the file comment. The tensors are allocated once per loader slot
// and reused; they are host tensors today and pinned host memory once the GPU path needs it.
struct Batch {
  std::int64_t size = 0;  // samples in this batch (the last batch may be short)
  // The whole batch's samples, of which this batch is a rank's slice (LoaderOptions::slice_ranks);
  // size without slicing (make_batch sets it to size).
  std::int64_t global_size = 0;
  Tensor labels;          // f32 [B]
  Tensor dense;           // f32 [B, 13]
  Tensor indices;         // i64 [26 * B]
  Tensor offsets;         // i64 [26 * B + 1]
  Tensor raw_sparse;      // i32 [26 * B], table-major: the unhashed 32-bit values (bit patterns),
                          // for implementations that fuse the hash into the embedding lookup
};

// Host memory for a batch tensor of the given shape and dtype. The default is plain host memory
// (Tensor::empty on the CPU); the GPU path passes page-locked memory so that batches can be
// copied to the device asynchronously.
using HostAllocator = std::function<Tensor(Dims shape, DType dtype)>;
// Page-locked host memory (cudaMallocHost) when fusekit was built with CUDA; otherwise empty
// (plain host memory).
HostAllocator pinned_host_allocator();

// Fills `batch`, (re)allocating its tensors through `allocate` (plain host memory when empty)
// when their shapes differ from what `records.size()` samples need. bags = false leaves indices
// and offsets empty, for a consumer that reads raw_sparse only (the fused lookup).
void make_batch(std::span<const RawRecord> records, const Featurizer& featurizer, Batch& batch,
                const HostAllocator& allocate = {}, bool bags = true);

struct LoaderOptions {
  std::int64_t batch_size = 128;
  bool drop_last = false;
  int prefetch = 4;  // batches prepared ahead of the consumer
  int workers = 1;   // threads preparing batches (each makes every workers-th batch)
  HostAllocator allocate;  // memory of the batch slots (empty: plain host memory)
  bool bags = true;        // false: batches without indices and offsets (make_batch)
  // The source read `epochs` times in a row, each pass cut into its own batches (so its last one
  // may be short), the first pass from its batch `first_batch` on: one loader for a whole run,
  // whose prefetching runs on across epochs.
  std::int64_t epochs = 1;
  std::int64_t first_batch = 0;
  // Data parallelism: each batch of batch_size records (as above) is cut into slice_ranks slices in
  // rank order, the first B % slice_ranks one sample more (data::slice_of), and only slice
  // slice_rank is read and made (dense features, labels and bags of those samples alone), so that
  // a rank reads 1/N of the data. Batch::size is the slice's (0 when B < slice_ranks and the rank
  // gets none), Batch::global_size the batch's.
  int slice_rank = 0;
  int slice_ranks = 1;
};

// Samples [begin, end) of a batch of n that rank `rank` of `ranks` takes: n / ranks each, the first
// n % ranks ranks one more.
std::pair<std::int64_t, std::int64_t> slice_of(std::int64_t n, int rank, int ranks);

// Streams the source's records in order as batches (LoaderOptions: over several epochs),
// prepared on background threads. next() returns nullptr at the end; the returned batch stays
// valid until the following next() call.
class BatchLoader {
 public:
  BatchLoader(std::shared_ptr<RecordSource> source, Featurizer featurizer, LoaderOptions options);
  ~BatchLoader();
  BatchLoader(const BatchLoader&) = delete;
  BatchLoader& operator=(const BatchLoader&) = delete;

  const Batch* next();
  std::int64_t num_batches() const noexcept { return num_batches_; }

 private:
  struct State;
  std::unique_ptr<State> state_;
  std::int64_t num_batches_ = 0;
};

}  // namespace fk::data
