#include "apps/checkpoint_distributed.hpp"

#include <fmt/format.h>
#include <zlib.h>

#include <filesystem>
#include <memory>

#include "fusekit/core/error.hpp"
#include "fusekit/models/dlrm_distributed.hpp"

namespace fk::apps {

namespace {

std::uint32_t config_crc(const nlohmann::json& config) {
  nlohmann::json c = config;
  c.erase("distributed");
  const std::string s = c.dump();
  return static_cast<std::uint32_t>(::crc32(0, reinterpret_cast<const Bytef*>(s.data()), static_cast<uInt>(s.size())));
}

nlohmann::json shards_json(const dist::ShardingPlan& plan, int rank) {  // rank < 0: every shard
  nlohmann::json out = nlohmann::json::array();
  for (const auto& table : plan.tables)
    for (const dist::Shard& sh : table)
      if (rank < 0 || sh.rank == rank) out.push_back({sh.table, sh.row_begin, sh.row_end, sh.rank});
  return out;
}

[[noreturn]] void bad(const char* op, const char* flag, const std::string& path, const std::string& what) {
  throw Error(op, flag, "a distributed fusekit DLRM checkpoint (manifest and shard files)", fmt::format("{}: {}", path, what));
}

const nlohmann::json& section(const std::string& path, const CheckpointHeader& h, const char* op, const char* flag) {
  if (!is_distributed(h)) bad(op, flag, path, "no \"distributed\" section (a one-process checkpoint)");
  const nlohmann::json& d = h.config["distributed"];
  if (!d.contains("world_size") || !d["world_size"].is_number_integer() || !d.contains("shards") ||
      !d["shards"].is_array() || !d.contains("config_crc") || !d["config_crc"].is_number_unsigned())
    bad(op, flag, path, "a \"distributed\" section without world_size, shards or config_crc");
  if (d["config_crc"].get<std::uint32_t>() != config_crc(h.config))
    bad(op, flag, path, "a configuration that does not match its config_crc");
  return d;
}

}  // namespace

std::string shard_file_path(const std::string& manifest, std::int64_t step, int rank, int ranks) {
  return fmt::format("{}.step{}.rank{}-of-{}", manifest, step, rank, ranks);
}

void write_shard_file(const std::string& manifest, std::int64_t step, const nlohmann::json& config,
                      const dist::ShardingPlan& plan, int rank, const std::function<void(std::ostream&)>& state) {
  const nlohmann::json meta = {{"world_size", plan.ranks},
                               {"rank", rank},
                               {"shards", shards_json(plan, rank)},
                               {"config_crc", config_crc(config)}};
  write_checkpoint(shard_file_path(manifest, step, rank, plan.ranks), step, meta, state);
}

void write_manifest(const std::string& manifest, std::int64_t step, const nlohmann::json& config,
                    const dist::ShardingPlan& plan, const std::function<void(std::ostream&)>& dense) {
  nlohmann::json c = config;
  nlohmann::json files = nlohmann::json::array();
  for (int r = 0; r < plan.ranks; ++r)
    files.push_back(std::filesystem::path(shard_file_path(manifest, step, r, plan.ranks)).filename().string());
  c["distributed"] = {{"world_size", plan.ranks},
                      {"shards", shards_json(plan, -1)},
                      {"files", files},
                      {"config_crc", config_crc(config)}};
  write_checkpoint(manifest, step, c, dense);
  // The previous checkpoints' shard files (the new manifest names none of them).
  const std::filesystem::path m(manifest);
  const std::filesystem::path dir = m.has_parent_path() ? m.parent_path() : std::filesystem::path(".");
  const std::string prefix = m.filename().string() + ".step", mine = fmt::format("{}{}.", prefix, step);
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.starts_with(prefix) && !name.starts_with(mine) && name.find(".rank") != std::string::npos)
      std::filesystem::remove(e.path(), ec);
  }
}

bool is_distributed(const CheckpointHeader& h) { return h.config.is_object() && h.config.contains("distributed"); }

nlohmann::json stored_run_config(const CheckpointHeader& h) {
  nlohmann::json c = h.config;
  if (c.is_object()) c.erase("distributed");
  return c;
}

dist::ShardingPlan manifest_plan(const std::string& path, const CheckpointHeader& h,
                                 const std::vector<std::int64_t>& table_rows, const char* op, const char* flag) {
  const nlohmann::json& d = section(path, h, op, flag);
  dist::ShardingPlan plan;
  plan.ranks = d["world_size"].get<int>();
  if (plan.ranks < 1 || plan.ranks > 1 << 20) bad(op, flag, path, fmt::format("world size {}", plan.ranks));
  plan.tables.resize(table_rows.size());
  for (const nlohmann::json& s : d["shards"]) {
    if (!s.is_array() || s.size() != 4 || !s[0].is_number_integer() || !s[1].is_number_integer() ||
        !s[2].is_number_integer() || !s[3].is_number_integer())
      bad(op, flag, path, fmt::format("a shard {} (expected [table, row_begin, row_end, rank])", s.dump()));
    const dist::Shard sh{.table = s[0].get<int>(), .row_begin = s[1].get<std::int64_t>(),
                         .row_end = s[2].get<std::int64_t>(), .rank = s[3].get<int>()};
    if (sh.table < 0 || static_cast<std::size_t>(sh.table) >= table_rows.size() || sh.rank < 0 || sh.rank >= plan.ranks)
      bad(op, flag, path, fmt::format("a shard {} of a table or rank that does not exist", s.dump()));
    auto& shards = plan.tables[static_cast<std::size_t>(sh.table)];
    const std::int64_t next = shards.empty() ? 0 : shards.back().row_end;
    if (sh.row_begin != next || sh.row_end <= sh.row_begin || sh.row_end > table_rows[static_cast<std::size_t>(sh.table)])
      bad(op, flag, path, fmt::format("a shard {} that does not continue its table's rows", s.dump()));
    shards.push_back(sh);
  }
  for (std::size_t t = 0; t < table_rows.size(); ++t)
    if (plan.tables[t].empty() || plan.tables[t].back().row_end != table_rows[t])
      bad(op, flag, path, fmt::format("table {}'s shards not covering its {} rows", t, table_rows[t]));
  return plan;
}

void open_shard_file(const std::string& path, const CheckpointHeader& h, int rank, std::ifstream& in, const char* op,
                     const char* flag) {
  const nlohmann::json& d = section(path, h, op, flag);
  const int ranks = d["world_size"].get<int>();
  const std::string file = shard_file_path(path, h.step, rank, ranks);
  CheckpointHeader s;
  try {
    s = open_checkpoint(file, in, op);
  } catch (const Error& e) {
    throw Error(e.op(), flag, fmt::format("the shard file of rank {} that {} names", rank, path), e.got());
  }
  nlohmann::json mine = nlohmann::json::array();
  for (const nlohmann::json& sh : d["shards"])
    if (sh.is_array() && sh.size() == 4 && sh[3] == rank) mine.push_back(sh);
  const nlohmann::json& m = s.config;
  // Compared as JSON values: a field of another type is another checkpoint's, not an exception.
  const auto field = [&m](const char* key) { return m.contains(key) ? m[key] : nlohmann::json(); };
  if (s.step != h.step || !m.is_object() || field("world_size") != ranks || field("rank") != rank ||
      field("shards") != mine || field("config_crc") != d["config_crc"])
    throw Error(op, flag, fmt::format("rank {}'s shard file of {} (step {}, {} ranks)", rank, path, h.step, ranks),
                fmt::format("{}: another checkpoint's (step {}, {})", file, s.step, m.dump()));
}

namespace {

// The shard files of the manifest `h` at `path` as models::SavedTables, each opened (and checked
// by open_shard_file) when first wanted; `files` holds them.
models::SavedTables shard_files(const std::string& path, const CheckpointHeader& h, dist::ShardingPlan plan,
                                std::vector<std::unique_ptr<std::ifstream>>& files, const char* op, const char* flag) {
  return {std::move(plan), models::SavedTables::Layout::shards, [&path, &h, &files, op, flag](int r) -> std::istream& {
            files.push_back(std::make_unique<std::ifstream>());
            open_shard_file(path, h, r, *files.back(), op, flag);
            return *files.back();
          }};
}

}  // namespace

void consolidate_checkpoint(const std::string& path, const CheckpointHeader& h, std::istream& dense,
                            const models::DlrmConfig& config, std::ostream& out, const char* op, const char* flag) {
  std::vector<std::unique_ptr<std::ifstream>> files;
  const models::SavedTables tables =
      shard_files(path, h, manifest_plan(path, h, config.table_rows, op, flag), files, op, flag);
  models::consolidate_distributed_state(config, dense, tables, out);
}

dist::ShardingPlan load_distributed(const std::string& path, const CheckpointHeader& h, std::ifstream& in,
                                    models::DistributedDlrm& model, const char* op, const char* flag) {
  const std::vector<std::int64_t>& rows = model.dense().config().table_rows;
  std::vector<std::unique_ptr<std::ifstream>> files;
  const std::streamoff start = in.tellg();
  // A one-process checkpoint: the dense arrays read first, then the tables' rows from the same file.
  const models::SavedTables tables =
      is_distributed(h) ? shard_files(path, h, manifest_plan(path, h, rows, op, flag), files, op, flag)
                        : models::SavedTables{models::one_process_plan(rows), models::SavedTables::Layout::one_process,
                                              [&in, start](int) -> std::istream& {
                                                in.clear();
                                                in.seekg(start);
                                                return in;
                                              }};
  try {
    model.load(in, tables);
  } catch (const Error& e) {
    if (e.arg() == flag) throw;  // a shard file's, already named
    throw Error(op, flag, fmt::format("{} ({}, {})", e.expected(), e.op(), e.arg()),
                fmt::format("{}: {}", path, e.got()));
  }
  return tables.plan;
}

}  // namespace fk::apps
