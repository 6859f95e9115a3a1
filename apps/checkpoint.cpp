#include "apps/checkpoint.hpp"

#include <fmt/format.h>
#include <zlib.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <set>
#include <streambuf>
#include <vector>

#include "apps/output_file.hpp"
#include "fusekit/core/error.hpp"

namespace fk::apps {

namespace {

constexpr char kMagicV1[8] = {'F', 'K', 'C', 'K', 'P', 'T', '0', '1'};
constexpr char kMagicV2[8] = {'F', 'K', 'C', 'K', 'P', 'T', '0', '2'};
constexpr char kEnd[8] = {'F', 'K', 'C', 'K', 'E', 'N', 'D', '2'};
constexpr std::uint64_t kMaxConfigBytes = std::uint64_t{1} << 24;
constexpr std::uint64_t kTrailerBytes = 8 + 4 + 8;

std::uint32_t crc(std::uint32_t c, const void* data, std::size_t n) {
  const auto* p = static_cast<const Bytef*>(data);
  while (n > 0) {  // zlib takes 32-bit lengths
    const uInt k = static_cast<uInt>(std::min<std::size_t>(n, std::size_t{1} << 30));
    c = static_cast<std::uint32_t>(::crc32(c, p, k));
    p += k;
    n -= k;
  }
  return c;
}

// Forwards writes to `sink`, counting the bytes and their CRC-32.
class CrcWriter : public std::streambuf {
 public:
  explicit CrcWriter(std::streambuf* sink) : sink_(sink) {}
  std::uint32_t crc32() const noexcept { return crc_; }
  std::uint64_t bytes() const noexcept { return bytes_; }

 protected:
  int_type overflow(int_type ch) override {
    if (traits_type::eq_int_type(ch, traits_type::eof())) return traits_type::not_eof(ch);
    const char c = traits_type::to_char_type(ch);
    return xsputn(&c, 1) == 1 ? ch : traits_type::eof();
  }
  std::streamsize xsputn(const char* s, std::streamsize n) override {
    crc_ = crc(crc_, s, static_cast<std::size_t>(n));
    bytes_ += static_cast<std::uint64_t>(n);
    return sink_->sputn(s, n);
  }

 private:
  std::streambuf* sink_;
  std::uint32_t crc_ = 0;
  std::uint64_t bytes_ = 0;
};

template <class T>
void put(std::ostream& out, const T& v) {
  out.write(reinterpret_cast<const char*>(&v), sizeof v);
}

[[noreturn]] void bad(const char* op, const std::string& path, const std::string& what) {
  throw Error(op, "--checkpoint", "a fusekit DLRM checkpoint", fmt::format("{}: {}", path, what));
}

template <class T>
T get(std::istream& in, const char* op, const std::string& path, const char* what) {
  T v{};
  in.read(reinterpret_cast<char*>(&v), sizeof v);
  if (!in) bad(op, path, fmt::format("truncated in its {}", what));
  return v;
}

}  // namespace

void write_checkpoint(const std::string& path, std::int64_t step, const nlohmann::json& config,
                      const std::function<void(std::ostream&)>& state) {
  write_file_atomically(path, "fusekit train", "--checkpoint", [&](std::ostream& out) {
    const std::string cfg = config.dump();
    const std::uint64_t st = static_cast<std::uint64_t>(step), len = cfg.size();
    std::uint32_t c = crc(0, &st, 8);
    c = crc(c, &len, 8);
    c = crc(c, cfg.data(), cfg.size());
    out.write(kMagicV2, 8);
    put(out, st);
    put(out, len);
    out.write(cfg.data(), static_cast<std::streamsize>(len));
    put(out, c);
    CrcWriter w(out.rdbuf());
    std::ostream body(&w);
    state(body);
    if (!body) throw Error("fusekit train", "--checkpoint", "a complete write", path);
    put(out, w.bytes());
    put(out, w.crc32());
    out.write(kEnd, 8);
  });
}

CheckpointHeader open_checkpoint(const std::string& path, std::ifstream& in, const char* op) {
  in.open(path, std::ios::binary);
  if (!in) throw Error(op, "--checkpoint", "a readable file", fmt::format("{} ({})", path, std::strerror(errno)));
  std::error_code ec;
  const std::uint64_t size = std::filesystem::file_size(path, ec);
  if (ec) throw Error(op, "--checkpoint", "a readable file", fmt::format("{} ({})", path, ec.message()));
  char magic[8] = {};
  in.read(magic, 8);
  const bool v1 = in && std::equal(magic, magic + 8, kMagicV1);
  if (!in || (!v1 && !std::equal(magic, magic + 8, kMagicV2)))
    bad(op, path, "no FKCKPT02 (or FKCKPT01) signature");
  const std::uint64_t step = get<std::uint64_t>(in, op, path, "step");
  const std::uint64_t len = get<std::uint64_t>(in, op, path, "configuration length");
  if (len > kMaxConfigBytes || len > size) bad(op, path, fmt::format("a configuration of {} bytes", len));
  std::string cfg(len, '\0');
  in.read(cfg.data(), static_cast<std::streamsize>(len));
  if (!in) bad(op, path, "truncated in its configuration");
  if (!v1) {
    std::uint32_t c = crc(0, &step, 8);
    c = crc(c, &len, 8);
    c = crc(c, cfg.data(), cfg.size());
    if (get<std::uint32_t>(in, op, path, "header checksum") != c)
      bad(op, path, "the step or configuration fails its checksum (the file is damaged)");
  }
  CheckpointHeader h;
  h.step = static_cast<std::int64_t>(step);
  if (h.step < 0) bad(op, path, fmt::format("step {}", step));
  try {
    h.config = nlohmann::json::parse(cfg);
  } catch (const nlohmann::json::exception& e) {
    bad(op, path, fmt::format("a configuration that is not JSON ({})", e.what()));
  }
  if (v1) return h;
  // The state and its trailer: length, checksum, end mark; checked before anything is loaded.
  const std::uint64_t start = static_cast<std::uint64_t>(in.tellg());
  if (size < start + kTrailerBytes) bad(op, path, "truncated before its model state's trailer");
  in.seekg(static_cast<std::streamoff>(size - kTrailerBytes));
  const std::uint64_t state_bytes = get<std::uint64_t>(in, op, path, "trailer");
  const std::uint32_t state_crc = get<std::uint32_t>(in, op, path, "trailer");
  char end[8] = {};
  in.read(end, 8);
  if (!in || !std::equal(end, end + 8, kEnd)) bad(op, path, "truncated (no FKCKEND2 end mark)");
  if (state_bytes != size - kTrailerBytes - start)
    bad(op, path, fmt::format("a model state of {} bytes where the file holds {}", state_bytes, size - kTrailerBytes - start));
  in.seekg(static_cast<std::streamoff>(start));
  std::vector<char> buf(static_cast<std::size_t>(std::min<std::uint64_t>(state_bytes, std::uint64_t{1} << 24)));
  std::uint32_t c = 0;
  for (std::uint64_t left = state_bytes; left > 0;) {
    const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(left, buf.size()));
    in.read(buf.data(), static_cast<std::streamsize>(n));
    if (!in) bad(op, path, "truncated in its model state");
    c = crc(c, buf.data(), n);
    left -= n;
  }
  if (c != state_crc) bad(op, path, "the model state fails its checksum (the file is damaged)");
  in.seekg(static_cast<std::streamoff>(start));
  return h;
}

std::string config_differences(const nlohmann::json& stored, const nlohmann::json& requested,
                               const nlohmann::json& defaults) {
  // What a resumed run may change without changing what it computes (or only how it reports).
  static const std::set<std::string> free = {
      "training.steps",      "training.epochs",     "training.eval_every", "training.print_every",
      "training.device",     "training.impl",       "training.metrics_json", "training.checkpoint",
      "training.trace",      "training.trace_steps", "training.checkpoint_every", "data.workers",
      "training.test_mini_batch_size"};
  std::string out;
  for (const auto& [section, fields] : requested.items()) {
    if (!fields.is_object()) continue;
    for (const auto& [key, value] : fields.items()) {
      const std::string name = section + "." + key;
      if (free.contains(name)) continue;
      const auto find = [](const nlohmann::json& j, const std::string& s, const std::string& k) -> const nlohmann::json* {
        if (j.contains(s) && j[s].is_object() && j[s].contains(k)) return &j[s][k];
        return nullptr;
      };
      const nlohmann::json* old = find(stored, section, key);
      const bool absent = old == nullptr;
      if (absent) old = find(defaults, section, key);
      if (old && *old == value) continue;
      out += fmt::format("{}{}: stored {}{}, requested {}", out.empty() ? "" : "; ", name,
                         old ? old->dump() : "(none)", absent && old ? " (absent: the default)" : "", value.dump());
    }
  }
  return out;
}

}  // namespace fk::apps
