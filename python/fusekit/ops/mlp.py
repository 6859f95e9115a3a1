"""mlp: a whole narrow MLP in one kernel (bf16 / f16; widths <= 128, hidden 16/32/64/128)."""
from __future__ import annotations

import torch
from torch import Tensor

from .. import _C
from ._registry import _custom_op, _autograd, _autocast, _bwd, _stream, _d


# ---------------------------------------------------------------------------------------------
# mlp: a whole narrow MLP in one kernel (bf16 / f16; widths <= 128, hidden 16/32/64/128)
# ---------------------------------------------------------------------------------------------

def _acts(acts: str) -> list:
    return acts.split(",") if acts else []


@_custom_op("fused_mlp")
def fused_mlp(x: Tensor, weights: list[Tensor], biases: list[Tensor], acts: str) -> Tensor:
    """y = act_L(... act_0(x W_0ᵀ + b_0) ...), inference (nothing saved); acts comma-separated
    (identity, relu, sigmoid), one per layer."""
    y = x.new_empty((x.shape[0], weights[-1].shape[0]))
    _C.fused_mlp_forward(_d(x), [_d(w) for w in weights], [_d(b) for b in biases], _acts(acts), _d(y), None,
                         _stream(x))
    return y


@fused_mlp.register_fake
def _(x, weights, biases, acts):
    return x.new_empty((x.shape[0], weights[-1].shape[0]))


def _hidden_shape(x: Tensor, weights: list) -> tuple:
    return (len(weights) - 1, x.shape[0], weights[0].shape[0])


@_custom_op("fused_mlp_train")
def fused_mlp_train(x: Tensor, weights: list[Tensor], biases: list[Tensor], acts: str) -> tuple[Tensor, Tensor]:
    """(y, hidden): the forward that also keeps every hidden layer's output for the backward."""
    y = x.new_empty((x.shape[0], weights[-1].shape[0]))
    hidden = x.new_empty(_hidden_shape(x, weights))
    _C.fused_mlp_forward(_d(x), [_d(w) for w in weights], [_d(b) for b in biases], _acts(acts), _d(y), _d(hidden),
                         _stream(x))
    return y, hidden


@fused_mlp_train.register_fake
def _(x, weights, biases, acts):
    return x.new_empty((x.shape[0], weights[-1].shape[0])), x.new_empty(_hidden_shape(x, weights))


@_custom_op("fused_mlp_backward")
def fused_mlp_backward(dy: Tensor, x: Tensor, hidden: Tensor, y: Tensor, weights: list[Tensor],
                       biases: list[Tensor], acts: str) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """(dx, dW_l, db_l): dW and db in f32 (master-gradient precision), summed in a fixed order."""
    dy = dy.contiguous() if not dy.is_contiguous() else dy
    dx = torch.empty_like(x)
    dws = [w.new_empty(w.shape, dtype=torch.float32) for w in weights]
    dbs = [b.new_empty(b.shape, dtype=torch.float32) for b in biases]
    _C.fused_mlp_backward(_d(dy), _d(x), _d(hidden), _d(y), [_d(w) for w in weights], [_d(b) for b in biases],
                          _acts(acts), _d(dx), [_d(t) for t in dws], [_d(t) for t in dbs], _stream(dy))
    return dx, dws, dbs


@fused_mlp_backward.register_fake
def _(dy, x, hidden, y, weights, biases, acts):
    return (torch.empty_like(x), [w.new_empty(w.shape, dtype=torch.float32) for w in weights],
            [b.new_empty(b.shape, dtype=torch.float32) for b in biases])


def _fused_mlp_setup(ctx, inputs, output):
    x, weights, biases, acts = inputs
    y, hidden = output
    ctx.acts, ctx.n = acts, len(weights)
    ctx.save_for_backward(x, hidden, y, *weights, *biases)


def _fused_mlp_bwd(ctx, dy, dhidden):
    x, hidden, y, *rest = ctx.saved_tensors
    weights, biases = rest[: ctx.n], rest[ctx.n:]
    dx, dws, dbs = _bwd(ctx, "fused_mlp_backward", dy, x, hidden, y, list(weights), list(biases), ctx.acts)
    return dx, [d.to(w.dtype) for d, w in zip(dws, weights)], [d.to(b.dtype) for d, b in zip(dbs, biases)], None


_autograd("fused_mlp_train", _fused_mlp_bwd, _fused_mlp_setup, eager=False)
_autocast("fused_mlp")
_autocast("fused_mlp_train")
