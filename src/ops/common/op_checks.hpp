// Argument checks private to the op families, over the public ones in fusekit/core/checks.hpp:
// each throws fk::Error naming the op and argument.
#pragma once

#include <fmt/format.h>

#include <initializer_list>
#include <iterator>

#include "fusekit/core/checks.hpp"
#include "fusekit/core/error.hpp"
#include "fusekit/core/stream.hpp"
#include "fusekit/core/tensor.hpp"

namespace fk::checks {

// A tensor that goes with `ref`: the given shape, ref's dtype (an output, a bias, a gradient).
inline void companion(const char* op, const char* arg, const TensorView& t, const TensorView& ref, const Dims& shape) {
  tensor(op, arg, t, static_cast<int>(shape.size()));
  same_dtype(op, arg, t, ref);
  shape_is(op, arg, t, shape);
  same_device(op, arg, t, ref.device());
}

// The floating dtypes of the GEMM-shaped families (f32 through TF32 where they allow it).
inline constexpr std::initializer_list<DType> kFloatTypes = {DType::f32, DType::bf16, DType::f16};

// A named tensor for the aliasing checks (absent optionals are skipped).
struct Named {
  const char* name;
  const TensorView* t;
};

// Each output overlaps no input and no other output; throws naming the output and what it
// overlaps.
inline void outputs_disjoint(const char* op, std::initializer_list<Named> outputs, std::initializer_list<Named> inputs) {
  for (auto o = outputs.begin(); o != outputs.end(); ++o) {
    if (!o->t) continue;
    auto refuse = [&](const Named& other) {
      if (other.t && overlaps(*o->t, *other.t))
        throw Error(op, o->name, fmt::format("memory that does not overlap {}", other.name), "an overlapping tensor");
    };
    for (const Named& in : inputs) refuse(in);
    for (auto p = std::next(o); p != outputs.end(); ++p) refuse(*p);
  }
}

// The legacy default stream (null) belongs to whichever device is current; an owned stream to one.
inline void check_stream(const char* op, const Stream* stream, Device dev) {
  if (stream && stream->handle() && dev.is_cuda())
    FK_CHECK_ARG(stream->device() == dev, op, "stream", fmt::format("a stream on {}", dev.str()),
                 fmt::format("a stream on {}", stream->device().str()));
}

// Raises a clear error when a CUDA tensor reaches a build without CUDA.
inline void cuda_available(const char* op, Device device) {
  FK_CHECK_ARG(device.is_cpu() || FUSEKIT_WITH_CUDA, op, "device",
               "cpu (fusekit was built without CUDA)", device.str());
}

}  // namespace fk::checks
