// The loss family's bindings: the LM head's linear fused with cross-entropy, its gradients in the
// same pass.
#include <nanobind/stl/string.h>

#include <cstdint>
#include <string>

#include "bindings.hpp"
#include "fusekit/ops/loss.hpp"

namespace fk::py {

using namespace nb::literals;

void bind_loss(nb::module_& m) {
  m.def(
      "linear_cross_entropy",
      [](const Array& h, const Array& w, const OptArray& bias, const Array& targets, const Array& loss,
         const OptArray& dh, const OptArray& dw, const OptArray& dbias, std::int64_t ignore_index,
         float label_smoothing, float z_loss, const std::string& reduction, std::int64_t chunk_rows, bool allow_tf32,
         bool check_targets, std::uintptr_t stream) {
        constexpr const char* op = "linear_cross_entropy";
        const LinearCrossEntropyArgs args{view(h, op, "h"),     view(w, op, "w"),   view(bias, op, "bias"),
                                          view(targets, op, "targets"), view(loss, op, "loss"),
                                          view(dh, op, "dh"),   view(dw, op, "dw"), view(dbias, op, "dbias")};
        LinearCrossEntropyParams p;
        p.ignore_index = ignore_index;
        p.label_smoothing = label_smoothing;
        p.z_loss = z_loss;
        p.reduction = parse_loss_reduction(reduction, op);
        p.chunk_rows = chunk_rows;
        p.allow_tf32 = allow_tf32;
        p.check_targets = check_targets;
        linear_cross_entropy(args, p, StreamArg(stream, args.h).get());
      },
      "h"_a, "w"_a, "bias"_a.none(), "targets"_a, "loss"_a, "dh"_a.none(), "dw"_a.none(), "dbias"_a.none(),
      "ignore_index"_a, "label_smoothing"_a, "z_loss"_a, "reduction"_a, "chunk_rows"_a = 0, "allow_tf32"_a = false,
      "check_targets"_a = true, "stream"_a = 0, kNoGil);
}

}  // namespace fk::py
