// The CUDA launchers of the loss family (cross_entropy_rows.cu), called by loss.cpp after every
// argument was checked.
#pragma once

#include <cstdint>

#include "fusekit/core/tensor.hpp"
#include "fusekit/ops/loss.hpp"

namespace fk::cuda {

// status [2] i64 (written): status[0] = the rows whose target is not ignore_index, status[1] = the
// first row whose target is neither ignore_index nor in [0, v), or n when there is none.
void loss_count_targets(const TensorView& targets, std::int64_t v, std::int64_t ignore_index, const TensorView& status,
                        const Stream* stream);

struct CrossEntropyRowsArgs {
  // [rows, v] in `grad_dtype` (the operands') with row stride ld (a multiple of 8: 16-byte aligned
  // rows): z = h_c wᵀ in, and out, in place, g, the same elements (padding up to ld written 0).
  void* logits = nullptr;
  std::int64_t rows = 0, v = 0, ld = 0;
  DType grad_dtype = DType::f32;
  const void* bias = nullptr;              // [v] in grad_dtype, or null
  const std::int64_t* targets = nullptr;   // [rows]
  const std::int64_t* status = nullptr;    // loss_count_targets' output: the count for the mean
  float* row_loss = nullptr;               // [rows]: loss_i (0 for ignored rows)
};
void cross_entropy_rows(const CrossEntropyRowsArgs& args, const LinearCrossEntropyParams& p, const Stream* stream);

// loss[0] = Σ row_loss (double, fixed order) / (mean ? status[0] : 1); loss f32.
void loss_total(const TensorView& row_loss, const TensorView& status, LossReduction reduction, const TensorView& loss,
                const Stream* stream);

// Every element of a contiguous float tensor set to 1.
void fill_ones(const TensorView& t, const Stream* stream);

}  // namespace fk::cuda
