// Tests of the primitives family (batched_matmul, puzzle 11): the spec against hand-worked
// values, both CUDA implementations (cuBLAS and impl=cute) against the spec on random inputs of
// many shapes (tails of every tile dimension, odd K, one row / column, K = 1 and 0, B = 1, empty
// batch, more batches than a grid's z dimension holds), an exact comparison of impl=cute on small
// integers, and every bad input. impl=cute is two kernels: on an sm_90 GPU the CUTLASS SM90 GEMM
// (TMA + wgmma) takes K % 8 == 0, N % 8 == 0 and 16-byte aligned a, b, c, and the SM80 CuTe
// kernel everything else (on other GPUs, everything); the shapes below cover both on an H100.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "fusekit/fusekit.hpp"
#include "test_util.hpp"

namespace fk {
namespace {

const Device kCpu = Device::cpu();

using test::host_tensor;

// ---------------------------------------------------------------------------------------------
// The spec against hand-worked values
// ---------------------------------------------------------------------------------------------

TEST(BatchedMatmulSpec, HandWorked2x2x3) {
  // Batch 0: [[1,2,3],[4,5,6]] @ [[7,8],[9,10],[11,12]] = [[58,64],[139,154]].
  // Batch 1: [[1,0,0],[0,1,0]] picks the first two rows of [[-1,2],[3,-4],[5,6]].
  Tensor a = host_tensor({2, 2, 3}, DType::f32, {1, 2, 3, 4, 5, 6, /**/ 1, 0, 0, 0, 1, 0});
  Tensor b = host_tensor({2, 3, 2}, DType::f32, {7, 8, 9, 10, 11, 12, /**/ -1, 2, 3, -4, 5, 6});
  Tensor c = Tensor::empty({2, 2, 2}, DType::f32, kCpu);
  test::poison(c);
  batched_matmul(a, b, c);
  EXPECT_EQ(test::to_doubles(c), (std::vector<double>{58, 64, 139, 154, /**/ -1, 2, 3, -4}));
}

TEST(BatchedMatmulSpec, RoundsOnceToTheOutputDtype) {
  // 1 * 1 + 1 * 2^-8 = 1.00390625 exactly: f32 keeps it; bf16 (8 significant bits) sees a tie
  // between 1 and 1 + 2^-7 and rounds to even, 1.
  Tensor a = host_tensor({1, 1, 2}, DType::bf16, {1, 1});
  Tensor b = host_tensor({1, 2, 1}, DType::bf16, {1, 0.00390625f});
  Tensor c32 = Tensor::empty({1, 1, 1}, DType::f32, kCpu), c16 = Tensor::empty({1, 1, 1}, DType::bf16, kCpu);
  batched_matmul(a, b, c32);
  batched_matmul(a, b, c16);
  EXPECT_EQ(test::to_doubles(c32), (std::vector<double>{1.00390625}));
  EXPECT_EQ(test::to_doubles(c16), (std::vector<double>{1.0}));
}

TEST(BatchedMatmulSpec, EmptyInnerDimensionGivesZeros) {
  const TensorView a(nullptr, DType::f32, {2, 3, 0}, kCpu), b(nullptr, DType::f32, {2, 0, 4}, kCpu);
  Tensor c = Tensor::empty({2, 3, 4}, DType::f32, kCpu);
  test::poison(c);
  batched_matmul(a, b, c);
  EXPECT_EQ(test::to_doubles(c), std::vector<double>(24, 0.0));
}

// ---------------------------------------------------------------------------------------------
// Bad inputs
// ---------------------------------------------------------------------------------------------

template <class F>
void expect_arg_error(F&& f, const std::string& arg) {
  test::expect_arg_error(std::forward<F>(f), "batched_matmul", arg);
}

TEST(BatchedMatmulErrors, EachBadInputNamesItsArgument) {
  auto f32 = [](Dims s) { return Tensor::empty(s, DType::f32, kCpu); };
  auto bf = [](Dims s) { return Tensor::empty(s, DType::bf16, kCpu); };
  Tensor a = f32({2, 3, 4}), b = f32({2, 4, 5}), c = f32({2, 3, 5});
  Tensor ab = bf({2, 3, 4}), bb = bf({2, 4, 5}), cb = bf({2, 3, 5});
  const TensorView a2(a.data(), DType::f32, {6, 4}, kCpu);
  const TensorView b4(b.data(), DType::f32, {1, 2, 4, 5}, kCpu);
  const TensorView c2(c.data(), DType::f32, {6, 5}, kCpu);

  // rank
  expect_arg_error([&] { batched_matmul(a2, b, c); }, "a");
  expect_arg_error([&] { batched_matmul(a, b4, c); }, "b");
  expect_arg_error([&] { batched_matmul(a, b, c2); }, "c");
  // shapes: batch and K of b, every dimension of c
  expect_arg_error([&] { batched_matmul(a, f32({3, 4, 5}), c); }, "b");
  expect_arg_error([&] { batched_matmul(a, f32({2, 3, 5}), c); }, "b");
  expect_arg_error([&] { batched_matmul(a, b, f32({2, 3, 6})); }, "c");
  expect_arg_error([&] { batched_matmul(a, b, f32({2, 4, 5})); }, "c");
  expect_arg_error([&] { batched_matmul(a, b, f32({1, 3, 5})); }, "c");
  // dtypes: a integer, a/b mismatch, c neither f32 nor the operands' dtype
  Tensor ai = Tensor::empty({2, 3, 4}, DType::i32, kCpu);
  expect_arg_error([&] { batched_matmul(ai, b, c); }, "a");
  expect_arg_error([&] { batched_matmul(a, bb, c); }, "b");
  expect_arg_error([&] { batched_matmul(a, b, cb); }, "c");
  expect_arg_error([&] { batched_matmul(ab, bb, Tensor::empty({2, 3, 5}, DType::f16, kCpu)); }, "c");
  // f32 operands are cuBLAS's only
  expect_arg_error([&] { batched_matmul(a, b, c, BatchedMatmulImpl::cute); }, "impl");
  // layout: strided, null data, c overlapping an operand
  const TensorView strided(a.data(), DType::f32, {2, 3, 2}, {12, 4, 2}, kCpu);
  expect_arg_error([&] { batched_matmul(strided, f32({2, 2, 5}), c); }, "a");
  expect_arg_error([&] { batched_matmul(TensorView(nullptr, DType::f32, {2, 3, 4}, kCpu), b, c); }, "a");
  Tensor square = f32({1, 4, 4});
  expect_arg_error([&] { batched_matmul(square, f32({1, 4, 4}), square); }, "c");
  expect_arg_error([&] { batched_matmul(f32({1, 4, 4}), square, square); }, "c");
  // devices: the views are never dereferenced, since the check comes first
  void* nowhere = reinterpret_cast<void*>(std::uintptr_t{256});
  const TensorView b_gpu(nowhere, DType::f32, {2, 4, 5}, Device::cuda(0));
  const TensorView c_gpu(nowhere, DType::f32, {2, 3, 5}, Device::cuda(0));
  expect_arg_error([&] { batched_matmul(a, b_gpu, c); }, "b");
  expect_arg_error([&] { batched_matmul(a, b, c_gpu); }, "c");
}

TEST(BatchedMatmulErrors, CudaTensorsInACpuOnlyBuild) {
  if (built_with_cuda()) GTEST_SKIP() << "only a CPU-only build refuses CUDA tensors outright";
  void* nowhere = reinterpret_cast<void*>(std::uintptr_t{256});
  const Device gpu = Device::cuda(0);
  expect_arg_error([&] {
    batched_matmul(TensorView(nowhere, DType::f32, {1, 2, 2}, gpu), TensorView(nowhere, DType::f32, {1, 2, 2}, gpu),
                   TensorView(nowhere, DType::f32, {1, 2, 2}, gpu));
  }, "device");
}

TEST(BatchedMatmulErrors, MixedDevices) {
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  Tensor a = Tensor::empty({2, 3, 4}, DType::bf16, gpu), b = Tensor::empty({2, 4, 5}, DType::bf16, kCpu);
  Tensor c = Tensor::empty({2, 3, 5}, DType::f32, gpu);
  expect_arg_error([&] { batched_matmul(a, b, c, BatchedMatmulImpl::cute); }, "b");
  Tensor b_gpu = Tensor::empty({2, 4, 5}, DType::bf16, gpu), c_cpu = Tensor::empty({2, 3, 5}, DType::f32, kCpu);
  expect_arg_error([&] { batched_matmul(a, b_gpu, c_cpu); }, "c");
}

// ---------------------------------------------------------------------------------------------
// CUDA against the spec
// ---------------------------------------------------------------------------------------------

// Error bound of a GPU batched matmul against the spec, for operands uniform in [-1, 1).
// Both sides multiply the same values exactly (a product of two bf16 or f16 numbers fits in
// fp32's 24 bits; f32 operands are multiplied inside fused multiply-adds), so they differ in two
// ways only:
//  - summation: the spec sums in double, the GPU in fp32, and tensor cores truncate rather than
//    round in their adders. Each of the K additions can be off by about one fp32 ulp (2^-23,
//    relative) of the running sum, and a running sum of products of random sign stays within a
//    few standard deviations of the whole sum (sqrt(K)/3 for uniform [-1, 1) operands). Bound:
//    K additions x an ulp at sqrt(K) (3 standard deviations) x 2 of slack = K^1.5 * 2^-22; for
//    K = 256 that is 1e-3, against sums of typical size 5;
//  - the final rounding to c's dtype: a sum near a rounding boundary may round either way, one
//    ulp of c's dtype relative to |c|, which tolerance_for's rtol covers.
test::Tolerance gemm_tolerance(DType c_dtype, std::int64_t k) {
  const double kk = static_cast<double>(std::max<std::int64_t>(k, 1));
  return {kk * std::sqrt(kk) * std::ldexp(1.0, -22), test::tolerance_for(c_dtype).rtol};
}

struct GemmCase {
  BatchedMatmulImpl impl;
  DType dtype;    // a and b
  DType c_dtype;
  std::int64_t batch, m, n, k;
};

std::string case_name(const ::testing::TestParamInfo<GemmCase>& info) {
  const GemmCase& p = info.param;
  return std::string(p.impl == BatchedMatmulImpl::cute ? "cute" : "cublas") + "_" +
         std::string(dtype_name(p.dtype)) + "_to_" + std::string(dtype_name(p.c_dtype)) + "_B" +
         std::to_string(p.batch) + "_M" + std::to_string(p.m) + "_N" + std::to_string(p.n) + "_K" +
         std::to_string(p.k);
}

std::vector<GemmCase> gemm_cases() {
  struct Size {
    std::int64_t batch, m, n, k;
  };
  // The SM80 kernel's tile is 128x128x32; its 16-byte loads need K % 8 == 0 and N % 8 == 0. The
  // SM90 GEMM's tile is 128x128x64 and it runs whenever K % 8 == 0 and N % 8 == 0 (on sm_90).
  const Size sizes[] = {
      {4, 32, 32, 32},     // puzzle 11
      {3, 77, 45, 133},    // odd K: element-wise loads, tails in M, N, K
      {2, 150, 264, 200},  // 16-byte loads with tails in M (150), N (264) and K (200 = 6*32 + 8)
      {3, 300, 392, 456},  // SM90 tails: M = 2*128 + 44, N = 3*128 + 8, K = 7*64 + 8
      {1, 1000, 136, 72},  // B = 1, 8 row tiles, N and K one tile + 8
      {8, 256, 512, 128},  // whole SM90 tiles, several tiles per SM
      {1, 128, 256, 64},   // whole tiles only
      {2, 1, 64, 40},      // one row
      {2, 19, 1, 24},      // one column
      {2, 33, 17, 1},      // K = 1
      {1, 1, 1, 1},
      {2, 16, 24, 0},      // K = 0: c = 0
      {0, 8, 8, 8},        // empty batch
      {70000, 3, 5, 8},    // more batches than gridDim.z (65535)
  };
  struct Types {
    BatchedMatmulImpl impl;
    DType dtype, c_dtype;
  };
  using I = BatchedMatmulImpl;
  const Types types[] = {
      {I::cublas, DType::f32, DType::f32},  {I::cublas, DType::bf16, DType::f32},
      {I::cublas, DType::bf16, DType::bf16}, {I::cublas, DType::f16, DType::f32},
      {I::cublas, DType::f16, DType::f16},  {I::cute, DType::bf16, DType::f32},
      {I::cute, DType::bf16, DType::bf16},  {I::cute, DType::f16, DType::f32},
      {I::cute, DType::f16, DType::f16},
  };
  std::vector<GemmCase> cases;
  for (const Types& t : types)
    for (const Size& s : sizes) cases.push_back({t.impl, t.dtype, t.c_dtype, s.batch, s.m, s.n, s.k});
  return cases;
}

class BatchedMatmulGpu : public ::testing::TestWithParam<GemmCase> {};

TEST_P(BatchedMatmulGpu, MatchesSpec) {
  FK_SKIP_WITHOUT_GPU();
  const GemmCase& p = GetParam();
  const Device gpu = Device::cuda(0);
  const auto seed = static_cast<std::uint64_t>(p.batch * 1000003 + p.m * 10007 + p.n * 101 + p.k);
  Tensor a = test::random_tensor({p.batch, p.m, p.k}, p.dtype, gpu, seed);
  Tensor b = test::random_tensor({p.batch, p.k, p.n}, p.dtype, gpu, seed + 1);
  Tensor c = Tensor::empty({p.batch, p.m, p.n}, p.c_dtype, gpu);
  test::poison(c);
  batched_matmul(a, b, c, p.impl);

  Tensor want = Tensor::empty({p.batch, p.m, p.n}, p.c_dtype, kCpu);
  batched_matmul(test::to_host(a), test::to_host(b), want);
  EXPECT_TRUE(test::all_close(c, want, gemm_tolerance(p.c_dtype, p.k)));
}

INSTANTIATE_TEST_SUITE_P(Shapes, BatchedMatmulGpu, ::testing::ValuesIn(gemm_cases()), case_name);

// Operands of small integers make every product and partial sum an integer below 2^24, exact in
// fp32 whatever the summation order, so the CuTe kernel must equal the spec bit for bit.
void expect_exact_on_small_integers(DType dtype, Dims a_shape, Dims b_shape, const Stream* stream) {
  const Device gpu = Device::cuda(0);
  auto integers = [&](Dims shape, std::uint64_t seed) {
    const std::vector<double> u = test::to_doubles(test::random_tensor(shape, DType::f32, kCpu, seed, -3.4f, 3.4f));
    std::vector<float> v(u.size());
    for (std::size_t i = 0; i < u.size(); ++i) v[i] = static_cast<float>(std::round(u[i]));  // in [-3, 3]
    return host_tensor(shape, dtype, v);
  };
  Tensor a = integers(a_shape, 7), b = integers(b_shape, 8);
  const Dims c_shape{a_shape[0], a_shape[1], b_shape[2]};
  Tensor want = Tensor::empty(c_shape, DType::f32, kCpu);
  batched_matmul(a, b, want);

  Tensor ad = a.copy_to(gpu), bd = b.copy_to(gpu), c = Tensor::empty(c_shape, DType::f32, gpu);
  test::poison(c);
  batched_matmul(ad, bd, c, BatchedMatmulImpl::cute, stream);
  if (stream) stream->synchronize();
  EXPECT_TRUE(test::all_close(c, want, {0.0, 0.0}));
}

// The first shape of each runs the SM90 GEMM on sm_90 (the SM80 kernel's 16-byte loads
// elsewhere), the second the SM80 kernel's element loads everywhere.
TEST(BatchedMatmulCute, bf16_f32_ExactOnSmallIntegers) {
  FK_SKIP_WITHOUT_GPU();
  const Stream stream = Stream::create(Device::cuda(0));
  expect_exact_on_small_integers(DType::bf16, {2, 136, 96}, {2, 96, 200}, &stream);
  expect_exact_on_small_integers(DType::bf16, {3, 77, 133}, {3, 133, 45}, nullptr);
}

TEST(BatchedMatmulCute, f16_f32_ExactOnSmallIntegers) {
  FK_SKIP_WITHOUT_GPU();
  expect_exact_on_small_integers(DType::f16, {2, 136, 96}, {2, 96, 200}, nullptr);
  expect_exact_on_small_integers(DType::f16, {3, 77, 133}, {3, 133, 45}, nullptr);
}

// Tails in every mode of the SM90 GEMM's 128x128x64 tile and clusters, B = 1.
TEST(BatchedMatmulCute, Sm90_bf16_f32_128x128x64_ExactOnSmallIntegers) {
  FK_SKIP_WITHOUT_GPU();
  expect_exact_on_small_integers(DType::bf16, {1, 333, 520}, {1, 520, 264}, nullptr);
  expect_exact_on_small_integers(DType::bf16, {5, 129, 8}, {5, 8, 136}, nullptr);
}

TEST(BatchedMatmulCute, MisalignedOperandsTakeTheElementPath) {
  // K and N are multiples of 8, but a and b start 2 bytes past a 16-byte boundary, which the
  // 16-byte cp.async cannot take: the kernel must notice and load element by element.
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  const std::int64_t batch = 2, m = 40, n = 48, k = 64;
  Tensor a_buf = test::random_tensor({batch * m * k + 1}, DType::bf16, gpu, 11);
  Tensor b_buf = test::random_tensor({batch * k * n + 1}, DType::bf16, gpu, 12);
  const TensorView a(static_cast<std::uint16_t*>(a_buf.data()) + 1, DType::bf16, {batch, m, k}, gpu);
  const TensorView b(static_cast<std::uint16_t*>(b_buf.data()) + 1, DType::bf16, {batch, k, n}, gpu);
  Tensor c = Tensor::empty({batch, m, n}, DType::f32, gpu);
  test::poison(c);
  batched_matmul(a, b, c, BatchedMatmulImpl::cute);

  Tensor want = Tensor::empty({batch, m, n}, DType::f32, kCpu);
  batched_matmul(test::to_host(a), test::to_host(b), want);
  EXPECT_TRUE(test::all_close(c, want, gemm_tolerance(DType::f32, k)));
}

TEST(BatchedMatmulCute, MisalignedOutputIsNotGivenToTma) {
  // a and b suit TMA, but c starts one element past a 16-byte boundary, which a TMA store cannot
  // take: on sm_90 the SM80 kernel (whose stores are per element) must run instead.
  FK_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  const std::int64_t batch = 2, m = 136, n = 72, k = 80;
  Tensor a = test::random_tensor({batch, m, k}, DType::bf16, gpu, 13);
  Tensor b = test::random_tensor({batch, k, n}, DType::bf16, gpu, 14);
  for (DType c_dtype : {DType::f32, DType::bf16}) {
    Tensor c_buf = Tensor::empty({batch * m * n + 1}, c_dtype, gpu);
    test::poison(c_buf);
    const TensorView c(static_cast<char*>(c_buf.data()) + dtype_size(c_dtype), c_dtype, {batch, m, n}, gpu);
    batched_matmul(a, b, c, BatchedMatmulImpl::cute);

    Tensor want = Tensor::empty({batch, m, n}, c_dtype, kCpu);
    batched_matmul(test::to_host(a), test::to_host(b), want);
    EXPECT_TRUE(test::all_close(c, want, gemm_tolerance(c_dtype, k))) << dtype_name(c_dtype);
    // The element before c is untouched.
    const std::vector<double> first = test::to_doubles(TensorView(c_buf.data(), c_dtype, {1}, gpu));
    EXPECT_TRUE(std::isnan(first[0])) << dtype_name(c_dtype);
  }
}

}  // namespace
}  // namespace fk
