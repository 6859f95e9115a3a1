// weight_grad_from_packed on the GPU: dW [COUT, CIN] = beta * dW + dyᵀ · x̂, where dy [K, COUT] is
// bf16 row-major and x̂ [K, CIN] is dequantized on the fly from the packed activations (1, 2, 4 or
// 8 bits; docs/quant-format.md) and never exists in global memory. sm_90a only (wgmma, TMA). This
// file is the host side: checks, the split of K, the tensor maps and the choice of kernel; the
// kernels are in weight_grad_*.cuh, instantiated in weight_grad_from_packed_b{1,2,4,8}.cu. Why
// this design (warp roles, RS and SS paths, dequantization, split-K): docs/quant.md.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>

#include "fusekit/core/cuda_check.hpp"
#include "fusekit/core/error.hpp"
#include "fusekit/core/tensor.hpp"
#include "ops/common/cuda_common.cuh"
#include "ops/common/sm90_async.cuh"
#include "quant_cuda.hpp"
#include "weight_grad_traits.hpp"

namespace fk::cuda {
namespace {

using namespace wgrad;

// A row-major [rows, cols] tensor as a TMA source of box_cols x box_rows boxes, zeros outside.
CUtensorMap tensor_map_2d(const char* what, const void* base, CUtensorMapDataType type, int elem_bytes,
                          std::int64_t rows, std::int64_t cols, int box_cols, int box_rows, CUtensorMapSwizzle swizzle) {
  return sm90::tensor_map<2>(kOp, what, type, base, {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)},
                             {static_cast<cuuint64_t>(cols) * elem_bytes},
                             {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows)}, swizzle);
}

bool aligned(const void* ptr, std::uintptr_t a) { return reinterpret_cast<std::uintptr_t>(ptr) % a == 0; }

}  // namespace

void weight_grad_from_packed(const TensorView& dy, const PackedView& x, const TensorView& dw,
                             const WeightGradParams& wp, const Stream* stream) {
  const int device = dy.device().index;
  fk::detail::DeviceScope on_device(device);
  int major = 0, minor = 0;
  FK_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  FK_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  FK_CHECK_ARG(major == 9 && minor == 0, kOp, "device", "an sm_90 GPU (H100/H200: the kernel uses wgmma and TMA)",
               "sm_" + std::to_string(major * 10 + minor));
  FK_CHECK_ARG(x.group % 32 == 0, kOp, "x", "a group size that is a multiple of 32 on CUDA",
               "group " + std::to_string(x.group));

  const std::int64_t k = dy.size(0), cout = dy.size(1), cin = x.cols;
  if (cout == 0 || cin == 0) return;
  const cudaStream_t s = fk::detail::cuda_stream(stream);
  if (k == 0) {  // the sum over nothing: dW = beta * dW
    if (wp.beta == 0.0f) FK_CUDA_CHECK(cudaMemsetAsync(dw.data(), 0, dw.nbytes(), s));
    return;
  }
  constexpr std::int64_t kMaxDim = INT_MAX - 1024;
  FK_CHECK_ARG(k <= kMaxDim && cout <= kMaxDim, kOp, "dy", "every dimension below 2^31 - 1024 on CUDA",
               dy.shape().str());
  FK_CHECK_ARG(cin <= kMaxDim, kOp, "x", "at most 2^31 - 1024 columns on CUDA", std::to_string(cin));

  Params p{};
  p.dy = static_cast<const std::uint16_t*>(dy.data());
  p.words = static_cast<const std::uint32_t*>(x.words.data());
  p.scale = x.scale.data();
  p.min = x.min.data();
  p.dw = dw.data();
  p.k = k;
  p.cout = static_cast<int>(cout);
  p.cin = static_cast<int>(cin);
  p.groups = static_cast<int>(x.groups());
  p.group = x.group;
  p.row_words = static_cast<int>(x.groups() * x.words_per_group());
  p.kblocks = static_cast<int>((k + kBlockK - 1) / kBlockK);
  p.tiles_n = static_cast<int>((cin + kBlockN - 1) / kBlockN);
  const std::int64_t tiles = ((cout + kBlockM - 1) / kBlockM) * p.tiles_n;
  p.stats_bf16 = x.scale.dtype() == DType::bf16;
  p.dw_bf16 = dw.dtype() == DType::bf16;
  p.accumulate = wp.beta != 0.0f;
  // TMA needs 16-byte aligned bases and row strides.
  const std::int64_t row_bytes = static_cast<std::int64_t>(p.row_words) * 4;
  p.tma_a = cout % 8 == 0 && aligned(dy.data(), 16);
  p.tma_x = row_bytes % 16 == 0 && aligned(x.words.data(), 16);
  p.stats_bytes = p.stats_bf16 ? 2 : 4;
  p.tma_stats = aligned(p.scale, 16) && aligned(p.min, 16) && kBlockK * x.groups() * p.stats_bytes <= kStatsBytes;

  const int sms = multiprocessor_count();
  // One tile per CTA when the tiles fill the GPU; otherwise split K S ways, S = SMs / tiles (but
  // no fewer than kMinKBlocksPerCta k-blocks a CTA): CTA t * S + s takes k-blocks
  // [s KB / S, (s + 1) KB / S) of tile t. All CTAs run at once, and those of one k-range read the
  // same dy rows (6 n-tiles for CIN = 768) and packed rows (3 m-tiles) at about the same time, so
  // that both come from DRAM about once.
  const std::int64_t splits =
      tiles >= sms ? 1 : std::clamp<std::int64_t>(std::min<std::int64_t>(sms / tiles, p.kblocks / kMinKBlocksPerCta), 1, sms);
  p.splits = static_cast<int>(splits);
  const std::int64_t ctas = tiles * splits;
  FK_CHECK_ARG(ctas <= INT_MAX, kOp, "dw", "fewer than 2^31 tiles of 256x128", dw.shape().str());

  // Split partials: fp32 tiles, or fp16 tiles (half the bytes) followed by one exponent byte
  // per 8 values (see store_partial_f16).
  p.half_partials = splits > 1 && p.dw_bf16 && !wp.fp32_partials;
  fk::Tensor workspace;
  if (splits > 1) {
    const std::int64_t bytes = p.half_partials ? ctas * (kTileElems * 2 + kTileElems / 8) : ctas * kTileElems * 4;
    workspace = fk::Tensor::empty({bytes / 4}, DType::f32, dy.device(), stream);
    p.workspace = workspace.data_as<float>();
    if (p.half_partials)
      p.partial_exps = reinterpret_cast<std::uint8_t*>(p.workspace) + ctas * kTileElems * 2;
  }
  // dy: 64 (m) x 64 (k) boxes with the 128-byte swizzle wgmma reads. Packed words: the 128
  // columns (4 * bits words) x 64 rows of a k-block, swizzled so that the dequantizing threads
  // read them without bank conflicts.
  const CUtensorMap map_dy = p.tma_a ? tensor_map_2d("dy", dy.data(), CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, k, cout, 64,
                                                     kBlockK, CU_TENSOR_MAP_SWIZZLE_128B)
                                     : CUtensorMap{};
  const CUtensorMapSwizzle swizzle_x = x.bits == 1   ? CU_TENSOR_MAP_SWIZZLE_NONE
                                       : x.bits == 2 ? CU_TENSOR_MAP_SWIZZLE_32B
                                       : x.bits == 4 ? CU_TENSOR_MAP_SWIZZLE_64B
                                                     : CU_TENSOR_MAP_SWIZZLE_128B;
  const CUtensorMap map_x = p.tma_x ? tensor_map_2d("x.words", x.words.data(), CU_TENSOR_MAP_DATA_TYPE_UINT32, 4, k,
                                                    p.row_words, kBlockN * x.bits / 32, kBlockK, swizzle_x)
                                    : CUtensorMap{};
  // Register-sourced A (consume_rs) wherever its inputs allow: 2, 4 and 8 bits with bf16
  // statistics and every operand by TMA; else x̂ through shared memory (consume).
  const bool rs = x.bits != 1 && p.stats_bf16 && p.tma_a && p.tma_x && p.tma_stats;
  const unsigned grid = static_cast<unsigned>(ctas);
  switch (x.bits) {
    case 1: launch_main<1>(p, grid, map_dy, map_x, s); break;
    case 2: rs ? launch_main<2, true>(p, grid, map_dy, map_x, s) : launch_main<2>(p, grid, map_dy, map_x, s); break;
    case 4: rs ? launch_main<4, true>(p, grid, map_dy, map_x, s) : launch_main<4>(p, grid, map_dy, map_x, s); break;
    case 8: rs ? launch_main<8, true>(p, grid, map_dy, map_x, s) : launch_main<8>(p, grid, map_dy, map_x, s); break;
    default: throw_internal("weight_grad_from_packed: bits not checked by the caller");
  }
}

}  // namespace fk::cuda
