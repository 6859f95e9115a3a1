// Raw launchers of the pointwise family's strided-row pieces (rows.cu): fp32 matrices [rows, cols]
// with a leading dimension `ld` >= cols (row r starts at r * ld), on stream `s`. Each returns
// after enqueueing (no synchronisation), so a caller can capture them in a CUDA graph. Callers
// check their arguments; these do not.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace fk::cuda {

// y[r, c] += bias[c].                                                      y: [rows, cols] (ld); bias: [cols]
void bias_add(float* y, const float* bias, std::int64_t rows, std::int64_t cols, std::int64_t ld, cudaStream_t s);
// y = max(y, 0) in place.                                                  y: [rows, cols] (ld)
void relu_inplace(float* y, std::int64_t rows, std::int64_t cols, std::int64_t ld, cudaStream_t s);
// dy[r, c] = y[r, c] > 0 ? dy[r, c] : 0 in place.                          dy: (ld_dy); y: (ld_y)
void relu_backward_inplace(float* dy, const float* y, std::int64_t rows, std::int64_t cols, std::int64_t ld_dy,
                           std::int64_t ld_y, cudaStream_t s);
// db[c] = sum_r dz[r, c] (=, overwritten), in a fixed order (deterministic). When y is not null the
// ReLU derivative is applied first and written back: dz = dz * (y > 0) (the fused bias-gradient
// pass). `partial` holds column_sum_partial_floats(rows, cols) floats of scratch.
void column_sum(float* dz, const float* y, float* db, std::int64_t rows, std::int64_t cols, std::int64_t ld_dz,
                std::int64_t ld_y, float* partial, cudaStream_t s);
std::size_t column_sum_partial_floats(std::int64_t rows, std::int64_t cols);

// dst [rows, cols] bf16 (contiguous) = src [rows, cols] f32 (leading dimension ld_src), rounded to nearest.
void to_bf16_rows(const float* src, std::int64_t ld_src, std::uint16_t* dst, std::int64_t rows, std::int64_t cols,
                  cudaStream_t s);
// dst [rows, cols] f32 (leading dimension ld_dst) = src [rows, cols] bf16 (contiguous).
void from_bf16_rows(const std::uint16_t* src, float* dst, std::int64_t ld_dst, std::int64_t rows, std::int64_t cols,
                    cudaStream_t s);

}  // namespace fk::cuda
