// The primitives' bindings: broadcast binary ops (forward and backward), 2-D convolution, batched
// matmul, softmax, the long row sum, and attention forward and backward (dense and varlen).
#include <nanobind/stl/string.h>

#include <string>

#include "bindings.hpp"
#include "fusekit/ops/attention.hpp"
#include "fusekit/ops/primitives.hpp"

namespace fk::py {

using namespace nb::literals;

namespace {

BinaryOp parse_binary_op(const std::string& s, const char* op) {
  for (const BinaryOp b : {BinaryOp::add, BinaryOp::mul, BinaryOp::mul_relu})
    if (s == binary_op_name(b)) return b;
  throw Error(op, "op", "add, mul or mul_relu", s);
}

Conv2dPadding parse_padding(const std::string& s) {
  for (const Conv2dPadding p : {Conv2dPadding::valid, Conv2dPadding::same, Conv2dPadding::same_end})
    if (s == conv2d_padding_name(p)) return p;
  throw Error("conv2d", "padding", "valid, same or same_end", s);
}

}  // namespace

void bind_primitives(nb::module_& m) {
  m.def(
      "broadcast_binary",
      [](const std::string& op, const Array& x, const Array& y, const Array& z, std::uintptr_t stream) {
        constexpr const char* name = "broadcast_binary";
        const TensorView xv = view(x, name, "x");
        broadcast_binary(parse_binary_op(op, name), xv, view(y, name, "y"), view(z, name, "z"),
                         StreamArg(stream, xv).get());
      },
      "op"_a, "x"_a, "y"_a, "z"_a, "stream"_a, kNoGil);
  m.def(
      "broadcast_binary_backward",
      [](const std::string& op, const Array& x, const Array& y, const Array& dz, const OptArray& dx,
         const OptArray& dy, std::uintptr_t stream) {
        constexpr const char* name = "broadcast_binary_backward";
        const TensorView xv = view(x, name, "x");
        broadcast_binary_backward(parse_binary_op(op, name), xv, view(y, name, "y"), view(dz, name, "dz"),
                                  view(dx, name, "dx"), view(dy, name, "dy"), StreamArg(stream, xv).get());
      },
      "op"_a, "x"_a, "y"_a, "dz"_a, "dx"_a.none(), "dy"_a.none(), "stream"_a, kNoGil);
  m.def(
      "conv2d",
      [](const Array& x, const Array& w, const Array& y, const std::string& padding, std::uintptr_t stream) {
        const TensorView xv = view(x, "conv2d", "x");
        conv2d(xv, view(w, "conv2d", "w"), view(y, "conv2d", "y"), parse_padding(padding),
               StreamArg(stream, xv).get());
      },
      "x"_a, "w"_a, "y"_a, "padding"_a, "stream"_a, kNoGil);
  m.def(
      "batched_matmul",
      [](const Array& a, const Array& b, const Array& c, const std::string& impl, std::uintptr_t stream) {
        constexpr const char* name = "batched_matmul";
        const TensorView av = view(a, name, "a");
        BatchedMatmulImpl i = BatchedMatmulImpl::cublas;
        if (impl == "cute") i = BatchedMatmulImpl::cute;
        else if (impl != "cublas") throw Error(name, "impl", "cublas or cute", impl);
        batched_matmul(av, view(b, name, "b"), view(c, name, "c"), i, StreamArg(stream, av).get());
      },
      "a"_a, "b"_a, "c"_a, "impl"_a, "stream"_a, kNoGil);
  m.def(
      "softmax",
      [](const Array& x, const Array& y, std::uintptr_t stream) {
        const TensorView xv = view(x, "softmax", "x");
        softmax(xv, view(y, "softmax", "y"), StreamArg(stream, xv).get());
      },
      "x"_a, "y"_a, "stream"_a, kNoGil);
  m.def(
      "row_sum",
      [](const Array& x, const Array& out, std::uintptr_t stream) {
        const TensorView xv = view(x, "row_sum", "x");
        row_sum(xv, view(out, "row_sum", "out"), StreamArg(stream, xv).get());
      },
      "x"_a, "out"_a, "stream"_a, kNoGil);
  m.def(
      "attention_forward",
      [](const Array& q, const Array& k, const Array& v, const Array& out, const Array& lse, bool causal,
         bool bottom_right, std::int64_t window_left, std::int64_t window_right, float scale, float softcap,
         std::uintptr_t stream) {
        constexpr const char* op = "attention_forward";
        const TensorView qv = view(q, op, "q");
        attention_forward(qv, view(k, op, "k"), view(v, op, "v"), view(out, op, "out"), view(lse, op, "lse"),
                          AttentionOptions{causal, bottom_right, window_left, window_right, scale, softcap},
                          StreamArg(stream, qv).get());
      },
      "q"_a, "k"_a, "v"_a, "out"_a, "lse"_a, "causal"_a, "bottom_right"_a, "window_left"_a, "window_right"_a,
      "scale"_a, "softcap"_a, "stream"_a, kNoGil);
  m.def(
      "attention_backward",
      [](const Array& q, const Array& k, const Array& v, const Array& out, const Array& dout, const Array& lse,
         const Array& dq, const Array& dk, const Array& dv, bool causal, bool bottom_right, std::int64_t window_left,
         std::int64_t window_right, float scale, float softcap, bool deterministic, std::uintptr_t stream) {
        constexpr const char* op = "attention_backward";
        const TensorView qv = view(q, op, "q");
        attention_backward(qv, view(k, op, "k"), view(v, op, "v"), view(out, op, "out"), view(dout, op, "dout"),
                           view(lse, op, "lse"), view(dq, op, "dq"), view(dk, op, "dk"), view(dv, op, "dv"),
                           AttentionOptions{causal, bottom_right, window_left, window_right, scale, softcap, deterministic},
                           StreamArg(stream, qv).get());
      },
      "q"_a, "k"_a, "v"_a, "out"_a, "dout"_a, "lse"_a, "dq"_a, "dk"_a, "dv"_a, "causal"_a, "bottom_right"_a,
      "window_left"_a, "window_right"_a, "scale"_a, "softcap"_a, "deterministic"_a, "stream"_a, kNoGil);
  m.def(
      "attention_forward_varlen",
      [](const Array& q, const Array& k, const Array& v, const Array& out, const Array& lse, const Array& cu_seqlens_q,
         const Array& cu_seqlens_k, std::int64_t max_seqlen_q, std::int64_t max_seqlen_k, bool causal,
         bool bottom_right, std::int64_t window_left, std::int64_t window_right, float scale, float softcap,
         std::uintptr_t stream) {
        constexpr const char* op = "attention_forward_varlen";
        const TensorView qv = view(q, op, "q");
        const AttentionVarlen seqs{view(cu_seqlens_q, op, "cu_seqlens_q"), view(cu_seqlens_k, op, "cu_seqlens_k"),
                                   max_seqlen_q, max_seqlen_k};
        attention_forward_varlen(qv, view(k, op, "k"), view(v, op, "v"), view(out, op, "out"), view(lse, op, "lse"),
                                 seqs, AttentionOptions{causal, bottom_right, window_left, window_right, scale, softcap},
                                 StreamArg(stream, qv).get());
      },
      "q"_a, "k"_a, "v"_a, "out"_a, "lse"_a, "cu_seqlens_q"_a, "cu_seqlens_k"_a, "max_seqlen_q"_a, "max_seqlen_k"_a,
      "causal"_a, "bottom_right"_a, "window_left"_a, "window_right"_a, "scale"_a, "softcap"_a, "stream"_a, kNoGil);
  m.def(
      "attention_backward_varlen",
      [](const Array& q, const Array& k, const Array& v, const Array& out, const Array& dout, const Array& lse,
         const Array& dq, const Array& dk, const Array& dv, const Array& cu_seqlens_q, const Array& cu_seqlens_k,
         std::int64_t max_seqlen_q, std::int64_t max_seqlen_k, bool causal, bool bottom_right,
         std::int64_t window_left, std::int64_t window_right, float scale, float softcap, bool deterministic,
         std::uintptr_t stream) {
        constexpr const char* op = "attention_backward_varlen";
        const TensorView qv = view(q, op, "q");
        const AttentionVarlen seqs{view(cu_seqlens_q, op, "cu_seqlens_q"), view(cu_seqlens_k, op, "cu_seqlens_k"),
                                   max_seqlen_q, max_seqlen_k};
        attention_backward_varlen(
            qv, view(k, op, "k"), view(v, op, "v"), view(out, op, "out"), view(dout, op, "dout"), view(lse, op, "lse"),
            view(dq, op, "dq"), view(dk, op, "dk"), view(dv, op, "dv"), seqs,
            AttentionOptions{causal, bottom_right, window_left, window_right, scale, softcap, deterministic},
            StreamArg(stream, qv).get());
      },
      "q"_a, "k"_a, "v"_a, "out"_a, "dout"_a, "lse"_a, "dq"_a, "dk"_a, "dv"_a, "cu_seqlens_q"_a, "cu_seqlens_k"_a,
      "max_seqlen_q"_a, "max_seqlen_k"_a, "causal"_a, "bottom_right"_a, "window_left"_a, "window_right"_a, "scale"_a,
      "softcap"_a, "deterministic"_a, "stream"_a, kNoGil);
}

}  // namespace fk::py
