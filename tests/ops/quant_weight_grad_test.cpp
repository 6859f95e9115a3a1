// Tests of weight_grad_from_packed: the CUDA kernel against the spec (fk::reference, fp64
// accumulation) on random inputs of many shapes, the split-K sums' determinism, and the inputs
// the GPU path rejects. The shapes cover K not a multiple of the 64-deep k-block, COUT and CIN not
// multiples of the 256x128 tile, CIN not a multiple of the group (a partial last group)
// nor of 8, COUT = 1 and COUT % 8 != 0 (dy copied without TMA), K from 0 to 8192, every bit width,
// bf16 and f32 statistics, f32 and bf16 dW, beta 0 (dW poisoned with NaN first) and 1, tiles
// stored directly and tiles split over several CTAs (2 to 78 ways).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ostream>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "fusekit/fusekit.hpp"
#include "test_util.hpp"

namespace fk {
namespace {

const Device kCpu = Device::cpu();
const Device kGpu = Device::cuda(0);

struct WgCase {
  std::int64_t k, cout, cin;
  int bits, group;
  DType stats, dw;
  float beta;
};

std::ostream& operator<<(std::ostream& os, const WgCase& c) {
  return os << "K" << c.k << "_COUT" << c.cout << "_CIN" << c.cin << "_b" << c.bits << "_g" << c.group << "_stats"
            << dtype_name(c.stats) << "_dw" << dtype_name(c.dw) << "_beta" << c.beta;
}

// The packed x of a case on the CPU (made by the spec's pack) and its copy on the GPU.
struct PackedPair {
  PackedTensor cpu, gpu;
};

// Huge rows: odd rows (huge_odd_rows), or rows [64, 128) (huge_second_block: the second 64-row
// k-block only), scaled by 1e22: their 8-bit scale, about 2^66, is past what the kernel's bf16x2
// dequantization takes, so those rows (or k-blocks) go through its f32 path.
PackedPair make_packed(std::int64_t k, std::int64_t cin, int bits, int group, DType stats, std::uint64_t seed,
                       bool huge_odd_rows = false, bool huge_second_block = false) {
  const Tensor x = test::random_tensor({k, cin}, DType::f32, kCpu, seed, -2.f, 3.f);
  for (std::int64_t r = 0; r < k; ++r)
    if ((huge_odd_rows && r % 2 == 1) || (huge_second_block && r >= 64 && r < 128))
      for (std::int64_t c = 0; c < cin; ++c) x.data_as<float>()[r * cin + c] *= 1e22f;
  PackedPair p;
  p.cpu = pack(x, {.bits = bits, .group = group, .stats_dtype = stats});
  p.gpu.words = p.cpu.words.copy_to(kGpu);
  p.gpu.scale = p.cpu.scale.copy_to(kGpu);
  p.gpu.min = p.cpu.min.copy_to(kGpu);
  p.gpu.rows = p.cpu.rows, p.gpu.cols = p.cpu.cols, p.gpu.dtype = p.cpu.dtype;
  p.gpu.bits = bits, p.gpu.group = group;
  return p;
}

// For each dW element, sum_k |dy[k, o] * x̂[k, c]|: the scale of the rounding errors the GPU may
// make on that element.
std::vector<double> abs_products(const TensorView& dy, const PackedView& x) {
  const std::int64_t k = dy.size(0), cout = dy.size(1), cin = x.cols;
  Tensor xhat = unpack(x, DType::f32);
  const float* xh = xhat.data_as<float>();
  const std::vector<double> g = test::to_doubles(dy);
  std::vector<double> out(static_cast<std::size_t>(cout * cin), 0.0);
  for (std::int64_t r = 0; r < k; ++r)
    for (std::int64_t o = 0; o < cout; ++o) {
      const double a = std::fabs(g[static_cast<std::size_t>(r * cout + o)]);
      double* row = out.data() + o * cin;
      for (std::int64_t c = 0; c < cin; ++c) row[c] += a * std::fabs(xh[r * cin + c]);
    }
  return out;
}

// Elementwise: x̂ is rounded to bf16 for the tensor cores (relative 2^-9 an element, so at most
// 2^-9 sum|dy x̂| on a dot product; the kernel's x̂ before that rounding is within 2^-24 (|min| +
// 2^15 scale) of the spec's, a few 2^-24 of the value range, negligible here), fp32 accumulation
// over K <= 8192 adds well under 2^-10 of the same sum, split-K partials crossing the workspace in
// fp16 (bf16 dW) 2^-11 of it, and a bf16 dW is rounded once more (2^-8 |ref| with prev). Bound:
// 2^-8 sum|dy x̂| + 2^-8 |ref| for bf16 dW, + a tiny absolute floor. Elements the spec makes
// infinite or NaN must be the same (same sign for infinities). Returns the number of elements
// beyond the bound, reporting the worst.
std::size_t count_beyond_bound(const std::vector<double>& got, const std::vector<double>& want,
                               const std::vector<double>& prod, const std::vector<double>& prev, DType dw,
                               std::int64_t cin) {
  const double out_rel = dw == DType::bf16 ? 1.0 / 256 : 1e-6;
  std::size_t bad = 0, worst = 0;
  double worst_excess = -1;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(want[i])) {
      const bool same = std::isnan(want[i]) ? std::isnan(got[i]) : got[i] == want[i];
      if (!same) {
        ++bad;
        if (worst_excess < INFINITY) worst_excess = INFINITY, worst = i;
      }
      continue;
    }
    const double err = std::fabs(got[i] - want[i]);
    const double bound = (prod[i] + std::fabs(prev[i])) / 256 + out_rel * std::fabs(want[i]) + 1e-30;
    if (!(err <= bound)) {
      ++bad;
      const double excess = std::isnan(err) ? INFINITY : err / bound;
      if (excess > worst_excess) worst_excess = excess, worst = i;
    }
  }
  if (bad > 0)
    ADD_FAILURE() << bad << " of " << got.size() << " elements beyond the bound; worst at ("
                  << worst / static_cast<std::size_t>(cin) << ", " << worst % static_cast<std::size_t>(cin)
                  << "): got " << got[worst] << ", expected " << want[worst];
  return bad;
}

class WeightGradPackedGpu : public ::testing::TestWithParam<WgCase> {};

TEST_P(WeightGradPackedGpu, MatchesTheSpec) {
  FK_SKIP_WITHOUT_GPU();
  const WgCase c = GetParam();
  const std::uint64_t seed = static_cast<std::uint64_t>(c.k * 131 + c.cout * 17 + c.cin * 7 + c.bits);
  const PackedPair x = make_packed(c.k, c.cin, c.bits, c.group, c.stats, seed);
  const Tensor dy = test::random_tensor({c.k, c.cout}, DType::bf16, kCpu, seed + 1, -1.f, 1.f);
  const Tensor dy_gpu = dy.copy_to(kGpu);
  // dW before the call: what beta = 1 accumulates into, or NaN that beta = 0 must overwrite.
  const Tensor dw0 = test::random_tensor({c.cout, c.cin}, c.dw, kCpu, seed + 2, -4.f, 4.f);
  if (c.beta == 0.0f) test::poison(dw0);
  Tensor dw = dw0.copy_to(kGpu);
  weight_grad_from_packed(dy_gpu, x.gpu.view(), dw, {.beta = c.beta});

  // The spec in f32 (fp64 sums, one rounding): on the same starting dW, as f32.
  Tensor ref = Tensor::empty({c.cout, c.cin}, DType::f32, kCpu);
  {
    const std::vector<double> start = test::to_doubles(dw0);
    for (std::size_t i = 0; i < start.size(); ++i) ref.data_as<float>()[i] = static_cast<float>(start[i]);
  }
  weight_grad_from_packed(dy, x.cpu.view(), ref, {.beta = c.beta});

  const std::vector<double> got = test::to_doubles(dw), want = test::to_doubles(ref);
  const std::vector<double> prod = abs_products(dy, x.cpu.view());
  const std::vector<double> prev = c.beta != 0.0f ? test::to_doubles(dw0) : std::vector<double>(got.size(), 0.0);
  count_beyond_bound(got, want, prod, prev, c.dw, c.cin);
  double diff2 = 0, ref2 = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    diff2 += (got[i] - want[i]) * (got[i] - want[i]);
    ref2 += want[i] * want[i];
  }
  // The op's stated bound: ||got - ref|| / ||ref|| <= 1e-2 against the fp64 product.
  if (ref2 > 0) EXPECT_LE(std::sqrt(diff2 / ref2), 1e-2);
  else EXPECT_EQ(diff2, 0.0);
}

constexpr DType kBf = DType::bf16, kF32 = DType::f32;

INSTANTIATE_TEST_SUITE_P(
    Shapes, WeightGradPackedGpu,
    ::testing::Values(
        // Every bit width and stats dtype; M and N tails (320 = 256 + 64, 300 = 2 x 128 + 44, not
        // a multiple of 8 nor of the group); K = 777 is not a multiple of 64.
        WgCase{777, 320, 300, 1, 64, kBf, kF32, 0}, WgCase{777, 320, 300, 2, 64, kF32, kF32, 0},
        WgCase{777, 320, 300, 4, 64, kBf, kBf, 1}, WgCase{777, 320, 300, 8, 64, kF32, kBf, 0},
        WgCase{777, 320, 300, 1, 256, kF32, kBf, 1}, WgCase{777, 320, 300, 2, 256, kBf, kF32, 1},
        WgCase{777, 320, 300, 4, 256, kF32, kF32, 0}, WgCase{777, 320, 300, 8, 256, kBf, kF32, 1},
        // The benchmark's widths at group 256, CIN = 384 (a partial last group).
        WgCase{1000, 256, 384, 2, 256, kBf, kBf, 0}, WgCase{1000, 256, 384, 4, 256, kBf, kBf, 1},
        WgCase{1000, 256, 384, 8, 256, kBf, kBf, 0},
        // Groups: 32 (4 groups a 128-column tile), 96 (tiles cross group borders), 1024 (one
        // partial group for the whole row), 512 at 1 bit.
        WgCase{300, 192, 256, 2, 32, kBf, kF32, 0}, WgCase{300, 192, 400, 4, 96, kF32, kF32, 0},
        WgCase{300, 192, 768, 8, 1024, kBf, kF32, 1}, WgCase{300, 192, 700, 1, 512, kF32, kF32, 0},
        // More than 12 groups a row: statistics rows too long for the TMA slots (loaded by the threads).
        WgCase{300, 64, 1600, 2, 32, kBf, kF32, 0},
        // Packed rows that cannot be read 16 bytes at a time (row of 32 columns at 1 bit = 4 bytes).
        WgCase{200, 64, 20, 1, 32, kBf, kF32, 0}, WgCase{200, 64, 20, 2, 32, kF32, kBf, 1},
        WgCase{150, 40, 96, 4, 32, kBf, kF32, 0},
        // COUT = 1 and COUT % 8 != 0: dy copied by the producer threads instead of TMA.
        WgCase{333, 1, 200, 4, 32, kBf, kF32, 0}, WgCase{333, 1, 128, 2, 64, kBf, kBf, 1},
        WgCase{500, 12, 300, 8, 32, kF32, kF32, 0}, WgCase{129, 260, 64, 2, 64, kBf, kF32, 0},
        // ... and with bf16 statistics: the x̂-through-shared-memory path at 8 bits in bf16x2 arithmetic.
        WgCase{500, 12, 300, 8, 32, kBf, kF32, 0},
        // Register-sourced x̂ with groups that straddle tiles (group 96: two groups a tile).
        WgCase{300, 192, 400, 4, 96, kBf, kF32, 0}, WgCase{300, 256, 400, 2, 96, kBf, kBf, 1},
        // COUT = 8: TMA boxes mostly outside dy.
        WgCase{400, 8, 512, 2, 256, kBf, kF32, 0},
        // Tiny K, and K = one k-block plus one row; every tile stored directly by one CTA.
        WgCase{1, 256, 256, 2, 256, kBf, kF32, 0}, WgCase{5, 100, 100, 4, 32, kF32, kBf, 1},
        WgCase{64, 512, 640, 8, 128, kBf, kF32, 0}, WgCase{65, 512, 640, 2, 128, kBf, kBf, 1},
        WgCase{200, 1024, 1024, 4, 256, kBf, kF32, 1},
        // More tiles than SMs (135: no split, more than one wave), an odd number of N tiles.
        WgCase{150, 2304, 1900, 2, 32, kBf, kF32, 0},
        // K = 0: dW = beta * dW.
        WgCase{0, 64, 96, 2, 32, kBf, kF32, 0}, WgCase{0, 64, 96, 2, 32, kBf, kBf, 1},
        // Long K: tiles split S ways (S = min(SMs / tiles, K-blocks / 8)), summed by the fix-up
        // kernel, with beta and bf16 dW: 8192 x 256 x 512 (S = 16 on an H100), 8000 x 300 x 260 (x̂
        // through shared memory), 3000 x 768 x 768 and 3000 x 768 x 384 (5 and 5), 2000 x 130 x 200
        // (a second row tile of 2 rows), 5000 x 300 x 260 (M and N tails, register-sourced x̂).
        WgCase{8192, 256, 512, 2, 256, kBf, kF32, 0}, WgCase{8192, 256, 384, 8, 256, kBf, kBf, 1},
        WgCase{8000, 300, 260, 4, 64, kF32, kF32, 1}, WgCase{3000, 768, 768, 2, 256, kBf, kBf, 0},
        WgCase{3000, 768, 384, 8, 256, kBf, kF32, 1}, WgCase{2000, 130, 200, 2, 32, kBf, kBf, 1},
        WgCase{5000, 300, 260, 4, 64, kBf, kF32, 1}, WgCase{5000, 300, 260, 8, 64, kBf, kBf, 0},
        // ... split with a bf16 dW (fp16 partials) on the x̂-through-shared-memory path: f32
        // statistics, and 1 bit.
        WgCase{8000, 300, 260, 4, 64, kF32, kBf, 1}, WgCase{6000, 256, 256, 1, 256, kBf, kBf, 0},
        // Longer K over one or two tiles: split 78 or 66 ways (more partials than the fix-up
        // kernel's 8 loads in flight).
        WgCase{40000, 256, 128, 2, 256, kBf, kF32, 1}, WgCase{40000, 256, 136, 8, 128, kBf, kBf, 0}),
    [](const ::testing::TestParamInfo<WgCase>& info) {
      std::ostringstream os;
      os << info.param;
      std::string s = os.str();
      for (char& ch : s)
        if (ch == '.') ch = 'p';
      return s;
    });

// Split-K partials are added in a fixed order: two runs give the same bits (K = 8192, 768 x 768:
// 18 tiles split 7 ways on an H100; K = 40000, 256 x 128: one tile split 78 ways).
TEST(WeightGradPackedGpuDeterminism, TwoRunsGiveIdenticalBits) {
  FK_SKIP_WITHOUT_GPU();
  for (const auto& [k, cout, cin] : {std::tuple<std::int64_t, std::int64_t, std::int64_t>{8192, 768, 768}, {40000, 256, 128}}) {
    const PackedPair x = make_packed(k, cin, 2, 128, DType::bf16, 7);
    const Tensor dy = test::random_tensor({k, cout}, DType::bf16, kGpu, 8, -1.f, 1.f);
    for (DType t : {DType::f32, DType::bf16}) {
      Tensor a = Tensor::empty({cout, cin}, t, kGpu), b = Tensor::empty({cout, cin}, t, kGpu);
      weight_grad_from_packed(dy, x.gpu.view(), a, {.beta = 0.0f, .deterministic = true});
      weight_grad_from_packed(dy, x.gpu.view(), b, {.beta = 0.0f, .deterministic = true});
      const Tensor ha = test::to_host(a), hb = test::to_host(b);
      EXPECT_EQ(std::memcmp(ha.data(), hb.data(), ha.nbytes()), 0) << "K " << k << " " << dtype_name(t);
    }
  }
}

// Split-K partials in fp16 with a power-of-two scale per 8 values (the default with a bf16 dW)
// against the same kernel with fp32 partials: the two differ by the fp16 roundings, at most 2^-11
// of each partial's magnitude (so 2^-11 sum|dy x̂| in all), plus one rounding of each to bf16
// (an ulp of the larger). A rounding to bf16 instead (2^-8) fails this bound. An f32 dW keeps fp32
// partials whatever the flag: bit-identical. 3000 x 768 x 384: 9 tiles split 5 ways on an H100;
// 40000 x 256 x 136: 2 tiles split 66 ways.
TEST(WeightGradPackedGpuPartials, Fp16PartialsStayWithin2ToTheMinus11OfTheFp32Ones) {
  FK_SKIP_WITHOUT_GPU();
  for (const auto& [k, cout, cin] : {std::tuple<std::int64_t, std::int64_t, std::int64_t>{3000, 768, 384}, {40000, 256, 136}}) {
    const PackedPair x = make_packed(k, cin, 2, 128, DType::bf16, 21);
    const Tensor dy = test::random_tensor({k, cout}, DType::bf16, kCpu, 22, -1.f, 1.f);
    const Tensor dy_gpu = dy.copy_to(kGpu);
    const std::vector<double> prod = abs_products(dy, x.cpu.view());
    Tensor half = Tensor::empty({cout, cin}, DType::bf16, kGpu), full = Tensor::empty({cout, cin}, DType::bf16, kGpu);
    weight_grad_from_packed(dy_gpu, x.gpu.view(), half, {});
    weight_grad_from_packed(dy_gpu, x.gpu.view(), full, {.fp32_partials = true});
    const std::vector<double> a = test::to_doubles(half), b = test::to_doubles(full);
    std::size_t bad = 0, differ = 0;
    for (std::size_t i = 0; i < a.size(); ++i) {
      const double ulp = std::ldexp(1.0, std::ilogb(std::max({std::fabs(a[i]), std::fabs(b[i]), 1e-30})) - 7);
      if (!(std::fabs(a[i] - b[i]) <= prod[i] / 2048 + ulp)) ++bad;
      differ += a[i] != b[i];
    }
    EXPECT_EQ(bad, 0u) << "K " << k << ": " << bad << " of " << a.size() << " beyond 2^-11 sum|dy x̂| + 1 ulp";
    EXPECT_GT(differ, 0u) << "K " << k << ": the two paths gave identical bits (is the fp16 path taken?)";
    // Against the exact product (the spec's fp64 sums) both are dominated by dW's own rounding to
    // bf16: the fp16 partials may add a few percent to the fp32 partials' error, no more.
    Tensor ref = Tensor::empty({cout, cin}, DType::f32, kCpu);
    weight_grad_from_packed(dy, x.cpu.view(), ref, {});
    const std::vector<double> want = test::to_doubles(ref);
    double da = 0, db = 0, w2 = 0;
    for (std::size_t i = 0; i < a.size(); ++i) {
      da += (a[i] - want[i]) * (a[i] - want[i]);
      db += (b[i] - want[i]) * (b[i] - want[i]);
      w2 += want[i] * want[i];
    }
    const double err_half = std::sqrt(da / w2), err_full = std::sqrt(db / w2);
    std::printf("K %lld: ||dW - exact|| / ||exact||: fp16 partials %.4e, fp32 partials %.4e\n", static_cast<long long>(k),
                err_half, err_full);
    EXPECT_LE(err_half, 1.05 * err_full) << "K " << k;
    for (const bool fp32 : {false, true}) {
      Tensor f = Tensor::empty({cout, cin}, DType::f32, kGpu), g = Tensor::empty({cout, cin}, DType::f32, kGpu);
      weight_grad_from_packed(dy_gpu, x.gpu.view(), f, {.fp32_partials = fp32});
      weight_grad_from_packed(dy_gpu, x.gpu.view(), g, {.fp32_partials = true});
      const Tensor hf = test::to_host(f), hg = test::to_host(g);
      EXPECT_EQ(std::memcmp(hf.data(), hg.data(), hf.nbytes()), 0) << "K " << k << ": f32 dW, fp32_partials " << fp32;
    }
  }
}

// The fp16 partials' scale is per 8 values (rows 16 g + {0, 1, 8, 9} + 2 (lane % 4), two columns),
// not per thread or tile: dy's columns (dW's rows) scaled by 2^-60 .. 2^60, one scale per 16
// rows, keep every row within the spec's relative bound. A scale shared by a thread's 128 values
// (64 rows) would flush the small rows to zero. Split 5 ways, bf16 and f32 dW.
TEST(WeightGradPackedGpuPartials, RowsOfVeryDifferentMagnitudesKeepTheirRelativeError) {
  FK_SKIP_WITHOUT_GPU();
  const std::int64_t k = 3000, cout = 768, cin = 384;
  const PackedPair x = make_packed(k, cin, 4, 256, DType::bf16, 31);
  const Tensor dy_f = test::random_tensor({k, cout}, DType::f32, kCpu, 32, -1.f, 1.f);
  std::vector<float> v(dy_f.data_as<float>(), dy_f.data_as<float>() + k * cout);
  for (std::int64_t r = 0; r < k; ++r)
    for (std::int64_t o = 0; o < cout; ++o) v[static_cast<std::size_t>(r * cout + o)] *= std::ldexp(1.0f, static_cast<int>(o / 16 * 5 / 2) - 60);
  const Tensor dy = test::host_tensor({k, cout}, DType::bf16, v);
  const std::vector<double> prod = abs_products(dy, x.cpu.view());
  Tensor ref = Tensor::empty({cout, cin}, DType::f32, kCpu);
  weight_grad_from_packed(dy, x.cpu.view(), ref, {});
  const std::vector<double> want = test::to_doubles(ref), zeros(want.size(), 0.0);
  for (const DType t : {DType::bf16, DType::f32}) {
    Tensor dw = Tensor::empty({cout, cin}, t, kGpu);
    weight_grad_from_packed(dy.copy_to(kGpu), x.gpu.view(), dw, {});
    EXPECT_EQ(count_beyond_bound(test::to_doubles(dw), want, prod, zeros, t, cin), 0u) << dtype_name(t);
  }
}

// An infinity in dy makes its dW row infinite (or NaN where a product is inf * 0 or inf - inf), as
// in the spec; the fp16 partials take their scale from the finite values of each 8, so the rows
// that share scales with it (rows o ^ 1, o +- 8) keep their precision. Split 5 ways, both dW dtypes
// and both partial formats.
TEST(WeightGradPackedGpuPartials, AnInfiniteGradientPoisonsItsRowOnly) {
  FK_SKIP_WITHOUT_GPU();
  const std::int64_t k = 3000, cout = 768, cin = 384, o_inf = 300;
  const PackedPair x = make_packed(k, cin, 2, 256, DType::bf16, 41);
  const Tensor dy_f = test::random_tensor({k, cout}, DType::f32, kCpu, 42, -1.f, 1.f);
  std::vector<float> v(dy_f.data_as<float>(), dy_f.data_as<float>() + k * cout);
  v[static_cast<std::size_t>(1234 * cout + o_inf)] = INFINITY;
  const Tensor dy = test::host_tensor({k, cout}, DType::bf16, v);
  const std::vector<double> prod = abs_products(dy, x.cpu.view());
  Tensor ref = Tensor::empty({cout, cin}, DType::f32, kCpu);
  weight_grad_from_packed(dy, x.cpu.view(), ref, {});
  const std::vector<double> want = test::to_doubles(ref), zeros(want.size(), 0.0);
  std::size_t infinite = 0;
  for (std::int64_t c = 0; c < cin; ++c) infinite += !std::isfinite(want[static_cast<std::size_t>(o_inf * cin + c)]);
  ASSERT_EQ(infinite, static_cast<std::size_t>(cin)) << "the spec's row " << o_inf << " should be all inf / NaN";
  for (const DType t : {DType::bf16, DType::f32})
    for (const bool fp32 : {false, true}) {
      Tensor dw = Tensor::empty({cout, cin}, t, kGpu);
      weight_grad_from_packed(dy.copy_to(kGpu), x.gpu.view(), dw, {.fp32_partials = fp32});
      EXPECT_EQ(count_beyond_bound(test::to_doubles(dw), want, prod, zeros, t, cin), 0u)
          << dtype_name(t) << ", fp32_partials " << fp32;
    }
}

// 8 bits with bf16 statistics: rows whose scale 2^67 would overflow bf16 (values near 1e22) take
// the f32 dequantization, the others the bf16x2 one: odd rows (every k-block has some), and the
// second k-block only (register-sourced x̂ switches per k-block; dy copied by threads, COUT = 60,
// takes x̂ through shared memory, which switches per row).
class WeightGradPackedGpuRange : public ::testing::TestWithParam<std::tuple<bool, std::int64_t>> {};
TEST_P(WeightGradPackedGpuRange, HugeScalesAt8BitsMatchTheSpec) {
  FK_SKIP_WITHOUT_GPU();
  const auto [odd_rows, cout] = GetParam();
  const std::int64_t k = 300, cin = 256;
  const PackedPair x = make_packed(k, cin, 8, 256, DType::bf16, 11, odd_rows, !odd_rows);
  const Tensor dy = test::random_tensor({k, cout}, DType::bf16, kCpu, 12, -1.f, 1.f);
  Tensor dw = Tensor::empty({cout, cin}, DType::f32, kGpu);
  weight_grad_from_packed(dy.copy_to(kGpu), x.gpu.view(), dw);
  Tensor ref = Tensor::empty({cout, cin}, DType::f32, kCpu);
  weight_grad_from_packed(dy, x.cpu.view(), ref);
  const std::vector<double> got = test::to_doubles(dw), want = test::to_doubles(ref);
  const std::vector<double> prod = abs_products(dy, x.cpu.view());
  std::size_t bad = 0;
  for (std::size_t i = 0; i < got.size(); ++i)  // the bound of MatchesTheSpec (x̂ rounded to bf16, fp32 sums)
    if (!(std::fabs(got[i] - want[i]) <= prod[i] / 256 + 1e-6 * std::fabs(want[i]))) ++bad;
  EXPECT_EQ(bad, 0u) << bad << " of " << got.size() << " elements beyond the bound";
}
INSTANTIATE_TEST_SUITE_P(Rows, WeightGradPackedGpuRange,
                         ::testing::Combine(::testing::Bool(), ::testing::Values(std::int64_t{64}, std::int64_t{60})));

// Valid packed formats the GPU kernel does not take (groups below 32 or not a multiple of it) are
// refused with an error naming x, never computed wrong.
TEST(WeightGradPackedGpuErrors, GroupsNotAMultipleOf32AreRefused) {
  FK_SKIP_WITHOUT_GPU();
  const Tensor dy = test::random_tensor({64, 32}, DType::bf16, kGpu, 1);
  Tensor dw = Tensor::empty({32, 48}, DType::f32, kGpu);
  for (int group : {16, 48}) {
    const PackedPair x = make_packed(64, 48, 2, group, DType::bf16, 2);
    test::expect_arg_error([&] { weight_grad_from_packed(dy, x.gpu.view(), dw); }, "weight_grad_from_packed", "x");
  }
}

}  // namespace
}  // namespace fk
