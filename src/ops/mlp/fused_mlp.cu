// The whole MLP in one kernel, forward and backward (see ops/mlp.hpp), in the manner of tiny-cuda-nn's
// FullyFusedMLP: every layer's GEMM, bias and activation fused, x read once, y written once, the
// hidden activations never leaving the SM. This file is the host side: the parameter blocks, the
// choice of backward kernel by shared memory, the cuBLAS dW GEMMs when dW does not fit. The
// kernels: fused_mlp_forward.cu, fused_mlp_backward.cu, fused_mlp_backward_fused_dw.cu (shared
// device code in fused_mlp.cuh). How they work and why: docs/mlp.md.
// Assumes: bf16 or f16; checks (shapes, widths, shared-memory budget) done by mlp.cpp.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "fused_mlp_launch.hpp"
#include "fusekit/core/cuda_check.hpp"
#include "fusekit/ops/gemm.hpp"
#include "mlp_cuda.hpp"
#include "ops/common/cuda_common.cuh"

namespace fk::cuda {

using namespace mlp;  // the kernels' parameter blocks and launchers

std::size_t fused_mlp_smem_limit() {
  int dev = 0, bytes = 0;
  FK_CUDA_CHECK(cudaGetDevice(&dev));
  FK_CUDA_CHECK(cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  return static_cast<std::size_t>(bytes);
}

void fused_mlp_forward(const FusedMlpForwardArgs& a, const TensorView* hidden_out, const Stream* stream) {
  const fk::detail::DeviceScope on_device(a.x.device().index);
  MlpParams p{};
  p.x = a.x.data_as<const u16>();
  p.y = a.y.data_as<u16>();
  p.hidden = hidden_out != nullptr ? hidden_out->data_as<u16>() : nullptr;
  p.batch = a.x.size(0);
  p.in = static_cast<int>(a.x.size(1));
  p.out = static_cast<int>(a.y.size(1));
  p.layers = static_cast<int>(a.layers.size());
  for (int l = 0; l < p.layers; ++l) {
    p.w[l] = a.layers[static_cast<std::size_t>(l)].weight.data_as<const u16>();
    p.b[l] = a.layers[static_cast<std::size_t>(l)].bias.data_as<const u16>();
    p.act[l] = a.layers[static_cast<std::size_t>(l)].act;
  }
  const int hidden = static_cast<int>(a.layers[0].weight.size(0));
  const std::size_t smem = fused_mlp_smem_bytes(p.in, hidden, p.out, p.layers, hidden_out != nullptr);
  const cudaStream_t s = fk::detail::cuda_stream(stream);
  with_float_type(a.x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, float>) {
      switch (hidden) {
        case 16: return launch<T, 16>(p, smem, s);
        case 32: return launch<T, 32>(p, smem, s);
        case 64: return launch<T, 64>(p, smem, s);
        case 128: return launch<T, 128>(p, smem, s);
        default: throw_internal("fused_mlp_forward: hidden width not checked by the caller");
      }
    }
  });
}

void fused_mlp_backward(const FusedMlpBackwardArgs& a, const Stream* stream) {
  const fk::detail::DeviceScope on_device(a.x.device().index);
  const cudaStream_t s = fk::detail::cuda_stream(stream);
  const int layers = static_cast<int>(a.layers.size());
  const std::int64_t batch = a.x.size(0);
  if (batch == 0) {  // the sums over no rows
    for (int l = 0; l < layers; ++l) {
      const TensorView& dw = a.dweight[static_cast<std::size_t>(l)];
      const TensorView& db = a.dbias[static_cast<std::size_t>(l)];
      FK_CUDA_CHECK(cudaMemsetAsync(dw.data(), 0, dw.nbytes(), s));
      FK_CUDA_CHECK(cudaMemsetAsync(db.data(), 0, db.nbytes(), s));
    }
    return;
  }
  const int hidden = static_cast<int>(a.layers[0].weight.size(0));
  const int in = static_cast<int>(a.x.size(1)), out = static_cast<int>(a.y.size(1));
  const Device dev = a.x.device();
  const DType dt = a.x.dtype();
  const int n_bias = static_cast<int>(fused_mlp_bias_elems(hidden, out, layers));

  MlpBackwardParams p{};
  p.dy = a.dy.data_as<const u16>();
  p.y = a.y.data_as<const u16>();
  p.hidden = a.hidden.data_as<const u16>();
  p.x = a.x.data_as<const u16>();
  p.dx = a.dx ? a.dx->data_as<u16>() : nullptr;
  p.batch = batch;
  p.in = in;
  p.out = out;
  p.layers = layers;
  for (int l = 0; l < layers; ++l) {
    p.w[l] = a.layers[static_cast<std::size_t>(l)].weight.data_as<const u16>();
    p.act[l] = a.layers[static_cast<std::size_t>(l)].act;
  }
  DbOut d{};
  for (int l = 0; l < layers; ++l) d.db[l] = a.dbias[static_cast<std::size_t>(l)].data_as<float>();

  if (fused_mlp_backward_fused_dw_smem_bytes(in, hidden, out, layers) <= fused_mlp_smem_limit()) {
    // dW on chip: one kernel, then the fixed-order sums of the CTAs' dW and db.
    MlpFusedDwParams fp{};
    fp.b = p;
    const std::int64_t k0 = round_up(in, 16), n_out = round_up(out, 16);
    int dw_off = 0, acc_off = 0;
    DwOut dwo{};
    for (int l = 0; l < layers; ++l) {
      const int m = l == layers - 1 ? out : hidden, n = l == 0 ? in : hidden;
      const int m_pad = static_cast<int>(l == layers - 1 ? n_out : hidden), n_pad = static_cast<int>(l == 0 ? k0 : hidden);
      fp.dw_offset[l] = dwo.offset[l] = dw_off;
      fp.acc_offset[l] = acc_off;
      dwo.dw[l] = a.dweight[static_cast<std::size_t>(l)].data_as<float>();
      dw_off += m * n;
      acc_off += m_pad * n_pad;
    }
    dwo.offset[layers] = dw_off;
    fp.dw_total = dw_off;
    const std::size_t smem = fused_mlp_backward_fused_dw_smem_bytes(in, hidden, out, layers);
    const std::int64_t chunks = (batch + kChunkRows - 1) / kChunkRows;
    const int blocks = static_cast<int>(std::min<std::int64_t>(chunks, multiprocessor_count()));
    const Tensor dw_part = Tensor::empty({blocks, std::int64_t{dw_off}}, DType::f32, dev, stream);
    const Tensor db_part = Tensor::empty({blocks, std::int64_t{n_bias}}, DType::f32, dev, stream);
    fp.dw_part = dw_part.data_as<float>();
    fp.b.db_part = db_part.data_as<float>();
    with_float_type(dt, [&](auto tag) {
      using T = decltype(tag);
      if constexpr (!std::is_same_v<T, float>) {
        switch (hidden) {
          case 16: return launch_backward_fused_dw<T, 16>(fp, blocks, smem, s);
          case 32: return launch_backward_fused_dw<T, 32>(fp, blocks, smem, s);
          case 64: return launch_backward_fused_dw<T, 64>(fp, blocks, smem, s);
          case 128: return launch_backward_fused_dw<T, 128>(fp, blocks, smem, s);
          default: throw_internal("fused_mlp_backward: hidden width not checked by the caller");
        }
      }
    });
    launch_weight_grad_sum(dw_part.data_as<float>(), blocks, dw_off, layers, dwo, s);
    launch_bias_grad_sum(db_part.data_as<float>(), blocks, n_bias, hidden, layers, out, d, s);
    return;
  }

  // dW too large for shared memory: the kernel stores every g_l, cuBLAS forms the dW GEMMs.
  const Tensor g_hidden = Tensor::empty({std::int64_t{layers} - 1, batch, std::int64_t{hidden}}, dt, dev, stream);
  const Tensor g_out = Tensor::empty({batch, std::int64_t{out}}, dt, dev, stream);
  p.g_hidden = g_hidden.data_as<u16>();
  p.g_out = g_out.data_as<u16>();
  Tensor part;
  const std::size_t smem = fused_mlp_backward_smem_bytes(in, hidden, out, layers);
  const auto alloc_part = [&](std::int64_t blocks) {
    part = Tensor::empty({blocks, std::int64_t{n_bias}}, DType::f32, dev, stream);
    return part.data_as<float>();
  };
  float* db_part = nullptr;
  int blocks = 0;
  with_float_type(dt, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, float>) {
      switch (hidden) {
        case 16: blocks = launch_backward<T, 16>(p, smem, s, &db_part, alloc_part); return;
        case 32: blocks = launch_backward<T, 32>(p, smem, s, &db_part, alloc_part); return;
        case 64: blocks = launch_backward<T, 64>(p, smem, s, &db_part, alloc_part); return;
        case 128: blocks = launch_backward<T, 128>(p, smem, s, &db_part, alloc_part); return;
        default: throw_internal("fused_mlp_backward: hidden width not checked by the caller");
      }
    }
  });
  launch_bias_grad_sum(db_part, blocks, n_bias, hidden, layers, out, d, s);

  // dW_l = g_lᵀ · h_{l-1} (h_{-1} = x), fp32 output.
  const auto h_slice = [&](int l, std::int64_t width) {
    return TensorView(a.hidden.data_as<u16>() + static_cast<std::int64_t>(l) * batch * hidden, dt, {batch, width}, dev);
  };
  const auto g_slice = [&](int l) {
    return TensorView(g_hidden.data_as<u16>() + static_cast<std::int64_t>(l) * batch * hidden, dt, {batch, hidden}, dev);
  };
  matmul(g_slice(0), a.x, a.dweight[0], Trans::t, Trans::n, stream);
  for (int l = 1; l < layers - 1; ++l)
    matmul(g_slice(l), h_slice(l - 1, hidden), a.dweight[static_cast<std::size_t>(l)], Trans::t, Trans::n, stream);
  matmul(g_out, h_slice(layers - 2, hidden), a.dweight[static_cast<std::size_t>(layers - 1)], Trans::t, Trans::n, stream);
}

}  // namespace fk::cuda
