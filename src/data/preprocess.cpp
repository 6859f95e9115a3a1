// Criteo TSV -> shards of vocabulary ids, and opening the shards: see preprocess.hpp.
#include "fusekit/data/preprocess.hpp"

#include <fmt/format.h>
#include <zlib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "fusekit/core/error.hpp"

namespace fk::data {
namespace {

using nlohmann::json;
constexpr const char* kOp = "data::preprocess";
constexpr std::size_t kChunkBytes = std::size_t{8} << 20;  // text per chunk
constexpr std::size_t kMaxLineBytes = std::size_t{1} << 20;
constexpr const char* kManifest = "manifest.json";
constexpr const char* kVocabularyFile = "vocabulary.fkv";
constexpr const char* kFormat = "fusekit-criteo-shards";
constexpr int kManifestVersion = 1;
constexpr std::size_t kMaxReported = 20;

std::string day_file(std::size_t d) { return fmt::format("day_{}.bin", d); }

// Whole lines of one input file.
struct Chunk {
  std::size_t file = 0;
  std::size_t seq = 0;             // chunk number in the pass, over all files
  std::int64_t first_line = 1;     // its first line's number in the file (1-based)
  std::string text;
};

// A chunk's lines parsed: its good records, and its part of the file's report.
struct Parsed {
  std::vector<RawRecord> records;
  ReadReport report;
};

std::string describe_issue(const LineIssue& issue) {
  if (issue.error == LineError::field_count)
    return fmt::format("field_count ({} fields, expected 40)", issue.field);
  return fmt::format("{} in field {}", line_error_name(issue.error), issue.field);
}

void parse_chunk(const Chunk& c, const std::filesystem::path& path, bool strict, Parsed& out) {
  out.records.clear();
  out.report = ReadReport{};
  std::string_view text = c.text;
  std::int64_t line_no = c.first_line;
  RawRecord rec;
  while (!text.empty()) {
    const std::size_t nl = text.find('\n');
    const std::string_view line = text.substr(0, nl);
    text.remove_prefix(nl == std::string_view::npos ? text.size() : nl + 1);
    ++out.report.lines;
    const std::int64_t this_line = line_no++;
    if (line.empty() || line == "\r") continue;
    if (const auto issue = parse_line(line, rec)) {
      if (strict)
        throw Error(kOp, path.string(), "well-formed Criteo lines (strict mode)",
                    fmt::format("line {}: {}", this_line, describe_issue(*issue)));
      ++out.report.malformed;
      ++out.report.by_error[static_cast<int>(issue->error)];
      if (out.report.first.size() < kMaxReported) out.report.first.push_back({this_line, issue->error, issue->field});
      continue;
    }
    out.records.push_back(rec);
    ++out.report.records;
  }
}

void merge_report(ReadReport& into, const ReadReport& part) {
  into.lines += part.lines;
  into.records += part.records;
  into.malformed += part.malformed;
  for (std::size_t e = 0; e < into.by_error.size(); ++e) into.by_error[e] += part.by_error[e];
  into.first.insert(into.first.end(), part.first.begin(), part.first.end());
  std::sort(into.first.begin(), into.first.end(), [](const auto& a, const auto& b) { return a.line < b.line; });
  if (into.first.size() > kMaxReported) into.first.resize(kMaxReported);
}

// One pass over the inputs: this thread reads chunks of whole lines (gzip or plain, through
// zlib) into a bounded queue; `threads` workers parse them and call work(chunk, parsed).
class Pass {
 public:
  using Work = std::function<void(const Chunk&, Parsed&)>;
  std::function<void()> on_fail;  // called once when a worker or the reader fails
  Pass(const PreprocessOptions& o, int threads, int index, int passes, const char* what)
      : o_(o), threads_(threads), index_(index), passes_(passes), what_(what) {}

  // Reads the files whose `read_file[i]` is true; returns the pass's seconds.
  double run(const std::vector<bool>& read_file, const Work& work) {
    const auto t0 = std::chrono::steady_clock::now();
    for (std::int64_t i = 0; i < static_cast<std::int64_t>(o_.inputs.size()); ++i)
      if (read_file[static_cast<std::size_t>(i)]) total_bytes_ += static_cast<std::int64_t>(std::filesystem::file_size(o_.inputs[static_cast<std::size_t>(i)]));
    std::vector<std::thread> pool;
    for (int w = 0; w < threads_; ++w) pool.emplace_back([&] { worker(work); });
    try {
      std::size_t seq = 0;
      for (std::size_t f = 0; f < o_.inputs.size() && !failed(); ++f)
        if (read_file[f]) read(f, seq, t0);
    } catch (...) {
      fail(std::current_exception());
    }
    {
      std::lock_guard lock(mutex_);
      done_ = true;
    }
    changed_.notify_all();
    for (std::thread& t : pool) t.join();
    if (error_) std::rethrow_exception(error_);
    report(t0, true);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  std::atomic<std::int64_t> records{0};

 private:
  bool failed() {
    std::lock_guard lock(mutex_);
    return error_ != nullptr;
  }
  void fail(std::exception_ptr e) {
    bool first = false;
    {
      std::lock_guard lock(mutex_);
      first = !error_;
      if (first) error_ = e;
    }
    changed_.notify_all();
    if (first && on_fail) on_fail();
  }

  void report(std::chrono::steady_clock::time_point t0, bool final) {
    if (!o_.progress) return;
    const auto now = std::chrono::steady_clock::now();
    if (!final && now - last_report_ < std::chrono::milliseconds(500)) return;
    last_report_ = now;
    o_.progress({index_, passes_, what_, done_bytes_ + file_bytes_, total_bytes_, records.load(),
                 std::chrono::duration<double>(now - t0).count()});
  }

  void read(std::size_t f, std::size_t& seq, std::chrono::steady_clock::time_point t0) {
    const std::filesystem::path& path = o_.inputs[f];
    gzFile file = gzopen(path.c_str(), "rb");
    if (!file) throw Error(kOp, "inputs", "readable files", path.string());
    struct Close {
      gzFile f;
      ~Close() { gzclose(f); }
    } close_file{file};
    gzbuffer(file, 1u << 20);
    std::string carry;
    std::int64_t line = 1;
    file_bytes_ = 0;
    bool eof = false;
    while (!eof && !failed()) {
      Chunk c;
      c.file = f;
      c.first_line = line;
      c.text = std::move(carry);
      carry.clear();
      const std::size_t old = c.text.size();
      c.text.resize(old + kChunkBytes);
      const int got = gzread(file, c.text.data() + old, static_cast<unsigned>(kChunkBytes));
      int code = Z_OK;
      const char* message = gzerror(file, &code);
      if (got < 0 || (code != Z_OK && code != Z_STREAM_END))
        throw Error(kOp, "inputs", "complete, uncorrupted (gzip) files", fmt::format("{}: {}", path.string(), message));
      c.text.resize(old + static_cast<std::size_t>(got));
      eof = got == 0;
      file_bytes_ = static_cast<std::int64_t>(gzoffset(file));
      if (!eof) {
        // The chunk ends at its last newline; the rest starts the next one.
        const std::size_t nl = c.text.rfind('\n');
        if (nl == std::string::npos) {
          FK_CHECK_ARG(c.text.size() <= kMaxLineBytes, kOp, "inputs",
                       fmt::format("lines of at most {} bytes (a Criteo line is a few hundred)", kMaxLineBytes),
                       fmt::format("{}: line {} is longer", path.string(), line));
          carry = std::move(c.text);
          continue;
        }
        carry.assign(c.text, nl + 1);
        c.text.resize(nl + 1);
      }
      if (c.text.empty()) continue;
      line += static_cast<std::int64_t>(std::count(c.text.begin(), c.text.end(), '\n'));
      c.seq = seq++;
      {
        std::unique_lock lock(mutex_);
        changed_.wait(lock, [&] { return queue_.size() < static_cast<std::size_t>(2 * threads_) || error_; });
        if (error_) return;
        queue_.push_back(std::move(c));
      }
      changed_.notify_all();
      report(t0, false);
    }
    done_bytes_ += static_cast<std::int64_t>(std::filesystem::file_size(path));
    file_bytes_ = 0;
  }

  void worker(const Work& work) {
    Parsed parsed;
    while (true) {
      Chunk c;
      {
        std::unique_lock lock(mutex_);
        changed_.wait(lock, [&] { return !queue_.empty() || done_ || error_; });
        if (error_ || queue_.empty()) return;
        c = std::move(queue_.front());
        queue_.pop_front();
      }
      changed_.notify_all();
      try {
        parse_chunk(c, o_.inputs[c.file], o_.strict, parsed);
        records += static_cast<std::int64_t>(parsed.records.size());
        work(c, parsed);
      } catch (...) {
        fail(std::current_exception());
        return;
      }
    }
  }

  const PreprocessOptions& o_;
  int threads_, index_, passes_;
  const char* what_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Chunk> queue_;
  bool done_ = false;
  std::exception_ptr error_;
  std::int64_t total_bytes_ = 0, done_bytes_ = 0, file_bytes_ = 0;
  std::chrono::steady_clock::time_point last_report_{};
};

// Chunk records counts by chunk number, and where each chunk starts in the data set.
struct ChunkIndex {
  std::mutex mutex;
  std::vector<std::int64_t> records;  // by seq
  void set(std::size_t seq, std::int64_t n) {
    std::lock_guard lock(mutex);
    if (records.size() <= seq) records.resize(seq + 1, -1);
    records[seq] = n;
  }
  std::vector<std::int64_t> begins() const {
    std::vector<std::int64_t> b(records.size() + 1, 0);
    for (std::size_t i = 0; i < records.size(); ++i) b[i + 1] = b[i] + records[i];
    return b;
  }
};

void write_text_atomically(const std::filesystem::path& path, const std::string& text) {
  const std::filesystem::path tmp = path.string() + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f << text;
    f.flush();
    if (!f) throw Error(kOp, "out", "a writable directory", tmp.string());
  }
  std::filesystem::rename(tmp, path);
}

}  // namespace

PreprocessReport preprocess(const PreprocessOptions& o) {
  const auto t_start = std::chrono::steady_clock::now();
  FK_CHECK_ARG(!o.inputs.empty(), kOp, "inputs", "at least one Criteo TSV file", "none");
  FK_CHECK_ARG(o.data_set == "kaggle" || o.data_set == "terabyte", kOp, "data_set", "kaggle or terabyte", o.data_set);
  FK_CHECK_ARG(o.data_set != "kaggle" || o.inputs.size() == 1, kOp, "inputs",
               "one file for the kaggle data set (it is cut into 7 days)", fmt::format("{} files", o.inputs.size()));
  FK_CHECK_ARG(o.data_set != "terabyte" || o.inputs.size() >= 2, kOp, "inputs",
               "a file per day for the terabyte data set, at least 2 (training days and the test day)",
               fmt::format("{} file", o.inputs.size()));
  o.vocabulary.validate();
  FK_CHECK_ARG(!o.out.empty(), kOp, "out", "an output directory", "none");
  FK_CHECK_ARG(!std::filesystem::exists(o.out) || std::filesystem::is_directory(o.out), kOp, "out",
               "a directory, or a path where one can be made", fmt::format("{}: a file", o.out.string()));
  const bool kaggle = o.data_set == "kaggle";
  const std::size_t files = o.inputs.size();
  const std::size_t days = kaggle ? 7 : files;
  std::vector<std::filesystem::path> outputs = {o.out / kManifest, o.out / kVocabularyFile};
  for (std::size_t d = 0; d < days; ++d) outputs.push_back(o.out / day_file(d));
  for (const std::filesystem::path& in : o.inputs) {
    FK_CHECK_ARG(std::filesystem::is_regular_file(in), kOp, "inputs", "existing files", in.string());
    for (const std::filesystem::path& out : outputs) {
      std::error_code ec;
      FK_CHECK_ARG(!std::filesystem::equivalent(in, out, ec), kOp, "out",
                   "a directory whose output files are not inputs", fmt::format("{} is {}", out.string(), in.string()));
    }
  }
  const int threads = o.threads > 0 ? o.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::filesystem::create_directories(o.out);
  // A directory that held a data set loses its manifest first: until the new one is complete
  // the directory is no data set.
  std::filesystem::remove(o.out / kManifest);

  PreprocessReport rep;
  for (const auto& in : o.inputs) rep.input_bytes += static_cast<std::int64_t>(std::filesystem::file_size(in));
  const int passes = kaggle ? 3 : 2;
  int pass_no = 0;
  const std::vector<bool> every_file(files, true);

  // Pass 1 (kaggle): records per chunk, for the day boundaries.
  ChunkIndex chunks;
  std::vector<std::int64_t> day_begin;  // kaggle: by record; terabyte: filled by the write pass
  if (kaggle) {
    Pass p(o, threads, ++pass_no, passes, "records");
    rep.pass_seconds.push_back(p.run(every_file, [&](const Chunk& c, Parsed& r) {
      chunks.set(c.seq, static_cast<std::int64_t>(r.records.size()));
    }));
    const ReferenceSplit sp = kaggle_split(p.records.load());
    day_begin = sp.day_begin;
  }
  const std::vector<std::int64_t> chunk_begin = chunks.begins();
  const auto chunk_start = [&](const Chunk& c, const Parsed& r) {
    // The same input cut the same way gives the same chunks: a different count means the file
    // changed between passes.
    FK_CHECK_ARG(c.seq < chunks.records.size() && chunks.records[c.seq] == static_cast<std::int64_t>(r.records.size()),
                 kOp, "inputs", "files that do not change while they are preprocessed",
                 fmt::format("{}: a different record count in chunk {} on the second reading", o.inputs[c.file].string(),
                             c.seq));
    return chunk_begin[c.seq];
  };

  // Pass 2: the vocabulary, over the training days (all days with vocabulary_all_days).
  VocabularyCounter counter(o.vocabulary);
  {
    std::vector<bool> read = every_file;
    if (!kaggle && !o.vocabulary_all_days) read.back() = false;  // the test day
    const std::int64_t count_end = kaggle && !o.vocabulary_all_days ? day_begin[day_begin.size() - 2] : INT64_MAX;
    std::array<std::mutex, kNumSparse> feature_mutex;
    std::mutex records_mutex;
    Pass p(o, threads, ++pass_no, passes, "vocabulary");
    rep.pass_seconds.push_back(p.run(read, [&](const Chunk& c, Parsed& r) {
      std::span<const RawRecord> counted = r.records;
      if (kaggle) {
        const std::int64_t begin = chunk_start(c, r);
        counted = counted.first(static_cast<std::size_t>(std::clamp<std::int64_t>(count_end - begin, 0, std::ssize(counted))));
      }
      if (counted.empty()) return;
      // Each feature once, taking whichever feature's counter is free, so that workers rarely wait.
      std::array<bool, kNumSparse> done{};
      int left = kNumSparse;
      for (int round = 0; left > 0; ++round) {
        for (int i = 0; i < kNumSparse; ++i) {
          const int t = (i + static_cast<int>(c.seq)) % kNumSparse;
          if (done[static_cast<std::size_t>(t)]) continue;
          std::unique_lock lock(feature_mutex[static_cast<std::size_t>(t)], std::defer_lock);
          if (round == 0 ? !lock.try_lock() : (lock.lock(), false)) continue;
          counter.add_feature(t, counted);
          done[static_cast<std::size_t>(t)] = true;
          --left;
        }
      }
      std::lock_guard lock(records_mutex);
      counter.add_records(std::ssize(counted));
    }));
  }
  // Each feature's counts are given back as its ids are made.
  const auto vocabulary = std::make_shared<const Vocabulary>(Vocabulary::build(std::move(counter)));
  rep.fingerprint = vocabulary->fingerprint();
  for (const std::int64_t r : vocabulary->table_rows()) rep.table_rows += r;

  // Pass 3: ids, written to the day files in record order.
  std::vector<std::unique_ptr<RecordWriter>> writers;
  for (std::size_t d = 0; d < days; ++d)
    writers.push_back(std::make_unique<RecordWriter>(o.out / day_file(d), FileFormat::binary,
                                                     BinaryContent{true, vocabulary->fingerprint()}));
  rep.inputs.assign(files, ReadReport{});
  {
    std::mutex turn_mutex;
    std::condition_variable turn_changed;
    std::size_t next_seq = 0;
    bool abandoned = false;
    Pass p(o, threads, ++pass_no, passes, "shards");
    p.on_fail = [&] {  // a chunk that fails before its turn must not leave the later ones waiting
      {
        std::lock_guard lock(turn_mutex);
        abandoned = true;
      }
      turn_changed.notify_all();
    };
    try {
      rep.pass_seconds.push_back(p.run(every_file, [&](const Chunk& c, Parsed& r) {
        const std::int64_t begin = kaggle ? chunk_start(c, r) : 0;
        for (RawRecord& rec : r.records)
          for (int t = 0; t < kNumSparse; ++t)
            rec.sparse[static_cast<std::size_t>(t)] = vocabulary->id(t, rec.sparse[static_cast<std::size_t>(t)]);
        std::unique_lock lock(turn_mutex);
        turn_changed.wait(lock, [&] { return next_seq == c.seq || abandoned; });
        if (abandoned) return;
        struct Next {  // the turn passes on whether this chunk's write succeeds or throws
          std::size_t& seq;
          bool& abandoned;
          std::condition_variable& changed;
          bool ok = false;
          ~Next() {
            ++seq;
            if (!ok) abandoned = true;
            changed.notify_all();
          }
        } next{next_seq, abandoned, turn_changed};
        merge_report(rep.inputs[c.file], r.report);
        std::span<const RawRecord> left = r.records;
        if (kaggle) {
          std::int64_t at = begin;
          while (!left.empty()) {
            const std::size_t d = static_cast<std::size_t>(
                std::upper_bound(day_begin.begin(), day_begin.end(), at) - day_begin.begin() - 1);
            const std::size_t n = static_cast<std::size_t>(std::min<std::int64_t>(day_begin[d + 1] - at, std::ssize(left)));
            writers[d]->write(left.first(n));
            left = left.subspan(n);
            at += static_cast<std::int64_t>(n);
          }
        } else {
          writers[c.file]->write(left);
        }
        next.ok = true;
      }));
    } catch (...) {
      writers.clear();  // unclosed writers remove their temporary files
      throw;
    }
  }
  for (std::size_t d = 0; d < days; ++d) {
    rep.day_records.push_back(writers[d]->count());
    writers[d]->close();
  }
  vocabulary->save(o.out / kVocabularyFile);

  json inputs = json::array();
  for (std::size_t f = 0; f < files; ++f)
    inputs.push_back({{"path", std::filesystem::absolute(o.inputs[f]).string()},
                      {"bytes", std::filesystem::file_size(o.inputs[f])},
                      {"lines", rep.inputs[f].lines},
                      {"records", rep.inputs[f].records},
                      {"malformed", rep.inputs[f].malformed}});
  json day_list = json::array();
  for (std::size_t d = 0; d < days; ++d) day_list.push_back({{"file", day_file(d)}, {"records", rep.day_records[d]}});
  const json manifest = {{"format", kFormat},
                         {"version", kManifestVersion},
                         {"data_set", o.data_set},
                         {"days", day_list},
                         {"inputs", inputs},
                         {"vocabulary",
                          {{"file", kVocabularyFile},
                           {"fingerprint", fmt::format("{:08x}", vocabulary->fingerprint())},
                           {"max_ind_range", o.vocabulary.max_ind_range},
                           {"min_count", o.vocabulary.min_count},
                           {"days", o.vocabulary_all_days ? "all" : "train"},
                           {"records", vocabulary->records()},
                           {"table_rows", vocabulary->table_rows()}}}};
  write_text_atomically(o.out / kManifest, manifest.dump(2) + "\n");
  rep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  return rep;
}

// ---------------------------------------------------------------------------------------------
// Opening a data set
// ---------------------------------------------------------------------------------------------

bool is_shard_directory(const std::filesystem::path& path) {
  std::error_code ec;
  return std::filesystem::is_directory(path, ec) && std::filesystem::is_regular_file(path / kManifest, ec);
}

std::shared_ptr<RecordSource> ShardSet::all() const { return concat_source(days); }

std::int64_t ShardSet::test_end() const {
  const std::int64_t last = val_end() - test_begin();
  return test_begin() + (last + 1) / 2;  // np.array_split: the first half takes the extra record
}

namespace {

ShardSet open_shards_checked(const std::filesystem::path& dir, std::shared_ptr<const Vocabulary> vocabulary);

}  // namespace

ShardSet open_shards(const std::filesystem::path& dir, std::shared_ptr<const Vocabulary> vocabulary) {
  try {
    return open_shards_checked(dir, std::move(vocabulary));
  } catch (const json::exception& e) {  // a value of another type than the manifest's
    throw Error("data::open_shards", "directory", fmt::format("a valid {} (values of the right types)", kManifest),
                fmt::format("{}: {}", (dir / kManifest).string(), e.what()));
  }
}

namespace {

ShardSet open_shards_checked(const std::filesystem::path& dir, std::shared_ptr<const Vocabulary> vocabulary) {
  constexpr const char* op = "data::open_shards";
  const std::filesystem::path mpath = dir / kManifest;
  FK_CHECK_ARG(is_shard_directory(dir), op, "directory",
               fmt::format("a directory written by fusekit data preprocess (with a {})", kManifest), dir.string());
  json m;
  {
    std::ifstream f(mpath);
    m = json::parse(f, nullptr, false);
  }
  const auto bad = [&](const std::string& what) {
    return Error(op, "directory", fmt::format("a valid {} ({})", kManifest, what), mpath.string());
  };
  if (m.is_discarded() || !m.is_object()) throw bad("JSON object");
  if (m.value("format", std::string()) != kFormat) throw bad(fmt::format("format \"{}\"", kFormat));
  if (!m.contains("version") || !m["version"].is_number_integer() || m["version"].get<int>() != kManifestVersion)
    throw bad(fmt::format("version {}", kManifestVersion));
  ShardSet s;
  s.directory = dir;
  s.data_set = m.value("data_set", std::string());
  if (s.data_set != "kaggle" && s.data_set != "terabyte") throw bad("data_set kaggle or terabyte");
  const json& v = m.value("vocabulary", json());
  if (!v.is_object() || !v.contains("file") || !v["file"].is_string() || !v.contains("fingerprint") ||
      !v["fingerprint"].is_string())
    throw bad("a vocabulary with file and fingerprint");
  const std::string vfile = v["file"].get<std::string>();
  if (vfile.empty() || vfile.find('/') != std::string::npos || vfile == "..") throw bad("a vocabulary file in the directory");
  s.vocabulary = vocabulary ? std::move(vocabulary) : std::make_shared<const Vocabulary>(Vocabulary::load(dir / vfile));
  const std::string fp = fmt::format("{:08x}", s.vocabulary->fingerprint());
  FK_CHECK_ARG(fp == v["fingerprint"].get<std::string>(), op, "vocabulary",
               fmt::format("the vocabulary the shards were written with (fingerprint {})", v["fingerprint"].get<std::string>()),
               fmt::format("{} with fingerprint {}", (dir / vfile).string(), fp));
  const json& days = m.value("days", json());
  if (!days.is_array() || days.size() < 2) throw bad("at least 2 days");
  s.day_begin.push_back(0);
  for (std::size_t d = 0; d < days.size(); ++d) {
    const json& e = days[d];
    if (!e.is_object() || !e.contains("file") || !e["file"].is_string() || !e.contains("records") ||
        !e["records"].is_number_integer() || e["records"].get<std::int64_t>() < 0)
      throw bad(fmt::format("day {}: file and records", d));
    const std::string name = e["file"].get<std::string>();
    if (name.empty() || name.find('/') != std::string::npos || name == "..") throw bad(fmt::format("day {}: a file in the directory", d));
    const std::filesystem::path path = dir / name;
    const BinaryContent content = binary_content(path);
    FK_CHECK_ARG(content.ids && content.vocabulary == s.vocabulary->fingerprint(), op, "directory",
                 fmt::format("day files of ids of vocabulary {}", fp),
                 content.ids ? fmt::format("{}: ids of vocabulary {:08x}", path.string(), content.vocabulary)
                             : fmt::format("{}: raw values", path.string()));
    std::shared_ptr<RecordSource> src = binary_source(path);
    FK_CHECK_ARG(src->size() == e["records"].get<std::int64_t>(), op, "directory",
                 fmt::format("day {} of {} records (the manifest's)", d, e["records"].get<std::int64_t>()),
                 fmt::format("{}: {} records", path.string(), src->size()));
    s.day_begin.push_back(s.day_begin.back() + src->size());
    s.days.push_back(std::move(src));
  }
  return s;
}

}  // namespace

}  // namespace fk::data
