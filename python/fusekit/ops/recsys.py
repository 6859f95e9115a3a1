"""recsys: embedding bags (the optimizer fused into the backward), interaction, loss, dense
optimizer step."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import _C
from ._registry import _custom_op, _autograd, _bwd, _stream, _same_device, _d


# The embedding bags' backward: "dense_gradient" hands autograd a dense [total_rows, D] gradient
# (nn.EmbeddingBag's sparse=False); the others apply the update to the table rows the batch
# touched, inside the backward, and hand autograd no gradient for the weights (FBGEMM's TBE).
EMBEDDING_UPDATES = ("dense_gradient", "sgd", "adagrad", "rowwise_adagrad")


def _bags_batch(indices: Optional[Tensor], offsets: Optional[Tensor], raw: Optional[Tensor], tables: int) -> int:
    if raw is not None:
        return raw.shape[0] // tables
    if offsets is None:
        raise _C.Error("fk::embedding_bag_forward: argument 'offsets': expected i64 [T * B + 1] with indices, "
                       "or raw values instead of both, got neither")
    return (offsets.shape[0] - 1) // tables


def _bags_nnz(indices: Optional[Tensor], raw: Optional[Tensor]) -> int:
    return raw.shape[0] if raw is not None else (indices.shape[0] if indices is not None else 0)


@_custom_op("embedding_bag")
def embedding_bag(weights: Tensor, indices: Optional[Tensor], offsets: Optional[Tensor], raw: Optional[Tensor],
                  table_rows: list[int], pooling: str, hash: str, update: str, lr: float, eps: float,
                  state: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """(out [B, T, D] f32, keys, bags i32 [nnz]): out[b, t] = the sum (or mean) over bag t * B + b
    of rows of table t, the T tables stacked in weights [sum(table_rows), D] (f32, bf16 or f16;
    rows pooled in f32). Input: CSR indices
    (row within the table) and offsets [T * B + 1], table-major; or raw i32 [T * B], one value per
    bag hashed to a row (hash "seed" or "reference"). keys / bags are what the backward reads.
    update, lr, eps and state say what the backward does (EMBEDDING_UPDATES)."""
    _same_device("embedding_bag_forward", weights=weights, indices=indices, offsets=offsets, raw=raw, state=state)
    tables = len(table_rows)
    nnz = _bags_nnz(indices, raw)
    out = weights.new_empty((_bags_batch(indices, offsets, raw, tables), tables, weights.shape[-1]),
                            dtype=torch.float32)
    keys = weights.new_empty((nnz,), dtype=torch.int32)
    bags = torch.empty_like(keys)
    _C.embedding_bag_forward(_d(weights), _d(indices), _d(offsets), _d(raw), table_rows, _d(out), _d(keys), _d(bags),
                             pooling, hash, False, _stream(weights))
    return out, keys, bags


@embedding_bag.register_fake
def _(weights, indices, offsets, raw, table_rows, pooling, hash, update, lr, eps, state):
    tables = len(table_rows)
    keys = weights.new_empty((_bags_nnz(indices, raw),), dtype=torch.int32)
    return (weights.new_empty((_bags_batch(indices, offsets, raw, tables), tables, weights.shape[-1]),
                              dtype=torch.float32), keys, torch.empty_like(keys))


def _embedding_workspace(keys: Tensor, dim: int) -> Optional[Tensor]:
    if not keys.is_cuda:
        return None
    return keys.new_empty((_C.embedding_bag_backward_workspace_bytes(keys.shape[0], dim),), dtype=torch.uint8)


@_custom_op("embedding_bag_backward")
def embedding_bag_backward(dout: Tensor, keys: Tensor, bags: Tensor, offsets: Optional[Tensor], table_rows: list[int],
                           pooling: str) -> Tensor:
    """The dense gradient of the stacked tables [sum(table_rows), D]: each touched row the sum of
    its bags' dout (over the bag size for mean pooling), summed in a fixed order; every other row 0."""
    dout = dout.contiguous() if not dout.is_contiguous() else dout
    dw = dout.new_empty((sum(table_rows), dout.shape[-1]))
    _C.embedding_bag_backward_update(_d(keys), _d(bags), _d(dout), _d(offsets if pooling == "mean" else None), _d(dw),
                                     None, _d(_embedding_workspace(keys, dout.shape[-1])), table_rows, "dense_gradient",
                                     0.0, 0.0, pooling, 0, None, _stream(dout))
    return dw


@embedding_bag_backward.register_fake
def _(dout, keys, bags, offsets, table_rows, pooling):
    return dout.new_empty((sum(table_rows), dout.shape[-1]))


@_custom_op("embedding_bag_update_", mutates_args=("weights", "state"))
def embedding_bag_update_(weights: Tensor, state: Optional[Tensor], dout: Tensor, keys: Tensor, bags: Tensor,
                          offsets: Optional[Tensor], table_rows: list[int], update: str, lr: float, eps: float,
                          pooling: str, rounding_offset: Optional[Tensor] = None) -> None:
    """The optimizer step on the rows the batch touched, in place: sgd, adagrad (state [rows, D])
    or rowwise_adagrad (state [rows]); each row's gradient summed in a fixed order first. The
    state is f32; 16-bit weights (bf16, f16) get each new value computed in f32 and stored with
    unbiased stochastic rounding, whose Philox draws start at rounding_offset (i64 [1], read
    when the op runs; required for 16-bit weights, and a new value each step: the module's
    backward draws one from torch's generator)."""
    dout = dout.contiguous() if not dout.is_contiguous() else dout
    _C.embedding_bag_backward_update(_d(keys), _d(bags), _d(dout), _d(offsets if pooling == "mean" else None),
                                     _d(weights), _d(state), _d(_embedding_workspace(keys, dout.shape[-1])), table_rows,
                                     update, lr, eps, pooling, 0, _d(rounding_offset), _stream(dout))
    for t in (weights, state):  # as a torch in-place op would: a tensor saved before this is stale
        if t is not None:
            torch.autograd.graph.increment_version(t)


def _embedding_bag_setup(ctx, inputs, output):
    weights, indices, offsets, raw, table_rows, pooling, hash, update, lr, eps, state = inputs
    _, keys, bags = output
    ctx.table_rows, ctx.pooling, ctx.update, ctx.lr, ctx.eps = table_rows, pooling, update, lr, eps
    ctx.save_for_backward(keys, bags, offsets)
    ctx.weights_dtype = weights.dtype
    if update != "dense_gradient":  # what the backward updates in place (not saved: no version check)
        ctx.weights, ctx.state = weights, state


def _embedding_bag_bwd(ctx, dout, dkeys, dbags):
    keys, bags, offsets = ctx.saved_tensors
    if ctx.update == "dense_gradient":
        dw = _bwd(ctx, "embedding_bag_backward", dout, keys, bags, offsets, ctx.table_rows, ctx.pooling)
        dw = dw.to(ctx.weights_dtype)
    else:
        # 16-bit tables: this step's stochastic rounding starts at a Philox offset drawn from
        # torch's generator (so torch.manual_seed reproduces it, and a CUDA graph draws anew).
        rounding = None
        if ctx.weights_dtype != torch.float32:
            rounding = torch.randint(0, 2 ** 62, (1,), dtype=torch.int64, device=dout.device)
        _bwd(ctx, "embedding_bag_update_", ctx.weights, ctx.state, dout, keys, bags, offsets, ctx.table_rows,
             ctx.update, ctx.lr, ctx.eps, ctx.pooling, rounding)
        dw = None
    return dw, None, None, None, None, None, None, None, None, None, None


_autograd("embedding_bag", _embedding_bag_bwd, _embedding_bag_setup)


@_custom_op("dense_optimizer_update_", mutates_args=("param", "state"))
def dense_optimizer_update_(param: Tensor, grad: Tensor, state: Optional[Tensor], adagrad: bool, lr: float,
                            eps: float) -> None:
    """One SGD or Adagrad step over a whole f32 parameter, in place (state: Adagrad's sum of squares)."""
    _same_device("dense_optimizer_update", param=param, grad=grad, state=state)
    _C.dense_optimizer_update(_d(param), _d(grad), _d(state), adagrad, lr, eps, _stream(param))
    for t in (param, state):
        if t is not None:
            torch.autograd.graph.increment_version(t)


def interaction_size(kind: str, self_interaction: bool, features: int, dim: int):
    """Columns of the interaction's output (works on symbolic sizes too)."""
    if kind == "dot":
        return dim + features * (features - 1) // 2 + (features if self_interaction else 0)
    if kind == "cat":
        return features * dim
    if kind == "outer":
        return (features * dim) ** 2
    raise _C.Error(f"fk::interaction_forward: argument 'kind': expected dot, cat or outer, got {kind}")


def _interaction_workspace(z: Tensor, kind: str) -> Optional[Tensor]:
    """[B, F, F] f32 for the batched-GEMM dot interaction, where the fused one's shared memory
    cannot hold a sample (large F D); None otherwise."""
    if not z.is_cuda or kind != "dot" or _C.interaction_dot_fused_fits(z.shape[1], z.shape[2]):
        return None
    return z.new_empty((z.shape[0], z.shape[1], z.shape[1]))


@_custom_op("interaction")
def interaction(z: Tensor, kind: str, self_interaction: bool) -> Tensor:
    """r [B, I] from z [B, F, D] f32: dot (z[:, 0] then the dot products of the pairs (i, j), j < i
    (j <= i with self_interaction), in the DLRM reference's order), cat or outer."""
    if z.dim() != 3:
        raise _C.Error(f"fk::interaction_forward: argument 'z': expected [B, F, D], got shape {list(z.shape)}")
    r = z.new_empty((z.shape[0], interaction_size(kind, self_interaction, z.shape[1], z.shape[2])))
    _C.interaction_forward(_d(z), _d(r), kind, self_interaction, _d(_interaction_workspace(z, kind)), _stream(z))
    return r


@interaction.register_fake
def _(z, kind, self_interaction):
    return z.new_empty((z.shape[0], interaction_size(kind, self_interaction, z.shape[1], z.shape[2])))


@_custom_op("interaction_backward")
def interaction_backward(z: Tensor, dr: Tensor, kind: str, self_interaction: bool) -> Tensor:
    dr = dr.contiguous() if dr.stride(-1) != 1 else dr
    dz = torch.empty_like(z)
    _C.interaction_backward(_d(z), _d(dr), _d(dz), kind, self_interaction, False, _d(_interaction_workspace(z, kind)),
                            _stream(z))
    return dz


@interaction_backward.register_fake
def _(z, dr, kind, self_interaction):
    return torch.empty_like(z)


def _interaction_setup(ctx, inputs, output):
    z, kind, self_interaction = inputs
    ctx.kind, ctx.self_interaction = kind, self_interaction
    ctx.save_for_backward(z)


def _interaction_bwd(ctx, dr):
    (z,) = ctx.saved_tensors
    return _bwd(ctx, "interaction_backward", z, dr, ctx.kind, ctx.self_interaction), None, None


_autograd("interaction", _interaction_bwd, _interaction_setup)


@_custom_op("sigmoid_bce")
def sigmoid_bce(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """(loss, dlogits): loss = mean BCE of sigmoid(logits) against labels (f32 [B]), summed in
    double in a fixed order; dlogits = (sigmoid(logits) - labels) / B, from the same pass."""
    _same_device("sigmoid_bce_forward_backward", logits=logits, labels=labels)
    acc = torch.zeros((_C.sigmoid_bce_accumulator_bytes,), dtype=torch.uint8, device=logits.device)
    dlogits = torch.empty_like(logits)
    _C.sigmoid_bce_forward_backward(_d(logits), _d(labels), _d(dlogits), _d(acc), None, _stream(logits))
    return acc[:8].view(torch.float64)[0].to(torch.float32), dlogits


@sigmoid_bce.register_fake
def _(logits, labels):
    return logits.new_empty(()), torch.empty_like(logits)


def _sigmoid_bce_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1])


def _sigmoid_bce_bwd(ctx, dloss, ddlogits):
    (dlogits,) = ctx.saved_tensors
    return dlogits * dloss, None


_autograd("sigmoid_bce", _sigmoid_bce_bwd, _sigmoid_bce_setup)
