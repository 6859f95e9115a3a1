// The distributed DLRM's saved state (include/fusekit/models/dlrm_distributed.hpp): a rank's shard
// stream (save_shards / load_shards), and the loads that gather each table's rows from wherever a
// saved state keeps them (SavedTables), whatever plan saved it: DistributedDlrm::load (N -> M, and
// 1 -> M from a one-process state) and consolidate_distributed_state (N -> 1).
//
// A saved stream is read in two passes: its header and every array's length field, each length
// checked against what the saved plan gives before the array is skipped (a seek); then, for each
// wanted row range, a seek to its first row and one read. The only sizes taken from a stream are
// the dense arrays' (a one-process state's, or consolidation's), bounded by the configuration's
// dense parameters.
//
// On a GPU (the NCCL communicator) the shards and their accumulators live in device memory: a save
// copies them to the host in chunks (detail::write_state), and a load gathers each shard's rows into
// host staging, a bounded chunk at a time, and copies them to the device on the embeddings' stream
// (load_tables), so N -> M, 1 -> M and N -> N loads all work there.
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <sstream>

#include "core/on_device.hpp"
#include "fusekit/core/error.hpp"
#include "fusekit/core/stream.hpp"
#include "fusekit/models/dlrm_distributed.hpp"
#include "models/dlrm_state_io.hpp"

namespace fk::models {
namespace {

constexpr const char* kOp = "models::DistributedDlrm";

// A shard's optimizer state inside a collection's state buffer: [rows] row-wise, else [rows, D].
TensorView shard_state(const nn::EmbeddingBagCollection& l, int s, bool rowwise) {
  const TensorView& tv = l.tables[static_cast<std::size_t>(s)].view();
  const std::int64_t base = l.layout().base(s);
  auto* state = const_cast<float*>(l.state.data_as<const float>());
  if (rowwise) return TensorView(state + base, DType::f32, {tv.size(0)}, l.state.device());
  return TensorView(state + base * tv.size(1), DType::f32, tv.shape(), l.state.device());
}

// Rank r's shards in (table, first row) order, as dist::ShardedEmbeddingBags holds them.
std::vector<dist::Shard> shards_of(const dist::ShardingPlan& plan, int r) {
  std::vector<dist::Shard> out;
  for (const auto& table : plan.tables)
    for (const dist::Shard& sh : table)
      if (sh.rank == r) out.push_back(sh);
  return out;
}

// An upper bound on a dense state array's floats: every parameter outside the tables, plus the
// rounding steps' array.
std::uint64_t dense_floats_limit(const DlrmConfig& c) {
  std::int64_t tables = 0;
  for (std::int64_t r : c.table_rows) tables += r * c.embedding_dim;
  return static_cast<std::uint64_t>(c.parameter_count() - tables) + 64;
}

// Rows [row_begin, row_end) of `table` and where they go: values f32 [rows, D]; state f32 [rows]
// (row-wise Adagrad) or [rows, D], or no data when no optimizer state is wanted. Contiguous.
struct RowsWanted {
  int table = 0;
  std::int64_t row_begin = 0, row_end = 0;
  TensorView values, state;
};

// One saved rank's stream once its lengths are checked: where each array's floats start, and how
// many there are.
struct SavedStream {
  std::istream* in = nullptr;
  bool adagrad = false;
  std::vector<std::streamoff> at;  // per array
  std::vector<std::uint64_t> len;  // per array
};

// 16-bit tables: a shard stream ends with the tables' rounding step (detail::step_to_floats).
bool sixteen_bit(const DlrmConfig& c) { return c.embedding_dtype != DType::f32; }
constexpr std::uint64_t kStepFloats = 2;

class RowGatherer {
 public:
  // dense_arrays: a one-process state's parameter arrays before its tables (SavedTables::one_process).
  RowGatherer(const DlrmConfig& config, const SavedTables& saved, bool adagrad, std::uint64_t dense_arrays,
              const char* op)
      : config_(config), saved_(saved), adagrad_(adagrad), dense_arrays_(dense_arrays), op_(op) {
    check_plan();
    local_.resize(config_.table_rows.size());
    for (std::size_t t = 0; t < saved_.plan.tables.size(); ++t)
      for (const dist::Shard& sh : saved_.plan.tables[t]) local_[t].push_back(shard_count_[sh.rank]++);
  }

  // The tables' rounding step the saved state holds (16-bit tables; 0 for a one-process state
  // saved without one), from a stream gather() has read rows from (every saved rank holding shards
  // keeps it; the step is the same on all).
  std::uint64_t rounding_step() {
    FK_CHECK_ARG(!streams_.empty(), op_, "tables", "rows gathered before the rounding step", "none");
    auto& [r, s] = *streams_.begin();
    if (one_process()) {
      const std::size_t base = (dense_arrays_ + config_.table_rows.size()) * (s.adagrad ? 2 : 1);
      if (s.at.size() == base || s.len.back() < 3 * kStepFloats) return 0;
      return read_step(s, r, s.at.size() - 1, 2 * kStepFloats);
    }
    return read_step(s, r, s.at.size() - 1, 0);
  }

  void gather(const RowsWanted& w) {
    const std::int64_t d = config_.embedding_dim, state_width = config_.rowwise_adagrad ? 1 : d;
    const auto& shards = saved_.plan.tables[static_cast<std::size_t>(w.table)];
    for (std::size_t k = 0; k < shards.size(); ++k) {
      const dist::Shard& sh = shards[k];
      const std::int64_t lo = std::max(w.row_begin, sh.row_begin), hi = std::min(w.row_end, sh.row_end);
      if (lo >= hi) continue;
      SavedStream& s = stream(sh.rank);
      const std::int64_t local = local_[static_cast<std::size_t>(w.table)][k];
      const auto [values_at, state_at] = arrays_of(sh.rank, w.table, local);
      read_rows(s, sh.rank, values_at, lo - sh.row_begin, hi - lo, d,
                static_cast<float*>(w.values.data()) + (lo - w.row_begin) * d);
      if (w.state.data() != nullptr)
        read_rows(s, sh.rank, state_at, lo - sh.row_begin, hi - lo, state_width,
                  static_cast<float*>(w.state.data()) + (lo - w.row_begin) * state_width);
    }
  }

 private:
  [[noreturn]] void bad(int rank, const std::string& what) const {
    throw Error(op_, "tables", fmt::format("saved rank {}'s state as its plan and the dense state give it", rank),
                what);
  }

  bool one_process() const { return saved_.layout == SavedTables::Layout::one_process; }

  void check_plan() const {
    const dist::ShardingPlan& p = saved_.plan;
    const std::size_t tables = config_.table_rows.size();
    FK_CHECK_ARG(static_cast<bool>(saved_.open), op_, "tables", "a way to open each saved rank's stream", "none");
    FK_CHECK_ARG(p.ranks >= 1 && p.tables.size() == tables && (!one_process() || p.ranks == 1), op_, "tables",
                 fmt::format("a saved plan of {} tables ({})", tables, one_process() ? "one process" : "any ranks"),
                 fmt::format("{} tables over {} ranks", p.tables.size(), p.ranks));
    for (std::size_t t = 0; t < tables; ++t) {
      std::int64_t next = 0;
      for (const dist::Shard& sh : p.tables[t]) {
        FK_CHECK_ARG(sh.table == static_cast<int>(t) && sh.row_begin == next && sh.row_end > sh.row_begin &&
                         sh.rank >= 0 && sh.rank < p.ranks,
                     op_, "tables", fmt::format("table {}'s saved shards tiling its rows in order", t),
                     fmt::format("table {} rows [{}, {}) on rank {}", sh.table, sh.row_begin, sh.row_end, sh.rank));
        next = sh.row_end;
      }
      FK_CHECK_ARG(next == config_.table_rows[t] && (!one_process() || p.tables[t].size() == 1), op_, "tables",
                   fmt::format("table {}'s saved shards covering its {} rows", t, config_.table_rows[t]),
                   fmt::format("rows [0, {}) in {} shards", next, p.tables[t].size()));
    }
  }

  // The array indices of saved rank r's local shard k (of `table`): its values and its state.
  std::pair<std::size_t, std::size_t> arrays_of(int r, int table, std::int64_t k) const {
    if (one_process()) {
      const std::size_t p = dense_arrays_, t = static_cast<std::size_t>(table), n = config_.table_rows.size();
      return {p + t, 2 * p + n + t};
    }
    const auto s = static_cast<std::size_t>(shard_count_.at(r));
    return {static_cast<std::size_t>(k), s + static_cast<std::size_t>(k)};
  }

  // Saved rank r's stream, opened and its lengths checked on first use.
  SavedStream& stream(int r) {
    if (const auto it = streams_.find(r); it != streams_.end()) return it->second;
    SavedStream s;
    s.in = &saved_.open(r);
    std::istream& in = *s.in;
    const std::streamoff start = in.tellg();
    std::uint64_t count = 0;
    s.adagrad = detail::read_state_header(in, count);
    // Each array's length: exact for a table's values and state, at most `limit` for a dense array.
    const std::int64_t d = config_.embedding_dim, state_width = config_.rowwise_adagrad ? 1 : d;
    std::vector<std::int64_t> floats;  // -1: a dense array
    if (one_process()) {
      const std::uint64_t p = dense_arrays_, base = (p + config_.table_rows.size()) * (s.adagrad ? 2 : 1);
      if (s.adagrad != adagrad_)
        bad(r, fmt::format("a state {} optimizer state, the dense state {}", s.adagrad ? "with" : "without",
                           adagrad_ ? "with" : "without"));
      if (count != base && count != base + 1)
        bad(r, fmt::format("a one-process state of {} arrays (expected {}, or {} with the rounding steps)", count,
                           base, base + 1));
      floats.assign(count, -1);
      for (std::size_t t = 0; t < config_.table_rows.size(); ++t) {
        floats[p + t] = config_.table_rows[t] * d;
        if (s.adagrad) floats[2 * p + config_.table_rows.size() + t] = config_.table_rows[t] * state_width;
      }
    } else {
      const std::vector<dist::Shard> mine = shards_of(saved_.plan, r);
      if (!mine.empty() && s.adagrad != adagrad_)
        bad(r, fmt::format("shards {} optimizer state, the dense state {}", s.adagrad ? "with" : "without",
                           adagrad_ ? "with" : "without"));
      const std::uint64_t step = sixteen_bit(config_) && !mine.empty() ? 1 : 0;
      const std::uint64_t want = mine.size() * (s.adagrad && !mine.empty() ? 2 : 1) + step;
      if (count != want)
        bad(r, fmt::format("{} arrays where its {} shards make {}{}", count, mine.size(), want,
                           step ? " (16-bit tables: with the rounding step)" : ""));
      for (const dist::Shard& sh : mine) floats.push_back((sh.row_end - sh.row_begin) * d);
      for (std::size_t k = 0; k < count - mine.size() - step; ++k)
        floats.push_back((mine[k].row_end - mine[k].row_begin) * state_width);
      if (step) floats.push_back(kStepFloats);
    }
    const std::uint64_t limit = dense_floats_limit(config_);
    std::streamoff at = start + 17;  // magic, flag, count
    for (std::size_t i = 0; i < floats.size(); ++i) {
      std::uint64_t len = 0;
      in.seekg(at);
      in.read(reinterpret_cast<char*>(&len), 8);
      if (!in) bad(r, fmt::format("a stream that ends in array {}'s length", i));
      const bool ok = floats[i] < 0 ? len <= limit : len == static_cast<std::uint64_t>(floats[i]);
      if (!ok) bad(r, fmt::format("array {} of {} floats (expected {})", i, len,
                                  floats[i] < 0 ? fmt::format("at most {}", limit) : fmt::format("{}", floats[i])));
      s.at.push_back(at + 8);
      s.len.push_back(len);
      at += 8 + static_cast<std::streamoff>(len) * 4;
    }
    return streams_.emplace(r, std::move(s)).first->second;
  }

  // The step at floats [first, first + 2) of saved rank r's array.
  std::uint64_t read_step(SavedStream& s, int r, std::size_t array, std::uint64_t first) const {
    float two[kStepFloats] = {};
    read_rows(s, r, array, static_cast<std::int64_t>(first), kStepFloats, 1, two);
    return detail::step_from_floats(two, op_);
  }

  void read_rows(SavedStream& s, int r, std::size_t array, std::int64_t first, std::int64_t rows, std::int64_t width,
                 float* to) const {
    s.in->seekg(s.at[array] + static_cast<std::streamoff>(first * width) * 4);
    s.in->read(reinterpret_cast<char*>(to), static_cast<std::streamsize>(rows * width) * 4);
    if (!*s.in) bad(r, fmt::format("a stream that ends in array {}", array));
  }

  const DlrmConfig& config_;
  const SavedTables& saved_;
  bool adagrad_;
  std::uint64_t dense_arrays_;
  const char* op_;
  // Per saved rank (a plan may name many ranks; only those holding shards count here).
  std::map<int, SavedStream> streams_;          // once opened
  std::map<int, std::int64_t> shard_count_;     // its shards
  std::vector<std::vector<std::int64_t>> local_;  // per table, per saved shard: its index on its rank
};

// The dense part of a one-process state (Dlrm::save_state of a model holding its tables) as the
// external-table Dlrm's state (its `dense_arrays` parameter arrays, their accumulators, the
// rounding steps): the tables' arrays skipped. Returns whether it holds optimizer state.
bool dense_part_of_one_process(const DlrmConfig& config, std::uint64_t dense_arrays, std::istream& in,
                               std::ostream& out) {
  const char* op = "models::DistributedDlrm::load";
  std::uint64_t count = 0;
  const bool adagrad = detail::read_state_header(in, count);
  const std::uint64_t n = config.table_rows.size(), base = (dense_arrays + n) * (adagrad ? 2 : 1);
  FK_CHECK_ARG(count == base || count == base + 1, op, "dense",
               fmt::format("a one-process state of {} arrays (or {} with the rounding steps)", base, base + 1),
               fmt::format("{}", count));
  const std::uint64_t limit = dense_floats_limit(config);
  std::vector<std::vector<float>> kept;
  for (std::uint64_t i = 0; i < count; ++i) {
    const std::uint64_t j = i >= dense_arrays + n ? i - (dense_arrays + n) : i;  // within its half
    if (j >= dense_arrays && j < dense_arrays + n && i < base) {                 // a table's values or state
      std::uint64_t len = 0;
      in.read(reinterpret_cast<char*>(&len), 8);
      FK_CHECK_ARG(in && len <= static_cast<std::uint64_t>(config.table_rows[j - dense_arrays] * config.embedding_dim),
                   op, "dense", fmt::format("table {}'s array of at most {} floats", j - dense_arrays,
                                            config.table_rows[j - dense_arrays] * config.embedding_dim),
                   in ? fmt::format("{}", len) : std::string("a truncated stream"));
      in.seekg(static_cast<std::streamoff>(len) * 4, std::ios::cur);
      continue;
    }
    kept.push_back(detail::read_state_array(in, limit, op, "dense"));
  }
  std::vector<TensorView> arrays;
  for (std::vector<float>& v : kept)
    arrays.push_back(TensorView(v.data(), DType::f32, {static_cast<std::int64_t>(v.size())}, Device::cpu()));
  detail::write_state(out, adagrad, arrays);
  return adagrad;
}

// Whether the state at `in`'s position holds optimizer state; `in` left where it was.
bool peek_adagrad(std::istream& in) {
  const std::streamoff start = in.tellg();
  std::uint64_t count = 0;
  const bool adagrad = detail::read_state_header(in, count);
  in.seekg(start);
  return adagrad;
}

}  // namespace

dist::ShardingPlan one_process_plan(const std::vector<std::int64_t>& table_rows) {
  dist::ShardingPlan p;
  p.ranks = 1;
  for (std::size_t t = 0; t < table_rows.size(); ++t)
    p.tables.push_back({dist::Shard{.table = static_cast<int>(t), .row_begin = 0, .row_end = table_rows[t], .rank = 0}});
  return p;
}

void DistributedDlrm::save_shards(std::ostream& out) {
  // On the communicator's GPU, if any: write_state copies each array through host memory (the
  // embeddings' calls return once their stream's work is done, so the shards are current).
  const fk::detail::OnDevice on(comm_.device());
  const nn::EmbeddingBagCollection* l = embeddings_.local();
  const bool adagrad = l != nullptr && l->state.data() != nullptr;  // none before an Adagrad step
  std::vector<TensorView> arrays;
  for (int s = 0; l && s < l->num_tables(); ++s) arrays.push_back(l->tables[static_cast<std::size_t>(s)]);
  for (int s = 0; adagrad && s < l->num_tables(); ++s) arrays.push_back(shard_state(*l, s, dense_.config().rowwise_adagrad));
  float step[kStepFloats] = {};
  if (l != nullptr && sixteen_bit(dense_.config())) {
    detail::step_to_floats(l->rounding_step(), step);
    arrays.push_back(TensorView(step, DType::f32, {kStepFloats}, Device::cpu()));
  }
  detail::write_state(out, adagrad, arrays);
}

void DistributedDlrm::load_shards(std::istream& in) {
  const bool adagrad = peek_adagrad(in);
  load_tables({plan(), SavedTables::Layout::shards, [&](int) -> std::istream& { return in; }}, adagrad, kOp);
}

void DistributedDlrm::load(std::istream& dense, const SavedTables& tables) {
  const char* op = "models::DistributedDlrm::load";
  const fk::detail::OnDevice on(comm_.device());
  bool adagrad = false;
  if (tables.layout == SavedTables::Layout::shards) {
    adagrad = peek_adagrad(dense);
    dense_.load_state(dense);
  } else {
    std::stringstream part;
    adagrad = dense_part_of_one_process(dense_.config(), dense_arrays(), dense, part);
    dense_.load_state(part);
  }
  load_tables(tables, adagrad, op);
}

std::uint64_t DistributedDlrm::dense_arrays() {
  return 2 * dense_.linear_layers().size() + dense_.cross_parameters().size();
}

void DistributedDlrm::load_tables(const SavedTables& tables, bool adagrad, const char* op) {
  const fk::detail::OnDevice on(comm_.device());
  RowGatherer from(dense_.config(), tables, adagrad, dense_arrays(), op);
  nn::EmbeddingBagCollection* l = embeddings_.local();
  if (l == nullptr) return;  // this rank holds no shard
  l->state = Tensor();
  // On the embeddings' stream and device (done when it returns); its values are overwritten below.
  if (adagrad) embeddings_.ensure_state(0.0f);
  const bool rowwise = dense_.config().rowwise_adagrad;
  const std::vector<dist::Shard>& mine = embeddings_.local_shards();
  const Stream* st = embeddings_.stream();
  const DType dtype = dense_.config().embedding_dtype;
  if (st == nullptr && dtype == DType::f32) {  // host f32 shards: the rows are read straight into them
    for (std::size_t s = 0; s < mine.size(); ++s)
      from.gather({.table = mine[s].table,
                   .row_begin = mine[s].row_begin,
                   .row_end = mine[s].row_end,
                   .values = l->tables[s],
                   .state = adagrad ? shard_state(*l, static_cast<int>(s), rowwise) : TensorView()});
    return;
  }
  // Shards on the GPU, or of 16 bits: each shard's rows gathered into host staging, at most
  // kStagingFloats values a chunk (16-bit values narrowed to nearest, exact for the values a 16-bit
  // shard saved), then copied to the shard's rows (and accumulators), on the GPU on the
  // embeddings' stream, which is synchronized before the staging is reused, so the load is done
  // when this returns.
  constexpr std::int64_t kStagingFloats = std::int64_t{1} << 22;  // 16 MiB
  const std::int64_t d = dense_.config().embedding_dim, state_width = rowwise ? 1 : d;
  const std::int64_t chunk = std::max<std::int64_t>(1, kStagingFloats / std::max<std::int64_t>(d, 1));
  for (std::size_t s = 0; s < mine.size(); ++s) {
    const TensorView values = l->tables[s];
    const TensorView state = adagrad ? shard_state(*l, static_cast<int>(s), rowwise) : TensorView();
    const std::int64_t rows = mine[s].row_end - mine[s].row_begin;
    for (std::int64_t at = 0; at < rows; at += chunk) {
      const std::int64_t n = std::min(chunk, rows - at);
      Tensor host_values = Tensor::empty({n, d}, DType::f32, Device::cpu());
      Tensor host_state;
      if (adagrad)
        host_state = rowwise ? Tensor::empty({n}, DType::f32, Device::cpu())
                             : Tensor::empty({n, state_width}, DType::f32, Device::cpu());
      from.gather({.table = mine[s].table,
                   .row_begin = mine[s].row_begin + at,
                   .row_end = mine[s].row_begin + at + n,
                   .values = host_values,
                   .state = adagrad ? TensorView(host_state) : TensorView()});
      if (dtype != DType::f32) {
        Tensor narrowed = Tensor::empty({n, d}, dtype, Device::cpu());
        detail::narrow(host_values.data_as<float>(), narrowed);
        host_values = std::move(narrowed);
      }
      if (st == nullptr) {
        copy(values.slice_rows(at, at + n), host_values);
        if (adagrad) copy(state.slice_rows(at, at + n), host_state);
        continue;
      }
      copy_async(values.slice_rows(at, at + n), host_values, *st);
      if (adagrad) copy_async(state.slice_rows(at, at + n), host_state, *st);
      st->synchronize();
    }
  }
  // 16-bit shards: the number of updates made, the next update's rounding offset (the saved
  // streams just read hold it).
  if (dtype != DType::f32 && !mine.empty()) l->set_rounding_step(from.rounding_step());
}

void consolidate_distributed_state(const DlrmConfig& config, std::istream& dense, const SavedTables& tables,
                                   std::ostream& out) {
  const char* op = "models::consolidate_distributed_state";
  const std::size_t n = config.table_rows.size();
  const std::int64_t d = config.embedding_dim;
  FK_CHECK_ARG(tables.layout == SavedTables::Layout::shards, op, "tables", "a distributed state's shards",
               "a one-process state");
  // The dense state: parameters (P arrays), with Adagrad their accumulators (P more), then the
  // MLPs' rounding steps when compressing.
  std::uint64_t count = 0;
  const bool adagrad = detail::read_state_header(dense, count);
  const std::uint64_t extra = config.compress_activations_bits > 0 ? 1 : 0;
  FK_CHECK_ARG(count >= extra && (!adagrad || (count - extra) % 2 == 0), op, "dense",
               "a dense DLRM state of this configuration", fmt::format("{} arrays", count));
  const std::uint64_t params = adagrad ? (count - extra) / 2 : count - extra;
  const std::uint64_t limit = dense_floats_limit(config);
  std::vector<std::vector<float>> dense_arrays;
  for (std::uint64_t i = 0; i < count; ++i) dense_arrays.push_back(detail::read_state_array(dense, limit, op, "dense"));
  // Every table whole, and its accumulators, filled from the shards that hold its rows.
  RowGatherer from(config, tables, adagrad, 0, op);
  std::vector<Tensor> values, states;
  for (std::size_t t = 0; t < n; ++t) {
    const std::int64_t rows = config.table_rows[t];
    values.push_back(Tensor::empty({rows, d}, DType::f32, Device::cpu()));
    if (adagrad)
      states.push_back(config.rowwise_adagrad ? Tensor::empty({rows}, DType::f32, Device::cpu())
                                              : Tensor::empty({rows, d}, DType::f32, Device::cpu()));
    from.gather({.table = static_cast<int>(t),
                 .row_begin = 0,
                 .row_end = rows,
                 .values = values.back(),
                 .state = adagrad ? TensorView(states.back()) : TensorView()});
  }
  // 16-bit tables: the rounding steps (the dense state's, the MLPs', when compressing) with the
  // tables' step from the shards, as the one-process model keeps them.
  if (sixteen_bit(config)) {
    if (!extra) dense_arrays.emplace_back(3 * kStepFloats, 0.0f);
    std::vector<float>& steps = dense_arrays.back();
    FK_CHECK_ARG(steps.size() == 2 * kStepFloats || steps.size() == 3 * kStepFloats, op, "dense",
                 fmt::format("rounding steps of {} or {} floats", 2 * kStepFloats, 3 * kStepFloats),
                 fmt::format("{}", steps.size()));
    steps.resize(3 * kStepFloats, 0.0f);
    detail::step_to_floats(from.rounding_step(), steps.data() + 2 * kStepFloats);
  }
  // The single-process order (Dlrm's state_arrays): parameters, tables, parameters' and tables'
  // accumulators, rounding steps.
  const auto view = [](std::vector<float>& v) {
    return TensorView(v.data(), DType::f32, {static_cast<std::int64_t>(v.size())}, Device::cpu());
  };
  std::vector<TensorView> all;
  for (std::uint64_t i = 0; i < params; ++i) all.push_back(view(dense_arrays[i]));
  for (const Tensor& v : values) all.push_back(v);
  for (std::uint64_t i = 0; adagrad && i < params; ++i) all.push_back(view(dense_arrays[params + i]));
  for (const Tensor& s : states) all.push_back(s);
  if (extra || sixteen_bit(config)) all.push_back(view(dense_arrays.back()));
  detail::write_state(out, adagrad, all);
}

}  // namespace fk::models
