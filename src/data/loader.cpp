// Batches from raw records, and the loader that prepares them on background threads: a ring of
// batch slots (max(prefetch, workers) + 1), filled by the workers (worker w makes batches w,
// w + W, ...) and handed out in batch order to the consumer.
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>

#include "fusekit/core/error.hpp"
#include "fusekit/data/criteo.hpp"

#if FUSEKIT_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace fk::data {

namespace {

void ensure(Tensor& t, Dims shape, DType dtype, const HostAllocator& allocate) {
  if (t.dtype() == dtype && t.shape() == shape && t.data() != nullptr) return;
  t = allocate ? allocate(shape, dtype) : Tensor::empty(shape, dtype, Device::cpu());
  FK_CHECK_ARG(t.device().is_cpu() && t.shape() == shape && t.dtype() == dtype, "data::make_batch", "allocate",
               fmt::format("host {} {}", dtype_name(dtype), shape.str()), t.view().str());
}

// Multi-hot bags (Featurizer::multi_hot_sizes): CSR only, bag (t, i) at indices
// [B * start_t + i * size_t, + size_t), start_t the sizes of the tables before t.
void make_multi_hot_batch(std::span<const RawRecord> records, const Featurizer& featurizer, Batch& batch,
                          const HostAllocator& allocate) {
  const std::int64_t b = batch.size;
  const std::vector<std::int64_t>& sizes = featurizer.multi_hot_sizes;
  std::int64_t per_sample = 0;
  for (std::int64_t m : sizes) per_sample += m;
  ensure(batch.indices, {per_sample * b}, DType::i64, allocate);
  ensure(batch.offsets, {kNumSparse * b + 1}, DType::i64, allocate);
  batch.raw_sparse = Tensor();
  float* labels = batch.labels.data_as<float>();
  float* dense = batch.dense.data_as<float>();
  std::int64_t* idx = batch.indices.data_as<std::int64_t>();
  std::int64_t* off = batch.offsets.data_as<std::int64_t>();
  std::int64_t start = 0;  // B * the sizes of the tables before t
  for (int t = 0; t < kNumSparse; ++t) {
    const std::int64_t m = sizes[static_cast<std::size_t>(t)];
    for (std::int64_t i = 0; i < b; ++i) {
      const RawRecord& r = records[static_cast<std::size_t>(i)];
      const std::int64_t row = featurizer.hash_index(t, r.sparse[static_cast<std::size_t>(t)]);
      off[t * b + i] = start + i * m;
      for (std::int64_t k = 0; k < m; ++k) idx[start + i * m + k] = featurizer.multi_hot_row(t, row, k);
    }
    start += b * m;
  }
  off[kNumSparse * b] = start;
  for (std::int64_t i = 0; i < b; ++i) {
    const RawRecord& r = records[static_cast<std::size_t>(i)];
    FK_CHECK_ARG(r.label == 0 || r.label == 1, "data::make_batch", "records", "labels 0 or 1",
                 fmt::format("{} in record {} of the batch", r.label, i));
    labels[i] = static_cast<float>(r.label);
    for (int j = 0; j < kNumDense; ++j) dense[i * kNumDense + j] = Featurizer::dense_transform(r.dense[j]);
  }
}

}  // namespace

void make_batch(std::span<const RawRecord> records, const Featurizer& featurizer, Batch& batch,
                const HostAllocator& allocate, bool bags) {
  featurizer.validate();
  const std::int64_t b = static_cast<std::int64_t>(records.size());
  batch.size = b;
  batch.global_size = b;
  ensure(batch.labels, {b}, DType::f32, allocate);
  ensure(batch.dense, {b, kNumDense}, DType::f32, allocate);
  if (featurizer.multi_hot()) return make_multi_hot_batch(records, featurizer, batch, allocate);
  if (bags) {
    ensure(batch.indices, {kNumSparse * b}, DType::i64, allocate);
    ensure(batch.offsets, {kNumSparse * b + 1}, DType::i64, allocate);
  } else {
    batch.indices = Tensor();
    batch.offsets = Tensor();
  }
  ensure(batch.raw_sparse, {kNumSparse * b}, DType::i32, allocate);
  float* labels = batch.labels.data_as<float>();
  float* dense = batch.dense.data_as<float>();
  std::int64_t* idx = bags ? batch.indices.data_as<std::int64_t>() : nullptr;
  std::uint32_t* raw = static_cast<std::uint32_t*>(batch.raw_sparse.data());
  // With a vocabulary, raw_sparse holds the ids, which the reference hash v % rows leaves unchanged.
  const bool ids = featurizer.vocabulary != nullptr;
  std::array<std::int64_t, kNumSparse> rows{};
  if (featurizer.premapped)
    for (int t = 0; t < kNumSparse; ++t) rows[static_cast<std::size_t>(t)] = featurizer.rows(t);
  for (std::int64_t i = 0; i < b; ++i) {
    const RawRecord& r = records[static_cast<std::size_t>(i)];
    FK_CHECK_ARG(r.label == 0 || r.label == 1, "data::make_batch", "records", "labels 0 or 1",
                 fmt::format("{} in record {} of the batch", r.label, i));
    labels[i] = static_cast<float>(r.label);
    if (featurizer.premapped) {  // ids already: checked against their tables, copied
      for (int j = 0; j < kNumDense; ++j) dense[i * kNumDense + j] = Featurizer::dense_transform(r.dense[j]);
      for (int t = 0; t < kNumSparse; ++t) {
        const std::uint32_t v = r.sparse[static_cast<std::size_t>(t)];
        if (static_cast<std::int64_t>(v) >= rows[static_cast<std::size_t>(t)]) featurizer.hash_index(t, v);  // throws
        raw[t * b + i] = v;
        if (bags) idx[t * b + i] = v;
      }
      continue;
    }
    for (int j = 0; j < kNumDense; ++j) dense[i * kNumDense + j] = Featurizer::dense_transform(r.dense[j]);
    for (int t = 0; t < kNumSparse; ++t) {
      const std::uint32_t v = r.sparse[t];
      if (!bags && !ids) {
        raw[t * b + i] = v;
        continue;
      }
      const std::int64_t row = featurizer.hash_index(t, v);
      if (bags) idx[t * b + i] = row;
      raw[t * b + i] = ids ? static_cast<std::uint32_t>(row) : v;
    }
  }
  if (bags) {
    std::int64_t* off = batch.offsets.data_as<std::int64_t>();
    for (std::int64_t k = 0; k <= kNumSparse * b; ++k) off[k] = k;
  }
}

std::pair<std::int64_t, std::int64_t> slice_of(std::int64_t n, int rank, int ranks) {
  FK_CHECK_ARG(ranks >= 1 && rank >= 0 && rank < ranks && n >= 0, "data::slice_of", "rank",
               "a rank in [0, ranks) of ranks >= 1, n >= 0", fmt::format("rank {} of {}, n {}", rank, ranks, n));
  const std::int64_t base = n / ranks, extra = n % ranks;
  const std::int64_t begin = rank * base + std::min<std::int64_t>(rank, extra);
  return {begin, begin + base + (rank < extra ? 1 : 0)};
}

struct BatchLoader::State {
  std::shared_ptr<RecordSource> source;
  Featurizer featurizer;
  LoaderOptions options;
  std::int64_t num_batches = 0;
  std::int64_t per_epoch = 0;  // batches of one pass over the source

  std::vector<Batch> slots;
  std::vector<std::int64_t> ready;  // per slot: the batch it holds, ready for the consumer (-1: none)
  std::mutex mutex;
  std::condition_variable changed;
  std::int64_t handed = 0;    // batches handed to the consumer
  std::int64_t released = 0;  // batches whose slot the consumer has given back
  bool stop = false;
  std::exception_ptr error;
  std::vector<std::thread> workers;

  std::int64_t num_slots() const { return static_cast<std::int64_t>(slots.size()); }

  // Worker w makes batches w, w + W, w + 2W, ...; batch k goes to slot k % slots once the batch
  // that slot held before (k - slots) has been given back.
  void produce(std::int64_t w, std::int64_t num_workers) {
    std::vector<RawRecord> records;
    try {
      for (std::int64_t k = w; k < num_batches; k += num_workers) {
        {
          std::unique_lock lock(mutex);
          changed.wait(lock, [&] { return stop || k - released < num_slots(); });
          if (stop) return;
        }
        // Batch k is batch (first + k) % per_epoch of its epoch.
        const std::int64_t begin = (options.first_batch + k) % per_epoch * options.batch_size;
        const std::int64_t n = std::min(options.batch_size, source->size() - begin);
        // This rank's slice of the batch, alone (the whole batch without slicing).
        const auto [lo, hi] = slice_of(n, options.slice_rank, options.slice_ranks);
        records.resize(static_cast<std::size_t>(hi - lo));
        if (hi > lo) source->read(begin + lo, records);
        Batch& slot = slots[static_cast<std::size_t>(k % num_slots())];
        make_batch(records, featurizer, slot, options.allocate, options.bags);
        slot.global_size = n;
        {
          std::lock_guard lock(mutex);
          ready[static_cast<std::size_t>(k % num_slots())] = k;
        }
        changed.notify_all();
      }
    } catch (...) {
      std::lock_guard lock(mutex);
      if (!error) error = std::current_exception();
      changed.notify_all();
    }
  }
};

BatchLoader::BatchLoader(std::shared_ptr<RecordSource> source, Featurizer featurizer, LoaderOptions options)
    : state_(std::make_unique<State>()) {
  FK_CHECK_ARG(options.batch_size >= 1, "data::BatchLoader", "batch_size", ">= 1", fmt::format("{}", options.batch_size));
  FK_CHECK_ARG(options.prefetch >= 1, "data::BatchLoader", "prefetch", ">= 1", fmt::format("{}", options.prefetch));
  FK_CHECK_ARG(options.workers >= 1, "data::BatchLoader", "workers", ">= 1", fmt::format("{}", options.workers));
  featurizer.validate();
  FK_CHECK_ARG(options.epochs >= 0, "data::BatchLoader", "epochs", ">= 0", fmt::format("{}", options.epochs));
  FK_CHECK_ARG(options.slice_ranks >= 1 && options.slice_rank >= 0 && options.slice_rank < options.slice_ranks,
               "data::BatchLoader", "slice_rank", "a rank in [0, slice_ranks) of slice_ranks >= 1",
               fmt::format("rank {} of {}", options.slice_rank, options.slice_ranks));
  const std::int64_t n = source->size();
  // n / B, plus a partial batch: no n + B - 1 that could pass 2^63 for a huge batch size.
  const std::int64_t per_epoch = n / options.batch_size + (!options.drop_last && n % options.batch_size != 0 ? 1 : 0);
  FK_CHECK_ARG(options.first_batch >= 0 && (options.first_batch < per_epoch || (options.first_batch == 0 && per_epoch == 0)),
               "data::BatchLoader", "first_batch", fmt::format("a batch of the first epoch, [0, {})", per_epoch),
               fmt::format("{}", options.first_batch));
  FK_CHECK_ARG(!__builtin_mul_overflow(per_epoch, options.epochs, &num_batches_), "data::BatchLoader", "epochs",
               fmt::format("at most {} epochs of {} batches (2^63 batches)", per_epoch ? INT64_MAX / per_epoch : 0, per_epoch),
               fmt::format("{}", options.epochs));
  num_batches_ = options.epochs > 0 ? num_batches_ - options.first_batch : 0;
  State& s = *state_;
  s.per_epoch = per_epoch;
  s.source = std::move(source);
  s.featurizer = std::move(featurizer);
  s.options = options;
  s.num_batches = num_batches_;
  // The consumer holds one slot while the workers fill the others; at least one slot per worker.
  const std::size_t slots = static_cast<std::size_t>(std::max(options.prefetch, options.workers)) + 1;
  s.slots.resize(slots);
  s.ready.assign(slots, -1);
  for (int w = 0; w < options.workers; ++w) s.workers.emplace_back([&s, w, options] { s.produce(w, options.workers); });
}

BatchLoader::~BatchLoader() {
  {
    std::lock_guard lock(state_->mutex);
    state_->stop = true;
  }
  state_->changed.notify_all();
  for (std::thread& t : state_->workers) t.join();
}

const Batch* BatchLoader::next() {
  State& s = *state_;
  std::unique_lock lock(s.mutex);
  // The batch handed out last time is given back now: its slot may be refilled.
  const std::int64_t k = s.handed;
  s.released = k;
  s.changed.notify_all();
  s.changed.wait(lock, [&] {
    return s.error || k >= s.num_batches || s.ready[static_cast<std::size_t>(k % s.num_slots())] == k;
  });
  if (s.error) std::rethrow_exception(s.error);
  if (k >= s.num_batches) return nullptr;
  ++s.handed;
  return &s.slots[static_cast<std::size_t>(k % static_cast<std::int64_t>(s.slots.size()))];
}

HostAllocator pinned_host_allocator() {
#if FUSEKIT_WITH_CUDA
  return [](Dims shape, DType dtype) {
    void* p = nullptr;
    const std::size_t bytes = std::max<std::size_t>(1, static_cast<std::size_t>(shape.numel()) * dtype_size(dtype));
    if (cudaMallocHost(&p, bytes) != cudaSuccess) {
      cudaGetLastError();
      throw Error("data::pinned_host_allocator", "bytes", "page-locked host memory", fmt::format("{} bytes refused", bytes));
    }
    return Tensor::adopt(TensorView(p, dtype, shape, Device::cpu()), [p] { cudaFreeHost(p); });
  };
#else
  return {};
#endif
}

}  // namespace fk::data
