"""pointwise: y = act(x + alpha * residual + bias) and its backward; rotary position embedding over q
and k (rope, rope_backward); convert between floating dtypes."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import _C
from ._registry import (_empty_in_order, _unit_rows, _custom_op, _autograd, _autocast, _bwd, _stream, _rows,
                        _same_device, _dlpack, _d, _FROM_OUTPUT, _derivative_from_output, _input, _not_kept)


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


# ---- rope -------------------------------------------------------------------------------------

def _rope_order(t: Tensor) -> list[int]:
    """The dimensions of a [B, H, T, D] tensor from outermost to innermost when it is a permutation
    of a dense tensor with D innermost (Hugging Face's q: [B, T, H, D] memory seen as [B, H, T, D]),
    else [] (contiguous). An output laid out in this order is what the caller's next op (SDPA, the
    transpose back and the projection's backward) reads without a copy. (Called on every rope:
    sizes and strides are read once, as tuples.)"""
    if t.dim() != 4 or t.is_contiguous():
        return []
    shape, stride = t.shape, t.stride()
    if shape[3] > 1 and stride[3] != 1:
        return []
    order = sorted(range(3), key=lambda d: (-stride[d], d)) + [3]
    expected = 1
    for d in reversed(order):
        if shape[d] > 1 and stride[d] != expected:
            return []
        expected *= shape[d]
    return [] if order == [0, 1, 2, 3] else order


def _rope_run(x: Tensor, y: Tensor, cos: Tensor, sin: Tensor, order_x: list[int], order_y: list[int],
              backward: bool) -> tuple[Tensor, Tensor]:
    _same_device("rope_backward" if backward else "rope_forward", q=x, k=y, cos=cos, sin=sin)
    x_out, y_out = _empty_in_order(x, order_x), _empty_in_order(y, order_y)
    _rope_into(x, y, cos, sin, x_out, y_out, backward)
    return x_out, y_out


def _rope_into(x: Tensor, y: Tensor, cos: Tensor, sin: Tensor, x_out: Tensor, y_out: Tensor, backward: bool) -> None:
    """The rope kernel from x, y into the given outputs (any strides with unit rows)."""
    _C.rope(_dlpack(_unit_rows(x)), _dlpack(_unit_rows(y)), _dlpack(_unit_rows(cos)), _dlpack(_unit_rows(sin)),
            _dlpack(x_out), _dlpack(y_out), backward, _stream(x))


@_custom_op("rope")
def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """(q_out, k_out) = (q cos + rotate_half(q) sin, k cos + rotate_half(k) sin) in one pass over q
    and k, rotate_half(x) = cat(-x2, x1) over the halves of the last dimension (Hugging Face
    LLaMA's apply_rotary_pos_emb). q [B, Hq, T, D], k [B, Hk, T, D] of one dtype (f32, bf16, f16),
    any strides; cos, sin [T, D], [1, T, D] or [B, T, D], in q's dtype or f32. Outputs in q's dtype,
    laid out as q and k when they are permutations of dense tensors, else contiguous. No gradient
    for cos and sin."""
    return _rope_run(q, k, cos, sin, _rope_order(q), _rope_order(k), False)


@rope.register_fake
def _(q, k, cos, sin):
    return _empty_in_order(q, _rope_order(q)), _empty_in_order(k, _rope_order(k))


@_custom_op("rope_backward")
def rope_backward(dq_out: Tensor, dk_out: Tensor, cos: Tensor, sin: Tensor, q_order: list[int],
                  k_order: list[int]) -> tuple[Tensor, Tensor]:
    """(dq, dk) from the gradients of rope's outputs (any layout): dx = dy cos + rotate_half_T(dy sin),
    rotate_half_T(g) = cat(g2, -g1); dq and dk laid out in q_order and k_order (rope's inputs' layout,
    [] for contiguous)."""
    return _rope_run(dq_out, dk_out, cos, sin, q_order, k_order, True)


@rope_backward.register_fake
def _(dq_out, dk_out, cos, sin, q_order, k_order):
    return _empty_in_order(dq_out, q_order), _empty_in_order(dk_out, k_order)


def _rope_setup(ctx, inputs, output):
    q, k, cos, sin = inputs
    if cos.requires_grad or sin.requires_grad:
        raise _C.Error("fk::rope_forward: argument 'cos': expected cos and sin that need no gradient (rope has "
                       "none for them; Hugging Face makes them under no_grad), got a tensor that requires grad")
    ctx.save_for_backward(cos, sin)
    ctx.orders = (_rope_order(q), _rope_order(k))


def _rope_bwd(ctx, dq_out, dk_out):
    cos, sin = ctx.saved_tensors
    dq, dk = _bwd(ctx, "rope_backward", dq_out, dk_out, cos, sin, *ctx.orders)
    return dq, dk, None, None


_autograd("rope", _rope_bwd, _rope_setup)
# Under autocast q and k run in autocast's dtype; f32 tables stay f32 (the kernel reads them in f32,
# as Hugging Face's q * cos computes in f32 when cos is), tables of another dtype follow q.
_autocast("rope", keep_f32=("cos", "sin"))


# ---- qkv_rope: the attention's input projections and rope -------------------------------------

_HF_ORDER = [0, 2, 1, 3]  # [B, H, T, D] seen over [B, T, H, D] memory (Hugging Face's view + transpose)


def _qkv_sizes(x: Tensor, wq: Tensor, wk: Tensor, wv: Tensor, head_dim: int) -> tuple[int, int, int, int]:
    """(B, T, Hq, Hk), after the checks the kernels and GEMMs need."""
    op = "qkv_rope"
    if x.dim() != 3:
        raise _C.Error(f"fk::{op}: argument 'x': expected [B, T, C], got shape {list(x.shape)}")
    if head_dim <= 0 or head_dim % 2:
        raise _C.Error(f"fk::{op}: argument 'head_dim': expected an even size >= 2, got {head_dim}")
    c = x.shape[2]
    for name, w in (("wq", wq), ("wk", wk), ("wv", wv)):
        if w.dim() != 2 or w.shape[1] != c or w.shape[0] % head_dim or w.dtype != x.dtype:
            raise _C.Error(f"fk::{op}: argument '{name}': expected [heads x {head_dim}, {c}] in x's dtype "
                           f"{x.dtype}, got {w.dtype} {list(w.shape)}")
    if wv.shape[0] != wk.shape[0]:
        raise _C.Error(f"fk::{op}: argument 'wv': expected as many rows as wk ({wk.shape[0]}), got {wv.shape[0]}")
    return x.shape[0], x.shape[1], wq.shape[0] // head_dim, wk.shape[0] // head_dim


def _heads(cols: Tensor, b: int, t: int, head_dim: int) -> Tensor:
    """Columns of a [B T, H D] matrix (any row stride) as [B, H, T, D]: a view."""
    return cols.view(b, t, cols.shape[1] // head_dim, head_dim).transpose(1, 2)


def _hf_empty(x: Tensor, b: int, h: int, t: int, head_dim: int) -> Tensor:
    """An uninitialised [B, H, T, D] tensor over [B, T, H, D] memory, x's dtype and device."""
    return torch.empty_strided((b, h, t, head_dim), (t * h * head_dim, head_dim, h * head_dim, 1), dtype=x.dtype,
                               device=x.device)


@_custom_op("qkv_rope")
def qkv_rope(x: Tensor, wq: Tensor, wk: Tensor, wv: Tensor, cos: Tensor, sin: Tensor,
             head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """(q, k, v) = (rope(x wqᵀ), rope(x wkᵀ), x wvᵀ), each [B, H, T, head_dim] over [B, T, H,
    head_dim] memory: what Hugging Face's attention makes of `proj(x).view(B, T, -1,
    head_dim).transpose(1, 2)` and apply_rotary_pos_emb. x [B, T, C]; wq [Hq head_dim, C], wk and
    wv [Hk head_dim, C], x's dtype; cos, sin as rope's. q and k come from one GEMM over the
    stacked [wq; wk], rope reading its two column blocks in place; v from a second GEMM. The
    backward (qkv_rope_backward) writes the gradients of q and k before rope side by side, so
    that x's gradient is one GEMM over them plus v's, accumulated in place, with no sum apart."""
    b, t, hq, hk = _qkv_sizes(x, wq, wk, wv, head_dim)
    _same_device("qkv_rope", x=x, wq=wq, wk=wk, wv=wv, cos=cos, sin=sin)
    x2 = x.reshape(b * t, x.shape[2])
    nq = wq.shape[0]
    qk = torch.mm(x2, torch.cat((wq, wk)).t())
    q, k, v = _hf_empty(x, b, hq, t, head_dim), _hf_empty(x, b, hk, t, head_dim), _hf_empty(x, b, hk, t, head_dim)
    torch.mm(x2, wv.t(), out=v.transpose(1, 2).view(b * t, -1))
    _rope_into(_heads(qk[:, :nq], b, t, head_dim), _heads(qk[:, nq:], b, t, head_dim), cos, sin, q, k, False)
    return q, k, v


@qkv_rope.register_fake
def _(x, wq, wk, wv, cos, sin, head_dim):
    b, t, hq, hk = _qkv_sizes(x, wq, wk, wv, head_dim)
    return _hf_empty(x, b, hq, t, head_dim), _hf_empty(x, b, hk, t, head_dim), _hf_empty(x, b, hk, t, head_dim)


@_custom_op("qkv_rope_backward")
def qkv_rope_backward(dq: Tensor, dk: Tensor, dv: Tensor, x: Tensor, wq: Tensor, wk: Tensor, wv: Tensor,
                      cos: Tensor, sin: Tensor, need_x: bool,
                      need_w: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, dwq, dwk, dwv) from the gradients of qkv_rope's outputs (any layout): rope's backward
    writes dq and dk before rope into the two column blocks of one [B T, (Hq + Hk) D] matrix G;
    dx = G [wq; wk] + dv wv (the second GEMM accumulating into the first's output), dwq, dwk, dwv
    = Gqᵀ x, Gkᵀ x, dvᵀ x. Outputs not needed (need_x, need_w) are empty."""
    head_dim = dq.shape[-1]
    b, t, hq, hk = _qkv_sizes(x, wq, wk, wv, head_dim)
    m, nq = b * t, wq.shape[0]
    x2 = x.reshape(m, x.shape[2])
    g = torch.empty(m, nq + wk.shape[0], dtype=x.dtype, device=x.device)
    _rope_into(dq, dk, cos, sin, _heads(g[:, :nq], b, t, head_dim), _heads(g[:, nq:], b, t, head_dim), True)
    dv2 = dv.transpose(1, 2).reshape(m, -1)
    empty = x.new_empty(0)
    dx = empty
    if need_x:
        dx = torch.mm(g, torch.cat((wq, wk))).view(x.shape)
        dx.view(m, -1).addmm_(dv2, wv)
    if not need_w:
        return dx, empty, empty, empty
    return dx, torch.mm(g[:, :nq].t(), x2), torch.mm(g[:, nq:].t(), x2), torch.mm(dv2.t(), x2)


@qkv_rope_backward.register_fake
def _(dq, dk, dv, x, wq, wk, wv, cos, sin, need_x, need_w):
    empty = x.new_empty(0)
    dx = torch.empty_like(x, memory_format=torch.contiguous_format) if need_x else empty
    if not need_w:
        return dx, empty, empty, empty
    return dx, *(torch.empty(w.shape, dtype=w.dtype, device=w.device) for w in (wq, wk, wv))


def _qkv_rope_setup(ctx, inputs, output):
    x, wq, wk, wv, cos, sin, _ = inputs
    if cos.requires_grad or sin.requires_grad:
        raise _C.Error("fk::qkv_rope: argument 'cos': expected cos and sin that need no gradient (rope has "
                       "none for them; Hugging Face makes them under no_grad), got a tensor that requires grad")
    ctx.save_for_backward(x, wq, wk, wv, cos, sin)


def _qkv_rope_bwd(ctx, dq, dk, dv):
    x, wq, wk, wv, cos, sin = ctx.saved_tensors
    b, t, d = x.shape[0], x.shape[1], cos.shape[-1]
    dq, dk, dv = (g if g is not None else torch.zeros(b, w.shape[0] // d, t, d, dtype=x.dtype, device=x.device)
                  for g, w in ((dq, wq), (dk, wk), (dv, wv)))
    need_x, need_w = ctx.needs_input_grad[0], any(ctx.needs_input_grad[1:4])
    dx, dwq, dwk, dwv = _bwd(ctx, "qkv_rope_backward", dq, dk, dv, x, wq, wk, wv, cos, sin, need_x, need_w)
    grads = (dx if need_x else None,) + tuple(
        g if need else None for g, need in zip((dwq, dwk, dwv), ctx.needs_input_grad[1:4]))
    return grads + (None, None, None)


_autograd("qkv_rope", _qkv_rope_bwd, _qkv_rope_setup)
_autocast("qkv_rope", keep_f32=("cos", "sin"))
