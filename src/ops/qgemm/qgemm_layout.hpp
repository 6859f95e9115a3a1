// Where each 4-bit weight lives in QuantizedWeight::packed (docs/qgemm.md), shared by the host spec
// (packing, unpacking) and the CUDA kernels.
//
// The words are grouped in tiles of 16 rows x 64 columns of K, ordered k-tile major
// ([k_pad / 64][n_pad / 16]) so that the 16-row tiles of one k-tile that a CTA needs are one
// contiguous run of memory. A tile holds 32 lanes x 4 words; lane l = 4 * g + t holds, for row g of
// each 8-row half j and each 32-wide half b of the k-tile, the word at slot 2 * j + b. Its 8 nibbles
// are the values of that row at k = 2t, 2t+1, 2t+8, 2t+9 (first k16 step) and the same + 16
// (second): what the thread holds of the B operand of mma.sync m16n8k16 (b0, b1) for both steps.
// Nibble i (bits 4i..4i+3) and nibble i + 4 (bits 16+4i..) form f16x2/bf16x2 register i once
// masked with 0x000F000F after a shift right by 4i: register i = (h, e) with h = i / 2 the k16 step
// and i % 2 the fragment register, e = 0/1 its low/high half.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FK_QGEMM_HD __host__ __device__
#else
#define FK_QGEMM_HD
#endif

namespace fk::qgemm_layout {

struct Slot {
  std::int64_t word;  // index into packed as int32
  int shift;          // bit offset of the nibble
};

// Where w[n, k] is stored, for rows padded to n_pad.
FK_QGEMM_HD inline Slot slot_of(std::int64_t n, std::int64_t k, std::int64_t n_pad) {
  const std::int64_t kt = k / 64, nt = n / 16;
  const int kk = static_cast<int>(k % 64), nn = static_cast<int>(n % 16);
  const int b = kk / 32, r = kk % 32, h = r / 16, r16 = r % 16;
  const int t = (r16 % 8) / 2, e = r16 % 2, reg = h * 2 + r16 / 8;
  const int j = nn / 8, g = nn % 8, lane = g * 4 + t;
  return {((kt * (n_pad / 16) + nt) * 32 + lane) * 4 + j * 2 + b, 4 * (reg + 4 * e)};
}

// The inverse: the (n, k) of nibble `nib` (0..7) of word `word`.
FK_QGEMM_HD inline void coords_of(std::int64_t word, int nib, std::int64_t n_pad, std::int64_t& n, std::int64_t& k) {
  const int slot = static_cast<int>(word % 4), lane = static_cast<int>((word / 4) % 32);
  const std::int64_t tile = word / 128, nt = tile % (n_pad / 16), kt = tile / (n_pad / 16);
  const int j = slot / 2, b = slot % 2, g = lane / 4, t = lane % 4;
  const int reg = nib % 4, e = nib / 4, h = reg / 2, hi8 = reg % 2;
  n = nt * 16 + j * 8 + g;
  k = kt * 64 + b * 32 + h * 16 + hi8 * 8 + 2 * t + e;
}

}  // namespace fk::qgemm_layout
