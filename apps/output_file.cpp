#include "apps/output_file.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "fusekit/core/error.hpp"

namespace fk::apps {

namespace {

namespace fs = std::filesystem;

std::string os_error(int err) { return std::strerror(err); }

fs::path directory_of(const std::string& path) {
  const fs::path parent = fs::path(path).parent_path();
  return parent.empty() ? fs::path(".") : parent;
}

// fsync of a file or directory by name; returns errno (0 on success).
int sync_path(const fs::path& p, bool directory) {
  const int fd = ::open(p.c_str(), directory ? (O_RDONLY | O_DIRECTORY) : O_RDONLY);
  if (fd < 0) return errno;
  const int rc = ::fsync(fd) == 0 ? 0 : errno;
  ::close(fd);
  return rc;
}

}  // namespace

void check_writable(const std::string& path, const char* op, const char* flag) {
  std::error_code ec;
  FK_CHECK_ARG(!path.empty(), op, flag, "a file path", "an empty path");
  FK_CHECK_ARG(!fs::is_directory(path, ec), op, flag, "a file path", fmt::format("{} (a directory)", path));
  const fs::path dir = directory_of(path);
  FK_CHECK_ARG(fs::is_directory(dir, ec), op, flag, "a path in an existing directory",
               fmt::format("{} ({} does not exist)", path, dir.string()));
  // Create (and remove) the temporary the write will use: the one test of permission and space
  // for a new file that does not depend on who we are.
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  FK_CHECK_ARG(fd >= 0, op, flag, "a writable path", fmt::format("{} ({})", path, os_error(errno)));
  ::close(fd);
  ::unlink(tmp.c_str());
}

void write_file_atomically(const std::string& path, const char* op, const char* flag,
                           const std::function<void(std::ostream&)>& write) {
  const std::string tmp = path + ".tmp";
  auto fail = [&](const std::string& what, int err) {
    std::error_code ec;
    fs::remove(tmp, ec);
    throw Error(op, flag, what, fmt::format("{} ({})", path, err != 0 ? os_error(err) : "write failed"));
  };
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) fail("a writable path", errno);
    try {
      write(out);
    } catch (...) {
      std::error_code ec;
      fs::remove(tmp, ec);
      throw;
    }
    out.flush();
    if (!out) fail("a complete write", errno);
    out.close();
    if (!out) fail("a complete write", errno);
  }
  if (const int err = sync_path(tmp, false)) fail("a file flushed to disk", err);
  std::error_code ec;
  fs::rename(tmp, path, ec);  // atomic: a crash leaves the previous file whole
  if (ec) fail("a rename into place", ec.value());
  if (const int err = sync_path(directory_of(path), true)) fail("its directory flushed to disk", err);
}

}  // namespace fk::apps
