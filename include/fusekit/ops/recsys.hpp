// Family `recsys`: the sparse and interaction ops of DLRM-style recommendation models.
#pragma once

namespace fk {

// How a raw one-hot value v becomes a row of a table of `rows` rows.
enum class RowHash {
  seed,       // (v + 1) % rows: the seed's modulus hash
  reference,  // v % rows: dlrm_s_pytorch.py's `% max_ind_range`
};

// Doubles of the device accumulator of the fused sigmoid + BCE: [0] the sum of the mean losses,
// [1] the number of calls, then the per-block partials of the fixed-order reduction.
inline constexpr int kSigmoidBceAccumulatorDoubles = 2 + 64;

}  // namespace fk
