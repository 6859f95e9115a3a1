// The qgemm family's bindings: 4-bit weight quantization and the conversion of weights quantized
// elsewhere (both on the host, handed out through DLPack), dequantization and the weight-only
// quantized matmul (x [..., K] and y [..., N], contiguous, taken as [rows, K] and [rows, N]).
#include <nanobind/stl/string.h>

#include <string>

#include "bindings.hpp"
#include "fusekit/ops/qgemm.hpp"

namespace fk::py {

using namespace nb::literals;

namespace {

// A host fusekit tensor handed out through DLPack (torch.from_dlpack takes it without a copy).
nb::ndarray<> to_array(Tensor t) {
  auto* held = new Tensor(std::move(t));
  nb::capsule owner(held, [](void* p) noexcept { delete static_cast<Tensor*>(p); });
  const TensorView v = held->view();
  nb::dlpack::dtype dt{};
  switch (v.dtype()) {
    case DType::f16: dt = nb::dtype<std::uint16_t>(); dt.code = static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float); break;
    case DType::bf16: dt = nb::dtype<std::uint16_t>(); dt.code = static_cast<std::uint8_t>(nb::dlpack::dtype_code::Bfloat); break;
    case DType::f32: dt = nb::dtype<float>(); break;
    case DType::i32: dt = nb::dtype<std::int32_t>(); break;
    default: throw Error("to_array", "t", "f16, bf16, f32 or i32", std::string(dtype_name(v.dtype())));
  }
  return nb::ndarray<>(held->data(), static_cast<std::size_t>(v.rank()),
                       reinterpret_cast<const std::size_t*>(v.shape().begin()), owner, v.strides().begin(), dt,
                       nb::device::cpu::value, 0);
}

QuantizedWeight quantized_view(const Array& packed, const Array& scale, const Array& zero, std::int64_t n,
                               std::int64_t k, int group, const char* op) {
  const auto borrow = [](const TensorView& v) { return Tensor::adopt(v, [] {}); };
  QuantizedWeight qw;
  qw.packed = borrow(view(packed, op, "packed"));
  qw.scale = borrow(view(scale, op, "scale"));
  qw.zero = borrow(view(zero, op, "zero"));
  qw.n = n;
  qw.k = k;
  qw.group = group;
  qw.dtype = qw.scale.dtype();
  return qw;
}

// A contiguous [..., C] (rank 1 or more) as the [rows, C] view the op takes, so that a caller
// need not reshape a decode step's [B, 1, C] activations (two PyTorch calls, about a microsecond
// each); any other view unchanged, for the op's own checks to name.
TensorView as_rows(const TensorView& v) {
  if (v.rank() == 0 || v.rank() == 2 || !v.is_contiguous()) return v;
  std::int64_t rows = 1;
  for (int i = 0; i + 1 < v.rank(); ++i) rows *= v.size(i);
  return v.reshape(Dims{rows, v.size(-1)});
}

}  // namespace

void bind_qgemm(nb::module_& m) {
  m.def(
      "quantize_weights",
      [](const Array& w, int group) {
        const TensorView wv = view(w, "quantize_weights", "w");
        FK_CHECK_ARG(wv.device().is_cpu(), "quantize_weights", "w", "a host tensor (quantization runs on the host)",
                     wv.device().str());
        QuantizedWeight qw;
        {
          nb::gil_scoped_release unlocked;
          qw = quantize_weights(wv, group);
        }
        return nb::make_tuple(to_array(std::move(qw.packed)), to_array(std::move(qw.scale)),
                              to_array(std::move(qw.zero)));
      },
      "w"_a, "group"_a);
  m.def(
      "from_puzzle_layout",
      [](const Array& weight, const Array& scale, const Array& shift, int group, const std::string& dtype) {
        constexpr const char* op = "from_puzzle_layout";
        const TensorView wv = view(weight, op, "weight"), sv = view(scale, op, "scale"), zv = view(shift, op, "shift");
        const DType dt = parse_dtype(dtype);
        QuantizedWeight qw;
        {
          nb::gil_scoped_release unlocked;
          qw = from_puzzle_layout(wv, sv, zv, group, dt);
        }
        return nb::make_tuple(to_array(std::move(qw.packed)), to_array(std::move(qw.scale)),
                              to_array(std::move(qw.zero)));
      },
      "weight"_a, "scale"_a, "shift"_a, "group"_a, "dtype"_a);
  m.def(
      "dequantize_weights",
      [](const Array& packed, const Array& scale, const Array& zero, std::int64_t n, std::int64_t k, int group,
         const Array& out, std::uintptr_t stream) {
        const QuantizedWeight qw = quantized_view(packed, scale, zero, n, k, group, "dequantize_weights");
        dequantize_weights(qw, view(out, "dequantize_weights", "out"), StreamArg(stream, qw.packed.view()).get());
      },
      "packed"_a, "scale"_a, "zero"_a, "n"_a, "k"_a, "group"_a, "out"_a, "stream"_a, kNoGil);
  m.def(
      "qgemm",
      [](const Array& x, const Array& packed, const Array& scale, const Array& zero, std::int64_t n, std::int64_t k,
         int group, const Array& y, std::uintptr_t stream, bool constant_weights) {
        const TensorView xv = as_rows(view(x, "qgemm", "x"));
        const QuantizedWeight qw = quantized_view(packed, scale, zero, n, k, group, "qgemm");
        qgemm(xv, qw, as_rows(view(y, "qgemm", "y")), StreamArg(stream, xv).get(),
              QgemmOptions{.constant_weights = constant_weights});
      },
      "x"_a, "packed"_a, "scale"_a, "zero"_a, "n"_a, "k"_a, "group"_a, "y"_a, "stream"_a,
      "constant_weights"_a = false, kNoGil);
}

}  // namespace fk::py
