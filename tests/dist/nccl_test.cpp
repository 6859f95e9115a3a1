// The NCCL communicator in one process (dist_nccl_test; a build with NCCL). With one GPU: a size-1
// communicator (one started through a host communicator, one from the in-process factory) copies,
// sums and refuses bad buffers, counts and streams. With two or more: one communicator a GPU, each
// used from its own thread, against what the ranks' data must give (nccl_checks.hpp), and a
// collective that one rank never joins fails within the timeout instead of hanging. Without
// enough GPUs a test skips, saying why.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <functional>
#include <thread>

#include "fusekit/dist/communicator.hpp"
#include "nccl_checks.hpp"
#include "test_util.hpp"

namespace fk::dist {
namespace {


constexpr const char* kA2a = "dist::NcclCommunicator::all_to_all_v";
constexpr const char* kAllReduce = "dist::NcclCommunicator::all_reduce_sum";

using test::on_every_rank;

std::vector<int> first_gpus(int n) {
  std::vector<int> d(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) d[static_cast<std::size_t>(i)] = i;
  return d;
}

TEST(NcclCommunicator, OneGpuCopiesAndSums) {
  FK_SKIP_WITHOUT_GPUS(1);
  for (int setup = 0; setup < 2; ++setup) {
    std::unique_ptr<Communicator> comm =
        setup == 0 ? make_nccl_communicator(make_single_communicator())
                   : std::move(make_nccl_communicators(std::vector<int>{0}).front());
    EXPECT_EQ(comm->rank(), 0);
    EXPECT_EQ(comm->size(), 1);
    EXPECT_EQ(comm->backend(), "nccl");
    EXPECT_EQ(comm->device(), Device::cuda(0));
    const Stream stream = Stream::create(Device::cuda(0));
    for (const Stream* s : {static_cast<const Stream*>(nullptr), &stream}) {
      test::check_all_to_all_v(*comm, s);
      test::check_all_reduce_sum(*comm, s, 1 << 20);
    }
    comm->barrier();
  }
}

TEST(NcclCommunicator, BadBuffersCountsAndStreamsAreRefused) {
  FK_SKIP_WITHOUT_GPUS(1);
  auto comm = make_nccl_communicator(make_single_communicator());
  const Device gpu = Device::cuda(0);
  const Tensor a = test::device_tensor(std::vector<float>{1, 2, 3, 4}, DType::f32, gpu);
  const Tensor b = test::device_tensor(std::vector<float>{0, 0, 0, 0}, DType::f32, gpu);
  const std::vector<std::int64_t> three{3};
  auto a2a = [&](const TensorView& s, const TensorView& r, std::vector<std::int64_t> sc, std::vector<std::int64_t> rc,
                 const Stream* st = nullptr) { comm->all_to_all_v(s, sc, r, rc, st); };
  // Buffers: host memory, another GPU's, a dtype NCCL is not given here, mismatched dtypes, overlap.
  std::vector<float> host(4);
  const TensorView on_host(host.data(), DType::f32, {4}, Device::cpu());
  test::expect_arg_error([&] { a2a(on_host, b, three, three); }, kA2a, "send");
  test::expect_arg_error([&] { a2a(a, TensorView(b.data(), DType::f32, {4}, Device::cuda(1)), three, three); }, kA2a,
                         "recv");
  test::expect_arg_error([&] { comm->all_reduce_sum(on_host); }, kAllReduce, "data");
  test::expect_arg_error([&] { comm->all_reduce_sum(TensorView(a.data(), DType::i32, {4}, gpu)); }, kAllReduce, "data");
  test::expect_arg_error([&] { a2a(a, TensorView(b.data(), DType::i32, {4}, gpu), three, three); }, kA2a, "recv");
  test::expect_arg_error(
      [&] { a2a(TensorView(a.data(), DType::bf16, {4}, gpu), TensorView(b.data(), DType::bf16, {4}, gpu), three, three); },
      kA2a, "dtype");
  test::expect_arg_error([&] { a2a(a, TensorView(a.data_as<float>() + 1, DType::f32, {3}, gpu), three, three); }, kA2a,
                         "recv");
  // Counts: one per rank, >= 0, within the buffer (an overflowing sum included), and what this
  // rank sends itself is what it receives from itself.
  test::expect_arg_error([&] { a2a(a, b, {3, 0}, three); }, kA2a, "send_counts");
  test::expect_arg_error([&] { a2a(a, b, {-1}, three); }, kA2a, "send_counts");
  test::expect_arg_error([&] { a2a(a, b, {5}, three); }, kA2a, "send_counts");
  test::expect_arg_error([&] { a2a(a, b, {LLONG_MAX}, three); }, kA2a, "send_counts");
  test::expect_arg_error([&] { a2a(a, b, three, {2}); }, kA2a, "recv_counts");
  // A stream of another GPU.
  const Stream elsewhere = Stream::adopt(nullptr, Device::cuda(1));
  test::expect_arg_error([&] { a2a(a, b, three, three, &elsewhere); }, kA2a, "stream");
  // After all that, the communicator still works, and nothing was written.
  EXPECT_EQ(test::host_values<float>(b), (std::vector<float>{0, 0, 0, 0}));
  a2a(a, b, three, three);
  EXPECT_EQ(test::host_values<float>(b), (std::vector<float>{1, 2, 3, 0}));
}

// Refused before NCCL is called: runs without a GPU too.
TEST(NcclCommunicator, FactoryArgumentsAreChecked) {
  const int gpus = cuda_device_count();
  test::expect_arg_error([] { make_nccl_communicators(std::vector<int>{}); }, "dist::make_nccl_communicators", "devices");
  test::expect_arg_error([&] { make_nccl_communicators(std::vector<int>{gpus}); }, "dist::make_nccl_communicators",
                         "devices");
  test::expect_arg_error([] { make_nccl_communicators(std::vector<int>{0, 0}); }, "dist::make_nccl_communicators",
                         "devices");
  test::expect_arg_error([&] { make_nccl_communicator(make_single_communicator(), {.device = gpus}); },
                         "dist::make_nccl_communicator", "options.device");
  test::expect_arg_error([] { make_nccl_communicator(make_single_communicator(), {.timeout = std::chrono::seconds(0)}); },
                         "dist::make_nccl_communicator", "options.timeout");
}

// Every GPU of the machine (at most 8), one thread each.
TEST(NcclCommunicator, OneThreadAGpu) {
  FK_SKIP_WITHOUT_GPUS(2);
  const int n = std::min(cuda_device_count(), 8);
  auto comms = make_nccl_communicators(first_gpus(n));
  ASSERT_EQ(comms.size(), static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(comms[static_cast<std::size_t>(r)]->rank(), r);
    EXPECT_EQ(comms[static_cast<std::size_t>(r)]->size(), n);
    EXPECT_EQ(comms[static_cast<std::size_t>(r)]->device(), Device::cuda(r));
  }
  on_every_rank(comms, [](Communicator& c) {
    const Stream stream = Stream::create(c.device());
    for (const Stream* s : {static_cast<const Stream*>(nullptr), &stream}) {
      test::check_all_to_all_v(c, s);
      test::check_all_reduce_sum(c, s);
      test::check_all_reduce_sum(c, s, (1 << 22) + 3);  // 16 MB and an odd tail
    }
  });
  // Destroyed here, one after the other from this thread.
}

// Rank 1 never joins rank 0's all-reduce: rank 0 fails after the timeout, naming the collective
// and the rank, both waiting (no stream) and queued on a stream (its stream drains; the next call
// throws). Nothing hangs, and destroying both ends within the timeout too.
TEST(NcclCommunicator, AMissingRankTimesOutInsteadOfHanging) {
  FK_SKIP_WITHOUT_GPUS(2);
  for (int queued = 0; queued < 2; ++queued) {
    const auto start = std::chrono::steady_clock::now();
    {
      auto comms = make_nccl_communicators(first_gpus(2), {.timeout = std::chrono::seconds(3)});
      on_every_rank(comms, [](Communicator& c) { c.barrier(); });  // NCCL connects the ranks
      Communicator& c = *comms[0];
      const Tensor x = test::device_tensor(std::vector<float>(256, 1.f), DType::f32, c.device());
      const Stream stream = Stream::create(c.device());
      test::expect_error_mentions(
          [&] {
            if (!queued) {
              c.all_reduce_sum(x);
              return;
            }
            c.all_reduce_sum(x, &stream);
            stream.synchronize();  // returns once the watchdog has aborted the communicator
            c.barrier();
          },
          {"rank 0 of 2", "dist::NcclCommunicator::all_reduce_sum failed", "after 3 s"});
      test::expect_error_mentions([&] { c.all_reduce_sum(x); }, {"the NCCL communicator was aborted"});
    }
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_LT(took, 3 * 3 + 30) << "seconds, for a timeout of 3 s (queued: " << queued << ")";
  }
}

}  // namespace
}  // namespace fk::dist
