// attention_forward and attention_backward (dense and varlen) on tensors that are not contiguous:
// any strides with the last one 1, as PyTorch hands them (Hugging Face's q, k, v: [B, S, H, D]
// projections seen as [B, H, S, D]; rows padded past D; q, k, v packed in one [total, 3, H, D]
// tensor). Each call on strided views must give what the same call gives on contiguous copies of
// them: bit for bit for out, lse, dk and dv (the same kernel on the same values; on the kernels
// that take contiguous tensors, the same kernel on the copies), within a few ulps for dq, which
// the sm_90 and mma.sync kernels sum by f32 atomics. Every output is written through its strides
// only: the padding around its elements keeps its poison.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "fusekit/fusekit.hpp"
#include "test_util.hpp"

namespace fk {
namespace {

const Device kCpu = Device::cpu();
const Device kGpu = Device::cuda(0);

// How a [B, H, S, D] view lies in memory.
enum class Layout {
  contiguous,
  bshd,    // [B, S, H, D] memory seen as [B, H, S, D] (Hugging Face's transposed projections)
  padded,  // [B, S, H, D + 8] memory: rows 8 elements apart beyond D, a gap after each row
};

// A [B, H, S, D] view (packed: [S, H, D], B = 1) over `mem`, which the caller keeps.
TensorView strided_view(Tensor& mem, Layout layout, std::int64_t b, std::int64_t h, std::int64_t s, std::int64_t d,
                        bool packed) {
  const std::int64_t pitch = layout == Layout::padded ? d + 8 : d;
  if (packed) {
    if (layout == Layout::contiguous) return mem.view();
    // Tokens H * pitch apart, heads pitch apart: a [S, H, pitch] tensor's first D columns.
    return TensorView(mem.data(), mem.dtype(), {s, h, d}, {h * pitch, pitch, 1}, mem.device());
  }
  if (layout == Layout::contiguous) return mem.view();
  return TensorView(mem.data(), mem.dtype(), {b, h, s, d}, {s * h * pitch, pitch, h * pitch, 1}, mem.device());
}

// Memory for a view of this layout, poisoned (NaN) so that a read of padding or a missed write shows.
Tensor memory_for(Layout layout, std::int64_t b, std::int64_t h, std::int64_t s, std::int64_t d, DType dt,
                  Device dev) {
  const std::int64_t pitch = layout == Layout::padded ? d + 8 : d;
  Tensor mem = Tensor::empty({b * h * s * pitch}, dt, dev);
  test::poison(mem);
  return mem;
}

// A contiguous copy of any view.
Tensor dense(const TensorView& t) {
  Tensor c = Tensor::empty(t.shape(), t.dtype(), t.device());
  convert(t, c);
  return c;
}

// A view of `layout` holding src's values.
struct Placed {
  Tensor mem;
  TensorView view;
};
Placed place(const TensorView& src, Layout layout, bool packed) {
  const std::int64_t b = packed ? 1 : src.size(0), h = packed ? src.size(1) : src.size(1);
  const std::int64_t s = packed ? src.size(0) : src.size(2), d = src.size(src.rank() - 1);
  Placed p{memory_for(layout, b, h, s, d, src.dtype(), src.device()), {}};
  p.view = strided_view(p.mem, layout, b, h, s, d, packed);
  convert(src, p.view);
  return p;
}

// The NaN elements of mem (the poison left in an output's padding).
std::int64_t nan_count(const Tensor& mem) {
  std::int64_t n = 0;
  for (double x : test::to_doubles(mem)) n += std::isnan(x) ? 1 : 0;
  return n;
}

struct StridedCase {
  std::string name;
  DType dt;
  std::int64_t b, h, hk, sq, sk, d;
  AttentionOptions opt;
  bool packed;  // varlen: B sequences of Sq (Sk) tokens each, minus b on the last
};

void PrintTo(const StridedCase& c, std::ostream* os) { *os << c.name; }

// Runs forward and backward of case c on `dev` with every tensor of `layout` (q, k, v, out, dout,
// dq, dk, dv), against the same calls on contiguous tensors.
void check_layout(const StridedCase& c, Layout layout, Device dev) {
  const std::uint64_t seed = 700 + static_cast<std::uint64_t>(c.sq + c.sk + c.d);
  const bool pk = c.packed;
  // Packed: sequence lengths sq, sq - 1, ... (and sk, sk - 1, ...), cu_seqlens on dev.
  std::vector<std::int32_t> cq{0}, ck{0};
  for (std::int64_t i = 0; i < c.b; ++i) {
    cq.push_back(cq.back() + static_cast<std::int32_t>(c.sq - i));
    ck.push_back(ck.back() + static_cast<std::int32_t>(c.sk - i));
  }
  const std::int64_t tq = pk ? cq.back() : c.sq, tk = pk ? ck.back() : c.sk, bb = pk ? 1 : c.b;
  const Dims qs = pk ? Dims{tq, c.h, c.d} : Dims{c.b, c.h, c.sq, c.d};
  const Dims ks = pk ? Dims{tk, c.hk, c.d} : Dims{c.b, c.hk, c.sk, c.d};
  const Dims ls = pk ? Dims{c.h, tq} : Dims{c.b, c.h, c.sq};
  Tensor cu_q = Tensor::empty({c.b + 1}, DType::i32, kCpu), cu_k = Tensor::empty({c.b + 1}, DType::i32, kCpu);
  std::copy(cq.begin(), cq.end(), cu_q.data_as<std::int32_t>());
  std::copy(ck.begin(), ck.end(), cu_k.data_as<std::int32_t>());
  const Tensor cu_qd = cu_q.copy_to(dev), cu_kd = cu_k.copy_to(dev);
  const AttentionVarlen seqs{cu_qd, cu_kd, c.sq, c.sk};

  const Tensor q = test::random_tensor(qs, c.dt, dev, seed, -2.0f, 2.0f);
  const Tensor k = test::random_tensor(ks, c.dt, dev, seed + 1, -2.0f, 2.0f);
  const Tensor v = test::random_tensor(ks, c.dt, dev, seed + 2);
  const Tensor dout = test::random_tensor(qs, c.dt, dev, seed + 3);
  auto forward = [&](const TensorView& q_, const TensorView& k_, const TensorView& v_, const TensorView& o_,
                     const TensorView& l_) {
    if (pk) attention_forward_varlen(q_, k_, v_, o_, l_, seqs, c.opt);
    else attention_forward(q_, k_, v_, o_, l_, c.opt);
  };
  auto backward = [&](const TensorView& q_, const TensorView& k_, const TensorView& v_, const TensorView& o_,
                      const TensorView& do_, const TensorView& l_, const TensorView& dq_, const TensorView& dk_,
                      const TensorView& dv_) {
    if (pk) attention_backward_varlen(q_, k_, v_, o_, do_, l_, dq_, dk_, dv_, seqs, c.opt);
    else attention_backward(q_, k_, v_, o_, do_, l_, dq_, dk_, dv_, c.opt);
  };

  // Contiguous: the reference.
  Tensor out = Tensor::empty(qs, c.dt, dev), lse = Tensor::empty(ls, DType::f32, dev);
  forward(q, k, v, out, lse);
  Tensor dq = Tensor::empty(qs, c.dt, dev), dk = Tensor::empty(ks, c.dt, dev), dv = Tensor::empty(ks, c.dt, dev);
  backward(q, k, v, out, dout, lse, dq, dk, dv);

  // Strided.
  const Placed sq_ = place(q, layout, pk), sk_ = place(k, layout, pk), sv_ = place(v, layout, pk);
  const Placed sdo = place(dout, layout, pk);
  Tensor so_mem = memory_for(layout, bb, c.h, tq, c.d, c.dt, dev);
  const TensorView so = strided_view(so_mem, layout, bb, c.h, tq, c.d, pk);
  Tensor slse = Tensor::empty(ls, DType::f32, dev);
  forward(sq_.view, sk_.view, sv_.view, so, slse);
  Tensor sdq_mem = memory_for(layout, bb, c.h, tq, c.d, c.dt, dev);
  Tensor sdk_mem = memory_for(layout, bb, c.hk, tk, c.d, c.dt, dev), sdv_mem = memory_for(layout, bb, c.hk, tk, c.d, c.dt, dev);
  const TensorView sdq = strided_view(sdq_mem, layout, bb, c.h, tq, c.d, pk);
  const TensorView sdk = strided_view(sdk_mem, layout, bb, c.hk, tk, c.d, pk);
  const TensorView sdv = strided_view(sdv_mem, layout, bb, c.hk, tk, c.d, pk);
  // The backward reads the strided forward's out (equal to `out`, checked below).
  backward(sq_.view, sk_.view, sv_.view, so, sdo.view, slse, sdq, sdk, sdv);

  const char* what = layout == Layout::bshd ? "bshd" : layout == Layout::padded ? "padded" : "contiguous";
  EXPECT_EQ(test::to_doubles(dense(so)), test::to_doubles(out)) << what << ": out";
  EXPECT_EQ(test::to_doubles(slse), test::to_doubles(lse)) << what << ": lse";
  EXPECT_EQ(test::to_doubles(dense(sdk)), test::to_doubles(dk)) << what << ": dk";
  EXPECT_EQ(test::to_doubles(dense(sdv)), test::to_doubles(dv)) << what << ": dv";
  EXPECT_TRUE(test::all_close(dense(sdq), dq, {1e-3, 1e-2})) << what << ": dq";
  // Outputs written through their strides only: the padding keeps its poison, the elements none.
  const std::int64_t pad = layout == Layout::padded ? 8 : 0;
  for (const auto& [name, mem, rows] : {std::tuple{"out", &so_mem, bb * c.h * tq}, std::tuple{"dq", &sdq_mem, bb * c.h * tq},
                                        std::tuple{"dk", &sdk_mem, bb * c.hk * tk}, std::tuple{"dv", &sdv_mem, bb * c.hk * tk}})
    EXPECT_EQ(nan_count(*mem), rows * pad) << what << ": " << name << " (NaN elements: the padding's and no others)";
}

class AttentionStrided : public ::testing::TestWithParam<StridedCase> {};

TEST_P(AttentionStrided, CpuMatchesContiguous) {
  const StridedCase& c = GetParam();
  if (c.sq * c.sk * c.h * c.b > (1 << 20)) GTEST_SKIP() << "large case: the GPU test covers it";
  for (Layout l : {Layout::bshd, Layout::padded}) check_layout(c, l, kCpu);
}

TEST_P(AttentionStrided, GpuMatchesContiguous) {
  FK_SKIP_WITHOUT_GPU();
  for (Layout l : {Layout::bshd, Layout::padded}) check_layout(GetParam(), l, kGpu);
}

INSTANTIATE_TEST_SUITE_P(
    Strided, AttentionStrided,
    ::testing::Values(
        // sm_90 forward and backward (on other GPUs: the copies, then mma.sync / warp-per-row)
        StridedCase{"bf16_d64_causal", DType::bf16, 2, 4, 4, 200, 200, 64, {.causal = true, .scale = 0.125f}, false},
        StridedCase{"f16_d128_gqa2", DType::f16, 1, 4, 2, 130, 257, 128, {.scale = 0.088f}, false},
        StridedCase{"bf16_d128_gqa4_causal_bottom_right", DType::bf16, 2, 8, 2, 129, 300, 128,
                    {.causal = true, .bottom_right = true, .scale = 0.088f}, false},
        StridedCase{"bf16_d64_varlen_causal", DType::bf16, 3, 4, 2, 150, 150, 64, {.causal = true, .scale = 0.125f}, true},
        // the kernels that take contiguous copies: mma.sync (D 96, a window), warp-per-row (f32)
        StridedCase{"bf16_d96", DType::bf16, 1, 2, 2, 100, 77, 96, {.scale = 0.1f}, false},
        StridedCase{"f16_d64_window", DType::f16, 1, 2, 1, 90, 90, 64,
                    {.causal = true, .window_left = 16, .scale = 0.125f}, false},
        StridedCase{"f32_d32_varlen", DType::f32, 2, 2, 2, 40, 33, 32, {.scale = 0.2f}, true}),
    [](const auto& info) { return info.param.name; });

TEST(AttentionStridedErrors, RowsMustBeContiguousAndOutputsDistinct) {
  auto t = [](Dims s, DType d = DType::bf16) { return Tensor::empty(s, d, kCpu); };
  Tensor q = t({1, 2, 8, 16}), k = t({1, 2, 8, 16}), v = t({1, 2, 8, 16}), out = t({1, 2, 8, 16});
  Tensor lse = t({1, 2, 8}, DType::f32), wide = t({1, 2, 8, 32});
  const TensorView every_other(wide.data(), DType::bf16, {1, 2, 8, 16}, {512, 256, 32, 2}, kCpu);
  test::expect_arg_error([&] { attention_forward(every_other, k, v, out, lse, {}); }, "attention_forward", "q");
  test::expect_arg_error([&] { attention_forward(q, k, every_other, out, lse, {}); }, "attention_forward", "v");
  const TensorView one_row(out.data(), DType::bf16, {1, 2, 8, 16}, {256, 128, 0, 1}, kCpu);  // every query one row
  test::expect_arg_error([&] { attention_forward(q, k, v, one_row, lse, {}); }, "attention_forward", "out");
  Tensor dq = t({1, 2, 8, 16}), dk = t({1, 2, 8, 16});
  test::expect_arg_error([&] { attention_backward(q, k, v, out, q, lse, dq, dk, one_row, {}); }, "attention_backward",
                         "dv");
}

}  // namespace
}  // namespace fk
