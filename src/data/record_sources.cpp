// Record sources over other sources (memory, slices, orders, concatenation) and the reference's
// day split and training orders (criteo.hpp).
#include "fusekit/data/criteo.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <random>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <array>
#include <thread>

#include "fusekit/core/error.hpp"

namespace fk::data {

namespace {

class MemorySource final : public RecordSource {
 public:
  explicit MemorySource(std::vector<RawRecord> r) : records_(std::move(r)) {}
  std::int64_t size() const override { return static_cast<std::int64_t>(records_.size()); }
  const RawRecord* mapped(std::int64_t i) const override { return &records_[static_cast<std::size_t>(i)]; }
  void read(std::int64_t begin, std::span<RawRecord> out) const override {
    FK_CHECK_ARG(begin >= 0 && begin + static_cast<std::int64_t>(out.size()) <= size(), "data::memory_source", "begin",
                 fmt::format("a range inside [0, {})", size()), fmt::format("[{}, {})", begin, begin + out.size()));
    std::copy_n(records_.begin() + begin, out.size(), out.begin());
  }

 private:
  std::vector<RawRecord> records_;
};

class SliceSource final : public RecordSource {
 public:
  SliceSource(std::shared_ptr<RecordSource> s, std::int64_t begin, std::int64_t end)
      : source_(std::move(s)), begin_(begin), end_(end) {
    FK_CHECK_ARG(0 <= begin && begin <= end && end <= source_->size(), "data::slice_source", "end",
                 fmt::format("0 <= begin <= end <= {}", source_->size()), fmt::format("[{}, {})", begin, end));
  }
  std::int64_t size() const override { return end_ - begin_; }
  const RawRecord* mapped(std::int64_t i) const override { return source_->mapped(begin_ + i); }
  void read(std::int64_t begin, std::span<RawRecord> out) const override {
    // Inside the slice: a read past its end must not reach the records after it (the test set).
    FK_CHECK_ARG(begin >= 0 && begin <= size() && static_cast<std::int64_t>(out.size()) <= size() - begin,
                 "data::slice_source", "begin", fmt::format("a range inside [0, {})", size()),
                 fmt::format("{} records at {}", out.size(), begin));
    source_->read(begin_ + begin, out);
  }

 private:
  std::shared_ptr<RecordSource> source_;
  std::int64_t begin_, end_;
};

class OrderedSource final : public RecordSource {
 public:
  OrderedSource(std::shared_ptr<RecordSource> s, std::vector<std::int64_t> order)
      : source_(std::move(s)), order_(std::move(order)) {
    const std::int64_t n = source_->size();
    for (std::size_t i = 0; i < order_.size(); ++i)
      FK_CHECK_ARG(order_[i] >= 0 && order_[i] < n, "data::ordered_source", "order",
                   fmt::format("indices in [0, {})", n), fmt::format("{} at position {}", order_[i], i));
  }
  std::int64_t size() const override { return static_cast<std::int64_t>(order_.size()); }
  void read(std::int64_t begin, std::span<RawRecord> out) const override {
    FK_CHECK_ARG(begin >= 0 && begin <= size() && static_cast<std::int64_t>(out.size()) <= size() - begin,
                 "data::ordered_source", "begin", fmt::format("a range inside [0, {})", size()),
                 fmt::format("{} records at {}", out.size(), begin));
    if (out.empty()) return;
    if (source_->mapped(order_[static_cast<std::size_t>(begin)]) != nullptr) {
      // Records in memory: their addresses first (verifying their blocks), then copies that
      // prefetch a few records ahead, so that the random order's cache misses overlap.
      constexpr std::size_t kAhead = 12;
      thread_local std::vector<const RawRecord*> at;
      at.resize(out.size());
      for (std::size_t i = 0; i < out.size(); ++i) at[i] = source_->mapped(order_[static_cast<std::size_t>(begin) + i]);
      for (std::size_t i = 0; i < out.size(); ++i) {
        if (i + kAhead < out.size()) {
          const char* p = reinterpret_cast<const char*>(at[i + kAhead]);
          __builtin_prefetch(p);
          __builtin_prefetch(p + 64);
          __builtin_prefetch(p + sizeof(RawRecord) - 1);
        }
        out[i] = *at[i];
      }
      return;
    }
    // Runs of consecutive indices (the file order, or a day's) are read at once.
    for (std::size_t i = 0; i < out.size();) {
      const std::int64_t first = order_[static_cast<std::size_t>(begin) + i];
      std::size_t run = 1;
      while (i + run < out.size() && order_[static_cast<std::size_t>(begin) + i + run] == first + static_cast<std::int64_t>(run))
        ++run;
      source_->read(first, out.subspan(i, run));
      i += run;
    }
  }

 private:
  std::shared_ptr<RecordSource> source_;
  std::vector<std::int64_t> order_;
};

class ConcatSource final : public RecordSource {
 public:
  explicit ConcatSource(std::vector<std::shared_ptr<RecordSource>> s) : sources_(std::move(s)) {
    begin_.push_back(0);
    for (std::size_t i = 0; i < sources_.size(); ++i) {
      FK_CHECK_ARG(sources_[i] != nullptr, "data::concat_source", "sources", "non-null sources",
                   fmt::format("null at {}", i));
      begin_.push_back(begin_.back() + sources_[i]->size());
    }
  }
  std::int64_t size() const override { return begin_.back(); }
  const RawRecord* mapped(std::int64_t i) const override {
    const std::size_t s = static_cast<std::size_t>(std::upper_bound(begin_.begin(), begin_.end(), i) - begin_.begin()) - 1;
    return sources_[s]->mapped(i - begin_[s]);
  }
  void read(std::int64_t begin, std::span<RawRecord> out) const override {
    FK_CHECK_ARG(begin >= 0 && begin <= size() && static_cast<std::int64_t>(out.size()) <= size() - begin,
                 "data::concat_source", "begin", fmt::format("a range inside [0, {})", size()),
                 fmt::format("{} records at {}", out.size(), begin));
    // The source holding `begin`: the last one starting at or before it (empty ones skipped).
    std::size_t s = static_cast<std::size_t>(std::upper_bound(begin_.begin(), begin_.end(), begin) - begin_.begin()) - 1;
    for (std::size_t i = 0; i < out.size(); ++s) {
      const std::int64_t at = begin + static_cast<std::int64_t>(i);
      const std::size_t n = static_cast<std::size_t>(std::min<std::int64_t>(begin_[s + 1] - at, static_cast<std::int64_t>(out.size() - i)));
      if (n == 0) continue;
      sources_[s]->read(at - begin_[s], out.subspan(i, n));
      i += n;
    }
  }

 private:
  std::vector<std::shared_ptr<RecordSource>> sources_;
  std::vector<std::int64_t> begin_;  // source i holds records [begin_[i], begin_[i + 1])
};

}  // namespace

std::shared_ptr<RecordSource> memory_source(std::vector<RawRecord> records) {
  return std::make_shared<MemorySource>(std::move(records));
}
std::shared_ptr<RecordSource> concat_source(std::vector<std::shared_ptr<RecordSource>> sources) {
  return std::make_shared<ConcatSource>(std::move(sources));
}
std::shared_ptr<RecordSource> slice_source(std::shared_ptr<RecordSource> source, std::int64_t begin, std::int64_t end) {
  return std::make_shared<SliceSource>(std::move(source), begin, end);
}
std::shared_ptr<RecordSource> ordered_source(std::shared_ptr<RecordSource> source, std::vector<std::int64_t> order) {
  return std::make_shared<OrderedSource>(std::move(source), std::move(order));
}

ReferenceSplit kaggle_split(std::int64_t records) {
  FK_CHECK_ARG(records >= 0, "data::kaggle_split", "records", ">= 0", std::to_string(records));
  constexpr std::int64_t kDays = 7;
  ReferenceSplit s;
  s.day_begin.assign(kDays + 1, 0);
  for (std::int64_t d = 0; d < kDays; ++d)
    s.day_begin[static_cast<std::size_t>(d + 1)] = s.day_begin[static_cast<std::size_t>(d)] + records / kDays +
                                                   (d < records % kDays ? 1 : 0);
  s.train_end = s.day_begin[kDays - 1];
  const std::int64_t last = records - s.train_end;
  s.test_begin = s.train_end;
  s.test_end = s.test_begin + (last + 1) / 2;  // np.array_split: the first part takes the extra record
  s.val_begin = s.test_end;
  s.val_end = records;
  return s;
}

std::vector<std::int64_t> training_order(std::span<const std::int64_t> day_begin, std::string_view randomize,
                                         std::uint64_t seed) {
  FK_CHECK_ARG(!day_begin.empty() && day_begin.front() == 0, "data::training_order", "day_begin",
               "day boundaries starting at 0", fmt::format("{} entries", day_begin.size()));
  for (std::size_t d = 1; d < day_begin.size(); ++d)
    FK_CHECK_ARG(day_begin[d] >= day_begin[d - 1], "data::training_order", "day_begin", "non-decreasing boundaries",
                 fmt::format("{} after {}", day_begin[d], day_begin[d - 1]));
  std::vector<std::int64_t> order(static_cast<std::size_t>(day_begin.back()));
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = static_cast<std::int64_t>(i);
  std::mt19937_64 engine(seed);
  // Fisher-Yates over [first, last) with unbiased bounded draws (rejection).
  const auto shuffle = [&](std::int64_t first, std::int64_t last) {
    for (std::int64_t i = last - first - 1; i > 0; --i) {
      const std::uint64_t bound = static_cast<std::uint64_t>(i) + 1;
      const std::uint64_t limit = std::numeric_limits<std::uint64_t>::max() - std::numeric_limits<std::uint64_t>::max() % bound;
      std::uint64_t x;
      do x = engine(); while (x >= limit);
      std::swap(order[static_cast<std::size_t>(first + i)], order[static_cast<std::size_t>(first) + x % bound]);
    }
  };
  if (randomize == "total") {
    shuffle(0, day_begin.back());
  } else if (randomize == "day") {
    for (std::size_t d = 0; d + 1 < day_begin.size(); ++d) shuffle(day_begin[d], day_begin[d + 1]);
  } else if (randomize != "none") {
    throw Error("data::training_order", "randomize", "total, day or none", std::string(randomize));
  }
  return order;
}

}  // namespace fk::data
