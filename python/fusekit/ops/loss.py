"""loss: an LM head's linear fused with cross-entropy; the gradients come from the forward.

As Liger-Kernel's fused linear cross-entropy: the op computes the loss and, in the same chunked
pass, the gradients of that loss (dh, dw, dbias), which autograd's backward only scales by the
incoming gradient (a 0-d tensor). The [N, V] logits never exist in full.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import _C
from ._registry import _custom_op, _autograd, _autocast, _stream, _same_device, _d

_OP = "linear_cross_entropy"


def _grad_shapes(h: Tensor, w: Tensor, bias: Optional[Tensor], need_dh: bool, need_dw: bool):
    return (tuple(h.shape) if need_dh else (0,), tuple(w.shape) if need_dw else (0,),
            tuple(bias.shape) if need_dw and bias is not None else (0,))


def _contiguous(t: Tensor) -> Tensor:
    return t if t.is_contiguous() else t.contiguous()


@_custom_op(_OP)
def linear_cross_entropy(h: Tensor, w: Tensor, bias: Optional[Tensor], targets: Tensor, ignore_index: int,
                         label_smoothing: float, z_loss: float, reduction: str, need_dh: bool,
                         need_dw: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(loss, dh, dw, dbias): loss = cross_entropy(h wᵀ + bias, targets) (+ z_loss lse², over the
    rows whose target is not ignore_index; reduction mean or sum) as an f32 scalar, h [..., H],
    w [V, H], targets int64 [...] (h's leading shape); dh [..., H] when need_dh, dw [V, H] and
    dbias [V] (with a bias) when need_dw, the gradients of loss, else empty tensors."""
    _same_device(_OP, h=h, w=w, bias=bias, targets=targets)
    hd = h.shape[-1]
    h2 = _contiguous(h.reshape(-1, hd))
    dh_shape, dw_shape, db_shape = _grad_shapes(h, w, bias, need_dh, need_dw)
    loss = h.new_empty((), dtype=torch.float32)
    dh, dw = h.new_empty(dh_shape), w.new_empty(dw_shape)
    dbias = (bias if bias is not None else h).new_empty(db_shape)
    _C.linear_cross_entropy(_d(h2), _d(_contiguous(w)), _d(None if bias is None else _contiguous(bias)),
                            _d(_contiguous(targets.reshape(-1))), _d(loss), _d(dh.view(-1, hd)) if need_dh else None,
                            _d(dw) if need_dw else None, _d(dbias) if need_dw and bias is not None else None,
                            ignore_index, label_smoothing, z_loss, reduction, 0,
                            bool(torch.backends.cuda.matmul.allow_tf32), True, _stream(h))
    return loss, dh, dw, dbias


@linear_cross_entropy.register_fake
def _(h, w, bias, targets, ignore_index, label_smoothing, z_loss, reduction, need_dh, need_dw):
    dh_shape, dw_shape, db_shape = _grad_shapes(h, w, bias, need_dh, need_dw)
    return (h.new_empty((), dtype=torch.float32), h.new_empty(dh_shape), w.new_empty(dw_shape),
            (bias if bias is not None else h).new_empty(db_shape))


def _not_computed(arg: str, flag: str):
    return _C.Error(f"fk::{_OP}: argument '{flag}': expected True when a gradient of '{arg}' is recorded "
                    "(the gradients are computed by the forward), got False")


def _setup(ctx, inputs, output):
    h, w, bias, targets, ignore_index, label_smoothing, z_loss, reduction, need_dh, need_dw = inputs
    _, dh, dw, dbias = output
    ctx.need_dh, ctx.need_dw, ctx.with_bias = need_dh, need_dw, bias is not None
    from ..compress import leave_unpacked  # the saved tensors are gradients, not activations
    leave_unpacked(dh, dw, dbias)
    ctx.save_for_backward(dh, dw, dbias)


def _backward(ctx, dloss, _ddh, _ddw, _ddbias):
    dh, dw, dbias = ctx.saved_tensors
    need = ctx.needs_input_grad
    if need[0] and not ctx.need_dh:
        raise _not_computed("h", "need_dh")
    if (need[1] or need[2]) and not ctx.need_dw:
        raise _not_computed("w", "need_dw")
    g = dloss.to(torch.float32)
    return ((dh * g).to(dh.dtype) if need[0] else None, (dw * g).to(dw.dtype) if need[1] else None,
            (dbias * g).to(dbias.dtype) if ctx.with_bias and need[2] else None,
            None, None, None, None, None, None, None)


_autograd(_OP, _backward, _setup)
_autocast(_OP)
