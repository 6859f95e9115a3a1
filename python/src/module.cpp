// fusekit._C: every op as a function of arrays, outputs passed in (the caller allocates them, so
// PyTorch's allocator sees every byte), run on the caller's stream. The Python layer
// (fusekit/ops.py) makes each one a torch.library custom op with its fake and autograd rules.
//
// Conventions: arguments in the C++ op's order, outputs last before the options; optional tensors
// are None; `stream` is a cudaStream_t as an integer (torch.cuda.current_stream().cuda_stream),
// ignored for host tensors. The GIL is released while an op runs. fk::Error becomes
// fusekit.Error (a ValueError) with fusekit's message.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>

#include "bindings.hpp"
#include "fusekit/fusekit.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace fk::py {
namespace {

using OptArray = std::optional<Array>;
constexpr auto kNoGil = nb::call_guard<nb::gil_scoped_release>();

void bind_core(nb::module_& m) {
  m.def("build_info", [] {
    const BuildInfo b = build_info();
    nb::dict d;
    d["version"] = b.version;
    d["commit"] = b.commit;
    d["cuda"] = b.cuda;
    d["cuda_targets"] = b.cuda_targets;
    d["cuda_compiler"] = b.cuda_compiler;
    d["build_type"] = b.build_type;
    return d;
  });
  m.def("cuda_device_count", [] { return cuda_device_count(); });
}

// The device memory of every op (scratch buffers too) from Python callables: allocate(bytes,
// stream) -> address and free(address), PyTorch's caching allocator in fusekit/__init__.py.
struct PyMemorySource {
  nb::object allocate, free;
};

void* py_allocate(void* context, std::size_t bytes, int /*device*/, void* stream) {
  const auto* source = static_cast<const PyMemorySource*>(context);
  std::string failure;
  {
    nb::gil_scoped_acquire gil;
    try {
      return reinterpret_cast<void*>(
          nb::cast<std::uintptr_t>(source->allocate(bytes, reinterpret_cast<std::uintptr_t>(stream))));
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  throw Error("allocate", "cannot allocate " + std::to_string(bytes) + " bytes of device memory: " + failure);
}

void py_deallocate(void* context, void* ptr, int /*device*/, void* /*stream*/) noexcept {
  if (!nb::is_alive()) return;  // the interpreter is gone: the process is ending
  nb::gil_scoped_acquire gil;
  try {
    static_cast<const PyMemorySource*>(context)->free(reinterpret_cast<std::uintptr_t>(ptr));
  } catch (const std::exception&) {
    // free(address) raised: nothing to hand the error to from a destructor; the block is lost.
  }
}

void bind_memory(nb::module_& m) {
  m.def(
      "set_memory_source",
      [](nb::object allocate, nb::object free) {
        if (allocate.is_none() != free.is_none())
          throw Error("set_memory_source", "free", "None exactly when allocate is None", "the other");
        if (allocate.is_none()) return allocator::set_device_memory_source(nullptr);
        // Never freed: blocks may go back to it while the interpreter shuts down.
        auto* held = new PyMemorySource{std::move(allocate), std::move(free)};
        DeviceMemorySource source;
        source.allocate = py_allocate;
        source.deallocate = py_deallocate;
        source.context = held;
        allocator::set_device_memory_source(&source);
      },
      "allocate"_a.none(), "free"_a.none());
  m.def("allocator_stats", [](int device) {
    const AllocatorStats st = allocator::stats(Device::cuda(device));
    nb::dict d;
    d["allocated_bytes"] = st.allocated_bytes;
    d["cached_bytes"] = st.cached_bytes;
    d["device_allocations"] = st.device_allocations;
    return d;
  }, "device"_a);
}

void bind_pointwise(nb::module_& m) {
  m.def(
      "bias_act_forward",
      [](const Array& x, const OptArray& r, const OptArray& bias, const Array& y, const OptArray& preact,
         const std::string& act, float alpha, std::uintptr_t stream) {
        constexpr const char* op = "bias_act_forward";
        const BiasActForwardArgs a{view(x, op, "x"), view(r, op, "r"), view(bias, op, "bias"), view(y, op, "y"),
                                   view(preact, op, "preact")};
        bias_act_forward(a, {parse_activation(act), alpha}, StreamArg(stream, a.x).get());
      },
      "x"_a, "r"_a.none(), "bias"_a.none(), "y"_a, "preact"_a.none(), "act"_a, "alpha"_a, "stream"_a, kNoGil);
  m.def(
      "bias_act_backward",
      [](const Array& dy, const Array& saved, bool saved_is_preact, const Array& dx, const OptArray& dr,
         const OptArray& dbias, const std::string& act, float alpha, std::uintptr_t stream) {
        constexpr const char* op = "bias_act_backward";
        const BiasActBackwardArgs a{view(dy, op, "dy"), view(saved, op, "saved"),
                                    saved_is_preact ? SavedForBackward::preactivation : SavedForBackward::output,
                                    view(dx, op, "dx"), view(dr, op, "dr"), view(dbias, op, "dbias")};
        bias_act_backward(a, {parse_activation(act), alpha}, StreamArg(stream, a.dy).get());
      },
      "dy"_a, "saved"_a, "saved_is_preact"_a, "dx"_a, "dr"_a.none(), "dbias"_a.none(), "act"_a, "alpha"_a,
      "stream"_a, kNoGil);
  m.def(
      "convert",
      [](const Array& src, const Array& dst, std::uintptr_t stream) {
        const TensorView s = view(src, "convert", "src");
        convert(s, view(dst, "convert", "dst"), StreamArg(stream, s).get());
      },
      "src"_a, "dst"_a, "stream"_a, kNoGil);
}

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
      [](const Array& q, const Array& k, const Array& v, const Array& out, const Array& lse, bool causal, float scale,
         std::uintptr_t stream) {
        constexpr const char* op = "attention_forward";
        const TensorView qv = view(q, op, "q");
        attention_forward(qv, view(k, op, "k"), view(v, op, "v"), view(out, op, "out"), view(lse, op, "lse"), causal,
                          scale, StreamArg(stream, qv).get());
      },
      "q"_a, "k"_a, "v"_a, "out"_a, "lse"_a, "causal"_a, "scale"_a, "stream"_a, kNoGil);
}

// A packed tensor crosses as its three arrays and the numbers that describe them.
PackedView packed_view(const Array& words, const Array& scale, const Array& min, std::int64_t rows, std::int64_t cols,
                       const std::string& dtype, int bits, int group, const char* op) {
  return PackedView{view(words, op, "words"), view(scale, op, "scale"), view(min, op, "min"), rows, cols,
                    parse_dtype(dtype), bits, group};
}

void bind_quant(nb::module_& m) {
  m.def(
      "pack",
      [](const Array& x, const Array& words, const Array& scale, const Array& min, int bits, int group,
         bool stochastic, std::uint64_t seed, std::uint64_t offset, std::uintptr_t stream) {
        constexpr const char* op = "pack";
        const TensorView xv = view(x, op, "x");
        FK_CHECK_ARG(xv.rank() == 2, op, "x", "a matrix [rows, cols]", xv.shape().str());
        const PackedView out = packed_view(words, scale, min, xv.size(0), xv.size(1),
                                           std::string(dtype_name(xv.dtype())), bits, group, op);
        const PackParams p{bits, group, stochastic ? Rounding::stochastic : Rounding::nearest, seed, offset,
                           out.scale.dtype()};
        pack(xv, out, p, StreamArg(stream, xv).get());
      },
      "x"_a, "words"_a, "scale"_a, "min"_a, "bits"_a, "group"_a, "stochastic"_a, "seed"_a, "offset"_a, "stream"_a,
      kNoGil);
  m.def(
      "unpack",
      [](const Array& words, const Array& scale, const Array& min, std::int64_t rows, std::int64_t cols, int bits,
         int group, const Array& out, std::uintptr_t stream) {
        const TensorView o = view(out, "unpack", "out");
        const PackedView pv =
            packed_view(words, scale, min, rows, cols, std::string(dtype_name(o.dtype())), bits, group, "unpack");
        unpack(pv, o, StreamArg(stream, o).get());
      },
      "words"_a, "scale"_a, "min"_a, "rows"_a, "cols"_a, "bits"_a, "group"_a, "out"_a, "stream"_a, kNoGil);
  m.def(
      "relu_forward_packed",
      [](const Array& x, const Array& y, const Array& mask, std::uintptr_t stream) {
        constexpr const char* op = "relu_forward_packed";
        const TensorView xv = view(x, op, "x");
        relu_forward_packed(xv, view(y, op, "y"), view(mask, op, "mask"), StreamArg(stream, xv).get());
      },
      "x"_a, "y"_a, "mask"_a, "stream"_a, kNoGil);
  m.def(
      "relu_backward_packed",
      [](const Array& dy, const Array& mask, const Array& dx, std::uintptr_t stream) {
        constexpr const char* op = "relu_backward_packed";
        const TensorView d = view(dy, op, "dy");
        relu_backward_packed(d, view(mask, op, "mask"), view(dx, op, "dx"), StreamArg(stream, d).get());
      },
      "dy"_a, "mask"_a, "dx"_a, "stream"_a, kNoGil);
  m.def(
      "weight_grad_from_packed",
      [](const Array& dy, const Array& words, const Array& scale, const Array& min, std::int64_t rows,
         std::int64_t cols, const std::string& x_dtype, int bits, int group, const Array& dw, float beta,
         std::uintptr_t stream) {
        constexpr const char* op = "weight_grad_from_packed";
        const TensorView d = view(dy, op, "dy");
        const PackedView x = packed_view(words, scale, min, rows, cols, x_dtype, bits, group, op);
        weight_grad_from_packed(d, x, view(dw, op, "dw"), {.beta = beta}, StreamArg(stream, d).get());
      },
      "dy"_a, "words"_a, "scale"_a, "min"_a, "rows"_a, "cols"_a, "x_dtype"_a, "bits"_a, "group"_a, "dw"_a, "beta"_a,
      "stream"_a, kNoGil);
}

void bind_glu(nb::module_& m) {
  m.def(
      "glu_forward",
      [](const Array& x, const Array& w, const OptArray& bias, const Array& out, const std::string& kind,
         bool allow_tf32, std::uintptr_t stream) {
        constexpr const char* op = "glu_forward";
        const GluForwardArgs a{view(x, op, "x"), view(w, op, "w"), view(bias, op, "bias"), view(out, op, "out")};
        glu_forward(a, {parse_glu_kind(kind), allow_tf32}, StreamArg(stream, a.x).get());
      },
      "x"_a, "w"_a, "bias"_a.none(), "out"_a, "kind"_a, "allow_tf32"_a, "stream"_a, kNoGil);
  m.def(
      "glu_backward",
      [](const Array& dy, const Array& x, const Array& w, const OptArray& bias, const OptArray& dx,
         const OptArray& dw, const OptArray& dbias, const std::string& kind, bool allow_tf32, std::uintptr_t stream) {
        constexpr const char* op = "glu_backward";
        const GluBackwardArgs a{view(dy, op, "dy"), view(x, op, "x"),   view(w, op, "w"),
                                view(bias, op, "bias"), view(dx, op, "dx"), view(dw, op, "dw"),
                                view(dbias, op, "dbias")};
        glu_backward(a, {parse_glu_kind(kind), allow_tf32}, StreamArg(stream, a.dy).get());
      },
      "dy"_a, "x"_a, "w"_a, "bias"_a.none(), "dx"_a.none(), "dw"_a.none(), "dbias"_a.none(), "kind"_a,
      "allow_tf32"_a, "stream"_a, kNoGil);
}

void bind_lora(nb::module_& m) {
  m.def(
      "lora_forward",
      [](const Array& x, const Array& w, const OptArray& bias, const Array& a, const Array& b, const Array& y,
         const OptArray& t, const OptArray& preact, const std::string& act, float scale, std::uintptr_t stream) {
        constexpr const char* op = "lora_forward";
        const LoraForwardArgs args{view(x, op, "x"), view(w, op, "w"), view(bias, op, "bias"),
                                   view(a, op, "a"), view(b, op, "b"), view(y, op, "y"),
                                   view(t, op, "t"), view(preact, op, "preact")};
        lora_forward(args, {parse_activation(act), scale}, StreamArg(stream, args.x).get());
      },
      "x"_a, "w"_a, "bias"_a.none(), "a"_a, "b"_a, "y"_a, "t"_a.none(), "preact"_a.none(), "act"_a, "scale"_a,
      "stream"_a, kNoGil);
  m.def(
      "lora_backward",
      [](const Array& dy, const Array& saved, bool saved_is_preact, const Array& x, const Array& w, const Array& a,
         const Array& b, const OptArray& t, const OptArray& dx, const Array& da, const Array& db,
         const OptArray& dbias, const std::string& act, float scale, std::uintptr_t stream) {
        constexpr const char* op = "lora_backward";
        const LoraBackwardArgs args{view(dy, op, "dy"),
                                    view(saved, op, "saved"),
                                    saved_is_preact ? SavedForBackward::preactivation : SavedForBackward::output,
                                    view(x, op, "x"),
                                    view(w, op, "w"),
                                    view(a, op, "a"),
                                    view(b, op, "b"),
                                    view(t, op, "t"),
                                    view(dx, op, "dx"),
                                    view(da, op, "da"),
                                    view(db, op, "db"),
                                    view(dbias, op, "dbias")};
        lora_backward(args, {parse_activation(act), scale}, StreamArg(stream, args.dy).get());
      },
      "dy"_a, "saved"_a, "saved_is_preact"_a, "x"_a, "w"_a, "a"_a, "b"_a, "t"_a.none(), "dx"_a.none(), "da"_a,
      "db"_a, "dbias"_a.none(), "act"_a, "scale"_a, "stream"_a, kNoGil);
}

// A host fusekit tensor handed out through DLPack (torch.from_dlpack takes it without a copy).
nb::ndarray<> to_array(Tensor t) {
  auto* held = new Tensor(std::move(t));
  nb::capsule owner(held, [](void* p) noexcept { delete static_cast<Tensor*>(p); });
  const TensorView v = held->view();
  nb::dlpack::dtype dt{};
  switch (v.dtype()) {
    case DType::f16: dt = nb::dtype<std::uint16_t>(); dt.code = static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float); break;
    case DType::bf16: dt = nb::dtype<std::uint16_t>(); dt.code = static_cast<std::uint8_t>(nb::dlpack::dtype_code::Bfloat); break;
    case DType::f32: dt = nb::dtype<float>(); break;
    case DType::i32: dt = nb::dtype<std::int32_t>(); break;
    default: throw Error("to_array", "t", "f16, bf16, f32 or i32", std::string(dtype_name(v.dtype())));
  }
  return nb::ndarray<>(held->data(), static_cast<std::size_t>(v.rank()),
                       reinterpret_cast<const std::size_t*>(v.shape().begin()), owner, v.strides().begin(), dt,
                       nb::device::cpu::value, 0);
}

QuantizedWeight quantized_view(const Array& packed, const Array& scale, const Array& zero, std::int64_t n,
                               std::int64_t k, int group, const char* op) {
  const auto borrow = [](const TensorView& v) { return Tensor::adopt(v, [] {}); };
  QuantizedWeight qw;
  qw.packed = borrow(view(packed, op, "packed"));
  qw.scale = borrow(view(scale, op, "scale"));
  qw.zero = borrow(view(zero, op, "zero"));
  qw.n = n;
  qw.k = k;
  qw.group = group;
  qw.dtype = qw.scale.dtype();
  return qw;
}

void bind_qgemm(nb::module_& m) {
  m.def(
      "quantize_weights",
      [](const Array& w, int group) {
        const TensorView wv = view(w, "quantize_weights", "w");
        FK_CHECK_ARG(wv.device().is_cpu(), "quantize_weights", "w", "a host tensor (quantization runs on the host)",
                     wv.device().str());
        QuantizedWeight qw;
        {
          nb::gil_scoped_release unlocked;
          qw = quantize_weights(wv, group);
        }
        return nb::make_tuple(to_array(std::move(qw.packed)), to_array(std::move(qw.scale)),
                              to_array(std::move(qw.zero)));
      },
      "w"_a, "group"_a);
  m.def(
      "dequantize_weights",
      [](const Array& packed, const Array& scale, const Array& zero, std::int64_t n, std::int64_t k, int group,
         const Array& out, std::uintptr_t stream) {
        const QuantizedWeight qw = quantized_view(packed, scale, zero, n, k, group, "dequantize_weights");
        dequantize_weights(qw, view(out, "dequantize_weights", "out"), StreamArg(stream, qw.packed.view()).get());
      },
      "packed"_a, "scale"_a, "zero"_a, "n"_a, "k"_a, "group"_a, "out"_a, "stream"_a, kNoGil);
  m.def(
      "qgemm",
      [](const Array& x, const Array& packed, const Array& scale, const Array& zero, std::int64_t n, std::int64_t k,
         int group, const Array& y, std::uintptr_t stream) {
        const TensorView xv = view(x, "qgemm", "x");
        const QuantizedWeight qw = quantized_view(packed, scale, zero, n, k, group, "qgemm");
        qgemm(xv, qw, view(y, "qgemm", "y"), StreamArg(stream, xv).get());
      },
      "x"_a, "packed"_a, "scale"_a, "zero"_a, "n"_a, "k"_a, "group"_a, "y"_a, "stream"_a, kNoGil);
}

// The fused MLP's layers from parallel lists (weights [out_l, in_l], biases [out_l], activations).
std::vector<MlpLayer> mlp_layers(const std::vector<Array>& weights, const std::vector<Array>& biases,
                                 const std::vector<std::string>& acts, const char* op) {
  FK_CHECK_ARG(biases.size() == weights.size() && acts.size() == weights.size(), op, "biases",
               std::to_string(weights.size()) + " biases and activations (one per weight)",
               std::to_string(biases.size()) + " biases, " + std::to_string(acts.size()) + " activations");
  std::vector<MlpLayer> layers;
  for (std::size_t l = 0; l < weights.size(); ++l)
    layers.push_back({view(weights[l], op, "weights"), view(biases[l], op, "biases"), parse_activation(acts[l])});
  return layers;
}

void bind_mlp(nb::module_& m) {
  m.def(
      "fused_mlp_forward",
      [](const Array& x, const std::vector<Array>& weights, const std::vector<Array>& biases,
         const std::vector<std::string>& acts, const Array& y, const OptArray& hidden, std::uintptr_t stream) {
        constexpr const char* op = "fused_mlp_forward";
        const TensorView xv = view(x, op, "x");
        std::vector<MlpLayer> layers = mlp_layers(weights, biases, acts, op);
        if (hidden) {
          fused_mlp_forward_train({xv, std::move(layers), view(y, op, "y"), view(*hidden, op, "hidden")},
                                  StreamArg(stream, xv).get());
        } else {
          fused_mlp_forward({xv, std::move(layers), view(y, op, "y")}, StreamArg(stream, xv).get());
        }
      },
      "x"_a, "weights"_a, "biases"_a, "acts"_a, "y"_a, "hidden"_a.none(), "stream"_a, kNoGil);
  m.def(
      "fused_mlp_backward",
      [](const Array& dy, const Array& x, const Array& hidden, const Array& y, const std::vector<Array>& weights,
         const std::vector<Array>& biases, const std::vector<std::string>& acts, const OptArray& dx,
         const std::vector<Array>& dweight, const std::vector<Array>& dbias, std::uintptr_t stream) {
        constexpr const char* op = "fused_mlp_backward";
        FusedMlpBackwardArgs a{view(dy, op, "dy"), view(x, op, "x"), view(hidden, op, "hidden"), view(y, op, "y"),
                               mlp_layers(weights, biases, acts, op), view(dx, op, "dx"), {}, {}};
        for (const Array& d : dweight) a.dweight.push_back(view(d, op, "dweight"));
        for (const Array& d : dbias) a.dbias.push_back(view(d, op, "dbias"));
        fused_mlp_backward(a, StreamArg(stream, a.dy).get());
      },
      "dy"_a, "x"_a, "hidden"_a, "y"_a, "weights"_a, "biases"_a, "acts"_a, "dx"_a.none(), "dweight"_a, "dbias"_a,
      "stream"_a, kNoGil);
}

}  // namespace
}  // namespace fk::py

NB_MODULE(_C, m) {
  m.doc() = "fusekit's ops on DLPack arrays (see fusekit.ops for the PyTorch operators)";
  static nb::exception<fk::Error> error(m, "Error", PyExc_ValueError);
  fk::py::bind_core(m);
  fk::py::bind_memory(m);
  fk::py::bind_pointwise(m);
  fk::py::bind_primitives(m);
  fk::py::bind_quant(m);
  fk::py::bind_glu(m);
  fk::py::bind_lora(m);
  fk::py::bind_qgemm(m);
  fk::py::bind_mlp(m);
  fk::py::bind_recsys(m);
}
