// The norm family's bindings: RMSNorm (and the residual add fused in front of it), forward and
// backward.
#include "bindings.hpp"
#include "fusekit/ops/norm.hpp"

namespace fk::py {

using namespace nb::literals;

void bind_norm(nb::module_& m) {
  m.def(
      "rms_norm_forward",
      [](const Array& x, const OptArray& residual, const Array& weight, const Array& out, const OptArray& residual_out,
         const Array& rstd, float eps, float offset, std::uintptr_t stream) {
        const char* op = residual ? "add_rms_norm_forward" : "rms_norm_forward";
        const RmsNormForwardArgs a{view(x, op, "x"),           view(residual, op, "residual"),
                                   view(weight, op, "weight"), view(out, op, "out"),
                                   view(residual_out, op, "residual_out"), view(rstd, op, "rstd")};
        rms_norm_forward(a, {eps, offset}, StreamArg(stream, a.x).get());
      },
      "x"_a, "residual"_a.none(), "weight"_a, "out"_a, "residual_out"_a.none(), "rstd"_a, "eps"_a, "offset"_a,
      "stream"_a, kNoGil);
  m.def(
      "rms_norm_backward",
      [](const Array& dout, const OptArray& dresidual_out, const Array& s, const Array& weight, const Array& rstd,
         const Array& dx, const OptArray& dweight, float offset, std::uintptr_t stream, const OptArray& dx_low) {
        constexpr const char* op = "rms_norm_backward";
        const RmsNormBackwardArgs a{view(dout, op, "dout"), view(dresidual_out, op, "dresidual_out"),
                                    view(s, op, "s"),       view(weight, op, "weight"),
                                    view(rstd, op, "rstd"), view(dx, op, "dx"),
                                    view(dweight, op, "dweight"), view(dx_low, op, "dx_low")};
        rms_norm_backward(a, {0.0f, offset}, StreamArg(stream, a.s).get());
      },
      "dout"_a, "dresidual_out"_a.none(), "s"_a, "weight"_a, "rstd"_a, "dx"_a, "dweight"_a.none(), "offset"_a,
      "stream"_a, "dx_low"_a.none() = nb::none(), kNoGil);
}

}  // namespace fk::py
