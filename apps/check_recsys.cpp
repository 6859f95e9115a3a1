// `fusekit check` for the family recsys (apps/check_families.hpp): the embedding bags, their
// backward fused with the optimizer, the dot interaction and the loss.
#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "apps/check_families.hpp"
#include "fusekit/fusekit.hpp"

namespace fk::app::check {

namespace {

// The loss accumulator's doubles [0] (the sum of the mean losses) and [1] (the calls).
std::vector<double> accumulated(const TensorView& acc) {
  Tensor h = Tensor::empty(acc.shape(), acc.dtype(), kCpu);
  copy(h, acc);
  return {h.data_as<double>()[0], h.data_as<double>()[1]};
}

Tensor zeroed_accumulator(Device d) {
  Tensor acc = Tensor::empty({8 * kSigmoidBceAccumulatorDoubles}, DType::u8, d);
  fill(acc, 0.0);
  return acc;
}

}  // namespace

// recsys_test.cpp's RecsysSpec cases: sums of small integers (exact), the loss in closed form.
std::vector<Measure> recsys_by_hand() {
  std::vector<Measure> out;
  // Tables of 3 and 2 rows, D = 2, B = 2: bag (t0, b0) = rows 0 + 2, (t0, b1) = row 1, (t1, b0) =
  // row 1, (t1, b1) empty.
  const TableLayout layout({3, 2});
  const Tensor weights = host({5, 2}, DType::f32, {1, 2, 3, 4, 5, 6, 10, 20, 30, 40});
  const Tensor indices = host({4}, DType::i64, {0, 2, 1, 1}), offsets = host({5}, DType::i64, {0, 2, 3, 4, 4});
  Tensor pooled = Tensor::empty({2, 2, 2}, DType::f32, kCpu);
  poison(pooled);
  embedding_bag_forward(layout, {weights, indices.view(), offsets.view(), std::nullopt, pooled}, {});
  out.push_back(close("embedding_bag_forward sum, 2 tables D 2 B 2 by hand", values(pooled),
                      {6, 8, 30, 40, 3, 4, 0, 0}, kExact));
  // Z = [[1, 2], [3, 4]]: R = [z0, <z1, z0>] = [1, 2, 11].
  const Tensor z = host({1, 2, 2}, DType::f32, {1, 2, 3, 4});
  const DotPairs pairs(2, false);
  Tensor r = Tensor::empty({1, 3}, DType::f32, kCpu);
  interaction_forward({z, r, &pairs}, {});
  out.push_back(close("interaction_forward dot, F 2 D 2 by hand", values(r), {1, 2, 11}, kExact));
  // x = [0, 2], y = [1, 0]: losses ln 2 and 2 + log1p(e^-2); dlogits = [(0.5 - 1) / 2, sigmoid(2) / 2].
  const Tensor x = host({2}, DType::f32, {0, 2}), y = host({2}, DType::f32, {1, 0});
  Tensor dx = Tensor::empty({2}, DType::f32, kCpu);
  const Tensor acc = zeroed_accumulator(kCpu);
  sigmoid_bce_forward_backward({x, y, dx, acc});
  const double loss = (std::log(2.0) + 2 + std::log1p(std::exp(-2.0))) / 2;
  out.push_back(close("sigmoid_bce loss, B 2 by hand", accumulated(acc), {loss, 1}, {1e-12, 1e-12}));
  out.push_back(close("sigmoid_bce dlogits, B 2 by hand", values(dx), {-0.25, 0.5 / (1 + std::exp(-2.0))},
                      one_rounding(DType::f32)));
  return out;
}

// recsys_test.cpp's RawForwardMatchesSpecForBothHashes, ForwardAndEveryUpdateMatchSpec (row-wise
// Adagrad), the dot interaction's ForwardAndBackwardMatchSpec and SigmoidBceMatchesSpec, each at
// one odd shape.
std::vector<Measure> recsys_against_spec(Device gpu) {
  std::vector<Measure> out;
  // One-hot lookup with the hash fused in, then its backward fused with row-wise Adagrad.
  const std::vector<std::int64_t> rows{1, 7, 1000, 3};
  const std::int64_t nt = 4, batch = 37, dim = 16, nnz = nt * batch;
  const std::string c = fmt::format("tables 1/7/1000/3 D {} B {}", dim, batch);
  const TableLayout host_layout(rows), layout(rows, gpu);
  std::mt19937 rng(5);
  Tensor hraw = Tensor::empty({nnz}, DType::i32, kCpu);
  for (std::int64_t i = 0; i < nnz; ++i) hraw.data_as<std::int32_t>()[i] = static_cast<std::int32_t>(rng());  // any 32 bits
  const Tensor graw = hraw.copy_to(gpu);
  Tensor w = random({layout.total_rows(), dim}, DType::f32, 501);
  Tensor state = Tensor::empty({layout.total_rows()}, DType::f32, kCpu);
  fill(state, 0.0);
  Tensor gw = w.copy_to(gpu), gstate = state.copy_to(gpu);
  Tensor pooled = Tensor::empty({batch, nt, dim}, DType::f32, kCpu), gpooled = Tensor::empty({batch, nt, dim}, DType::f32, gpu);
  Tensor keys = Tensor::empty({nnz}, DType::i32, kCpu), bags = Tensor::empty({nnz}, DType::i32, kCpu);
  Tensor gkeys = Tensor::empty({nnz}, DType::i32, gpu), gbags = Tensor::empty({nnz}, DType::i32, gpu);
  poison(gpooled);
  const EmbeddingBagParams fp{.hash = RowHash::reference};
  embedding_bag_forward(host_layout, {w, std::nullopt, std::nullopt, hraw.view(), pooled, keys.view(), bags.view()}, fp);
  embedding_bag_forward(layout, {gw, std::nullopt, std::nullopt, graw.view(), gpooled, gkeys.view(), gbags.view()}, fp);
  out.push_back(same_bits("embedding_bag_forward raw, hash reference, " + c, gpooled, pooled));  // copies: exact
  const Tensor dout = random({batch, nt, dim}, DType::f32, 502);
  const EmbeddingOptimizerParams op{.update = EmbeddingUpdate::rowwise_adagrad, .lr = 0.05f};
  embedding_bag_backward_update(host_layout, {keys, bags, dout, std::nullopt, w, state.view()}, op);
  Tensor workspace =
      Tensor::empty({static_cast<std::int64_t>(embedding_bag_backward_workspace_bytes(nnz, dim))}, DType::u8, gpu);
  embedding_bag_backward_update(layout, {gkeys, gbags, dout.copy_to(gpu), std::nullopt, gw, gstate.view(), workspace.view()},
                                op);
  // fp32 sums of a row's gradients against the spec's double sums (recsys_test.cpp's bound).
  out.push_back(close("embedding_bag_backward_update rowwise_adagrad weights, " + c, gw, w, {1e-5, 1e-4}));
  out.push_back(close("embedding_bag_backward_update rowwise_adagrad state, " + c, gstate, state, {1e-5, 1e-4}));

  // The dot interaction of DLRM's Kaggle model: F = 27, D = 16, padded rows of R.
  const std::int64_t nf = 27, size = interaction_size({}, nf, dim), ld = (size + 3) / 4 * 4 + 4;
  const std::string ci = fmt::format("dot F {} D {} B {}", nf, dim, batch);
  const DotPairs hp(nf, false), gp(nf, false, gpu);
  const Tensor z = random({batch, nf, dim}, DType::f32, 503), gz = z.copy_to(gpu);
  Tensor r = Tensor::empty({batch, ld}, DType::f32, kCpu), gr = Tensor::empty({batch, ld}, DType::f32, gpu);
  poison(gr);
  interaction_forward({z, r, &hp}, {});
  interaction_forward({gz, gr, &gp}, {});
  out.push_back(close("interaction_forward " + ci, gr, r, {1e-5, 1e-5}));
  const Tensor dr = random({batch, ld}, DType::f32, 504);
  Tensor dz = Tensor::empty({batch, nf, dim}, DType::f32, kCpu), gdz = Tensor::empty({batch, nf, dim}, DType::f32, gpu);
  poison(gdz);
  interaction_backward({z, dr, dz, &hp, true}, {});
  interaction_backward({gz, dr.copy_to(gpu), gdz, &gp, true}, {});
  out.push_back(close("interaction_backward relu_x " + ci, gdz, dz, {1e-5, 1e-4}));

  // The fused loss over 1000 logits in [-30, 30).
  const std::int64_t n = 1000;
  const Tensor x = random({n}, DType::f32, 505, -30.f, 30.f);
  std::vector<double> yv = values(random({n}, DType::f32, 506, 0.f, 1.f));
  for (double& v : yv) v = v < 0.5 ? 0.0 : 1.0;
  const Tensor y = host({n}, DType::f32, yv);
  Tensor dx = Tensor::empty({n}, DType::f32, kCpu), gdx = Tensor::empty({n}, DType::f32, gpu);
  const Tensor acc = zeroed_accumulator(kCpu), gacc = zeroed_accumulator(gpu);
  poison(gdx);
  sigmoid_bce_forward_backward({x, y, dx, acc});
  sigmoid_bce_forward_backward({x.copy_to(gpu), y.copy_to(gpu), gdx, gacc});
  // Each term a float expression (about 1e-7 relative), summed in double.
  out.push_back(close("sigmoid_bce loss, B 1000", accumulated(gacc), accumulated(acc), {0, 1e-6}));
  out.push_back(close("sigmoid_bce dlogits, B 1000", gdx, dx, {1e-7 / static_cast<double>(n), 1e-6}));
  return out;
}

}  // namespace fk::app::check
