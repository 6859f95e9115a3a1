// The lora family's bindings: the fused LoRA linear, forward and backward.
#include <nanobind/stl/string.h>

#include <string>

#include "bindings.hpp"
#include "fusekit/ops/lora.hpp"
#include "fusekit/ops/pointwise.hpp"

namespace fk::py {

using namespace nb::literals;

void bind_lora(nb::module_& m) {
  m.def(
      "lora_forward",
      [](const Array& x, const Array& w, const OptArray& bias, const Array& a, const Array& b, const Array& y,
         const OptArray& t, const OptArray& preact, const std::string& act, float scale, std::uintptr_t stream) {
        constexpr const char* op = "lora_forward";
        const LoraForwardArgs args{view(x, op, "x"), view(w, op, "w"), view(bias, op, "bias"),
                                   view(a, op, "a"), view(b, op, "b"), view(y, op, "y"),
                                   view(t, op, "t"), view(preact, op, "preact")};
        lora_forward(args, {parse_activation(act), scale}, StreamArg(stream, args.x).get());
      },
      "x"_a, "w"_a, "bias"_a.none(), "a"_a, "b"_a, "y"_a, "t"_a.none(), "preact"_a.none(), "act"_a, "scale"_a,
      "stream"_a, kNoGil);
  m.def(
      "lora_backward",
      [](const Array& dy, const Array& saved, bool saved_is_preact, const Array& x, const Array& w, const Array& a,
         const Array& b, const OptArray& t, const OptArray& dx, const Array& da, const Array& db,
         const OptArray& dbias, const std::string& act, float scale, std::uintptr_t stream) {
        constexpr const char* op = "lora_backward";
        const LoraBackwardArgs args{view(dy, op, "dy"),
                                    view(saved, op, "saved"),
                                    saved_is_preact ? SavedForBackward::preactivation : SavedForBackward::output,
                                    view(x, op, "x"),
                                    view(w, op, "w"),
                                    view(a, op, "a"),
                                    view(b, op, "b"),
                                    view(t, op, "t"),
                                    view(dx, op, "dx"),
                                    view(da, op, "da"),
                                    view(db, op, "db"),
                                    view(dbias, op, "dbias")};
        lora_backward(args, {parse_activation(act), scale}, StreamArg(stream, args.dy).get());
      },
      "dy"_a, "saved"_a, "saved_is_preact"_a, "x"_a, "w"_a, "a"_a, "b"_a, "t"_a.none(), "dx"_a.none(), "da"_a,
      "db"_a, "dbias"_a.none(), "act"_a, "scale"_a, "stream"_a, kNoGil);
}

}  // namespace fk::py
