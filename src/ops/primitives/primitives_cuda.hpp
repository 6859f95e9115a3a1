// The CUDA launchers of the primitives family, called by primitives.cpp after every argument was
// checked (shapes, dtypes, one CUDA device, contiguity, aliasing as the header allows) and with
// a non-empty output.
#pragma once

#include <cstdint>
#include <optional>

#include "fusekit/ops/primitives.hpp"

namespace fk::cuda {

// broadcast.cu: z has the broadcast shape of x and y.
void broadcast_binary(BinaryOp op, const TensorView& x, const TensorView& y, const TensorView& z, const Stream* stream);
void broadcast_binary_backward(BinaryOp op, const TensorView& x, const TensorView& y, const TensorView& dz,
                               const std::optional<TensorView>& dx, const std::optional<TensorView>& dy,
                               const Stream* stream);
// row_sum.cu: x [rows, cols], out [rows].
void row_sum(const TensorView& x, const TensorView& out, const Stream* stream);
// softmax.cu: x, y [rows, cols]; y is x or disjoint from it.
void softmax(const TensorView& x, const TensorView& y, const Stream* stream);
// conv2d.cu: x [N, C, H, W], w [O, C, KH, KW], y [N, O, Ho, Wo]; top/left: the zero rows/columns
// before the image (the rest of the padding, if any, lies after it).
void conv2d(const TensorView& x, const TensorView& w, const TensorView& y, std::int64_t top, std::int64_t left,
            const Stream* stream);

// batched_matmul_cute.cu: a [B, M, K], b [B, K, N], c [B, M, N], c overlapping neither a nor b.

// fusekit's tensor-core kernels; a/b bf16 or f16: the SM90 GEMM below where it applies, else the
// SM80 CuTe kernel. Throws fk::Error on GPUs before sm_80.
void batched_matmul_cute(const TensorView& a, const TensorView& b, const TensorView& c, const Stream* stream);
// batched_matmul_sm90.cu: CUTLASS's TMA + wgmma GEMM, batch as its L mode. Runs it and returns true
// on an sm_90 device when the shapes and pointers suit TMA (K, N multiples of 8; a, b, c 16-byte
// aligned; M, N, K > 0); returns false, having done nothing, otherwise. Every dimension fits int.
bool batched_matmul_sm90(const TensorView& a, const TensorView& b, const TensorView& c, const Stream* stream);

}  // namespace fk::cuda
