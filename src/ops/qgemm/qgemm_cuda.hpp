// The CUDA launchers of the qgemm family, called by qgemm.cpp after every argument was checked.
#pragma once

#include "fusekit/ops/qgemm.hpp"

namespace fk::cuda {

// Which kernels qgemm may take. automatic: the weight-streaming kernel for M <= 16 (when x's chunk
// fits), else the wgmma kernel on sm_90, else the mma.sync tiles. mma_sync_tiles: the mma.sync
// tiles at any M on any device, so that the tests check on sm_90 the path that other GPUs take.
enum class QgemmPath { automatic, mma_sync_tiles };

// qgemm.cu
// options: QgemmOptions (constant_weights: the small-M kernel's programmatic dependent launch;
// reduction: the small-M kernel's split-K reduction).
void qgemm(const TensorView& x, const QuantizedWeight& qw, const TensorView& y, const Stream* stream,
           QgemmPath path = QgemmPath::automatic, const QgemmOptions& options = {});
void dequantize_weights(const QuantizedWeight& qw, const TensorView& out, const Stream* stream);

// qgemm_small_m.cu: M <= 16, the weight-streaming kernel. False (nothing launched) when M > 16 or
// x's chunk of K does not fit a CTA's shared memory; the caller then takes the tensor-core tiles.
// options.constant_weights (sm_90): launched as a programmatic dependent launch, its first weight
// loads issued before it waits for the kernel before it. options.reduction (sm_90): the split-K
// reduction, pull (cluster barriers + DSMEM reads) or push (st.async into the owner's mbarrier).
bool qgemm_small_m(const TensorView& x, const QuantizedWeight& qw, const TensorView& y, const Stream* stream,
                   const QgemmOptions& options = {});

// A plan of the wgmma kernel: nc consumer warpgroups of mw m64 blocks of N each — (2, 2), (2, 1)
// or (3, 1): 256, 128 or 192 rows a CTA — and the splits of K (1 to 8; one cluster of `splits`
// CTAs per output tile).
struct QgemmWgmmaPlan {
  int nc = 2, mw = 2, splits = 1;
};

// qgemm_wgmma.cu: M > 16 on sm_90 (wgmma with the dequantized weights in registers). False
// (nothing launched) off sm_90. `forced`, when not null, replaces the plan of the cost model (the
// tests run every plan it can pick on every shape).
bool qgemm_wgmma(const TensorView& x, const QuantizedWeight& qw, const TensorView& y, const Stream* stream,
                 const QgemmWgmmaPlan* forced = nullptr);

}  // namespace fk::cuda
