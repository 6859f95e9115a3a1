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

// The arguments of all_to_all_v: both buffers on `where` (check_collective_buffer), one dtype, and
// their counts (check_counts); returns the elements sent and received.
struct AllToAllTotals {
  std::int64_t sent = 0, received = 0;
};
AllToAllTotals check_all_to_all(const TensorView& send, std::span<const std::int64_t> send_counts,
                                const TensorView& recv, std::span<const std::int64_t> recv_counts, Device where,
                                int ranks, const char* op);

}  // namespace fk::dist::detail
