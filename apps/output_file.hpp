// The files fusekit train writes (checkpoints, the metrics JSON, the trace): checked before a run,
// written so that a crash or a full disk never leaves a half-written file under the name.
#pragma once

#include <functional>
#include <iosfwd>
#include <string>

namespace fk::apps {

// Throws fk::Error (op `op`, argument `flag`) naming the path and the OS error unless `path` can be
// written: not a directory, in a directory that exists, creatable there. Leaves nothing behind.
void check_writable(const std::string& path, const char* op, const char* flag);

// Writes `path` through `write`: the bytes go to `path`.tmp, which is flushed to disk (fsync),
// renamed over `path`, and the directory is flushed too. On any failure the temporary is removed
// and fk::Error names the path and the OS error; the previous file under `path` stays whole.
void write_file_atomically(const std::string& path, const char* op, const char* flag,
                           const std::function<void(std::ostream&)>& write);

}  // namespace fk::apps
