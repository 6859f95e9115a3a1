#include "fusekit/core/tensor.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstring>
#include <type_traits>
#include <vector>

#include "fusekit/core/allocator.hpp"
#include "fusekit/core/error.hpp"
#include "fusekit/core/stream.hpp"

#if FUSEKIT_WITH_CUDA
#include "fusekit/core/cuda_check.hpp"
#endif

namespace fk {

Dims::Dims(std::initializer_list<std::int64_t> d) : Dims(std::span<const std::int64_t>(d.begin(), d.size())) {}

Dims::Dims(std::span<const std::int64_t> d) {
  FK_CHECK_ARG(d.size() <= static_cast<std::size_t>(kMaxRank), "Dims", "rank",
               fmt::format("at most {}", kMaxRank), std::to_string(d.size()));
  rank_ = static_cast<int>(d.size());
  for (int i = 0; i < rank_; ++i) v_[i] = d[i];
}

std::int64_t Dims::numel() const {
  std::int64_t n = 1;
  for (int i = 0; i < rank_; ++i) {
    FK_CHECK_ARG(v_[i] >= 0, "Dims::numel", "shape", "non-negative sizes", str());
    FK_CHECK_ARG(!__builtin_mul_overflow(n, v_[i], &n), "Dims::numel", "shape", "sizes whose product is below 2^63",
                 str());
  }
  return n;
}

std::int64_t checked_bytes(const Dims& shape, DType dtype, const char* op) {
  std::int64_t bytes = 0;
  FK_CHECK_ARG(!__builtin_mul_overflow(shape.numel(), static_cast<std::int64_t>(dtype_size(dtype)), &bytes), op,
               "shape", fmt::format("a {} tensor of fewer than 2^63 bytes", dtype_name(dtype)), shape.str());
  return bytes;
}

std::string Dims::str() const { return fmt::format("[{}]", fmt::join(begin(), end(), ", ")); }

bool operator==(const Dims& a, const Dims& b) noexcept {
  if (a.rank_ != b.rank_) return false;
  for (int i = 0; i < a.rank_; ++i)
    if (a.v_[i] != b.v_[i]) return false;
  return true;
}

Dims contiguous_strides(const Dims& shape) {
  Dims s = shape;
  std::int64_t stride = 1;
  for (int i = shape.size() - 1; i >= 0; --i) {
    s[i] = stride;
    // Wraps (no undefined behaviour) for a shape too large; the view's constructor refuses it.
    stride = static_cast<std::int64_t>(static_cast<std::uint64_t>(stride) * static_cast<std::uint64_t>(shape[i]));
  }
  return s;
}

TensorView::TensorView(void* data, DType dtype, Dims shape, Device device)
    : TensorView(data, dtype, shape, contiguous_strides(shape), device) {}

TensorView::TensorView(void* data, DType dtype, Dims shape, Dims strides, Device device)
    : data_(data), dtype_(dtype), shape_(shape), strides_(strides), device_(device) {
  FK_CHECK_ARG(shape.size() == strides.size(), "TensorView", "strides",
               fmt::format("{} strides (one per dimension)", shape.size()), strides.str());
  for (int i = 0; i < shape.size(); ++i)
    FK_CHECK_ARG(shape[i] >= 0, "TensorView", "shape", "non-negative sizes", shape.str());
  checked_bytes(shape, dtype, "TensorView");  // numel() and nbytes() never overflow afterwards
}

bool TensorView::is_contiguous() const noexcept {
  // An empty tensor's strides address nothing (PyTorch hands out [4, 0] with strides [1, 1]).
  for (int i = 0; i < rank(); ++i)
    if (shape_[i] == 0) return true;
  std::int64_t expected = 1;
  for (int i = rank() - 1; i >= 0; --i) {
    if (shape_[i] != 1 && strides_[i] != expected) return false;
    expected *= shape_[i];
  }
  return true;
}

std::string TensorView::str() const {
  return fmt::format("{}{}{} on {}", dtype_name(dtype_), shape_.str(),
                     is_contiguous() ? "" : fmt::format(" strides {}", strides_.str()), device_.str());
}

TensorView TensorView::slice_rows(std::int64_t begin, std::int64_t end) const {
  FK_CHECK_ARG(rank() >= 1, "TensorView::slice_rows", "self", "rank >= 1", str());
  FK_CHECK_ARG(0 <= begin && begin <= end && end <= shape_[0], "TensorView::slice_rows", "range",
               fmt::format("0 <= begin <= end <= {}", shape_[0]), fmt::format("[{}, {})", begin, end));
  Dims s = shape_;
  s[0] = end - begin;
  auto* p = static_cast<char*>(data_) + begin * strides_[0] * static_cast<std::int64_t>(dtype_size(dtype_));
  return TensorView(p, dtype_, s, strides_, device_);
}

TensorView TensorView::reshape(Dims shape) const {
  FK_CHECK_ARG(is_contiguous(), "TensorView::reshape", "self", "a contiguous tensor", str());
  FK_CHECK_ARG(shape.numel() == numel(), "TensorView::reshape", "shape",
               fmt::format("{} elements", numel()), shape.str());
  return TensorView(data_, dtype_, shape, device_);
}

Tensor Tensor::empty(Dims shape, DType dtype, Device device, const Stream* stream) {
  Tensor t;
  const std::size_t bytes = static_cast<std::size_t>(checked_bytes(shape, dtype, "Tensor::empty"));
  void* p = allocator::allocate(bytes, device, stream);
  t.storage_ = std::shared_ptr<void>(p, [](void* q) { allocator::deallocate(q); });
  t.view_ = TensorView(p, dtype, shape, device);
  return t;
}

Tensor Tensor::adopt(TensorView view, std::function<void()> release) {
  Tensor t;
  t.storage_ = std::shared_ptr<void>(view.data(), [release = std::move(release)](void*) {
    if (release) release();
  });
  t.view_ = view;
  return t;
}

Tensor Tensor::copy_to(Device device) const {
  Tensor t = empty(shape(), dtype(), device);
  copy(t.view(), view_);
  return t;
}

namespace {

// A view copy() can move: contiguous, or rank 2 with unit inner stride and row stride >= cols
// (rows of a padded matrix). Returns the row stride in elements (cols when contiguous).
std::int64_t copy_row_stride(const TensorView& t, const char* arg) {
  if (t.is_contiguous()) return t.rank() == 2 ? t.size(1) : 0;
  FK_CHECK_ARG(t.rank() == 2 && t.strides()[1] == 1 && t.strides()[0] >= t.size(1), "copy", arg,
               "a contiguous tensor or rows [rows, cols] with inner stride 1 and a row stride >= cols", t.str());
  return t.strides()[0];
}

#if FUSEKIT_WITH_CUDA
// What the runtime knows of a view's pointer: "device 0", "host (page-locked)", "host (pageable)".
std::string memory_of(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();
    return "unknown";
  }
  switch (a.type) {
    case cudaMemoryTypeDevice: return fmt::format("device {}", a.device);
    case cudaMemoryTypeManaged: return fmt::format("managed (device {})", a.device);
    case cudaMemoryTypeHost: return "host (page-locked)";
    default: return "host (pageable) or unknown to CUDA";
  }
}

// A failed cudaMemcpy*: fk::Error naming both views, their pointers and what the runtime takes
// them for (a view labelled with the wrong device, or running past its allocation, shows here).
[[noreturn]] void throw_copy_failure(cudaError_t e, const TensorView& dst, const TensorView& src, bool async) {
  cudaGetLastError();  // non-sticky: later calls are not blamed for it
  throw Error(async ? "copy_async" : "copy",
              fmt::format("{} ({}) copying {} bytes to dst {} at {} ({}) from src {} at {} ({})", cudaGetErrorString(e),
                          cudaGetErrorName(e), src.nbytes(), dst.str(), dst.data(), memory_of(dst.data()), src.str(),
                          src.data(), memory_of(src.data())));
}
#endif

void copy_impl(const TensorView& dst, const TensorView& src, const Stream* stream) {
  FK_CHECK_ARG(dst.dtype() == src.dtype(), "copy", "dst", fmt::format("dtype {}", dtype_name(src.dtype())),
               std::string(dtype_name(dst.dtype())));
  FK_CHECK_ARG(dst.shape() == src.shape(), "copy", "dst", fmt::format("shape {}", src.shape().str()),
               dst.shape().str());
  const std::int64_t ld_src = copy_row_stride(src, "src"), ld_dst = copy_row_stride(dst, "dst");
  if (src.numel() == 0) return;
  // A view of no memory (a default TensorView is rank 0, one element, no data): a clear error here
  // rather than a crash in memcpy or cudaErrorInvalidValue from the runtime.
  FK_CHECK_ARG(src.data() != nullptr, "copy", "src", "a tensor with memory", src.str() + " with no data");
  FK_CHECK_ARG(dst.data() != nullptr, "copy", "dst", "a tensor with memory", dst.str() + " with no data");
  const bool rows = !(src.is_contiguous() && dst.is_contiguous());
  const std::size_t esize = dtype_size(src.dtype());
  if (src.device().is_cpu() && dst.device().is_cpu()) {
    if (stream != nullptr) stream->synchronize();
    if (!rows) {
      std::memcpy(dst.data(), src.data(), src.nbytes());
      return;
    }
    const std::size_t width = static_cast<std::size_t>(src.size(1)) * esize;
    for (std::int64_t r = 0; r < src.size(0); ++r)
      std::memcpy(static_cast<unsigned char*>(dst.data()) + static_cast<std::size_t>(r * ld_dst) * esize,
                  static_cast<const unsigned char*>(src.data()) + static_cast<std::size_t>(r * ld_src) * esize, width);
    return;
  }
#if FUSEKIT_WITH_CUDA
  const cudaStream_t s = stream != nullptr ? static_cast<cudaStream_t>(stream->handle()) : nullptr;
  cudaError_t e = cudaSuccess;
  if (!rows) {
    e = stream != nullptr ? cudaMemcpyAsync(dst.data(), src.data(), src.nbytes(), cudaMemcpyDefault, s)
                          : cudaMemcpy(dst.data(), src.data(), src.nbytes(), cudaMemcpyDefault);
  } else {
    const std::size_t width = static_cast<std::size_t>(src.size(1)) * esize;
    const std::size_t dpitch = static_cast<std::size_t>(ld_dst) * esize, spitch = static_cast<std::size_t>(ld_src) * esize;
    const std::size_t height = static_cast<std::size_t>(src.size(0));
    e = stream != nullptr ? cudaMemcpy2DAsync(dst.data(), dpitch, src.data(), spitch, width, height, cudaMemcpyDefault, s)
                          : cudaMemcpy2D(dst.data(), dpitch, src.data(), spitch, width, height, cudaMemcpyDefault);
  }
  if (e != cudaSuccess) throw_copy_failure(e, dst, src, stream != nullptr);
#else
  throw Error("copy", "src", "host tensors (fusekit was built without CUDA)", src.str());
#endif
}

}  // namespace

void copy(const TensorView& dst, const TensorView& src) { copy_impl(dst, src, nullptr); }

void copy_async(const TensorView& dst, const TensorView& src, const Stream& stream) { copy_impl(dst, src, &stream); }

void zero_async(const TensorView& t, const Stream& stream) {
  FK_CHECK_ARG(t.is_contiguous(), "zero_async", "t", "a contiguous tensor", t.str());
  if (t.numel() == 0) return;
  if (t.device().is_cpu()) {
    stream.synchronize();
    std::memset(t.data(), 0, t.nbytes());
    return;
  }
#if FUSEKIT_WITH_CUDA
  FK_CUDA_CHECK(cudaMemsetAsync(t.data(), 0, t.nbytes(), static_cast<cudaStream_t>(stream.handle())));
#endif
}

void fill(const TensorView& t, double value) {
  FK_CHECK_ARG(t.is_contiguous(), "fill", "t", "a contiguous tensor", t.str());
  if (t.numel() == 0) return;
  std::vector<unsigned char> host;
  unsigned char* p = static_cast<unsigned char*>(t.data());
  if (t.device().is_cuda()) {
    host.resize(t.nbytes());
    p = host.data();
  }
  visit_dtype(t.dtype(), [&](auto zero) {
    using T = decltype(zero);
    T v{};
    if constexpr (std::is_integral_v<T>) v = static_cast<T>(value);
    else v = T(static_cast<float>(value));
    auto* q = reinterpret_cast<T*>(p);
    for (std::int64_t i = 0; i < t.numel(); ++i) q[i] = v;
  });
  if (t.device().is_cuda()) copy(t, TensorView(host.data(), t.dtype(), t.shape(), Device::cpu()));
}

}  // namespace fk
