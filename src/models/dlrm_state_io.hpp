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

}  // namespace fk::models::detail
