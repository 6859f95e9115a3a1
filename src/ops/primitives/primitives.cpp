// Dispatch of the primitives family: argument checks, then the CPU spec or the CUDA kernels.
#include "fusekit/ops/primitives.hpp"

#include <cstdint>
#include <functional>

#include "fusekit/core/stream.hpp"
#include "ops/op_checks.hpp"
#include "primitives_cuda.hpp"

namespace fk {
namespace {

constexpr std::initializer_list<DType> kFloatTypes = {DType::f32, DType::bf16, DType::f16};

bool overlaps(const TensorView& x, const TensorView& y) {
  if (x.numel() == 0 || y.numel() == 0) return false;
  const auto* x0 = static_cast<const unsigned char*>(x.data());
  const auto* y0 = static_cast<const unsigned char*>(y.data());
  // std::less gives a total order on unrelated pointers, where < would be unspecified.
  return std::less<>{}(x0, y0 + y.nbytes()) && std::less<>{}(y0, x0 + x.nbytes());
}

}  // namespace

void batched_matmul(const TensorView& a, const TensorView& b, const TensorView& c, BatchedMatmulImpl impl,
                    const Stream* stream) {
  constexpr const char* op = "batched_matmul";
  checks::tensor(op, "a", a, 3);
  checks::dtype_in(op, "a", a, kFloatTypes);
  const Device dev = a.device();
  checks::cuda_available(op, dev);
  const std::int64_t batch = a.size(0), m = a.size(1), k = a.size(2);

  checks::tensor(op, "b", b, 3);
  checks::same_dtype(op, "b", b, a);
  FK_CHECK_ARG(b.size(0) == batch && b.size(1) == k, op, "b", fmt::format("shape [{}, {}, N]", batch, k),
               b.shape().str());
  checks::same_device(op, "b", b, dev);
  const std::int64_t n = b.size(2);

  checks::tensor(op, "c", c, 3);
  if (a.dtype() == DType::f32)
    checks::dtype_in(op, "c", c, {DType::f32});
  else
    checks::dtype_in(op, "c", c, {DType::f32, a.dtype()});
  checks::shape_is(op, "c", c, Dims{batch, m, n});
  checks::same_device(op, "c", c, dev);
  FK_CHECK_ARG(!overlaps(c, a) && !overlaps(c, b), op, "c", "memory that overlaps neither a nor b",
               "an overlapping tensor");

  // Checked on every device, so that a call is valid or not whatever device its tensors are on.
  FK_CHECK_ARG(impl == BatchedMatmulImpl::cublas || a.dtype() != DType::f32, op, "impl",
               "cublas for f32 operands (the CuTe kernel takes bf16 or f16)", "cute");
  // The legacy default stream (null) belongs to whichever device is current; an owned stream to one.
  if (stream && stream->handle() && dev.is_cuda())
    FK_CHECK_ARG(stream->device() == dev, op, "stream", fmt::format("a stream on {}", dev.str()),
                 fmt::format("a stream on {}", stream->device().str()));

  if (c.numel() == 0) return;
  if (dev.is_cpu()) return reference::batched_matmul(a, b, c);
#if FUSEKIT_WITH_CUDA
  if (impl == BatchedMatmulImpl::cute)
    cuda::batched_matmul_cute(a, b, c, stream);
  else
    cuda::batched_matmul_cublas(a, b, c, stream);
#else
  (void)stream;
#endif
}

}  // namespace fk
