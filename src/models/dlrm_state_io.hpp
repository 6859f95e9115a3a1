// The state part of a DLRM checkpoint (Dlrm::save_state / load_state): "FKDLRMS1", an Adagrad
// flag, the number of arrays, then each array's length and its f32 values, copied through host
// memory in chunks (the arrays may live on a GPU).
#pragma once

#include <cstdint>
#include <istream>
#include <ostream>
#include <vector>

#include "fusekit/core/tensor.hpp"

namespace fk::models::detail {

void write_state(std::ostream& out, bool adagrad, const std::vector<TensorView>& arrays);
// The header's Adagrad flag; `count` gets the number of arrays. fk::Error for another stream.
bool read_state_header(std::istream& in, std::uint64_t& count);
// Reads the arrays into `arrays` (this configuration's): fk::Error when their number or sizes differ.
void read_state_arrays(std::istream& in, std::uint64_t count, const std::vector<TensorView>& arrays);
// The next array of a state whose sizes are not known in advance: fk::Error (op, argument `arg`)
// for one of more than `max_floats` values or a truncated stream.
std::vector<float> read_state_array(std::istream& in, std::uint64_t max_floats, const char* op, const char* arg);

// Host f32 values into a host tensor of 16 bits (bf16, f16), each rounded to nearest (exact for
// values a 16-bit array saved).
void narrow(const float* from, const Tensor& to);

// A rounding step (the number of updates a stochastically rounded part has made) as the state keeps
// it: two f32 values, its low 24 bits and the rest, each a whole number below 2^24 (exact below
// 2^48 steps). steps_from_floats: fk::Error (op, argument "in") for values that are not.
void step_to_floats(std::uint64_t step, float* two);
std::uint64_t step_from_floats(const float* two, const char* op);

}  // namespace fk::models::detail
