// How a raw 32-bit categorical value becomes a row of an embedding table: the one setting shared by
// the data (criteo.hpp's featurizer), the embedding lookup that fuses the hash in (ops/recsys.hpp)
// and the model (models/dlrm.hpp).
#pragma once

namespace fk {

// How a raw one-hot value v becomes a row of a table of `rows` rows.
enum class RowHash {
  seed,       // (v + 1) % rows: a plain modulus hash
  reference,  // v % rows: dlrm_s_pytorch.py's `% max_ind_range`
};

}  // namespace fk
