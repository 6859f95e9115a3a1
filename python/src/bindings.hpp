// The families' binding functions, one per source file, called by NB_MODULE in module.cpp.
#pragma once

#include "convert.hpp"

namespace fk::py {

void bind_recsys(nb::module_& m);

}  // namespace fk::py
