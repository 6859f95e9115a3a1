// fk::Error: the one exception fusekit throws. It names the op, the argument, what was expected
// and what was got, so that a bad call reads like "fk::bias_act_forward: argument 'bias':
// expected shape [1024], got [1000]".
#pragma once

#include <stdexcept>
#include <string>

namespace fk {

class Error : public std::runtime_error {
 public:
  Error(std::string op, std::string arg, std::string expected, std::string got);
  // A failure that is no one argument's fault (a CUDA error, an exhausted allocator).
  explicit Error(std::string op, std::string what);

  const std::string& op() const noexcept { return op_; }
  const std::string& arg() const noexcept { return arg_; }
  const std::string& expected() const noexcept { return expected_; }
  const std::string& got() const noexcept { return got_; }

 private:
  std::string op_, arg_, expected_, got_;
};

// Throws fk::Error(op, arg, expected, got) unless cond holds. The strings are built only on failure.
#define FK_CHECK_ARG(cond, op, arg, expected, got)               \
  do {                                                           \
    if (!(cond)) throw ::fk::Error((op), (arg), (expected), (got)); \
  } while (0)

// Internal invariant that is not the caller's fault; names file and line. (The builtins, not
// std::source_location, which clang before 15 cannot compile with libstdc++: the fuzz build.)
[[noreturn]] void throw_internal(const char* what, const char* file = __builtin_FILE(), int line = __builtin_LINE());

}  // namespace fk
