// Helpers shared by the recsys family's tests (recsys_test.cpp: the spec and bad inputs;
// recsys_gpu_test.cpp: the CUDA kernels against the spec).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "fusekit/fusekit.hpp"
#include "fusekit/ops/recsys.hpp"
#include "test_util.hpp"

namespace fk::recsys_test {

inline const Device kCpu = Device::cpu();

inline Tensor f32(Dims shape, const std::vector<float>& v) { return test::host_tensor(shape, DType::f32, v); }

inline Tensor i64(const std::vector<std::int64_t>& v) {
  Tensor t = Tensor::empty({static_cast<std::int64_t>(v.size())}, DType::i64, kCpu);
  std::copy(v.begin(), v.end(), t.data_as<std::int64_t>());
  return t;
}

inline Tensor i32(const std::vector<std::int32_t>& v) {
  Tensor t = Tensor::empty({static_cast<std::int64_t>(v.size())}, DType::i32, kCpu);
  std::copy(v.begin(), v.end(), t.data_as<std::int32_t>());
  return t;
}

inline std::vector<float> floats(const TensorView& t) {
  const Tensor h = test::to_host(t);
  return std::vector<float>(h.data_as<float>(), h.data_as<float>() + h.numel());
}

inline std::vector<std::int32_t> ints(const TensorView& t) {
  const Tensor h = test::to_host(t);
  return std::vector<std::int32_t>(h.data_as<std::int32_t>(), h.data_as<std::int32_t>() + h.numel());
}

// The pooled bags [B, T, D] inside a DLRM-like Z [B, T + 1, D]: bag (t, b) at Z[b, 1 + t].
inline TensorView pooled_in(const Tensor& z) {
  const std::int64_t b = z.size(0), f = z.size(1), d = z.size(2);
  return TensorView(z.data_as<float>() + d, DType::f32, {b, f - 1, d}, {f * d, d, 1}, z.device());
}

}  // namespace fk::recsys_test
