// The families' binding functions, one per source file (python/src/<family>.cpp), called by
// NB_MODULE in module.cpp, and what their definitions share.
#pragma once

#include <optional>

#include "convert.hpp"

namespace fk::py {

using OptArray = std::optional<Array>;  // an optional tensor: None in Python
constexpr auto kNoGil = nb::call_guard<nb::gil_scoped_release>();  // the GIL released while an op runs

void bind_pointwise(nb::module_& m);
void bind_primitives(nb::module_& m);
void bind_quant(nb::module_& m);
void bind_glu(nb::module_& m);
void bind_lora(nb::module_& m);
void bind_qgemm(nb::module_& m);
void bind_mlp(nb::module_& m);
void bind_recsys(nb::module_& m);
void bind_loss(nb::module_& m);
void bind_norm(nb::module_& m);

}  // namespace fk::py
