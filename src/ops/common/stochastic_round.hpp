// Stochastic rounding of f32 to bf16 and f16, shared by the CPU spec and the CUDA kernels so that
// both give the same bits for the same f32 value and draw.
//
// A finite x between two neighbouring values lo <= |x| < hi of the 16-bit format (lo its
// truncation toward zero) rounds to hi with probability (|x| - lo) / (hi - lo) and to lo
// otherwise, the sign kept: E[result] = x, so that updates far smaller than a 16-bit step still
// move a value on average (what a table stored in bf16 needs: a learning rate times a gradient is
// mostly below half of bf16's step, and rounding to nearest would drop it). The probability is
// exact for every bf16 result and for normal f16 results (the draw is compared with the dropped
// mantissa bits); for f16 subnormals (|x| < 2^-14) it is within 2^-16 of exact. NaN stays NaN;
// bf16 carries past its largest finite value into infinity as the exponent does, f16 likewise, and
// |x| >= 65536 gives f16 infinity. The draw h is 16 random bits.
//
// This header is plain C++ that nvcc also compiles for the device.
#pragma once

#include <math.h>

#include <cstdint>

#include "fusekit/core/philox.hpp"
#include "ops/common/float_bits.hpp"

namespace fk::sround {

FK_HOST_DEVICE std::uint16_t to_bf16(float x, std::uint32_t h) {
  const std::uint32_t u = float_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);
  // The dropped bits over 2^16 are the distance to the truncation over the step.
  return static_cast<std::uint16_t>((u >> 16) + ((h & 0xffffu) < (u & 0xffffu) ? 1u : 0u));
}

FK_HOST_DEVICE std::uint16_t to_f16(float x, std::uint32_t h) {
  const std::uint32_t u = float_bits(x);
  const auto sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u);
  if (a >= (143u << 23)) return static_cast<std::uint16_t>(sign | 0x7c00u);  // |x| >= 2^16 (and infinity)
  if (a >= (113u << 23)) {
    // Normal: exponent 127 - 15 = 112 lower, 13 mantissa bits dropped; a carry out of the
    // mantissa steps the exponent (past 65504: infinity).
    const std::uint32_t r = (a >> 13) - (112u << 10) + ((h & 0x1fffu) < (a & 0x1fffu) ? 1u : 0u);
    return static_cast<std::uint16_t>(sign | r);
  }
  // Subnormal: multiples of 2^-24. y = |x| 2^24 < 1024 is exact, so are its floor and fraction.
  const float y = bits_float(a) * 16777216.0f;
  const float m = floorf(y);
  const float u01 = (static_cast<float>(h & 0xffffu) + 0.5f) * (1.0f / 65536.0f);
  const auto r = static_cast<std::uint32_t>(m) + (u01 < y - m ? 1u : 0u);  // 1024: the least normal
  return static_cast<std::uint16_t>(sign | r);
}

// The 16 draw bits of element `flat` of a stream: word (flat / 2) % 4 of Philox block flat / 8
// of (seed, offset), its low half for an even flat, its high half for an odd one (so eight
// elements share a block).
FK_HOST_DEVICE std::uint32_t draw_bits(const philox::U32x4& block, std::uint64_t flat) {
  // Selected, not indexed: an indexed register array would be put in local memory.
  const auto k = static_cast<unsigned>(flat >> 1) & 3u;
  const std::uint32_t w = k == 0 ? block.v[0] : k == 1 ? block.v[1] : k == 2 ? block.v[2] : block.v[3];
  return (flat & 1) ? (w >> 16) : (w & 0xffffu);
}

}  // namespace fk::sround
