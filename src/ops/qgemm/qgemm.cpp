// Dispatch of the qgemm family: argument checks, then the CPU spec or the CUDA kernels.
#include "fusekit/ops/qgemm.hpp"

#include <cstring>

#include "fusekit/core/stream.hpp"
#include "ops/common/op_checks.hpp"
#include "ops/common/reference_io.hpp"
#include "qgemm_cuda.hpp"
#include "qgemm_layout.hpp"

namespace fk {
namespace {

constexpr std::initializer_list<DType> kHalfTypes = {DType::f16, DType::bf16};

void sync(const Stream* stream) { (stream ? *stream : Stream::default_stream()).synchronize(); }

// Every part of qw is consistent with its metadata, on one device.
void check_weight(const char* op, const QuantizedWeight& qw) {
  FK_CHECK_ARG(qw.n >= 1 && qw.k >= 1 && qw.group >= 1 && (qw.k % qw.group == 0 || qw.group == qw.k), op, "qw",
               "a quantized [N >= 1, K >= 1] weight whose group divides K",
               fmt::format("[{}, {}], group {}", qw.n, qw.k, qw.group));
  FK_CHECK_ARG(qw.dtype == DType::f16 || qw.dtype == DType::bf16, op, "qw", "an f16 or bf16 weight",
               std::string(dtype_name(qw.dtype)));
  checks::tensor(op, "qw.packed", qw.packed, 4);
  checks::dtype_in(op, "qw.packed", qw.packed, {DType::i32});
  checks::shape_is(op, "qw.packed", qw.packed, Dims{qw.k_pad() / 64, qw.n_pad() / 16, 32, 4});
  checks::tensor(op, "qw.scale", qw.scale, 2);
  checks::dtype_in(op, "qw.scale", qw.scale, {qw.dtype});
  checks::shape_is(op, "qw.scale", qw.scale, Dims{qw.groups(), qw.n_pad()});
  checks::tensor(op, "qw.zero", qw.zero, 2);
  checks::dtype_in(op, "qw.zero", qw.zero, {DType::i32});
  checks::shape_is(op, "qw.zero", qw.zero, Dims{qw.groups(), qw.n_pad() / 8});
  checks::same_device(op, "qw.scale", qw.scale, qw.packed.device());
  checks::same_device(op, "qw.zero", qw.zero, qw.packed.device());
  checks::cuda_available(op, qw.packed.device());
}

}  // namespace

QuantizedWeight QuantizedWeight::zeros(std::int64_t n, std::int64_t k, int group, DType dtype, Device device) {
  QuantizedWeight qw;
  qw.n = n;
  qw.k = k;
  qw.group = group;
  qw.dtype = dtype;
  qw.packed = Tensor::empty({qw.k_pad() / 64, qw.n_pad() / 16, 32, 4}, DType::i32, Device::cpu());
  qw.scale = Tensor::empty({qw.groups(), qw.n_pad()}, dtype, Device::cpu());
  qw.zero = Tensor::empty({qw.groups(), qw.n_pad() / 8}, DType::i32, Device::cpu());
  for (const Tensor* t : {&qw.packed, &qw.scale, &qw.zero}) std::memset(t->data(), 0, t->nbytes());
  return device.is_cpu() ? std::move(qw) : qw.copy_to(device);
}

QuantizedWeight QuantizedWeight::copy_to(Device device) const {
  QuantizedWeight qw;
  qw.n = n;
  qw.k = k;
  qw.group = group;
  qw.dtype = dtype;
  qw.packed = packed.copy_to(device);
  qw.scale = scale.copy_to(device);
  qw.zero = zero.copy_to(device);
  return qw;
}

QuantizedWeight quantize_weights(const TensorView& w, int group, const Stream* stream) {
  constexpr const char* op = "quantize_weights";
  checks::tensor(op, "w", w, 2);
  checks::dtype_in(op, "w", w, kHalfTypes);
  checks::cuda_available(op, w.device());
  FK_CHECK_ARG(w.size(0) >= 1 && w.size(1) >= 1, op, "w", "a non-empty [N, K] weight", w.shape().str());
  const std::int64_t k = w.size(1);
  FK_CHECK_ARG(group == 32 || group == 64 || group == 128 || group == k, op, "group",
               fmt::format("32, 64, 128 or K (= {})", k), std::to_string(group));
  FK_CHECK_ARG(k % group == 0, op, "group", fmt::format("a divisor of K (= {}); use group = K for one group per row", k),
               std::to_string(group));
  if (w.device().is_cpu()) return reference::quantize_weights(w, group);
  // A one-time step at model load: through the host, then the packed weight goes back to w's device.
  sync(stream);
  Tensor host = Tensor::empty(w.shape(), w.dtype(), Device::cpu());
  copy(host.view(), w);
  return reference::quantize_weights(host.view(), group).copy_to(w.device());
}

void dequantize_weights(const QuantizedWeight& qw, const TensorView& out, const Stream* stream) {
  constexpr const char* op = "dequantize_weights";
  check_weight(op, qw);
  checks::tensor(op, "out", out, 2);
  checks::dtype_in(op, "out", out, {qw.dtype});
  checks::shape_is(op, "out", out, Dims{qw.n, qw.k});
  checks::same_device(op, "out", out, qw.device());
  if (out.device().is_cpu()) return reference::dequantize_weights(qw, out);
#if FUSEKIT_WITH_CUDA
  cuda::dequantize_weights(qw, out, stream);
#else
  (void)stream;
#endif
}

Tensor dequantize_weights(const QuantizedWeight& qw, const Stream* stream) {
  check_weight("dequantize_weights", qw);
  Tensor t = Tensor::empty({qw.n, qw.k}, qw.dtype, qw.device(), stream);
  dequantize_weights(qw, t, stream);
  return t;
}

QuantizedWeight from_puzzle_layout(const TensorView& weight, const TensorView& scale, const TensorView& shift,
                                   int group, DType dtype) {
  constexpr const char* op = "from_puzzle_layout";
  checks::tensor(op, "weight", weight, 2);
  checks::dtype_in(op, "weight", weight, {DType::i32});
  checks::same_device(op, "weight", weight, Device::cpu());
  const std::int64_t n = weight.size(0), k = weight.size(1) * 8;
  FK_CHECK_ARG(n >= 1 && k >= 1, op, "weight", "a non-empty [N, K / 8] tensor", weight.shape().str());
  FK_CHECK_ARG(group >= 8 && group % 8 == 0 && k % group == 0, op, "group",
               fmt::format("a multiple of 8 that divides K (= {})", k), std::to_string(group));
  FK_CHECK_ARG(dtype == DType::f16 || dtype == DType::bf16, op, "dtype", "f16 or bf16",
               std::string(dtype_name(dtype)));
  const std::int64_t groups = k / group;
  checks::tensor(op, "scale", scale, 2);
  checks::dtype_in(op, "scale", scale, {DType::f32, DType::f16, DType::bf16});
  checks::shape_is(op, "scale", scale, Dims{n, groups});
  checks::same_device(op, "scale", scale, Device::cpu());
  checks::tensor(op, "shift", shift, 2);
  checks::dtype_in(op, "shift", shift, {DType::i32});
  checks::shape_is(op, "shift", shift, Dims{n, (groups + 7) / 8});
  checks::same_device(op, "shift", shift, Device::cpu());
  QuantizedWeight qw = QuantizedWeight::zeros(n, k, group, dtype, Device::cpu());
  const std::int64_t n_pad = qw.n_pad();
  const auto* wsrc = weight.data_as<const std::uint32_t>();
  const auto* zsrc = shift.data_as<const std::uint32_t>();
  auto* words = qw.packed.data_as<std::uint32_t>();
  auto* zeros = qw.zero.data_as<std::uint32_t>();
  for (std::int64_t r = 0; r < n; ++r) {
    for (std::int64_t g = 0; g < groups; ++g) {
      reference::store(qw.scale, g * n_pad + r, reference::load(scale, r * groups + g));
      const std::uint32_t z = (zsrc[r * shift.size(1) + g / 8] >> (4 * (g % 8))) & 0xFu;
      zeros[g * (n_pad / 8) + r / 8] |= z << (4 * (r % 8));
    }
    for (std::int64_t c = 0; c < k; ++c) {
      const std::uint32_t q = (wsrc[r * (k / 8) + c / 8] >> (4 * (c % 8))) & 0xFu;
      const qgemm_layout::Slot sl = qgemm_layout::slot_of(r, c, n_pad);
      words[sl.word] |= q << sl.shift;
    }
  }
  return qw;
}

void qgemm(const TensorView& x, const QuantizedWeight& qw, const TensorView& y, const Stream* stream,
           const QgemmOptions& options) {
  constexpr const char* op = "qgemm";
  check_weight(op, qw);
  checks::tensor(op, "x", x, 2);
  checks::dtype_in(op, "x", x, {qw.dtype});
  FK_CHECK_ARG(x.size(1) == qw.k, op, "x", fmt::format("[M, {}] (K of the weight)", qw.k), x.shape().str());
  checks::same_device(op, "x", x, qw.device());
  checks::tensor(op, "y", y, 2);
  checks::dtype_in(op, "y", y, {qw.dtype});
  checks::shape_is(op, "y", y, Dims{x.size(0), qw.n});
  checks::same_device(op, "y", y, qw.device());
  if (y.numel() == 0) return;
  if (y.device().is_cpu()) return reference::qgemm(x, qw, y);
  FK_CHECK_ARG(qw.k % 8 == 0, op, "qw", "K a multiple of 8 on CUDA (16-byte rows of x)", std::to_string(qw.k));
  FK_CHECK_ARG(qw.group % 32 == 0 || qw.group == qw.k, op, "qw",
               "group a multiple of 32, or K, on CUDA (re-quantize with quantize_weights, or run on the CPU)",
               std::to_string(qw.group));
  FK_CHECK_ARG(reinterpret_cast<std::uintptr_t>(x.data()) % 16 == 0, op, "x", "16-byte aligned data",
               "a misaligned pointer");
  FK_CHECK_ARG(x.size(0) <= 65535 * 128, op, "x", "at most 8388480 rows", x.shape().str());
  for (const Tensor* t : {&qw.packed, &qw.scale, &qw.zero})
    FK_CHECK_ARG(reinterpret_cast<std::uintptr_t>(t->data()) % 16 == 0, op, "qw",
                 "16-byte aligned packed, scale and zero (the kernel copies them in 16-byte units)",
                 "a misaligned pointer");
#if FUSEKIT_WITH_CUDA
  cuda::qgemm(x, qw, y, stream, cuda::QgemmPath::automatic, options);
#else
  (void)stream;
  (void)options;
#endif
}

Tensor qgemm(const TensorView& x, const QuantizedWeight& qw, const Stream* stream, const QgemmOptions& options) {
  checks::tensor("qgemm", "x", x, 2);
  Tensor y = Tensor::empty({x.size(0), qw.n}, qw.dtype, qw.device(), stream);
  qgemm(x, qw, y, stream, options);
  return y;
}

}  // namespace fk
