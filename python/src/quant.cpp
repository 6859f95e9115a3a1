// The quant family's bindings: group-wise pack and unpack, the ReLU that packs its mask and its
// backward, and the weight gradient straight from packed activations. A packed tensor crosses as its
// three arrays and the numbers that describe them.
#include <nanobind/stl/string.h>

#include <string>

#include "bindings.hpp"
#include "fusekit/ops/quant.hpp"

namespace fk::py {

using namespace nb::literals;

namespace {

PackedView packed_view(const Array& words, const Array& scale, const Array& min, std::int64_t rows, std::int64_t cols,
                       const std::string& dtype, int bits, int group, const char* op) {
  return PackedView{view(words, op, "words"), view(scale, op, "scale"), view(min, op, "min"), rows, cols,
                    parse_dtype(dtype), bits, group};
}

}  // namespace

void bind_quant(nb::module_& m) {
  m.def(
      "pack",
      [](const Array& x, const Array& words, const Array& scale, const Array& min, int bits, int group,
         bool stochastic, std::uint64_t seed, std::uint64_t offset, std::uintptr_t stream) {
        constexpr const char* op = "pack";
        const TensorView xv = view(x, op, "x");
        FK_CHECK_ARG(xv.rank() == 2, op, "x", "a matrix [rows, cols]", xv.shape().str());
        const PackedView out = packed_view(words, scale, min, xv.size(0), xv.size(1),
                                           std::string(dtype_name(xv.dtype())), bits, group, op);
        const PackParams p{bits, group, stochastic ? Rounding::stochastic : Rounding::nearest, seed, offset,
                           out.scale.dtype()};
        pack(xv, out, p, StreamArg(stream, xv).get());
      },
      "x"_a, "words"_a, "scale"_a, "min"_a, "bits"_a, "group"_a, "stochastic"_a, "seed"_a, "offset"_a, "stream"_a,
      kNoGil);
  m.def(
      "unpack",
      [](const Array& words, const Array& scale, const Array& min, std::int64_t rows, std::int64_t cols, int bits,
         int group, const Array& out, std::uintptr_t stream) {
        const TensorView o = view(out, "unpack", "out");
        const PackedView pv =
            packed_view(words, scale, min, rows, cols, std::string(dtype_name(o.dtype())), bits, group, "unpack");
        unpack(pv, o, StreamArg(stream, o).get());
      },
      "words"_a, "scale"_a, "min"_a, "rows"_a, "cols"_a, "bits"_a, "group"_a, "out"_a, "stream"_a, kNoGil);
  m.def(
      "relu_forward_packed",
      [](const Array& x, const Array& y, const Array& mask, std::uintptr_t stream) {
        constexpr const char* op = "relu_forward_packed";
        const TensorView xv = view(x, op, "x");
        relu_forward_packed(xv, view(y, op, "y"), view(mask, op, "mask"), StreamArg(stream, xv).get());
      },
      "x"_a, "y"_a, "mask"_a, "stream"_a, kNoGil);
  m.def(
      "relu_backward_packed",
      [](const Array& dy, const Array& mask, const Array& dx, std::uintptr_t stream) {
        constexpr const char* op = "relu_backward_packed";
        const TensorView d = view(dy, op, "dy");
        relu_backward_packed(d, view(mask, op, "mask"), view(dx, op, "dx"), StreamArg(stream, d).get());
      },
      "dy"_a, "mask"_a, "dx"_a, "stream"_a, kNoGil);
  m.def(
      "weight_grad_from_packed",
      [](const Array& dy, const Array& words, const Array& scale, const Array& min, std::int64_t rows,
         std::int64_t cols, const std::string& x_dtype, int bits, int group, const Array& dw, float beta,
         std::uintptr_t stream) {
        constexpr const char* op = "weight_grad_from_packed";
        const TensorView d = view(dy, op, "dy");
        const PackedView x = packed_view(words, scale, min, rows, cols, x_dtype, bits, group, op);
        weight_grad_from_packed(d, x, view(dw, op, "dw"), {.beta = beta}, StreamArg(stream, d).get());
      },
      "dy"_a, "words"_a, "scale"_a, "min"_a, "rows"_a, "cols"_a, "x_dtype"_a, "bits"_a, "group"_a, "dw"_a, "beta"_a,
      "stream"_a, kNoGil);
}

}  // namespace fk::py
