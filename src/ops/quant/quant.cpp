// Dispatch of the quant family: argument checks, then the CPU spec or the CUDA kernels.
#include "fusekit/ops/quant.hpp"

#include "ops/common/op_checks.hpp"
#include "quant_cuda.hpp"

namespace fk {
namespace {

constexpr std::initializer_list<DType> kFloatTypes = {DType::f32, DType::bf16, DType::f16};

void check_params(const char* op, const PackParams& p) {
  FK_CHECK_ARG(p.bits == 1 || p.bits == 2 || p.bits == 4 || p.bits == 8, op, "bits", "1, 2, 4 or 8",
               std::to_string(p.bits));
  const int vpw = 32 / p.bits;
  FK_CHECK_ARG(p.group > 0 && p.group % vpw == 0, op, "group",
               fmt::format("a positive multiple of {} (values per word at {} bits)", vpw, p.bits),
               std::to_string(p.group));
  FK_CHECK_ARG(p.stats_dtype == DType::bf16 || p.stats_dtype == DType::f32, op, "stats_dtype", "bf16 or f32",
               std::string(dtype_name(p.stats_dtype)));
}

// Every part of a packed view is consistent with its metadata, on one device.
void check_packed(const char* op, const char* arg, const PackedView& p) {
  FK_CHECK_ARG(p.bits == 1 || p.bits == 2 || p.bits == 4 || p.bits == 8, op, arg, "bits 1, 2, 4 or 8",
               std::to_string(p.bits));
  FK_CHECK_ARG(p.group > 0 && p.group % (32 / p.bits) == 0, op, arg,
               fmt::format("group a multiple of {}", 32 / p.bits), std::to_string(p.group));
  FK_CHECK_ARG(p.rows >= 0 && p.cols >= 0 && p.cols < (std::int64_t{1} << 31), op, arg,
               "non-negative rows and fewer than 2^31 cols", fmt::format("[{}, {}]", p.rows, p.cols));
  const std::string words = std::string(arg) + ".words", scale = std::string(arg) + ".scale",
                    min = std::string(arg) + ".min";
  checks::tensor(op, words.c_str(), p.words, 3);
  checks::dtype_in(op, words.c_str(), p.words, {DType::i32});
  checks::shape_is(op, words.c_str(), p.words, Dims{p.rows, p.groups(), p.words_per_group()});
  checks::tensor(op, scale.c_str(), p.scale, 2);
  checks::dtype_in(op, scale.c_str(), p.scale, {DType::bf16, DType::f32});
  checks::shape_is(op, scale.c_str(), p.scale, Dims{p.rows, p.groups()});
  checks::tensor(op, min.c_str(), p.min, 2);
  checks::same_dtype(op, min.c_str(), p.min, p.scale);
  checks::shape_is(op, min.c_str(), p.min, Dims{p.rows, p.groups()});
  checks::same_device(op, scale.c_str(), p.scale, p.words.device());
  checks::same_device(op, min.c_str(), p.min, p.words.device());
  checks::cuda_available(op, p.words.device());
}

}  // namespace

PackedTensor PackedTensor::empty(std::int64_t rows, std::int64_t cols, DType dtype, const PackParams& p,
                                 Device device, const Stream* stream) {
  check_params("PackedTensor::empty", p);
  PackedTensor t;
  t.rows = rows;
  t.cols = cols;
  t.dtype = dtype;
  t.bits = p.bits;
  t.group = p.group;
  const std::int64_t groups = (cols + p.group - 1) / p.group;
  t.words = Tensor::empty({rows, groups, p.group * p.bits / 32}, DType::i32, device, stream);
  t.scale = Tensor::empty({rows, groups}, p.stats_dtype, device, stream);
  t.min = Tensor::empty({rows, groups}, p.stats_dtype, device, stream);
  return t;
}

PackedView PackedTensor::view() const { return {words, scale, min, rows, cols, dtype, bits, group}; }

void pack(const TensorView& x, const PackedView& out, const PackParams& p, const Stream* stream) {
  constexpr const char* op = "pack";
  check_params(op, p);
  checks::tensor(op, "x", x, 2);
  checks::dtype_in(op, "x", x, kFloatTypes);
  check_packed(op, "out", out);
  FK_CHECK_ARG(out.rows == x.size(0) && out.cols == x.size(1), op, "out",
               fmt::format("a packed [{}, {}]", x.size(0), x.size(1)), fmt::format("[{}, {}]", out.rows, out.cols));
  FK_CHECK_ARG(out.bits == p.bits && out.group == p.group && out.scale.dtype() == p.stats_dtype, op, "out",
               fmt::format("bits {}, group {}, stats {}", p.bits, p.group, dtype_name(p.stats_dtype)),
               fmt::format("bits {}, group {}, stats {}", out.bits, out.group, dtype_name(out.scale.dtype())));
  checks::same_device(op, "out", out.words, x.device());
  if (p.offset_counter.data() != nullptr) {
    checks::tensor(op, "offset_counter", p.offset_counter, 1);
    checks::dtype_in(op, "offset_counter", p.offset_counter, {DType::i64});
    checks::shape_is(op, "offset_counter", p.offset_counter, Dims{1});
    checks::same_device(op, "offset_counter", p.offset_counter, x.device());
  }
  if (x.numel() == 0) return;
  if (x.device().is_cpu()) {
    PackParams at = p;  // the spec takes the offset by value: the counter's value now
    if (p.offset_counter.data() != nullptr) at.offset += *p.offset_counter.data_as<const std::uint64_t>();
    return reference::pack(x, out, at);
  }
#if FUSEKIT_WITH_CUDA
  cuda::pack(x, out, p, stream);
#else
  (void)stream;
#endif
}

PackedTensor pack(const TensorView& x, const PackParams& p, const Stream* stream) {
  check_params("pack", p);
  checks::tensor("pack", "x", x, 2);
  PackedTensor t = PackedTensor::empty(x.size(0), x.size(1), x.dtype(), p, x.device(), stream);
  pack(x, t.view(), p, stream);
  return t;
}

void unpack(const PackedView& packed, const TensorView& out, const Stream* stream) {
  constexpr const char* op = "unpack";
  check_packed(op, "packed", packed);
  checks::tensor(op, "out", out, 2);
  checks::dtype_in(op, "out", out, kFloatTypes);
  checks::shape_is(op, "out", out, Dims{packed.rows, packed.cols});
  checks::same_device(op, "out", out, packed.words.device());
  if (out.numel() == 0) return;
  if (out.device().is_cpu()) return reference::unpack(packed, out);
#if FUSEKIT_WITH_CUDA
  cuda::unpack(packed, out, stream);
#else
  (void)stream;
#endif
}

Tensor unpack(const PackedView& packed, DType dtype, const Stream* stream) {
  Tensor t = Tensor::empty({packed.rows, packed.cols}, dtype, packed.words.device(), stream);
  unpack(packed, t, stream);
  return t;
}

namespace {

void check_mask(const char* op, const TensorView& mask, std::int64_t numel, Device device) {
  checks::tensor(op, "mask", mask, 1);
  checks::dtype_in(op, "mask", mask, {DType::i32});
  checks::shape_is(op, "mask", mask, Dims{relu_mask_words(numel)});
  checks::same_device(op, "mask", mask, device);
}

void check_flat(const char* op, const char* arg, const TensorView& t) {
  FK_CHECK_ARG(t.is_contiguous(), op, arg, "a contiguous tensor", t.str());
  FK_CHECK_ARG(t.data() != nullptr || t.numel() == 0, op, arg, "non-null data", "a null pointer");
}

}  // namespace

void relu_forward_packed(const TensorView& x, const TensorView& y, const TensorView& mask, const Stream* stream) {
  constexpr const char* op = "relu_forward_packed";
  check_flat(op, "x", x);
  checks::dtype_in(op, "x", x, kFloatTypes);
  checks::cuda_available(op, x.device());
  check_flat(op, "y", y);
  checks::same_dtype(op, "y", y, x);
  checks::shape_is(op, "y", y, x.shape());
  checks::same_device(op, "y", y, x.device());
  check_mask(op, mask, x.numel(), x.device());
  if (x.numel() == 0) return;
  if (x.device().is_cpu()) return reference::relu_forward_packed(x, y, mask);
#if FUSEKIT_WITH_CUDA
  cuda::relu_forward_packed(x, y, mask, stream);
#else
  (void)stream;
#endif
}

void relu_backward_packed(const TensorView& dy, const TensorView& mask, const TensorView& dx, const Stream* stream) {
  constexpr const char* op = "relu_backward_packed";
  check_flat(op, "dy", dy);
  checks::dtype_in(op, "dy", dy, kFloatTypes);
  checks::cuda_available(op, dy.device());
  check_mask(op, mask, dy.numel(), dy.device());
  check_flat(op, "dx", dx);
  checks::same_dtype(op, "dx", dx, dy);
  checks::shape_is(op, "dx", dx, dy.shape());
  checks::same_device(op, "dx", dx, dy.device());
  if (dy.numel() == 0) return;
  if (dy.device().is_cpu()) return reference::relu_backward_packed(dy, mask, dx);
#if FUSEKIT_WITH_CUDA
  cuda::relu_backward_packed(dy, mask, dx, stream);
#else
  (void)stream;
#endif
}

void weight_grad_from_packed(const TensorView& dy, const PackedView& x, const TensorView& dw,
                             const WeightGradParams& p, const Stream* stream) {
  constexpr const char* op = "weight_grad_from_packed";
  checks::tensor(op, "dy", dy, 2);
  check_packed(op, "x", x);
  FK_CHECK_ARG(dy.size(0) == x.rows, op, "dy", fmt::format("{} rows (the packed x's rows)", x.rows),
               dy.shape().str());
  checks::same_device(op, "dy", dy, x.words.device());
  checks::tensor(op, "dw", dw, 2);
  checks::dtype_in(op, "dw", dw, {DType::f32, DType::bf16});
  checks::shape_is(op, "dw", dw, Dims{dy.size(1), x.cols});
  checks::same_device(op, "dw", dw, dy.device());
  FK_CHECK_ARG(p.beta == 0.0f || p.beta == 1.0f, op, "beta", "0 (overwrite) or 1 (accumulate)",
               std::to_string(p.beta));
  checks::outputs_disjoint(op, {{"dw", &dw}},
                           {{"dy", &dy}, {"x.words", &x.words}, {"x.scale", &x.scale}, {"x.min", &x.min}});
  if (dy.device().is_cpu()) {
    checks::dtype_in(op, "dy", dy, kFloatTypes);
    return reference::weight_grad_from_packed(dy, x, dw, p);
  }
  checks::dtype_in(op, "dy", dy, {DType::bf16});
#if FUSEKIT_WITH_CUDA
  cuda::weight_grad_from_packed(dy, x, dw, p, stream);
#else
  (void)stream;
#endif
}

}  // namespace fk
