// The collectives a sharded model needs, behind one interface: rank and size, all-to-all with
// per-rank counts (ids out, pooled embeddings back, their gradients out again), an in-place sum
// all-reduce (the data-parallel gradients), a barrier, and abort.
//
//   single   one process (size 1): all_to_all_v copies, all_reduce_sum leaves the data as it is;
//            what a build without MPI runs
//   mpi      MPI's collectives on host memory (FUSEKIT_WITH_MPI; ranks launched by mpirun)
//   offline  one rank of N without its peers (no collective), for a rank's state without a run
//
// Every call is collective: all ranks make the same calls in the same order. Buffers are
// TensorViews, so each implementation checks they live where it can reach them (host memory for
// these). A device implementation (NCCL) takes the same calls with the `stream` argument the
// collective is queued on; the host implementations synchronise it first, if given, and return
// when the collective is done. Errors throw fk::Error; a rank that fails should call abort(), so
// that the others stop instead of waiting in their next collective.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>

#include "fusekit/core/tensor.hpp"

namespace fk {
class Stream;
}

namespace fk::dist {

class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  virtual int rank() const noexcept = 0;
  virtual int size() const noexcept = 0;
  virtual std::string_view backend() const noexcept = 0;  // "single" | "mpi" | "offline"
  // Where the buffers of the calls must live (host memory: Device::cpu()).
  virtual Device device() const noexcept = 0;

  // send: contiguous, send_counts[r] elements for rank r, one block per rank in rank order; recv:
  // contiguous, recv_counts[r] elements from rank r, in rank order (written). Counts in elements
  // of the buffers' dtype (u8, i32, i64 or f32; the same on both sides); recv_counts[r] must
  // equal what rank r sends here (exchange_counts gives it).
  virtual void all_to_all_v(const TensorView& send, std::span<const std::int64_t> send_counts, const TensorView& recv,
                            std::span<const std::int64_t> recv_counts, const Stream* stream = nullptr) = 0;
  // data (f32, contiguous) = the elementwise sum over the ranks, the same on every rank.
  virtual void all_reduce_sum(const TensorView& data, const Stream* stream = nullptr) = 0;
  virtual void barrier() = 0;
  // Ends every rank's process with `code` (MPI_Abort); size 1: std::exit. Not for library code:
  // for the program's top level, after a rank has reported an error.
  [[noreturn]] virtual void abort(int code) = 0;

  // What each rank sends to this one: recv[r] = rank r's send[rank()] (send and recv: size() values).
  void exchange_counts(std::span<const std::int64_t> send, std::span<std::int64_t> recv);
};

// Size 1, for a build or a run without MPI.
std::unique_ptr<Communicator> make_single_communicator();

// Rank `rank` of `size` on its own, with no peers: for building one rank's part of a sharded model
// and saving or loading its state without running it (re-sharding tools, tests, the fuzz seeds).
// Every collective throws fk::Error; abort() ends the process. fk::Error for rank outside [0, size).
std::unique_ptr<Communicator> make_offline_communicator(int rank, int size);

// MPI_COMM_WORLD; initialises MPI (MPI_THREAD_FUNNELED) unless it is already, and finalises it
// when the last communicator it made is destroyed. Throws fk::Error when fusekit was built
// without MPI (FUSEKIT_WITH_MPI).
std::unique_ptr<Communicator> make_mpi_communicator();

}  // namespace fk::dist
