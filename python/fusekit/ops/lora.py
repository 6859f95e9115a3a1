"""lora: y = act(x Wᵀ + b + s (x Aᵀ) Bᵀ), W frozen."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import _C
from ._registry import (_custom_op, _autograd, _autocast, _bwd, _stream, _same_device, _d, _derivative_from_output,
                        _not_kept)


def _lora_kept(x: Tensor, a: Tensor, act: str, for_backward: bool):
    """The shapes of (t, z) lora keeps: t [M, r] and, for gelu / silu, z [M, N]; none unless for_backward."""
    return ((x.shape[0], a.shape[0]) if for_backward else (0,)), for_backward and not _derivative_from_output(act)


@_custom_op("lora")
def lora(x: Tensor, w: Tensor, bias: Optional[Tensor], a: Tensor, b: Tensor, act: str, scale: float,
         for_backward: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(y, t, z): y = act(x Wᵀ + bias + t Bᵀ); when for_backward, t = scale x Aᵀ [M, r] and, for
    gelu / silu, z the pre-activation, kept for the backward (else empty tensors)."""
    _same_device("lora_forward", x=x, w=w, bias=bias, a=a, b=b)
    y = x.new_empty((x.shape[0], w.shape[0]))
    t_shape, with_z = _lora_kept(x, a, act, for_backward)
    t = x.new_empty(t_shape)
    z = torch.empty_like(y) if with_z else x.new_empty(0)
    _C.lora_forward(_d(x), _d(w), _d(bias), _d(a), _d(b), _d(y), _d(t) if for_backward else None,
                    _d(z) if with_z else None, act, scale, _stream(x))
    return y, t, z


@lora.register_fake
def _(x, w, bias, a, b, act, scale, for_backward):
    y = x.new_empty((x.shape[0], w.shape[0]))
    t_shape, with_z = _lora_kept(x, a, act, for_backward)
    return y, x.new_empty(t_shape), (torch.empty_like(y) if with_z else x.new_empty(0))


@_custom_op("lora_backward")
def lora_backward(dy: Tensor, saved: Tensor, x: Tensor, w: Tensor, a: Tensor, b: Tensor, t: Tensor, act: str,
                  scale: float, with_bias: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, da, db, dbias); dbias empty without a bias. W is frozen: no dW."""
    dy = dy.contiguous() if not dy.is_contiguous() else dy
    dx, da, db = torch.empty_like(x), torch.empty_like(a), torch.empty_like(b)
    dbias = dy.new_empty(w.shape[0]) if with_bias else dy.new_empty(0)
    _C.lora_backward(_d(dy), _d(saved), not _derivative_from_output(act), _d(x), _d(w), _d(a), _d(b), _d(t), _d(dx), _d(da),
                     _d(db), _d(dbias) if with_bias else None, act, scale, _stream(dy))
    return dx, da, db, dbias


@lora_backward.register_fake
def _(dy, saved, x, w, a, b, t, act, scale, with_bias):
    return (torch.empty_like(x), torch.empty_like(a), torch.empty_like(b),
            dy.new_empty(w.shape[0] if with_bias else 0))


def _lora_setup(ctx, inputs, output):
    x, w, bias, a, b, act, scale, for_backward = inputs
    if not for_backward:
        raise _not_kept("lora_forward")
    y, t, z = output
    ctx.act, ctx.scale, ctx.with_bias = act, scale, bias is not None
    ctx.save_for_backward(y if _derivative_from_output(act) else z, x, w, a, b, t)


def _lora_bwd(ctx, dy, dt, dz):
    saved, x, w, a, b, t = ctx.saved_tensors
    dx, da, db, dbias = _bwd(ctx, "lora_backward", dy, saved, x, w, a, b, t, ctx.act, ctx.scale, ctx.with_bias)
    return dx, None, (dbias if ctx.with_bias else None), da, db, None, None, None


_autograd("lora", _lora_bwd, _lora_setup)
_autocast("lora")
