// Tests of the recsys family's CUDA kernels against the spec on random inputs of many shapes (odd
// D, one sample, empty bags, repeated rows, tables of one row, more than 2^16 entries), and their
// bad inputs on the device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <tuple>
#include <vector>

#include "fusekit/fusekit.hpp"
#include "fusekit/ops/recsys.hpp"
#include "recsys_test_util.hpp"
#include "test_util.hpp"

namespace fk {
namespace {

using namespace recsys_test;

// ---------------------------------------------------------------------------------------------
// CUDA kernels against the spec
// ---------------------------------------------------------------------------------------------

// Random CSR input for `rows` tables and B samples: bag sizes in [0, max_bag] (one-row tables and
// small tables give repeated rows), from a fixed seed.
struct Csr {
  std::vector<std::int64_t> indices, offsets{0};
};

Csr random_csr(const std::vector<std::int64_t>& rows, std::int64_t batch, int max_bag, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  Csr c;
  for (std::size_t t = 0; t < rows.size(); ++t)
    for (std::int64_t b = 0; b < batch; ++b) {
      const int n = static_cast<int>(rng() % static_cast<std::uint64_t>(max_bag + 1));
      for (int k = 0; k < n; ++k) c.indices.push_back(static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(rows[t])));
      c.offsets.push_back(static_cast<std::int64_t>(c.indices.size()));
    }
  return c;
}

// |got - want| <= atol + rtol |want| elementwise: fp32 sums of a bag's rows (or of a row's
// gradients) against the spec's double sums: a relative 1e-5 covers sums of thousands of terms.
::testing::AssertionResult close(const TensorView& got, const TensorView& want, double atol = 1e-5,
                                 double rtol = 1e-5) {
  return test::all_close(got, want, {atol, rtol});
}

struct EmbeddingShape {
  std::vector<std::int64_t> rows;
  std::int64_t batch, dim;
  int max_bag;
  std::int64_t row_stride_pad;  // extra floats between pooled rows
};

// The random CSR batch of one shape (seeded), on the host and on the GPU, with the layouts and
// the pooled view [B, T, D] of a padded output buffer.
struct EmbeddingInputs {
  EmbeddingInputs(const EmbeddingShape& shape, std::uint64_t seed)
      : gpu(Device::cuda(0)),
        host_layout(shape.rows),
        layout(shape.rows, gpu),
        nt(layout.num_tables()),
        batch(shape.batch),
        dim(shape.dim),
        stride(nt * dim + shape.row_stride_pad) {
    const Csr csr = random_csr(shape.rows, batch, shape.max_bag, seed);
    indices = i64(csr.indices);
    offsets = i64(csr.offsets);
    g_indices = indices.copy_to(gpu);
    g_offsets = offsets.copy_to(gpu);
    nnz = indices.numel();
  }
  TensorView pooled(const Tensor& buf) const {
    return TensorView(buf.data(), DType::f32, {batch, nt, dim}, {stride, dim, 1}, buf.device());
  }
  Device gpu;
  TableLayout host_layout, layout;
  std::int64_t nt, batch, dim, stride, nnz = 0;
  Tensor indices, offsets, g_indices, g_offsets;
};

class RecsysEmbeddingGpu : public ::testing::TestWithParam<std::tuple<EmbeddingShape, Pooling>> {};

TEST_P(RecsysEmbeddingGpu, ForwardAndEveryUpdateMatchSpec) {
  FK_SKIP_WITHOUT_GPU();
  const auto& [shape, pooling] = GetParam();
  const EmbeddingInputs in(shape, 17 + static_cast<std::uint64_t>(shape.dim));
  const Device gpu = in.gpu;
  const TableLayout &host_layout = in.host_layout, &layout = in.layout;
  const std::int64_t batch = in.batch, dim = in.dim, nnz = in.nnz, stride = in.stride;
  const Tensor &indices = in.indices, &offsets = in.offsets, &g_indices = in.g_indices, &g_offsets = in.g_offsets;
  const auto pooled = [&](const Tensor& buf) { return in.pooled(buf); };
  Tensor weights = test::random_tensor({layout.total_rows(), dim}, DType::f32, kCpu, 3);
  Tensor g_weights = weights.copy_to(gpu);
  Tensor out = Tensor::empty({batch * stride}, DType::f32, kCpu), g_out = Tensor::empty({batch * stride}, DType::f32, gpu);
  fill(out, 0.0);
  fill(g_out, 0.0);  // the padding between rows stays 0 on both
  Tensor keys = Tensor::empty({nnz}, DType::i32, kCpu), bags = Tensor::empty({nnz}, DType::i32, kCpu);
  Tensor g_keys = Tensor::empty({nnz}, DType::i32, gpu), g_bags = Tensor::empty({nnz}, DType::i32, gpu);
  embedding_bag_forward(host_layout, {weights, indices.view(), offsets.view(), std::nullopt, pooled(out), keys.view(),
                                      bags.view()},
                        {pooling});
  embedding_bag_forward(layout, {g_weights, g_indices.view(), g_offsets.view(), std::nullopt, pooled(g_out),
                                 g_keys.view(), g_bags.view()},
                        {pooling});
  ASSERT_TRUE(close(g_out, out));
  EXPECT_EQ(ints(g_keys), ints(keys));
  EXPECT_EQ(ints(g_bags), ints(bags));

  // One update of each kind from the same gradient, against the spec; twice on the GPU, bitwise equal.
  const Tensor dout = test::random_tensor({batch * stride}, DType::f32, kCpu, 5);
  const Tensor g_dout = dout.copy_to(gpu);
  Tensor ws = Tensor::empty({static_cast<std::int64_t>(embedding_bag_backward_workspace_bytes(nnz, dim)) + 1}, DType::u8, gpu);
  for (EmbeddingUpdate u : {EmbeddingUpdate::sgd, EmbeddingUpdate::adagrad, EmbeddingUpdate::rowwise_adagrad,
                            EmbeddingUpdate::store_gradient}) {
    SCOPED_TRACE(static_cast<int>(u));
    std::optional<Tensor> state;
    if (u == EmbeddingUpdate::adagrad) state = test::random_tensor({layout.total_rows(), dim}, DType::f32, kCpu, 7, 0, 1);
    if (u == EmbeddingUpdate::rowwise_adagrad) state = test::random_tensor({layout.total_rows()}, DType::f32, kCpu, 7, 0, 1);
    const EmbeddingOptimizerParams p{u, 0.05f, 1e-8f, pooling};
    Tensor w = weights.clone();
    if (u == EmbeddingUpdate::store_gradient) fill(w, 0.0);
    std::optional<Tensor> s = state ? std::optional<Tensor>(state->clone()) : std::nullopt;
    embedding_bag_backward_update(host_layout, {keys, bags, pooled(dout), offsets.view(), w,
                                                s ? std::optional<TensorView>(s->view()) : std::nullopt},
                                  p);
    Tensor gw[2], gs[2];
    for (int run = 0; run < 2; ++run) {
      gw[run] = weights.copy_to(gpu);
      if (u == EmbeddingUpdate::store_gradient) fill(gw[run], 0.0);
      std::optional<TensorView> sv;
      if (state) {
        gs[run] = state->copy_to(gpu);
        sv = gs[run].view();
      }
      // A misaligned workspace start (offset by one byte): the op aligns its pieces itself.
      const TensorView wsv(static_cast<unsigned char*>(ws.data()) + 1, DType::u8, {ws.numel() - 1}, gpu);
      embedding_bag_backward_update(layout, {g_keys, g_bags, pooled(g_dout), g_offsets.view(), gw[run], sv, wsv}, p);
    }
    EXPECT_TRUE(close(gw[0], w, 1e-5, 1e-4));
    if (s) {
      EXPECT_TRUE(close(gs[0], *s, 1e-5, 1e-4));
    }
    EXPECT_EQ(floats(gw[0]), floats(gw[1])) << "not deterministic";
  }
}

// The unfused baselines: one launch per table (keys and bags by one more launch), and the dense
// gradient written whole, against the spec.
TEST_P(RecsysEmbeddingGpu, PerTableLaunchAndDenseGradientMatchSpec) {
  FK_SKIP_WITHOUT_GPU();
  const auto& [shape, pooling] = GetParam();
  const EmbeddingInputs in(shape, 23 + static_cast<std::uint64_t>(shape.dim));
  const Device gpu = in.gpu;
  const TableLayout &host_layout = in.host_layout, &layout = in.layout;
  const std::int64_t batch = in.batch, dim = in.dim, nnz = in.nnz, stride = in.stride;
  const Tensor &indices = in.indices, &offsets = in.offsets, &g_indices = in.g_indices, &g_offsets = in.g_offsets;
  const auto pooled = [&](const Tensor& buf) { return in.pooled(buf); };
  const Tensor weights = test::random_tensor({layout.total_rows(), dim}, DType::f32, kCpu, 4);
  const Tensor g_weights = weights.copy_to(gpu);
  Tensor out = Tensor::empty({batch * stride}, DType::f32, kCpu), g_out = Tensor::empty({batch * stride}, DType::f32, gpu);
  fill(out, 0.0);
  fill(g_out, 0.0);
  Tensor keys = Tensor::empty({nnz}, DType::i32, kCpu), bags = Tensor::empty({nnz}, DType::i32, kCpu);
  Tensor g_keys = Tensor::empty({nnz}, DType::i32, gpu), g_bags = Tensor::empty({nnz}, DType::i32, gpu);
  EmbeddingBagParams fp{pooling};
  fp.per_table_launch = true;
  embedding_bag_forward(host_layout, {weights, indices.view(), offsets.view(), std::nullopt, pooled(out), keys.view(),
                                      bags.view()},
                        {pooling});
  embedding_bag_forward(layout, {g_weights, g_indices.view(), g_offsets.view(), std::nullopt, pooled(g_out),
                                 g_keys.view(), g_bags.view()},
                        fp);
  EXPECT_TRUE(close(g_out, out));
  EXPECT_EQ(ints(g_keys), ints(keys));
  EXPECT_EQ(ints(g_bags), ints(bags));
  // Without keys and bags: the lookups alone.
  fill(g_out, 0.0);
  embedding_bag_forward(layout, {g_weights, g_indices.view(), g_offsets.view(), std::nullopt, pooled(g_out)}, fp);
  EXPECT_TRUE(close(g_out, out));

  const Tensor dout = test::random_tensor({batch * stride}, DType::f32, kCpu, 6);
  const Tensor g_dout = dout.copy_to(gpu);
  const EmbeddingOptimizerParams p{EmbeddingUpdate::dense_gradient, 0, 0, pooling};
  Tensor grad = Tensor::empty({layout.total_rows(), dim}, DType::f32, kCpu);
  test::poison(grad);
  embedding_bag_backward_update(host_layout, {keys, bags, pooled(dout), offsets.view(), grad}, p);
  Tensor ws = Tensor::empty({static_cast<std::int64_t>(embedding_bag_backward_workspace_bytes(nnz, dim))}, DType::u8, gpu);
  Tensor g_grad[2];
  for (int run = 0; run < 2; ++run) {
    g_grad[run] = Tensor::empty({layout.total_rows(), dim}, DType::f32, gpu);
    test::poison(g_grad[run]);  // written whole: no NaN may survive
    embedding_bag_backward_update(layout, {g_keys, g_bags, pooled(g_dout), g_offsets.view(), g_grad[run], std::nullopt,
                                           ws.view()},
                                  p);
  }
  EXPECT_TRUE(close(g_grad[0], grad, 1e-5, 1e-4));
  EXPECT_EQ(floats(g_grad[0]), floats(g_grad[1])) << "not deterministic";
}

// One 16-bit step at the larger of |a| and |b| (bf16: 8 significant bits; f16: 11, with its
// subnormals' fixed step 2^-24).
double step16(float a, float b, DType dt) {
  const double m = std::max(std::fabs(a), std::fabs(b));
  if (m == 0) return 0;
  const int e = std::ilogb(m);
  return dt == DType::bf16 ? std::ldexp(1.0, e - 7) : std::ldexp(1.0, std::max(e, -14) - 10);
}

// Tables of bf16 and f16: the forward pools their values as the spec does; every update, drawing
// from the same (seed, offset) (once through a device counter), lands where the spec's does, or
// one 16-bit step away where the GPU's fp32 sum and the spec's double sum straddle a draw's
// threshold (rare: at least 99% of the elements are the same bits); twice on the GPU, bitwise equal.
TEST_P(RecsysEmbeddingGpu, SixteenBitTablesMatchSpec) {
  FK_SKIP_WITHOUT_GPU();
  const auto& [shape, pooling] = GetParam();
  const EmbeddingInputs in(shape, 29 + static_cast<std::uint64_t>(shape.dim));
  const Device gpu = in.gpu;
  const TableLayout &host_layout = in.host_layout, &layout = in.layout;
  const std::int64_t batch = in.batch, dim = in.dim, nnz = in.nnz, stride = in.stride;
  const Tensor &indices = in.indices, &offsets = in.offsets, &g_indices = in.g_indices, &g_offsets = in.g_offsets;
  const auto pooled = [&](const Tensor& buf) { return in.pooled(buf); };
  Tensor keys = Tensor::empty({nnz}, DType::i32, kCpu), bags = Tensor::empty({nnz}, DType::i32, kCpu);
  Tensor g_keys = Tensor::empty({nnz}, DType::i32, gpu), g_bags = Tensor::empty({nnz}, DType::i32, gpu);
  const Tensor dout = test::random_tensor({batch * stride}, DType::f32, kCpu, 6);
  const Tensor g_dout = dout.copy_to(gpu);
  Tensor ws = Tensor::empty({static_cast<std::int64_t>(embedding_bag_backward_workspace_bytes(nnz, dim)) + 1}, DType::u8, gpu);
  for (const DType dt : {DType::bf16, DType::f16}) {
    SCOPED_TRACE(std::string(dtype_name(dt)));
    const Tensor weights = test::random_tensor({layout.total_rows(), dim}, dt, kCpu, 8);
    Tensor out = Tensor::empty({batch * stride}, DType::f32, kCpu), g_out = Tensor::empty({batch * stride}, DType::f32, gpu);
    fill(out, 0.0);
    fill(g_out, 0.0);
    embedding_bag_forward(host_layout, {weights, indices.view(), offsets.view(), std::nullopt, pooled(out), keys.view(),
                                        bags.view()},
                          {pooling});
    embedding_bag_forward(layout, {weights.copy_to(gpu), g_indices.view(), g_offsets.view(), std::nullopt,
                                   pooled(g_out), g_keys.view(), g_bags.view()},
                          {pooling});
    ASSERT_TRUE(close(g_out, out));
    // Then again with the tables drawing their rounding as rows elsewhere (TableLayout's draw
    // bases: table t from row 3 base(t) + 8 t + 5, apart and off the Philox blocks' 8 elements).
    std::vector<std::int64_t> bases;
    for (int t = 0; t < layout.num_tables(); ++t) bases.push_back(3 * layout.base(t) + 8 * t + 5);
    const TableLayout drawn_host(shape.rows, kCpu, bases), drawn(shape.rows, gpu, bases);
    constexpr EmbeddingUpdate kUpdates[] = {EmbeddingUpdate::sgd, EmbeddingUpdate::adagrad, EmbeddingUpdate::rowwise_adagrad};
    for (int run_case = 0; run_case < 6; ++run_case) {
      const bool elsewhere = run_case >= 3;
      const EmbeddingUpdate u = kUpdates[run_case % 3];
      SCOPED_TRACE(std::string(elsewhere ? "draw bases, " : "") + "update " + std::to_string(static_cast<int>(u)));
      const TableLayout& spec_layout = elsewhere ? drawn_host : host_layout;
      const TableLayout& gpu_layout = elsewhere ? drawn : layout;
      std::optional<Tensor> state;
      if (u == EmbeddingUpdate::adagrad) state = test::random_tensor({layout.total_rows(), dim}, DType::f32, kCpu, 7, 0, 1);
      if (u == EmbeddingUpdate::rowwise_adagrad) state = test::random_tensor({layout.total_rows()}, DType::f32, kCpu, 7, 0, 1);
      EmbeddingOptimizerParams p{u, 0.05f, 1e-8f, pooling};
      p.seed = 31;
      p.offset = 5;
      Tensor w = weights.clone();
      std::optional<Tensor> s = state ? std::optional<Tensor>(state->clone()) : std::nullopt;
      embedding_bag_backward_update(spec_layout, {keys, bags, pooled(dout), offsets.view(), w,
                                                  s ? std::optional<TensorView>(s->view()) : std::nullopt},
                                    p);
      Tensor gw[2], gs[2];
      for (int run = 0; run < 2; ++run) {
        gw[run] = weights.copy_to(gpu);
        std::optional<TensorView> sv;
        if (state) {
          gs[run] = state->copy_to(gpu);
          sv = gs[run].view();
        }
        EmbeddingOptimizerParams q = p;
        Tensor counter;
        if (run == 1) {  // offset 2 + the counter's 3
          counter = i64({3}).copy_to(gpu);
          q.offset = 2;
          q.offset_counter = counter.view();
        }
        const TensorView wsv(static_cast<unsigned char*>(ws.data()) + 1, DType::u8, {ws.numel() - 1}, gpu);
        embedding_bag_backward_update(gpu_layout, {g_keys, g_bags, pooled(g_dout), g_offsets.view(), gw[run], sv, wsv}, q);
      }
      const std::vector<float> got = test::to_floats(gw[0]), want = test::to_floats(w);
      std::int64_t same = 0;
      for (std::size_t i = 0; i < got.size(); ++i) {
        same += got[i] == want[i];
        ASSERT_LE(std::fabs(got[i] - want[i]), step16(got[i], want[i], dt)) << "element " << i;
      }
      EXPECT_GE(static_cast<double>(same), 0.99 * static_cast<double>(got.size()));
      if (s) {
        EXPECT_TRUE(close(gs[0], *s, 1e-5, 1e-4));
      }
      EXPECT_EQ(test::to_floats(gw[0]), test::to_floats(gw[1])) << "not deterministic";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, RecsysEmbeddingGpu,
    ::testing::Combine(
        ::testing::Values(EmbeddingShape{{5, 1, 100}, 7, 16, 3, 0},          // a one-row table
                          EmbeddingShape{{3, 2}, 1, 3, 4, 5},                // one sample, odd D, padded rows
                          EmbeddingShape{{1000, 17, 1}, 33, 33, 2, 0},       // D > 16, not a multiple of 16
                          EmbeddingShape{{50, 7}, 64, 1, 6, 3},              // D = 1
                          EmbeddingShape{{64, 3, 9}, 4096, 8, 12, 8},        // nnz past 2^16, long segments
                          EmbeddingShape{{100000, 40}, 512, 4, 0, 0},        // every bag empty
                          EmbeddingShape{{40, 1000}, 300, 128, 5, 16}),      // wide rows
        ::testing::Values(Pooling::sum, Pooling::mean)));

TEST(RecsysGpu, RawForwardMatchesSpecForBothHashes) {
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  const std::vector<std::int64_t> rows{1, 7, 1000, 3};
  const TableLayout host_layout(rows), layout(rows, gpu);
  for (std::int64_t dim : {1, 4, 6, 16}) {
    for (std::int64_t batch : {1, 37, 2048}) {
      const std::int64_t nt = 4;
      std::mt19937 rng(static_cast<unsigned>(batch * dim));
      std::vector<std::int32_t> raw(static_cast<std::size_t>(nt * batch));
      for (auto& v : raw) v = static_cast<std::int32_t>(rng());  // any 32 bits, the high one too
      const Tensor hraw = i32(raw), graw = hraw.copy_to(gpu);
      const Tensor weights = test::random_tensor({layout.total_rows(), dim}, DType::f32, kCpu, 9);
      const Tensor gweights = weights.copy_to(gpu);
      for (RowHash hash : {RowHash::seed, RowHash::reference}) {
        Tensor out = Tensor::empty({batch, nt + 1, dim}, DType::f32, kCpu);
        Tensor gout = Tensor::empty({batch, nt + 1, dim}, DType::f32, gpu);
        fill(out, 1.0);
        fill(gout, 1.0);
        Tensor keys = Tensor::empty({nt * batch}, DType::i32, kCpu), bags = Tensor::empty({nt * batch}, DType::i32, kCpu);
        Tensor gkeys = Tensor::empty({nt * batch}, DType::i32, gpu), gbags = Tensor::empty({nt * batch}, DType::i32, gpu);
        embedding_bag_forward(host_layout, {weights, std::nullopt, std::nullopt, hraw.view(), pooled_in(out), keys.view(),
                                            bags.view()},
                              {Pooling::sum, hash});
        embedding_bag_forward(layout, {gweights, std::nullopt, std::nullopt, graw.view(), pooled_in(gout), gkeys.view(),
                                       gbags.view()},
                              {Pooling::sum, hash});
        EXPECT_EQ(floats(gout), floats(out)) << "dim " << dim << " batch " << batch;  // copies: exact
        EXPECT_EQ(ints(gkeys), ints(keys));
        EXPECT_EQ(ints(gbags), ints(bags));
      }
    }
  }
}

TEST(RecsysGpu, DenseOptimizerMatchesSpec) {
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  for (const Dims& shape : {Dims{1}, Dims{7}, Dims{3, 5, 9}, Dims{65536 + 3}, Dims{1000, 333}}) {
    for (bool adagrad : {false, true}) {
      SCOPED_TRACE(shape.str() + (adagrad ? " adagrad" : " sgd"));
      const Tensor param = test::random_tensor(shape, DType::f32, kCpu, 41);
      const Tensor grad = test::random_tensor(shape, DType::f32, kCpu, 42);
      const Tensor state = test::random_tensor(shape, DType::f32, kCpu, 43, 0, 1);
      const DenseOptimizerParams p{adagrad, 0.05f, 1e-10f};
      Tensor want = param.clone(), want_state = state.clone();
      reference::dense_optimizer_update(
          {want, grad, adagrad ? std::optional<TensorView>(want_state.view()) : std::nullopt}, p);
      Tensor got = param.copy_to(gpu), got_state = state.copy_to(gpu);
      const Tensor g_grad = grad.copy_to(gpu);
      dense_optimizer_update({got, g_grad, adagrad ? std::optional<TensorView>(got_state.view()) : std::nullopt}, p);
      // The same float formula; nvcc contracts a * b + c into one fma where the host rounds the
      // product first, so each result may differ by an ulp or two of its operands.
      EXPECT_TRUE(close(got, want, 1e-7, 4e-7));
      if (adagrad) {
        EXPECT_TRUE(close(got_state, want_state, 1e-7, 4e-7));
      }
    }
  }
}

TEST(RecsysGpu, SigmoidBceUnfusedMatchesSpec) {
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  for (std::int64_t batch : {1, 1000, 65536 + 7}) {
    // |x| <= 8: 1 - p stays far from f32's rounding of p (an ulp of p there moves ln(1 - p) by
    // about 2e-4 at most), so the GPU's and the spec's p give the same loss to 1e-5.
    const Tensor x = test::random_tensor({batch}, DType::f32, kCpu, 51, -8, 8);
    Tensor y = test::random_tensor({batch}, DType::f32, kCpu, 52, 0, 1);
    for (std::int64_t i = 0; i < batch; ++i) y.data_as<float>()[i] = y.data_as<float>()[i] < 0.5f ? 0.0f : 1.0f;
    Tensor dx = Tensor::empty({batch}, DType::f32, kCpu), prob = Tensor::empty({batch}, DType::f32, kCpu);
    Tensor acc = Tensor::empty({8 * kSigmoidBceAccumulatorDoubles}, DType::u8, kCpu);
    fill(acc, 0.0);
    sigmoid_bce_forward_backward({x, y, dx, acc, prob.view()}, SigmoidBceParams{true});
    const Tensor gx = x.copy_to(gpu), gy = y.copy_to(gpu);
    Tensor gdx = Tensor::empty({batch}, DType::f32, gpu), gprob = Tensor::empty({batch}, DType::f32, gpu);
    test::poison(gdx);
    test::poison(gprob);
    Tensor gacc = Tensor::empty({8 * kSigmoidBceAccumulatorDoubles}, DType::u8, gpu);
    fill(gacc, 0.0);
    sigmoid_bce_forward_backward({gx, gy, gdx, gacc, gprob.view()}, SigmoidBceParams{true});
    const Tensor hacc = test::to_host(gacc);
    EXPECT_NEAR(hacc.data_as<double>()[0], acc.data_as<double>()[0], 1e-5 * acc.data_as<double>()[0]) << batch;
    EXPECT_EQ(hacc.data_as<double>()[1], 1.0);
    EXPECT_TRUE(close(gprob, prob, 1e-7, 1e-6)) << batch;
    EXPECT_TRUE(close(gdx, dx, 1e-7 / static_cast<double>(batch), 1e-6)) << batch;
  }
  // The clamp: p rounds to 1 and to 0 exactly on both; each mislabelled term is capped at 100.
  const Tensor x = f32({3}, {200, -200, 0}), y = f32({3}, {0, 1, 1});
  const Tensor gx = x.copy_to(gpu), gy = y.copy_to(gpu);
  Tensor gdx = Tensor::empty({3}, DType::f32, gpu), gprob = Tensor::empty({3}, DType::f32, gpu);
  Tensor gacc = Tensor::empty({8 * kSigmoidBceAccumulatorDoubles}, DType::u8, gpu);
  fill(gacc, 0.0);
  sigmoid_bce_forward_backward({gx, gy, gdx, gacc, gprob.view()}, SigmoidBceParams{true});
  EXPECT_NEAR(test::to_host(gacc).data_as<double>()[0], (200 + std::log(2.0)) / 3, 1e-6);
  EXPECT_EQ(floats(gprob), (std::vector<float>{1, 0, 0.5f}));
}

class RecsysInteractionGpu
    : public ::testing::TestWithParam<std::tuple<std::int64_t, std::int64_t, std::int64_t, InteractionKind, bool>> {};

TEST_P(RecsysInteractionGpu, ForwardAndBackwardMatchSpec) {
  FK_SKIP_WITHOUT_GPU();
  const auto [batch, nf, dim, kind, self] = GetParam();
  const Device gpu = Device::cuda(0);
  const InteractionParams p{kind, self};
  const std::int64_t size = interaction_size(p, nf, dim);
  const std::int64_t ld = kind == InteractionKind::outer ? size : (size + 3) / 4 * 4 + 4;
  const DotPairs hp(nf, self), gp(nf, self, gpu);
  const Tensor z = test::random_tensor({batch, nf, dim}, DType::f32, kCpu, 21, -1, 1);
  const Tensor gz = z.copy_to(gpu);
  Tensor r = Tensor::empty({batch, ld}, DType::f32, kCpu), gr = Tensor::empty({batch, ld}, DType::f32, gpu);
  test::poison(gr);
  interaction_forward({z, r, &hp}, p);
  interaction_forward({gz, gr, &gp}, p);
  EXPECT_TRUE(close(gr, r));
  const Tensor dr = test::random_tensor({batch, ld}, DType::f32, kCpu, 22);
  const Tensor gdr = dr.copy_to(gpu);
  for (bool relu_x : {false, true}) {
    if (relu_x && kind != InteractionKind::dot) continue;
    Tensor dz = Tensor::empty({batch, nf, dim}, DType::f32, kCpu), gdz = Tensor::empty({batch, nf, dim}, DType::f32, gpu);
    test::poison(gdz);
    interaction_backward({z, dr, dz, &hp, relu_x}, p);
    interaction_backward({gz, gdr, gdz, &gp, relu_x}, p);
    EXPECT_TRUE(close(gdz, dz, 1e-5, 1e-4)) << "relu_x " << relu_x;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Dot, RecsysInteractionGpu,
    ::testing::Combine(::testing::Values(1, 9, 130), ::testing::Values(1, 2, 27, 30),
                       ::testing::Values(1, 3, 8, 16, 32), ::testing::Values(InteractionKind::dot),
                       ::testing::Bool()));
// More than 32 features: the backward's shared-memory kernel for every D.
INSTANTIATE_TEST_SUITE_P(
    DotWide, RecsysInteractionGpu,
    ::testing::Combine(::testing::Values(9), ::testing::Values(33), ::testing::Values(3, 8),
                       ::testing::Values(InteractionKind::dot), ::testing::Bool()));
INSTANTIATE_TEST_SUITE_P(
    CatOuter, RecsysInteractionGpu,
    ::testing::Combine(::testing::Values(1, 9), ::testing::Values(1, 3), ::testing::Values(1, 5),
                       ::testing::Values(InteractionKind::cat, InteractionKind::outer), ::testing::Values(false)));

// The unfused dot (batched fp32 GEMM + gather / scatter + dense-row add) against the spec.
class RecsysInteractionBmmGpu
    : public ::testing::TestWithParam<std::tuple<std::int64_t, std::int64_t, std::int64_t, bool>> {};

TEST_P(RecsysInteractionBmmGpu, ForwardAndBackwardMatchSpec) {
  FK_SKIP_WITHOUT_GPU();
  const auto [batch, nf, dim, self] = GetParam();
  const Device gpu = Device::cuda(0);
  InteractionParams p{InteractionKind::dot, self};
  p.impl = InteractionImpl::bmm;
  const std::int64_t size = interaction_size(p, nf, dim), ld = size + 3;  // 3 padding columns
  const DotPairs hp(nf, self), gp(nf, self, gpu);
  const Tensor z = test::random_tensor({batch, nf, dim}, DType::f32, kCpu, 61, -1, 1);
  const Tensor gz = z.copy_to(gpu);
  Tensor ws = Tensor::empty({batch, nf, nf}, DType::f32, gpu);
  test::poison(ws);
  Tensor r = Tensor::empty({batch, ld}, DType::f32, kCpu), gr = Tensor::empty({batch, ld}, DType::f32, gpu);
  test::poison(gr);
  interaction_forward({z, r, &hp}, p);
  interaction_forward({gz, gr, &gp, ws.view()}, p);
  // fp32 GEMM sums of D products of values in [-1, 1] against the spec's double sums.
  EXPECT_TRUE(close(gr, r));
  const Tensor dr = test::random_tensor({batch, ld}, DType::f32, kCpu, 62);
  const Tensor gdr = dr.copy_to(gpu);
  Tensor dz = Tensor::empty({batch, nf, dim}, DType::f32, kCpu), gdz = Tensor::empty({batch, nf, dim}, DType::f32, gpu);
  test::poison(ws);
  test::poison(gdz);
  interaction_backward({z, dr, dz, &hp}, p);
  InteractionBackwardArgs ga{gz, gdr, gdz, &gp};
  ga.workspace = ws.view();
  interaction_backward(ga, p);
  EXPECT_TRUE(close(gdz, dz, 1e-5, 1e-4));
}

INSTANTIATE_TEST_SUITE_P(
    Dot, RecsysInteractionBmmGpu,
    ::testing::Combine(::testing::Values(1, 9, 130), ::testing::Values(1, 2, 27, 33), ::testing::Values(1, 3, 16, 32),
                       ::testing::Bool()));

TEST(RecsysGpu, SigmoidBceMatchesSpec) {
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  for (std::int64_t batch : {1, 1000, 1024, 65536 + 7, 200000}) {
    const Tensor x = test::random_tensor({batch}, DType::f32, kCpu, 31, -30, 30);
    Tensor y = test::random_tensor({batch}, DType::f32, kCpu, 32, 0, 1);
    for (std::int64_t i = 0; i < batch; ++i) y.data_as<float>()[i] = y.data_as<float>()[i] < 0.5f ? 0.0f : 1.0f;
    Tensor dx = Tensor::empty({batch}, DType::f32, kCpu);
    Tensor acc = Tensor::empty({8 * kSigmoidBceAccumulatorDoubles}, DType::u8, kCpu);
    fill(acc, 0.0);
    sigmoid_bce_forward_backward({x, y, dx, acc});
    const Tensor gx = x.copy_to(gpu), gy = y.copy_to(gpu);
    Tensor gdx = Tensor::empty({batch}, DType::f32, gpu);
    Tensor gacc = Tensor::empty({8 * kSigmoidBceAccumulatorDoubles}, DType::u8, gpu);
    fill(gacc, 0.0);
    sigmoid_bce_forward_backward({gx, gy, gdx, gacc});
    const Tensor hacc = test::to_host(gacc);
    // Each term is a float expression (about 1e-7 relative), summed in double.
    EXPECT_NEAR(hacc.data_as<double>()[0], acc.data_as<double>()[0], 1e-6 * acc.data_as<double>()[0]) << batch;
    EXPECT_EQ(hacc.data_as<double>()[1], 1.0);
    EXPECT_TRUE(close(gdx, dx, 1e-7 / static_cast<double>(batch), 1e-6)) << batch;
  }
}

// Random bags (sizes 0 to 4, and one of 300) in a random order, from no bag to 70,000: the same
// integers as the spec, and no workspace refused.
TEST(RecsysGpu, PermuteBagsMatchesSpec) {
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  for (std::int64_t n : {0, 1, 7, 1000, 70000}) {
    std::mt19937_64 rng(static_cast<std::uint64_t>(n) + 3);
    std::vector<std::int64_t> len(static_cast<std::size_t>(n)), idx, perm(static_cast<std::size_t>(n));
    for (std::int64_t q = 0; q < n; ++q) {
      len[static_cast<std::size_t>(q)] = q == n / 2 ? 300 : static_cast<std::int64_t>(rng() % 5);
      for (std::int64_t e = 0; e < len[static_cast<std::size_t>(q)]; ++e) idx.push_back(static_cast<std::int64_t>(rng() % 100000));
    }
    std::iota(perm.begin(), perm.end(), std::int64_t{0});
    std::shuffle(perm.begin(), perm.end(), rng);
    const Tensor hl = i64(len), hi = i64(idx), hp = i64(perm);
    const auto nnz = static_cast<std::int64_t>(idx.size());
    Tensor ho = Tensor::empty({n + 1}, DType::i64, kCpu), hout = Tensor::empty({nnz}, DType::i64, kCpu);
    permute_bags({hl, hi, hp, ho, hout});
    const Tensor dl = hl.copy_to(gpu), di = hi.copy_to(gpu), dp = hp.copy_to(gpu);
    Tensor o = Tensor::empty({n + 1}, DType::i64, gpu), out = Tensor::empty({nnz}, DType::i64, gpu);
    test::expect_arg_error([&] { permute_bags({dl, di, dp, o, out}); }, "permute_bags", "workspace");
    Tensor ws = Tensor::empty({static_cast<std::int64_t>(std::max<std::size_t>(permute_bags_workspace_bytes(n), 1))},
                              DType::u8, gpu);
    const Stream stream = Stream::create(gpu);
    permute_bags({dl, di, dp, o, out, ws.view()}, &stream);
    stream.synchronize();
    const Tensor go = test::to_host(o), gout = test::to_host(out);
    EXPECT_EQ(std::memcmp(go.data(), ho.data(), ho.nbytes()), 0) << n;
    EXPECT_EQ(std::memcmp(gout.data(), hout.data(), hout.nbytes()), 0) << n;
  }
}

TEST(RecsysGpu, BadInputs) {
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  const TableLayout host_layout({4, 2}), layout({4, 2}, gpu);
  Tensor w = Tensor::empty({6, 2}, DType::f32, gpu), out = Tensor::empty({3, 2, 2}, DType::f32, gpu);
  const Tensor raw = i32({1, 2, 3, 4, 5, 6}).copy_to(gpu);
  // A layout made for the host, tables on the GPU.
  test::expect_arg_error([&] { embedding_bag_forward(host_layout, {w, std::nullopt, std::nullopt, raw.view(), out}, {}); },
                         "embedding_bag_forward", "layout");
  embedding_bag_forward(layout, {w, std::nullopt, std::nullopt, raw.view(), out}, {});
  // Host raw values with GPU tables.
  const Tensor hraw = i32({1, 2, 3, 4, 5, 6});
  test::expect_arg_error([&] { embedding_bag_forward(layout, {w, std::nullopt, std::nullopt, hraw.view(), out}, {}); },
                         "embedding_bag_forward", "raw");
  // The GPU backward needs its workspace.
  const Tensor keys = i32({0, 1, 2, 3, 4, 5}).copy_to(gpu), bags = i32({0, 1, 2, 3, 4, 5}).copy_to(gpu);
  test::expect_arg_error([&] { embedding_bag_backward_update(layout, {keys, bags, out, std::nullopt, w}, {}); },
                         "embedding_bag_backward_update", "workspace");
  Tensor small = Tensor::empty({16}, DType::u8, gpu);
  test::expect_arg_error(
      [&] { embedding_bag_backward_update(layout, {keys, bags, out, std::nullopt, w, std::nullopt, small.view()}, {}); },
      "embedding_bag_backward_update", "workspace");
  // Pairs made for the host with a GPU Z.
  const DotPairs hp(3, false);
  Tensor z = Tensor::empty({1, 3, 2}, DType::f32, gpu), r = Tensor::empty({1, 8}, DType::f32, gpu);
  test::expect_arg_error([&] { interaction_forward({z, r, &hp}, {}); }, "interaction_forward", "pairs");
  // Too many features for the shared-memory dot kernel.
  const DotPairs big(600, false, gpu);
  Tensor zb = Tensor::empty({1, 600, 16}, DType::f32, gpu);
  Tensor rb = Tensor::empty({1, interaction_size({}, 600, 16)}, DType::f32, gpu);
  test::expect_arg_error([&] { interaction_forward({zb, rb, &big}, {}); }, "interaction_forward", "z");
  // The unfused dot needs its [B, F, F] workspace on the GPU.
  InteractionParams bmm{InteractionKind::dot, false};
  bmm.impl = InteractionImpl::bmm;
  const DotPairs gp(3, false, gpu);
  Tensor dz = Tensor::empty({1, 3, 2}, DType::f32, gpu), dr = Tensor::empty({1, 8}, DType::f32, gpu);
  Tensor ws = Tensor::empty({1, 3, 3}, DType::f32, gpu), ws_bad = Tensor::empty({1, 3, 2}, DType::f32, gpu);
  Tensor ws_host = Tensor::empty({1, 3, 3}, DType::f32, kCpu);
  test::expect_arg_error([&] { interaction_forward({z, r, &gp}, bmm); }, "interaction_forward", "workspace");
  test::expect_arg_error([&] { interaction_forward({z, r, &gp, ws_bad.view()}, bmm); }, "interaction_forward",
                         "workspace");
  test::expect_arg_error([&] { interaction_forward({z, r, &gp, ws_host.view()}, bmm); }, "interaction_forward",
                         "workspace");
  test::expect_arg_error([&] { interaction_backward({z, dr, dz, &gp}, bmm); }, "interaction_backward", "workspace");
  fill(z, 1.0);
  fill(dr, 1.0);
  interaction_forward({z, r, &gp, ws.view()}, bmm);
  InteractionBackwardArgs ba{z, dr, dz, &gp};
  ba.workspace = ws.view();
  interaction_backward(ba, bmm);
  ba.relu_x = true;
  test::expect_arg_error([&] { interaction_backward(ba, bmm); }, "interaction_backward", "relu_x");
}

}  // namespace
}  // namespace fk
