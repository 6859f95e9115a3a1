// The NCCL communicator of one process a GPU, started through MPI: this binary is launched by
// ctest under mpirun -np 2 (dist_nccl_mpi_np2), and by hand on a machine with more GPUs
// (mpirun -np N build/tests/dist_nccl_mpi_test). Each rank takes the GPU of its local rank; the
// checks are nccl_checks.hpp's. With fewer GPUs than ranks the collectives skip, saying why, and
// every rank must fail to make the communicator.
#include <gtest/gtest.h>

#include <memory>

#include "fusekit/dist/communicator.hpp"
#include "nccl_checks.hpp"

namespace fk::dist {
namespace {

std::shared_ptr<Communicator> g_mpi;

TEST(NcclCommunicatorOverMpi, CollectivesOnEveryRank) {
  if (cuda_device_count() < g_mpi->size())
    GTEST_SKIP() << "needs a GPU a rank (" << g_mpi->size() << "), found " << cuda_device_count()
                 << (cuda_device_count() == 0 ? ": " + cuda_unavailable_reason() : std::string());
  auto comm = make_nccl_communicator(g_mpi);
  EXPECT_EQ(comm->rank(), g_mpi->rank());
  EXPECT_EQ(comm->size(), g_mpi->size());
  EXPECT_EQ(comm->backend(), "nccl");
  EXPECT_EQ(comm->device(), Device::cuda(g_mpi->rank()));  // one host: the local rank is the rank
  const Stream stream = Stream::create(comm->device());
  for (const Stream* s : {static_cast<const Stream*>(nullptr), &stream}) {
    test::check_all_to_all_v(*comm, s);
    test::check_all_reduce_sum(*comm, s);
    test::check_all_reduce_sum(*comm, s, (1 << 22) + 3);
  }
}

// A rank without a GPU of its own fails, and so does every other rank, instead of waiting for it
// in NCCL's setup (on CI's machines, which have no GPU).
TEST(NcclCommunicatorOverMpi, RanksFailTogetherWhenOneHasNoGpu) {
  if (cuda_device_count() >= g_mpi->size()) GTEST_SKIP() << "every rank has a GPU here";
  test::expect_error_mentions([] { make_nccl_communicator(g_mpi); }, {"dist::make_nccl_communicator", "GPU"});
}

}  // namespace
}  // namespace fk::dist

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  fk::dist::g_mpi = fk::dist::make_mpi_communicator();
  fk::dist::Communicator& mpi = *fk::dist::g_mpi;
  if (mpi.rank() != 0) {  // one progress log; the other ranks still report their failures
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  const int rc = RUN_ALL_TESTS();
  // Every rank's verdict: a rank whose test failed makes the whole run fail on rank 0 too.
  std::vector<std::int64_t> out(static_cast<std::size_t>(mpi.size()), rc), in(static_cast<std::size_t>(mpi.size()));
  mpi.exchange_counts(out, in);
  int failed = 0;
  for (std::int64_t r : in) failed += r != 0;
  if (mpi.rank() == 0 && failed > 0) std::printf("%d of %d ranks had failures\n", failed, mpi.size());
  fk::dist::g_mpi.reset();
  return failed > 0 ? 1 : 0;
}
