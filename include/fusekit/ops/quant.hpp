// Family `quant`: activation compression. Activations saved for the backward pass are
// stored group-wise min/max quantized to 1, 2, 4 or 8 bits and packed into int32 words, ReLU
// masks at one bit per element, and the weight gradient is computed straight from the packed
// bits. The packed format is specified in docs/quant-format.md.
#pragma once

#include <cstdint>

#include "fusekit/core/tensor.hpp"

namespace fk {

class Stream;

enum class Rounding { nearest, stochastic };

struct PackParams {
  int bits = 2;                      // 1, 2, 4 or 8
  int group = 256;                   // values per (row, group); a multiple of 32 / bits
  Rounding rounding = Rounding::nearest;
  std::uint64_t seed = 0;            // stochastic rounding: the Philox key ...
  std::uint64_t offset = 0;          // ... and subsequence; (seed, offset) reproduce the draw
  DType stats_dtype = DType::bf16;   // dtype of the per-group scale and minimum: bf16 or f32
  // Optional (stochastic rounding): an i64 [1] on x's device whose value is added to `offset`
  // when the pack runs, not when it is queued, so that a CUDA graph replaying the pack draws
  // anew each time the counter is advanced (advance_offset, core/random.hpp). Null data: none.
  TensorView offset_counter;
};

// Non-owning view of a packed tensor.
struct PackedView {
  TensorView words;  // i32 [rows, groups, group * bits / 32]
  TensorView scale;  // stats dtype [rows, groups]
  TensorView min;    // stats dtype [rows, groups]
  std::int64_t rows = 0, cols = 0;
  DType dtype = DType::bf16;  // dtype of the tensor that was packed
  int bits = 2, group = 256;

  std::int64_t groups() const noexcept { return (cols + group - 1) / group; }
  int words_per_group() const noexcept { return group * bits / 32; }
  // Bytes held: words + scale + min.
  std::size_t nbytes() const noexcept { return words.nbytes() + scale.nbytes() + min.nbytes(); }
};

// Owning packed tensor.
struct PackedTensor {
  Tensor words, scale, min;
  std::int64_t rows = 0, cols = 0;
  DType dtype = DType::bf16;
  int bits = 2, group = 256;

  // Uninitialised storage for packing a [rows, cols] tensor of `dtype` with `p`.
  static PackedTensor empty(std::int64_t rows, std::int64_t cols, DType dtype, const PackParams& p, Device device,
                            const Stream* stream = nullptr);
  PackedView view() const;
  std::size_t nbytes() const noexcept { return view().nbytes(); }
};

// Quantizes and packs x [rows, cols] (f32, bf16 or f16) into `out`, whose bits, group and stats
// dtype must match `p`.
void pack(const TensorView& x, const PackedView& out, const PackParams& p, const Stream* stream = nullptr);
PackedTensor pack(const TensorView& x, const PackParams& p, const Stream* stream = nullptr);

// x̂ [rows, cols] (f32, bf16 or f16): q * scale + min, in fp32, rounded once to out's dtype.
void unpack(const PackedView& packed, const TensorView& out, const Stream* stream = nullptr);
Tensor unpack(const PackedView& packed, DType dtype, const Stream* stream = nullptr);

// ReLU that saves its mask at one bit per element: y = relu(x) (NaN propagates), bit i of the flat
// mask (word i / 32, bit i % 32) is x_i > 0. x, y: any shape, contiguous, one dtype (f32, bf16,
// f16); y may alias x. mask: i32 [ceil(numel / 32)], trailing bits zero.
void relu_forward_packed(const TensorView& x, const TensorView& y, const TensorView& mask,
                         const Stream* stream = nullptr);
// dx = dy where the mask bit is set, else 0. dx may alias dy.
void relu_backward_packed(const TensorView& dy, const TensorView& mask, const TensorView& dx,
                          const Stream* stream = nullptr);
// Words a mask of `numel` elements takes.
inline std::int64_t relu_mask_words(std::int64_t numel) noexcept { return (numel + 31) / 32; }

struct WeightGradParams {
  float beta = 0.0f;         // 0: dW is overwritten; 1: dW += the product (gradient accumulation)
  bool deterministic = true; // split-K partial sums added in a fixed order
  // K split over several CTAs with a bf16 dW: each CTA's fp32 partial tile crosses the workspace
  // as fp16 with a power-of-two scale per 8 values (relative error 2^-11 for every value within
  // 2^-28 of the largest of its 8: 8x below dW's own bf16 rounding, below the bf16 inputs'
  // representation error), and the fix-up adds the partials in fp32. This halves the split-K
  // round trip, as cuBLAS's default reduced-precision split-K reduction does for low-precision
  // outputs (in the output type). true keeps the partials fp32; an f32 dW always does.
  bool fp32_partials = false;
};

// dW [COUT, CIN] = beta * dW + dyᵀ · unpack(x), dy [K, COUT] (bf16), x packed from [K, CIN];
// fp32 accumulation; dW is f32 or bf16. K split over several CTAs adds their partial sums in fp32,
// the partials carried in fp16 with a scale per 8 values for a bf16 dW (see fp32_partials above).
// dW overlaps neither dy nor any part of x (an error naming dw).
void weight_grad_from_packed(const TensorView& dy, const PackedView& x, const TensorView& dw,
                             const WeightGradParams& p = {}, const Stream* stream = nullptr);

namespace reference {
void pack(const TensorView& x, const PackedView& out, const PackParams& p);
void unpack(const PackedView& packed, const TensorView& out);
void relu_forward_packed(const TensorView& x, const TensorView& y, const TensorView& mask);
void relu_backward_packed(const TensorView& dy, const TensorView& mask, const TensorView& dx);
// Double accumulation over K of dy * x̂, x̂ dequantized in fp32 exactly as unpack does before
// its final rounding.
void weight_grad_from_packed(const TensorView& dy, const PackedView& x, const TensorView& dw,
                             const WeightGradParams& p);
}  // namespace reference

}  // namespace fk
