// The collectives a sharded model needs, behind one interface: rank and size, all-to-all with
// per-rank counts (ids out, pooled embeddings back, their gradients out again), an in-place sum
// all-reduce (the data-parallel gradients), a barrier, and abort.
//
//   single   one process (size 1): all_to_all_v copies, all_reduce_sum leaves the data as it is;
//            what a build without MPI runs
//   mpi      MPI's collectives on host memory (FUSEKIT_WITH_MPI; ranks launched by mpirun)
//   nccl     NCCL's on device memory, one GPU a rank (a CUDA build with NCCL: FUSEKIT_NCCL), in
//            two setups: one process a GPU, launched by mpirun, with the MPI communicator to start
//            it; or one process driving N GPUs, one thread each (make_nccl_communicators)
//   offline  one rank of N without its peers (no collective), for a rank's state without a run
//
// Every call is collective: all ranks make the same calls in the same order. Buffers are
// TensorViews, so each implementation checks they live where it can reach them (host memory for
// single, mpi and offline, this rank's GPU for nccl). The device implementation queues each collective
// on the `stream` argument and returns once it is queued; without a stream it uses a stream of
// its own and returns when the collective is done. The host implementations synchronise the
// stream first, if given, and return when the collective is done. Errors throw fk::Error; a rank
// that fails should call abort(), so that the others stop instead of waiting in their next
// collective.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

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
  virtual std::string_view backend() const noexcept = 0;  // "single" | "mpi" | "offline" | "nccl"
  // Where the buffers of the calls must live (host memory: Device::cpu(); nccl: the rank's GPU).
  virtual Device device() const noexcept = 0;

  // send: contiguous, send_counts[r] elements for rank r, one block per rank in rank order; recv:
  // contiguous, recv_counts[r] elements from rank r, in rank order (written). Counts in elements
  // of the buffers' dtype (u8, i32, i64 or f32; the same on both sides); recv_counts[r] must
  // equal what rank r sends here (exchange_counts gives it).
  virtual void all_to_all_v(const TensorView& send, std::span<const std::int64_t> send_counts, const TensorView& recv,
                            std::span<const std::int64_t> recv_counts, const Stream* stream = nullptr) = 0;
  // data (f32, contiguous) = the elementwise sum over the ranks, the same on every rank.
  virtual void all_reduce_sum(const TensorView& data, const Stream* stream = nullptr) = 0;
  // The same sum without waiting for it, so that several can run while the caller goes on (the
  // data-parallel gradient buckets, each started as soon as the backward has made it):
  // start_all_reduce_sum starts data's sum once the work queued on `ready` so far is done, and
  // returns without waiting for the sum; data must then be neither read nor written until
  // wait_all_reduces(), which completes every sum started so far. A host
  // communicator returns from wait_all_reduces when they are done (`stream` ignored); the device
  // one makes `stream` wait for them (the host does not wait; no stream: the host waits). Sums are
  // started in the same order on every rank, and each gives what all_reduce_sum of the same
  // buffer gives (the same reduction order where the backend fixes one; see docs/dlrm.md).
  //   single, offline  the default: all_reduce_sum at the start, nothing to wait for
  //   mpi              MPI_Iallreduce, MPI_Waitall (each start also tests the earlier ones, which
  //                    lets an MPI without a progress thread move them on)
  //   nccl             ncclAllReduce on a communication stream of the communicator's own, after an
  //                    event recorded on `ready`; wait: `stream` waits for an event recorded after them
  virtual void start_all_reduce_sum(const TensorView& data, const Stream* ready = nullptr) {
    all_reduce_sum(data, ready);
  }
  virtual void wait_all_reduces(const Stream* stream = nullptr) { (void)stream; }
  virtual void barrier() = 0;
  // Ends every rank's process with `code` (MPI_Abort); size 1: std::exit; nccl: aborts the NCCL
  // communicator, then its MPI communicator's abort, or ends this process (all its GPUs' threads)
  // when it has none. Not for library code: for the program's top level, after a rank has reported
  // an error.
  [[noreturn]] virtual void abort(int code) = 0;

  // What each rank sends to this one: recv[r] = rank r's send[rank()] (send and recv: size() values,
  // host memory, for every backend); returns when they are there.
  virtual void exchange_counts(std::span<const std::int64_t> send, std::span<std::int64_t> recv);
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

// ---------------------------------------------------------------------------------------------
// NCCL (device memory). Built when CMake finds NCCL in a CUDA build (FUSEKIT_NCCL, docs/dlrm.md);
// otherwise the factories throw fk::Error. Programs link libnccl.so.2 dynamically: at run time it
// is found through the build's RPATH or LD_LIBRARY_PATH (e.g. PyTorch's nvidia-nccl wheel).
//
// Never waits forever: the communicators are NCCL's nonblocking ones (ncclConfig_t::blocking = 0),
// and a watchdog thread per communicator follows every queued collective (an event recorded after
// it on its stream) with ncclCommGetAsyncError. When one fails or is not done within `timeout` (a
// dead or diverged rank), the communicator is aborted (ncclCommAbort: its kernels stop, so the
// streams drain) and the waiting call, or the next call, throws fk::Error naming the collective,
// the rank and NCCL's error; the communicator stays unusable. Creation is bounded by the same
// timeout. A collective that returns without waiting (one given a stream) can leave garbage in its
// outputs if it is aborted later: the next call's error says so.
//
// NVLink multicast (NVLS) is off unless the caller says otherwise: the factories set
// NCCL_NVLS_ENABLE=0 when the environment does not set it (the GPU hosts fusekit is tested on
// require it off; a launcher that wants NVLS sets NCCL_NVLS_ENABLE=1). NCCL reads its other
// NCCL_* variables as usual.
struct NcclOptions {
  // How long a collective may take from being queued to being done on its GPU, and creation.
  std::chrono::milliseconds timeout = std::chrono::seconds(300);
  // make_nccl_communicator: this rank's GPU; -1 picks its local rank (its place among the ranks
  // on its host, by host name), which must be below the host's GPU count.
  int device = -1;
};

// True when fusekit was built with NCCL (FUSEKIT_WITH_NCCL).
bool built_with_nccl() noexcept;

// One process a GPU: one NCCL rank for each rank of `bootstrap` (make_mpi_communicator() under
// mpirun; any host communicator, size 1 included), with the same rank and size. Collective over
// `bootstrap`: rank 0 makes NCCL's unique id and sends it to the others through it. The NCCL
// communicator keeps `bootstrap` (its abort() is MPI_Abort, and MPI stays initialised).
std::unique_ptr<Communicator> make_nccl_communicator(std::shared_ptr<Communicator> bootstrap,
                                                     const NcclOptions& options = {});

// One process, one thread a GPU: communicator r is rank r of devices.size(), on GPU devices[r]
// (distinct GPUs), created together from this thread. Use each from its own thread (all ranks'
// calls must be in flight together) and destroy them in any order from any thread: NCCL's
// resources go when the last one goes.
std::vector<std::unique_ptr<Communicator>> make_nccl_communicators(std::span<const int> devices,
                                                                   const NcclOptions& options = {});

}  // namespace fk::dist
