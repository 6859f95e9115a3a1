// The arithmetic of the packed format, shared by the CPU spec and the CUDA kernels so that both
// produce the same bits: every operation is an IEEE float operation rounded to nearest (no fma
// contraction, which nvcc would otherwise apply), and the rounding of the statistics to their
// dtype is done on the bit patterns. See docs/quant-format.md.
#pragma once

#include <math.h>

#include <cstdint>
#include <cstring>

#include "fusekit/core/philox.hpp"
#include "ops/common/float_bits.hpp"

namespace fk::quant {

using fk::bits_float;
using fk::float_bits;

FK_HOST_DEVICE float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
FK_HOST_DEVICE float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
FK_HOST_DEVICE float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
FK_HOST_DEVICE float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

FK_HOST_DEVICE bool is_finite(float f) { return (float_bits(f) & 0x7f800000u) != 0x7f800000u; }

// Round a finite float to bf16 (returned as float): to nearest even, or toward -infinity.
FK_HOST_DEVICE float bf16_nearest(float f) {
  std::uint32_t u = float_bits(f);
  u += 0x7fffu + ((u >> 16) & 1u);
  return bits_float(u & 0xffff0000u);
}
FK_HOST_DEVICE float bf16_down(float f) {
  const std::uint32_t u = float_bits(f), t = u & 0xffff0000u;
  if (t == u) return f;
  // Truncation rounds toward zero: down for positives; negatives step one bf16 ulp further out.
  return bits_float((u & 0x80000000u) ? t + 0x10000u : t);
}
// The next representable value above a positive finite x in the stats dtype.
FK_HOST_DEVICE float next_up(float x, bool bf16_stats) {
  return bits_float(float_bits(x) + (bf16_stats ? 0x10000u : 1u));
}

struct Stats {
  float scale, min;  // as stored (already rounded to the stats dtype)
  float inv;         // 1 / scale, rounded to nearest: quantizing multiplies by it
};

FK_HOST_DEVICE Stats make_stats(float scale, float min) { return {scale, min, div_rn(1.0f, scale)}; }

// Scale and minimum of a group whose finite values span [lo, hi], as stored in the stats dtype:
// the minimum rounded down and the scale rounded so that min + scale * levels >= hi, which keeps
// every value on the grid [min, min + scale * levels] and within scale / 2 of its nearest level.
// A group holding a NaN or an infinity (any_nonfinite) gets NaN statistics and all-zero words:
// unpack gives NaN for all its values instead of silently wrong numbers.
FK_HOST_DEVICE Stats group_stats(float lo, float hi, bool any_nonfinite, int bits, bool bf16_stats) {
  if (any_nonfinite) return make_stats(bits_float(0x7fc00000u), bits_float(0x7fc00000u));
  const float levels = static_cast<float>((1 << bits) - 1);
  const float m = bf16_stats ? bf16_down(lo) : lo;
  float s = div_rn(sub_rn(hi, m), levels);
  if (!(s > 0.0f)) s = 1.0f;  // hi == min: every value is the minimum
  if (bf16_stats) s = bf16_nearest(s);
  while (add_rn(m, mul_rn(s, levels)) < hi) s = next_up(s, bf16_stats);
  return make_stats(s, m);
}

// The level of a finite x of the group, from v = (x - min) * (1 / scale): nearest (ties to even),
// or floor(v + u) with u uniform in (0, 1) for stochastic rounding, which is unbiased:
// E[level] = v (to within 2^-17 of a step with stochastic_u's 16-bit draws). (Multiplying by the rounded reciprocal moves v by a few ulps: a value within
// 2^-22 v of a tie may round the other way, so the error bound is scale / 2 plus 2^-22 * 255 scale
// at most.) Since min <= x and min + scale * levels >= x for every x of the group, 0 <= v <
// levels + 1/2 needs no clamp; adding 1.5 * 2^23 then rounds v to the nearest integer (ties to
// even) and leaves it in the low mantissa bits: no conversion instructions. Groups holding a NaN
// or an infinity are not quantized (their words are 0: see group_stats).
FK_HOST_DEVICE std::uint32_t quantize(float x, Stats st, int bits, bool stochastic, float u) {
  float v = mul_rn(sub_rn(x, st.min), st.inv);
  // v + u may round up to levels + 1 when v is at the top level and u near 1: clamp that one.
  if (stochastic) v = fminf(floorf(add_rn(v, u)), static_cast<float>((1 << bits) - 1));
  return float_bits(add_rn(v, 12582912.0f)) & 0x3fffffu;
}

// x̂ = q * scale + min, one fma (correctly rounded on host and device alike). float(q) is built
// from the bits (2^23 + q, minus 2^23: exact), which is cheaper on the GPU than a conversion.
FK_HOST_DEVICE float dequantize(std::uint32_t q, Stats st) {
  const float qf = sub_rn(bits_float(0x4b000000u | q), 8388608.0f);
  return fmaf(qf, st.scale, st.min);
}

// The draw of element flat = row * cols + col of a packed [rows, cols] tensor from its Philox
// block, block flat / 8 of the stream (seed, offset): 16 bits of word (flat / 2) % 4, the low half
// for an even flat, the high half for an odd one, as u = (h + 1/2) / 2^16 in (0, 1). Eight draws a
// block (a block costs about 100 instructions, more than the quantization of 8 values); the
// rounding floor(v + u) is then unbiased to within 2^-17 of a step: |E[level] - v| <= 2^-17.
FK_HOST_DEVICE float dither_from(const philox::U32x4& block, std::uint64_t flat) {
  const std::uint32_t w = block.v[(flat >> 1) & 3];
  const std::uint32_t h = (flat & 1) ? (w >> 16) : (w & 0xffffu);
  return (static_cast<float>(h) + 0.5f) * (1.0f / 65536.0f);
}

FK_HOST_DEVICE float stochastic_u(std::uint64_t seed, std::uint64_t offset, std::uint64_t flat) {
  return dither_from(philox::random_block(seed, offset, flat >> 3), flat);
}

}  // namespace fk::quant
