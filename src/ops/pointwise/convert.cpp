// convert: checks, the spec, dispatch (see ops/pointwise.hpp).
#include <fmt/format.h>

#include "fusekit/ops/pointwise.hpp"
#include "ops/common/op_checks.hpp"
#include "ops/common/reference_io.hpp"

#if FUSEKIT_WITH_CUDA
#include "pointwise_cuda.hpp"
#endif

namespace fk {

namespace {

constexpr const char* kOp = "convert";

// The row stride of a rows view (rank 2, inner stride 1, row stride >= cols) or of a contiguous
// view seen as [numel / last, last].
std::int64_t row_stride(const char* arg, const TensorView& t) {
  if (t.is_contiguous()) return t.rank() == 0 ? 1 : t.size(t.rank() - 1);
  FK_CHECK_ARG(t.rank() == 2 && t.strides()[1] == 1 && t.strides()[0] >= t.size(1), kOp, arg,
               "a contiguous tensor or rows with inner stride 1 and a row stride >= cols", t.str());
  return t.strides()[0];
}

struct Shape2 {
  std::int64_t rows, cols, ld_src, ld_dst;
};

Shape2 check(const TensorView& src, const TensorView& dst) {
  checks::dtype_in(kOp, "src", src, checks::kFloatTypes);
  checks::dtype_in(kOp, "dst", dst, checks::kFloatTypes);
  FK_CHECK_ARG(src.shape() == dst.shape(), kOp, "dst", fmt::format("shape {}", src.shape().str()), dst.shape().str());
  checks::same_device(kOp, "dst", dst, src.device());
  const std::int64_t ld_src = row_stride("src", src), ld_dst = row_stride("dst", dst);
  for (const auto& [arg, t] : {std::pair{"src", &src}, std::pair{"dst", &dst}})
    FK_CHECK_ARG(t->data() != nullptr || t->numel() == 0, kOp, arg, "non-null data", "a null pointer");
  const std::int64_t cols = src.rank() == 0 ? 1 : src.size(src.rank() - 1);
  const std::int64_t rows = cols == 0 ? 0 : src.numel() / cols;
  FK_CHECK_ARG(!(src.numel() > 0 && checks::overlaps(src, dst)) || (src.data() == dst.data() && src.dtype() == dst.dtype()),
               kOp, "dst", "memory that does not overlap src", "an overlapping tensor");
  return {rows, cols, ld_src, ld_dst};
}

}  // namespace

namespace reference {

void convert(const TensorView& src, const TensorView& dst) {
  const Shape2 s = check(src, dst);
  for (std::int64_t r = 0; r < s.rows; ++r)
    for (std::int64_t c = 0; c < s.cols; ++c) store(dst, r * s.ld_dst + c, load(src, r * s.ld_src + c));
}

}  // namespace reference

void convert(const TensorView& src, const TensorView& dst, const Stream* stream) {
  [[maybe_unused]] const Shape2 s = check(src, dst);
  checks::cuda_available(kOp, src.device());
  if (src.device().is_cpu()) {
    if (stream != nullptr) stream->synchronize();
    reference::convert(src, dst);
    return;
  }
#if FUSEKIT_WITH_CUDA
  checks::check_stream(kOp, stream, src.device());
  cuda::convert(src, s.ld_src, dst, s.ld_dst, s.rows, s.cols, stream);
#endif
}

}  // namespace fk
