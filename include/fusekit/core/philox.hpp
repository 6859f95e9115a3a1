// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11): a
// counter-based generator. The numbers are a pure function of (key, counter), so the CPU and the
// GPU produce the same stream, any element can be generated independently, and a stochastic
// rounding or a synthetic data set is reproducible from (seed, offset).
//
// This header is plain C++ that nvcc also compiles for the device.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FK_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FK_HOST_DEVICE inline
#endif

namespace fk::philox {

struct U32x4 {
  std::uint32_t v[4];
};

FK_HOST_DEVICE void mulhilo(std::uint32_t a, std::uint32_t b, std::uint32_t& hi, std::uint32_t& lo) {
  const std::uint64_t p = static_cast<std::uint64_t>(a) * b;
  hi = static_cast<std::uint32_t>(p >> 32);
  lo = static_cast<std::uint32_t>(p);
}

// Ten rounds of Philox4x32 on `ctr` with the 64-bit key (k0, k1).
FK_HOST_DEVICE U32x4 philox4x32_10(U32x4 ctr, std::uint32_t k0, std::uint32_t k1) {
  constexpr std::uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr std::uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    std::uint32_t hi0, lo0, hi1, lo1;
    mulhilo(kM0, ctr.v[0], hi0, lo0);
    mulhilo(kM1, ctr.v[2], hi1, lo1);
    ctr = U32x4{{hi1 ^ ctr.v[1] ^ k0, lo1, hi0 ^ ctr.v[3] ^ k1, lo0}};
    k0 += kW0;
    k1 += kW1;
  }
  return ctr;
}

// Four random words for block `index` of the stream (seed, subsequence). Element i of a tensor
// filled from the stream uses word i % 4 of block i / 4.
FK_HOST_DEVICE U32x4 random_block(std::uint64_t seed, std::uint64_t subsequence, std::uint64_t index) {
  const U32x4 ctr{{static_cast<std::uint32_t>(index), static_cast<std::uint32_t>(index >> 32),
                   static_cast<std::uint32_t>(subsequence),
                   static_cast<std::uint32_t>(subsequence >> 32)}};
  return philox4x32_10(ctr, static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32));
}

// Uniform in [0, 1): the top 24 bits, so every value is exact in float.
FK_HOST_DEVICE float to_unit_float(std::uint32_t x) {
  return static_cast<float>(x >> 8) * (1.0f / 16777216.0f);
}

}  // namespace fk::philox
