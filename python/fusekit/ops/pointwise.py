"""pointwise: y = act(x + alpha * residual + bias) and its backward; convert between floating dtypes."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import _C
from ._registry import (_custom_op, _autograd, _bwd, _stream, _rows, _same_device, _dlpack, _d, _FROM_OUTPUT,
                        _derivative_from_output, _input, _not_kept)


def _bias_act(x: Tensor, bias: Optional[Tensor], residual: Optional[Tensor], act: str, alpha: float,
              for_backward: bool) -> tuple:
    """bias_act, with None for z where it is not written."""
    # (devices are checked by the op: y and z are allocated on x's)
    if x.dim() != 2 or x.stride(1) != 1:
        x = _input(x)
    if residual is not None and (residual.dim() != 2 or residual.stride(1) != 1):
        residual = _input(residual)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    z = None if act in _FROM_OUTPUT or not for_backward else torch.empty_like(y)
    xs, ys, zs = x, y, z  # as [rows, cols] views; a 2-D x (the common case) as it is
    if x.dim() != 2:
        xs, ys = _rows(x, "bias_act_forward", "x"), _rows(y, "bias_act_forward", "y")
        zs = None if z is None else _rows(z, "bias_act_forward", "preact")
    _C.bias_act_forward(_dlpack(xs), None if residual is None else _dlpack(_rows(residual, "bias_act_forward", "r")),
                        _d(bias), _dlpack(ys), _d(zs), act, alpha, _stream(x))
    return y, z


@_custom_op("bias_act", first=_bias_act)
def bias_act(x: Tensor, bias: Optional[Tensor], residual: Optional[Tensor], act: str, alpha: float,
             for_backward: bool) -> tuple[Tensor, Tensor]:
    """(y, z): y = act(x + alpha * residual + bias) over x's last dimension; z, the pre-activation,
    when for_backward and act's derivative needs it (gelu, silu), else an empty tensor."""
    y, z = _bias_act(x, bias, residual, act, alpha, for_backward)
    return y, (x.new_empty(0) if z is None else z)


@bias_act.register_fake
def _(x, bias, residual, act, alpha, for_backward):
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    return y, (torch.empty_like(y) if for_backward and not _derivative_from_output(act) else x.new_empty(0))


@_custom_op("bias_act_backward")
def bias_act_backward(dy: Tensor, saved: Tensor, act: str, alpha: float, with_bias: bool,
                      with_residual: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dbias, dresidual) from dy and what bias_act saved (y, or z for gelu / silu); dbias and
    dresidual are empty tensors when not asked for."""
    _same_device("bias_act_backward", dy=dy, saved=saved)
    dy = _input(dy)  # autograd hands out expanded and transposed gradients
    dx = torch.empty_like(dy, memory_format=torch.contiguous_format)
    cols = dy.shape[-1] if dy.dim() else 1
    db = dy.new_empty(cols) if with_bias else dy.new_empty(0)
    dr = torch.empty_like(dx) if with_residual else dy.new_empty(0)
    _C.bias_act_backward(_d(_rows(dy, "bias_act_backward", "dy")), _d(_rows(saved, "bias_act_backward", "saved")),
                         not _derivative_from_output(act), _d(_rows(dx, "bias_act_backward", "dx")),
                         _d(_rows(dr, "bias_act_backward", "dr")) if with_residual else None,
                         _d(db) if with_bias else None, act, alpha, _stream(dy))
    return dx, db, dr


@bias_act_backward.register_fake
def _(dy, saved, act, alpha, with_bias, with_residual):
    dx = torch.empty_like(dy, memory_format=torch.contiguous_format)
    cols = dy.shape[-1] if dy.dim() else 1
    return dx, dy.new_empty(cols if with_bias else 0), (torch.empty_like(dx) if with_residual else dy.new_empty(0))


def _bias_act_setup(ctx, inputs, output):
    _, bias, residual, act, alpha, for_backward = inputs
    if not for_backward:
        raise _not_kept("bias_act_forward")
    ctx.act, ctx.alpha, ctx.with_bias, ctx.with_residual = act, alpha, bias is not None, residual is not None
    ctx.save_for_backward(output[0] if act in _FROM_OUTPUT else output[1])


def _bias_act_backward(ctx, dy, dz):
    (saved,) = ctx.saved_tensors
    dx, db, dr = _bwd(ctx, "bias_act_backward", dy, saved, ctx.act, ctx.alpha, ctx.with_bias, ctx.with_residual)
    return dx, (db if ctx.with_bias else None), (dr if ctx.with_residual else None), None, None, None


_autograd("bias_act", _bias_act_backward, _bias_act_setup)


@_custom_op("convert")
def convert(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x in another floating dtype (f32, bf16, f16), rounded to nearest even."""
    y = torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format)
    _C.convert(_d(x), _d(y), _stream(x))
    return y


@convert.register_fake
def _(x, dtype):
    return torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format)


def _convert_setup(ctx, inputs, output):
    ctx.dtype = inputs[0].dtype


def _convert_bwd(ctx, dy):
    return _bwd(ctx, "convert", dy.contiguous(), ctx.dtype), None


_autograd("convert", _convert_bwd, _convert_setup)
