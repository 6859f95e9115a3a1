// The GPU DLRM: buffers, cuBLAS / cuBLASLt calls and the order of the kernels of the recsys and
// pointwise families (ops/recsys/recsys_cuda.hpp, ops/pointwise/rows_cuda.hpp), for both
// implementations (contract in dlrm_gpu.hpp).
#include "models/dlrm_gpu.hpp"

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <array>
#include <cmath>
#include <cstring>
#include <map>
#include <tuple>

#include "fusekit/core/allocator.hpp"
#include "fusekit/core/cuda_check.hpp"
#include "fusekit/core/error.hpp"
#include "fusekit/core/random.hpp"
#include "fusekit/core/stream.hpp"
#include "fusekit/ops/gemm.hpp"
#include "fusekit/ops/mlp.hpp"
#include "models/layers.hpp"
#include "ops/pointwise/rows_cuda.hpp"
#include "ops/recsys/recsys_cuda.hpp"

namespace fk::models::gpu {

using cuda::add_dense_grad;
using cuda::bias_add;
using cuda::column_sum;
using cuda::column_sum_partial_floats;
using cuda::embedding_backward_fused;
using cuda::embedding_forward_fused;
using cuda::embedding_forward_table;
using cuda::embedding_keys;
using cuda::from_bf16_rows;
using cuda::interaction_dot_backward;
using cuda::interaction_dot_forward;
using cuda::interaction_gather;
using cuda::interaction_outer_forward;
using cuda::interaction_scatter;
using cuda::kLossAccDoubles;
using cuda::optimizer_update;
using cuda::relu_backward_inplace;
using cuda::relu_inplace;
using cuda::sigmoid;
using cuda::sigmoid_bce_fused;
using cuda::sigmoid_bce_reference;
using cuda::sparse_backward_chunks;
using cuda::sparse_backward_sort_bytes;
using cuda::SparseBackwardWorkspace;
using cuda::TableSet;
using cuda::to_bf16_rows;

namespace {

constexpr const char* kOp = "models::Dlrm";
constexpr std::int64_t kAlign = 64;  // floats: every parameter starts 256-byte aligned

std::int64_t align_up(std::int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

struct LinearSlot {
  std::int64_t in, out;
  bool relu;
  std::int64_t w, b;  // offsets in the flat parameter / gradient / state buffers
  // The GEMMs see the input with `in_ld` >= in columns (zero padding to a multiple of 4 floats,
  // so that TF32 kernels get 16-byte aligned rows: Criteo's 13 dense features, the dot
  // interaction's 367). A padded layer runs its GEMMs on a zero-padded copy of W and of dW
  // (`shadow` offsets, refreshed / copied back every step); the parameters stay [out, in].
  std::int64_t in_ld = 0;
  std::int64_t shadow_w = -1, shadow_dw = -1;
  bool padded() const { return in_ld != in; }
};

Tensor device_f32(std::int64_t n, Device dev, const Stream* s) {
  return Tensor::empty({std::max<std::int64_t>(n, 1)}, DType::f32, dev, s);
}

Tensor view_of(float* p, Dims shape, Device dev) {
  return Tensor::adopt(TensorView(p, DType::f32, shape, dev), [] {});
}

// An MLP (linears [first, first + count)) run through fusekit's fused_mlp in bf16: a bf16 mirror
// of its parameter range, refreshed every step from the fp32 master copy, and bf16 batch buffers.
struct FusedMlpRun {
  bool on = false;
  std::size_t first = 0, count = 0;
  std::int64_t in = 0, hidden = 0, out = 0;
  std::int64_t start = 0, floats = 0;  // the parameter range [start, start + floats)
  Tensor w16, x16, y16, hid16, dy16, dx16;
};

}  // namespace

struct GpuDlrm::State {
  DlrmConfig config;
  DlrmImpl impl;
  Device dev;
  Stream stream, copy_stream;

  // Parameters: MLP layers in one flat buffer (and their gradients / Adagrad state alike).
  std::vector<LinearSlot> linears;
  std::size_t bottom_layers = 0;
  std::int64_t param_floats = 0;
  Tensor params, grads, adagrad, shadow;
  std::vector<Tensor> param_views;  // per linear: W, b, dW, db
  // Tables: one buffer [total_rows, D].
  std::int64_t total_rows = 0;
  int key_bits = 1;
  std::vector<std::int64_t> base_host, rows_host;
  Tensor table_buf, table_state, dense_grad, table_base, table_rows;
  std::vector<Tensor> table_views;
  Tensor pairs;
  int num_pairs = 0;
  FusedMlpRun bottom_run, top_run;
  std::int64_t features = 0, dim = 0, inter = 0, ldr = 0, ld_dense = 0;

  // Batch-sized buffers, allocated for the largest batch seen.
  struct Slot {
    Tensor dense, raw, labels, indices, offsets;
    cudaEvent_t copied = nullptr, free = nullptr;
  };
  std::array<Slot, 2> slots;
  std::int64_t cap = 0, cap_nnz = 0;
  Tensor z, r, logits, p, dlogits, dr, dz, zz, sym, keys, bags, partial, ga, gb;
  std::vector<Tensor> bot_act, top_act;
  SparseBackwardWorkspace ws;
  Tensor ws_keys, ws_bags, ws_temp, ws_head, ws_tail, ws_ends, ws_owners;
  Tensor loss_acc;

  // The batch of the last forward.
  std::int64_t batch = 0, nnz = 0;
  int slot = 0;
  bool use_raw = false;
  std::int64_t steps = 0;
  std::map<std::tuple<int, std::int64_t, int, float, float>, cudaGraphExec_t> graphs;
  std::map<std::int64_t, bool> warm;  // batch sizes that ran one eager step

  // Phase timing for --trace: mark(name) starts a phase (ending the previous one); flush() waits
  // for the step and adds the phases to the trace.
  TraceRecorder* trace = nullptr;
  std::vector<cudaEvent_t> events;
  std::vector<const char*> marks;
  double step_host_start_us = 0;

  void mark(const char* name) {
    if (!trace) return;
    if (marks.empty()) {
      FK_CUDA_CHECK(cudaStreamSynchronize(cs()));
      step_host_start_us = trace->now_us();
    }
    if (events.size() <= marks.size()) {
      cudaEvent_t e = nullptr;
      FK_CUDA_CHECK(cudaEventCreate(&e));
      events.push_back(e);
    }
    FK_CUDA_CHECK(cudaEventRecord(events[marks.size()], cs()));
    marks.push_back(name);
  }

  void flush_trace() {
    if (!trace || marks.empty()) return;
    mark(nullptr);
    FK_CUDA_CHECK(cudaEventSynchronize(events[marks.size() - 1]));
    for (std::size_t i = 0; i + 1 < marks.size(); ++i) {
      float start = 0, end = 0;
      FK_CUDA_CHECK(cudaEventElapsedTime(&start, events[0], events[i]));
      FK_CUDA_CHECK(cudaEventElapsedTime(&end, events[0], events[i + 1]));
      trace->add_on_track(marks[i], "gpu", step_host_start_us + 1e3 * start, 1e3 * (end - start),
                          TraceRecorder::kGpuTrack);
    }
    marks.clear();
  }

  cudaStream_t cs() const { return static_cast<cudaStream_t>(stream.handle()); }
  float* P(std::int64_t off) const { return params.data_as<float>() + off; }
  float* G(std::int64_t off) const { return grads.data_as<float>() + off; }
  float* S(std::int64_t off) const { return shadow.data_as<float>() + off; }
  const float* weights_for_gemm(const LinearSlot& l) const { return l.padded() ? S(l.shadow_w) : P(l.w); }
  float* table(int t) const { return table_buf.data_as<float>() + base_host[t] * dim; }
  // The tables for the kernels (adagrad_state is set by the step that uses it).
  TableSet table_set() const {
    return {table_buf.data_as<float>(), nullptr, table_base.data_as<std::int64_t>(),
            table_rows.data_as<std::int64_t>(), static_cast<int>(base_host.size()), static_cast<int>(dim)};
  }

  State(const DlrmConfig& c, DlrmImpl im, int device)
      : config(c), impl(im), dev(Device::cuda(device)), stream(Stream::create(dev)), copy_stream(Stream::create(dev)) {}

  ~State() {
    for (cudaEvent_t e : events) cudaEventDestroy(e);
    for (auto& [k, g] : graphs) cudaGraphExecDestroy(g);
    for (Slot& s : slots) {
      if (s.copied) cudaEventDestroy(s.copied);
      if (s.free) cudaEventDestroy(s.free);
    }
  }

  // A row-major f32 matrix [rows, cols] with row stride ld.
  TensorView mat(const float* p, std::int64_t rows, std::int64_t cols, std::int64_t ld) const {
    return TensorView(const_cast<float*>(p), DType::f32, {rows, cols}, {ld, 1}, dev);
  }
  // A batch of `count` such matrices, `stride` floats apart.
  TensorView mats(const float* p, std::int64_t count, std::int64_t stride, std::int64_t rows, std::int64_t cols,
                  std::int64_t ld) const {
    return TensorView(const_cast<float*>(p), DType::f32, {count, rows, cols}, {stride, ld, 1}, dev);
  }

  // y [B, out] (leading dim ldy) = act(x [B, in] (ldx) Wᵀ + b).
  void linear_forward(std::size_t li, const float* x, std::int64_t ldx, float* y, std::int64_t ldy, std::int64_t b) {
    const LinearSlot& l = linears[li];
    const TensorView xv = mat(x, b, l.in_ld, ldx), w = mat(weights_for_gemm(l), l.out, l.in_ld, l.in_ld);
    const TensorView yv = mat(y, b, l.out, ldy);
    GemmParams p;
    p.trans_b = Trans::t;
    p.allow_tf32 = config.allow_tf32;
    if (impl == DlrmImpl::fused) {  // bias and ReLU in the GEMM's epilogue
      p.epilogue = l.relu ? GemmEpilogue::relu_bias : GemmEpilogue::bias;
      gemm({xv, w, yv, TensorView(P(l.b), DType::f32, {l.out}, dev)}, p, &stream);
      return;
    }
    gemm({xv, w, yv}, p, &stream);
    bias_add(y, P(l.b), b, l.out, ldy, cs());
    if (l.relu) relu_inplace(y, b, l.out, ldy, cs());
  }

  // From dy [B, out] (the gradient of the layer's output y; overwritten with the gradient of its
  // pre-activation): dW, db, and dx [B, in_ld] when dx is not null. masked: dy already carries
  // the ReLU derivative (the fused interaction backward applied it).
  void linear_backward(std::size_t li, const float* x, std::int64_t ldx, const float* y, std::int64_t ldy, float* dy,
                       std::int64_t lddy, float* dx, std::int64_t lddx, std::int64_t b, bool masked = false) {
    const LinearSlot& l = linears[li];
    if (impl == DlrmImpl::fused) {
      column_sum(dy, l.relu && !masked ? y : nullptr, G(l.b), b, l.out, lddy, ldy, partial.data_as<float>(), cs());
    } else {
      if (l.relu) relu_backward_inplace(dy, y, b, l.out, lddy, ldy, cs());
      column_sum(dy, nullptr, G(l.b), b, l.out, lddy, ldy, partial.data_as<float>(), cs());
    }
    float* dw = l.padded() ? S(l.shadow_dw) : G(l.w);
    const TensorView dyv = mat(dy, b, l.out, lddy);
    matmul(dyv, mat(x, b, l.in_ld, ldx), mat(dw, l.out, l.in_ld, l.in_ld), Trans::t, Trans::n, &stream,
           config.allow_tf32);
    if (l.padded())
      FK_CUDA_CHECK(cudaMemcpy2DAsync(G(l.w), static_cast<std::size_t>(l.in) * 4, dw, static_cast<std::size_t>(l.in_ld) * 4,
                                      static_cast<std::size_t>(l.in) * 4, static_cast<std::size_t>(l.out),
                                      cudaMemcpyDeviceToDevice, cs()));
    if (dx)
      matmul(dyv, mat(weights_for_gemm(l), l.out, l.in_ld, l.in_ld), mat(dx, b, l.in_ld, lddx), Trans::n, Trans::n,
             &stream, config.allow_tf32);
  }

  // The padded layers' GEMM copies of W, from the parameters the optimizer updated.
  void refresh_shadows() {
    for (std::size_t i = 0; i < linears.size(); ++i) {
      const LinearSlot& l = linears[i];
      const FusedMlpRun& run = i < bottom_layers ? bottom_run : top_run;
      if (l.padded() && !run.on)
        FK_CUDA_CHECK(cudaMemcpy2DAsync(S(l.shadow_w), static_cast<std::size_t>(l.in_ld) * 4, P(l.w),
                                        static_cast<std::size_t>(l.in) * 4, static_cast<std::size_t>(l.in) * 4,
                                        static_cast<std::size_t>(l.out), cudaMemcpyDeviceToDevice, cs()));
    }
  }

  // ---- MLPs through fused_mlp ---------------------------------------------------------------------
  // Whether linears [first, first + count) fit fused_mlp: two layers or more, input and output
  // <= 128, every hidden layer one width of 16, 32, 64 or 128.
  bool fits_fused_mlp(std::size_t first, std::size_t count) const {
    if (count < 2) return false;
    const std::int64_t h = linears[first].out;
    if (h != 16 && h != 32 && h != 64 && h != 128) return false;
    for (std::size_t i = first; i + 1 < first + count; ++i)
      if (linears[i].out != h) return false;
    return linears[first].in <= 128 && linears[first + count - 1].out <= 128;
  }

  void plan_fused_mlp(FusedMlpRun& run, std::size_t first, std::size_t count) {
    if (!config.fused_mlp || impl != DlrmImpl::fused || !fits_fused_mlp(first, count)) return;
    const LinearSlot& a = linears[first];
    const LinearSlot& z = linears[first + count - 1];
    run.on = true;
    run.first = first;
    run.count = count;
    run.in = a.in;
    run.hidden = a.out;
    run.out = z.out;
    run.start = a.w;
    run.floats = z.b + z.out - a.w;
    run.w16 = Tensor::empty({run.floats}, DType::bf16, dev, &stream);
  }

  std::vector<MlpLayer> mlp_layers(const FusedMlpRun& run) const {
    std::vector<MlpLayer> v;
    auto* w16 = static_cast<std::uint16_t*>(run.w16.data());
    for (std::size_t i = run.first; i < run.first + run.count; ++i) {
      const LinearSlot& l = linears[i];
      v.push_back({TensorView(w16 + (l.w - run.start), DType::bf16, {l.out, l.in}, dev),
                   TensorView(w16 + (l.b - run.start), DType::bf16, {l.out}, dev),
                   l.relu ? Activation::relu : Activation::identity});
    }
    return v;
  }

  void alloc_fused_mlp(FusedMlpRun& run, bool with_dx) {
    if (!run.on) return;
    const Stream* s = &stream;
    run.x16 = Tensor::empty({cap * run.in}, DType::bf16, dev, s);
    run.y16 = Tensor::empty({cap * run.out}, DType::bf16, dev, s);
    run.dy16 = Tensor::empty({cap * run.out}, DType::bf16, dev, s);
    run.hid16 = Tensor::empty({static_cast<std::int64_t>(run.count - 1) * cap * run.hidden}, DType::bf16, dev, s);
    if (with_dx) run.dx16 = Tensor::empty({cap * run.in}, DType::bf16, dev, s);
  }

  TensorView bf16_view(const Tensor& t, Dims shape) const { return TensorView(t.data(), DType::bf16, shape, dev); }

  // y [B, out] (ld ldy, f32) = the MLP of x [B, in] (ld ldx, f32), in bf16; keeps what backward needs.
  void fused_mlp_run_forward(const FusedMlpRun& run, const float* x, std::int64_t ldx, float* y, std::int64_t ldy,
                             std::int64_t b) {
    auto* w16 = static_cast<std::uint16_t*>(run.w16.data());
    to_bf16_rows(P(run.start), run.floats, w16, 1, run.floats, cs());
    to_bf16_rows(x, ldx, static_cast<std::uint16_t*>(run.x16.data()), b, run.in, cs());
    fused_mlp_forward_train({bf16_view(run.x16, {b, run.in}), mlp_layers(run), bf16_view(run.y16, {b, run.out}),
                             bf16_view(run.hid16, {static_cast<std::int64_t>(run.count - 1), b, run.hidden})},
                            &stream);
    from_bf16_rows(static_cast<const std::uint16_t*>(run.y16.data()), y, ldy, b, run.out, cs());
  }

  // From dy [B, out] (ld lddy, f32): the fp32 dW and db of every layer, and dx (ld lddx) if asked.
  void fused_mlp_run_backward(const FusedMlpRun& run, const float* dy, std::int64_t lddy, float* dx, std::int64_t lddx,
                              std::int64_t b) {
    to_bf16_rows(dy, lddy, static_cast<std::uint16_t*>(run.dy16.data()), b, run.out, cs());
    FusedMlpBackwardArgs a{bf16_view(run.dy16, {b, run.out}), bf16_view(run.x16, {b, run.in}),
                           bf16_view(run.hid16, {static_cast<std::int64_t>(run.count - 1), b, run.hidden}),
                           bf16_view(run.y16, {b, run.out}), mlp_layers(run), std::nullopt, {}, {}};
    if (dx) a.dx = bf16_view(run.dx16, {b, run.in});
    for (std::size_t i = run.first; i < run.first + run.count; ++i) {
      const LinearSlot& l = linears[i];
      a.dweight.emplace_back(G(l.w), DType::f32, Dims{l.out, l.in}, dev);
      a.dbias.emplace_back(G(l.b), DType::f32, Dims{l.out}, dev);
    }
    fused_mlp_backward(a, &stream);
    if (dx) from_bf16_rows(static_cast<const std::uint16_t*>(run.dx16.data()), dx, lddx, b, run.in, cs());
  }

  // ---- buffers ------------------------------------------------------------------------------------
  void ensure_capacity(std::int64_t b, std::int64_t nnz_needed) {
    if (b <= cap && nnz_needed <= cap_nnz) return;
    FK_CUDA_CHECK(cudaStreamSynchronize(cs()));
    FK_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(copy_stream.handle())));
    for (auto& [k, g] : graphs) cudaGraphExecDestroy(g);
    graphs.clear();
    warm.clear();
    cap = std::max(cap, b);
    cap_nnz = std::max({cap_nnz, nnz_needed, cap * static_cast<std::int64_t>(base_host.size())});
    const std::int64_t t = static_cast<std::int64_t>(base_host.size());
    const Stream* s = &stream;
    for (Slot& sl : slots) {
      sl.dense = Tensor::empty({cap, ld_dense}, DType::f32, dev, s);
      // Padding columns stay 0. Zeroed on the copy stream, the one that writes the slot: zeroed on
      // the compute stream, nothing ordered it before the first copy into the slot, and when the
      // compute stream ran late (under compute-sanitizer, behind other models' work) the memset
      // wiped the first batch's dense features.
      FK_CUDA_CHECK(cudaMemsetAsync(sl.dense.data(), 0, sl.dense.nbytes(), static_cast<cudaStream_t>(copy_stream.handle())));
      sl.raw = Tensor::empty({cap * t}, DType::i32, dev, s);
      sl.labels = device_f32(cap, dev, s);
      sl.indices = Tensor::empty({cap_nnz}, DType::i64, dev, s);
      sl.offsets = Tensor::empty({cap * t + 1}, DType::i64, dev, s);
    }
    std::int64_t widest = ldr;
    for (const LinearSlot& l : linears) widest = std::max({widest, l.in, l.out});
    z = device_f32(cap * features * dim, dev, s);
    dz = device_f32(cap * features * dim, dev, s);
    r = device_f32(cap * ldr, dev, s);
    dr = device_f32(cap * ldr, dev, s);
    logits = device_f32(cap, dev, s);
    p = device_f32(cap, dev, s);
    dlogits = device_f32(cap, dev, s);
    ga = device_f32(cap * widest, dev, s);
    gb = device_f32(cap * widest, dev, s);
    std::size_t part = 1;
    for (const LinearSlot& l : linears) part = std::max(part, column_sum_partial_floats(cap, l.out));
    partial = device_f32(static_cast<std::int64_t>(part), dev, s);
    bot_act.clear();
    top_act.clear();
    for (std::size_t i = 0; i < linears.size(); ++i) {
      const bool bottom = i < bottom_layers;
      const bool last = bottom ? i + 1 == bottom_layers : i + 1 == linears.size();
      if (last) continue;
      (bottom ? bot_act : top_act).push_back(device_f32(cap * linears[i].out, dev, s));
    }
    alloc_fused_mlp(bottom_run, false);
    alloc_fused_mlp(top_run, true);
    if (config.interaction == InteractionOp::dot && impl == DlrmImpl::reference) {
      zz = device_f32(cap * features * features, dev, s);
      sym = device_f32(cap * features * features, dev, s);
    }
    keys = Tensor::empty({cap_nnz}, DType::i32, dev, s);
    bags = Tensor::empty({cap_nnz}, DType::i32, dev, s);
    {
      const std::int64_t chunks = sparse_backward_chunks(cap_nnz);
      ws_keys = Tensor::empty({cap_nnz}, DType::i32, dev, s);
      ws_bags = Tensor::empty({cap_nnz}, DType::i32, dev, s);
      ws_temp = Tensor::empty({static_cast<std::int64_t>(sparse_backward_sort_bytes(cap_nnz))}, DType::u8, dev, s);
      ws_head = device_f32(chunks * dim, dev, s);
      ws_tail = device_f32(chunks * dim, dev, s);
      ws_ends = Tensor::empty({chunks}, DType::u8, dev, s);
      ws_owners = Tensor::empty({chunks + 1}, DType::i32, dev, s);
      ws = {ws_keys.data_as<std::uint32_t>(), ws_bags.data_as<std::uint32_t>(), ws_temp.data(), ws_temp.nbytes(),
            ws_head.data_as<float>(),         ws_tail.data_as<float>(),       ws_ends.data_as<std::uint8_t>(),
            ws_owners.data_as<int>()};
    }
  }

  // Checks the input, copies it into slot `si` (on the copy stream, after the slot's last step)
  // and makes the compute stream wait for the copy. Returns after the copy (the caller's host
  // buffers are then free).
  void stage(int si, const DlrmInput& in, const TensorView* labels) {
    const std::int64_t t = static_cast<std::int64_t>(base_host.size());
    const std::int64_t n_in = config.bottom_mlp.front();
    FK_CHECK_ARG(in.dense.dtype() == DType::f32 && in.dense.rank() == 2 && in.dense.size(1) == n_in &&
                     in.dense.is_contiguous(),
                 kOp, "dense", fmt::format("f32 [B, {}], contiguous", n_in), in.dense.str());
    const std::int64_t b = in.dense.size(0);
    FK_CHECK_ARG(b >= 1, kOp, "dense", "a batch of at least one sample", in.dense.str());
    if (labels)
      FK_CHECK_ARG(labels->dtype() == DType::f32 && labels->numel() == b && labels->is_contiguous(), kOp, "labels",
                   fmt::format("f32 with {} elements", b), labels->str());
    const bool raw = impl == DlrmImpl::fused && in.raw_sparse.data() != nullptr;
    std::int64_t nnz = t * b;
    if (raw) {
      FK_CHECK_ARG(in.raw_sparse.dtype() == DType::i32 && in.raw_sparse.numel() == t * b && in.raw_sparse.is_contiguous(),
                   kOp, "raw_sparse", fmt::format("i32 [{}] (tables * batch)", t * b), in.raw_sparse.str());
    } else {
      FK_CHECK_ARG(in.offsets.dtype() == DType::i64 && in.offsets.numel() == t * b + 1 && in.offsets.is_contiguous() &&
                       in.offsets.device().is_cpu(),
                   kOp, "offsets", fmt::format("host i64 [{}] (tables * batch + 1)", t * b + 1), in.offsets.str());
      FK_CHECK_ARG(in.indices.dtype() == DType::i64 && in.indices.rank() == 1 && in.indices.is_contiguous() &&
                       in.indices.device().is_cpu(),
                   kOp, "indices", "host i64 [nnz]", in.indices.str());
      const std::int64_t* off = in.offsets.data_as<std::int64_t>();
      const std::int64_t* idx = in.indices.data_as<std::int64_t>();
      nnz = in.indices.numel();
      FK_CHECK_ARG(off[0] == 0 && off[t * b] == nnz, kOp, "offsets", fmt::format("0 first and {} (nnz) last", nnz),
                   fmt::format("{} first and {} last", off[0], off[t * b]));
      for (std::int64_t q = 0; q < t * b; ++q) {
        FK_CHECK_ARG(off[q] <= off[q + 1], kOp, "offsets", "non-decreasing offsets",
                     fmt::format("offsets[{}] = {} > offsets[{}] = {}", q, off[q], q + 1, off[q + 1]));
        const std::int64_t rows = rows_host[static_cast<std::size_t>(q / b)];
        for (std::int64_t k = off[q]; k < off[q + 1]; ++k)
          FK_CHECK_ARG(idx[k] >= 0 && idx[k] < rows, kOp, "indices",
                       fmt::format("rows of table {} in [0, {})", q / b, rows), fmt::format("{} at position {}", idx[k], k));
      }
    }
    ensure_capacity(b, nnz);
    Slot& sl = slots[static_cast<std::size_t>(si)];
    const cudaStream_t copy = static_cast<cudaStream_t>(copy_stream.handle());
    if (sl.free) FK_CUDA_CHECK(cudaStreamWaitEvent(copy, sl.free, 0));
    auto put = [&](const Tensor& dst, const TensorView& src) {
      FK_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), src.nbytes(), cudaMemcpyDefault, copy));
    };
    FK_CUDA_CHECK(cudaMemcpy2DAsync(sl.dense.data(), static_cast<std::size_t>(ld_dense) * 4, in.dense.data(),
                                    static_cast<std::size_t>(n_in) * 4, static_cast<std::size_t>(n_in) * 4,
                                    static_cast<std::size_t>(b), cudaMemcpyDefault, copy));
    if (labels) put(sl.labels, *labels);
    if (raw) {
      put(sl.raw, in.raw_sparse);
    } else {
      put(sl.indices, in.indices);
      put(sl.offsets, in.offsets);
    }
    FK_CUDA_CHECK(cudaEventRecord(sl.copied, copy));
    FK_CUDA_CHECK(cudaStreamWaitEvent(cs(), sl.copied, 0));
    FK_CUDA_CHECK(cudaEventSynchronize(sl.copied));
    batch = b;
    this->nnz = nnz;
    slot = si;
    use_raw = raw;
  }

  // ---- the step's phases ----------------------------------------------------------------------------
  void forward_body() {
    const Slot& sl = slots[static_cast<std::size_t>(slot)];
    const std::int64_t b = batch, fd = features * dim;
    const std::int64_t t = static_cast<std::int64_t>(base_host.size());
    mark("bottom_mlp.fwd");
    refresh_shadows();
    const float* x = sl.dense.data_as<float>();
    std::int64_t ldx = ld_dense;
    if (bottom_run.on) fused_mlp_run_forward(bottom_run, x, ldx, z.data_as<float>(), fd, b);
    for (std::size_t i = 0; i < bottom_layers && !bottom_run.on; ++i) {
      const bool last = i + 1 == bottom_layers;
      float* y = last ? z.data_as<float>() : bot_act[i].data_as<float>();
      const std::int64_t ldy = last ? fd : linears[i].out;
      linear_forward(i, x, ldx, y, ldy, b);
      x = y;
      ldx = ldy;
    }
    mark("embeddings.fwd");
    if (impl == DlrmImpl::fused) {
      embedding_forward_fused(table_set(), use_raw ? sl.raw.data_as<std::uint32_t>() : nullptr,
                              config.raw_hash == fk::models::RawHash::seed ? RowHash::seed : RowHash::reference,
                              sl.indices.data_as<std::int64_t>(), sl.offsets.data_as<std::int64_t>(), b,
                              z.data_as<float>() + dim, fd, /*mean=*/false, keys.data_as<std::uint32_t>(),
                              bags.data_as<std::uint32_t>(), cs());
    } else {
      for (int ti = 0; ti < t; ++ti)
        embedding_forward_table(table(ti), static_cast<int>(dim), ti, sl.indices.data_as<std::int64_t>(),
                                sl.offsets.data_as<std::int64_t>(), b, z.data_as<float>() + dim, fd,
                                /*mean=*/false, cs());
    }
    mark("interaction.fwd");
    switch (config.interaction) {
      case InteractionOp::dot:
        if (impl == DlrmImpl::fused) {
          interaction_dot_forward(z.data_as<float>(), pairs.data_as<std::uint32_t>(), num_pairs,
                                  static_cast<int>(features), static_cast<int>(dim), b, r.data_as<float>(), ldr, cs());
        } else {
          {  // zz[b] = Z[b] Z[b]ᵀ
            const TensorView zb = mats(z.data_as<float>(), b, fd, features, dim, dim);
            GemmParams p;
            p.trans_b = Trans::t;
            gemm({zb, zb, mats(zz.data_as<float>(), b, features * features, features, features, features)}, p, &stream);
          }
          interaction_gather(z.data_as<float>(), zz.data_as<float>(), pairs.data_as<std::uint32_t>(), num_pairs,
                             static_cast<int>(features), static_cast<int>(dim), b, r.data_as<float>(), ldr, cs());
        }
        break;
      case InteractionOp::cat:
        FK_CUDA_CHECK(cudaMemcpyAsync(r.data(), z.data(), static_cast<std::size_t>(b * fd) * 4,
                                      cudaMemcpyDeviceToDevice, cs()));
        break;
      case InteractionOp::outer:
        interaction_outer_forward(z.data_as<float>(), fd, b, r.data_as<float>(), cs());
        break;
    }
    mark("top_mlp.fwd");
    x = r.data_as<float>();
    ldx = ldr;
    if (top_run.on) fused_mlp_run_forward(top_run, x, ldx, logits.data_as<float>(), 1, b);
    for (std::size_t i = bottom_layers; i < linears.size() && !top_run.on; ++i) {
      const bool last = i + 1 == linears.size();
      float* y = last ? logits.data_as<float>() : top_act[i - bottom_layers].data_as<float>();
      linear_forward(i, x, ldx, y, linears[i].out, b);
      x = y;
      ldx = linears[i].out;
    }
  }

  void loss_body() {
    mark("bce_loss");
    const Slot& sl = slots[static_cast<std::size_t>(slot)];
    if (impl == DlrmImpl::fused)
      sigmoid_bce_fused(logits.data_as<float>(), sl.labels.data_as<float>(), batch, dlogits.data_as<float>(),
                        loss_acc.data_as<double>(), cs());
    else
      sigmoid_bce_reference(logits.data_as<float>(), sl.labels.data_as<float>(), batch, p.data_as<float>(),
                            dlogits.data_as<float>(), loss_acc.data_as<double>(), cs());
  }

  void backward_body() {
    const Slot& sl = slots[static_cast<std::size_t>(slot)];
    const std::int64_t b = batch, fd = features * dim;
    mark("top_mlp.bwd");
    // Top MLP, last layer first; dy ping-pongs between ga and gb.
    float* dy = dlogits.data_as<float>();
    std::int64_t lddy = 1;
    float* spare[2] = {ga.data_as<float>(), gb.data_as<float>()};
    int which = 0;
    if (top_run.on) fused_mlp_run_backward(top_run, dy, 1, dr.data_as<float>(), ldr, b);
    for (std::size_t i = linears.size(); i-- > bottom_layers && !top_run.on;) {
      const std::size_t k = i - bottom_layers;
      const float* x = k == 0 ? r.data_as<float>() : top_act[k - 1].data_as<float>();
      const std::int64_t ldx = linears[i].in_ld;
      const float* y = i + 1 == linears.size() ? logits.data_as<float>() : top_act[k].data_as<float>();
      float* dx = k == 0 ? dr.data_as<float>() : spare[which];
      linear_backward(i, x, ldx, y, linears[i].out, dy, lddy, dx, linears[i].in_ld, b);
      dy = dx;
      lddy = linears[i].in_ld;
      which ^= 1;
    }
    mark("interaction.bwd");
    switch (config.interaction) {
      case InteractionOp::dot:
        if (impl == DlrmImpl::fused) {
          interaction_dot_backward(z.data_as<float>(), dr.data_as<float>(), ldr, pairs.data_as<std::uint32_t>(),
                                   num_pairs, static_cast<int>(features), static_cast<int>(dim), b,
                                   dz.data_as<float>(), /*relu_x=*/true, cs());
        } else {
          interaction_scatter(dr.data_as<float>(), ldr, pairs.data_as<std::uint32_t>(), num_pairs,
                              static_cast<int>(features), static_cast<int>(dim), b, sym.data_as<float>(), cs());
          // dZ[b] = S[b] Z[b]
          gemm({mats(sym.data_as<float>(), b, features * features, features, features, features),
                mats(z.data_as<float>(), b, fd, features, dim, dim), mats(dz.data_as<float>(), b, fd, features, dim, dim)},
               {}, &stream);
          add_dense_grad(dr.data_as<float>(), static_cast<int>(ldr), static_cast<int>(dim), static_cast<int>(fd), b,
                         dz.data_as<float>(), cs());
        }
        break;
      case InteractionOp::cat:
        FK_CUDA_CHECK(cudaMemcpyAsync(dz.data(), dr.data(), static_cast<std::size_t>(b * fd) * 4,
                                      cudaMemcpyDeviceToDevice, cs()));
        break;
      case InteractionOp::outer:
        // dc = G c + Gᵀ c per sample (G = dR[b] as [n, n] row-major).
        {
          const TensorView g = mats(dr.data_as<float>(), b, fd * fd, fd, fd, fd);
          const TensorView c = mats(z.data_as<float>(), b, fd, fd, 1, 1), dc = mats(dz.data_as<float>(), b, fd, fd, 1, 1);
          gemm({g, c, dc}, {}, &stream);  // G c
          GemmParams p;
          p.trans_a = Trans::t;
          p.beta = 1.0f;
          gemm({g, c, dc}, p, &stream);  // + Gᵀ c
        }
        break;
    }
    if (impl == DlrmImpl::reference) {
      mark("embeddings.bwd");
      // Dense gradients of every table: zeroed, then each touched row's summed gradient stored
      // (sort-based like PyTorch's embedding backward, so the run is deterministic).
      FK_CUDA_CHECK(cudaMemsetAsync(dense_grad.data(), 0, dense_grad.nbytes(), cs()));
      TableSet gs = table_set();
      gs.weights = dense_grad.data_as<float>();
      gs.store_gradient = true;
      embedding_keys(gs, sl.indices.data_as<std::int64_t>(), sl.offsets.data_as<std::int64_t>(), b,
                     keys.data_as<std::uint32_t>(), bags.data_as<std::uint32_t>(), cs());
      embedding_backward_fused(gs, key_bits, keys.data_as<std::uint32_t>(), bags.data_as<std::uint32_t>(), nnz, b,
                               dz.data_as<float>() + dim, fd, nullptr, 0.0f, 0.0f, ws, cs());
    }
    // Bottom MLP: its output's gradient is dZ[:, 0].
    mark("bottom_mlp.bwd");
    // (The fused dot backward has already applied the last bottom ReLU's derivative.)
    const bool masked = impl == DlrmImpl::fused && config.interaction == InteractionOp::dot;
    dy = dz.data_as<float>();
    lddy = fd;
    if (bottom_run.on) fused_mlp_run_backward(bottom_run, dy, lddy, nullptr, 0, b);
    for (std::size_t i = bottom_layers; i-- > 0 && !bottom_run.on;) {
      const float* x = i == 0 ? sl.dense.data_as<float>() : bot_act[i - 1].data_as<float>();
      const std::int64_t ldx = linears[i].in_ld;
      const bool last = i + 1 == bottom_layers;
      const float* y = last ? z.data_as<float>() : bot_act[i].data_as<float>();
      const std::int64_t ldy = last ? fd : linears[i].out;
      float* dx = i == 0 ? nullptr : spare[which];
      linear_backward(i, x, ldx, y, ldy, dy, lddy, dx, linears[i].in_ld, b, masked && last);
      dy = dx;
      lddy = linears[i].in_ld;
      which ^= 1;
    }
  }

  void ensure_optimizer_state(const OptimizerConfig& opt) {
    if (opt.kind != OptimizerKind::adagrad || adagrad.data() != nullptr) return;
    // A uniform fill over [a, a] writes a exactly.
    adagrad = device_f32(param_floats, dev, &stream);
    fill_uniform(adagrad, opt.initial_accumulator, opt.initial_accumulator, {}, &stream);
    table_state = device_f32(total_rows * dim, dev, &stream);
    fill_uniform(table_state, opt.initial_accumulator, opt.initial_accumulator, {}, &stream);
  }

  void step_body(const OptimizerConfig& opt) {
    const bool ada = opt.kind == OptimizerKind::adagrad;
    const std::int64_t t = static_cast<std::int64_t>(base_host.size());
    TableSet ts = table_set();
    ts.adagrad_state = ada ? table_state.data_as<float>() : nullptr;
    mark("optimizer.embeddings");
    if (impl == DlrmImpl::fused) {
      embedding_backward_fused(ts, key_bits, keys.data_as<std::uint32_t>(), bags.data_as<std::uint32_t>(), nnz, batch,
                               dz.data_as<float>() + dim, features * dim, nullptr, opt.learning_rate, opt.eps, ws,
                               cs());
      mark("optimizer.mlp");
      optimizer_update(params.data_as<float>(), grads.data_as<float>(), ada ? adagrad.data_as<float>() : nullptr,
                       param_floats, opt.learning_rate, opt.eps, cs());
      return;
    }
    for (int ti = 0; ti < t; ++ti) {
      const std::int64_t at = base_host[ti] * dim;
      optimizer_update(table(ti), dense_grad.data_as<float>() + at, ada ? table_state.data_as<float>() + at : nullptr,
                       rows_host[ti] * dim, opt.learning_rate, opt.eps, cs());
    }
    mark("optimizer.mlp");
    for (const LinearSlot& l : linears) {
      optimizer_update(P(l.w), G(l.w), ada ? adagrad.data_as<float>() + l.w : nullptr, l.in * l.out,
                       opt.learning_rate, opt.eps, cs());
      optimizer_update(P(l.b), G(l.b), ada ? adagrad.data_as<float>() + l.b : nullptr, l.out, opt.learning_rate,
                       opt.eps, cs());
    }
  }

  void finish_step() {
    FK_CUDA_CHECK(cudaEventRecord(slots[static_cast<std::size_t>(slot)].free, cs()));
    ++steps;
    flush_trace();
  }
};

GpuDlrm::GpuDlrm(const DlrmConfig& config, DlrmImpl impl, int device) {
  const fk::detail::DeviceScope on(device);
  s_ = std::make_unique<State>(config, impl, device);
  State& s = *s_;
  const Stream* st = &s.stream;
  s.features = config.num_features();
  s.dim = config.embedding_dim;
  s.inter = config.interaction_size();
  const auto pad4 = [](std::int64_t n) { return (n + 3) / 4 * 4; };
  s.ldr = pad4(s.inter);
  s.ld_dense = pad4(config.bottom_mlp.front());
  for (auto& sl : s.slots) {
    FK_CUDA_CHECK(cudaEventCreateWithFlags(&sl.copied, cudaEventDisableTiming));
    FK_CUDA_CHECK(cudaEventCreateWithFlags(&sl.free, cudaEventDisableTiming));
  }

  // MLP parameters, initialised on the host exactly as the CPU model does, then copied.
  std::vector<std::int64_t> top{s.inter};
  top.insert(top.end(), config.top_mlp.begin(), config.top_mlp.end());
  std::vector<cpu::Linear> host;
  for (std::size_t l = 0; l + 1 < config.bottom_mlp.size(); ++l)
    host.emplace_back(config.bottom_mlp[l], config.bottom_mlp[l + 1], true, config.seed, l);
  s.bottom_layers = host.size();
  for (std::size_t l = 0; l + 1 < top.size(); ++l)
    host.emplace_back(top[l], top[l + 1], l + 2 < top.size(), config.seed, 1000 + l);
  std::int64_t shadow_floats = 0;
  for (std::size_t i = 0; i < host.size(); ++i) {
    const cpu::Linear& l = host[i];
    LinearSlot slot{l.in(), l.out(), l.relu(), s.param_floats, 0};
    s.param_floats += align_up(l.in() * l.out());
    slot.b = s.param_floats;
    s.param_floats += align_up(l.out());
    slot.in_ld = i == 0 ? s.ld_dense : i == s.bottom_layers ? s.ldr : l.in();
    if (slot.padded()) {
      slot.shadow_w = shadow_floats;
      shadow_floats += align_up(slot.in_ld * slot.out);
      slot.shadow_dw = shadow_floats;
      shadow_floats += align_up(slot.in_ld * slot.out);
    }
    s.linears.push_back(slot);
  }
  s.shadow = device_f32(shadow_floats, s.dev, st);
  FK_CHECK_ARG(!config.fused_mlp || impl == DlrmImpl::fused, kOp, "config.fused_mlp", "impl fused",
               std::string(impl_name(impl)));
  s.plan_fused_mlp(s.bottom_run, 0, s.bottom_layers);
  s.plan_fused_mlp(s.top_run, s.bottom_layers, s.linears.size() - s.bottom_layers);
  FK_CUDA_CHECK(cudaMemsetAsync(s.shadow.data(), 0, s.shadow.nbytes(), s.cs()));  // padding columns stay 0
  s.params = device_f32(s.param_floats, s.dev, st);
  s.grads = device_f32(s.param_floats, s.dev, st);
  FK_CUDA_CHECK(cudaMemsetAsync(s.params.data(), 0, s.params.nbytes(), s.cs()));
  FK_CUDA_CHECK(cudaMemsetAsync(s.grads.data(), 0, s.grads.nbytes(), s.cs()));
  for (std::size_t i = 0; i < host.size(); ++i) {
    const LinearSlot& l = s.linears[i];
    FK_CUDA_CHECK(cudaMemcpyAsync(s.P(l.w), host[i].weight.data(), host[i].weight.nbytes(), cudaMemcpyHostToDevice, s.cs()));
    FK_CUDA_CHECK(cudaMemcpyAsync(s.P(l.b), host[i].bias.data(), host[i].bias.nbytes(), cudaMemcpyHostToDevice, s.cs()));
    s.param_views.push_back(view_of(s.P(l.w), {l.out, l.in}, s.dev));
    s.param_views.push_back(view_of(s.P(l.b), {l.out}, s.dev));
    s.param_views.push_back(view_of(s.G(l.w), {l.out, l.in}, s.dev));
    s.param_views.push_back(view_of(s.G(l.b), {l.out}, s.dev));
  }
  FK_CUDA_CHECK(cudaStreamSynchronize(s.cs()));  // `host` is freed on return

  // Tables: one buffer; table t from the same Philox stream as the CPU model (bit-identical).
  for (std::int64_t rows : config.table_rows) {
    s.base_host.push_back(s.total_rows);
    s.rows_host.push_back(rows);
    s.total_rows += rows;
  }
  FK_CHECK_ARG(s.total_rows < (std::int64_t{1} << 32), kOp, "table_rows", "fewer than 2^32 rows in all (GPU)",
               fmt::format("{}", s.total_rows));
  while ((std::int64_t{1} << s.key_bits) < s.total_rows) ++s.key_bits;
  s.table_buf = device_f32(s.total_rows * s.dim, s.dev, st);
  for (std::size_t t = 0; t < s.base_host.size(); ++t) {
    const std::int64_t rows = s.rows_host[t];
    s.table_views.push_back(view_of(s.table(static_cast<int>(t)), {rows, s.dim}, s.dev));
    const float bound = static_cast<float>(std::sqrt(1.0 / static_cast<double>(rows)));
    fill_uniform(s.table_views.back(), -bound, bound, {config.seed, (std::uint64_t{1} << 40) + t}, st);
  }
  s.table_base = Tensor::empty({std::max<std::int64_t>(1, static_cast<std::int64_t>(s.base_host.size()))}, DType::i64, s.dev, st);
  s.table_rows = Tensor::empty({std::max<std::int64_t>(1, static_cast<std::int64_t>(s.rows_host.size()))}, DType::i64, s.dev, st);
  if (!s.base_host.empty()) {
    FK_CUDA_CHECK(cudaMemcpyAsync(s.table_base.data(), s.base_host.data(), s.base_host.size() * 8, cudaMemcpyHostToDevice, s.cs()));
    FK_CUDA_CHECK(cudaMemcpyAsync(s.table_rows.data(), s.rows_host.data(), s.rows_host.size() * 8, cudaMemcpyHostToDevice, s.cs()));
  }
  if (impl == DlrmImpl::reference) s.dense_grad = device_f32(s.total_rows * s.dim, s.dev, st);

  // The dot interaction's pairs, in the CPU layer's order.
  std::vector<std::uint32_t> pairs;
  for (std::uint32_t i = 0; i < static_cast<std::uint32_t>(s.features); ++i)
    for (std::uint32_t j = 0; j < i + (config.interaction_itself ? 1u : 0u); ++j) pairs.push_back(i << 16 | j);
  s.num_pairs = static_cast<int>(pairs.size());
  s.pairs = Tensor::empty({std::max<std::int64_t>(1, static_cast<std::int64_t>(pairs.size()))}, DType::i32, s.dev, st);
  if (!pairs.empty())
    FK_CUDA_CHECK(cudaMemcpyAsync(s.pairs.data(), pairs.data(), pairs.size() * 4, cudaMemcpyHostToDevice, s.cs()));
  s.loss_acc = Tensor::empty({kLossAccDoubles * 8}, DType::u8, s.dev, st);  // loss sum, steps, partials
  FK_CUDA_CHECK(cudaMemsetAsync(s.loss_acc.data(), 0, s.loss_acc.nbytes(), s.cs()));
  FK_CUDA_CHECK(cudaStreamSynchronize(s.cs()));
}

GpuDlrm::~GpuDlrm() = default;

void GpuDlrm::forward(const DlrmInput& input, const TensorView& logits) {
  State& s = *s_;
  const fk::detail::DeviceScope on(s.dev.index);
  s.stage(static_cast<int>(s.steps % 2), input, nullptr);
  FK_CHECK_ARG(logits.dtype() == DType::f32 && logits.numel() == s.batch && logits.is_contiguous(), kOp, "logits",
               fmt::format("f32 with {} elements", s.batch), logits.str());
  s.forward_body();
  FK_CUDA_CHECK(cudaMemcpyAsync(logits.data(), s.logits.data(), static_cast<std::size_t>(s.batch) * 4, cudaMemcpyDefault, s.cs()));
  FK_CUDA_CHECK(cudaStreamSynchronize(s.cs()));
}

void GpuDlrm::backward(const TensorView& dlogits) {
  State& s = *s_;
  const fk::detail::DeviceScope on(s.dev.index);
  FK_CHECK_ARG(s.batch > 0, kOp, "backward", "a forward() first", "none");
  FK_CHECK_ARG(dlogits.dtype() == DType::f32 && dlogits.numel() == s.batch && dlogits.is_contiguous(), kOp, "dlogits",
               fmt::format("f32 with {} elements", s.batch), dlogits.str());
  FK_CUDA_CHECK(cudaMemcpyAsync(s.dlogits.data(), dlogits.data(), static_cast<std::size_t>(s.batch) * 4, cudaMemcpyDefault, s.cs()));
  s.backward_body();
  FK_CUDA_CHECK(cudaStreamSynchronize(s.cs()));
}

void GpuDlrm::step(const OptimizerConfig& opt) {
  State& s = *s_;
  const fk::detail::DeviceScope on(s.dev.index);
  FK_CHECK_ARG(s.batch > 0, kOp, "step", "a forward() and backward() first", "none");
  s.ensure_optimizer_state(opt);
  s.step_body(opt);
  s.finish_step();
  FK_CUDA_CHECK(cudaStreamSynchronize(s.cs()));
}

void GpuDlrm::enqueue_train_step(const DlrmInput& input, const TensorView& labels, const OptimizerConfig& opt) {
  State& s = *s_;
  const fk::detail::DeviceScope on(s.dev.index);
  const int si = static_cast<int>(s.steps % 2);
  s.stage(si, input, &labels);
  s.ensure_optimizer_state(opt);
  auto body = [&] {
    s.forward_body();
    s.loss_body();
    s.backward_body();
    s.step_body(opt);
  };
  // The fused step with one-hot raw input has fixed sizes for a given batch: after one eager
  // step at that size (which also picks the GEMMs' algorithms), capture it once per slot and replay.
  const bool graphable = s.impl == DlrmImpl::fused && s.use_raw && s.config.cuda_graph && s.trace == nullptr;
  if (!graphable || !s.warm[s.batch]) {
    body();
    s.warm[s.batch] = true;
  } else {
    const auto key = std::make_tuple(si, s.batch, static_cast<int>(opt.kind), opt.learning_rate, opt.eps);
    auto it = s.graphs.find(key);
    if (it == s.graphs.end()) {
      cudaGraph_t graph = nullptr;
      FK_CUDA_CHECK(cudaStreamBeginCapture(s.cs(), cudaStreamCaptureModeThreadLocal));
      try {
        body();
      } catch (...) {
        cudaStreamEndCapture(s.cs(), &graph);
        if (graph) cudaGraphDestroy(graph);
        throw;
      }
      FK_CUDA_CHECK(cudaStreamEndCapture(s.cs(), &graph));
      cudaGraphExec_t exec = nullptr;
      const cudaError_t e = cudaGraphInstantiate(&exec, graph, 0);
      cudaGraphDestroy(graph);
      FK_CUDA_CHECK(e);
      it = s.graphs.emplace(key, exec).first;
    }
    FK_CUDA_CHECK(cudaGraphLaunch(it->second, s.cs()));
  }
  s.finish_step();
}

double GpuDlrm::drain_loss() {
  State& s = *s_;
  const fk::detail::DeviceScope on(s.dev.index);
  double acc[2] = {0, 0};
  FK_CUDA_CHECK(cudaMemcpyAsync(acc, s.loss_acc.data(), 16, cudaMemcpyDeviceToHost, s.cs()));
  FK_CUDA_CHECK(cudaMemsetAsync(s.loss_acc.data(), 0, 16, s.cs()));
  FK_CUDA_CHECK(cudaStreamSynchronize(s.cs()));
  return acc[1] > 0 ? acc[0] / acc[1] : 0.0;
}

void GpuDlrm::predict(const DlrmInput& input, const TensorView& probabilities) {
  State& s = *s_;
  const fk::detail::DeviceScope on(s.dev.index);
  s.stage(static_cast<int>(s.steps % 2), input, nullptr);
  FK_CHECK_ARG(probabilities.dtype() == DType::f32 && probabilities.numel() == s.batch && probabilities.is_contiguous(),
               kOp, "probabilities", fmt::format("f32 with {} elements", s.batch), probabilities.str());
  s.forward_body();
  s.marks.clear();  // evaluation is not traced
  sigmoid(s.logits.data_as<float>(), s.p.data_as<float>(), s.batch, s.cs());
  FK_CUDA_CHECK(cudaMemcpyAsync(probabilities.data(), s.p.data(), static_cast<std::size_t>(s.batch) * 4,
                                cudaMemcpyDefault, s.cs()));
  FK_CUDA_CHECK(cudaEventRecord(s.slots[static_cast<std::size_t>(s.slot)].free, s.cs()));
  FK_CUDA_CHECK(cudaStreamSynchronize(s.cs()));
}

std::vector<Dlrm::LinearParams> GpuDlrm::linear_layers() {
  std::vector<Dlrm::LinearParams> v;
  for (std::size_t i = 0; i < s_->linears.size(); ++i) {
    Tensor* p = &s_->param_views[4 * i];
    v.push_back({p, p + 1, p + 2, p + 3});
  }
  return v;
}

std::vector<Tensor*> GpuDlrm::tables() {
  std::vector<Tensor*> v;
  for (Tensor& t : s_->table_views) v.push_back(&t);
  return v;
}

namespace {

// The GPU state in the order of the CPU model's state_arrays (dlrm.cpp): the stream is the same.
std::vector<fk::models::detail::StateArray> gpu_state_arrays(float* params, float* adagrad, float* tables,
                                                             float* table_state,
                                                             const std::vector<LinearSlot>& linears,
                                                             const std::vector<std::int64_t>& base,
                                                             const std::vector<std::int64_t>& rows, std::int64_t dim) {
  std::vector<fk::models::detail::StateArray> v;
  for (const LinearSlot& l : linears) {
    v.push_back({params + l.w, l.in * l.out, true});
    v.push_back({params + l.b, l.out, true});
  }
  for (std::size_t t = 0; t < base.size(); ++t) v.push_back({tables + base[t] * dim, rows[t] * dim, true});
  if (adagrad) {
    for (const LinearSlot& l : linears) {
      v.push_back({adagrad + l.w, l.in * l.out, true});
      v.push_back({adagrad + l.b, l.out, true});
    }
    for (std::size_t t = 0; t < base.size(); ++t) v.push_back({table_state + base[t] * dim, rows[t] * dim, true});
  }
  return v;
}

}  // namespace

void GpuDlrm::save_state(std::ostream& out) const {
  State& s = *s_;
  const fk::detail::DeviceScope on(s.dev.index);
  FK_CUDA_CHECK(cudaStreamSynchronize(s.cs()));
  const bool ada = s.adagrad.data() != nullptr;
  fk::models::detail::write_state(
      out, ada,
      gpu_state_arrays(s.params.data_as<float>(), ada ? s.adagrad.data_as<float>() : nullptr,
                       s.table_buf.data_as<float>(), ada ? s.table_state.data_as<float>() : nullptr, s.linears,
                       s.base_host, s.rows_host, s.dim));
}

void GpuDlrm::load_state(std::istream& in) {
  State& s = *s_;
  const fk::detail::DeviceScope on(s.dev.index);
  FK_CUDA_CHECK(cudaStreamSynchronize(s.cs()));
  std::uint64_t count = 0;
  const bool ada = fk::models::detail::read_state_header(in, count);
  if (ada) {
    s.ensure_optimizer_state({OptimizerKind::adagrad});
    FK_CUDA_CHECK(cudaStreamSynchronize(s.cs()));
  } else {
    s.adagrad = Tensor();
    s.table_state = Tensor();
  }
  fk::models::detail::read_state_arrays(
      in, count,
      gpu_state_arrays(s.params.data_as<float>(), ada ? s.adagrad.data_as<float>() : nullptr,
                       s.table_buf.data_as<float>(), ada ? s.table_state.data_as<float>() : nullptr, s.linears,
                       s.base_host, s.rows_host, s.dim));
}

void GpuDlrm::set_trace(TraceRecorder* trace) noexcept { s_->trace = trace; }

std::size_t GpuDlrm::peak_device_bytes() const { return allocator::stats(s_->dev).peak_allocated_bytes; }

}  // namespace fk::models::gpu
