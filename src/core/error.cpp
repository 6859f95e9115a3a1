#include "fusekit/core/error.hpp"

#include <fmt/format.h>

namespace fk {

Error::Error(std::string op, std::string arg, std::string expected, std::string got)
    : std::runtime_error(fmt::format("fk::{}: argument '{}': expected {}, got {}", op, arg, expected, got)),
      op_(std::move(op)), arg_(std::move(arg)), expected_(std::move(expected)), got_(std::move(got)) {}

Error::Error(std::string op, std::string what)
    : std::runtime_error(fmt::format("fk::{}: {}", op, what)), op_(std::move(op)) {}

void throw_internal(const char* what, const char* file, int line) {
  throw Error("internal", fmt::format("{} ({}:{})", what, file, line));
}

}  // namespace fk
