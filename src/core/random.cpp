#include "fusekit/core/random.hpp"

#include <cmath>

#include "fusekit/core/error.hpp"
#include "fusekit/core/stream.hpp"
#include "random_detail.hpp"

namespace fk {
namespace {

void fill_random(const char* op, const TensorView& t, detail::Distribution d, float a, float b,
                 RandomParams p, const Stream* stream) {
  FK_CHECK_ARG(is_floating(t.dtype()), op, "t", "a floating-point tensor (f32, f16, bf16)", t.str());
  FK_CHECK_ARG(t.is_contiguous(), op, "t", "a contiguous tensor", t.str());
  FK_CHECK_ARG(t.data() != nullptr || t.numel() == 0, op, "t", "non-null data", "null");
  if (t.numel() == 0) return;
  if (t.device().is_cuda()) {
#if FUSEKIT_WITH_CUDA
    detail::fill_random_cuda(t, d, a, b, p, (stream ? *stream : Stream::default_stream()).handle());
    return;
#else
    (void)stream;
    throw Error(op, "t", "a host tensor (fusekit was built without CUDA)", t.str());
#endif
  }
  visit_dtype(t.dtype(), [&](auto zero) {
    using T = decltype(zero);
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, bf16> || std::is_same_v<T, f16>) {
      T* out = t.data_as<T>();
      const std::int64_t n = t.numel();
      for (std::int64_t blk = 0; blk * 4 < n; ++blk) {
        float v[4];
        detail::transform_block(
            philox::random_block(p.seed, p.subsequence, static_cast<std::uint64_t>(blk)), d, a, b, v,
            [](float x) { return std::log(x); }, [](float x) { return std::sqrt(x); },
            [](float x, float& s, float& c) { s = std::sin(x); c = std::cos(x); });
        for (int j = 0; j < 4 && blk * 4 + j < n; ++j) out[blk * 4 + j] = T(v[j]);
      }
    }
  });
}

}  // namespace

void fill_uniform(const TensorView& t, float lo, float hi, RandomParams p, const Stream* stream) {
  fill_random("fill_uniform", t, detail::Distribution::uniform, lo, hi - lo, p, stream);
}

void fill_normal(const TensorView& t, float mean, float std, RandomParams p, const Stream* stream) {
  fill_random("fill_normal", t, detail::Distribution::normal, mean, std, p, stream);
}

void advance_offset(const TensorView& counter, std::uint64_t by, const Stream* stream) {
  constexpr const char* op = "advance_offset";
  FK_CHECK_ARG(counter.dtype() == DType::i64 && counter.rank() == 1 && counter.numel() == 1 && counter.data() != nullptr,
               op, "counter", "an i64 [1] tensor with data", counter.str());
  auto* c = counter.data_as<std::uint64_t>();
  if (counter.device().is_cuda()) {
#if FUSEKIT_WITH_CUDA
    detail::advance_offset_cuda(c, by, (stream ? *stream : Stream::default_stream()).handle());
    return;
#else
    throw Error(op, "counter", "a host tensor (fusekit was built without CUDA)", counter.str());
#endif
  }
  (void)stream;
  *c += by;
}

}  // namespace fk
