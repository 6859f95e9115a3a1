// `fusekit train --distributed`: the run on several ranks (models::DistributedDlrm), launched by
// `mpirun -np N build/fusekit train --distributed ...` in a build with MPI (one process without):
// on the CPU through MPI's collectives, or with --device cuda a GPU a rank through NCCL (the MPI
// communicator starting it). `fusekit train --gpus N`: the same run in one process, a thread, a GPU
// and an NCCL communicator a rank. Every rank reads only its slice of each global batch (the first
// B % N ranks one sample more; data::LoaderOptions::slice_rank), dense features, labels and sparse
// ids alike (the tables' all-to-all routes each rank's own ids); rank 0 prints the plan (the
// tables' and the dense gradients' buckets), the progress lines, the final evaluation and the
// summary. A rank that fails prints its error and aborts every rank
// (MPI_Abort; with --gpus, the communicators are aborted and the process ends), so none waits in
// a collective.
// --checkpoint PATH saves a manifest and one shard file per rank (apps/checkpoint_distributed.hpp)
// at the end and every --checkpoint-every steps; --resume / --load-model continue from one saved
// on any number of ranks and plan (N -> M), or by the one-process run (1 -> M). What it does not
// do yet (the single-process run does): periodic evaluation, metrics JSON, traces, learning-rate
// schedules.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <memory>
#include <mutex>
#include <thread>

#include "apps/checkpoint_distributed.hpp"
#include "apps/train.hpp"
#include "apps/train_data.hpp"
#include "fusekit/core/error.hpp"
#include "fusekit/core/stream.hpp"
#include "fusekit/data/criteo.hpp"
#include "fusekit/dist/communicator.hpp"
#include "fusekit/models/dlrm_distributed.hpp"
#include "fusekit/models/metrics.hpp"

#if FUSEKIT_WITH_CUDA
#include "fusekit/core/cuda_check.hpp"
#endif

namespace fk::app {
namespace {

constexpr const char* kOp = "fusekit train --distributed";
using Clock = std::chrono::steady_clock;

using data::slice_of;

bool same_plan(const dist::ShardingPlan& a, const dist::ShardingPlan& b) {
  if (a.ranks != b.ranks || a.tables.size() != b.tables.size()) return false;
  for (std::size_t t = 0; t < a.tables.size(); ++t) {
    if (a.tables[t].size() != b.tables[t].size()) return false;
    for (std::size_t i = 0; i < a.tables[t].size(); ++i) {
      const dist::Shard &x = a.tables[t][i], &y = b.tables[t][i];
      if (x.row_begin != y.row_begin || x.row_end != y.row_end || x.rank != y.rank) return false;
    }
  }
  return true;
}

// Where a resumed run starts: the checkpoint's step, and the ranks that saved it (1 for none, or a
// one-process checkpoint), whose count of steps per epoch places the step in the data.
struct Resume {
  std::int64_t step = 0;
  int saved_ranks = 1;
};

// --resume / --load-model: the dense state from the checkpoint, this rank's shards of its plan
// gathered from the shard files that hold their rows (any number of ranks, any plan: N -> M), or
// from a one-process checkpoint's tables (1 -> M).
Resume start_from(const StartState& start, bool resume_override, const TrainConfig& c, models::DistributedDlrm& model,
                  std::int64_t total) {
  if (start.path.empty() || (!start.must_exist && !std::filesystem::exists(start.path))) return {};
  const char* flag = start.flag.c_str();
  std::ifstream in;
  apps::CheckpointHeader h;
  try {
    h = apps::open_checkpoint(start.path, in, kOp);
  } catch (const Error& e) {
    throw Error(e.op(), flag, e.expected(), e.got());
  }
  const std::string diff = apps::config_differences(h.config, to_json(c), to_json(TrainConfig{}));
  FK_CHECK_ARG(diff.empty() || resume_override, kOp, flag,
               fmt::format("the configuration stored in {} (--resume-override resumes with the new settings)", start.path),
               diff);
  FK_CHECK_ARG(h.step <= total, kOp, flag, fmt::format("a checkpoint at most at step {} (the run's end)", total),
               fmt::format("{} at step {}", start.path, h.step));
  const dist::ShardingPlan saved = apps::load_distributed(start.path, h, in, model, kOp, flag);
  if (model.communicator().rank() == 0 && !same_plan(saved, model.plan())) {
    fmt::print("re-sharded: {} saved on {} rank{}{}, loaded onto this run's plan of {} rank{}\n", start.path,
               saved.ranks, saved.ranks == 1 ? "" : "s", apps::is_distributed(h) ? "" : " (one process)",
               model.plan().ranks, model.plan().ranks == 1 ? "" : "s");
    std::fflush(stdout);
  }
  return {h.step, saved.ranks};
}

// Every rank its shard file, then (after a barrier) rank 0 the manifest with the dense state.
void save(const TrainConfig& c, models::DistributedDlrm& model, std::int64_t step) {
  if (c.checkpoint.empty()) return;
  dist::Communicator& comm = model.communicator();
  const nlohmann::json config = to_json(c);
  apps::write_shard_file(c.checkpoint, step, config, model.plan(), comm.rank(),
                         [&](std::ostream& out) { model.save_shards(out); });
  comm.barrier();
  if (comm.rank() == 0) {
    apps::write_manifest(c.checkpoint, step, config, model.plan(),
                         [&](std::ostream& out) { model.dense().save_state(out); });
    fmt::print("checkpoint: step {} saved to {} (+ {} shard files)\n", step, c.checkpoint, comm.size());
    std::fflush(stdout);
  }
  comm.barrier();
}

// An all-to-all of host floats in which only rank 0 receives (the evaluation's gather); a device
// communicator's goes through buffers on its GPU.
void gather_to_rank0(dist::Communicator& comm, std::vector<float>& out, std::span<const std::int64_t> send,
                     std::vector<float>& all, std::span<const std::int64_t> recv) {
  const auto host = [](std::vector<float>& v) {
    return TensorView(v.data(), DType::f32, {std::ssize(v)}, Device::cpu());
  };
  if (comm.device().is_cpu()) return comm.all_to_all_v(host(out), send, host(all), recv);
  // Allocated on the default stream (a block goes back to the stream it was ordered on, and this
  // stream goes at the end of the call); nothing else uses them meanwhile.
  const Tensor d_out = Tensor::empty({std::max<std::int64_t>(std::ssize(out), 1)}, DType::f32, comm.device());
  const Tensor d_all = Tensor::empty({std::max<std::int64_t>(std::ssize(all), 1)}, DType::f32, comm.device());
  const Stream stream = Stream::create(comm.device());
  const TensorView o(d_out.data(), DType::f32, {std::ssize(out)}, comm.device());
  const TensorView a(d_all.data(), DType::f32, {std::ssize(all)}, comm.device());
  copy_async(o, host(out), stream);
  comm.all_to_all_v(o, send, a, recv, &stream);
  copy_async(host(all), a, stream);
  stream.synchronize();
}

int run(const TrainConfig& c, std::int64_t max_shard_rows, const StartState& start, bool resume_override,
        dist::Communicator& comm) {
  const int ranks = comm.size(), me = comm.rank();
  const bool lead = me == 0;
  FK_CHECK_ARG(comm.device().is_cuda() == Device::parse(c.device).is_cuda(), kOp, "--device",
               comm.device().is_cuda() ? "cuda (the ranks' GPUs)" : "cpu (this run's collectives are MPI's, on the host)",
               c.device);
  FK_CHECK_ARG(c.mini_batch_size >= ranks && c.test_mini_batch_size >= ranks, kOp, "--mini-batch-size",
               fmt::format("global batches of at least one sample per rank ({})", ranks),
               fmt::format("{} and test {}", c.mini_batch_size, c.test_mini_batch_size));
  const RunData data = open_data(c);
  const models::DlrmConfig mc = make_model_config(c, data.featurizer);
  const models::DlrmImpl impl = models::parse_impl(c.impl);
  const models::OptimizerConfig opt{.kind = models::parse_optimizer(c.optimizer),
                                    .learning_rate = static_cast<float>(c.learning_rate)};
  dist::ShardingPlan plan =
      models::plan_dlrm_sharding(mc, ranks, c.mini_batch_size, opt.kind, data.featurizer.multi_hot_sizes,
                                 {.max_shard_rows = max_shard_rows});
  if (lead) {
    fmt::print("fusekit train --distributed: DLRM bot {} top {} D {} interaction {}, {} tables, {:.1f}M parameters, "
               "{} lr {}, impl {}; {} ranks ({}), global batch {} ({} to {} samples a rank)\n",
               c.arch_mlp_bot, c.arch_mlp_top, mc.embedding_dim, c.arch_interaction_op, mc.table_rows.size(),
               static_cast<double>(mc.parameter_count()) / 1e6, c.optimizer, c.learning_rate, c.impl, ranks,
               comm.backend(), c.mini_batch_size, c.mini_batch_size / ranks, (c.mini_batch_size + ranks - 1) / ranks);
    fmt::print("data: {}\n{}", data.split.description, plan.str());
    std::fflush(stdout);
  }
  models::DistributedDlrm model(mc, comm, std::move(plan), impl,
                                {.bucket_bytes = static_cast<std::int64_t>(std::llround(c.bucket_cap_mb * 1048576.0))});
  if (lead) {
    fmt::print("{}", model.gradient_buckets_str());
    std::fflush(stdout);
  }

  // Training: every rank reads its slice of each global batch, and trains on it.
  const std::int64_t n_train = data.split.train->size();
  const std::int64_t per_epoch = (n_train + c.mini_batch_size - 1) / c.mini_batch_size;
  const std::int64_t total = c.steps > 0 ? c.steps : per_epoch * c.epochs;
  const Resume resume = start_from(start, resume_override, c, model, total);
  std::int64_t step = resume.step;
  if (lead && step > 0) {
    fmt::print("{} {} at step {}\n", start.must_exist ? "loaded" : "resumed from", start.path, step);
    std::fflush(stdout);
  }
  // Step k is batch k of the epochs' batches less any last batch smaller than the ranks (skipped):
  // a resumed run starts where the ranks that saved it were.
  const std::int64_t last_batch = n_train - (per_epoch - 1) * c.mini_batch_size;
  const std::int64_t saved_per_epoch =
      std::max<std::int64_t>(1, per_epoch - (last_batch < resume.saved_ranks ? 1 : 0));
  data::BatchLoader loader(data.split.train, data.featurizer,
                           {.batch_size = c.mini_batch_size,
                            .epochs = (total + per_epoch - 1) / per_epoch - step / saved_per_epoch,
                            .first_batch = step % saved_per_epoch,
                            .slice_rank = me,
                            .slice_ranks = ranks});
  std::int64_t samples = 0, window_steps = 0, last_steps = 0;
  double window_loss = 0, last_loss = 0, train_seconds = 0;
  auto window_start = Clock::now();
  while (step < total) {
    const data::Batch* b = loader.next();
    if (!b) break;
    if (b->global_size < ranks) continue;  // an epoch's last batch smaller than the ranks
    const auto t0 = Clock::now();
    const double loss = model.train_step({b->dense, b->indices, b->offsets}, b->labels, opt);
    train_seconds += std::chrono::duration<double>(Clock::now() - t0).count();
    FK_CHECK_ARG(std::isfinite(loss), kOp, "loss", "a finite training loss", fmt::format("{} at step {}", loss, step + 1));
    ++step;
    samples += b->global_size;
    window_loss += loss;
    ++window_steps;
    if (step > total - per_epoch || c.steps > 0) {  // the last epoch's (or a --steps run's) mean
      last_loss += loss;
      ++last_steps;
    }
    if (lead && c.print_every > 0 && (step % c.print_every == 0 || step == total)) {
      const double secs = std::chrono::duration<double>(Clock::now() - window_start).count();
      fmt::print("step {}/{}  loss {:.5f}  {:.0f} samples/s\n", step, total, window_loss / static_cast<double>(window_steps),
                 static_cast<double>(window_steps * c.mini_batch_size) / secs);
      std::fflush(stdout);
      window_loss = 0;
      window_steps = 0;
      window_start = Clock::now();
    }
    if (c.checkpoint_every > 0 && step % c.checkpoint_every == 0 && step < total) save(c, model, step);
  }
  save(c, model, step);

  // The final evaluation: each rank predicts its slice; rank 0 gathers every slice (an
  // all-to-all in which only rank 0 receives) and computes the metrics.
  data::BatchLoader test(data.split.test, data.featurizer,
                         {.batch_size = c.test_mini_batch_size, .slice_rank = me, .slice_ranks = ranks});
  std::vector<float> probs, labels;
  std::int64_t skipped = 0;
  while (const data::Batch* b = test.next()) {
    const std::int64_t n = b->global_size;
    if (n < ranks) {
      skipped += n;
      continue;
    }
    std::vector<float> out(static_cast<std::size_t>(2 * b->size));  // probabilities, then labels
    model.predict({b->dense, b->indices, b->offsets}, TensorView(out.data(), DType::f32, {b->size}, Device::cpu()));
    std::memcpy(out.data() + b->size, b->labels.data(), static_cast<std::size_t>(b->size) * sizeof(float));
    std::vector<std::int64_t> send(static_cast<std::size_t>(ranks), 0), recv(static_cast<std::size_t>(ranks), 0);
    send[0] = 2 * b->size;
    for (int r = 0; lead && r < ranks; ++r) {
      const auto [rb, re] = slice_of(n, r, ranks);
      recv[static_cast<std::size_t>(r)] = 2 * (re - rb);
    }
    std::vector<float> all(static_cast<std::size_t>(lead ? 2 * n : 0));
    gather_to_rank0(comm, out, send, all, recv);
    for (int r = 0; lead && r < ranks; ++r) {
      const auto [rb, re] = slice_of(n, r, ranks);
      const float* p = all.data() + 2 * rb;
      probs.insert(probs.end(), p, p + (re - rb));
      labels.insert(labels.end(), p + (re - rb), p + 2 * (re - rb));
    }
  }
  if (lead) {
    const models::BinaryMetrics m = models::evaluate_binary(probs, labels);
    fmt::print("eval final, step {}: test logloss {:.5f}, AUC {:.5f}, accuracy {:.5f} ({} samples{})\n", step, m.log_loss,
               m.auc, m.accuracy, m.samples,
               skipped > 0 ? fmt::format("; {} in a last batch smaller than the ranks not evaluated", skipped) : "");
    fmt::print("summary: train loss {:.5f} (mean over the last {} steps), test logloss {:.5f}, AUC {:.5f}, "
               "{:.0f} samples/s over {} ranks ({} steps, {} samples, {:.1f} s training)\n",
               last_steps > 0 ? last_loss / static_cast<double>(last_steps) : 0.0, last_steps, m.log_loss, m.auc,
               static_cast<double>(samples) / train_seconds, ranks, step, samples, train_seconds);
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

int run_train_distributed(const TrainConfig& c, std::int64_t max_shard_rows, const StartState& start,
                          bool resume_override) {
  std::unique_ptr<dist::Communicator> comm =
      FUSEKIT_WITH_MPI ? dist::make_mpi_communicator() : dist::make_single_communicator();
  // --device cuda: a GPU a rank (its local rank's), NCCL started through the host communicator.
  if (Device::parse(c.device).is_cuda()) comm = dist::make_nccl_communicator(std::move(comm));
  try {
    return run(c, max_shard_rows, start, resume_override, *comm);
  } catch (const std::exception& e) {
    if (comm->size() == 1) throw;
    std::fprintf(stderr, "fusekit train --distributed: rank %d of %d: %s\n", comm->rank(), comm->size(), e.what());
    std::fflush(stderr);
    comm->abort(1);
  }
  return 1;  // not reached: abort ends the process
}

int run_train_gpus(const TrainConfig& c, int gpus, std::int64_t max_shard_rows, const StartState& start,
                   bool resume_override) {
  constexpr const char* op = "fusekit train --gpus";
  FK_CHECK_ARG(gpus >= 1, op, "--gpus", ">= 1", std::to_string(gpus));
  FK_CHECK_ARG(c.device == "cuda", op, "--device", "cuda (--gpus N takes GPUs 0 to N-1)", c.device);
  std::vector<int> devices(static_cast<std::size_t>(gpus));
  for (int r = 0; r < gpus; ++r) devices[static_cast<std::size_t>(r)] = r;
  std::vector<std::unique_ptr<dist::Communicator>> comms = dist::make_nccl_communicators(devices);
  // A rank that fails prints its error and aborts its communicator, which ends the process: the
  // other threads may be waiting in a collective it will never join. One rank has no one to
  // wait for: its error is thrown here, as a one-process run's.
  std::exception_ptr only_rank_error;
  std::mutex print;
  std::vector<std::thread> threads;
  for (int r = 0; r < gpus; ++r)
    threads.emplace_back([&, r] {
      dist::Communicator& comm = *comms[static_cast<std::size_t>(r)];
      try {
#if FUSEKIT_WITH_CUDA
        fk::detail::check_cuda(cudaSetDevice(r), "cudaSetDevice");  // this thread's GPU, for all it calls
#endif
        run(c, max_shard_rows, start, resume_override, comm);
      } catch (const std::exception& e) {
        if (gpus == 1) {
          only_rank_error = std::current_exception();
          return;
        }
        {
          const std::lock_guard lock(print);
          std::fprintf(stderr, "%s: rank %d of %d (cuda:%d): %s\n", op, r, gpus, r, e.what());
          std::fflush(stderr);
        }
        comm.abort(1);
      }
    });
  for (std::thread& t : threads) t.join();
  if (only_rank_error) std::rethrow_exception(only_rank_error);
  return 0;
}

}  // namespace fk::app
