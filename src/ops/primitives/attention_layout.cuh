// Where the rows of attention's tensors are, for the kernels of attention_rowwise.cu and
// attention_mma_bwd.cu. Every layout keeps a row of D elements contiguous, so a row is an index in
// units of D, and a kernel needs only a sequence's lengths and where its rows start:
//   dense:  q, out, dout, dq [B, H, Sq, D]; k, v, dk, dv [B, Hk, Sk, D]; lse, delta [B, H, Sq]
//   packed: q, out, dout, dq [total_q, H, D]; k, v, dk, dv [total_k, Hk, D]; lse, delta
//           [H, total_q] (FlashAttention's varlen layout), sequence b's tokens from cu_seqlens[b]
//           to cu_seqlens[b + 1]
// A kernel templated on kPacked reads a sequence's place once (cu_seqlens[b], cu_seqlens[b + 1] of
// q and k); its dense instantiation computes the dense formulas with the call's Sq and Sk.
#pragma once

#include <cstdint>

#include "fusekit/core/tensor.hpp"
#include "fusekit/ops/attention.hpp"

namespace fk::cuda {

// One sequence (a batch entry): its lengths and where its rows are, each layout's formula written
// out (the dense ones are the formulas the dense kernels always used).
template <bool kPacked>
struct SeqRows {
  std::int64_t sq, sk;             // this sequence's query and key counts
  std::int64_t b;                  // dense: the batch index
  std::int64_t q0, k0;             // packed: its first query and key tokens
  std::int64_t heads, kv_heads, total_q;

  // q, out, dout, dq row of (q head h, query i).
  __device__ std::int64_t q_row(std::int64_t h, std::int64_t i) const {
    if constexpr (kPacked) return (q0 + i) * heads + h;
    else return (b * heads + h) * sq + i;
  }
  // k, v, dk, dv row of (k/v head kh, key j).
  __device__ std::int64_t kv_row(std::int64_t kh, std::int64_t j) const {
    if constexpr (kPacked) return (k0 + j) * kv_heads + kh;
    else return (b * kv_heads + kh) * sk + j;
  }
  // lse and delta element of (q head h, query i), contiguous in i.
  __device__ std::int64_t stat(std::int64_t h, std::int64_t i) const {
    if constexpr (kPacked) return h * total_q + q0 + i;
    else return (b * heads + h) * sq + i;
  }
  // Rows from one query (key) to the next.
  __device__ std::int64_t q_tok() const { return kPacked ? heads : 1; }
  __device__ std::int64_t kv_tok() const { return kPacked ? kv_heads : 1; }
};

// The layout of one call, by value into the kernels.
struct Layout {
  std::int64_t batch, heads, kv_heads;  // B, H, Hk
  std::int64_t sq, sk;         // a sequence's extent in the grid: dense Sq, Sk; packed max_seqlen_q, max_seqlen_k
  const std::int32_t* cu_q;    // packed: cu_seqlens_q [B + 1] (device memory)
  const std::int32_t* cu_k;    // packed: cu_seqlens_k [B + 1]
  std::int64_t total_q;        // packed: lse's head stride

  template <bool kPacked>
  __device__ SeqRows<kPacked> seq(std::int64_t b) const {
    if constexpr (kPacked) {
      const std::int64_t q0 = cu_q[b], k0 = cu_k[b];
      return {cu_q[b + 1] - q0, cu_k[b + 1] - k0, b, q0, k0, heads, kv_heads, total_q};
    } else {
      return {sq, sk, b, 0, 0, heads, kv_heads, total_q};
    }
  }
};
// Where a head's rows are in one of attention's tensors, in elements, from the tensor's own strides
// (any strides, the last one 1): row i of head `head` of batch entry `batch` of dense [B, H, S, D]
// at batch * b + head * h + i * s; token t of head `head` of packed [total, H, D] at head * h + t * s
// (b = 0). The sm_90 kernels read and
// write every tensor through these; the other kernels take contiguous tensors (attention.cpp
// copies the others).
struct HeadStrides {
  std::int64_t b, h, s;
  __device__ __host__ std::int64_t at(std::int64_t batch, std::int64_t head, std::int64_t row) const {
    return batch * b + head * h + row * s;
  }
};
inline HeadStrides head_strides(const TensorView& t) {
  if (t.rank() == 3) return {0, t.strides()[1], t.strides()[0]};
  return {t.strides()[0], t.strides()[1], t.strides()[2]};
}

// Row r of a tensor's rows in row-major order of its leading dimensions (dense (b, h, i) with
// r = (b H + h) S + i; packed (t, h) with r = t H + h), as an element offset from its strides: for
// the kernels that walk every row (delta, dq from its f32 accumulator).
struct RowOffsets {
  std::int64_t n1, n2;  // dense: H, S; packed: total, H
  std::int64_t s0, s1, s2;
  std::int64_t d;       // contiguous tensors: rows d apart, no divisions
  bool contiguous;
  bool narrow;          // fewer than 2^32 rows: the divisions in 32 bits
  __device__ std::int64_t at(std::int64_t r) const {
    if (contiguous) return r * d;
    if (narrow) {
      const auto u = static_cast<std::uint32_t>(r), m1 = static_cast<std::uint32_t>(n1),
                 m2 = static_cast<std::uint32_t>(n2);
      const std::uint32_t rest = u / m2;
      return (rest / m1) * s0 + (rest % m1) * s1 + (u % m2) * s2;
    }
    const std::int64_t i2 = r % n2, rest = r / n2, i1 = rest % n1, i0 = rest / n1;
    return i0 * s0 + i1 * s1 + i2 * s2;
  }
};
inline RowOffsets row_offsets(const TensorView& t) {
  constexpr std::int64_t kNarrow = std::int64_t{1} << 32;
  const std::int64_t d = t.size(t.rank() == 3 ? 2 : 3), rows = d > 0 ? t.numel() / d : 0;
  if (t.rank() == 3)
    return {t.size(0), t.size(1), 0, t.strides()[0], t.strides()[1], d, t.is_contiguous(), rows < kNarrow};
  return {t.size(1), t.size(2), t.strides()[0], t.strides()[1], t.strides()[2], d, t.is_contiguous(), rows < kNarrow};
}

// Dense when varlen is null, else packed.
inline Layout layout_of(const TensorView& q, const TensorView& k, const AttentionVarlen* varlen) {
  if (!varlen) return {q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), nullptr, nullptr, 0};
  return {varlen->cu_seqlens_q.size(0) - 1, q.size(1), k.size(1), varlen->max_seqlen_q, varlen->max_seqlen_k,
          varlen->cu_seqlens_q.data_as<const std::int32_t>(), varlen->cu_seqlens_k.data_as<const std::int32_t>(),
          q.size(0)};
}

}  // namespace fk::cuda
