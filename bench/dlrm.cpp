// Bench cases of DLRM training (family `dlrm`): the DLRM reference's Kaggle model (bottom
// 13-512-256-64-16, dot interaction, top 512-256-1, full Kaggle table sizes: 33.8M rows, 2.2 GB of
// fp32 tables), SGD lr 0.1, one epoch of synthetic Criteo-like data, trained by both CUDA
// implementations on exactly the same batches, then evaluated on the same test set.
//
// The batches are prepared beforehand in page-locked host memory (the loader's work is not what
// is measured); each training step copies its batch to the device (overlapped with the previous
// step) and runs forward, loss, backward and the optimizer. samples_per_s counts the steps after
// a warm-up of 8 (cuBLAS/cuBLASLt plans, the fused step's graph capture), from one
// synchronisation to the next, host copies included. median_us is the mean time of one step over
// those steps (not a median: a step's time only exists as part of the stream). Each record also
// gives what the MLPs keep for the backward of a training batch (Dlrm::mlp_activation_bytes):
// train/packed_activations_kaggle_dot_b32768 keeps them packed at 8, 4 and 2 bits against f32.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <span>
#include <thread>
#include <vector>

#include "bench/harness.hpp"
#include "fusekit/core/allocator.hpp"
#include "fusekit/data/criteo.hpp"
#include "fusekit/models/dlrm.hpp"
#include "fusekit/models/metrics.hpp"

namespace fk::bench {
namespace {

constexpr std::int64_t kTrainSamples = std::int64_t{1} << 22;  // one epoch of configs/dlrm_kaggle.json
constexpr std::int64_t kTestSamples = std::int64_t{1} << 18;
constexpr std::int64_t kTestBatch = 32768;
constexpr int kWarmup = 8;

// Runs f(i) for i in [0, n) on every core.
template <class F>
void parallel_for(std::int64_t n, F f) {
  const std::int64_t threads = std::clamp<std::int64_t>(std::thread::hardware_concurrency(), 1, 32);
  std::vector<std::thread> pool;
  for (std::int64_t t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      for (std::int64_t i = t; i < n; i += threads) f(i);
    });
  for (std::thread& th : pool) th.join();
}

std::vector<data::Batch> make_batches(std::span<const data::RawRecord> records, const data::Featurizer& feat,
                                      std::int64_t batch) {
  std::vector<data::Batch> out(static_cast<std::size_t>(static_cast<std::int64_t>(records.size()) / batch));
  const data::HostAllocator pinned = data::pinned_host_allocator();
  parallel_for(static_cast<std::int64_t>(out.size()), [&](std::int64_t i) {
    data::make_batch(records.subspan(static_cast<std::size_t>(i * batch), static_cast<std::size_t>(batch)), feat,
                     out[static_cast<std::size_t>(i)], pinned);
  });
  return out;
}

struct Outcome {
  double step_us = 0, samples_per_s = 0, auc = 0, logloss = 0, train_loss = 0, peak_mb = 0;
  double mlp_whole_mb = 0, mlp_kept_mb = 0, mlp_scratch_mb = 0;
};

Outcome train_one_epoch(const models::DlrmConfig& mc, models::DlrmImpl impl, const std::vector<data::Batch>& train,
                        const std::vector<data::Batch>& test) {
  using clock = std::chrono::steady_clock;
  allocator::release_cached(Device::cuda());
  allocator::reset_peak(Device::cuda());
  models::Dlrm model(mc, Device::cuda(), impl);
  const models::OptimizerConfig opt{.kind = models::OptimizerKind::sgd, .learning_rate = 0.1f};
  auto input = [](const data::Batch& b) { return models::DlrmInput{b.dense, b.indices, b.offsets, b.raw_sparse}; };
  const std::int64_t steps = static_cast<std::int64_t>(train.size());
  const std::int64_t warm = std::min<std::int64_t>(kWarmup, steps / 4);
  for (std::int64_t i = 0; i < warm; ++i) model.enqueue_train_step(input(train[i]), train[i].labels, opt);
  model.drain_loss();
  const auto t0 = clock::now();
  for (std::int64_t i = warm; i < steps; ++i) model.enqueue_train_step(input(train[i]), train[i].labels, opt);
  Outcome o;
  o.train_loss = model.drain_loss();
  const double secs = std::chrono::duration<double>(clock::now() - t0).count();
  o.step_us = 1e6 * secs / static_cast<double>(steps - warm);
  o.samples_per_s = static_cast<double>((steps - warm) * train.front().size) / secs;
  std::vector<float> probs, labels;
  Tensor p = Tensor::empty({kTestBatch}, DType::f32, Device::cpu());
  for (const data::Batch& b : test) {
    model.predict(input(b), p);
    probs.insert(probs.end(), p.data_as<float>(), p.data_as<float>() + b.size);
    labels.insert(labels.end(), b.labels.data_as<float>(), b.labels.data_as<float>() + b.size);
  }
  const models::BinaryMetrics m = models::evaluate_binary(probs, labels);
  o.auc = m.auc;
  o.logloss = m.log_loss;
  o.peak_mb = static_cast<double>(model.peak_device_bytes()) / 1e6;
  const nn::MLP::SavedActivationBytes act = model.mlp_activation_bytes(train.front().size);
  o.mlp_whole_mb = static_cast<double>(act.whole) / 1e6;
  o.mlp_kept_mb = static_cast<double>(act.kept) / 1e6;
  o.mlp_scratch_mb = static_cast<double>(act.scratch) / 1e6;
  return o;
}

void add_record(Context& ctx, const std::string& name, const char* impl, const char* baseline, const Outcome& o,
                const Outcome& base, std::int64_t batch) {
  Record r{"dlrm", name, impl, baseline};
  r.median_us = o.step_us;
  r.extra = {{"samples_per_s", o.samples_per_s}, {"auc", o.auc},         {"test_logloss", o.logloss},
             {"train_loss", o.train_loss},       {"peak_mem_mb", o.peak_mb}, {"batch", static_cast<double>(batch)},
             {"train_samples", static_cast<double>(kTrainSamples)},
             {"auc_minus_baseline", o.auc - base.auc},
             {"mlp_activations_f32_mb", o.mlp_whole_mb},
             {"mlp_activations_kept_mb", o.mlp_kept_mb},
             {"mlp_scratch_mb", o.mlp_scratch_mb}};
  ctx.add(r);
  fmt::print("dlrm {} {}: {:.0f} samples/s ({:.1f} us/step), test AUC {:.5f}, logloss {:.5f}, peak {:.0f} MB; MLP "
             "activations kept {:.1f} MB of {:.1f} MB as f32, scratch {:.1f} MB\n",
             name, impl, o.samples_per_s, o.step_us, o.auc, o.logloss, o.peak_mb, o.mlp_kept_mb, o.mlp_whole_mb,
             o.mlp_scratch_mb);
}

void train_cases(Context& ctx) {
  const std::vector<std::int64_t> batches{2048, 32768};
  std::vector<std::int64_t> chosen;
  for (std::int64_t b : batches)
    if (ctx.selected("dlrm", "train/kaggle_dot_b" + std::to_string(b))) chosen.push_back(b);
  // The same model with a narrow bottom MLP (13-64-64-16): the one MLP fused_mlp can take (the
  // top MLP's input, 367 wide, is beyond its 128), run by the fused implementation with cuBLASLt
  // (TF32) and with fused_mlp (bf16).
  const std::string narrow = "train/bot64_dot_b32768";
  const bool with_narrow = ctx.selected("dlrm", narrow);
  // The Kaggle model at batch 32768, the fused implementation keeping the MLPs' activations in f32
  // (the baseline) and packed at 8, 4 and 2 bits (DlrmConfig::compress_activations_bits).
  const std::string packed = "train/packed_activations_kaggle_dot_b32768";
  const bool with_packed = ctx.selected("dlrm", packed);
  if (chosen.empty() && !with_narrow && !with_packed) return;

  data::Featurizer feat;  // Kaggle cardinalities, no cap
  feat.hash = data::HashMode::reference;
  const data::SyntheticCriteo gen(data::SyntheticConfig{});
  std::vector<data::RawRecord> records(static_cast<std::size_t>(kTrainSamples + kTestSamples));
  constexpr std::int64_t kChunk = 65536;
  parallel_for(static_cast<std::int64_t>(records.size()) / kChunk, [&](std::int64_t c) {
    gen.generate(c * kChunk, std::span(records).subspan(static_cast<std::size_t>(c * kChunk), kChunk));
  });
  const std::span<const data::RawRecord> all(records);
  const std::vector<data::Batch> test = make_batches(all.subspan(kTrainSamples), feat, kTestBatch);

  models::DlrmConfig mc;
  mc.table_rows = feat.table_rows();
  mc.raw_hash = RowHash::reference;
  for (std::int64_t b : chosen) {
    const std::string name = "train/kaggle_dot_b" + std::to_string(b);
    const std::vector<data::Batch> train = make_batches(all.first(kTrainSamples), feat, b);
    const Outcome ref = train_one_epoch(mc, models::DlrmImpl::reference, train, test);
    const Outcome fused = train_one_epoch(mc, models::DlrmImpl::fused, train, test);
    add_record(ctx, name, "reference", "reference", ref, ref, b);
    add_record(ctx, name, "fused", "reference", fused, ref, b);
  }
  if (with_narrow) {
    const std::vector<data::Batch> train = make_batches(all.first(kTrainSamples), feat, 32768);
    models::DlrmConfig nc = mc;
    nc.bottom_mlp = {13, 64, 64, 16};
    const Outcome lt = train_one_epoch(nc, models::DlrmImpl::fused, train, test);
    nc.fused_mlp = true;
    const Outcome fm = train_one_epoch(nc, models::DlrmImpl::fused, train, test);
    add_record(ctx, narrow, "fused", "fused", lt, lt, 32768);
    add_record(ctx, narrow, "fused_mlp", "fused", fm, lt, 32768);
  }
  if (with_packed) {
    const std::vector<data::Batch> train = make_batches(all.first(kTrainSamples), feat, 32768);
    const Outcome f32 = train_one_epoch(mc, models::DlrmImpl::fused, train, test);
    add_record(ctx, packed, "fused", "fused", f32, f32, 32768);
    for (const int bits : {8, 4, 2}) {
      models::DlrmConfig pc = mc;
      pc.compress_activations_bits = bits;
      const Outcome o = train_one_epoch(pc, models::DlrmImpl::fused, train, test);
      add_record(ctx, packed, bits == 8 ? "fused_act8" : bits == 4 ? "fused_act4" : "fused_act2", "fused", o, f32, 32768);
    }
  }
}

FK_BENCH_CASE("dlrm", "train/kaggle_dot", train_cases);

}  // namespace
}  // namespace fk::bench
