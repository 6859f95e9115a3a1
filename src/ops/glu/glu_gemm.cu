// The fused GLU GEMM's entry point: checks what the Hopper kernels need, picks the tile
// configuration, and calls the kernels of the requested kind (glu_gemm.cuh, one translation unit
// a kind: glu_gemm_<kind>.cu).
#include <cstdint>

#include "fusekit/core/tensor.hpp"
#include "glu_cuda.hpp"
#include "glu_gemm_kinds.hpp"
#include "ops/common/cuda_common.cuh"

namespace fk::cuda {

bool glu_gemm_fused(const TensorView& x, const TensorView& w, const TensorView* bias, const TensorView* dy,
                    const TensorView& out, const TensorView* db_partial, const TensorView* preact,
                    const GluOptions& opt, const Stream* stream) {
  const DType t = x.dtype();
  if (t != DType::bf16 && t != DType::f16 && t != DType::f32) return false;
  if (t == DType::f32 && !opt.allow_tf32) return false;
  const std::int64_t k = x.size(1), align = 16 / static_cast<std::int64_t>(dtype_size(t));
  if (k % align != 0 || k == 0) return false;  // TMA needs 16-byte rows
  for (const TensorView* p : {&x, &w, &out})
    if (!aligned16(p->data())) return false;
  if (bias != nullptr && !aligned16(bias->data())) return false;  // read in 2-element pairs
  if (preact != nullptr && (dy != nullptr || !aligned16(preact->data()))) return false;
  if (x.size(0) > INT32_MAX / 2 || w.size(0) > INT32_MAX / 2 || k > INT32_MAX / 2) return false;
  const fk::detail::DeviceScope on_device(x.device().index);
  if (!is_sm90(x.device().index)) return false;
  // More than two waves of 128 x 256 tiles: ping-pong.
  const std::int64_t tiles = ((x.size(0) + 127) / 128) * ((w.size(0) + 255) / 256);
  const bool many = tiles > 2 * static_cast<std::int64_t>(multiprocessor_count());
  const TensorView* part = dy != nullptr ? db_partial : nullptr;
  const TensorView* keep = dy == nullptr ? preact : nullptr;
  switch (opt.kind) {
    case GluKind::sigmoid_tanh: glu_gemm_run<GluKind::sigmoid_tanh>(x, w, bias, dy, out, part, keep, many, stream); break;
    case GluKind::swiglu: glu_gemm_run<GluKind::swiglu>(x, w, bias, dy, out, part, keep, many, stream); break;
    case GluKind::geglu_tanh: glu_gemm_run<GluKind::geglu_tanh>(x, w, bias, dy, out, part, keep, many, stream); break;
    case GluKind::geglu_erf: glu_gemm_run<GluKind::geglu_erf>(x, w, bias, dy, out, part, keep, many, stream); break;
    case GluKind::reglu: glu_gemm_run<GluKind::reglu>(x, w, bias, dy, out, part, keep, many, stream); break;
  }
  return true;
}

}  // namespace fk::cuda
