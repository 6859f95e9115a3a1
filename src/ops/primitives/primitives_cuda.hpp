// The CUDA launchers of the primitives family (batched_matmul_cute.cu), called by primitives.cpp
// after every argument was checked: a [B, M, K], b [B, K, N], c [B, M, N], row-major contiguous,
// on one CUDA device, c not empty, c overlapping neither a nor b.
#pragma once

#include "fusekit/ops/primitives.hpp"

namespace fk::cuda {

// cuBLAS strided-batched GEMM, fp32 compute (no TF32); a/b f32, bf16 or f16.
void batched_matmul_cublas(const TensorView& a, const TensorView& b, const TensorView& c, const Stream* stream);
// fusekit's CuTe tensor-core kernel; a/b bf16 or f16. Throws fk::Error on GPUs before sm_80.
void batched_matmul_cute(const TensorView& a, const TensorView& b, const TensorView& c, const Stream* stream);

}  // namespace fk::cuda
