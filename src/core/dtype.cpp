#include "fusekit/core/dtype.hpp"

#include <string>

#include "fusekit/core/error.hpp"

namespace fk {

std::size_t dtype_size(DType t) noexcept {
  switch (t) {
    case DType::f32: case DType::i32: return 4;
    case DType::f16: case DType::bf16: return 2;
    case DType::i8: case DType::u8: return 1;
    case DType::i64: return 8;
  }
  return 0;
}

std::string_view dtype_name(DType t) noexcept {
  switch (t) {
    case DType::f32: return "f32";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
    case DType::i8: return "i8";
    case DType::u8: return "u8";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
  }
  return "?";
}

DType parse_dtype(std::string_view name) {
  for (DType t : {DType::f32, DType::f16, DType::bf16, DType::i8, DType::u8, DType::i32, DType::i64})
    if (dtype_name(t) == name) return t;
  throw Error("parse_dtype", "name", "one of f32, f16, bf16, i8, u8, i32, i64", std::string(name));
}

bool is_floating(DType t) noexcept { return t == DType::f32 || t == DType::f16 || t == DType::bf16; }

f16::f16(float f) noexcept {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  const std::uint32_t sign = (u >> 16) & 0x8000u;
  const std::uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) { bits = static_cast<std::uint16_t>(sign | 0x7e00u); return; }  // NaN
  if (abs >= 0x477ff000u) { bits = static_cast<std::uint16_t>(sign | 0x7c00u); return; } // >= 65520: inf
  if (abs < 0x38800000u) {  // below the smallest normal half (2^-14): subnormal or zero
    // In units of 2^-24 (the subnormal step) the value is exact in float; round to nearest even.
    const float scaled = std::bit_cast<float>(abs) * 16777216.0f;
    const float fl = static_cast<float>(static_cast<std::uint32_t>(scaled));
    const float frac = scaled - fl;
    std::uint32_t q = static_cast<std::uint32_t>(fl);
    if (frac > 0.5f || (frac == 0.5f && (q & 1u))) ++q;
    bits = static_cast<std::uint16_t>(sign | q);
    return;
  }
  // Normal: rebias exponent (127 -> 15) and round the 23-bit mantissa to 10 bits, nearest even.
  std::uint32_t m = abs - 0x38000000u;  // exponent rebias by (127-15) << 23
  m += 0xfffu + ((m >> 13) & 1u);
  bits = static_cast<std::uint16_t>(sign | (m >> 13));
}

f16::operator float() const noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(bits & 0x8000u) << 16;
  const std::uint32_t exp = (bits >> 10) & 0x1fu;
  const std::uint32_t man = bits & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: man * 2^-24
    const float v = static_cast<float>(man) * (1.0f / 16777216.0f);
    return std::bit_cast<float>(std::bit_cast<std::uint32_t>(v) | sign);
  }
  if (exp == 31) return std::bit_cast<float>(sign | 0x7f800000u | (man << 13));
  return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (man << 13));
}

}  // namespace fk
