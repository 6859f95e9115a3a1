// Buckets of data-parallel gradients, for all-reduces overlapped with the backward (PyTorch DDP's
// gradient buckets): the gradients are one contiguous buffer, cut into units that the backward
// completes one after the other (a layer's weight and bias); a bucket is a run of consecutive units
// (in the backward's order) that tile one contiguous range of the buffer, of at most `bucket_bytes`
// (a unit larger than that is a bucket of its own). Each bucket's all-reduce starts once the backward
// has made its last unit, and the reduced buffer is what one all-reduce of the whole would give,
// element by element (each element is summed once, by one all-reduce).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace fk::dist {

// One unit of the gradient buffer: floats [offset, offset + floats), in the order the backward
// completes them.
struct GradientRange {
  std::int64_t offset = 0, floats = 0;
};

struct GradientBucket {
  std::int64_t offset = 0, floats = 0;  // the range of the buffer it all-reduces
  std::size_t first_unit = 0, last_unit = 0;  // units [first_unit, last_unit] in the backward's order
};

// The buckets of `units` (in the backward's order; they must tile [0, total) without overlap, fk::Error
// naming `units` otherwise), in the order their all-reduces start. bucket_bytes >= 1 (fk::Error);
// f32 gradients (4 bytes a float). A unit joins the bucket before it when the two stay one
// contiguous range within bucket_bytes; otherwise it starts the next bucket.
std::vector<GradientBucket> plan_gradient_buckets(std::span<const GradientRange> units, std::int64_t bucket_bytes);

// "gradient buckets: 3 of at most 25.0 MB over 1.2 MB: [top.3 .. top.0] 0.4 MB, ..." for a plan
// printout (unit names in the backward's order).
std::string gradient_buckets_str(std::span<const GradientBucket> buckets, std::span<const std::string> unit_names,
                                 std::int64_t bucket_bytes);

}  // namespace fk::dist
