#include "convert.hpp"

#include <span>
#include <string>

namespace fk::py {

namespace {

DType to_dtype(nb::dlpack::dtype t, const char* op, const char* arg) {
  using Code = nb::dlpack::dtype_code;
  const auto code = static_cast<Code>(t.code);
  if (t.lanes == 1) {
    if (code == Code::Float && t.bits == 32) return DType::f32;
    if (code == Code::Float && t.bits == 16) return DType::f16;
    if (code == Code::Bfloat && t.bits == 16) return DType::bf16;
    if (code == Code::Int && t.bits == 8) return DType::i8;
    if (code == Code::UInt && t.bits == 8) return DType::u8;
    if (code == Code::Int && t.bits == 32) return DType::i32;
    if (code == Code::Int && t.bits == 64) return DType::i64;
  }
  throw Error(op, arg, "float32, float16, bfloat16, int8, uint8, int32 or int64",
              "DLPack type code " + std::to_string(t.code) + ", " + std::to_string(t.bits) + " bits, " +
                  std::to_string(t.lanes) + " lanes");
}

}  // namespace

TensorView view(const Array& a, const char* op, const char* arg) {
  const DType dtype = to_dtype(a.dtype(), op, arg);
  Device device;
  if (a.device_type() == nb::device::cpu::value) {
    device = Device::cpu();
  } else if (a.device_type() == nb::device::cuda::value) {
    device = Device::cuda(a.device_id());
  } else {
    throw Error(op, arg, "a CPU or CUDA tensor", "DLPack device type " + std::to_string(a.device_type()));
  }
  FK_CHECK_ARG(a.ndim() <= static_cast<std::size_t>(kMaxRank), op, arg,
               "at most " + std::to_string(kMaxRank) + " dimensions", std::to_string(a.ndim()));
  const Dims shape(std::span<const std::int64_t>(a.shape_ptr(), a.ndim()));
  const Dims strides = a.stride_ptr() ? Dims(std::span<const std::int64_t>(a.stride_ptr(), a.ndim()))
                                      : contiguous_strides(shape);
  return TensorView(const_cast<void*>(static_cast<const void*>(a.data())), dtype, shape, strides, device);
}

std::optional<TensorView> view(const std::optional<Array>& a, const char* op, const char* arg) {
  if (!a) return std::nullopt;
  return view(*a, op, arg);
}

StreamArg::StreamArg(std::uintptr_t handle, const TensorView& like) {
  if (like.device().is_cuda()) stream_.emplace(Stream::adopt(reinterpret_cast<void*>(handle), like.device()));
}

}  // namespace fk::py
