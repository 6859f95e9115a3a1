// The recsys family's bindings: embedding bags (forward; backward as a dense gradient or with the
// optimizer fused in), the dense optimizer step, the feature interaction and the sigmoid BCE loss.
//
// Tables cross as their row counts: the TableLayout (and the dot interaction's DotPairs) of a
// configuration is made on its first call on a device (a synchronous copy of the bases, outside
// any CUDA graph capture) and kept for the life of the process.
#include <nanobind/stl/vector.h>

#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

#include "bindings.hpp"
#include "fusekit/ops/recsys.hpp"

namespace fk::py {
namespace {

using namespace nb::literals;

const TableLayout& layout_for(const std::vector<std::int64_t>& rows, Device device, const char* op) {
  FK_CHECK_ARG(!rows.empty(), op, "table_rows", "one row count per table (at least one table)", "none");
  for (const std::int64_t r : rows) FK_CHECK_ARG(r > 0, op, "table_rows", "positive row counts", std::to_string(r));
  static std::mutex mu;
  static auto* cache = new std::map<std::pair<int, std::vector<std::int64_t>>, std::unique_ptr<TableLayout>>();
  const std::lock_guard lock(mu);
  auto& slot = (*cache)[{device.is_cpu() ? -1 : device.index, rows}];
  if (!slot) slot = std::make_unique<TableLayout>(rows, device);
  return *slot;
}

const DotPairs& pairs_for(std::int64_t features, bool self, Device device) {
  static std::mutex mu;
  static auto* cache = new std::map<std::tuple<int, std::int64_t, bool>, std::unique_ptr<DotPairs>>();
  const std::lock_guard lock(mu);
  auto& slot = (*cache)[{device.is_cpu() ? -1 : device.index, features, self}];
  if (!slot) slot = std::make_unique<DotPairs>(features, self, device);
  return *slot;
}

Pooling parse_pooling(const std::string& s, const char* op) {
  if (s == "sum") return Pooling::sum;
  if (s == "mean") return Pooling::mean;
  throw Error(op, "pooling", "sum or mean", s);
}

RowHash parse_hash(const std::string& s, const char* op) {
  if (s == "seed") return RowHash::seed;
  if (s == "reference") return RowHash::reference;
  throw Error(op, "hash", "seed or reference", s);
}

EmbeddingUpdate parse_update(const std::string& s, const char* op) {
  if (s == "sgd") return EmbeddingUpdate::sgd;
  if (s == "adagrad") return EmbeddingUpdate::adagrad;
  if (s == "rowwise_adagrad") return EmbeddingUpdate::rowwise_adagrad;
  if (s == "dense_gradient") return EmbeddingUpdate::dense_gradient;
  throw Error(op, "update", "sgd, adagrad, rowwise_adagrad or dense_gradient", s);
}

InteractionParams interaction_params(const std::string& kind, bool self, bool bmm, const char* op) {
  InteractionParams p;
  if (kind == "dot") p.kind = InteractionKind::dot;
  else if (kind == "cat") p.kind = InteractionKind::cat;
  else if (kind == "outer") p.kind = InteractionKind::outer;
  else throw Error(op, "kind", "dot, cat or outer", kind);
  p.self_interaction = self;
  p.impl = bmm ? InteractionImpl::bmm : InteractionImpl::fused;
  return p;
}

}  // namespace

void bind_recsys(nb::module_& m) {
  m.def(
      "embedding_bag_forward",
      [](const Array& weights, const OptArray& indices, const OptArray& offsets, const OptArray& raw,
         const std::vector<std::int64_t>& table_rows, const Array& out, const OptArray& keys, const OptArray& bags,
         const std::string& pooling, const std::string& hash, bool per_table_launch, std::uintptr_t stream) {
        constexpr const char* op = "embedding_bag_forward";
        const EmbeddingBagForwardArgs a{view(weights, op, "weights"), view(indices, op, "indices"),
                                        view(offsets, op, "offsets"),  view(raw, op, "raw"),
                                        view(out, op, "out"),          view(keys, op, "keys"),
                                        view(bags, op, "bags")};
        const TableLayout& layout = layout_for(table_rows, a.weights.device(), op);
        embedding_bag_forward(layout, a, {parse_pooling(pooling, op), parse_hash(hash, op), per_table_launch},
                              StreamArg(stream, a.weights).get());
      },
      "weights"_a, "indices"_a.none(), "offsets"_a.none(), "raw"_a.none(), "table_rows"_a, "out"_a, "keys"_a.none(),
      "bags"_a.none(), "pooling"_a, "hash"_a, "per_table_launch"_a, "stream"_a, kNoGil);
  m.def(
      "embedding_bag_backward_workspace_bytes",
      [](std::int64_t nnz, std::int64_t dim) { return embedding_bag_backward_workspace_bytes(nnz, dim); }, "nnz"_a,
      "dim"_a, kNoGil);
  m.def(
      "embedding_bag_backward_update",
      [](const Array& keys, const Array& bags, const Array& dout, const OptArray& offsets, const Array& weights,
         const OptArray& state, const OptArray& workspace, const std::vector<std::int64_t>& table_rows,
         const std::string& update, float lr, float eps, const std::string& pooling, std::uint64_t seed,
         const OptArray& rounding_offset, std::uintptr_t stream) {
        constexpr const char* op = "embedding_bag_backward_update";
        const EmbeddingBagBackwardArgs a{view(keys, op, "keys"),       view(bags, op, "bags"),
                                         view(dout, op, "dout"),       view(offsets, op, "offsets"),
                                         view(weights, op, "weights"), view(state, op, "state"),
                                         view(workspace, op, "workspace")};
        EmbeddingOptimizerParams p{parse_update(update, op), lr, eps, parse_pooling(pooling, op)};
        // 16-bit tables round each update stochastically; without an offset every step would draw
        // the same bits, so Python must pass one (fusekit.nn draws it from torch's generator).
        const auto counter = view(rounding_offset, op, "rounding_offset");
        FK_CHECK_ARG(a.weights.dtype() == DType::f32 || counter.has_value(), op, "rounding_offset",
                     "an i64 [1] tensor (a new Philox offset each step) for 16-bit tables", "None");
        p.seed = seed;
        if (counter && a.weights.dtype() != DType::f32) p.offset_counter = *counter;
        const TableLayout& layout = layout_for(table_rows, a.weights.device(), op);
        embedding_bag_backward_update(layout, a, p, StreamArg(stream, a.weights).get());
      },
      "keys"_a, "bags"_a, "dout"_a, "offsets"_a.none(), "weights"_a, "state"_a.none(), "workspace"_a.none(),
      "table_rows"_a, "update"_a, "lr"_a, "eps"_a, "pooling"_a, "seed"_a, "rounding_offset"_a.none(), "stream"_a,
      kNoGil);
  m.def(
      "dense_optimizer_update",
      [](const Array& param, const Array& grad, const OptArray& state, bool adagrad, float lr, float eps,
         std::uintptr_t stream) {
        constexpr const char* op = "dense_optimizer_update";
        const DenseOptimizerArgs a{view(param, op, "param"), view(grad, op, "grad"), view(state, op, "state")};
        dense_optimizer_update(a, {adagrad, lr, eps}, StreamArg(stream, a.param).get());
      },
      "param"_a, "grad"_a, "state"_a.none(), "adagrad"_a, "lr"_a, "eps"_a, "stream"_a, kNoGil);
  m.def(
      "interaction_size",
      [](const std::string& kind, bool self, std::int64_t features, std::int64_t dim) {
        return interaction_size(interaction_params(kind, self, false, "interaction_size"), features, dim);
      },
      "kind"_a, "self_interaction"_a, "features"_a, "dim"_a);
  m.def("interaction_dot_fused_fits", &interaction_dot_fused_fits, "features"_a, "dim"_a);
  m.def(
      "interaction_forward",
      [](const Array& z, const Array& r, const std::string& kind, bool self, const OptArray& workspace,
         std::uintptr_t stream) {
        constexpr const char* op = "interaction_forward";
        const TensorView zv = view(z, op, "z");
        const InteractionParams p = interaction_params(kind, self, workspace.has_value(), op);
        FK_CHECK_ARG(zv.rank() == 3, op, "z", "[B, F, D]", zv.shape().str());
        const DotPairs* pairs = p.kind == InteractionKind::dot ? &pairs_for(zv.size(1), self, zv.device()) : nullptr;
        interaction_forward({zv, view(r, op, "r"), pairs, view(workspace, op, "workspace")}, p,
                            StreamArg(stream, zv).get());
      },
      "z"_a, "r"_a, "kind"_a, "self_interaction"_a, "workspace"_a.none(), "stream"_a, kNoGil);
  m.def(
      "interaction_backward",
      [](const Array& z, const Array& dr, const Array& dz, const std::string& kind, bool self, bool relu_x,
         const OptArray& workspace, std::uintptr_t stream) {
        constexpr const char* op = "interaction_backward";
        const TensorView zv = view(z, op, "z");
        const InteractionParams p = interaction_params(kind, self, workspace.has_value(), op);
        FK_CHECK_ARG(zv.rank() == 3, op, "z", "[B, F, D]", zv.shape().str());
        const DotPairs* pairs = p.kind == InteractionKind::dot ? &pairs_for(zv.size(1), self, zv.device()) : nullptr;
        interaction_backward({zv, view(dr, op, "dr"), view(dz, op, "dz"), pairs, relu_x,
                              view(workspace, op, "workspace")},
                             p, StreamArg(stream, zv).get());
      },
      "z"_a, "dr"_a, "dz"_a, "kind"_a, "self_interaction"_a, "relu_x"_a, "workspace"_a.none(), "stream"_a, kNoGil);
  m.attr("sigmoid_bce_accumulator_bytes") = 8 * kSigmoidBceAccumulatorDoubles;
  m.def(
      "sigmoid_bce_forward_backward",
      [](const Array& logits, const Array& labels, const Array& dlogits, const Array& accumulator,
         const OptArray& probabilities, std::uintptr_t stream) {
        constexpr const char* op = "sigmoid_bce_forward_backward";
        const SigmoidBceArgs a{view(logits, op, "logits"), view(labels, op, "labels"), view(dlogits, op, "dlogits"),
                               view(accumulator, op, "accumulator"), view(probabilities, op, "probabilities")};
        sigmoid_bce_forward_backward(a, {probabilities.has_value()}, StreamArg(stream, a.logits).get());
      },
      "logits"_a, "labels"_a, "dlogits"_a, "accumulator"_a, "probabilities"_a.none(), "stream"_a, kNoGil);
}

}  // namespace fk::py
