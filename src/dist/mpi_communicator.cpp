// The MPI communicator: MPI_COMM_WORLD's collectives on host memory (MPI_Alltoallv, MPI_Allreduce,
// MPI_Barrier). MPI's default error handler stays (MPI_ERRORS_ARE_FATAL): a failed collective
// ends every rank rather than leaving the others waiting.
#include <mpi.h>

#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <mutex>
#include <vector>

#include "dist/communicator_checks.hpp"
#include "fusekit/core/error.hpp"
#include "fusekit/core/stream.hpp"
#include "fusekit/dist/communicator.hpp"

namespace fk::dist {
namespace {

constexpr const char* kA2a = "dist::MpiCommunicator::all_to_all_v";

void mpi_check(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  throw Error(fmt::format("dist::MpiCommunicator ({})", call), std::string(msg, static_cast<std::size_t>(len)));
}

MPI_Datatype mpi_type(DType dt, const char* op) {
  switch (dt) {
    case DType::u8: return MPI_BYTE;
    case DType::i32: return MPI_INT32_T;
    case DType::i64: return MPI_INT64_T;
    case DType::f32: return MPI_FLOAT;
    default: break;
  }
  throw Error(op, "dtype", "u8, i32, i64 or f32", std::string(dtype_name(dt)));
}

// MPI's counts and displacements are int: this communicator moves at most INT_MAX elements of a
// buffer per call (MPI 4's large-count calls are not in Debian's Open MPI 4.1).
std::vector<int> counts_and_displacements(std::span<const std::int64_t> counts, std::vector<int>& displs,
                                          const char* arg) {
  std::vector<int> c(counts.size());
  displs.assign(counts.size(), 0);
  std::int64_t at = 0;
  for (std::size_t r = 0; r < counts.size(); ++r) {
    FK_CHECK_ARG(at + counts[r] <= INT_MAX, kA2a, arg, "at most INT_MAX elements per buffer (MPI's int counts)",
                 fmt::format("{} elements", at + counts[r]));
    c[r] = static_cast<int>(counts[r]);
    displs[r] = static_cast<int>(at);
    at += counts[r];
  }
  return c;
}

// MPI is initialised by the first communicator and finalised with the last one (if this library
// initialised it); it cannot be initialised twice in a process.
std::mutex g_mutex;
int g_live = 0;
bool g_we_initialised = false;

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator() {
    const std::lock_guard lock(g_mutex);
    int initialised = 0, finalised = 0;
    mpi_check(MPI_Initialized(&initialised), "MPI_Initialized");
    mpi_check(MPI_Finalized(&finalised), "MPI_Finalized");
    if (finalised) throw Error("dist::make_mpi_communicator", "MPI was finalised already in this process");
    if (!initialised) {
      int provided = 0;
      mpi_check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
      g_we_initialised = true;
    }
    ++g_live;
    mpi_check(MPI_Comm_rank(MPI_COMM_WORLD, &rank_), "MPI_Comm_rank");
    mpi_check(MPI_Comm_size(MPI_COMM_WORLD, &size_), "MPI_Comm_size");
  }
  ~MpiCommunicator() override {
    const std::lock_guard lock(g_mutex);
    if (--g_live == 0 && g_we_initialised) MPI_Finalize();
  }

  int rank() const noexcept override { return rank_; }
  int size() const noexcept override { return size_; }
  std::string_view backend() const noexcept override { return "mpi"; }
  Device device() const noexcept override { return Device::cpu(); }

  void all_to_all_v(const TensorView& send, std::span<const std::int64_t> send_counts, const TensorView& recv,
                    std::span<const std::int64_t> recv_counts, const Stream* stream) override {
    detail::check_all_to_all(send, send_counts, recv, recv_counts, device(), size_, kA2a);
    const MPI_Datatype type = mpi_type(send.dtype(), kA2a);
    std::vector<int> sdispl, rdispl;
    const std::vector<int> sc = counts_and_displacements(send_counts, sdispl, "send_counts");
    const std::vector<int> rc = counts_and_displacements(recv_counts, rdispl, "recv_counts");
    if (stream) stream->synchronize();
    mpi_check(MPI_Alltoallv(send.data(), sc.data(), sdispl.data(), type, recv.data(), rc.data(), rdispl.data(), type,
                            MPI_COMM_WORLD),
              "MPI_Alltoallv");
  }

  void all_reduce_sum(const TensorView& data, const Stream* stream) override {
    constexpr const char* op = "dist::MpiCommunicator::all_reduce_sum";
    detail::check_collective_buffer(data, device(), op, "data");
    FK_CHECK_ARG(data.dtype() == DType::f32, op, "data", "f32",
                 std::string(dtype_name(data.dtype())));
    const MPI_Datatype type = mpi_type(data.dtype(), op);
    if (stream) stream->synchronize();
    // In pieces of at most 2^30 elements (MPI's int count).
    constexpr std::int64_t kPiece = std::int64_t{1} << 30;
    auto* bytes = static_cast<unsigned char*>(data.data());
    const std::size_t esize = dtype_size(data.dtype());
    for (std::int64_t at = 0; at < data.numel(); at += kPiece) {
      const int n = static_cast<int>(std::min(kPiece, data.numel() - at));
      mpi_check(MPI_Allreduce(MPI_IN_PLACE, bytes + static_cast<std::size_t>(at) * esize, n, type, MPI_SUM,
                              MPI_COMM_WORLD),
                "MPI_Allreduce");
    }
  }

  void start_all_reduce_sum(const TensorView& data, const Stream* ready) override {
    constexpr const char* op = "dist::MpiCommunicator::start_all_reduce_sum";
    detail::check_collective_buffer(data, device(), op, "data");
    FK_CHECK_ARG(data.dtype() == DType::f32, op, "data", "f32", std::string(dtype_name(data.dtype())));
    if (ready) ready->synchronize();
    // The same pieces as all_reduce_sum (MPI's int count).
    constexpr std::int64_t kPiece = std::int64_t{1} << 30;
    auto* floats = static_cast<float*>(data.data());
    for (std::int64_t at = 0; at < data.numel(); at += kPiece) {
      const int n = static_cast<int>(std::min(kPiece, data.numel() - at));
      requests_.push_back(MPI_REQUEST_NULL);
      mpi_check(MPI_Iallreduce(MPI_IN_PLACE, floats + at, n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD, &requests_.back()),
                "MPI_Iallreduce");
    }
    // Progress for the ones in flight (Open MPI moves nonblocking collectives on inside MPI calls).
    int done = 0;
    mpi_check(MPI_Testall(static_cast<int>(requests_.size()), requests_.data(), &done, MPI_STATUSES_IGNORE),
              "MPI_Testall");
    if (done) requests_.clear();
  }

  void wait_all_reduces(const Stream*) override {
    if (requests_.empty()) return;
    std::vector<MPI_Request> pending;
    pending.swap(requests_);
    mpi_check(MPI_Waitall(static_cast<int>(pending.size()), pending.data(), MPI_STATUSES_IGNORE), "MPI_Waitall");
  }

  void barrier() override { mpi_check(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier"); }

  [[noreturn]] void abort(int code) override {
    MPI_Abort(MPI_COMM_WORLD, code);
    std::exit(code);  // MPI_Abort does not return; for the compiler
  }

 private:
  int rank_ = 0, size_ = 1;
  std::vector<MPI_Request> requests_;  // started sums not yet waited for
};

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator() { return std::make_unique<MpiCommunicator>(); }

}  // namespace fk::dist
