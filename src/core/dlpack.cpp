#include "fusekit/core/dlpack.hpp"

#include <dlpack/dlpack.h>
#include <fmt/format.h>

#include <optional>

#include "fusekit/core/error.hpp"

namespace fk {
namespace {

DLDataType to_dl(DType t) {
  switch (t) {
    case DType::f32: return {kDLFloat, 32, 1};
    case DType::f16: return {kDLFloat, 16, 1};
    case DType::bf16: return {kDLBfloat, 16, 1};
    case DType::i8: return {kDLInt, 8, 1};
    case DType::u8: return {kDLUInt, 8, 1};
    case DType::i32: return {kDLInt, 32, 1};
    case DType::i64: return {kDLInt, 64, 1};
  }
  throw_internal("to_dl: unknown dtype");
}

std::optional<DType> from_dl(DLDataType t) {
  if (t.lanes != 1) return std::nullopt;
  for (DType d : {DType::f32, DType::f16, DType::bf16, DType::i8, DType::u8, DType::i32, DType::i64}) {
    const DLDataType x = to_dl(d);
    if (x.code == t.code && x.bits == t.bits) return d;
  }
  return std::nullopt;
}

struct Exported {
  Tensor tensor;
  std::int64_t shape[kMaxRank];
  std::int64_t strides[kMaxRank];
  DLManagedTensor managed;
};

}  // namespace

DLManagedTensor* to_dlpack(Tensor&& t) {
  auto* e = new Exported{std::move(t), {}, {}, {}};
  const TensorView& v = e->tensor.view();
  for (int i = 0; i < v.rank(); ++i) {
    e->shape[i] = v.shape()[i];
    e->strides[i] = v.strides()[i];
  }
  DLTensor& d = e->managed.dl_tensor;
  d.data = v.data();
  d.device = v.device().is_cuda() ? DLDevice{kDLCUDA, v.device().index} : DLDevice{kDLCPU, 0};
  d.ndim = v.rank();
  d.dtype = to_dl(v.dtype());
  d.shape = e->shape;
  d.strides = e->strides;
  d.byte_offset = 0;
  e->managed.manager_ctx = e;
  e->managed.deleter = [](DLManagedTensor* m) { delete static_cast<Exported*>(m->manager_ctx); };
  return &e->managed;
}

Tensor from_dlpack(DLManagedTensor* m) {
  FK_CHECK_ARG(m != nullptr, "from_dlpack", "m", "a DLManagedTensor", "null");
  auto release = [m] {
    if (m->deleter) m->deleter(m);
  };
  try {
    const DLTensor& d = m->dl_tensor;
    const auto dtype = from_dl(d.dtype);
    FK_CHECK_ARG(dtype.has_value(), "from_dlpack", "dtype", "f32, f16, bf16, i8, u8, i32 or i64 with 1 lane",
                 fmt::format("code {} bits {} lanes {}", d.dtype.code, d.dtype.bits, d.dtype.lanes));
    FK_CHECK_ARG(d.device.device_type == kDLCPU || d.device.device_type == kDLCUDA, "from_dlpack", "device",
                 "kDLCPU or kDLCUDA", fmt::format("device type {}", static_cast<int>(d.device.device_type)));
    FK_CHECK_ARG(d.ndim >= 0 && d.ndim <= kMaxRank, "from_dlpack", "ndim", fmt::format("0..{}", kMaxRank),
                 std::to_string(d.ndim));
    const Dims shape(std::span<const std::int64_t>(d.shape, static_cast<std::size_t>(d.ndim)));
    const Dims strides = d.strides ? Dims(std::span<const std::int64_t>(d.strides, static_cast<std::size_t>(d.ndim)))
                                   : contiguous_strides(shape);
    const Device dev = d.device.device_type == kDLCUDA ? Device::cuda(d.device.device_id) : Device::cpu();
    void* data = static_cast<char*>(d.data) + d.byte_offset;
    return Tensor::adopt(TensorView(data, *dtype, shape, strides, dev), release);
  } catch (...) {
    release();
    throw;
  }
}

}  // namespace fk
