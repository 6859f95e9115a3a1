// The NCCL communicator: device memory, one GPU a rank, for the two setups communicator.hpp
// describes (a process a GPU started through MPI; one process with a thread a GPU).
//
// all_to_all_v is one NCCL group of ncclSend / ncclRecv, one pair a peer with a nonzero count (the
// block a rank keeps is a device copy on the same stream); all_reduce_sum is ncclAllReduce in
// place; barrier a one-float all-reduce waited for. The communicators are nonblocking
// (ncclConfig_t::blocking = 0): no NCCL call waits on the host, each returning ncclInProgress until
// its work is queued, which this file waits for with a deadline. A watchdog thread per
// communicator follows the queued collectives (an event recorded after each) and aborts the
// communicator when one fails or outlives the timeout, so that no wait, ours or the caller's
// stream synchronisation, lasts forever. NCCL's own teardown follows its guide for nonblocking
// communicators: ncclCommFinalize, wait until quiescent, ncclCommDestroy; ncclCommAbort when that
// does not come in time.
#include <cuda_runtime.h>
#include <nccl.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "dist/communicator_checks.hpp"
#include "fusekit/core/cuda_check.hpp"
#include "fusekit/core/error.hpp"
#include "fusekit/core/stream.hpp"
#include "fusekit/dist/communicator.hpp"

namespace fk::dist {
namespace {

using Clock = std::chrono::steady_clock;
using fk::detail::DeviceScope;
constexpr const char* kA2a = "dist::NcclCommunicator::all_to_all_v";
constexpr const char* kAllReduce = "dist::NcclCommunicator::all_reduce_sum";
constexpr const char* kBarrier = "dist::NcclCommunicator::barrier";
constexpr const char* kExchange = "dist::NcclCommunicator::exchange_counts";
constexpr const char* kMakeOne = "dist::make_nccl_communicator";
constexpr const char* kMakeMany = "dist::make_nccl_communicators";

std::string nccl_error(ncclResult_t r, ncclComm_t comm) {
  const char* last = ncclGetLastError(comm);
  return fmt::format("NCCL error {} ({}){}{}", static_cast<int>(r), ncclGetErrorString(r),
                     last && *last ? ": " : "", last ? last : "");
}

ncclDataType_t nccl_type(DType dt, const char* op) {
  switch (dt) {
    case DType::u8: return ncclUint8;
    case DType::i32: return ncclInt32;
    case DType::i64: return ncclInt64;
    case DType::f32: return ncclFloat32;
    default: break;
  }
  throw Error(op, "dtype", "u8, i32, i64 or f32", std::string(dtype_name(dt)));
}

// Spins briefly, then sleeps: a collective that is queued at once costs no sleep, one that waits
// for a peer for minutes costs little CPU.
class Backoff {
 public:
  void pause() {
    if (Clock::now() - start_ < std::chrono::milliseconds(1)) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

 private:
  Clock::time_point start_ = Clock::now();
};

// Polls a nonblocking communicator until it leaves ncclInProgress (set up, or its work queued) or
// `deadline` passes; returns its state then (ncclInProgress: the deadline passed).
ncclResult_t settle(ncclComm_t comm, Clock::time_point deadline) {
  Backoff backoff;
  while (true) {
    ncclResult_t state = ncclInProgress;
    const ncclResult_t r = ncclCommGetAsyncError(comm, &state);
    if (r != ncclSuccess) return r;
    if (state != ncclInProgress || Clock::now() >= deadline) return state;
    backoff.pause();
  }
}

std::string in_seconds(std::chrono::milliseconds t) {
  return fmt::format("{:g} s", static_cast<double>(t.count()) / 1e3);
}

// The GPU hosts fusekit is tested on require NVLink multicast off; a launcher that wants it says so.
void default_nvls_off() { setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0); }

ncclConfig_t nonblocking_config() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  config.commName = "fusekit";
  return config;
}

// The NCCL communicators created together (this process's ranks of one clique: one, or one a GPU).
// They are torn down together when the last fk communicator holding them goes: finalising one
// waits for the others, so one thread could not destroy them one after the other otherwise.
class Clique {
 public:
  Clique(std::vector<ncclComm_t> comms, std::chrono::milliseconds timeout)
      : comms_(std::move(comms)), timeout_(timeout) {}
  Clique(const Clique&) = delete;
  Clique& operator=(const Clique&) = delete;

  ~Clique() {
    const Clock::time_point deadline = Clock::now() + timeout_;
    std::vector<bool> quiet(comms_.size(), false);
    for (std::size_t i = 0; i < comms_.size(); ++i) {
      if (!comms_[i]) continue;
      const ncclResult_t r = ncclCommFinalize(comms_[i]);
      quiet[i] = r == ncclSuccess || r == ncclInProgress;
    }
    for (std::size_t i = 0; i < comms_.size(); ++i)
      if (quiet[i]) quiet[i] = settle(comms_[i], deadline) == ncclSuccess;
    for (std::size_t i = 0; i < comms_.size(); ++i) {
      if (!comms_[i]) continue;
      if (!quiet[i] || ncclCommDestroy(comms_[i]) != ncclSuccess) ncclCommAbort(comms_[i]);
    }
  }

  ncclComm_t comm(std::size_t i) const { return comms_[i]; }
  // After the owner aborted comm i (which freed it).
  void forget(std::size_t i) { comms_[i] = nullptr; }

 private:
  std::vector<ncclComm_t> comms_;
  std::chrono::milliseconds timeout_;
};

// Creates the communicators of one clique that this process holds (rank ranks[i] on devices[i]),
// all from this thread in one NCCL group, and waits until they are set up.
std::shared_ptr<Clique> init_clique(const char* op, const ncclUniqueId& id, int size, std::span<const int> ranks,
                                    std::span<const int> devices, std::chrono::milliseconds timeout) {
  std::vector<ncclComm_t> comms(ranks.size(), nullptr);
  std::vector<ncclConfig_t> configs(ranks.size(), nonblocking_config());
  ncclResult_t r = ncclGroupStart();
  for (std::size_t i = 0; i < ranks.size() && (r == ncclSuccess || r == ncclInProgress); ++i) {
    const DeviceScope scope(devices[i]);
    r = ncclCommInitRankConfig(&comms[i], size, id, ranks[i], &configs[i]);
  }
  const ncclResult_t end = ncclGroupEnd();
  if (r == ncclSuccess || r == ncclInProgress) r = end;
  const Clock::time_point deadline = Clock::now() + timeout;
  std::string why;
  for (std::size_t i = 0; i < comms.size(); ++i) {
    if (!comms[i]) {
      why = fmt::format("rank {} was not created: {}", ranks[i], nccl_error(r, nullptr));
      break;
    }
    const ncclResult_t state = settle(comms[i], deadline);
    if (state == ncclInProgress) {
      why = fmt::format("rank {} on cuda:{} was not set up within {} (are all {} ranks starting?)", ranks[i],
                        devices[i], in_seconds(timeout), size);
    } else if (state != ncclSuccess) {
      why = fmt::format("rank {} on cuda:{}: {}", ranks[i], devices[i], nccl_error(state, comms[i]));
    }
    if (!why.empty()) break;
  }
  if (!why.empty()) {
    for (ncclComm_t c : comms)
      if (c) ncclCommAbort(c);
    int version = 0;
    ncclGetVersion(&version);
    throw Error(op, fmt::format("ncclCommInitRankConfig failed: {} (NCCL {} at run time, built against {})", why,
                                version, NCCL_VERSION_CODE));
  }
  return std::make_shared<Clique>(std::move(comms), timeout);
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(std::shared_ptr<Clique> clique, std::size_t index, int rank, int size, int device,
                   std::chrono::milliseconds timeout, std::shared_ptr<Communicator> bootstrap)
      : bootstrap_(std::move(bootstrap)),
        clique_(std::move(clique)),
        index_(index),
        rank_(rank),
        size_(size),
        device_(device),
        timeout_(timeout),
        own_(stream_on(device)),
        comm_(clique_->comm(index)) {
    watchdog_ = std::thread([this] { watch(); });
  }

  ~NcclCommunicator() override {
    {
      // The queued collectives finish, or the watchdog aborts them within the timeout.
      std::unique_lock lock(mutex_);
      changed_.wait(lock, [&] { return pending_.empty() || !comm_; });
      stopping_ = true;
    }
    changed_.notify_all();
    watchdog_.join();
    for (cudaEvent_t e : spare_events_) cudaEventDestroy(e);
    for (cudaEvent_t e : {ready_event_, reduced_event_})
      if (e) cudaEventDestroy(e);
  }

  int rank() const noexcept override { return rank_; }
  int size() const noexcept override { return size_; }
  std::string_view backend() const noexcept override { return "nccl"; }
  Device device() const noexcept override { return Device::cuda(device_); }

  void all_to_all_v(const TensorView& send, std::span<const std::int64_t> send_counts, const TensorView& recv,
                    std::span<const std::int64_t> recv_counts, const Stream* stream) override {
    const auto [sent, received] = detail::check_all_to_all(send, send_counts, recv, recv_counts, device(), size_, kA2a);
    const ncclDataType_t type = nccl_type(send.dtype(), kA2a);
    const std::size_t esize = dtype_size(send.dtype());
    // Peers read and write the blocks at any time during the call: the buffers must be apart.
    const auto* s0 = static_cast<const unsigned char*>(send.data());
    const auto* r0 = static_cast<const unsigned char*>(recv.data());
    const std::size_t sbytes = static_cast<std::size_t>(sent) * esize;
    const std::size_t rbytes = static_cast<std::size_t>(received) * esize;
    FK_CHECK_ARG(sbytes == 0 || rbytes == 0 || s0 + sbytes <= r0 || r0 + rbytes <= s0, kA2a, "recv",
                 "a buffer apart from send", "one that overlaps it");
    const auto me = static_cast<std::size_t>(rank_);
    FK_CHECK_ARG(recv_counts[me] == send_counts[me], kA2a, "recv_counts",
                 fmt::format("{} from this rank (what it sends itself)", send_counts[me]),
                 fmt::format("{}", recv_counts[me]));
    check_stream(kA2a, stream);
    std::vector<std::size_t> sdispl(send_counts.size()), rdispl(recv_counts.size());
    for (std::size_t r = 1; r < send_counts.size(); ++r) {
      sdispl[r] = sdispl[r - 1] + static_cast<std::size_t>(send_counts[r - 1]);
      rdispl[r] = rdispl[r - 1] + static_cast<std::size_t>(recv_counts[r - 1]);
    }
    collective(kA2a, stream, [&](ncclComm_t comm, cudaStream_t s) {
      if (send_counts[me] > 0)
        FK_CUDA_CHECK(cudaMemcpyAsync(recv.data_as<unsigned char>() + rdispl[me] * esize, s0 + sdispl[me] * esize,
                                      static_cast<std::size_t>(send_counts[me]) * esize, cudaMemcpyDeviceToDevice, s));
      ncclResult_t r = ncclGroupStart();
      for (int peer = 0; peer < size_ && (r == ncclSuccess || r == ncclInProgress); ++peer) {
        const auto p = static_cast<std::size_t>(peer);
        if (peer == rank_) continue;
        if (send_counts[p] > 0)
          r = ncclSend(s0 + sdispl[p] * esize, static_cast<std::size_t>(send_counts[p]), type, peer, comm, s);
        if (recv_counts[p] > 0 && (r == ncclSuccess || r == ncclInProgress))
          r = ncclRecv(recv.data_as<unsigned char>() + rdispl[p] * esize, static_cast<std::size_t>(recv_counts[p]),
                       type, peer, comm, s);
      }
      const ncclResult_t end = ncclGroupEnd();  // closes the group even after a failed call
      return r == ncclSuccess || r == ncclInProgress ? end : r;
    });
  }

  void all_reduce_sum(const TensorView& data, const Stream* stream) override {
    detail::check_collective_buffer(data, device(), kAllReduce, "data");
    FK_CHECK_ARG(data.dtype() == DType::f32, kAllReduce, "data", "f32", std::string(dtype_name(data.dtype())));
    check_stream(kAllReduce, stream);
    if (data.numel() == 0) return;  // the same on every rank: every rank skips it
    collective(kAllReduce, stream, [&](ncclComm_t comm, cudaStream_t s) {
      return ncclAllReduce(data.data(), data.data(), static_cast<std::size_t>(data.numel()), ncclFloat32, ncclSum, comm,
                           s);
    });
  }

  // The buckets' sums on comm_stream_, each after an event recorded on `ready`; the waiting stream
  // waits for an event recorded after the last one.
  void start_all_reduce_sum(const TensorView& data, const Stream* ready) override {
    constexpr const char* op = "dist::NcclCommunicator::start_all_reduce_sum";
    detail::check_collective_buffer(data, device(), op, "data");
    FK_CHECK_ARG(data.dtype() == DType::f32, op, "data", "f32", std::string(dtype_name(data.dtype())));
    check_stream(op, ready);
    if (data.numel() == 0) return;  // the same on every rank: every rank skips it
    const DeviceScope scope(device_);
    if (!comm_stream_) {
      comm_stream_.emplace(stream_on(device_));
      FK_CUDA_CHECK(cudaEventCreateWithFlags(&ready_event_, cudaEventDisableTiming));
      FK_CUDA_CHECK(cudaEventCreateWithFlags(&reduced_event_, cudaEventDisableTiming));
    }
    const auto comm_stream = static_cast<cudaStream_t>(comm_stream_->handle());
    if (ready) {
      FK_CUDA_CHECK(cudaEventRecord(ready_event_, static_cast<cudaStream_t>(ready->handle())));
      FK_CUDA_CHECK(cudaStreamWaitEvent(comm_stream, ready_event_, 0));
    }
    collective(op, &*comm_stream_, [&](ncclComm_t comm, cudaStream_t s) {
      return ncclAllReduce(data.data(), data.data(), static_cast<std::size_t>(data.numel()), ncclFloat32, ncclSum, comm,
                           s);
    });
    started_ = true;
  }

  void wait_all_reduces(const Stream* stream) override {
    constexpr const char* op = "dist::NcclCommunicator::wait_all_reduces";
    check_stream(op, stream);
    if (!comm_stream_) return;  // none ever started
    const DeviceScope scope(device_);
    const auto comm_stream = static_cast<cudaStream_t>(comm_stream_->handle());
    // The event after the sums started since the last wait (a second wait waits for the same).
    if (started_) FK_CUDA_CHECK(cudaEventRecord(reduced_event_, comm_stream));
    started_ = false;
    if (stream) {
      FK_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream->handle()), reduced_event_, 0));
      return;
    }
    wait_stream(op, comm_stream);
  }

  void barrier() override {
    const DeviceScope scope(device_);
    if (!one_float_.data()) one_float_ = Tensor::empty({1}, DType::f32, device(), &own_);
    collective(kBarrier, nullptr, [&](ncclComm_t comm, cudaStream_t s) {
      return ncclAllReduce(one_float_.data(), one_float_.data(), 1, ncclFloat32, ncclSum, comm, s);
    });
  }

  [[noreturn]] void abort(int code) override {
    {
      const std::lock_guard lock(mutex_);
      if (comm_) fail_locked("dist::NcclCommunicator::abort", fmt::format("abort({}) was called", code));
    }
    if (bootstrap_) bootstrap_->abort(code);
    // No bootstrap: this process holds every rank. Other threads may be inside a collective, so
    // no static destructor (the CUDA runtime's teardown among them) may run.
    std::fflush(nullptr);
    std::_Exit(code);
  }

  void exchange_counts(std::span<const std::int64_t> send, std::span<std::int64_t> recv) override {
    const auto n = static_cast<std::size_t>(size_);
    FK_CHECK_ARG(send.size() == n && recv.size() == n, kExchange, "send/recv",
                 fmt::format("{} values each (one per rank)", n), fmt::format("{} and {}", send.size(), recv.size()));
    const DeviceScope scope(device_);
    const Tensor buffer = Tensor::empty({2 * size_}, DType::i64, device(), &own_);
    const TensorView out = buffer.view().slice_rows(0, size_), in = buffer.view().slice_rows(size_, 2 * size_);
    const auto stream = static_cast<cudaStream_t>(own_.handle());
    const std::size_t bytes = n * sizeof(std::int64_t);
    FK_CUDA_CHECK(cudaMemcpyAsync(out.data(), send.data(), bytes, cudaMemcpyHostToDevice, stream));
    const std::vector<std::int64_t> ones(n, 1);
    all_to_all_v(out, ones, in, ones, &own_);
    FK_CUDA_CHECK(cudaMemcpyAsync(recv.data(), in.data(), bytes, cudaMemcpyDeviceToHost, stream));
    wait_own_stream(kExchange);
  }

 private:
  // Stream::create makes the device current: the caller's stays current here.
  static Stream stream_on(int device) {
    const DeviceScope scope(device);
    return Stream::create(Device::cuda(device));
  }

  struct Pending {
    cudaEvent_t done;
    const char* op;
    Clock::time_point queued;
  };

  void check_stream(const char* op, const Stream* stream) const {
    FK_CHECK_ARG(!stream || stream->device() == device(), op, "stream", fmt::format("a stream on {}", device().str()),
                 stream ? stream->device().str() : std::string());
  }

  // Queues one collective (`enqueue(comm, stream)`, returning NCCL's status) on `stream` or this
  // communicator's own, waits until NCCL has queued it, and hands it to the watchdog; with no
  // stream, also waits until it is done.
  template <class Enqueue>
  void collective(const char* op, const Stream* stream, Enqueue&& enqueue) {
    const DeviceScope scope(device_);
    const auto s = static_cast<cudaStream_t>((stream ? *stream : own_).handle());
    {
      std::unique_lock lock(mutex_);
      throw_if_failed(op);
      ncclResult_t r = enqueue(comm_, s);
      if (r == ncclSuccess || r == ncclInProgress) r = settle(comm_, Clock::now() + timeout_);
      if (r != ncclSuccess) {
        fail_locked(op, r == ncclInProgress ? stuck("queued by NCCL") : nccl_error(r, comm_));
        throw_if_failed(op);
      }
      cudaEvent_t done = nullptr;
      if (spare_events_.empty()) {
        FK_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
      } else {
        done = spare_events_.back();
        spare_events_.pop_back();
      }
      pending_.push_back({done, op, Clock::now()});
      FK_CUDA_CHECK(cudaEventRecord(done, s));
    }
    changed_.notify_all();
    if (!stream) wait_own_stream(op);
  }

  // Until the own stream is drained; the watchdog bounds the wait (its abort drains the stream).
  void wait_own_stream(const char* op) { wait_stream(op, static_cast<cudaStream_t>(own_.handle())); }

  // Until stream `s` (one the collectives are queued on) is drained, as wait_own_stream.
  void wait_stream(const char* op, cudaStream_t s) {
    Backoff backoff;
    while (true) {
      const cudaError_t q = cudaStreamQuery(s);
      if (q == cudaSuccess) break;
      cudaGetLastError();  // cudaErrorNotReady is recorded as the thread's last error: not a failure
      {
        const std::lock_guard lock(mutex_);
        throw_if_failed(op);  // an abort's reason before the CUDA error it may cause
      }
      if (q != cudaErrorNotReady) fk::detail::check_cuda(q, "cudaStreamQuery");
      backoff.pause();
    }
    const std::lock_guard lock(mutex_);
    throw_if_failed(op);
  }

  std::string stuck(const char* what) const {
    return fmt::format("not {} after {} (did a rank die, or not make the same call?)", what, in_seconds(timeout_));
  }

  void throw_if_failed(const char* op) const {
    if (!failure_.empty()) throw Error(op, failure_);
  }

  // With mutex_ held: records why, aborts the NCCL communicator (its kernels stop), and forgets
  // the collectives in flight.
  void fail_locked(const char* op, const std::string& why) {
    if (!comm_) return;
    failure_ = fmt::format("rank {} of {} (cuda:{}): {} failed: {}; the NCCL communicator was aborted, and the outputs "
                           "of the collectives queued since the last wait are undefined",
                           rank_, size_, device_, op, why);
    ncclCommAbort(comm_);
    clique_->forget(index_);
    comm_ = nullptr;
    for (const Pending& p : pending_) cudaEventDestroy(p.done);
    pending_.clear();
    changed_.notify_all();
  }

  // The watchdog: retires the collectives whose events have completed, and aborts the
  // communicator on NCCL's asynchronous error or a collective older than the timeout.
  void watch() {
    cudaSetDevice(device_);
    std::unique_lock lock(mutex_);
    while (!stopping_) {
      if (pending_.empty() || !comm_) {
        changed_.wait(lock);
        continue;
      }
      while (!pending_.empty()) {
        const cudaError_t q = cudaEventQuery(pending_.front().done);
        if (q == cudaErrorNotReady) {
          cudaGetLastError();
          break;
        }
        if (q != cudaSuccess) {
          fail_locked(pending_.front().op, fmt::format("CUDA error {}", cudaGetErrorString(q)));
          break;
        }
        spare_events_.push_back(pending_.front().done);
        pending_.pop_front();
      }
      if (pending_.empty() || !comm_) {
        changed_.notify_all();
        continue;
      }
      ncclResult_t state = ncclSuccess;
      const ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
      if (r != ncclSuccess || (state != ncclSuccess && state != ncclInProgress)) {
        fail_locked(pending_.front().op, nccl_error(r != ncclSuccess ? r : state, comm_));
      } else if (Clock::now() - pending_.front().queued > timeout_) {
        fail_locked(pending_.front().op, stuck("done"));
      } else {
        changed_.wait_for(lock, std::chrono::milliseconds(1));
      }
    }
  }

  std::shared_ptr<Communicator> bootstrap_;  // first member: outlives the NCCL resources (MPI)
  std::shared_ptr<Clique> clique_;
  std::size_t index_;
  int rank_, size_, device_;
  std::chrono::milliseconds timeout_;
  Stream own_;
  // start_all_reduce_sum's stream and events (made by its first call), and whether sums were
  // started since the last wait_all_reduces.
  std::optional<Stream> comm_stream_;
  cudaEvent_t ready_event_ = nullptr, reduced_event_ = nullptr;
  bool started_ = false;
  Tensor one_float_;  // the barrier's all-reduce
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  ncclComm_t comm_;     // null once aborted
  std::string failure_;  // why it was aborted
  std::deque<Pending> pending_;
  std::vector<cudaEvent_t> spare_events_;
  bool stopping_ = false;
  std::thread watchdog_;
};

// The name of this host, for the local rank.
std::string host_name() {
  char name[256] = {};
  if (gethostname(name, sizeof name - 1) != 0)
    throw Error(kMakeOne, fmt::format("gethostname: {}", std::strerror(errno)));
  return name;
}

std::uint64_t fnv1a(std::string_view s) {
  std::uint64_t h = 1469598103934665603ull;
  for (const char c : s) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return h;
}

// This rank's place among the ranks on its host (by host name), over the bootstrap communicator.
int local_rank(Communicator& bootstrap) {
  const auto n = static_cast<std::size_t>(bootstrap.size());
  const auto me = static_cast<std::int64_t>(fnv1a(host_name()));
  const std::vector<std::int64_t> mine(n, me);
  std::vector<std::int64_t> theirs(n);
  bootstrap.exchange_counts(mine, theirs);
  return static_cast<int>(std::count(theirs.begin(), theirs.begin() + bootstrap.rank(), me));
}

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(std::shared_ptr<Communicator> bootstrap,
                                                     const NcclOptions& options) {
  FK_CHECK_ARG(bootstrap != nullptr, kMakeOne, "bootstrap", "a communicator", "null");
  FK_CHECK_ARG(bootstrap->device().is_cpu(), kMakeOne, "bootstrap", "a host communicator (mpi or single)",
               std::string(bootstrap->backend()));
  FK_CHECK_ARG(options.timeout.count() > 0, kMakeOne, "options.timeout", "> 0",
               fmt::format("{} ms", options.timeout.count()));
  default_nvls_off();
  const int gpus = cuda_device_count();
  const int rank = bootstrap->rank(), size = bootstrap->size();
  const int local = local_rank(*bootstrap);
  const int device = options.device >= 0 ? options.device : local;
  // Every rank learns whether every rank has its GPU, so that all of them fail, none waits.
  const bool have_gpu = device < gpus;
  const std::vector<std::int64_t> ok_out(static_cast<std::size_t>(size), have_gpu ? 1 : 0);
  std::vector<std::int64_t> ok_in(static_cast<std::size_t>(size));
  bootstrap->exchange_counts(ok_out, ok_in);
  if (!have_gpu) {
    if (options.device >= 0)
      throw Error(kMakeOne, "options.device", fmt::format("a GPU below {} on host {}", gpus, host_name()),
                  fmt::format("{} (rank {})", device, rank));
    throw Error(kMakeOne, "options.device",
                fmt::format("a GPU for each rank on host {} ({} GPUs), or a device named", host_name(), gpus),
                fmt::format("rank {}, the host's rank {}", rank, local));
  }
  for (int r = 0; r < size; ++r)
    if (ok_in[static_cast<std::size_t>(r)] != 1)
      throw Error(kMakeOne, fmt::format("rank {} has no GPU to take (its own error says why)", r));
  // Rank 0 makes the unique id and sends it, with whether it could, to every rank.
  std::vector<unsigned char> out, in(1 + sizeof(ncclUniqueId));
  std::string rank0_error;
  if (rank == 0) {
    ncclUniqueId id{};
    const ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess) rank0_error = nccl_error(r, nullptr);
    for (int k = 0; k < size; ++k) {
      out.push_back(r == ncclSuccess ? 1 : 0);
      out.insert(out.end(), id.internal, id.internal + sizeof id.internal);
    }
  }
  std::vector<std::int64_t> send_counts(static_cast<std::size_t>(size), rank == 0 ? std::ssize(in) : 0);
  std::vector<std::int64_t> recv_counts(static_cast<std::size_t>(size), 0);
  recv_counts[0] = std::ssize(in);
  bootstrap->all_to_all_v(TensorView(out.data(), DType::u8, {std::ssize(out)}, Device::cpu()), send_counts,
                          TensorView(in.data(), DType::u8, {std::ssize(in)}, Device::cpu()), recv_counts);
  if (in[0] != 1)
    throw Error(kMakeOne, fmt::format("rank 0 could not make NCCL's unique id{}", rank == 0 ? ": " + rank0_error : ""));
  ncclUniqueId id{};
  std::memcpy(id.internal, in.data() + 1, sizeof id.internal);
  const int ranks[] = {rank}, devices[] = {device};
  auto clique = init_clique(kMakeOne, id, size, ranks, devices, options.timeout);
  return std::make_unique<NcclCommunicator>(std::move(clique), 0, rank, size, device, options.timeout,
                                            std::move(bootstrap));
}

std::vector<std::unique_ptr<Communicator>> make_nccl_communicators(std::span<const int> devices,
                                                                   const NcclOptions& options) {
  const int gpus = cuda_device_count();
  const int n = static_cast<int>(devices.size());
  FK_CHECK_ARG(n >= 1, kMakeMany, "devices", "at least one GPU", "none");
  FK_CHECK_ARG(options.timeout.count() > 0, kMakeMany, "options.timeout", "> 0",
               fmt::format("{} ms", options.timeout.count()));
  for (int r = 0; r < n; ++r) {
    const int d = devices[static_cast<std::size_t>(r)];
    FK_CHECK_ARG(d >= 0 && d < gpus, kMakeMany, "devices", fmt::format("GPUs in [0, {})", gpus),
                 fmt::format("{} for rank {}", d, r));
    FK_CHECK_ARG(std::count(devices.begin(), devices.end(), d) == 1, kMakeMany, "devices", "distinct GPUs",
                 fmt::format("cuda:{} more than once", d));
  }
  default_nvls_off();
  ncclUniqueId id{};
  if (const ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess)
    throw Error(kMakeMany, fmt::format("ncclGetUniqueId failed: {}", nccl_error(r, nullptr)));
  std::vector<int> ranks(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) ranks[static_cast<std::size_t>(r)] = r;
  auto clique = init_clique(kMakeMany, id, n, ranks, devices, options.timeout);
  std::vector<std::unique_ptr<Communicator>> comms;
  for (int r = 0; r < n; ++r)
    comms.push_back(std::make_unique<NcclCommunicator>(clique, static_cast<std::size_t>(r), r, n,
                                                       devices[static_cast<std::size_t>(r)], options.timeout, nullptr));
  return comms;
}

}  // namespace fk::dist
