// Device helpers shared by the two qgemm kernels (qgemm.cu: tensor-core tiles; qgemm_small_m.cu:
// the weight-streaming path): the magic-number dequantization of one packed word into four
// f16x2/bf16x2 mma fragment registers, and mma.sync m16n8k16.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace fk::cuda::qgemm_device {

template <class T> struct Half2;
template <> struct Half2<__half> {
  using type = __half2;
  static constexpr std::uint32_t magic = 0x6400;  // 1024.0: 1024 + q exact for q < 1024
};
template <> struct Half2<__nv_bfloat16> {
  using type = __nv_bfloat162;
  static constexpr std::uint32_t magic = 0x4300;  // 128.0: 128 + q exact for q < 128
};

template <class To, class From>
__device__ __forceinline__ To bits_as(From v) {
  static_assert(sizeof(To) == sizeof(From));
  To t;
  memcpy(&t, &v, sizeof(To));
  return t;
}

// (a & mask) | c in one LOP3 (the compiler splits an and-or in two when both constants are
// immediates).
template <std::uint32_t MASK>
__device__ __forceinline__ std::uint32_t and_or(std::uint32_t a, std::uint32_t c) {
  std::uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(r) : "r"(a), "n"(MASK), "r"(c));
  return r;
}

// q - z for the 8 values of one word, as the four mma fragment registers (register i: nibbles i and
// i + 4), exactly: f16 takes nibbles 0-3 / 8-11 as (1024 + q) - (1024 + z) (one LOP3, one HSUB2) and
// nibbles 4-7 / 12-15 unshifted as (1024 + 16 q) / 16 - (64 + z) (one LOP3, one HFMA2: the product
// and the sum are exact); bf16 (7 mantissa bits: no room for 16 q) shifts every nibble down and
// takes (128 + q) - (128 + z). c0 and c1 are the per-row constants of centering_constants.

template <class T>
__device__ __forceinline__ void centering_constants(std::uint32_t z, std::uint32_t& c0, std::uint32_t& c1) {
  c0 = z * 0x10001u + Half2<T>::magic * 0x10001u;                  // magic + z, both halves
  c1 = std::is_same_v<T, __half> ? z * 0x100010u + 0xD400D400u : c0;  // f16 -(64 + z): z in the mantissa at 2^-4
}
template <class T>
__device__ __forceinline__ void centered_word(std::uint32_t q, std::uint32_t c0, std::uint32_t c1, std::uint32_t (&out)[4]) {
  using T2 = typename Half2<T>::type;
  constexpr std::uint32_t magic = Half2<T>::magic * 0x10001u;
  const std::uint32_t q8 = q >> 8;
  if constexpr (std::is_same_v<T, __half>) {
    const __half2 sixteenth = bits_as<__half2>(0x2C002C00u);  // 1/16
    out[0] = bits_as<std::uint32_t>(__hsub2(bits_as<T2>(and_or<0x000F000Fu>(q, magic)), bits_as<T2>(c0)));
    out[1] = bits_as<std::uint32_t>(__hfma2(bits_as<T2>(and_or<0x00F000F0u>(q, magic)), sixteenth, bits_as<T2>(c1)));
    out[2] = bits_as<std::uint32_t>(__hsub2(bits_as<T2>(and_or<0x000F000Fu>(q8, magic)), bits_as<T2>(c0)));
    out[3] = bits_as<std::uint32_t>(__hfma2(bits_as<T2>(and_or<0x00F000F0u>(q8, magic)), sixteenth, bits_as<T2>(c1)));
  } else {
    (void)c1;
    out[0] = bits_as<std::uint32_t>(__hsub2(bits_as<T2>(and_or<0x000F000Fu>(q, magic)), bits_as<T2>(c0)));
    out[1] = bits_as<std::uint32_t>(__hsub2(bits_as<T2>(and_or<0x000F000Fu>(q >> 4, magic)), bits_as<T2>(c0)));
    out[2] = bits_as<std::uint32_t>(__hsub2(bits_as<T2>(and_or<0x000F000Fu>(q8, magic)), bits_as<T2>(c0)));
    out[3] = bits_as<std::uint32_t>(__hsub2(bits_as<T2>(and_or<0x000F000Fu>(q >> 12, magic)), bits_as<T2>(c0)));
  }
}

// The four fragment registers of one word (qgemm_layout.hpp): s * (q - z) per value, register i
// from nibbles i and i + 4. (magic | q) - (magic + z) is exact; the multiplication by s rounds
// once, as dequantize_weights does.
template <class T>
__device__ __forceinline__ void dequant_word(std::uint32_t q, std::uint32_t scale_bits, std::uint32_t z,
                                             std::uint32_t (&out)[4]) {
  using T2 = typename Half2<T>::type;
  constexpr std::uint32_t magic = Half2<T>::magic * 0x10001u;
  const T2 mz = bits_as<T2>((Half2<T>::magic + z) * 0x10001u);
  const T2 s = bits_as<T2>(scale_bits * 0x10001u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const T2 v = bits_as<T2>(and_or<0x000F000Fu>(q >> (4 * i), magic));
    out[i] = bits_as<std::uint32_t>(__hmul2(__hsub2(v, mz), s));
  }
}

// c += a · b, m16n8k16, f16 or bf16 inputs, fp32 accumulators.
template <class T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                          std::uint32_t b1) {
  if constexpr (std::is_same_v<T, __half>) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// 16 bytes global -> shared; src_bytes 0 writes zeros and reads nothing.
__device__ __forceinline__ void cp_async_16(std::uint32_t smem_addr, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

}  // namespace fk::cuda::qgemm_device
