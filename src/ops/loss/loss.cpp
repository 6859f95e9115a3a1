// Dispatch of the loss family: argument checks, then the CPU spec or the chunked GPU path (the
// gemm family's cuBLAS GEMMs around cross_entropy_rows.cu's kernel).
#include "fusekit/ops/loss.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "fusekit/ops/gemm.hpp"
#include "fusekit/ops/pointwise.hpp"
#include "ops/common/op_checks.hpp"

#if FUSEKIT_WITH_CUDA
#include <cuda_runtime.h>

#include "fusekit/core/cuda_check.hpp"
#include "loss_cuda.hpp"
#endif

namespace fk {

std::string_view loss_reduction_name(LossReduction r) noexcept {
  switch (r) {
    case LossReduction::mean: return "mean";
    case LossReduction::sum: return "sum";
  }
  return "?";
}

LossReduction parse_loss_reduction(std::string_view name, const char* op) {
  if (name == "mean") return LossReduction::mean;
  if (name == "sum") return LossReduction::sum;
  throw Error(op, "reduction", "\"mean\" or \"sum\"", fmt::format("\"{}\"", name));
}

namespace {

constexpr const char* kOp = "linear_cross_entropy";
// A chunk's logits when there are several: 16-bit logits half of the N rows' logits, between 256
// and 512 MiB; f32 logits 256 MiB. N rows of 16-bit logits are one chunk where those logits fit the
// smallest budget, or where they are at least kOneChunkMinLogitBytes16 and fit
// kOneChunkLogitBytes16 plus the accumulators one chunk does not need. H100, bf16, fused linear +
// cross-entropy forward and backward (docs/notes/llm-training.md): at M 16384, H 2048, V 32000 one
// chunk took 9.7 ms against 10.2-10.6 in chunks of 4096 rows; at M 65536, H 768, chunks of 8192
// rows 18.4 against 18.7-18.9. Smaller logits (N 8192, V 32000: 500 MiB) go in two chunks, which
// keeps the head within a quarter of the eager expression's memory (its f32 logits and their
// gradient) once the 16-bit copies of w and dw beside one chunk's logits are counted.
constexpr std::int64_t kMinChunkLogitBytes16 = std::int64_t{256} << 20, kMaxChunkLogitBytes16 = std::int64_t{512} << 20;
constexpr std::int64_t kChunkLogitBytes32 = std::int64_t{256} << 20;
constexpr std::int64_t kOneChunkLogitBytes16 = std::int64_t{1} << 30, kOneChunkMinLogitBytes16 = std::int64_t{768} << 20;
constexpr std::int64_t kMinChunkRows = 4096;

// The chunk's f32 logits rows are padded to a multiple of 8 floats: 32-byte aligned rows for the
// kernel's 16-byte loads and for cuBLAS's vectorised paths (also in the 16-bit g over them).
std::int64_t padded_classes(std::int64_t v) { return (v + 7) / 8 * 8; }

const TensorView* opt(const std::optional<TensorView>& t) { return t ? &*t : nullptr; }

void check(const LinearCrossEntropyArgs& a, const LinearCrossEntropyParams& p, const Stream* stream) {
  checks::tensor(kOp, "h", a.h, 2);
  checks::dtype_in(kOp, "h", a.h, checks::kFloatTypes);
  const Device dev = a.h.device();
  checks::cuda_available(kOp, dev);
  checks::check_stream(kOp, stream, dev);
  const std::int64_t n = a.h.size(0), hd = a.h.size(1);
  FK_CHECK_ARG(hd >= 1, kOp, "h", "[N, H] with H >= 1", a.h.shape().str());
  checks::tensor(kOp, "w", a.w, 2);
  checks::same_dtype(kOp, "w", a.w, a.h);
  checks::same_device(kOp, "w", a.w, dev);
  FK_CHECK_ARG(a.w.size(0) >= 1 && a.w.size(1) == hd, kOp, "w", fmt::format("[V, {}] with V >= 1 (H of h)", hd),
               a.w.shape().str());
  const std::int64_t v = a.w.size(0);
  if (a.bias) checks::companion(kOp, "bias", *a.bias, a.h, Dims{v});
  checks::tensor(kOp, "targets", a.targets, 1);
  checks::dtype_in(kOp, "targets", a.targets, {DType::i64});
  checks::shape_is(kOp, "targets", a.targets, Dims{n});
  checks::same_device(kOp, "targets", a.targets, dev);
  FK_CHECK_ARG(a.loss.numel() == 1 && a.loss.rank() <= 1 && a.loss.dtype() == DType::f32 && a.loss.data() != nullptr,
               kOp, "loss", "an f32 scalar ([] or [1])", a.loss.str());
  checks::same_device(kOp, "loss", a.loss, dev);
  if (a.dh) checks::companion(kOp, "dh", *a.dh, a.h, Dims{n, hd});
  if (a.dw) checks::companion(kOp, "dw", *a.dw, a.w, Dims{v, hd});
  if (a.dbias) {
    FK_CHECK_ARG(a.bias.has_value(), kOp, "dbias", "no dbias without a bias", "a dbias");
    checks::companion(kOp, "dbias", *a.dbias, *a.bias, Dims{v});
  }
  FK_CHECK_ARG(std::isfinite(p.label_smoothing) && p.label_smoothing >= 0.0f && p.label_smoothing <= 1.0f, kOp,
               "label_smoothing", "a number in [0, 1]", fmt::format("{}", p.label_smoothing));
  FK_CHECK_ARG(std::isfinite(p.z_loss) && p.z_loss >= 0.0f, kOp, "z_loss", "a finite number >= 0",
               fmt::format("{}", p.z_loss));
  FK_CHECK_ARG(p.chunk_rows >= 0, kOp, "chunk_rows", "0 (automatic) or a row count >= 1",
               fmt::format("{}", p.chunk_rows));
  FK_CHECK_ARG(p.reduction == LossReduction::mean || p.reduction == LossReduction::sum, kOp, "reduction",
               "mean or sum", fmt::format("{}", static_cast<int>(p.reduction)));
  checks::outputs_disjoint(kOp, {{"loss", &a.loss}, {"dh", opt(a.dh)}, {"dw", opt(a.dw)}, {"dbias", opt(a.dbias)}},
                           {{"h", &a.h}, {"w", &a.w}, {"bias", opt(a.bias)}, {"targets", &a.targets}});
}

#if FUSEKIT_WITH_CUDA
void check_targets_on_host(const LinearCrossEntropyArgs& a, const LinearCrossEntropyParams& p, const Tensor& status,
                           const Stream* stream) {
  const cudaStream_t s = detail::cuda_stream(stream);
  std::int64_t host[2] = {0, 0};
  FK_CUDA_CHECK(cudaMemcpyAsync(host, status.data(), sizeof(host), cudaMemcpyDeviceToHost, s));
  FK_CUDA_CHECK(cudaStreamSynchronize(s));
  const std::int64_t n = a.h.size(0), row = host[1];
  if (row >= n) return;
  std::int64_t value = 0;
  FK_CUDA_CHECK(cudaMemcpy(&value, a.targets.data_as<const std::int64_t>() + row, sizeof(value), cudaMemcpyDeviceToHost));
  throw Error(kOp, "targets", fmt::format("class indices in [0, {}) or ignore_index {}", a.w.size(0), p.ignore_index),
              fmt::format("{} at row {}", value, row));
}

void run_cuda(const LinearCrossEntropyArgs& a, const LinearCrossEntropyParams& p, const Stream* stream) {
  const Device dev = a.h.device();
  const detail::DeviceScope on_device(dev.index);
  const std::int64_t n = a.h.size(0), hd = a.h.size(1), v = a.w.size(0);
  const DType dt = a.h.dtype();

  const Tensor status = Tensor::empty({2}, DType::i64, dev, stream);  // [count, first bad row]
  cuda::loss_count_targets(a.targets, v, p.ignore_index, status.view(), stream);
  if (p.check_targets && n > 0) check_targets_on_host(a, p, status, stream);

  // Several chunks accumulate 16-bit dw and dbias in f32 (f32 ones in place); one chunk writes
  // them with its GEMMs, one rounding each, and may use the accumulators' memory for its logits.
  const bool wide = dt == DType::f32;
  const std::int64_t accumulator_bytes = wide ? 0 : (a.dw ? 4 * v * hd : 0) + (a.dbias ? 4 * v : 0);
  const std::int64_t c = n == 0 ? 1 : linear_cross_entropy_chunk_rows(n, v, p.chunk_rows, dt, accumulator_bytes);
  const bool accumulate = !wide && c < n;
  std::optional<Tensor> dw_acc, dbias_acc;
  if (a.dw && accumulate) dw_acc = Tensor::empty({v, hd}, DType::f32, dev, stream);
  if (a.dbias && accumulate) dbias_acc = Tensor::empty({v}, DType::f32, dev, stream);
  const std::optional<TensorView> dw = a.dw ? std::optional(dw_acc ? dw_acc->view() : *a.dw) : std::nullopt;
  const std::optional<TensorView> dbias =
      a.dbias ? std::optional((dbias_acc ? dbias_acc->view() : *a.dbias).reshape({1, v})) : std::nullopt;

  const Tensor row_loss = Tensor::empty({n}, DType::f32, dev, stream);
  if (n == 0) {
    if (dw) zero_async(*dw, stream ? *stream : Stream::default_stream());
    if (dbias) zero_async(*dbias, stream ? *stream : Stream::default_stream());
  } else {
    const std::int64_t vp = padded_classes(v);
    const Tensor logits = Tensor::empty({c, vp}, dt, dev, stream);  // [C, Vp]: z, then g over it
    std::optional<Tensor> ones;                                             // [1, C] for dbias += 1ᵀ g
    if (dbias) {
      ones = Tensor::empty({1, c}, dt, dev, stream);
      cuda::fill_ones(ones->view(), stream);
    }
    for (std::int64_t r0 = 0; r0 < n; r0 += c) {
      const std::int64_t rows = std::min(c, n - r0);
      const TensorView h_c = a.h.slice_rows(r0, r0 + rows);
      const TensorView z_c(logits.data(), dt, {rows, v}, {vp, 1}, dev);
      const TensorView& g_c = z_c;  // the row kernel writes g over z
      const float beta = r0 == 0 ? 0.0f : 1.0f;
      gemm({h_c, a.w, z_c}, {.trans_a = Trans::n, .trans_b = Trans::t, .allow_tf32 = p.allow_tf32}, stream);
      cuda::cross_entropy_rows({logits.data(), rows, v, vp, dt, a.bias ? a.bias->data() : nullptr,
                                a.targets.data_as<const std::int64_t>() + r0, status.data_as<const std::int64_t>(),
                                row_loss.data_as<float>() + r0},
                               p, stream);
      if (a.dh)
        gemm({g_c, a.w, a.dh->slice_rows(r0, r0 + rows)},
             {.trans_a = Trans::n, .trans_b = Trans::n, .allow_tf32 = p.allow_tf32}, stream);
      if (dw)
        gemm({g_c, h_c, *dw}, {.trans_a = Trans::t, .trans_b = Trans::n, .beta = beta, .allow_tf32 = p.allow_tf32},
             stream);
      if (dbias) {
        const TensorView ones_c(ones->data(), dt, {1, rows}, {c, 1}, dev);
        gemm({ones_c, g_c, *dbias}, {.trans_a = Trans::n, .trans_b = Trans::n, .beta = beta, .allow_tf32 = p.allow_tf32},
             stream);
      }
    }
  }
  cuda::loss_total(row_loss.view(), status.view(), p.reduction, a.loss, stream);
  if (dw_acc) convert(dw_acc->view(), *a.dw, stream);
  if (dbias_acc) convert(dbias_acc->view(), *a.dbias, stream);
}
#endif

}  // namespace

std::int64_t linear_cross_entropy_chunk_rows(std::int64_t n, std::int64_t v, std::int64_t chunk_rows, DType logits,
                                             std::int64_t accumulator_bytes) {
  if (n <= 0) return 1;
  if (chunk_rows > 0) return std::min(chunk_rows, n);
  // At least kMinChunkRows: each chunk re-reads and re-writes the f32 dW accumulator (8 V H
  // bytes), which against the chunk's 6 C V H flops costs about (8 / 6) (peak FLOP/s / bandwidth)
  // / C of the GEMM time, about 311 / C on an H100: 8% at 4096 rows, 30% at V 128256's 1046.
  const std::int64_t row_bytes = static_cast<std::int64_t>(dtype_size(logits)) * padded_classes(v);
  const bool half = dtype_size(logits) == 2;
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  const std::int64_t all_bytes = n > kMax / row_bytes ? kMax : n * row_bytes;
  const std::int64_t budget =
      half ? std::clamp(all_bytes / 2, kMinChunkLogitBytes16, kMaxChunkLogitBytes16) : kChunkLogitBytes32;
  const std::int64_t cap = std::max<std::int64_t>(kMinChunkRows, budget / row_bytes);
  if (n <= cap) return n;
  // One chunk needs no accumulator: it may take the accumulator's memory as well (no accumulator
  // traffic, one rounding of dw); large 16-bit logits up to kOneChunkLogitBytes16 besides.
  const std::int64_t acc = std::max<std::int64_t>(accumulator_bytes, 0);
  const std::int64_t one_chunk = half ? (all_bytes >= kOneChunkMinLogitBytes16 ? kOneChunkLogitBytes16 : 0) : budget;
  if (all_bytes <= one_chunk + acc) return n;
  // Equal chunks, rounded up to 8 rows (the GEMMs' M), at most about cap rows.
  const std::int64_t chunks = (n + cap - 1) / cap;
  const std::int64_t c = ((n + chunks - 1) / chunks + 7) / 8 * 8;
  return std::min(c, n);
}

void linear_cross_entropy(const LinearCrossEntropyArgs& args, const LinearCrossEntropyParams& p,
                          [[maybe_unused]] const Stream* stream) {
  check(args, p, stream);
  if (args.h.device().is_cpu()) return reference::linear_cross_entropy(args, p);
#if FUSEKIT_WITH_CUDA
  run_cuda(args, p, stream);
#endif
}

}  // namespace fk
