// The glu family's bindings: GEMM fused with a gated activation, forward and backward.
#include <nanobind/stl/string.h>

#include <string>

#include "bindings.hpp"
#include "fusekit/ops/glu.hpp"
#include "fusekit/ops/pointwise.hpp"

namespace fk::py {

using namespace nb::literals;

void bind_glu(nb::module_& m) {
  m.def(
      "glu_forward",
      [](const Array& x, const Array& w, const OptArray& bias, const Array& out, const OptArray& preact,
         const std::string& kind, bool allow_tf32, std::uintptr_t stream) {
        constexpr const char* op = "glu_forward";
        const GluForwardArgs a{view(x, op, "x"),     view(w, op, "w"),          view(bias, op, "bias"),
                               view(out, op, "out"), view(preact, op, "preact")};
        glu_forward(a, {parse_glu_kind(kind), allow_tf32}, StreamArg(stream, a.x).get());
      },
      "x"_a, "w"_a, "bias"_a.none(), "out"_a, "preact"_a.none(), "kind"_a, "allow_tf32"_a, "stream"_a, kNoGil);
  m.def(
      "glu_backward",
      [](const Array& dy, const Array& x, const Array& w, const OptArray& bias, const OptArray& dx,
         const OptArray& dw, const OptArray& dbias, const std::string& kind, bool allow_tf32, std::uintptr_t stream) {
        constexpr const char* op = "glu_backward";
        const GluBackwardArgs a{view(dy, op, "dy"), view(x, op, "x"),   view(w, op, "w"),
                                view(bias, op, "bias"), view(dx, op, "dx"), view(dw, op, "dw"),
                                view(dbias, op, "dbias")};
        glu_backward(a, {parse_glu_kind(kind), allow_tf32}, StreamArg(stream, a.dy).get());
      },
      "dy"_a, "x"_a, "w"_a, "bias"_a.none(), "dx"_a.none(), "dw"_a.none(), "dbias"_a.none(), "kind"_a,
      "allow_tf32"_a, "stream"_a, kNoGil);
  m.def(
      "glu_activate",
      [](const Array& preact, const Array& out, const std::string& kind, std::uintptr_t stream) {
        constexpr const char* op = "glu_activate";
        const GluActivateArgs a{view(preact, op, "preact"), view(out, op, "out")};
        glu_activate(a, {parse_glu_kind(kind), false}, StreamArg(stream, a.preact).get());
      },
      "preact"_a, "out"_a, "kind"_a, "stream"_a, kNoGil);
  m.def(
      "glu_preact_grad",
      [](const Array& dy, const Array& preact, const Array& dpreact, const OptArray& out, const std::string& kind,
         std::uintptr_t stream) {
        constexpr const char* op = "glu_preact_grad";
        const GluPreactGradArgs a{view(dy, op, "dy"), view(preact, op, "preact"), view(dpreact, op, "dpreact"),
                                  view(out, op, "out")};
        glu_preact_grad(a, {parse_glu_kind(kind), false}, StreamArg(stream, a.preact).get());
      },
      "dy"_a, "preact"_a, "dpreact"_a, "out"_a.none(), "kind"_a, "stream"_a, kNoGil);
  m.def(
      "glu_backward_from_preact",
      [](const Array& dy, const Array& x, const Array& w, const Array& preact, const OptArray& dx, const OptArray& dw,
         const OptArray& dbias, bool overwrite_preact, const OptArray& out, const std::string& kind, bool allow_tf32,
         std::uintptr_t stream, const OptArray& down_w) {
        constexpr const char* op = "glu_backward_from_preact";
        const GluBackwardFromPreactArgs a{view(dy, op, "dy"),         view(x, op, "x"),   view(w, op, "w"),
                                          view(preact, op, "preact"), view(dx, op, "dx"), view(dw, op, "dw"),
                                          view(dbias, op, "dbias"),   overwrite_preact,   view(out, op, "out"),
                                          view(down_w, op, "down_w")};
        glu_backward_from_preact(a, {parse_glu_kind(kind), allow_tf32}, StreamArg(stream, a.dy).get());
      },
      "dy"_a, "x"_a, "w"_a, "preact"_a, "dx"_a.none(), "dw"_a.none(), "dbias"_a.none(), "overwrite_preact"_a,
      "out"_a.none(), "kind"_a, "allow_tf32"_a, "stream"_a, "down_w"_a.none() = nb::none(), kNoGil);
}

}  // namespace fk::py
