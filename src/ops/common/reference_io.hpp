// Element access for the CPU specs: read any float dtype as double, store a double rounded to the
// tensor's dtype through float (the kernels hold fp32 values and round once at the store).
#pragma once

#include <cstdint>

#include "fusekit/core/error.hpp"
#include "fusekit/core/tensor.hpp"

namespace fk::reference {

inline double load(const TensorView& t, std::int64_t i) {
  switch (t.dtype()) {
    case DType::f32: return t.data_as<float>()[i];
    case DType::bf16: return static_cast<float>(t.data_as<bf16>()[i]);
    case DType::f16: return static_cast<float>(t.data_as<f16>()[i]);
    default: throw_internal("reference::load: dtype not checked by the caller");
  }
}

// v rounded to dtype `t` through float, as store() rounds it.
inline double round_to(DType t, double v) {
  const float f = static_cast<float>(v);
  switch (t) {
    case DType::bf16: return static_cast<float>(bf16(f));
    case DType::f16: return static_cast<float>(f16(f));
    default: return f;
  }
}

inline void store(const TensorView& t, std::int64_t i, double v) {
  const float f = static_cast<float>(v);
  switch (t.dtype()) {
    case DType::f32: t.data_as<float>()[i] = f; return;
    case DType::bf16: t.data_as<bf16>()[i] = bf16(f); return;
    case DType::f16: t.data_as<f16>()[i] = f16(f); return;
    default: throw_internal("reference::store: dtype not checked by the caller");
  }
}

}  // namespace fk::reference
