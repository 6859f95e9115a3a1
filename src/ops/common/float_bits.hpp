// The bits of a float and back, on the host and the device alike (plain C++ that nvcc also
// compiles for the device).
#pragma once

#include <cstdint>
#include <cstring>

#include "fusekit/core/philox.hpp"  // FK_HOST_DEVICE

namespace fk {

FK_HOST_DEVICE std::uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

FK_HOST_DEVICE float bits_float(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

}  // namespace fk
