// How convert walks a view (convert.cpp checks it, convert.cu runs it): rows of `cols` contiguous
// elements, row r = (i0, i1, i2) over the leading sizes n[0..2] (row-major, unused leading sizes 1)
// at element offset i0 s[0] + i1 s[1] + i2 s[2].
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FK_WALK_FN __host__ __device__
#else
#define FK_WALK_FN
#endif

namespace fk {

struct ConvertWalk {
  std::int64_t n[3] = {1, 1, 1};
  std::int64_t s[3] = {0, 0, 0};
  std::int64_t cols = 0;
  FK_WALK_FN std::int64_t row(std::int64_t r) const {
    const std::int64_t i2 = r % n[2], rest = r / n[2];
    return (rest / n[1]) * s[0] + (rest % n[1]) * s[1] + i2 * s[2];
  }
  // Whether rows are r * s[2] apart (contiguous, or one row stride).
  bool plain_rows() const { return n[0] == 1 && n[1] == 1; }
};

}  // namespace fk

#undef FK_WALK_FN
