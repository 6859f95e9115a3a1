#include "fusekit/dist/gradient_buckets.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <numeric>

#include "fusekit/core/error.hpp"

namespace fk::dist {

std::vector<GradientBucket> plan_gradient_buckets(std::span<const GradientRange> units, std::int64_t bucket_bytes) {
  constexpr const char* op = "dist::plan_gradient_buckets";
  FK_CHECK_ARG(bucket_bytes >= 1, op, "bucket_bytes", ">= 1", fmt::format("{}", bucket_bytes));
  // The units must tile [0, total): sorted by offset, each starts where the one before ends.
  std::vector<std::size_t> order(units.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return units[a].offset < units[b].offset; });
  std::int64_t end = 0;
  for (const std::size_t u : order) {
    FK_CHECK_ARG(units[u].floats >= 1 && units[u].offset == end, op, "units",
                 "ranges of >= 1 float that tile [0, total) without gaps or overlaps",
                 fmt::format("unit {} at [{}, {}) after floats up to {}", u, units[u].offset,
                             units[u].offset + units[u].floats, end));
    end += units[u].floats;
  }
  const std::int64_t cap = std::max<std::int64_t>(1, bucket_bytes / 4);  // floats
  std::vector<GradientBucket> buckets;
  for (std::size_t u = 0; u < units.size(); ++u) {
    const GradientRange& r = units[u];
    if (!buckets.empty()) {
      GradientBucket& b = buckets.back();
      const bool below = r.offset + r.floats == b.offset, above = r.offset == b.offset + b.floats;
      if ((below || above) && b.floats + r.floats <= cap) {
        if (below) b.offset = r.offset;
        b.floats += r.floats;
        b.last_unit = u;
        continue;
      }
    }
    buckets.push_back({r.offset, r.floats, u, u});
  }
  return buckets;
}

std::string gradient_buckets_str(std::span<const GradientBucket> buckets, std::span<const std::string> unit_names,
                                 std::int64_t bucket_bytes) {
  const auto mb = [](std::int64_t floats) { return static_cast<double>(floats) * 4.0 / 1e6; };
  std::int64_t total = 0;
  for (const GradientBucket& b : buckets) total += b.floats;
  std::string s = fmt::format("gradient buckets: {} of at most {:.3g} MB over {:.3g} MB, all-reduced as the backward "
                              "makes them:",
                              buckets.size(), static_cast<double>(bucket_bytes) / 1e6, mb(total));
  const auto name = [&](std::size_t u) { return u < unit_names.size() ? unit_names[u] : fmt::format("unit {}", u); };
  for (const GradientBucket& b : buckets)
    s += b.first_unit == b.last_unit
             ? fmt::format(" [{}] {:.3g} MB;", name(b.first_unit), mb(b.floats))
             : fmt::format(" [{} .. {}] {:.3g} MB;", name(b.first_unit), name(b.last_unit), mb(b.floats));
  if (!buckets.empty()) s.back() = '\n';
  else s += " none\n";
  return s;
}

}  // namespace fk::dist
