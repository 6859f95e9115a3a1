// Helpers shared by every fusekit test: GPU skipping, random tensors, comparison with tolerances
// derived from the dtype.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "fusekit/fusekit.hpp"

namespace fk::test {

// Skips the current test, printing why, when no CUDA device can run kernels.
#define FK_SKIP_WITHOUT_GPU()                                                      \
  do {                                                                             \
    if (::fk::cuda_device_count() == 0)                                            \
      GTEST_SKIP() << "GPU test skipped: " << ::fk::cuda_unavailable_reason();    \
  } while (0)

// A tensor of uniform random values in [lo, hi) from the Philox stream `seed`, made on the host
// and copied to `device`, so the same seed gives the same values everywhere.
Tensor random_tensor(Dims shape, DType dtype, Device device, std::uint64_t seed, float lo = -1.f, float hi = 1.f);
Tensor to_host(const TensorView& t);
// A host tensor holding `values` (row-major), each rounded to `dtype`.
Tensor host_tensor(Dims shape, DType dtype, const std::vector<float>& values);
// Every element as double (host or device tensor).
std::vector<double> to_doubles(const TensorView& t);
// Every element as float (host or device tensor).
std::vector<float> to_floats(const TensorView& t);
// Fills a tensor with NaN, so that an element a kernel fails to write cannot pass a comparison.
void poison(const TensorView& t);
// Whether device 0 is an sm_90 GPU (H100/H200), where the wgmma/TMA kernels run.
bool on_sm90();

// |got - ref| <= atol + rtol * |ref| elementwise.
struct Tolerance {
  double atol;
  double rtol;
};
// One rounding to the dtype plus a few float operations of slack: rtol = 2 * unit roundoff of
// the dtype (bf16 2^-8, f16 2^-11, f32 2^-23), atol the same scaled to values of order 1.
Tolerance tolerance_for(DType t);

::testing::AssertionResult all_close(const TensorView& got, const TensorView& ref, Tolerance tol);

// ||got - ref|| / ||ref|| over every element (||got - ref|| when ref is all zeros), infinite when
// got holds a NaN or an infinity: the normwise relative error of GEMM-shaped results, as
// `fusekit bench` reports rel_err.
double rel_err_normwise(const TensorView& got, const TensorView& ref);

// Runs f and checks that it throws fk::Error of op `op` naming argument `arg`.
template <class F>
void expect_arg_error(F&& f, const std::string& op, const std::string& arg) {
  try {
    f();
    ADD_FAILURE() << "no fk::Error for argument " << arg;
  } catch (const Error& e) {
    EXPECT_EQ(e.op(), op) << e.what();
    EXPECT_EQ(e.arg(), arg) << e.what();
  }
}

// Runs f and checks that it throws fk::Error whose message contains every one of `parts`.
template <class F>
void expect_error_mentions(F&& f, std::initializer_list<std::string> parts) {
  try {
    f();
    ADD_FAILURE() << "no fk::Error (expected one mentioning " << *parts.begin() << ")";
  } catch (const Error& e) {
    for (const std::string& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << p << " in: " << e.what();
  }
}

}  // namespace fk::test
