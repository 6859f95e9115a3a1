// Where a tensor lives: the host, or one CUDA device.
#pragma once

#include <string>
#include <string_view>

namespace fk {

struct Device {
  enum class Kind { cpu, cuda };
  Kind kind = Kind::cpu;
  int index = 0;  // CUDA ordinal; 0 for the CPU

  static constexpr Device cpu() noexcept { return {Kind::cpu, 0}; }
  static constexpr Device cuda(int i = 0) noexcept { return {Kind::cuda, i}; }
  static Device parse(std::string_view s);  // "cpu", "cuda", "cuda:1"; throws fk::Error

  bool is_cpu() const noexcept { return kind == Kind::cpu; }
  bool is_cuda() const noexcept { return kind == Kind::cuda; }
  std::string str() const;  // "cpu" or "cuda:N"
  friend bool operator==(const Device&, const Device&) = default;
};

// Number of usable CUDA devices: 0 in a CPU-only build, or when no driver or GPU is present.
int cuda_device_count() noexcept;
// Why there is no usable GPU (empty when there is one): shown by tests that skip.
std::string cuda_unavailable_reason();
// True when fusekit was built with its CUDA kernels.
bool built_with_cuda() noexcept;

}  // namespace fk
