// Dense parameters and their optimizers.
//
//   ParameterArena  the f32 parameters of several layers in one buffer, their gradients in a second
//                   buffer of the same layout and, once Adagrad has run, its state in a third, so
//                   that one launch updates every parameter (ops/recsys dense_optimizer_update)
//
// Update rules (PyTorch's): SGD p -= lr g; Adagrad state += g^2, p -= lr g / (sqrt(state) + eps),
// the state starting at initial_accumulator. Each parameter starts 256-byte aligned; a matrix may
// have a row stride wider than its columns (padded rows, for 16-byte aligned GEMM operands). The
// gaps and padding are zero in the values and gradients alike, so an update leaves them zero.
#pragma once

#include <cstdint>
#include <deque>
#include <optional>
#include <string_view>
#include <vector>

#include "fusekit/core/tensor.hpp"

namespace fk {
class Stream;
}

namespace fk::nn {

enum class OptimizerKind { sgd, adagrad };
OptimizerKind parse_optimizer(std::string_view name);  // "sgd" | "adagrad"; throws fk::Error
std::string_view optimizer_name(OptimizerKind k);

struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::sgd;
  float learning_rate = 0.1f;
  float eps = 1e-10f;                // Adagrad (PyTorch's default)
  float initial_accumulator = 0.0f;  // Adagrad
};

class ParameterArena {
 public:
  // Room for `capacity` floats (the sum of floats_for() over the parameters to come) on `device`,
  // values and gradients zeroed.
  ParameterArena(std::int64_t capacity, Device device);
  ParameterArena(ParameterArena&&) noexcept = default;
  ParameterArena& operator=(ParameterArena&&) noexcept = default;

  // The floats a parameter of `shape` (rank 1 or 2) with row stride `row_stride` takes, its
  // alignment gap included (row_stride 0: the columns).
  static std::int64_t floats_for(const Dims& shape, std::int64_t row_stride = 0);

  struct Parameter {
    Tensor value, grad;  // views of the arena: `shape`, strides (row_stride, 1) for a matrix
    std::int64_t offset = 0;  // first float in the arena
  };
  // The next parameter, zero (value and gradient). Throws fk::Error when the arena is full. The
  // reference stays valid for the arena's life (adding more parameters does not move it).
  const Parameter& add(const Dims& shape, std::int64_t row_stride = 0);

  const std::deque<Parameter>& parameters() const noexcept { return params_; }
  Device device() const noexcept { return device_; }
  // The Adagrad state of parameter i (shape and strides of its value); null before the first
  // Adagrad step or ensure_state().
  std::optional<TensorView> state(std::size_t i) const;
  bool has_state() const noexcept { return state_.data() != nullptr; }
  // Every parameter's gradient as one contiguous f32 [floats used] buffer (the alignment gaps
  // zero): what data-parallel ranks all-reduce in one call.
  TensorView gradients() const;
  // Allocates the Adagrad state at `initial_accumulator` when there is none; drop_state frees it.
  void ensure_state(float initial_accumulator, const Stream* stream = nullptr);
  void drop_state() noexcept { state_ = Tensor(); }

  // One optimizer step on every parameter from its gradient: one launch over the whole arena, or
  // (one_launch false, the unfused baseline) one launch per parameter.
  void step(const OptimizerConfig& opt, bool one_launch, const Stream* stream = nullptr);

 private:
  TensorView view_of(const Tensor& buffer, const Parameter& p) const;
  Device device_;
  Tensor values_, grads_, state_;
  std::int64_t used_ = 0;
  std::deque<Parameter> params_;  // a deque: add() hands out references that must not move
  std::vector<std::int64_t> extent_;  // floats each parameter spans (for the per-parameter launches)
};

}  // namespace fk::nn
