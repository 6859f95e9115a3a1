#include <gtest/gtest.h>

#include <set>
#include <vector>

#include "fusekit/core/checks.hpp"
#include "fusekit/fusekit.hpp"
#include "test_util.hpp"

namespace fk {
namespace {

TEST(Tensor, ShapeStridesAndContiguity) {
  Tensor t = Tensor::empty({2, 3, 4}, DType::bf16, Device::cpu());
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.nbytes(), 48u);
  EXPECT_EQ(t.view().strides(), (Dims{12, 4, 1}));
  EXPECT_TRUE(t.view().is_contiguous());
  EXPECT_EQ(t.view().str(), "bf16[2, 3, 4] on cpu");
  const TensorView transposed(t.data(), DType::bf16, {3, 2}, {1, 3}, Device::cpu());
  EXPECT_FALSE(transposed.is_contiguous());
  // Empty: any strides (as PyTorch's [4, 0] with strides [1, 1]); size-1 dims: any stride.
  EXPECT_TRUE(TensorView(nullptr, DType::f32, {4, 0}, {1, 1}, Device::cpu()).is_contiguous());
  EXPECT_TRUE(TensorView(t.data(), DType::bf16, {1, 3}, {7, 1}, Device::cpu()).is_contiguous());
  EXPECT_EQ(t.size(-1), 4);
}

TEST(Tensor, SliceRowsAndReshape) {
  Tensor t = Tensor::empty({5, 4}, DType::f32, Device::cpu());
  for (int i = 0; i < 20; ++i) t.data_as<float>()[i] = static_cast<float>(i);
  const TensorView s = t.view().slice_rows(2, 4);
  EXPECT_EQ(s.shape(), (Dims{2, 4}));
  EXPECT_EQ(s.data_as<float>()[0], 8.0f);
  EXPECT_THROW(t.view().slice_rows(3, 6), Error);
  EXPECT_EQ(t.view().reshape({20}).shape(), (Dims{20}));
  EXPECT_THROW(t.view().reshape({3, 7}), Error);
}

TEST(Tensor, ErrorsNameTheOpAndArgument) {
  try {
    Tensor t = Tensor::empty({2, 2}, DType::f32, Device::cpu());
    Tensor u = Tensor::empty({3}, DType::f32, Device::cpu());
    copy(u, t);
    FAIL() << "copy of mismatched shapes did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.op(), "copy");
    EXPECT_EQ(e.arg(), "dst");
    EXPECT_NE(std::string(e.what()).find("expected shape [2, 2], got [3]"), std::string::npos) << e.what();
  }
  // A view of no memory (a default TensorView is one element, rank 0, no data) is refused by
  // name, on the host as on a GPU (where the runtime would say only "invalid argument").
  Tensor one = Tensor::empty({1}, DType::f32, Device::cpu());
  for (const bool to_null : {false, true}) {
    try {
      const TensorView none = TensorView().reshape({1});
      if (to_null) copy(none, one);
      else copy(one, none);
      FAIL() << "copy with a null view did not throw";
    } catch (const Error& e) {
      EXPECT_EQ(e.op(), "copy");
      EXPECT_EQ(e.arg(), to_null ? "dst" : "src");
      EXPECT_NE(std::string(e.what()).find("with no data"), std::string::npos) << e.what();
    }
  }
  EXPECT_NO_THROW(copy(TensorView(nullptr, DType::f32, {0}, Device::cpu()), TensorView(nullptr, DType::f32, {0}, Device::cpu())));
  EXPECT_THROW(Device::parse("gpu0"), Error);
  EXPECT_EQ(Device::parse("cuda:3"), Device::cuda(3));
  EXPECT_EQ(Device::parse("cpu").str(), "cpu");
}

TEST(Tensor, FillAndCloneOnHost) {
  Tensor t = Tensor::empty({3, 3}, DType::f16, Device::cpu());
  fill(t, 1.5);
  Tensor c = t.clone();
  EXPECT_NE(c.data(), t.data());
  for (double v : test::to_doubles(c)) EXPECT_EQ(v, 1.5);
  Tensor moved = std::move(c);
  EXPECT_EQ(moved.numel(), 9);
}

TEST(Tensor, SizesWhoseProductOverflowsAreRefusedNamingTheShape) {
  // 3 x 6148914691236517206 wraps to 2 elements in 64-bit arithmetic; 2^62 f32 elements are
  // 2^64 bytes. Both used to pass as small tensors.
  test::expect_arg_error([] { Tensor::empty({3, 6148914691236517206}, DType::f32, Device::cpu()); }, "Dims::numel", "shape");
  test::expect_arg_error([] { Tensor::empty({std::int64_t{1} << 62}, DType::f32, Device::cpu()); }, "Tensor::empty",
                         "shape");
  test::expect_arg_error([] { (void)Dims{1 << 20, 1 << 20, 1 << 20, 1 << 20}.numel(); }, "Dims::numel", "shape");
  test::expect_arg_error([] { (void)Dims{4, -1}.numel(); }, "Dims::numel", "shape");
  static float one = 0;
  test::expect_arg_error([] { TensorView(&one, DType::f32, {std::int64_t{1} << 40, std::int64_t{1} << 30}, Device::cpu()); },
                         "Dims::numel", "shape");
  try {
    Tensor::empty({3, 6148914691236517206}, DType::f32, Device::cpu());
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("[3, 6148914691236517206]"), std::string::npos) << e.what();
  }
}

TEST(Tensor, CopiesBetweenHostAndDevice) {
  FK_SKIP_WITHOUT_GPU();
  Tensor h = test::random_tensor({129, 33}, DType::bf16, Device::cpu(), 7);
  Tensor d = h.copy_to(Device::cuda(0));
  EXPECT_TRUE(d.device().is_cuda());
  Tensor back = d.copy_to(Device::cpu());
  EXPECT_EQ(std::memcmp(back.data(), h.data(), h.nbytes()), 0);
  fill(d, -3.0);
  for (double v : test::to_doubles(d)) ASSERT_EQ(v, -3.0);
}

// checks::disjoint_elements against brute force: every pair of views of one buffer among column
// blocks, shifted blocks, transposed and strided views; it may say "not proven" where they are
// disjoint, never "disjoint" where they share an element.
TEST(Checks, DisjointElementsNeverClaimsAnOverlap) {
  Tensor mem = Tensor::empty({4096}, DType::f32, Device::cpu());
  auto* base = static_cast<float*>(mem.data());
  const auto at = [&](std::int64_t off, Dims shape, Dims strides) {
    return TensorView(base + off, DType::f32, shape, strides, Device::cpu());
  };
  const std::vector<TensorView> views = {
      at(0, {2, 3, 5, 4}, {5 * 20, 4, 20, 1}),   // q: 3 heads of 4 in rows of 20 ([B, T, 5 heads])
      at(12, {2, 2, 5, 4}, {5 * 20, 4, 20, 1}),  // k: the last 2 heads of those rows
      at(11, {2, 2, 5, 4}, {5 * 20, 4, 20, 1}),  // k shifted one column into q
      at(0, {10, 20}, {20, 1}),                  // the whole matrix
      at(4, {10, 4}, {20, 1}),                   // one head's column block
      at(0, {4, 10}, {1, 20}),                   // a transposed view
      at(1, {5, 5}, {40, 2}),                    // every other column of every other row
      at(2, {5, 5}, {40, 2}),
      at(20, {5, 5}, {40, 2}),
      at(300, {3, 3}, {3, 1}),                   // apart
  };
  const auto elements = [&](const TensorView& v) {
    std::set<std::int64_t> out;
    std::vector<std::int64_t> idx(static_cast<std::size_t>(v.rank()), 0);
    for (std::int64_t n = 0; n < v.numel(); ++n) {
      std::int64_t off = static_cast<const float*>(v.data()) - base, rem = n;
      for (int d = v.rank() - 1; d >= 0; --d) {
        off += (rem % v.size(d)) * v.strides()[d];
        rem /= v.size(d);
      }
      out.insert(off);
    }
    return out;
  };
  int proven = 0;
  for (const TensorView& a : views)
    for (const TensorView& b : views) {
      const std::set<std::int64_t> ea = elements(a), eb = elements(b);
      bool shared = false;
      for (std::int64_t e : ea) shared = shared || eb.count(e) > 0;
      if (checks::disjoint_elements(a, b)) {
        EXPECT_FALSE(shared) << a.str() << " strides " << a.strides().str() << " vs " << b.str();
        ++proven;
      }
    }
  EXPECT_TRUE(checks::disjoint_elements(views[0], views[1]));  // q's and k's blocks
  EXPECT_FALSE(checks::disjoint_elements(views[0], views[2]));
  EXPECT_TRUE(checks::disjoint_elements(views[6], views[7]));  // odd and even columns
  EXPECT_GT(proven, 10);
}

}  // namespace
}  // namespace fk
