"""norm: RMSNorm, and RMSNorm fused with the residual add in front of it, forward and backward.

Dtypes as PyTorch's expressions give them: s = x + residual in the promotion of the two (as
``residual + hidden`` is; a bf16 or f16 x is added to f32 rows as it is read, without a copy), out
in the promotion of s's and the weight's dtypes (Hugging Face's LlamaRMSNorm: ``weight *
x̂.to(x.dtype)``, so an f32 weight with bf16 x gives f32). ``out_dtype`` bf16 or f16 with f32 rows
and weight rounds that f32 result once, as autocast's cast in front of the GEMM that reads it would
(fusekit.patch's decoder layers use it under autocast). The kernels take a weight of s's dtype or
f32; any other is cast to f32 first (a [N] copy), its gradient cast back.
Under CUDA autocast the ops follow torch's own rms_norm and layer_norm (autocast's fp32 list): the
floating inputs are cast to f32 and the op runs in f32; CPU autocast leaves them as they are, as it
leaves torch's.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import _C
from ._registry import _autocast, _autograd, _bwd, _custom_op, _d, _input, _rows, _same_device, _stream


def _row_major(t: Tensor) -> Tensor:
    """t as the kernels read it: rows of unit inner stride that do not overlap (a padded row stride
    is read in place); else a contiguous copy (a transposed or expanded tensor)."""
    t = _input(t)
    if t.dim() >= 2 and t.numel() > 0:
        rows = t.view(-1, t.shape[-1])
        if rows.shape[0] > 1 and rows.stride(0) < rows.shape[1]:
            return t.contiguous()
    return t


def _kernel_weight(weight: Tensor, dtype: torch.dtype) -> Tensor:
    """The weight as the kernels take it: of x's dtype or f32, contiguous."""
    if weight.dtype != dtype and weight.dtype != torch.float32:
        weight = weight.float()
    return weight.contiguous()


def _out_dtype(s: torch.dtype, weight: torch.dtype) -> torch.dtype:
    return s if weight == s else torch.float32


_HALF = (torch.bfloat16, torch.float16)


def _chosen_out_dtype(op: str, s: torch.dtype, weight: torch.dtype, out_dtype: Optional[torch.dtype]) -> torch.dtype:
    """out's dtype: the promotion of s's and the kernel weight's, or out_dtype where it is that or,
    for f32 rows and weight, bf16 or f16."""
    promoted = _out_dtype(s, weight)
    if out_dtype is None or out_dtype == promoted:
        return promoted
    if promoted == torch.float32 and s == torch.float32 and out_dtype in _HALF:
        return out_dtype
    raise _C.Error(f"fk::{op}: argument 'out_dtype': expected None, {_dtype_str(promoted)}"
                   + (" or bfloat16/float16" if s == torch.float32 else "")
                   + f" (for {_dtype_str(s)} rows and a {_dtype_str(weight)} weight), got {out_dtype}")


def _dtype_str(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _add_operands(x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
    """(x, residual) as the kernel adds them: residual of s's dtype (the promotion), x of it or a
    16-bit type added to f32 rows as read (the operands swap, the sum is the same), else a copy."""
    dtype = torch.promote_types(x.dtype, residual.dtype)
    if dtype == torch.float32 and x.dtype in _HALF and residual.dtype == torch.float32:
        return _row_major(x), _row_major(residual)
    if dtype == torch.float32 and residual.dtype in _HALF and x.dtype == torch.float32:
        return _row_major(residual), _row_major(x)
    return _row_major(x.to(dtype)), _row_major(residual.to(dtype))


def _forward(op: str, x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float, offset: float,
             out_dtype: Optional[torch.dtype] = None):
    if residual is not None:
        _same_device(op, x=x, residual=residual, weight=weight)
        if residual.shape != x.shape:
            raise _C.Error(f"fk::{op}: argument 'residual': expected shape {list(x.shape)} (x's), "
                           f"got {list(residual.shape)}")
        x, residual = _add_operands(x, residual)
        s_dtype = residual.dtype
    else:
        _same_device(op, x=x, weight=weight)
        x = _row_major(x)
        s_dtype = x.dtype
    w = _kernel_weight(weight, s_dtype)
    out = torch.empty(x.shape, dtype=_chosen_out_dtype(op, s_dtype, w.dtype, out_dtype), device=x.device)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    residual_out = (torch.empty(x.shape, dtype=s_dtype, device=x.device) if residual is not None else None)
    _C.rms_norm_forward(_d(_rows(x, op, "x")), None if residual is None else _d(_rows(residual, op, "residual")),
                        _d(w), _d(_rows(out, op, "out")),
                        None if residual_out is None else _d(_rows(residual_out, op, "residual_out")),
                        _d(rstd.view(-1)), eps, offset, _stream(x))
    return out, residual_out, rstd


def _fake(op: str, x: Tensor, residual: Optional[Tensor], weight: Tensor, out_dtype: Optional[torch.dtype]):
    dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    wdtype = weight.dtype if weight.dtype in (dtype, torch.float32) else torch.float32
    out = x.new_empty(x.shape, dtype=_chosen_out_dtype(op, dtype, wdtype, out_dtype))
    rstd = x.new_empty(x.shape[:-1], dtype=torch.float32)
    return out, x.new_empty(x.shape, dtype=dtype), rstd


@_custom_op("rms_norm")
def rms_norm(x: Tensor, weight: Tensor, eps: float, offset: float,
             out_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor]:
    """(out, rstd): out = x · rstd · (weight + offset) over x's last dimension, rstd = 1 /
    sqrt(mean(x²) + eps) in f32 (x.shape[:-1]), kept for the backward; out in out_dtype (see the
    module's docstring) or the promotion of x's and weight's dtypes."""
    out, _, rstd = _forward("rms_norm_forward", x, None, weight, eps, offset, out_dtype)
    return out, rstd


@rms_norm.register_fake
def _(x, weight, eps, offset, out_dtype=None):
    out, _, rstd = _fake("rms_norm_forward", x, None, weight, out_dtype)
    return out, rstd


@_custom_op("add_rms_norm")
def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float, offset: float,
                 out_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor, Tensor]:
    """(out, residual_out, rstd): residual_out = x + residual, out = rms_norm(residual_out), in one
    read of x and residual."""
    return _forward("add_rms_norm_forward", x, residual, weight, eps, offset, out_dtype)


@add_rms_norm.register_fake
def _(x, residual, weight, eps, offset, out_dtype=None):
    return _fake("add_rms_norm_forward", x, residual, weight, out_dtype)


@_custom_op("rms_norm_backward")
def rms_norm_backward(dout: Tensor, dresidual_out: Optional[Tensor], s: Tensor, weight: Tensor, rstd: Tensor,
                      offset: float, weight_grad: bool,
                      low_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor, Tensor]:
    """(ds, dweight, ds_low) from the incoming gradients of out (and of residual_out, for
    add_rms_norm) and what the forward kept: s (x, or residual_out), rstd. ds in s's dtype; dweight
    in weight's dtype when weight_grad, else an empty tensor; ds_low, for f32 s and low_dtype bf16 or
    f16, ds rounded once to low_dtype in the same pass (the gradient of a 16-bit x that add_rms_norm
    added to f32 rows), else an empty tensor."""
    op = "rms_norm_backward"
    _same_device(op, dout=dout, dresidual_out=dresidual_out, s=s, weight=weight, rstd=rstd)
    s = _row_major(s)
    w = _kernel_weight(weight, s.dtype)
    out_dtype = dout.dtype if dout.dtype in _HALF and s.dtype == torch.float32 else _out_dtype(s.dtype, w.dtype)
    if low_dtype is not None and (s.dtype != torch.float32 or low_dtype not in _HALF):
        raise _C.Error(f"fk::{op}: argument 'low_dtype': expected None, or bfloat16/float16 for f32 s, got "
                       f"{low_dtype} for {_dtype_str(s.dtype)} s")
    if low_dtype is not None:
        out_dtype = low_dtype  # the kernel writes ds_low in dout's dtype
    dout = _row_major(dout.to(out_dtype))  # autograd hands out any layout
    if dresidual_out is not None:
        dresidual_out = _row_major(dresidual_out.to(s.dtype))
    dx = torch.empty(s.shape, dtype=s.dtype, device=s.device)
    dw = torch.empty(w.shape, dtype=w.dtype, device=s.device) if weight_grad else None
    low = torch.empty(s.shape, dtype=low_dtype, device=s.device) if low_dtype is not None else None
    _C.rms_norm_backward(_d(_rows(dout, op, "dout")),
                         None if dresidual_out is None else _d(_rows(dresidual_out, op, "dresidual_out")),
                         _d(_rows(s, op, "s")), _d(w), _d(rstd.contiguous().view(-1)), _d(_rows(dx, op, "dx")),
                         _d(dw), offset, _stream(s), None if low is None else _d(_rows(low, op, "dx_low")))
    if low is None:
        low = s.new_empty(0)
    if dw is None:
        return dx, s.new_empty(0, dtype=weight.dtype), low
    return dx, dw.to(weight.dtype), low


@rms_norm_backward.register_fake
def _(dout, dresidual_out, s, weight, rstd, offset, weight_grad, low_dtype=None):
    low = s.new_empty(s.shape, dtype=low_dtype) if low_dtype is not None else s.new_empty(0)
    return s.new_empty(s.shape), weight.new_empty(weight.shape if weight_grad else (0,)), low


def _rms_norm_setup(ctx, inputs, output):
    x, weight, _, offset = inputs[:4]
    ctx.offset, ctx.x_dtype = offset, x.dtype
    ctx.save_for_backward(x, weight, output[1])


def _rms_norm_bwd(ctx, dout, drstd):
    x, weight, rstd = ctx.saved_tensors
    want_w = ctx.needs_input_grad[1]
    dx, dw, _ = _bwd(ctx, "rms_norm_backward", dout, None, x, weight, rstd, ctx.offset, want_w)
    return dx, (dw if want_w else None), None, None, None


_autograd("rms_norm", _rms_norm_bwd, _rms_norm_setup)


def _add_rms_norm_setup(ctx, inputs, output):
    x, residual, weight, _, offset = inputs[:5]
    ctx.out_dtype = output[0].dtype
    ctx.offset, ctx.dtypes = offset, (x.dtype, residual.dtype)
    ctx.save_for_backward(output[1], weight, output[2])


def _add_rms_norm_bwd(ctx, dout, dresidual_out, drstd):
    s, weight, rstd = ctx.saved_tensors
    want_w = ctx.needs_input_grad[2]
    if dout is None:  # only residual_out is used downstream
        dout = torch.zeros((), dtype=ctx.out_dtype, device=s.device).expand(s.shape)
    x_dtype, r_dtype = ctx.dtypes
    # x bf16/f16 added to f32 rows (autocast's attention or MLP output onto the residual stream):
    # its gradient written in its dtype by the same pass, not cast from ds after it
    low = x_dtype if (ctx.needs_input_grad[0] and s.dtype == torch.float32 and x_dtype in _HALF
                      and dout.dtype == x_dtype) else None
    ds, dw, ds_low = _bwd(ctx, "rms_norm_backward", dout, dresidual_out, s, weight, rstd, ctx.offset, want_w, low)
    dx = (ds_low if low is not None else ds) if ctx.needs_input_grad[0] else None
    dr = ds if ctx.needs_input_grad[1] else None
    return (None if dx is None else dx.to(x_dtype)), (None if dr is None else dr.to(r_dtype)), \
        (dw if want_w else None), None, None, None


_autograd("add_rms_norm", _add_rms_norm_bwd, _add_rms_norm_setup)

# torch's rms_norm and layer_norm are on CUDA autocast's fp32 list, and on no CPU autocast list.
# torch's own rms_norm is on CUDA autocast's fp32 list from torch 2.12 (before, autocast leaves it
# alone and it runs in its inputs' dtypes): fusekit's follow the running torch.
if torch.torch_version.TorchVersion(torch.__version__) >= (2, 12):
    _autocast("rms_norm", policy="fp32", device_types=("cuda",))
    _autocast("add_rms_norm", policy="fp32", device_types=("cuda",))
