// Host-side helpers every CUDA launcher of fusekit uses: the current device's SM count, and the
// dispatch from a floating DType to its CUDA element type.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "fusekit/core/cuda_check.hpp"
#include "fusekit/core/dtype.hpp"

namespace fk::cuda {

// True when p is 16-byte aligned: the condition for 16-byte vector accesses and TMA sources.
inline bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

// Multiprocessors of the current device.
inline int multiprocessor_count() {
  int dev = 0, sms = 0;
  FK_CUDA_CHECK(cudaGetDevice(&dev));
  FK_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  return sms;
}

// Whether `device` is an sm_90 GPU (H100/H200): sm_90a code (wgmma, TMA) runs there only.
inline bool is_sm90(int device) {
  int major = 0, minor = 0;
  FK_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  FK_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  return major == 9 && minor == 0;
}

// Calls f(T{}) with T = float, __nv_bfloat16 or __half for f32, bf16, f16.
template <class F>
void with_float_type(DType t, F&& f) {
  switch (t) {
    case DType::f32: return f(float{});
    case DType::bf16: return f(__nv_bfloat16{});
    case DType::f16: return f(__half{});
    default: throw_internal("with_float_type: dtype not checked by the caller");
  }
}

}  // namespace fk::cuda
