#include <dlpack/dlpack.h>
#include <gtest/gtest.h>

#include "fusekit/fusekit.hpp"
#include "test_util.hpp"

namespace fk {
namespace {

TEST(DLPack, ExportDescribesTheTensorAndKeepsItAlive) {
  Tensor t = Tensor::empty({3, 5}, DType::bf16, Device::cpu());
  fill(t, 2.0);
  void* data = t.data();
  DLManagedTensor* m = to_dlpack(std::move(t));
  EXPECT_EQ(m->dl_tensor.data, data);
  EXPECT_EQ(m->dl_tensor.ndim, 2);
  EXPECT_EQ(m->dl_tensor.shape[0], 3);
  EXPECT_EQ(m->dl_tensor.shape[1], 5);
  EXPECT_EQ(m->dl_tensor.strides[0], 5);
  EXPECT_EQ(m->dl_tensor.dtype.code, kDLBfloat);
  EXPECT_EQ(m->dl_tensor.dtype.bits, 16);
  EXPECT_EQ(m->dl_tensor.device.device_type, kDLCPU);
  // Round trip: the same memory comes back, and the exporter's deleter runs when it is dropped.
  {
    Tensor back = from_dlpack(m);
    EXPECT_EQ(back.data(), data);
    EXPECT_EQ(back.dtype(), DType::bf16);
    EXPECT_EQ(back.shape(), (Dims{3, 5}));
    for (double v : test::to_doubles(back)) EXPECT_EQ(v, 2.0);
  }
}

struct Foreign {
  float values[6] = {1, 2, 3, 4, 5, 6};
  std::int64_t shape[2] = {2, 3};
  int* deleted;
  DLManagedTensor m{};
};

DLManagedTensor* make_foreign(int* deleted, DLDataType dtype) {
  auto* f = new Foreign;
  f->deleted = deleted;
  f->m.dl_tensor = DLTensor{f->values, DLDevice{kDLCPU, 0}, 2, dtype, f->shape, nullptr, 0};
  f->m.manager_ctx = f;
  f->m.deleter = [](DLManagedTensor* m) {
    auto* f = static_cast<Foreign*>(m->manager_ctx);
    ++*f->deleted;
    delete f;
  };
  return &f->m;
}

TEST(DLPack, ImportCallsTheDeleterOnceWhenDone) {
  int deleted = 0;
  {
    Tensor t = from_dlpack(make_foreign(&deleted, {kDLFloat, 32, 1}));
    EXPECT_TRUE(t.view().is_contiguous());  // null strides mean row-major
    EXPECT_EQ(test::to_doubles(t)[5], 6.0);
    Tensor moved = std::move(t);
    EXPECT_EQ(deleted, 0);
  }
  EXPECT_EQ(deleted, 1);
}

TEST(DLPack, UnsupportedDtypeRaisesAndReleases) {
  int deleted = 0;
  EXPECT_THROW(from_dlpack(make_foreign(&deleted, {kDLComplex, 64, 1})), Error);
  EXPECT_EQ(deleted, 1);
  EXPECT_THROW(from_dlpack(make_foreign(&deleted, {kDLFloat, 32, 4})), Error);
  EXPECT_EQ(deleted, 2);
  EXPECT_THROW(from_dlpack(nullptr), Error);
}

TEST(DLPack, CudaTensorsKeepTheirDevice) {
  FK_SKIP_WITHOUT_GPU();
  Tensor t = Tensor::empty({4}, DType::f32, Device::cuda(0));
  DLManagedTensor* m = to_dlpack(std::move(t));
  EXPECT_EQ(m->dl_tensor.device.device_type, kDLCUDA);
  EXPECT_EQ(m->dl_tensor.device.device_id, 0);
  Tensor back = from_dlpack(m);
  EXPECT_EQ(back.device(), Device::cuda(0));
}

}  // namespace
}  // namespace fk
