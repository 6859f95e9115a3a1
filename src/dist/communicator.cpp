// The single-process communicator and what every communicator shares.
#include "fusekit/dist/communicator.hpp"

#include <fmt/format.h>

#include <cstdlib>
#include <cstring>

#include "dist/communicator_checks.hpp"
#include "fusekit/core/error.hpp"
#include "fusekit/core/stream.hpp"

namespace fk::dist {

void Communicator::exchange_counts(std::span<const std::int64_t> send, std::span<std::int64_t> recv) {
  const auto n = static_cast<std::size_t>(size());
  FK_CHECK_ARG(send.size() == n && recv.size() == n, "dist::Communicator::exchange_counts", "send/recv",
               fmt::format("{} values each (one per rank)", n), fmt::format("{} and {}", send.size(), recv.size()));
  const std::vector<std::int64_t> ones(n, 1);
  const TensorView s(const_cast<std::int64_t*>(send.data()), DType::i64, {static_cast<std::int64_t>(n)}, device());
  const TensorView r(recv.data(), DType::i64, {static_cast<std::int64_t>(n)}, device());
  all_to_all_v(s, ones, r, ones);
}

namespace detail {

void check_collective_buffer(const TensorView& t, Device where, const char* op, const char* arg) {
  FK_CHECK_ARG(t.device() == where, op, arg,
               where.is_cpu() ? std::string("host memory (this communicator is host-side)")
                              : fmt::format("memory on {} (this communicator's GPU)", where.str()),
               t.str());
  FK_CHECK_ARG(t.is_contiguous() && t.defined(), op, arg, "a contiguous tensor with data", t.str());
}

std::int64_t check_counts(const TensorView& t, std::span<const std::int64_t> counts, int ranks, const char* op,
                          const char* arg) {
  FK_CHECK_ARG(counts.size() == static_cast<std::size_t>(ranks), op, arg, fmt::format("{} counts (one per rank)", ranks),
               fmt::format("{}", counts.size()));
  std::int64_t total = 0;
  for (std::size_t r = 0; r < counts.size(); ++r) {
    FK_CHECK_ARG(counts[r] >= 0, op, arg, "counts >= 0", fmt::format("{} for rank {}", counts[r], r));
    // Compared before the sum, which could overflow.
    FK_CHECK_ARG(counts[r] <= t.numel() - total, op, arg,
                 fmt::format("counts that fit the buffer of {} elements", t.numel()),
                 fmt::format("{} for rank {} after {} for the ranks before it", counts[r], r, total));
    total += counts[r];
  }
  return total;
}

AllToAllTotals check_all_to_all(const TensorView& send, std::span<const std::int64_t> send_counts,
                                const TensorView& recv, std::span<const std::int64_t> recv_counts, Device where,
                                int ranks, const char* op) {
  check_collective_buffer(send, where, op, "send");
  check_collective_buffer(recv, where, op, "recv");
  FK_CHECK_ARG(send.dtype() == recv.dtype(), op, "recv", fmt::format("dtype {}", dtype_name(send.dtype())),
               std::string(dtype_name(recv.dtype())));
  return {check_counts(send, send_counts, ranks, op, "send_counts"),
          check_counts(recv, recv_counts, ranks, op, "recv_counts")};
}

}  // namespace detail

namespace {

class SingleCommunicator final : public Communicator {
 public:
  int rank() const noexcept override { return 0; }
  int size() const noexcept override { return 1; }
  std::string_view backend() const noexcept override { return "single"; }
  Device device() const noexcept override { return Device::cpu(); }

  void all_to_all_v(const TensorView& send, std::span<const std::int64_t> send_counts, const TensorView& recv,
                    std::span<const std::int64_t> recv_counts, const Stream* stream) override {
    constexpr const char* op = "dist::Communicator::all_to_all_v";
    const std::int64_t n = detail::check_all_to_all(send, send_counts, recv, recv_counts, device(), 1, op).sent;
    FK_CHECK_ARG(recv_counts[0] == n, op, "recv_counts", fmt::format("{} (what this rank sends itself)", n),
                 fmt::format("{}", recv_counts[0]));
    if (stream) stream->synchronize();
    if (n > 0 && send.data() != recv.data())
      std::memcpy(recv.data(), send.data(), static_cast<std::size_t>(n) * dtype_size(send.dtype()));
  }

  void all_reduce_sum(const TensorView& data, const Stream* stream) override {
    detail::check_collective_buffer(data, device(), "dist::Communicator::all_reduce_sum", "data");
    FK_CHECK_ARG(data.dtype() == DType::f32, "dist::Communicator::all_reduce_sum",
                 "data", "f32", std::string(dtype_name(data.dtype())));
    if (stream) stream->synchronize();
  }

  void barrier() override {}
  [[noreturn]] void abort(int code) override { std::exit(code); }
};

class OfflineCommunicator final : public Communicator {
 public:
  OfflineCommunicator(int rank, int size) : rank_(rank), size_(size) {}
  int rank() const noexcept override { return rank_; }
  int size() const noexcept override { return size_; }
  std::string_view backend() const noexcept override { return "offline"; }
  Device device() const noexcept override { return Device::cpu(); }

  void all_to_all_v(const TensorView&, std::span<const std::int64_t>, const TensorView&, std::span<const std::int64_t>,
                    const Stream*) override {
    no_peers("dist::Communicator::all_to_all_v");
  }
  void all_reduce_sum(const TensorView&, const Stream*) override { no_peers("dist::Communicator::all_reduce_sum"); }
  void barrier() override { no_peers("dist::Communicator::barrier"); }
  [[noreturn]] void abort(int code) override { std::exit(code); }

 private:
  [[noreturn]] void no_peers(const char* op) const {
    throw Error(op, "communicator", "a communicator with peers (not an offline one)",
                fmt::format("rank {} of {} offline", rank_, size_));
  }
  int rank_, size_;
};

}  // namespace

std::unique_ptr<Communicator> make_single_communicator() { return std::make_unique<SingleCommunicator>(); }

std::unique_ptr<Communicator> make_offline_communicator(int rank, int size) {
  FK_CHECK_ARG(size >= 1 && rank >= 0 && rank < size, "dist::make_offline_communicator", "rank",
               "a rank in [0, size) of size >= 1", fmt::format("rank {} of {}", rank, size));
  return std::make_unique<OfflineCommunicator>(rank, size);
}

bool built_with_nccl() noexcept { return FUSEKIT_WITH_NCCL != 0; }

#if !FUSEKIT_WITH_NCCL
namespace {
[[noreturn]] void no_nccl(const char* op) {
  throw Error(op, "build", "fusekit built with NCCL (a CUDA build, -DFUSEKIT_NCCL=ON)", "a build without NCCL");
}
}  // namespace
std::unique_ptr<Communicator> make_nccl_communicator(std::shared_ptr<Communicator>, const NcclOptions&) {
  no_nccl("dist::make_nccl_communicator");
}
std::vector<std::unique_ptr<Communicator>> make_nccl_communicators(std::span<const int>, const NcclOptions&) {
  no_nccl("dist::make_nccl_communicators");
}
#endif

#if !FUSEKIT_WITH_MPI
std::unique_ptr<Communicator> make_mpi_communicator() {
  throw Error("dist::make_mpi_communicator", "build", "fusekit built with MPI (-DFUSEKIT_MPI=ON)",
              "a build without MPI");
}
#endif

}  // namespace fk::dist
