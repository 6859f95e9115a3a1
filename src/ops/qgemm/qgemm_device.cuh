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
    const T2 v = bits_as<T2>(((q >> (4 * i)) & 0x000F000Fu) | magic);
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
