// Bench cases of the recsys family: the table-batched embedding bag and its backward fused with
// the optimizer, against the unfused path a user runs instead (what DLRM's reference implementation
// runs):
//   forward   one launch per table (an nn.EmbeddingBag per table, indices hashed beforehand),
//             against all tables in one launch with the raw values' hash computed in the kernel
//   backward  the dense table gradient (zeroed, each touched row's summed gradient stored, sorted
//             like PyTorch's deterministic embedding backward) then a dense optimizer pass over
//             every table, one launch per table; against the sort + segmented sums applying the
//             update to each touched row (no table gradient)
// Shapes: DLRM on Criteo Kaggle (26 tables of Kaggle's row counts, 33.8M rows, D = 16, one-hot),
// batch 2048 and 32768, SGD and Adagrad; one multi-hot case (8 tables of 1M rows, D = 64, bags of
// 20). gbps counts the bytes of table rows touched: forward, the rows read plus the pooled rows
// written; backward, each touched row (and its optimizer state) read and written once plus the
// gradient rows read. The baseline's record carries the same bytes (it moves far more: every row
// of every table, several times), so the two gbps compare as speed.
#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <optional>
#include <random>
#include <string>
#include <unordered_set>
#include <vector>

#include "bench/harness.hpp"
#include "fusekit/core/cuda_check.hpp"
#include "fusekit/data/criteo.hpp"
#include "fusekit/core/random.hpp"
#include "fusekit/ops/pointwise.hpp"
#include "fusekit/ops/recsys.hpp"

namespace fk::bench {
namespace {

struct Tables {
  std::vector<std::int64_t> rows;
  std::int64_t dim;
  TableLayout layout;
  Tensor weights;  // [total_rows, D]
};

Tables make_tables(Context& ctx, std::vector<std::int64_t> rows, std::int64_t dim) {
  Tables t{rows, dim, TableLayout(rows, ctx.fk_stream().device()), Tensor()};
  t.weights = ctx.random({t.layout.total_rows(), dim}, DType::f32, -0.05f, 0.05f);
  return t;
}

// One batch of input, in both forms: raw one-hot values (bag = 0) or CSR bags of `bag` rows, and
// the CSR form of the same rows (the baseline's input), plus the keys / bags of the forward.
struct InputSet {
  Tensor raw, indices, offsets, keys, bags, out;
  std::int64_t nnz = 0;
  std::vector<std::int32_t> host_keys;
};

InputSet make_input(Context& ctx, const Tables& tb, std::int64_t batch, int bag, std::uint64_t seed) {
  const std::int64_t nt = static_cast<std::int64_t>(tb.rows.size());
  std::mt19937_64 rng(seed);
  InputSet s;
  std::vector<std::int64_t> idx, off{0};
  std::vector<std::int32_t> raw;
  for (std::int64_t t = 0; t < nt; ++t)
    for (std::int64_t b = 0; b < batch; ++b) {
      if (bag == 0) {
        const auto v = static_cast<std::uint32_t>(rng());
        raw.push_back(static_cast<std::int32_t>(v));
        idx.push_back(reference::hash_row(v, tb.rows[static_cast<std::size_t>(t)], RowHash::reference));
      } else {
        for (int k = 0; k < bag; ++k)
          idx.push_back(static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(tb.rows[static_cast<std::size_t>(t)])));
      }
      off.push_back(static_cast<std::int64_t>(idx.size()));
    }
  s.nnz = static_cast<std::int64_t>(idx.size());
  const auto upload = [&](const void* p, Dims shape, DType dt) {
    Tensor d = ctx.empty(shape, dt);
    FK_CUDA_CHECK(cudaMemcpyAsync(d.data(), p, d.nbytes(), cudaMemcpyHostToDevice, ctx.stream()));
    return d;
  };
  if (bag == 0) s.raw = upload(raw.data(), {nt * batch}, DType::i32);
  s.indices = upload(idx.data(), {s.nnz}, DType::i64);
  s.offsets = upload(off.data(), {nt * batch + 1}, DType::i64);
  s.keys = ctx.empty({s.nnz}, DType::i32);
  s.bags = ctx.empty({s.nnz}, DType::i32);
  s.out = ctx.empty({batch, nt, tb.dim}, DType::f32);
  FK_CUDA_CHECK(cudaStreamSynchronize(ctx.stream()));  // the host vectors go out of scope
  return s;
}

// The fused forward of one input set: raw values through the hash, or CSR; keys and bags too.
void fused_forward(Context& ctx, const Tables& tb, const TensorView& weights, const InputSet& s, const TensorView& out) {
  EmbeddingBagForwardArgs a{weights, std::nullopt, std::nullopt, std::nullopt, out, s.keys.view(), s.bags.view()};
  if (s.raw.data()) {
    a.raw = s.raw.view();
  } else {
    a.indices = s.indices.view();
    a.offsets = s.offsets.view();
  }
  embedding_bag_forward(tb.layout, a, {Pooling::sum, RowHash::reference}, &ctx.fk_stream());
}

// One launch per table, CSR input (the rows hashed beforehand), as a per-table EmbeddingBag runs.
void per_table_forward(Context& ctx, const Tables& tb, const InputSet& s) {
  EmbeddingBagParams p{Pooling::sum, RowHash::reference};
  p.per_table_launch = true;
  embedding_bag_forward(tb.layout, {tb.weights, s.indices.view(), s.offsets.view(), std::nullopt, s.out}, p,
                        &ctx.fk_stream());
}

// How far one update's effect on the pooled rows is from a reference update's, both from the
// pooled rows `before`: ||(after - before) - (ref - before)|| / ||ref - before|| (the plain norm when
// the reference changed nothing). Waits for the stream.
double change_err(Context& ctx, const Tensor& before, const Tensor& after, const Tensor& ref) {
  FK_CUDA_CHECK(cudaStreamSynchronize(ctx.stream()));
  const auto host = [](const Tensor& t) {
    std::vector<float> v(static_cast<std::size_t>(t.numel()));
    FK_CUDA_CHECK(cudaMemcpy(v.data(), t.data(), t.nbytes(), cudaMemcpyDeviceToHost));
    return v;
  };
  const std::vector<float> b0 = host(before), a1 = host(after), r1 = host(ref);
  double num = 0, den = 0;
  for (std::size_t k = 0; k < b0.size(); ++k) {
    const double da = static_cast<double>(a1[k]) - b0[k], dr = static_cast<double>(r1[k]) - b0[k];
    num += (da - dr) * (da - dr);
    den += dr * dr;
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

std::string case_name(const char* op, const std::string& shape) { return std::string(op) + "/" + shape; }

void forward_case(Context& ctx, Tables& tb, const std::string& shape, std::int64_t batch, int bag) {
  const std::string name = case_name("embedding_fwd", shape);
  if (!ctx.selected("recsys", name)) return;
  const std::int64_t nt = static_cast<std::int64_t>(tb.rows.size());
  const std::size_t pooled_bytes = static_cast<std::size_t>(batch * nt * tb.dim) * 4;
  const int rot = ctx.rotations_for(2 * pooled_bytes);
  std::vector<InputSet> sets;
  for (int i = 0; i < rot; ++i) sets.push_back(make_input(ctx, tb, batch, bag, 100 + static_cast<std::uint64_t>(i)));
  Tensor fused_out = ctx.empty({batch, nt, tb.dim}, DType::f32);
  fused_forward(ctx, tb, tb.weights, sets[0], fused_out);
  per_table_forward(ctx, tb, sets[0]);
  const double err = ctx.rel_err(fused_out, sets[0].out);
  require_close(name, err, 1e-6);  // the same rows summed in the same order

  const double bytes = static_cast<double>(sets[0].nnz * tb.dim * 4) + static_cast<double>(pooled_bytes);
  Record fr{"recsys", name, "fused", "per_table_launches"};
  fr.median_us = ctx.time_us([&](int i) {
    const InputSet& s = sets[static_cast<std::size_t>(i)];
    fused_forward(ctx, tb, tb.weights, s, s.out);
  }, rot);
  fr.gbps = bytes / (fr.median_us * 1e3);
  fr.rel_err = err;
  fr.extra = {{"nnz", static_cast<double>(sets[0].nnz)}};
  Record br{"recsys", name, "per_table_launches", "per_table_launches"};
  br.median_us = ctx.time_us([&](int i) { per_table_forward(ctx, tb, sets[static_cast<std::size_t>(i)]); }, rot);
  br.gbps = bytes / (br.median_us * 1e3);
  ctx.add(fr);
  ctx.add(br);
}

void backward_case(Context& ctx, Tables& tb, const std::string& shape, std::int64_t batch, int bag,
                   EmbeddingUpdate update) {
  const bool ada = update == EmbeddingUpdate::adagrad;
  const std::string name = case_name(ada ? "embedding_bwd_adagrad" : "embedding_bwd_sgd", shape);
  if (!ctx.selected("recsys", name)) return;
  const std::int64_t nt = static_cast<std::int64_t>(tb.rows.size()), total = tb.layout.total_rows(), d = tb.dim;
  const std::size_t pooled_bytes = static_cast<std::size_t>(batch * nt * d) * 4;
  const int rot = ctx.rotations_for(pooled_bytes);
  std::vector<InputSet> sets;
  std::vector<Tensor> douts;
  for (int i = 0; i < rot; ++i) {
    sets.push_back(make_input(ctx, tb, batch, bag, 200 + static_cast<std::uint64_t>(i)));
    fused_forward(ctx, tb, tb.weights, sets.back(), sets.back().out);  // keys and bags
    douts.push_back(ctx.random({batch, nt, d}, DType::f32, -1e-2f, 1e-2f));
  }
  const std::int64_t nnz = sets[0].nnz;
  Tensor ws = ctx.empty({static_cast<std::int64_t>(embedding_bag_backward_workspace_bytes(nnz, d))}, DType::u8);
  // Two copies of the tables (and of the Adagrad state) from the same start, one per path.
  const auto clone = [&](const Tensor& src) {
    Tensor c = ctx.empty(src.shape(), src.dtype());
    FK_CUDA_CHECK(cudaMemcpyAsync(c.data(), src.data(), src.nbytes(), cudaMemcpyDeviceToDevice, ctx.stream()));
    return c;
  };
  Tensor w_fused = clone(tb.weights), w_base = clone(tb.weights), grad = ctx.empty({total, d}, DType::f32);
  Tensor s_fused, s_base;
  if (ada) {
    s_fused = ctx.random({total, d}, DType::f32, 0.0f, 0.1f);
    s_base = clone(s_fused);
  }
  const EmbeddingOptimizerParams p{update, 0.01f, 1e-8f, Pooling::sum};
  auto fused = [&](int i) {
    const InputSet& s = sets[static_cast<std::size_t>(i)];
    embedding_bag_backward_update(tb.layout,
                                  {s.keys, s.bags, douts[static_cast<std::size_t>(i)], std::nullopt, w_fused,
                                   ada ? std::optional<TensorView>(s_fused.view()) : std::nullopt, ws.view()},
                                  p, &ctx.fk_stream());
  };
  const DenseOptimizerParams dp{ada, p.lr, p.eps};
  auto baseline = [&](int i) {
    const InputSet& s = sets[static_cast<std::size_t>(i)];
    embedding_bag_backward_update(tb.layout,
                                  {s.keys, s.bags, douts[static_cast<std::size_t>(i)], std::nullopt, grad, std::nullopt,
                                   ws.view()},
                                  {EmbeddingUpdate::dense_gradient}, &ctx.fk_stream());
    for (int t = 0; t < nt; ++t) {  // one optimizer launch per table, as one optimizer per table runs
      const std::int64_t r0 = tb.layout.base(t), r1 = r0 + tb.layout.rows(t);
      dense_optimizer_update({w_base.view().slice_rows(r0, r1), grad.view().slice_rows(r0, r1),
                              ada ? std::optional<TensorView>(s_base.view().slice_rows(r0, r1)) : std::nullopt},
                             dp, &ctx.fk_stream());
    }
  };
  // The check: one step of each from the same tables; the touched rows' updates must agree (the
  // pooled rows of set 0 before and after, through the forward).
  Tensor before = ctx.empty({batch, nt, d}, DType::f32), after_f = ctx.empty({batch, nt, d}, DType::f32);
  Tensor after_b = ctx.empty({batch, nt, d}, DType::f32);
  fused_forward(ctx, tb, tb.weights, sets[0], before);
  fused(0);
  baseline(0);
  fused_forward(ctx, tb, w_fused, sets[0], after_f);
  fused_forward(ctx, tb, w_base, sets[0], after_b);
  const double err = change_err(ctx, before, after_f, after_b);
  require_close(name, err, 1e-4);  // the same sums; the updates differ by float rounding at most

  std::vector<std::int32_t> keys(static_cast<std::size_t>(nnz));
  FK_CUDA_CHECK(cudaMemcpy(keys.data(), sets[0].keys.data(), sets[0].keys.nbytes(), cudaMemcpyDeviceToHost));
  const double unique = static_cast<double>(std::unordered_set<std::int32_t>(keys.begin(), keys.end()).size());
  const double bytes = unique * static_cast<double>(d * 4) * (ada ? 4 : 2) + static_cast<double>(nnz * d * 4);
  Record fr{"recsys", name, "fused", "dense_grad+dense_optimizer"};
  fr.median_us = ctx.time_us(fused, rot);
  fr.gbps = bytes / (fr.median_us * 1e3);
  fr.rel_err = err;
  fr.extra = {{"nnz", static_cast<double>(nnz)}, {"unique_rows", unique}};
  Record br{"recsys", name, "dense_grad+dense_optimizer", "dense_grad+dense_optimizer"};
  br.median_us = ctx.time_us(baseline, rot);
  br.gbps = bytes / (br.median_us * 1e3);
  ctx.add(fr);
  ctx.add(br);
}

// 16-bit tables against f32 tables, both through the fused ops: the forward (rows read as bf16)
// and the row-wise Adagrad update (rows read and written as bf16 with stochastic rounding, the
// accumulators f32). The f32 tables hold the bf16 tables' values widened, so the forwards compare
// exactly; the updates compare through the pooled rows after one step (the f32 path's result
// rounded to bf16, within a bf16 step). gbps counts the bf16 path's bytes for both records.
void sixteen_bit_case(Context& ctx, const Tables& tb, const std::string& shape, std::int64_t batch, int bag) {
  const std::string fwd = case_name("embedding_bf16_fwd", shape), bwd = case_name("embedding_bf16_bwd_rowwise", shape);
  const bool run_fwd = ctx.selected("recsys", fwd), run_bwd = ctx.selected("recsys", bwd);
  if (!run_fwd && !run_bwd) return;
  const std::int64_t nt = static_cast<std::int64_t>(tb.rows.size()), total = tb.layout.total_rows(), d = tb.dim;
  const std::size_t pooled_bytes = static_cast<std::size_t>(batch * nt * d) * 4;
  const int rot = ctx.rotations_for(2 * pooled_bytes);
  std::vector<InputSet> sets;
  std::vector<Tensor> douts;
  for (int i = 0; i < rot; ++i) {
    sets.push_back(make_input(ctx, tb, batch, bag, 300 + static_cast<std::uint64_t>(i)));
    douts.push_back(ctx.random({batch, nt, d}, DType::f32, -1e-2f, 1e-2f));
  }
  Tensor w16 = ctx.empty({total, d}, DType::bf16), w32 = ctx.empty({total, d}, DType::f32);
  convert(tb.weights, w16, &ctx.fk_stream());
  convert(w16, w32, &ctx.fk_stream());
  const std::int64_t nnz = sets[0].nnz;
  Tensor out16 = ctx.empty({batch, nt, d}, DType::f32), out32 = ctx.empty({batch, nt, d}, DType::f32);
  fused_forward(ctx, tb, w16, sets[0], out16);
  fused_forward(ctx, tb, w32, sets[0], out32);
  const double fwd_err = ctx.rel_err(out16, out32);
  if (run_fwd) {
    require_close(fwd, fwd_err, 1e-6);  // the same values summed in the same order
    const double bytes = static_cast<double>(nnz * d * 2) + static_cast<double>(pooled_bytes);
    Record fr{"recsys", fwd, "fused_bf16_tables", "fused_f32_tables"};
    fr.median_us = ctx.time_us([&](int i) {
      const InputSet& s = sets[static_cast<std::size_t>(i)];
      fused_forward(ctx, tb, w16, s, s.out);
    }, rot);
    fr.gbps = bytes / (fr.median_us * 1e3);
    fr.rel_err = fwd_err;
    fr.extra = {{"nnz", static_cast<double>(nnz)}};
    Record br{"recsys", fwd, "fused_f32_tables", "fused_f32_tables"};
    br.median_us = ctx.time_us([&](int i) {
      const InputSet& s = sets[static_cast<std::size_t>(i)];
      fused_forward(ctx, tb, w32, s, s.out);
    }, rot);
    br.gbps = bytes / (br.median_us * 1e3);
    ctx.add(fr);
    ctx.add(br);
  }
  if (!run_bwd) return;
  for (InputSet& s : sets) fused_forward(ctx, tb, w16, s, s.out);  // keys and bags
  Tensor ws = ctx.empty({static_cast<std::int64_t>(embedding_bag_backward_workspace_bytes(nnz, d))}, DType::u8);
  Tensor s16 = ctx.random({total}, DType::f32, 0.0f, 0.1f), s32 = ctx.empty({total}, DType::f32);
  FK_CUDA_CHECK(cudaMemcpyAsync(s32.data(), s16.data(), s16.nbytes(), cudaMemcpyDeviceToDevice, ctx.stream()));
  Tensor counter = ctx.empty({1}, DType::i64);
  FK_CUDA_CHECK(cudaMemsetAsync(counter.data(), 0, 8, ctx.stream()));
  EmbeddingOptimizerParams p{EmbeddingUpdate::rowwise_adagrad, 0.01f, 1e-8f, Pooling::sum};
  p.seed = 5;
  p.offset_counter = counter.view();
  const auto update = [&](int i, const Tensor& w, const Tensor& st) {
    const InputSet& s = sets[static_cast<std::size_t>(i)];
    embedding_bag_backward_update(tb.layout,
                                  {s.keys, s.bags, douts[static_cast<std::size_t>(i)], std::nullopt, w, st.view(),
                                   ws.view()},
                                  p, &ctx.fk_stream());
    if (w.dtype() != DType::f32) advance_offset(counter.view(), 1, &ctx.fk_stream());
  };
  // The check: one step of each from the same values, the pooled rows of set 0 before and after.
  Tensor before = ctx.empty({batch, nt, d}, DType::f32), after16 = ctx.empty({batch, nt, d}, DType::f32);
  Tensor after32 = ctx.empty({batch, nt, d}, DType::f32);
  fused_forward(ctx, tb, w32, sets[0], before);
  update(0, w16, s16);
  update(0, w32, s32);
  fused_forward(ctx, tb, w16, sets[0], after16);
  fused_forward(ctx, tb, w32, sets[0], after32);
  // Each stored value is within a bf16 step of the f32 one, its error unbiased with a standard
  // deviation of at most half a step (about 6e-5 at |w| = 0.03) against updates of about 2e-4
  // here: the pooled change's relative error is well below 1 (0.04 on the H100), and about 1 with
  // rounding to nearest, which drops most of these updates.
  const double err = change_err(ctx, before, after16, after32);
  require_close(bwd, err, 0.8);
  std::vector<std::int32_t> keys(static_cast<std::size_t>(nnz));
  FK_CUDA_CHECK(cudaMemcpy(keys.data(), sets[0].keys.data(), sets[0].keys.nbytes(), cudaMemcpyDeviceToHost));
  const double unique = static_cast<double>(std::unordered_set<std::int32_t>(keys.begin(), keys.end()).size());
  const double bytes = unique * static_cast<double>(d * 2 * 2 + 8) + static_cast<double>(nnz * d * 4);
  Record fr{"recsys", bwd, "fused_bf16_tables", "fused_f32_tables"};
  fr.median_us = ctx.time_us([&](int i) { update(i, w16, s16); }, rot);
  fr.gbps = bytes / (fr.median_us * 1e3);
  fr.rel_err = err;
  fr.extra = {{"nnz", static_cast<double>(nnz)}, {"unique_rows", unique}};
  Record br{"recsys", bwd, "fused_f32_tables", "fused_f32_tables"};
  br.median_us = ctx.time_us([&](int i) { update(i, w32, s32); }, rot);
  br.gbps = bytes / (br.median_us * 1e3);
  ctx.add(fr);
  ctx.add(br);
}

void recsys_cases(Context& ctx) {
  const auto any_selected = [&](const std::string& shape, std::initializer_list<const char*> ops) {
    for (const char* op : ops)
      if (ctx.selected("recsys", case_name(op, shape))) return true;
    return false;
  };
  const std::vector<std::int64_t> kaggle(data::kKaggleCardinalities.begin(), data::kKaggleCardinalities.end());
  std::optional<Tables> tb;  // made once, for the first selected case
  for (std::int64_t batch : {2048, 32768}) {
    const std::string shape = "kaggle26_d16_b" + std::to_string(batch) + "_onehot";
    if (!any_selected(shape, {"embedding_fwd", "embedding_bwd_sgd", "embedding_bwd_adagrad"})) continue;
    if (!tb) tb = make_tables(ctx, kaggle, 16);
    forward_case(ctx, *tb, shape, batch, 0);
    backward_case(ctx, *tb, shape, batch, 0, EmbeddingUpdate::sgd);
    backward_case(ctx, *tb, shape, batch, 0, EmbeddingUpdate::adagrad);
  }
  tb.reset();
  const std::string shape = "t8_r1M_d64_b4096_bag20";
  if (any_selected(shape, {"embedding_fwd", "embedding_bwd_sgd", "embedding_bf16_fwd", "embedding_bf16_bwd_rowwise"})) {
    tb = make_tables(ctx, std::vector<std::int64_t>(8, 1 << 20), 64);
    forward_case(ctx, *tb, shape, 4096, 20);
    backward_case(ctx, *tb, shape, 4096, 20, EmbeddingUpdate::sgd);
    sixteen_bit_case(ctx, *tb, shape, 4096, 20);
  }
  tb.reset();
  // The MLPerf DLRM-DCNv2 model's embedding dim and bag sizes, on 8 tables of 4M rows.
  const std::string mlperf = "t8_r4M_d128_b8192_bag20";
  if (any_selected(mlperf, {"embedding_bf16_fwd", "embedding_bf16_bwd_rowwise"})) {
    tb = make_tables(ctx, std::vector<std::int64_t>(8, 1 << 22), 128);
    sixteen_bit_case(ctx, *tb, mlperf, 8192, 20);
  }
}

}  // namespace

FK_BENCH_CASE("recsys", "embedding", recsys_cases);

}  // namespace fk::bench
