// Family `qgemm`: 4-bit weight-only quantized matmul (W4A16, GPTQ/AWQ style; Triton puzzle 12).
//
// A weight w [N, K] (f16 or bf16) is quantized once, group-wise along K, to 4-bit unsigned values q
// with one scale s (w's dtype) and one 4-bit zero point z per (row, group):
//     w̃[n, k] = s[n, k / group] * (q[n, k] - z[n, k / group])          (rounded once to w's dtype)
// and y [M, N] = x [M, K] · w̃ᵀ is computed straight from the 4-bit words (fp32 accumulation), so
// that decoding at small M reads about a quarter of the bytes an f16 GEMM reads.
//
// The packed words are laid out for the CUDA kernel: the 8 nibbles of one int32 are the 8 values
// one thread of an mma.sync m16n8k16 B fragment needs for two k16 steps, already in the order in
// which the LOP3/magic-number trick turns them into f16x2/bf16x2 registers (docs/qgemm.md).
//
// K not a multiple of the group is rejected (fk::Error naming `group`); group == K (one group per
// row) is accepted for any K. The CUDA kernel needs K % 8 == 0 (16-byte rows of x) and a group that
// is a multiple of 32 or equal to K; other packings (e.g. the puzzle's group of 8) run on the CPU.
#pragma once

#include <cstdint>

#include "fusekit/core/tensor.hpp"

namespace fk {

class Stream;

// Padding of the packed layout: rows to a multiple of kQgemmRowPad, K to a multiple of
// kQgemmKPad. Padded weights are 0 (q = z = 0, s = 0) and never reach an output.
inline constexpr std::int64_t kQgemmRowPad = 256;
inline constexpr std::int64_t kQgemmKPad = 64;

struct QuantizedWeight {
  Tensor packed;  // i32 [k_pad / 64, n_pad / 16, 32, 4]: fragment order, docs/qgemm.md
  Tensor scale;   // dtype [groups, n_pad]: s[n, g] at scale[g, n]
  Tensor zero;    // i32 [groups, n_pad / 8]: z[n, g] in bits 4 * (n % 8) of zero[g, n / 8]
  std::int64_t n = 0, k = 0;
  int group = 128;            // values of K per scale; == k for one group per row
  DType dtype = DType::f16;   // dtype of the weight, of the scales and of the activations

  std::int64_t groups() const noexcept { return group > 0 ? (k + group - 1) / group : 0; }
  std::int64_t n_pad() const noexcept { return (n + kQgemmRowPad - 1) / kQgemmRowPad * kQgemmRowPad; }
  std::int64_t k_pad() const noexcept { return (k + kQgemmKPad - 1) / kQgemmKPad * kQgemmKPad; }
  Device device() const noexcept { return packed.device(); }
  // Bytes a GEMM reads for the weight: words, scales and zero points.
  std::size_t nbytes() const noexcept { return packed.nbytes() + scale.nbytes() + zero.nbytes(); }

  // Zeroed storage (every padded weight 0) for an [n, k] weight of `dtype`.
  static QuantizedWeight zeros(std::int64_t n, std::int64_t k, int group, DType dtype, Device device);
  QuantizedWeight copy_to(Device device) const;
};

// Quantizes w [N, K] (f16 or bf16) with group ∈ {32, 64, 128, K}: per (row, group) the range
// [lo, hi] = [min(w, 0), max(w, 0)], s = (hi - lo) / 15 rounded up to w's dtype, z = round(-lo / s),
// q = clamp(round(w / s) + z, 0, 15); every weight then lies within s / 2 of w̃. The quantization
// runs on the host (a one-time step at model load); the result lives on w's device.
QuantizedWeight quantize_weights(const TensorView& w, int group, const Stream* stream = nullptr);

// w̃ [N, K] in the weight's dtype (on the weight's device).
Tensor dequantize_weights(const QuantizedWeight& qw, const Stream* stream = nullptr);
void dequantize_weights(const QuantizedWeight& qw, const TensorView& out, const Stream* stream = nullptr);

// The puzzle's layout (puzzle 12): weight i32 [N, K / 8] with value k at bits 4 * (k % 8) of word
// k / 8; scale f32/f16/bf16 [N, K / group]; shift i32 [N, ceil(K / group / 8)] with the zero point
// of group g at bits 4 * (g % 8) of word g / 8. Host tensors; K % 8 == 0 and group % 8 == 0. The
// scales are rounded to `dtype`.
QuantizedWeight from_puzzle_layout(const TensorView& weight, const TensorView& scale, const TensorView& shift,
                                   int group, DType dtype);

// y [M, N] = x [M, K] · w̃ᵀ, x and y in the weight's dtype, fp32 accumulation, y overwritten.
// CUDA: M <= 16 streams the weights (the weight as the mma's A operand, split-K over a thread-block
// cluster, reduced in a fixed order: deterministic); it multiplies by the scale in fp32 once per
// group and row, so y differs from x · w̃ᵀ by w̃'s rounding to 16 bits (within the family's 5e-3 bound).
// Larger M: on sm_90, wgmma with the dequantized w̃ as the register-sourced operand; elsewhere
// 64x256 or 128x128 mma.sync m16n8k16 tiles on the dequantized w̃ (docs/qgemm.md).
//
// QgemmOptions::constant_weights: a promise that no kernel before this call in the stream writes
// the weight (packed, scale, zero) while it may still run, as in inference, where the weights are
// written once at load. The small-M kernel is then launched as a programmatic dependent launch
// (sm_90): its weight loads start while the kernel before it finishes, and it reads x and writes
// y only after that kernel has completed. Without the promise (the default) every qgemm waits for
// the kernel before it.
//
// QgemmOptions::reduction: how the small-M kernel sums its split-K partials on sm_90 (a kernel
// variant, benched side by side; the bytes of y are the same either way, both sum in the order
// (split, warp)). cluster_pull: a cluster barrier, each CTA reads its rows' partials
// from its peers' shared memory, a second barrier before any CTA exits. cluster_push (the default,
// 0.2-4.8 µs faster at M <= 16 on an H100, docs/qgemm.md): each CTA
// pushes its partials into the shared memory of the CTA that owns their rows (st.async, counted on
// the owner's mbarrier), and the owner reduces once its byte count has arrived; one cluster barrier
// arrive right after the mbarrier's initialization, waited on before the first push. Ignored off
// sm_90 and by the other kernels.
enum class QgemmReduction { cluster_pull, cluster_push };
struct QgemmOptions {
  bool constant_weights = false;
  QgemmReduction reduction = QgemmReduction::cluster_push;
};
void qgemm(const TensorView& x, const QuantizedWeight& qw, const TensorView& y, const Stream* stream = nullptr,
           const QgemmOptions& options = {});
Tensor qgemm(const TensorView& x, const QuantizedWeight& qw, const Stream* stream = nullptr,
             const QgemmOptions& options = {});

namespace reference {
QuantizedWeight quantize_weights(const TensorView& w, int group);
void dequantize_weights(const QuantizedWeight& qw, const TensorView& out);
// Double accumulation of x * w̃ over K, w̃ as dequantize_weights rounds it.
void qgemm(const TensorView& x, const QuantizedWeight& qw, const TensorView& y);
}  // namespace reference

}  // namespace fk
