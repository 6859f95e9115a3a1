"""primitives: softmax, attention (dense and varlen) with its backward, broadcast binary ops, row
sum, 2-D convolution, batched matmul."""
from __future__ import annotations

import torch
from torch import Tensor

from .. import _C
from ._registry import (_empty_in_order, _unit_rows, _custom_op, _autograd, _autocast, _bwd, _stream, _rows,
                        _same_device, _dlpack, _d, _input)


@_custom_op("softmax")
def softmax(x: Tensor) -> Tensor:
    """softmax over the last dimension (one online pass per row); x of any layout (the kernel reads
    a contiguous copy where x is not contiguous)."""
    if not x.is_contiguous():
        x = x.contiguous()
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    xs, ys = (x, y) if x.dim() == 2 else (_rows(x, "softmax", "x"), _rows(y, "softmax", "y"))
    _C.softmax(_dlpack(xs), _dlpack(ys), _stream(x))
    return y


@softmax.register_fake
def _(x):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _softmax_setup(ctx, inputs, output):
    ctx.save_for_backward(output)


def _softmax_backward(ctx, dy):
    (y,) = ctx.saved_tensors
    return y * (dy - (dy * y).sum(-1, keepdim=True))


_autograd("softmax", _softmax_backward, _softmax_setup)


def _empty_in_layout_of(t: Tensor) -> Tensor:
    """An uninitialised tensor of t's shape whose dimensions lie in memory in t's order (by stride,
    the last one innermost), densely: the outputs and gradients of attention take their input's
    layout (Hugging Face's q, a [B, S, H, D] projection seen as [B, H, S, D], gets an out and a dq
    that its transposes and reshapes read without a copy)."""
    return _empty_in_order(t, sorted(range(t.dim()), key=lambda i: (-t.stride(i), i)))


@_custom_op("attention")
def attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, bottom_right: bool = False,
              window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
              deterministic: bool = False) -> tuple[Tensor, Tensor]:
    """(out, lse): softmax(s) v per (batch, head), s = scale q kᵀ (softcap tanh(s / softcap) when
    softcap > 0) over the visible keys (causal top-left or, bottom_right, bottom-right; a sliding
    window of window_left keys before and window_right after the diagonal, -1 unbounded), q
    [B, H, Sq, D], k, v [B, Hk, Sk, D] with H a multiple of Hk (grouped-query heads); lse
    [B, H, Sq] f32, the log-sum-exp of each row. Its backward is attention_backward; deterministic
    is for it (dq summed in a fixed order: the same bits on every run)."""
    _same_device("attention_forward", q=q, k=k, v=v)
    q, k, v = (_unit_rows(t) for t in (q, k, v))
    out = _empty_in_layout_of(q)
    lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
    _C.attention_forward(_d(q), _d(k), _d(v), _d(out), _d(lse), causal, bottom_right, window_left, window_right, scale,
                         softcap, _stream(q))
    return out, lse


@attention.register_fake
def _(q, k, v, causal, scale, bottom_right=False, window_left=-1, window_right=-1, softcap=0.0, deterministic=False):
    return _empty_in_layout_of(_unit_rows(q)), q.new_empty(q.shape[:-1], dtype=torch.float32)


@_custom_op("attention_backward")
def attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                       scale: float, bottom_right: bool, window_left: int, window_right: int,
                       softcap: float, deterministic: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of attention's out from dout and the forward's q, k, v, out, lse (dk and dv
    summed over each group of q heads); deterministic: dq summed in a fixed order."""
    _same_device("attention_backward", dout=dout, q=q, k=k, v=v, out=out, lse=lse)
    dout, q, k, v, out = (_unit_rows(t) for t in (dout, q, k, v, out))
    lse = lse.contiguous()
    dq, dk, dv = _empty_in_layout_of(q), _empty_in_layout_of(k), _empty_in_layout_of(v)
    _C.attention_backward(_d(q), _d(k), _d(v), _d(out), _d(dout), _d(lse), _d(dq), _d(dk), _d(dv), causal,
                          bottom_right, window_left, window_right, scale, softcap, deterministic, _stream(q))
    return dq, dk, dv


@attention_backward.register_fake
def _(dout, q, k, v, out, lse, causal, scale, bottom_right, window_left, window_right, softcap, deterministic=False):
    return tuple(_empty_in_layout_of(_unit_rows(t)) for t in (q, k, v))


def _attention_setup(ctx, inputs, output):
    q, k, v, causal, scale, *rest = inputs  # the eager path passes what the caller passed: defaults for the rest
    ctx.options = (causal, scale, *rest, *(False, -1, -1, 0.0, False)[len(rest):])
    ctx.set_materialize_grads(False)  # lse carries no gradient
    ctx.save_for_backward(q, k, v, output[0], output[1])


def _attention_bwd(ctx, dout, _dlse):
    if dout is None:
        return (None,) * 10
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _bwd(ctx, "attention_backward", dout, q, k, v, out, lse, *ctx.options)
    return (dq, dk, dv) + (None,) * 7


_autograd("attention", _attention_bwd, _attention_setup)
_autocast("attention")


@_custom_op("attention_varlen")
def attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                     max_seqlen_k: int, causal: bool, scale: float, bottom_right: bool = False, window_left: int = -1,
                     window_right: int = -1, softcap: float = 0.0,
                     deterministic: bool = False) -> tuple[Tensor, Tensor]:
    """(out, lse) of attention over sequences packed without padding (flash_attn_varlen_func's
    layout): sequence b is rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q [total_q, H, D] and rows
    cu_seqlens_k[b]:cu_seqlens_k[b + 1] of k, v [total_k, Hk, D], and sees only its own keys; the
    options as attention's, per sequence. cu_seqlens [B + 1] int32 on q's device; lse [H, total_q]
    f32. deterministic is for the backward (dq summed in a fixed order)."""
    _same_device("attention_forward_varlen", q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    q, k, v = (_unit_rows(t) for t in (q, k, v))
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    out = _empty_in_layout_of(q)
    lse = q.new_empty(_varlen_lse_shape(q), dtype=torch.float32)
    _C.attention_forward_varlen(_d(q), _d(k), _d(v), _d(out), _d(lse), _d(cu_seqlens_q), _d(cu_seqlens_k), max_seqlen_q,
                                max_seqlen_k, causal, bottom_right, window_left, window_right, scale, softcap, _stream(q))
    return out, lse


def _varlen_lse_shape(q: Tensor) -> tuple:
    """lse's [H, total_q] (anything for a q of the wrong rank: the kernel's check names q)."""
    return (q.shape[1], q.shape[0]) if q.dim() == 3 else (0,)


@attention_varlen.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, bottom_right=False,
      window_left=-1, window_right=-1, softcap=0.0, deterministic=False):
    return _empty_in_layout_of(_unit_rows(q)), q.new_empty(_varlen_lse_shape(q), dtype=torch.float32)


@_custom_op("attention_backward_varlen")
def attention_backward_varlen(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                              cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                              causal: bool, scale: float, bottom_right: bool, window_left: int, window_right: int,
                              softcap: float, deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of attention_varlen's out from dout and the forward's tensors (dk and dv summed
    over each group of q heads)."""
    _same_device("attention_backward_varlen", dout=dout, q=q, k=k, v=v, out=out, lse=lse, cu_seqlens_q=cu_seqlens_q,
                 cu_seqlens_k=cu_seqlens_k)
    dout, q, k, v, out = (_unit_rows(t) for t in (dout, q, k, v, out))
    lse, cu_seqlens_q, cu_seqlens_k = (t.contiguous() for t in (lse, cu_seqlens_q, cu_seqlens_k))
    dq, dk, dv = _empty_in_layout_of(q), _empty_in_layout_of(k), _empty_in_layout_of(v)
    _C.attention_backward_varlen(_d(q), _d(k), _d(v), _d(out), _d(dout), _d(lse), _d(dq), _d(dk), _d(dv),
                                 _d(cu_seqlens_q), _d(cu_seqlens_k), max_seqlen_q, max_seqlen_k, causal, bottom_right,
                                 window_left, window_right, scale, softcap, deterministic, _stream(q))
    return dq, dk, dv


@attention_backward_varlen.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, bottom_right,
      window_left, window_right, softcap, deterministic):
    return tuple(_empty_in_layout_of(_unit_rows(t)) for t in (q, k, v))


def _attention_varlen_setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, *rest = inputs  # eager: defaults not passed are absent
    ctx.options = (max_q, max_k, causal, scale, *rest, *(False, -1, -1, 0.0, False)[len(rest):])
    ctx.set_materialize_grads(False)  # lse carries no gradient
    ctx.save_for_backward(q, k, v, cu_q, cu_k, output[0], output[1])


def _attention_varlen_bwd(ctx, dout, _dlse):
    if dout is None:
        return (None,) * 14
    q, k, v, cu_q, cu_k, out, lse = ctx.saved_tensors
    dq, dk, dv = _bwd(ctx, "attention_backward_varlen", dout, q, k, v, out, lse, cu_q, cu_k, *ctx.options)
    return (dq, dk, dv) + (None,) * 11


_autograd("attention_varlen", _attention_varlen_bwd, _attention_varlen_setup)
_autocast("attention_varlen")


@_custom_op("broadcast_binary")
def broadcast_binary(x: Tensor, y: Tensor, op: str) -> Tensor:
    """z = f(x, y) with NumPy broadcasting, f add, mul or mul_relu (relu(x * y) fused); x, y
    contiguous, one dtype; fp32 arithmetic, one rounding."""
    _same_device("broadcast_binary", x=x, y=y)
    z = x.new_empty(torch.broadcast_shapes(x.shape, y.shape))
    _C.broadcast_binary(op, _d(x), _d(y), _d(z), _stream(x))
    return z


@broadcast_binary.register_fake
def _(x, y, op):
    return x.new_empty(torch.broadcast_shapes(x.shape, y.shape))


@_custom_op("broadcast_binary_backward")
def broadcast_binary_backward(x: Tensor, y: Tensor, dz: Tensor, op: str, need_dx: bool,
                              need_dy: bool) -> tuple[Tensor, Tensor]:
    """(dx, dy): dz times f's partial derivative, summed over the broadcast dimensions in a fixed
    order; an empty tensor for a gradient not asked for."""
    dz = dz.contiguous() if not dz.is_contiguous() else dz
    dx = torch.empty_like(x) if need_dx else x.new_empty(0)
    dy = torch.empty_like(y) if need_dy else y.new_empty(0)
    _C.broadcast_binary_backward(op, _d(x), _d(y), _d(dz), _d(dx) if need_dx else None, _d(dy) if need_dy else None,
                                 _stream(x))
    return dx, dy


@broadcast_binary_backward.register_fake
def _(x, y, dz, op, need_dx, need_dy):
    return (torch.empty_like(x) if need_dx else x.new_empty(0)), (torch.empty_like(y) if need_dy else y.new_empty(0))


def _broadcast_binary_setup(ctx, inputs, output):
    x, y, op = inputs
    ctx.op, ctx.need = op, (x.requires_grad, y.requires_grad)
    ctx.save_for_backward(x, y)


def _broadcast_binary_bwd(ctx, dz):
    x, y = ctx.saved_tensors
    dx, dy = _bwd(ctx, "broadcast_binary_backward", x, y, dz, ctx.op, *ctx.need)
    return (dx if ctx.need[0] else None), (dy if ctx.need[1] else None), None


_autograd("broadcast_binary", _broadcast_binary_bwd, _broadcast_binary_setup)


@_custom_op("row_sum")
def row_sum(x: Tensor, out_dtype: torch.dtype) -> Tensor:
    """out [...] = the sum over x's last dimension (fp32 accumulation, a fixed order), in
    out_dtype (f32 or x's dtype)."""
    out = x.new_empty(x.shape[:-1], dtype=out_dtype)
    _C.row_sum(_d(_rows(x, "row_sum", "x")), _d(out.view(-1)), _stream(x))
    return out


@row_sum.register_fake
def _(x, out_dtype):
    return x.new_empty(x.shape[:-1], dtype=out_dtype)


def _row_sum_setup(ctx, inputs, output):
    ctx.shape, ctx.dtype = inputs[0].shape, inputs[0].dtype


def _row_sum_bwd(ctx, dout):
    return dout.to(ctx.dtype).unsqueeze(-1).expand(ctx.shape), None


_autograd("row_sum", _row_sum_bwd, _row_sum_setup)


def _conv2d_shape(x: Tensor, w: Tensor, padding: str) -> tuple:
    h, wd = x.shape[2], x.shape[3]
    if padding == "valid":
        h, wd = h - w.shape[2] + 1, wd - w.shape[3] + 1
    return (x.shape[0], w.shape[0], h, wd)


@_custom_op("conv2d")
def conv2d(x: Tensor, w: Tensor, padding: str) -> Tensor:
    """Cross-correlation, stride 1, NCHW: x [N, C, H, W], w [O, C, KH, KW]; padding valid, same
    (PyTorch's) or same_end (all after). Forward only."""
    _same_device("conv2d", x=x, w=w)
    if x.dim() != 4 or w.dim() != 4:
        raise _C.Error(f"fk::conv2d: argument '{'x' if x.dim() != 4 else 'w'}': expected a rank-4 tensor, got shape "
                       f"{list(x.shape if x.dim() != 4 else w.shape)}")
    y = x.new_empty(_conv2d_shape(x, w, padding))
    _C.conv2d(_d(x), _d(w), _d(y), padding, _stream(x))
    return y


@conv2d.register_fake
def _(x, w, padding):
    return x.new_empty(_conv2d_shape(x, w, padding))


@_custom_op("batched_matmul")
def batched_matmul(a: Tensor, b: Tensor, impl: str, out_dtype: torch.dtype) -> Tensor:
    """c [B, M, N] = a [B, M, K] @ b [B, K, N], fp32 accumulation, c in out_dtype (f32 or the
    operands'); impl cublas or cute (fusekit's tensor-core kernel, bf16 / f16). Forward only."""
    _same_device("batched_matmul", a=a, b=b)
    c = a.new_empty((a.shape[0], a.shape[1], b.shape[-1]), dtype=out_dtype)
    _C.batched_matmul(_d(a), _d(b), _d(c), impl, _stream(a))
    return c


@batched_matmul.register_fake
def _(a, b, impl, out_dtype):
    return a.new_empty((a.shape[0], a.shape[1], b.shape[-1]), dtype=out_dtype)
