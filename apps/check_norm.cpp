// `fusekit check`'s norm cases: the spec's hand-worked values on the CPU (tests/ops/norm_test.cpp's
// NormSpec), and on a GPU add + RMSNorm forward and backward against the spec, bf16 with an f32
// weight, a row width with a tail of the vector kernels (1000 = 125 vectors of 8).
#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "apps/check_families.hpp"

namespace fk::app::check {

// Rows [2, -2, 2, -2] (rstd 1/2) and [1, 1, 1, 1] (rstd 1) from x + residual, weight [1, 2, 3, 4],
// offset 1: out = x^ (weight + 1); the backward of the first row with dout 1 and dresidual_out
// [1, 2, 3, 4]: dx = [2.25, 3.25, 5.25, 6.25], dweight = x^. Small dyadic values: exact.
std::vector<Measure> norm_by_hand() {
  std::vector<Measure> out;
  const Tensor x = host({2, 4}, DType::f32, {1, -1, 3, -2, 0.5, 0.5, 0.5, 0.5});
  const Tensor r = host({2, 4}, DType::f32, {1, -1, -1, 0, 0.5, 0.5, 0.5, 0.5});
  const Tensor w = host({4}, DType::f32, {1, 2, 3, 4});
  Tensor y = Tensor::empty({2, 4}, DType::f32, kCpu), s = Tensor::empty({2, 4}, DType::f32, kCpu);
  Tensor rstd = Tensor::empty({2}, DType::f32, kCpu);
  const RmsNormParams p{0.0f, 1.0f};
  rms_norm_forward({x, r.view(), w, y, s.view(), rstd}, p);
  out.push_back(close("add_rms_norm_forward residual_out, f32 [2, 4] by hand", values(s), {2, -2, 2, -2, 1, 1, 1, 1},
                      kExact));
  out.push_back(close("add_rms_norm_forward rstd, f32 [2, 4] by hand", values(rstd), {0.5, 1}, kExact));
  out.push_back(close("add_rms_norm_forward out, offset 1, f32 [2, 4] by hand", values(y),
                      {2, -3, 4, -5, 2, 3, 4, 5}, kExact));
  const Tensor dout = host({1, 4}, DType::f32, {1, 1, 1, 1}), dr = host({1, 4}, DType::f32, {1, 2, 3, 4});
  Tensor dx = Tensor::empty({1, 4}, DType::f32, kCpu), dw = Tensor::empty({4}, DType::f32, kCpu);
  rms_norm_backward({dout, dr.view(), s.view().slice_rows(0, 1), w, rstd.view().slice_rows(0, 1), dx, dw.view()}, p);
  out.push_back(close("rms_norm_backward dx, f32 [1, 4] by hand", values(dx), {2.25, 3.25, 5.25, 6.25}, kExact));
  out.push_back(close("rms_norm_backward dweight, f32 [1, 4] by hand", values(dw), {1, -1, 1, -1}, kExact));
  return out;
}

std::vector<Measure> norm_against_spec(Device gpu) {
  std::vector<Measure> out;
  const std::int64_t rows = 257, cols = 1000;
  const Dims sh{rows, cols};
  const DType dt = DType::bf16, wt = DType::f32, ot = rms_norm_out_dtype(dt, wt);
  const RmsNormParams p{1e-5f, 0.0f};
  const std::string c = fmt::format("{} x, {} weight {}", dtype_name(dt), dtype_name(wt), sh.str());
  // norm_test.cpp's bounds: one rounding of the dtype plus 4 sqrt(cols) fp32 roundings (the sums
  // in another order than the spec's double ones); dx 4x the atol (g - x^ mean cancels);
  // dweight plus 2 rows fp32 roundings.
  const double accum = 4.0 * std::sqrt(static_cast<double>(cols)) * 0x1p-24;
  auto tol = [&](DType t, double atol_scale) {
    const Tol o = one_rounding(t);
    return Tol{atol_scale * (o.atol + accum), o.rtol + accum};
  };

  const Tensor x = random(sh, dt, 301, -2, 2), r = random(sh, dt, 302, -2, 2), w = random({cols}, wt, 303, -1.5f, 1.5f);
  Tensor want = Tensor::empty(sh, ot, kCpu), want_s = Tensor::empty(sh, dt, kCpu);
  Tensor want_rstd = Tensor::empty({rows}, DType::f32, kCpu);
  reference::rms_norm_forward({x, r.view(), w, want, want_s.view(), want_rstd}, p);
  const Tensor xd = x.copy_to(gpu), rd = r.copy_to(gpu), wd = w.copy_to(gpu);
  Tensor y = Tensor::empty(sh, ot, gpu), s = Tensor::empty(sh, dt, gpu), rstd = Tensor::empty({rows}, DType::f32, gpu);
  poison(y);
  poison(s);
  poison(rstd);
  rms_norm_forward({xd, rd.view(), wd, y, s.view(), rstd}, p);
  out.push_back(close("add_rms_norm_forward out, " + c, y, want, tol(ot, 1)));
  out.push_back(close("add_rms_norm_forward residual_out, " + c, s, want_s, one_rounding(dt)));
  out.push_back(close("add_rms_norm_forward rstd, " + c, rstd, want_rstd, tol(DType::f32, 1)));

  const Tensor dout = random(sh, ot, 304), dres = random(sh, dt, 305);
  Tensor want_dx = Tensor::empty(sh, dt, kCpu), want_dw = Tensor::empty({cols}, wt, kCpu);
  reference::rms_norm_backward({dout, dres.view(), want_s, w, want_rstd, want_dx, want_dw.view()}, p);
  const Tensor doutd = dout.copy_to(gpu), dresd = dres.copy_to(gpu), sd = want_s.copy_to(gpu);
  const Tensor rstdd = want_rstd.copy_to(gpu);
  Tensor dx = Tensor::empty(sh, dt, gpu), dw = Tensor::empty({cols}, wt, gpu);
  poison(dx);
  poison(dw);
  rms_norm_backward({doutd, dresd.view(), sd, wd, rstdd, dx, dw.view()}, p);
  out.push_back(close("rms_norm_backward dx, " + c, dx, want_dx, tol(dt, 4)));
  const Tol o = one_rounding(wt);
  out.push_back(close("rms_norm_backward dweight, " + c, dw, want_dw,
                      {o.atol + 2.0 * static_cast<double>(rows) * 0x1p-24, o.rtol}));
  return out;
}

}  // namespace fk::app::check
