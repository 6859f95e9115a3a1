// Tests of the qgemm family: the packed layout, puzzle 12 at its exact shapes through the puzzle's
// own layout, quantization error bounds, the CUDA kernels (every tile shape, split-K, odd N, M = 1,
// K tails inside a k-tile) against the spec on the dequantized weights, and every bad input.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "fusekit/fusekit.hpp"
#include "ops/qgemm/qgemm_layout.hpp"
#if FUSEKIT_WITH_CUDA
#include "ops/qgemm/qgemm_cuda.hpp"
#endif
#include "ops/common/reference_io.hpp"
#include "test_util.hpp"

namespace fk {
namespace {

const Device kCpu = Device::cpu();

// The op's stated relative error: normwise, as `fusekit bench` reports it.
const auto rel_err = test::rel_err_normwise;

struct Fields {
  int q, z;
  double s;
};

// q, z and s of w[n, k] read straight from a host QuantizedWeight.
Fields fields(const QuantizedWeight& qw, std::int64_t n, std::int64_t k) {
  const qgemm_layout::Slot sl = qgemm_layout::slot_of(n, k, qw.n_pad());
  const std::int64_t g = k / qw.group;
  const auto* words = qw.packed.data_as<const std::uint32_t>();
  const auto* zeros = qw.zero.data_as<const std::uint32_t>();
  return {static_cast<int>((words[sl.word] >> sl.shift) & 0xFu),
          static_cast<int>((zeros[g * (qw.n_pad() / 8) + n / 8] >> (4 * (n % 8))) & 0xFu),
          reference::load(qw.scale, g * qw.n_pad() + n)};
}

// ---------------------------------------------------------------------------------------------
// Layout and spec
// ---------------------------------------------------------------------------------------------

TEST(QgemmLayout, EveryNibbleOnceAndInverse) {
  const std::int64_t n_pad = 256, k_pad = 128;
  std::set<std::pair<std::int64_t, int>> seen;
  for (std::int64_t n = 0; n < n_pad; ++n)
    for (std::int64_t k = 0; k < k_pad; ++k) {
      const qgemm_layout::Slot s = qgemm_layout::slot_of(n, k, n_pad);
      ASSERT_GE(s.word, 0);
      ASSERT_LT(s.word, n_pad * k_pad / 8);
      ASSERT_TRUE(seen.insert({s.word, s.shift}).second) << n << " " << k;
      std::int64_t n2 = -1, k2 = -1;
      qgemm_layout::coords_of(s.word, s.shift / 4, n_pad, n2, k2);
      ASSERT_EQ(n2, n);
      ASSERT_EQ(k2, k);
    }
  // The mma.sync m16n8k16 B fragment: lane 4g + t, register 0 holds k = 2t (low half), 2t + 1.
  const qgemm_layout::Slot a = qgemm_layout::slot_of(3, 2 * 1, n_pad), b = qgemm_layout::slot_of(3, 2 * 1 + 1, n_pad);
  EXPECT_EQ(a.word, (3 * 4 + 1) * 4);
  EXPECT_EQ(a.shift, 0);
  EXPECT_EQ(b.shift, 16);
  EXPECT_EQ(qgemm_layout::slot_of(3, 2 + 8, n_pad).shift, 4);    // register 1, low half
  EXPECT_EQ(qgemm_layout::slot_of(3, 2 + 16, n_pad).shift, 8);   // second k16 step, register 0
  EXPECT_EQ(qgemm_layout::slot_of(3, 32, n_pad).word % 4, 1);    // second 32-wide half: slot 1
  EXPECT_EQ(qgemm_layout::slot_of(8 + 3, 0, n_pad).word % 4, 2); // rows 8..15: slots 2, 3
}

// A row whose range is exactly 15 steps of 1: s = 1, z = 5, q = w + 5, and w̃ == w.
TEST(QgemmSpec, HandWorkedQuantization) {
  for (DType dt : {DType::f16, DType::bf16}) {
    Tensor w = Tensor::empty({2, 32}, dt, kCpu);
    for (std::int64_t k = 0; k < 32; ++k) {
      reference::store(w, k, static_cast<double>(k % 16) - 5.0);
      reference::store(w, 32 + k, 0.0);
    }
    const QuantizedWeight qw = quantize_weights(w, 32);
    for (std::int64_t k = 0; k < 32; ++k) {
      const Fields f = fields(qw, 0, k);
      EXPECT_EQ(f.s, 1.0);
      EXPECT_EQ(f.z, 5);
      EXPECT_EQ(f.q, k % 16);
      const Fields f0 = fields(qw, 1, k);  // an all-zero row: s = 0, w̃ = 0
      EXPECT_EQ(f0.s, 0.0);
      EXPECT_EQ(f0.q - f0.z, 0);
    }
    const Tensor wt = dequantize_weights(qw);
    EXPECT_TRUE(test::all_close(wt, w, {0.0, 0.0}));
    // y = x · w̃ᵀ with x = 1: the row sums (2 * (sum 0..15) - 32 * 5 = 80) and 0.
    Tensor x = Tensor::empty({1, 32}, dt, kCpu);
    fill(x, 1.0);
    const Tensor y = qgemm(x, qw);
    EXPECT_EQ(reference::load(y, 0), 80.0);
    EXPECT_EQ(reference::load(y, 1), 0.0);
  }
}

// Puzzle 12 at its exact shapes: weight i32 [32, 8] (64 values a row), GROUP = 8, scale [32, 8],
// one int32 of 8 shifts a row, activation [64, 32]; z = (scale * (extract(weight) - shift)) @ act.
TEST(QgemmSpec, Puzzle12ExactShapes) {
  constexpr int N0 = 32, MID = 64, N1 = 32, GROUP = 8, FPINT = 8;
  std::vector<std::uint32_t> weight(N0 * MID / FPINT), offset(N0);
  std::vector<float> scale(N0 * MID / GROUP), act(MID * N1);
  std::uint64_t state = 12345;
  auto next = [&] { return static_cast<std::uint32_t>((state = state * 6364136223846793005ull + 1442695040888963407ull) >> 33); };
  for (auto& v : weight) v = next();
  for (auto& v : offset) v = next();
  for (auto& v : scale) v = static_cast<float>(next() % 64 + 1) / 32.0f;    // 6 significant bits: exact in f16
  for (auto& v : act) v = static_cast<float>(static_cast<int>(next() % 33) - 16) / 8.0f;
  // The puzzle's spec, in plain loops.
  auto extract = [](std::uint32_t word, int i) { return static_cast<int>((word >> (4 * i)) & 0xFu); };
  std::vector<double> wt(N0 * MID), z(N0 * N1, 0.0);
  for (int j = 0; j < N0; ++j)
    for (int l = 0; l < MID; ++l)
      wt[j * MID + l] = scale[j * (MID / GROUP) + l / GROUP] *
                        (extract(weight[j * (MID / FPINT) + l / FPINT], l % FPINT) - extract(offset[j], l / GROUP));
  for (int j = 0; j < N0; ++j)
    for (int k = 0; k < N1; ++k)
      for (int l = 0; l < MID; ++l) z[j * N1 + k] += wt[j * MID + l] * act[l * N1 + k];

  const TensorView wv(weight.data(), DType::i32, {N0, MID / FPINT}, kCpu);
  const TensorView sv(scale.data(), DType::f32, {N0, MID / GROUP}, kCpu);
  const TensorView ov(offset.data(), DType::i32, {N0, 1}, kCpu);
  const QuantizedWeight qw = from_puzzle_layout(wv, sv, ov, GROUP, DType::f16);
  EXPECT_EQ(qw.n, N0);
  EXPECT_EQ(qw.k, MID);
  const Tensor w_tilde = dequantize_weights(qw);
  for (int i = 0; i < N0 * MID; ++i) ASSERT_EQ(reference::load(w_tilde, i), wt[i]) << i;  // exact in f16
  // qgemm computes x · w̃ᵀ with x = actᵀ [N1, MID]: y = zᵀ.
  Tensor x = Tensor::empty({N1, MID}, DType::f16, kCpu);
  for (int k = 0; k < N1; ++k)
    for (int l = 0; l < MID; ++l) reference::store(x, k * MID + l, act[l * N1 + k]);
  const Tensor y = qgemm(x, qw);
  for (int j = 0; j < N0; ++j)
    for (int k = 0; k < N1; ++k) {
      const double ref = z[j * N1 + k];
      EXPECT_NEAR(reference::load(y, k * N0 + j), ref, std::abs(ref) * 0x1p-11 + 1e-12) << j << " " << k;
    }
}

// Every weight within s / 2 of s * (q - z), and w̃ (rounded to the dtype) within s / 2 plus half an
// ulp of the dtype.
TEST(QgemmSpec, QuantizationErrorWithinHalfAStep) {
  for (DType dt : {DType::f16, DType::bf16})
    for (int group : {32, 64, 128, 192}) {
      const std::int64_t n = 7, k = 384 + (group == 192 ? -192 : 0);  // group 192 == K
      const Tensor w = test::random_tensor({n, k}, dt, kCpu, 7 + group, -3.f, 2.f);
      const QuantizedWeight qw = quantize_weights(w, group);
      const Tensor wt = dequantize_weights(qw);
      const double u = dt == DType::f16 ? 0x1p-11 : 0x1p-8;
      for (std::int64_t r = 0; r < n; ++r)
        for (std::int64_t c = 0; c < k; ++c) {
          const Fields f = fields(qw, r, c);
          const double v = reference::load(w, r * k + c), exact = f.s * (f.q - f.z);
          ASSERT_LE(std::abs(v - exact), f.s / 2 * (1 + 1e-12)) << dtype_name(dt) << " " << group;
          ASSERT_LE(std::abs(v - reference::load(wt, r * k + c)), f.s / 2 + std::abs(exact) * u + 1e-12);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Bad input
// ---------------------------------------------------------------------------------------------

TEST(QgemmErrors, BadInputNamesOpAndArgument) {
  const Tensor w = test::random_tensor({8, 64}, DType::f16, kCpu, 1);
  const Tensor w32 = test::random_tensor({8, 64}, DType::f32, kCpu, 1);
  test::expect_arg_error([&] { quantize_weights(w32, 32); }, "quantize_weights", "w");
  test::expect_arg_error([&] { quantize_weights(w, 48); }, "quantize_weights", "group");
  const Tensor w96 = test::random_tensor({8, 96}, DType::f16, kCpu, 1);
  test::expect_arg_error([&] { quantize_weights(w96, 64); }, "quantize_weights", "group");  // K % group != 0
  const QuantizedWeight qw = quantize_weights(w, 32);
  const Tensor xb = test::random_tensor({2, 64}, DType::bf16, kCpu, 2);
  const Tensor xk = test::random_tensor({2, 63}, DType::f16, kCpu, 2);
  const Tensor x = test::random_tensor({2, 64}, DType::f16, kCpu, 2);
  const Tensor y_bad = Tensor::empty({2, 9}, DType::f16, kCpu);
  test::expect_arg_error([&] { qgemm(xb, qw); }, "qgemm", "x");
  test::expect_arg_error([&] { qgemm(xk, qw); }, "qgemm", "x");
  test::expect_arg_error([&] { qgemm(x, qw, y_bad); }, "qgemm", "y");
  const Tensor out_bad = Tensor::empty({8, 65}, DType::f16, kCpu);
  test::expect_arg_error([&] { dequantize_weights(qw, out_bad); }, "dequantize_weights", "out");
  std::vector<std::uint32_t> words(8 * 8), shifts(8);
  std::vector<float> scales(8 * 7);
  const TensorView wv(words.data(), DType::i32, {8, 8}, kCpu), sv(scales.data(), DType::f32, {8, 7}, kCpu),
      ov(shifts.data(), DType::i32, {8, 1}, kCpu);
  test::expect_arg_error([&] { from_puzzle_layout(wv, sv, ov, 8, DType::f16); }, "from_puzzle_layout", "scale");
  test::expect_arg_error([&] { from_puzzle_layout(wv, sv, ov, 12, DType::f16); }, "from_puzzle_layout", "group");
}

// ---------------------------------------------------------------------------------------------
// CUDA
// ---------------------------------------------------------------------------------------------

using Shape = std::tuple<std::int64_t, std::int64_t, std::int64_t, int, DType>;  // M, N, K, group (0: K), dtype

class QgemmGpu : public ::testing::TestWithParam<Shape> {};

// The operands of one shape on the host and on the GPU, and the spec's y [M, N] (f32, host).
struct GpuOperands {
  QuantizedWeight qw_host, qw;
  Tensor x_host, x, ref;
};

GpuOperands gpu_operands(const Shape& shape) {
  const auto [m, n, k, group_arg, dt] = shape;
  const int group = group_arg == 0 ? static_cast<int>(k) : group_arg;
  const Device gpu = Device::cuda();
  GpuOperands o;
  const Tensor w = test::random_tensor({n, k}, dt, kCpu, static_cast<std::uint64_t>(m * 7 + n * 3 + k), -1.f, 1.f);
  o.qw_host = quantize_weights(w, group);
  o.qw = o.qw_host.copy_to(gpu);
  o.x_host = test::random_tensor({m, k}, dt, kCpu, static_cast<std::uint64_t>(m + 11), -1.f, 1.f);
  o.x = o.x_host.copy_to(gpu);
  o.ref = Tensor::empty({m, n}, DType::f32, kCpu);
  reference::qgemm(o.x_host, o.qw_host, o.ref);
  return o;
}

std::string describe(const Shape& shape) {
  const auto [m, n, k, group, dt] = shape;
  return std::string(dtype_name(dt)) + " M " + std::to_string(m) + " N " + std::to_string(n) + " K " +
         std::to_string(k) + " group " + std::to_string(group == 0 ? k : group);
}

const char* reduction_name(QgemmReduction r) { return r == QgemmReduction::cluster_pull ? "pull" : "push"; }

// Both split-K reductions of the small-M kernel (the option is ignored by the other kernels): each
// against the spec, each deterministic, and the two the same bytes (both sum in the order
// (split, warp)).
TEST_P(QgemmGpu, MatchesSpecOnDequantizedWeights) {
  FK_SKIP_WITHOUT_GPU();
  const auto [m, n, k, group_arg, dt] = GetParam();
  const Device gpu = Device::cuda();
  const GpuOperands o = gpu_operands(GetParam());
  std::vector<unsigned char> first;  // the pull's bytes
  for (QgemmReduction r : {QgemmReduction::cluster_pull, QgemmReduction::cluster_push}) {
    Tensor y = Tensor::empty({m, n}, dt, gpu);
    test::poison(y);
    qgemm(o.x, o.qw, y, nullptr, {.reduction = r});
    const Tensor got = test::to_host(y);
    // fp32 accumulation in another order plus one rounding of y to the dtype: within 5e-3 (the op's stated
    // bound; bf16 rounding alone is 2^-9 = 2e-3 relative).
    EXPECT_LE(rel_err(got, o.ref), 5e-3) << describe(GetParam()) << ", " << reduction_name(r);
    // Split-K is reduced in a fixed order: a second run gives the same bytes.
    Tensor y2 = Tensor::empty({m, n}, dt, gpu);
    test::poison(y2);
    qgemm(o.x, o.qw, y2, nullptr, {.reduction = r});
    const Tensor got2 = test::to_host(y2);
    EXPECT_EQ(std::memcmp(got.data(), got2.data(), got.nbytes()), 0) << "not deterministic, " << reduction_name(r);
    const auto* bytes = static_cast<const unsigned char*>(got.data());
    if (r == QgemmReduction::cluster_pull)
      first.assign(bytes, bytes + got.nbytes());
    else
      EXPECT_EQ(std::memcmp(bytes, first.data(), got.nbytes()), 0)
          << describe(GetParam()) << ": push and pull differ";
  }
  // The GPU's dequantization is the spec's, bit for bit.
  const Tensor wt_gpu = test::to_host(dequantize_weights(o.qw));
  EXPECT_TRUE(test::all_close(wt_gpu, dequantize_weights(o.qw_host), {0.0, 0.0}));
}

#if FUSEKIT_WITH_CUDA  // these two call the CUDA launchers directly
// The mma.sync tiles, qgemm's path off sm_90 for M > 16 (and for a small M whose chunk of x does
// not fit the weight-streaming kernel), on every shape whatever the GPU: on sm_90 qgemm never takes
// them, the wgmma kernel does.
TEST_P(QgemmGpu, MmaSyncTilesMatchSpec) {
  FK_SKIP_WITHOUT_GPU();
  const auto [m, n, k, group_arg, dt] = GetParam();
  const GpuOperands o = gpu_operands(GetParam());
  Tensor y = Tensor::empty({m, n}, dt, Device::cuda());
  test::poison(y);
  cuda::qgemm(o.x, o.qw, y, nullptr, cuda::QgemmPath::mma_sync_tiles);
  // The bound of MatchesSpecOnDequantizedWeights, for the same reason.
  EXPECT_LE(rel_err(test::to_host(y), o.ref), 5e-3) << describe(GetParam());
}

// Every plan of the wgmma kernel (consumers x MW: 2 x 2, 2 x 1, 3 x 1; 1, 3 and 8 splits of K), not
// only the one the cost model picks for the shape on this GPU, on the shapes qgemm gives that
// kernel (M > 16; M = 16 with K = 65536 takes the model's plan in MatchesSpecOnDequantizedWeights).
TEST_P(QgemmGpu, EveryWgmmaPlanMatchesSpec) {
  FK_SKIP_WITHOUT_GPU();
  const auto [m, n, k, group_arg, dt] = GetParam();
  if (m <= 16) GTEST_SKIP() << "M <= 16: the weight-streaming kernel's shape";
  const GpuOperands o = gpu_operands(GetParam());
  Tensor y = Tensor::empty({m, n}, dt, Device::cuda());
  const cuda::QgemmWgmmaPlan configs[] = {{2, 2, 1}, {2, 1, 1}, {3, 1, 1}};
  for (cuda::QgemmWgmmaPlan plan : configs)
    for (const int splits : {1, 3, 8}) {
      plan.splits = splits;
      test::poison(y);
      if (!cuda::qgemm_wgmma(o.x, o.qw, y, nullptr, &plan)) GTEST_SKIP() << "the wgmma kernel runs on sm_90 only";
      EXPECT_LE(rel_err(test::to_host(y), o.ref), 5e-3)
          << describe(GetParam()) << ", " << plan.nc << " consumers x MW " << plan.mw << ", " << splits << " splits";
    }
}
#endif

// Small M (the weight-streaming kernel: M <= 8 and M <= 16, groups of 32 and of 64+, split-K
// clusters with uneven last splits); M > 16: on sm_90 the wgmma kernel (x tiles of 64 rows up to
// M = 64, 128 beyond; several row blocks and an M tail at M = 200 and 300; groups of 32, whose
// two halves of a k-tile have their own scales; EveryWgmmaPlanMatchesSpec: every plan), elsewhere
// the mma.sync tiles (MmaSyncTilesMatchSpec: on sm_90 too); odd N, N over several tiles, K tails
// inside a k-tile (K = 200, 96 with one group), K long enough to split. M = 16 with K = 65536 does
// not fit the small-M kernel's shared memory and takes the M > 16 path.
INSTANTIATE_TEST_SUITE_P(
    Shapes, QgemmGpu,
    ::testing::Values(Shape{1, 97, 256, 32, DType::f16}, Shape{1, 4097, 1024, 128, DType::bf16},
                      Shape{3, 301, 200, 0, DType::f16}, Shape{16, 257, 4096, 128, DType::f16},
                      Shape{16, 130, 96, 0, DType::bf16}, Shape{17, 255, 512, 64, DType::bf16},
                      Shape{64, 513, 1024, 128, DType::f16}, Shape{65, 129, 384, 32, DType::bf16},
                      Shape{128, 300, 2048, 128, DType::bf16}, Shape{200, 33, 64, 64, DType::f16},
                      Shape{300, 515, 384, 0, DType::f16}, Shape{33, 1031, 4160, 64, DType::bf16},
                      Shape{1, 11008, 512, 128, DType::f16}, Shape{9, 1000, 8192, 64, DType::bf16},
                      Shape{12, 384, 1344, 32, DType::f16}, Shape{5, 700, 2880, 64, DType::f16},
                      Shape{8, 2304, 4096, 128, DType::bf16}, Shape{16, 40, 65536, 128, DType::f16},
                      Shape{2, 515, 2048, 64, DType::bf16}, Shape{7, 1100, 4096, 128, DType::f16},
                      Shape{15, 777, 3072, 32, DType::bf16}, Shape{11, 300, 8192, 0, DType::f16}));

// The bench's shapes (bench/qgemm.cu: group 128) at M 1 and 16 (the small-M kernel) and 17 and
// 65 (the wgmma kernel takes the plans of M 64 and 128 there: x tiles of 64 and 128 rows), so that
// the exact split-K plans the bench takes (clusters of up to 8 CTAs; N = 11008 in row blocks of
// 192, the last one past the padded rows) are checked against the spec, and then run many times, on two streams at once (clusters of two
// grids side by side, different timing from run to run): every result must be the first one's bytes.
TEST(QgemmGpu, BenchShapesRepeatedOnTwoStreams) {
  FK_SKIP_WITHOUT_GPU();
  struct Case {
    std::int64_t n, k;
    DType dt;
  };
  const Case cases[] = {{4096, 4096, DType::f16}, {11008, 4096, DType::f16}, {8192, 8192, DType::f16},
                        {11008, 4096, DType::bf16}};
  const Device gpu = Device::cuda();
  const Stream s0 = Stream::create(gpu), s1 = Stream::create(gpu);
  for (const Case& c : cases) {
    const Tensor w = test::random_tensor({c.n, c.k}, c.dt, kCpu, static_cast<std::uint64_t>(c.n + c.k), -1.f, 1.f);
    const QuantizedWeight qw_host = quantize_weights(w, 128);
    const QuantizedWeight qw = qw_host.copy_to(gpu);
    const Tensor x_host = test::random_tensor({65, c.k}, c.dt, kCpu, static_cast<std::uint64_t>(c.n), -1.f, 1.f);
    Tensor ref = Tensor::empty({65, c.n}, DType::f32, kCpu);
    reference::qgemm(x_host, qw_host, ref);
    for (std::int64_t m : {1, 16, 17, 65}) {
      const Tensor x = Tensor::empty({m, c.k}, c.dt, gpu);
      copy(x, x_host.view().slice_rows(0, m));
      const Tensor y0 = Tensor::empty({m, c.n}, c.dt, gpu);
      test::poison(y0);
      qgemm(x, qw, y0, &s0);
      s0.synchronize();
      const Tensor first = test::to_host(y0);
      EXPECT_LE(rel_err(first, ref.view().slice_rows(0, m)), 5e-3) << "M " << m << " N " << c.n << " K " << c.k;
      // Both reductions of the small-M kernel (M > 16: the option is ignored), on the same bytes.
      for (QgemmReduction red : {QgemmReduction::cluster_pull, QgemmReduction::cluster_push}) {
        if (m > 16 && red == QgemmReduction::cluster_push) continue;
        constexpr int kRuns = 40;
        std::vector<Tensor> ys;
        for (int r = 0; r < kRuns; ++r) {
          ys.push_back(Tensor::empty({m, c.n}, c.dt, gpu));
          test::poison(ys.back());
        }
        for (int r = 0; r < kRuns; ++r)
          qgemm(x, qw, ys[static_cast<std::size_t>(r)], r % 2 == 0 ? &s0 : &s1, {.reduction = red});
        s0.synchronize();
        s1.synchronize();
        int differing = 0;
        for (const Tensor& y : ys) {
          const Tensor got = test::to_host(y);
          differing += std::memcmp(got.data(), first.data(), got.nbytes()) != 0;
        }
        EXPECT_EQ(differing, 0) << "runs (of " << kRuns << ") unlike the first (pull), " << reduction_name(red)
                                << ", M " << m << " N " << c.n << " K " << c.k;
      }
    }
  }
}

// constant_weights (a programmatic dependent launch on sm_90: the weight loads start before the
// kernel before it has finished; x is read only after): chains of small-M qgemms where each
// one's x is the output of the kernel just before it, first x written by a dequantize kernel.
// Every output must be the bytes of the same chain run without the promise (the kernel is
// deterministic): an x read too early would differ.
TEST(QgemmGpu, ConstantWeightsReadXOnlyAfterTheKernelBefore) {
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda();
  const Stream s = Stream::create(gpu);
  for (DType dt : {DType::f16, DType::bf16})
    for (std::int64_t m : {1, 5, 16}) {
      constexpr std::int64_t kDim = 4096;
      constexpr int kSteps = 8;
      // |w| <= 0.03: each step keeps y's scale near x's (K = 4096 terms), no overflow over the chain.
      const Tensor w = test::random_tensor({kDim, kDim}, dt, kCpu, 71, -0.03f, 0.03f);
      const QuantizedWeight qw = quantize_weights(w, 128).copy_to(gpu);
      const Tensor x_src = test::random_tensor({m, kDim}, dt, kCpu, 72, -1.f, 1.f);
      const QuantizedWeight qx = quantize_weights(x_src, 128).copy_to(gpu);
      std::vector<Tensor> plain, promised, pushed;
      for (int variant : {0, 1, 2}) {  // plain, the promise, the promise with the push reduction
        const bool constant = variant > 0;
        std::vector<Tensor>& ys = variant == 0 ? plain : variant == 1 ? promised : pushed;
        Tensor x = Tensor::empty({m, kDim}, dt, gpu);
        test::poison(x);
        s.synchronize();
        dequantize_weights(qx, x, &s);  // a kernel writes the first x
        for (int i = 0; i < kSteps; ++i) {
          ys.push_back(Tensor::empty({m, kDim}, dt, gpu));
          test::poison(ys.back());
        }
        s.synchronize();
        for (int i = 0; i < kSteps; ++i)
          qgemm(i == 0 ? x : ys[static_cast<std::size_t>(i - 1)], qw, ys[static_cast<std::size_t>(i)], &s,
                {.constant_weights = constant,
                 .reduction = variant == 2 ? QgemmReduction::cluster_push : QgemmReduction::cluster_pull});
        s.synchronize();
      }
      // The first step against the spec; then every step's bytes.
      Tensor ref = Tensor::empty({m, kDim}, DType::f32, kCpu);
      reference::qgemm(test::to_host(dequantize_weights(qx)), quantize_weights(w, 128), ref);
      EXPECT_LE(rel_err(test::to_host(plain[0]), ref), 5e-3) << dtype_name(dt) << " M " << m;
      for (int i = 0; i < kSteps; ++i) {
        const Tensor a = test::to_host(plain[static_cast<std::size_t>(i)]);
        const Tensor b = test::to_host(promised[static_cast<std::size_t>(i)]);
        const Tensor c = test::to_host(pushed[static_cast<std::size_t>(i)]);
        EXPECT_EQ(std::memcmp(a.data(), b.data(), a.nbytes()), 0) << dtype_name(dt) << " M " << m << " step " << i;
        EXPECT_EQ(std::memcmp(a.data(), c.data(), a.nbytes()), 0)
            << dtype_name(dt) << " M " << m << " step " << i << ", push reduction";
      }
    }
}

TEST(QgemmGpuLayout, QuantizeOnGpuMatchesHost) {
  FK_SKIP_WITHOUT_GPU();
  const Tensor w = test::random_tensor({33, 256}, DType::bf16, kCpu, 5);
  const QuantizedWeight host = quantize_weights(w, 64);
  const Tensor wg = w.copy_to(Device::cuda());
  const QuantizedWeight dev = quantize_weights(wg, 64);
  EXPECT_EQ(dev.device(), Device::cuda());
  EXPECT_TRUE(test::all_close(test::to_host(dev.scale), host.scale, {0.0, 0.0}));
  const Tensor packed = test::to_host(dev.packed), zero = test::to_host(dev.zero);
  EXPECT_EQ(std::memcmp(packed.data(), host.packed.data(), host.packed.nbytes()), 0);
  EXPECT_EQ(std::memcmp(zero.data(), host.zero.data(), host.zero.nbytes()), 0);
}

// The puzzle's group of 8 cannot reach the kernel (its scale changes inside a word), nor can K % 8 != 0:
// a clear error.
TEST(QgemmGpuLayout, PuzzleGroupRejectedOnGpu) {
  FK_SKIP_WITHOUT_GPU();
  std::vector<std::uint32_t> words(32 * 8, 0x76543210u), shifts(32, 0x11111111u);
  std::vector<float> scales(32 * 8, 0.5f);
  const QuantizedWeight qw =
      from_puzzle_layout(TensorView(words.data(), DType::i32, {32, 8}, kCpu),
                         TensorView(scales.data(), DType::f32, {32, 8}, kCpu),
                         TensorView(shifts.data(), DType::i32, {32, 1}, kCpu), 8, DType::f16)
          .copy_to(Device::cuda());
  const Tensor x = test::random_tensor({4, 64}, DType::f16, Device::cuda(), 3);
  test::expect_arg_error([&] { qgemm(x, qw); }, "qgemm", "qw");
  // K % 8 != 0 cannot be copied in 16-byte rows of x: rejected on CUDA, run on the CPU.
  const Tensor w100 = test::random_tensor({5, 100}, DType::f16, kCpu, 4);
  const QuantizedWeight q100 = quantize_weights(w100, 100);
  const Tensor x100 = test::random_tensor({2, 100}, DType::f16, kCpu, 5);
  EXPECT_EQ(qgemm(x100, q100).shape(), (Dims{2, 5}));
  const QuantizedWeight q100_gpu = q100.copy_to(Device::cuda());
  const Tensor x100_gpu = x100.copy_to(Device::cuda());
  test::expect_arg_error([&] { qgemm(x100_gpu, q100_gpu); }, "qgemm", "qw");
  // dequantize_weights handles any group on the GPU.
  const Tensor wt = test::to_host(dequantize_weights(qw));
  EXPECT_EQ(reference::load(wt, 1), 0.5 * (1 - 1));
  EXPECT_EQ(reference::load(wt, 7), 0.5 * (7 - 1));
}

}  // namespace
}  // namespace fk
