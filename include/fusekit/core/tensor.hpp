// TensorView (non-owning: pointer, dtype, shape, strides in elements, device) and Tensor (owning,
// move-only; its memory comes from the caching allocator, or from a DLPack producer).
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>

#include "fusekit/core/device.hpp"
#include "fusekit/core/dtype.hpp"

namespace fk {

class Stream;

inline constexpr int kMaxRank = 8;

// Shape or strides of up to kMaxRank dimensions, stored inline.
class Dims {
 public:
  Dims() = default;
  Dims(std::initializer_list<std::int64_t> d);
  explicit Dims(std::span<const std::int64_t> d);

  int size() const noexcept { return rank_; }
  std::int64_t operator[](int i) const noexcept { return v_[i]; }
  std::int64_t& operator[](int i) noexcept { return v_[i]; }
  const std::int64_t* begin() const noexcept { return v_.data(); }
  const std::int64_t* end() const noexcept { return v_.data() + rank_; }
  // The product of the sizes; throws fk::Error for a negative size or a product past 2^63.
  std::int64_t numel() const;
  std::string str() const;  // "[2, 3]"
  friend bool operator==(const Dims& a, const Dims& b) noexcept;

 private:
  std::array<std::int64_t, kMaxRank> v_{};
  int rank_ = 0;
};

Dims contiguous_strides(const Dims& shape);
// numel * dtype_size, checked: throws fk::Error naming `op` and the shape when it would pass 2^63.
std::int64_t checked_bytes(const Dims& shape, DType dtype, const char* op);

class TensorView {
 public:
  TensorView() = default;
  // Contiguous (row-major) view.
  TensorView(void* data, DType dtype, Dims shape, Device device);
  TensorView(void* data, DType dtype, Dims shape, Dims strides, Device device);

  void* data() const noexcept { return data_; }
  template <class T> T* data_as() const noexcept { return static_cast<T*>(data_); }
  DType dtype() const noexcept { return dtype_; }
  const Dims& shape() const noexcept { return shape_; }
  const Dims& strides() const noexcept { return strides_; }
  std::int64_t size(int dim) const noexcept { return shape_[dim < 0 ? dim + shape_.size() : dim]; }
  int rank() const noexcept { return shape_.size(); }
  Device device() const noexcept { return device_; }
  // Checked when the view was made: these never overflow.
  std::int64_t numel() const noexcept { return shape_.numel(); }
  std::size_t nbytes() const noexcept { return static_cast<std::size_t>(numel()) * dtype_size(dtype_); }
  bool is_contiguous() const noexcept;
  bool defined() const noexcept { return data_ != nullptr || numel() == 0; }
  // "bf16[128, 512] on cuda:0"
  std::string str() const;

  // Rows [begin, end) of the first dimension (a view, no copy).
  TensorView slice_rows(std::int64_t begin, std::int64_t end) const;
  TensorView reshape(Dims shape) const;  // contiguous views only

 private:
  void* data_ = nullptr;
  DType dtype_ = DType::f32;
  Dims shape_, strides_;
  Device device_ = Device::cpu();
};

class Tensor {
 public:
  Tensor() = default;
  // Uninitialised contiguous tensor. On a CUDA device the memory comes from the caching allocator,
  // ordered on `stream` (the device's default stream when null).
  static Tensor empty(Dims shape, DType dtype, Device device, const Stream* stream = nullptr);
  // Wraps memory owned by someone else; `release` runs when the last user lets go.
  static Tensor adopt(TensorView view, std::function<void()> release);

  Tensor(Tensor&&) noexcept = default;
  Tensor& operator=(Tensor&&) noexcept = default;
  // No implicit copies of device memory: use clone() or copy_to().
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;
  ~Tensor() = default;

  const TensorView& view() const noexcept { return view_; }
  operator const TensorView&() const noexcept { return view_; }
  void* data() const noexcept { return view_.data(); }
  template <class T> T* data_as() const noexcept { return view_.data_as<T>(); }
  DType dtype() const noexcept { return view_.dtype(); }
  const Dims& shape() const noexcept { return view_.shape(); }
  Device device() const noexcept { return view_.device(); }
  std::int64_t numel() const noexcept { return view_.numel(); }
  std::size_t nbytes() const noexcept { return view_.nbytes(); }
  std::int64_t size(int dim) const noexcept { return view_.size(dim); }

  // A copy of this tensor on `device` (synchronous). Contiguous tensors only.
  Tensor copy_to(Device device) const;
  Tensor clone() const { return copy_to(device()); }
  // Shares ownership of the storage: the memory lives until every holder is gone.
  std::shared_ptr<void> storage() const noexcept { return storage_; }

 private:
  std::shared_ptr<void> storage_;
  TensorView view_;
};

// Copy between any two devices; same dtype and shape. Each side is contiguous, or the rows of a
// padded matrix: rank 2, inner stride 1, row stride >= cols (only the cols are copied).
// copy is synchronous and ordered after work on the legacy default stream only (synchronise other
// streams first); copy_async is queued on `stream` (host memory must then be page-locked for the
// copy to overlap, and must stay valid until the stream has run it).
void copy(const TensorView& dst, const TensorView& src);
void copy_async(const TensorView& dst, const TensorView& src, const Stream& stream);
// Sets every byte of a contiguous tensor to 0, queued on `stream` (host tensors: at once, after
// synchronising the stream).
void zero_async(const TensorView& t, const Stream& stream);
// Fills every element with `value` converted to the tensor's dtype (synchronous).
void fill(const TensorView& t, double value);

}  // namespace fk
