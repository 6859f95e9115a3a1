// convert: checks, the spec, dispatch (see ops/pointwise.hpp).
#include <fmt/format.h>

#include <utility>

#include "fusekit/ops/pointwise.hpp"
#include "ops/common/op_checks.hpp"
#include "ops/common/reference_io.hpp"
#include "pointwise_walk.hpp"

#if FUSEKIT_WITH_CUDA
#include "pointwise_cuda.hpp"
#endif

namespace fk {

namespace {

constexpr const char* kOp = "convert";

// A view convert walks: rank <= 4, stride 1 on the last dimension, non-negative strides; an output's
// elements distinct. As rows: the leading dimensions (up to 3) over the last one.
ConvertWalk walk_of(const char* arg, const TensorView& t, bool output) {
  ConvertWalk w{};
  w.cols = t.rank() == 0 ? 1 : t.size(t.rank() - 1);
  if (t.is_contiguous()) {
    w.n[2] = w.cols == 0 ? 0 : t.numel() / w.cols;
    w.s[2] = w.cols;
    return w;
  }
  bool ok = t.rank() <= 4 && (t.strides()[t.rank() - 1] == 1 || t.size(t.rank() - 1) == 1);
  for (int i = 0; i < t.rank(); ++i) ok = ok && t.strides()[i] >= 0;
  FK_CHECK_ARG(ok && (!output || checks::distinct_elements(t)), kOp, arg,
               output ? "rank <= 4, stride 1 on the last dimension, non-negative strides, no two elements in one place"
                      : "rank <= 4, stride 1 on the last dimension, non-negative strides",
               t.str());
  const int lead = t.rank() - 1, skip = 3 - lead;  // leading dimensions right-aligned in n[], s[]
  for (int i = 0; i < lead; ++i) {
    w.n[skip + i] = t.size(i);
    w.s[skip + i] = t.strides()[i];
  }
  return w;
}

struct Walks {
  ConvertWalk src, dst;
  std::int64_t rows() const { return src.n[0] * src.n[1] * src.n[2]; }
};

Walks check(const TensorView& src, const TensorView& dst) {
  checks::dtype_in(kOp, "src", src, checks::kFloatTypes);
  checks::dtype_in(kOp, "dst", dst, checks::kFloatTypes);
  FK_CHECK_ARG(src.shape() == dst.shape(), kOp, "dst", fmt::format("shape {}", src.shape().str()), dst.shape().str());
  checks::same_device(kOp, "dst", dst, src.device());
  const Walks w{walk_of("src", src, false), walk_of("dst", dst, true)};
  for (const auto& [arg, t] : {std::pair{"src", &src}, std::pair{"dst", &dst}})
    FK_CHECK_ARG(t->data() != nullptr || t->numel() == 0, kOp, arg, "non-null data", "a null pointer");
  FK_CHECK_ARG(!(src.numel() > 0 && checks::overlaps(src, dst)) ||
                   (src.data() == dst.data() && src.dtype() == dst.dtype() && src.strides() == dst.strides()),
               kOp, "dst", "memory that does not overlap src", "an overlapping tensor");
  return w;
}

}  // namespace

namespace reference {

void convert(const TensorView& src, const TensorView& dst) {
  const Walks w = check(src, dst);
  for (std::int64_t r = 0; r < w.rows(); ++r) {
    const std::int64_t from = w.src.row(r), to = w.dst.row(r);
    for (std::int64_t c = 0; c < w.src.cols; ++c) store(dst, to + c, load(src, from + c));
  }
}

}  // namespace reference

void convert(const TensorView& src, const TensorView& dst, const Stream* stream) {
  [[maybe_unused]] const Walks w = check(src, dst);
  checks::cuda_available(kOp, src.device());
  if (src.device().is_cpu()) {
    if (stream != nullptr) stream->synchronize();
    reference::convert(src, dst);
    return;
  }
#if FUSEKIT_WITH_CUDA
  checks::check_stream(kOp, stream, src.device());
  cuda::convert(src, w.src, dst, w.dst, stream);
#endif
}

}  // namespace fk
