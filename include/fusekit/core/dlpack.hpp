// DLPack (dlpack.h, v0.6) interchange: hand a tensor to PyTorch/JAX/CuPy without a copy, and take
// theirs. A caller that reads or fills the DLManagedTensor includes <dlpack/dlpack.h> itself
// (Debian's libdlpack-dev); this header needs only the name.
#pragma once

#include "fusekit/core/tensor.hpp"

struct DLManagedTensor;

namespace fk {

// Moves `t` into a DLManagedTensor; the consumer calls its deleter when done.
DLManagedTensor* to_dlpack(Tensor&& t);
// Takes ownership of `m`: its deleter runs when the returned Tensor (and anything sharing its
// storage) is gone. Throws fk::Error on an unsupported dtype or device, and then also calls the
// deleter, since ownership passed in.
Tensor from_dlpack(DLManagedTensor* m);

}  // namespace fk
