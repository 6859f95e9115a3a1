// Event, Graph and adopted Streams: ownership moves, events order and time work, a captured graph replays it.
#include <gtest/gtest.h>

#include "fusekit/core/event.hpp"
#include "fusekit/fusekit.hpp"
#include "test_util.hpp"

namespace fk {
namespace {

TEST(Event, RefusedWithoutCudaDevice) {
  test::expect_arg_error([] { Event::create(Device::cpu()); }, "Event::create", "device");
}

TEST(Event, OrdersAndTimesWorkAcrossStreams) {
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  const Stream a = Stream::create(gpu), b = Stream::create(gpu);
  const Event start = Event::create(gpu), done = Event::create(gpu);
  Event moved = Event::create(gpu, false);
  const Event taken = std::move(moved);
  EXPECT_FALSE(moved);
  EXPECT_TRUE(taken);
  Tensor x = test::random_tensor({1 << 20}, DType::f32, gpu, 1), y = Tensor::empty({1 << 20}, DType::f32, gpu);
  start.record(a);
  fill_uniform(x, 2.0f, 3.0f, {5, 0}, &a);
  done.record(a);
  done.wait_on(b);  // the copy on b sees the fill on a
  b.synchronize();
  copy(y, x);
  done.synchronize();
  EXPECT_GE(done.elapsed_ms_since(start), 0.0f);
  for (double v : test::to_doubles(y.view().slice_rows(0, 1000))) ASSERT_TRUE(v >= 2.0 && v < 3.0) << v;
}

TEST(Stream, AdoptedStreamRunsWorkAndIsNotDestroyed) {
  test::expect_arg_error([] { Stream::adopt(nullptr, Device::cpu()); }, "Stream::adopt", "device");
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  const Stream owner = Stream::create(gpu);
  Tensor x = Tensor::empty({4096}, DType::f32, gpu);
  {
    const Stream adopted = Stream::adopt(owner.handle(), gpu);
    EXPECT_EQ(adopted.handle(), owner.handle());
    fill_uniform(x, 4.0f, 5.0f, {3, 0}, &adopted);
  }  // the adopted handle goes; the stream must stay usable
  fill_uniform(x, 5.0f, 6.0f, {4, 0}, &owner);
  owner.synchronize();
  for (double v : test::to_doubles(x)) ASSERT_TRUE(v >= 5.0 && v < 6.0) << v;
}

TEST(Graph, ReplaysWhatWasCaptured) {
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  const Stream s = Stream::create(gpu);
  Tensor x = Tensor::empty({4096}, DType::f32, gpu, &s);
  const Graph g = Graph::capture(s, [&] { fill_uniform(x, 7.0f, 8.0f, {9, 0}, &s); });
  fill_uniform(x, -1.0f, 0.0f, {1, 0}, &s);  // capture ran nothing: x holds what this writes
  s.synchronize();
  EXPECT_LT(test::to_doubles(x)[0], 0.0);
  g.launch(s);
  s.synchronize();
  for (double v : test::to_doubles(x)) ASSERT_TRUE(v >= 7.0 && v < 8.0) << v;
  Graph moved = Graph::capture(s, [&] { fill_uniform(x, 0.0f, 1.0f, {2, 0}, &s); });
  const Graph kept = std::move(moved);
  EXPECT_FALSE(moved);
  EXPECT_TRUE(kept);
}

}  // namespace
}  // namespace fk
