// Checks of a communicator on device memory, run by every rank with its own communicator (from
// its thread, or its process under mpirun) against what the ranks' data must give: all-to-all
// with uneven counts, zeros among them, in three dtypes, and sums that every rank gets bit for
// bit. Failures name the rank. Also what the NCCL tests share to run: a skip without enough GPUs,
// and one thread a communicator.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <numeric>
#include <vector>

#include "fusekit/dist/communicator.hpp"
#include "fusekit/fusekit.hpp"
#include "test_util.hpp"

// Skips the test, saying why, where fewer than n GPUs are visible.
#define FK_SKIP_WITHOUT_GPUS(n)                                                                        \
  do {                                                                                                  \
    if (::fk::cuda_device_count() < (n))                                                                    \
      GTEST_SKIP() << "needs " << (n) << " GPU(s), found " << ::fk::cuda_device_count()                     \
                   << (::fk::cuda_device_count() == 0 ? ": " + ::fk::cuda_unavailable_reason() : std::string()); \
  } while (0)

namespace fk::test {

// Runs f on one thread a communicator, all at once (NCCL needs every rank's call in flight); an
// exception fails the test naming the rank.
inline void on_every_rank(std::vector<std::unique_ptr<dist::Communicator>>& comms,
                          const std::function<void(dist::Communicator&)>& f) {
  std::vector<std::thread> threads;
  for (auto& c : comms)
    threads.emplace_back([&f, comm = c.get()] {
      try {
        f(*comm);
      } catch (const std::exception& e) {
        ADD_FAILURE() << "rank " << comm->rank() << ": " << e.what();
      }
    });
  for (auto& t : threads) t.join();
}

// A host tensor holding `values`, copied to `device`.
template <class T>
Tensor device_tensor(const std::vector<T>& values, DType dtype, Device device) {
  Tensor h = Tensor::empty({static_cast<std::int64_t>(values.size())}, dtype, Device::cpu());
  if (!values.empty()) std::memcpy(h.data(), values.data(), values.size() * sizeof(T));
  return h.copy_to(device);
}

template <class T>
std::vector<T> host_values(const Tensor& t) {
  const Tensor h = t.copy_to(Device::cpu());
  std::vector<T> v(static_cast<std::size_t>(h.numel()));
  if (!v.empty()) std::memcpy(v.data(), h.data(), v.size() * sizeof(T));
  return v;
}

// Rank s sends rank r (s + 2r + 1) % 4 values (zero for some pairs from 2 ranks on), valued
// 1000 s + 10 r + k; checked as f32, i64 and bytes (their low byte). On `stream` when given (the
// caller's stream, synchronised before the check), else on the communicator's own.
template <class T>
void check_all_to_all_v_as(dist::Communicator& c, DType dtype, const Stream* stream) {
  const int n = c.size(), me = c.rank();
  auto count = [](int s, int r) { return static_cast<std::int64_t>((s + 2 * r + 1) % 4); };
  auto value = [](int s, int r, std::int64_t k) { return static_cast<T>(1000 * s + 10 * r + k); };
  std::vector<std::int64_t> send_counts, recv_counts;
  std::vector<T> send, expected;
  for (int r = 0; r < n; ++r) {
    send_counts.push_back(count(me, r));
    recv_counts.push_back(count(r, me));
    for (std::int64_t k = 0; k < count(me, r); ++k) send.push_back(value(me, r, k));
    for (std::int64_t k = 0; k < count(r, me); ++k) expected.push_back(value(r, me, k));
  }
  expected.push_back(T(77));  // one element more than is received: left as it was
  const Tensor send_d = device_tensor(send, dtype, c.device());
  std::vector<T> sentinel(expected.size(), T(77));
  const Tensor recv_d = device_tensor(sentinel, dtype, c.device());
  c.all_to_all_v(send_d, send_counts, recv_d, recv_counts, stream);
  if (stream) stream->synchronize();
  EXPECT_EQ(host_values<T>(recv_d), expected) << "rank " << me << " of " << n << ", dtype " << dtype_name(dtype);
}

inline void check_all_to_all_v(dist::Communicator& c, const Stream* stream) {
  check_all_to_all_v_as<float>(c, DType::f32, stream);
  check_all_to_all_v_as<std::int64_t>(c, DType::i64, stream);
  check_all_to_all_v_as<std::uint8_t>(c, DType::u8, stream);
  // Host counts through the device (exchange_counts): recv[s] = rank s's send[me].
  const int n = c.size(), me = c.rank();
  std::vector<std::int64_t> mine(static_cast<std::size_t>(n)), theirs(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) mine[static_cast<std::size_t>(r)] = 100 * me + r;
  c.exchange_counts(mine, theirs);
  for (int s = 0; s < n; ++s) EXPECT_EQ(theirs[static_cast<std::size_t>(s)], 100 * s + me) << "rank " << me;
}

// Small integers sum exactly in any order; a value that rounds must come out as the same bits on
// every rank (compared through exchange_counts). `elements` past NCCL's small-message paths too.
inline void check_all_reduce_sum(dist::Communicator& c, const Stream* stream, std::int64_t elements = 1000) {
  const int n = c.size(), me = c.rank();
  std::vector<float> v(static_cast<std::size_t>(elements));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(me + 1) * static_cast<float>(i % 7);
  const Tensor d = device_tensor(v, DType::f32, c.device());
  c.all_reduce_sum(d, stream);
  if (stream) stream->synchronize();
  const std::vector<float> got = host_values<float>(d);
  const float ranks_sum = static_cast<float>(n * (n + 1) / 2);
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < got.size(); ++i) wrong += got[i] != ranks_sum * static_cast<float>(i % 7);
  EXPECT_EQ(wrong, 0u) << "rank " << me << ": elements of the sum differ from " << ranks_sum << " * (i % 7)";
  const Tensor x = device_tensor(std::vector<float>{0.1f * static_cast<float>(me + 1) + 1e-3f}, DType::f32, c.device());
  c.all_reduce_sum(x, stream);
  if (stream) stream->synchronize();
  std::int64_t bits = 0;
  const float sum = host_values<float>(x)[0];
  std::memcpy(&bits, &sum, sizeof sum);
  std::vector<std::int64_t> out(static_cast<std::size_t>(n), bits), in(static_cast<std::size_t>(n));
  c.exchange_counts(out, in);
  for (int s = 0; s < n; ++s) EXPECT_EQ(in[static_cast<std::size_t>(s)], bits) << "rank " << s << " vs rank " << me;
  c.barrier();
}

}  // namespace fk::test
