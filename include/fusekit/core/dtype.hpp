// Element types, with host-side storage types for the two 16-bit floats so that the CPU specs
// can read and write the same bits the GPU kernels do.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace fk {

enum class DType : std::uint8_t { f32, f16, bf16, i8, u8, i32, i64 };

std::size_t dtype_size(DType t) noexcept;
std::string_view dtype_name(DType t) noexcept;  // "f32", "bf16", ...
DType parse_dtype(std::string_view name);       // throws fk::Error on an unknown name
bool is_floating(DType t) noexcept;

// bfloat16 bits. Conversion from float rounds to nearest even; NaN stays NaN.
struct bf16 {
  std::uint16_t bits = 0;
  bf16() = default;
  explicit bf16(float f) noexcept {
    std::uint32_t u = std::bit_cast<std::uint32_t>(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      bits = static_cast<std::uint16_t>((u >> 16) | 0x40u);
    } else {
      u += 0x7fffu + ((u >> 16) & 1u);
      bits = static_cast<std::uint16_t>(u >> 16);
    }
  }
  explicit operator float() const noexcept {
    return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
  }
};

// IEEE binary16 bits. Conversion from float rounds to nearest even, with subnormals and overflow
// to infinity handled as the hardware does.
struct f16 {
  std::uint16_t bits = 0;
  f16() = default;
  explicit f16(float f) noexcept;
  explicit operator float() const noexcept;
};

template <class T> struct dtype_of;
template <> struct dtype_of<float> { static constexpr DType value = DType::f32; };
template <> struct dtype_of<f16> { static constexpr DType value = DType::f16; };
template <> struct dtype_of<bf16> { static constexpr DType value = DType::bf16; };
template <> struct dtype_of<std::int8_t> { static constexpr DType value = DType::i8; };
template <> struct dtype_of<std::uint8_t> { static constexpr DType value = DType::u8; };
template <> struct dtype_of<std::int32_t> { static constexpr DType value = DType::i32; };
template <> struct dtype_of<std::int64_t> { static constexpr DType value = DType::i64; };
template <class T> inline constexpr DType dtype_v = dtype_of<T>::value;

// Calls f(T{}) with T the host storage type of t (float, f16, bf16, int8_t, ...).
template <class F>
decltype(auto) visit_dtype(DType t, F&& f) {
  switch (t) {
    case DType::f32: return f(float{});
    case DType::f16: return f(f16{});
    case DType::bf16: return f(bf16{});
    case DType::i8: return f(std::int8_t{});
    case DType::u8: return f(std::uint8_t{});
    case DType::i32: return f(std::int32_t{});
    case DType::i64: break;
  }
  return f(std::int64_t{});
}

}  // namespace fk
