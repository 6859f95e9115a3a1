// The CUDA launchers of the qgemm family, called by qgemm.cpp after every argument was checked.
#pragma once

#include "fusekit/ops/qgemm.hpp"

namespace fk::cuda {

// Which kernels qgemm may take. automatic: the weight-streaming kernel for M <= 16 (when x's chunk
// fits), else the wgmma kernel on sm_90, else the mma.sync tiles. mma_sync_tiles: the mma.sync
// tiles at any M on any device, so that the tests check on sm_90 the path that other GPUs take.
enum class QgemmPath { automatic, mma_sync_tiles };

// qgemm.cu
void qgemm(const TensorView& x, const QuantizedWeight& qw, const TensorView& y, const Stream* stream,
           QgemmPath path = QgemmPath::automatic);
void dequantize_weights(const QuantizedWeight& qw, const TensorView& out, const Stream* stream);

// qgemm_small_m.cu: M <= 16, the weight-streaming kernel. False (nothing launched) when M > 16 or
// x's chunk of K does not fit a CTA's shared memory; the caller then takes the tensor-core tiles.
bool qgemm_small_m(const TensorView& x, const QuantizedWeight& qw, const TensorView& y, const Stream* stream);

// qgemm_wgmma.cu: M > 16 on sm_90 (wgmma with the dequantized weights in registers). False
// (nothing launched) off sm_90.
bool qgemm_wgmma(const TensorView& x, const QuantizedWeight& qw, const TensorView& y, const Stream* stream);

}  // namespace fk::cuda
