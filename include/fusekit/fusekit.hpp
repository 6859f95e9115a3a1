// Everything public in one include.
#pragma once

#include "fusekit/core/allocator.hpp"
#include "fusekit/core/device.hpp"
#include "fusekit/core/dlpack.hpp"
#include "fusekit/core/dtype.hpp"
#include "fusekit/core/error.hpp"
#include "fusekit/core/event.hpp"
#include "fusekit/core/random.hpp"
#include "fusekit/core/stream.hpp"
#include "fusekit/core/tensor.hpp"
#include "fusekit/core/trace.hpp"
#include "fusekit/ops/gemm.hpp"
#include "fusekit/ops/pointwise.hpp"
#include "fusekit/ops/glu.hpp"
#include "fusekit/ops/mlp.hpp"
#include "fusekit/ops/lora.hpp"
#include "fusekit/ops/loss.hpp"
#include "fusekit/ops/primitives.hpp"
#include "fusekit/ops/attention.hpp"
#include "fusekit/ops/qgemm.hpp"
#include "fusekit/ops/quant.hpp"
#include "fusekit/ops/recsys.hpp"
#include "fusekit/ops/norm.hpp"
#include "fusekit/nn/compressed.hpp"
#include "fusekit/nn/fused_mlp.hpp"
#include "fusekit/nn/glu.hpp"
#include "fusekit/nn/linear.hpp"
#include "fusekit/nn/lora.hpp"

namespace fk {
// Build description: commit, CUDA targets, compiler version, build type.
struct BuildInfo {
  const char* version;
  const char* commit;
  bool cuda;
  const char* cuda_targets;
  const char* cuda_compiler;
  const char* build_type;
};
BuildInfo build_info() noexcept;
}  // namespace fk
