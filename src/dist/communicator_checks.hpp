// Argument checks every communicator shares (src/dist/).
#pragma once

#include <cstdint>
#include <span>

#include "fusekit/core/tensor.hpp"

namespace fk::dist::detail {

// Memory on `where` (the communicator's device()), contiguous, with data.
void check_collective_buffer(const TensorView& t, Device where, const char* op, const char* arg);
// One count >= 0 per rank, their sum within t (no overflow on the way); returns the sum.
std::int64_t check_counts(const TensorView& t, std::span<const std::int64_t> counts, int ranks, const char* op,
                          const char* arg);

}  // namespace fk::dist::detail
