// dist::plan_gradient_buckets, and the DLRM's gradient units it cuts (Dlrm::gradient_units).
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "distributed_run.hpp"
#include "fusekit/dist/gradient_buckets.hpp"
#include "test_util.hpp"

namespace fk::dist {
namespace {

// Units in a backward's order over a buffer laid out [a | b | c | d] of 10, 20, 30 and 40 floats,
// made last layer first: d, c, b, a.
std::vector<GradientRange> reversed_units() { return {{60, 40}, {30, 30}, {10, 20}, {0, 10}}; }

TEST(GradientBuckets, TinyBucketsHoldOneUnitEach) {
  const auto b = plan_gradient_buckets(reversed_units(), 1);
  ASSERT_EQ(b.size(), 4u);
  for (std::size_t i = 0; i < b.size(); ++i) {
    EXPECT_EQ(b[i].first_unit, i);
    EXPECT_EQ(b[i].last_unit, i);
    EXPECT_EQ(b[i].offset, reversed_units()[i].offset);
    EXPECT_EQ(b[i].floats, reversed_units()[i].floats);
  }
}

TEST(GradientBuckets, AHugeBucketIsTheWholeBuffer) {
  const auto b = plan_gradient_buckets(reversed_units(), std::int64_t{1} << 40);
  ASSERT_EQ(b.size(), 1u);
  EXPECT_EQ(b[0].offset, 0);
  EXPECT_EQ(b[0].floats, 100);
  EXPECT_EQ(b[0].first_unit, 0u);
  EXPECT_EQ(b[0].last_unit, 3u);
}

TEST(GradientBuckets, UnitsJoinWhileTheyFitAndStayContiguous) {
  // 280 bytes = 70 floats: d (40) + c (30) = 70 fits; b (20) + a (10) = 30 the next.
  auto b = plan_gradient_buckets(reversed_units(), 280);
  ASSERT_EQ(b.size(), 2u);
  EXPECT_EQ(b[0].offset, 30);
  EXPECT_EQ(b[0].floats, 70);
  EXPECT_EQ(b[0].last_unit, 1u);
  EXPECT_EQ(b[1].offset, 0);
  EXPECT_EQ(b[1].floats, 30);
  EXPECT_EQ(b[1].first_unit, 2u);
  // 276 bytes = 69 floats: d alone, then c + b + a (60).
  b = plan_gradient_buckets(reversed_units(), 276);
  ASSERT_EQ(b.size(), 2u);
  EXPECT_EQ(b[0].floats, 40);
  EXPECT_EQ(b[1].offset, 0);
  EXPECT_EQ(b[1].floats, 60);
  // 120 bytes = 30 floats: d (40) is a bucket of its own, larger than the cap; then c; then b + a.
  b = plan_gradient_buckets(reversed_units(), 120);
  ASSERT_EQ(b.size(), 3u);
  EXPECT_EQ(b[0].floats, 40);
  EXPECT_EQ(b[1].floats, 30);
  EXPECT_EQ(b[2].offset, 0);
  EXPECT_EQ(b[2].floats, 30);
  EXPECT_EQ(b[2].first_unit, 2u);
  EXPECT_EQ(b[2].last_unit, 3u);
}

TEST(GradientBuckets, NonAdjacentUnitsStartANewBucket) {
  // The backward makes [20, 30), then [0, 10), then [10, 20): the second is not next to the first.
  const std::vector<GradientRange> units{{20, 10}, {0, 10}, {10, 10}};
  const auto b = plan_gradient_buckets(units, std::int64_t{1} << 40);
  ASSERT_EQ(b.size(), 2u);
  EXPECT_EQ(b[0].offset, 20);
  EXPECT_EQ(b[0].floats, 10);
  EXPECT_EQ(b[1].offset, 0);
  EXPECT_EQ(b[1].floats, 20);
}

TEST(GradientBuckets, RefusesUnitsThatDoNotTileTheBuffer) {
  const std::vector<GradientRange> gap{{0, 10}, {11, 5}}, overlap{{0, 10}, {9, 5}}, empty{{0, 0}};
  for (const auto& u : {gap, overlap, empty})
    test::expect_arg_error([&] { plan_gradient_buckets(u, 64); }, "dist::plan_gradient_buckets", "units");
  test::expect_arg_error([&] { plan_gradient_buckets(reversed_units(), 0); }, "dist::plan_gradient_buckets",
                         "bucket_bytes");
}

TEST(GradientBuckets, DlrmUnitsTileItsGradientsInTheBackwardsOrder) {
  for (const auto op : {models::InteractionOp::dot, models::InteractionOp::dcn}) {
    const data::Featurizer feat = test::dist_featurizer(false);
    models::DlrmConfig config = test::dist_config({op, false, models::DlrmImpl::fused}, feat);
    config.bottom_mlp = {13, 16, 16, 8};
    config.top_mlp = {32, 16, 1};
    models::Dlrm m(config, Device::cpu(), models::DlrmImpl::fused, models::DlrmTables::external);
    const auto units = m.gradient_units();
    std::vector<std::string> names;
    std::vector<GradientRange> ranges;
    for (const auto& u : units) {
      names.push_back(u.name);
      ranges.push_back({u.offset, u.floats});
    }
    std::vector<std::string> want{"top.2", "top.1", "top.0"};
    if (op == models::InteractionOp::dcn) want.push_back("cross");
    for (const char* n : {"bottom.2", "bottom.1", "bottom.0"}) want.push_back(n);
    EXPECT_EQ(names, want);
    // They tile the buffer (the planner checks), and one huge bucket is all of it.
    const auto one = plan_gradient_buckets(ranges, std::int64_t{1} << 40);
    ASSERT_EQ(one.size(), 1u);
    EXPECT_EQ(one[0].floats, m.dense_gradients().numel());
    // Every layer's weight and bias gradients lie in its unit.
    const auto* base = static_cast<const float*>(m.dense_gradients().data());
    const auto layers = m.linear_layers();  // bottom, then top
    for (std::size_t l = 0; l < layers.size(); ++l) {
      const bool top = l >= 3;
      const std::string name = (top ? "top." : "bottom.") + std::to_string(top ? l - 3 : l);
      const auto u = std::find(names.begin(), names.end(), name) - names.begin();
      ASSERT_LT(static_cast<std::size_t>(u), units.size()) << name;
      for (const Tensor* g : {layers[l].weight_grad, layers[l].bias_grad}) {
        const auto at = static_cast<const float*>(g->data()) - base;
        EXPECT_GE(at, units[static_cast<std::size_t>(u)].offset) << name;
        EXPECT_LE(at + g->numel(), units[static_cast<std::size_t>(u)].offset + units[static_cast<std::size_t>(u)].floats)
            << name;
      }
    }
    const std::string line = gradient_buckets_str(plan_gradient_buckets(ranges, 1), names, 1);
    EXPECT_NE(line.find("[top.2]"), std::string::npos) << line;
  }
}

// DistributedDlrm on the single communicator: any bucket size trains the same bits.
TEST(GradientBuckets, OneRankTrainsTheSameBitsWithAnyBucketSize) {
  auto comm = make_single_communicator();
  for (const auto op : {models::InteractionOp::dot, models::InteractionOp::dcn})
    test::compare_gradient_buckets(*comm, {op, true, models::DlrmImpl::fused}, true);
}

}  // namespace
}  // namespace fk::dist
