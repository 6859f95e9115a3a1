// The pointwise family's bindings: bias + scaled residual + activation, forward and backward, rotary
// position embedding (rope_forward / rope_backward as one function with a flag), and the conversion
// between floating dtypes.
#include <nanobind/stl/string.h>

#include <string>

#include "bindings.hpp"
#include "fusekit/ops/pointwise.hpp"

namespace fk::py {

using namespace nb::literals;

void bind_pointwise(nb::module_& m) {
  m.def(
      "bias_act_forward",
      [](const Array& x, const OptArray& r, const OptArray& bias, const Array& y, const OptArray& preact,
         const std::string& act, float alpha, std::uintptr_t stream) {
        constexpr const char* op = "bias_act_forward";
        const BiasActForwardArgs a{view(x, op, "x"), view(r, op, "r"), view(bias, op, "bias"), view(y, op, "y"),
                                   view(preact, op, "preact")};
        bias_act_forward(a, {parse_activation(act), alpha}, StreamArg(stream, a.x).get());
      },
      "x"_a, "r"_a.none(), "bias"_a.none(), "y"_a, "preact"_a.none(), "act"_a, "alpha"_a, "stream"_a, kNoGil);
  m.def(
      "bias_act_backward",
      [](const Array& dy, const Array& saved, bool saved_is_preact, const Array& dx, const OptArray& dr,
         const OptArray& dbias, const std::string& act, float alpha, std::uintptr_t stream) {
        constexpr const char* op = "bias_act_backward";
        const BiasActBackwardArgs a{view(dy, op, "dy"), view(saved, op, "saved"),
                                    saved_is_preact ? SavedForBackward::preactivation : SavedForBackward::output,
                                    view(dx, op, "dx"), view(dr, op, "dr"), view(dbias, op, "dbias")};
        bias_act_backward(a, {parse_activation(act), alpha}, StreamArg(stream, a.dy).get());
      },
      "dy"_a, "saved"_a, "saved_is_preact"_a, "dx"_a, "dr"_a.none(), "dbias"_a.none(), "act"_a, "alpha"_a,
      "stream"_a, kNoGil);
  m.def(
      "rope",
      [](const Array& q, const Array& k, const Array& cos, const Array& sin, const Array& q_out, const Array& k_out,
         bool backward, std::uintptr_t stream) {
        const char* op = backward ? "rope_backward" : "rope_forward";
        const RopeArgs a{view(q, op, "q"),        view(k, op, "k"),         view(cos, op, "cos"),
                         view(sin, op, "sin"),    view(q_out, op, "q_out"), view(k_out, op, "k_out")};
        const StreamArg s(stream, a.q);
        backward ? rope_backward(a, s.get()) : rope_forward(a, s.get());
      },
      "q"_a, "k"_a, "cos"_a, "sin"_a, "q_out"_a, "k_out"_a, "backward"_a, "stream"_a, kNoGil);
  m.def(
      "convert",
      [](const Array& src, const Array& dst, std::uintptr_t stream) {
        const TensorView s = view(src, "convert", "src");
        convert(s, view(dst, "convert", "dst"), StreamArg(stream, s).get());
      },
      "src"_a, "dst"_a, "stream"_a, kNoGil);
}

}  // namespace fk::py
