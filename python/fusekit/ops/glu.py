"""glu: out = glu(x wᵀ + b), w [2N, K] in the prepared (row-interleaved) layout.

Two training paths (docs/glu.md): ``glu`` keeps only x and w for its backward, which recomputes
C = x wᵀ + b in the fused GEMM (``glu_backward``); ``glu_train`` also returns C [M, 2N] (prepared
column order, the operand dtype) and keeps it, so its backward (``glu_backward_from_preact``) runs
one elementwise pass and two GEMMs instead of three GEMMs. ``glu_prepared`` picks between them;
``glu_mlp`` is a whole Hugging Face MLP on its own (unprepared) parameters."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _C
from ._registry import (_custom_op, _autograd, _autocast, _autocast_dtype, _autocast_enabled, _bwd, _stream,
                        _same_device, _d, call, call_first, needs_grad)


# The half of [L, R] = x wᵀ + b that fusekit's kernel for each kind activates (the gate): L, except
# geglu's l · gelu(r).
_KERNEL_GATE = {"sigmoid_tanh": "first", "swiglu": "first", "reglu": "first", "geglu_tanh": "second",
                "geglu_erf": "second"}


def glu_swaps_halves(kind: str, gate: str) -> bool:
    """Whether w's two halves are swapped before the kernel, so that the half named by `gate`
    ("first": torch.chunk's first, Hugging Face's gate_proj; "second") is the one activated."""
    if gate not in ("first", "second"):
        raise _C.Error(f"fk::glu_forward: argument 'gate': expected \"first\" or \"second\", got {gate!r}")
    kernel = _KERNEL_GATE.get(kind)
    if kernel is None:
        raise _C.Error(f"fk::glu_forward: argument 'kind': expected one of {', '.join(_KERNEL_GATE)}, got {kind!r}")
    return kernel != gate


def _contiguous(t: Optional[Tensor]) -> Optional[Tensor]:
    """The kernels read row-major tensors: t, or a contiguous copy of it."""
    return t if t is None or t.is_contiguous() else t.contiguous()


def prepare_glu_weight(w: Tensor) -> Tensor:
    """PyTorch layout [2N, ...] (gate rows, then up rows) -> fusekit's: row 2n = w[n], 2n + 1 = w[N + n]."""
    n = w.shape[0] // 2
    return torch.stack((w[:n], w[n:]), dim=1).reshape(w.shape)


def unprepare_glu_weight(w: Tensor) -> Tensor:
    n = w.shape[0] // 2
    pairs = w.reshape(n, 2, *w.shape[1:])
    return torch.cat((pairs[:, 0], pairs[:, 1]), dim=0)


@_custom_op("glu")
def glu(x: Tensor, w: Tensor, bias: Optional[Tensor], kind: str, allow_tf32: bool) -> Tensor:
    """out [M, N] = glu(L, R), [L, R] = x wᵀ + b; w [2N, K] and bias [2N] prepared."""
    _same_device("glu_forward", x=x, w=w, bias=bias)
    x, w, bias = _contiguous(x), _contiguous(w), _contiguous(bias)
    out = x.new_empty((x.shape[0], w.shape[0] // 2))
    _C.glu_forward(_d(x), _d(w), _d(bias), _d(out), None, kind, allow_tf32, _stream(x))
    return out


@glu.register_fake
def _(x, w, bias, kind, allow_tf32):
    return x.new_empty((x.shape[0], w.shape[0] // 2))


@_custom_op("glu_backward")
def glu_backward(dy: Tensor, x: Tensor, w: Tensor, bias: Optional[Tensor], kind: str,
                 allow_tf32: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dw, dbias), dw and dbias prepared; dbias empty without a bias."""
    dy, x, w, bias = _contiguous(dy), _contiguous(x), _contiguous(w), _contiguous(bias)
    dx, dw = torch.empty_like(x), torch.empty_like(w)
    db = torch.empty_like(bias) if bias is not None else w.new_empty(0)
    _C.glu_backward(_d(dy), _d(x), _d(w), _d(bias), _d(dx), _d(dw), _d(db) if bias is not None else None, kind, allow_tf32,
                    _stream(dy))
    return dx, dw, db


@glu_backward.register_fake
def _(dy, x, w, bias, kind, allow_tf32):
    return torch.empty_like(x), torch.empty_like(w), (torch.empty_like(bias) if bias is not None else w.new_empty(0))


def _glu_setup(ctx, inputs, output):
    x, w, bias, kind, allow_tf32 = inputs
    ctx.kind, ctx.allow_tf32, ctx.with_bias = kind, allow_tf32, bias is not None
    ctx.save_for_backward(x, w, bias)


def _glu_bwd(ctx, dy):
    x, w, bias = ctx.saved_tensors
    dx, dw, db = _bwd(ctx, "glu_backward", dy, x, w, bias, ctx.kind, ctx.allow_tf32)
    return dx, dw, (db if ctx.with_bias else None), None, None


_autograd("glu", _glu_bwd, _glu_setup)
_autocast("glu")


@_custom_op("glu_train")
def glu_train(x: Tensor, w: Tensor, bias: Optional[Tensor], kind: str, allow_tf32: bool) -> tuple[Tensor, Tensor]:
    """(out [M, N], preact [M, 2N]): glu's forward that also returns C = x wᵀ + b (prepared column
    order, the operand dtype), which its backward reads instead of recomputing the GEMM. preact
    carries no gradient."""
    return _glu_train_impl(x, w, bias, kind, allow_tf32)


def _glu_train_impl(x: Tensor, w: Tensor, bias: Optional[Tensor], kind: str, allow_tf32: bool):
    _same_device("glu_forward", x=x, w=w, bias=bias)
    x, w, bias = _contiguous(x), _contiguous(w), _contiguous(bias)
    out, preact = x.new_empty((x.shape[0], w.shape[0] // 2)), x.new_empty((x.shape[0], w.shape[0]))
    _C.glu_forward(_d(x), _d(w), _d(bias), _d(out), _d(preact), kind, allow_tf32, _stream(x))
    return out, preact


@glu_train.register_fake
def _(x, w, bias, kind, allow_tf32):
    return x.new_empty((x.shape[0], w.shape[0] // 2)), x.new_empty((x.shape[0], w.shape[0]))


@_custom_op("glu_backward_from_preact")
def glu_backward_from_preact(dy: Tensor, x: Tensor, w: Tensor, preact: Tensor, with_bias: bool, kind: str,
                             allow_tf32: bool, with_out: bool = False,
                             down_w: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, dw, dbias, out) from glu_train's preact, dw and dbias prepared; dbias empty without a
    bias; out = glu_activate(preact) [M, N] from the same read of preact when with_out, else empty.
    With down_w [K', N] (a gated MLP's down projection), dy [M, K'] is the gradient of its output
    and the gradient of glu's out (dy down_w) is formed inside the op: on Hopper with 16-bit operands
    and with_out, from 128 output tiles of 128 x 128 up, by one GEMM whose epilogue forms dC and out
    with the fast activations (out within an ulp of glu_activate's), never in memory; elsewhere by
    cuBLAS, rounded, before the pass over preact.
    preact is read, not overwritten: a graph kept by retain_graph=True may run this backward twice."""
    dy, x, w, preact, down_w = _contiguous(dy), _contiguous(x), _contiguous(w), _contiguous(preact), _contiguous(down_w)
    dx, dw = torch.empty_like(x), torch.empty_like(w)
    db = w.new_empty(w.shape[0] if with_bias else 0)
    out = preact.new_empty(_activated_shape(preact, with_out))
    _C.glu_backward_from_preact(_d(dy), _d(x), _d(w), _d(preact), _d(dx), _d(dw), _d(db) if with_bias else None,
                                False, _d(out) if with_out else None, kind, allow_tf32, _stream(dy),
                                _d(down_w) if down_w is not None else None)
    return dx, dw, db, out


def _activated_shape(preact: Tensor, with_out: bool) -> tuple[int, int]:
    """glu_activate's [M, N] for preact [M, 2N] when with_out, else [0, N]."""
    return (preact.shape[0] if with_out else 0, preact.shape[1] // 2)


@glu_backward_from_preact.register_fake
def _(dy, x, w, preact, with_bias, kind, allow_tf32, with_out=False, down_w=None):
    return (x.new_empty(x.shape), w.new_empty(w.shape), w.new_empty(w.shape[0] if with_bias else 0),
            preact.new_empty(_activated_shape(preact, with_out)))


def _glu_train_setup(ctx, inputs, output):
    x, w, bias, kind, allow_tf32 = inputs
    ctx.kind, ctx.allow_tf32, ctx.with_bias = kind, allow_tf32, bias is not None
    ctx.set_materialize_grads(False)  # preact carries no gradient: no [M, 2N] of zeros for it
    from ..compress import mark_activation  # C is an activation (packed under compress_saved_tensors)
    mark_activation(output[1])
    ctx.save_for_backward(x, w, output[1])


def _glu_train_bwd(ctx, dy, _dpreact):
    if dy is None:  # out unused downstream
        return None, None, None, None, None
    x, w, preact = ctx.saved_tensors
    dx, dw, db, _ = _bwd(ctx, "glu_backward_from_preact", dy, x, w, preact, ctx.with_bias, ctx.kind, ctx.allow_tf32)
    return dx, dw, (db if ctx.with_bias else None), None, None


_autograd("glu_train", _glu_train_bwd, _glu_train_setup)
_autocast("glu_train")


@_custom_op("glu_activate")
def glu_activate(preact: Tensor, kind: str) -> Tensor:
    """out [M, N] = glu(C) from glu_train's preact C [M, 2N] (prepared order, bias included): the
    forward's out recomputed in one elementwise pass, from C as rounded to the operand dtype."""
    _same_device("glu_activate", preact=preact)
    preact = _contiguous(preact)
    out = preact.new_empty((preact.shape[0], preact.shape[1] // 2))
    _C.glu_activate(_d(preact), _d(out), kind, _stream(preact))
    return out


@glu_activate.register_fake
def _(preact, kind):
    return preact.new_empty((preact.shape[0], preact.shape[1] // 2))


@_custom_op("glu_preact_grad")
def glu_preact_grad(dy: Tensor, preact: Tensor, kind: str, with_out: bool = False) -> tuple[Tensor, Tensor]:
    """(dC, out): dC [M, 2N] (prepared order, preact's dtype) from glu_train's preact C and dy
    [M, N], the elementwise half of glu_backward_from_preact, for a backward that forms dx and dw
    itself; out = glu_activate(preact) [M, N] from the same read of C when with_out, else empty."""
    _same_device("glu_preact_grad", dy=dy, preact=preact)
    dy, preact = _contiguous(dy), _contiguous(preact)
    dpreact = torch.empty_like(preact)
    out = preact.new_empty(_activated_shape(preact, with_out))
    _C.glu_preact_grad(_d(dy), _d(preact), _d(dpreact), _d(out) if with_out else None, kind, _stream(preact))
    return dpreact, out


@glu_preact_grad.register_fake
def _(dy, preact, kind, with_out=False):
    return torch.empty_like(preact), preact.new_empty(_activated_shape(preact, with_out))


@_custom_op("glu_mlp_train")
def glu_mlp_train(x: Tensor, w: Tensor, bias: Optional[Tensor], down_w: Tensor, down_b: Optional[Tensor], kind: str,
                  allow_tf32: bool) -> tuple[Tensor, Tensor]:
    """(y [M, K'], preact [M, 2N]): y = linear(glu(x wᵀ + b), down_w, down_b), a gated MLP whose
    backward keeps C = x wᵀ + b (as glu_train) but not glu's [M, N] out: it recomputes out from C
    for down_w's gradient in the pass that forms dC (glu_backward_from_preact's out), instead of
    keeping M N values."""
    out, preact = _glu_train_impl(x, w, bias, kind, allow_tf32)
    return F.linear(out, down_w, down_b), preact


@glu_mlp_train.register_fake
def _(x, w, bias, down_w, down_b, kind, allow_tf32):
    return x.new_empty((x.shape[0], down_w.shape[0])), x.new_empty((x.shape[0], w.shape[0]))


def _glu_mlp_train_setup(ctx, inputs, output):
    x, w, bias, down_w, down_b, kind, allow_tf32 = inputs
    ctx.kind, ctx.allow_tf32, ctx.with_bias = kind, allow_tf32, bias is not None
    ctx.set_materialize_grads(False)
    from ..compress import mark_activation  # C is an activation (packed under compress_saved_tensors)
    mark_activation(output[1])
    ctx.save_for_backward(x, w, output[1], down_w)


def _glu_mlp_train_bwd(ctx, dy, _dpreact):
    if dy is None:
        return (None,) * 7
    x, w, preact, down_w = ctx.saved_tensors
    need = ctx.needs_input_grad
    dy = dy.reshape(-1, dy.shape[-1])
    d_down_b = dy.sum(0) if need[4] else None
    dx = dw = db = h = None
    if need[0] or need[1] or need[2]:
        dx, dw, db, h = _bwd(ctx, "glu_backward_from_preact", dy, x, w, preact, ctx.with_bias, ctx.kind,
                             ctx.allow_tf32, need[3], down_w)
    elif need[3]:
        h = _bwd(ctx, "glu_activate", preact, ctx.kind)
    d_down_w = dy.t().mm(h) if need[3] else None
    return dx, dw, (db if ctx.with_bias else None), d_down_w, d_down_b, None, None


_autograd("glu_mlp_train", _glu_mlp_train_bwd, _glu_mlp_train_setup)
_autocast("glu_mlp_train")


def glu_prepared(x: Tensor, w: Tensor, bias: Optional[Tensor], kind: str, allow_tf32: bool,
                 recompute: bool) -> Tensor:
    """glu on x [M, K] and the prepared w [2N, K], bias [2N]: when a gradient is recorded, keeping
    the pre-activations [M, 2N] for the backward (recompute=False: two GEMMs in the backward, M 2N
    values of the operand dtype kept) or recomputing them there (recompute=True: three GEMMs,
    nothing but x kept)."""
    if recompute or not needs_grad(x, w, bias):
        return call("glu", x, w, bias, kind, allow_tf32)
    return call_first("glu_train", x, w, bias, kind, allow_tf32)


def glu_mlp(x: Tensor, gate_w: Tensor, up_w: Tensor, down_w: Tensor, kind: str = "swiglu",
            gate_b: Optional[Tensor] = None, up_b: Optional[Tensor] = None, down_b: Optional[Tensor] = None,
            recompute: bool = False, allow_tf32: Optional[bool] = None) -> Tensor:
    """A Hugging Face gated MLP, down_proj(act(gate_proj(x)) * up_proj(x)) (LLaMA's SwiGLU, Gemma's
    GeGLU), on the model's own parameters in PyTorch's layout: gate_w, up_w [N, K], down_w [K', N].
    The prepared [2N, K] weight is built on each call inside autograd (one interleaving copy,
    prepare_glu_weight(cat(gate_w, up_w))), so gradients reach gate_w and up_w as they are and the
    state dict is untouched; then the fused GEMM + activation, then F.linear for down_proj.
    recompute: as glu_prepared. Under autocast the two weights are cast before the interleaving."""
    if (gate_b is None) != (up_b is None):
        raise _C.Error("fk::glu_mlp: argument 'up_b': expected a bias exactly when gate_b has one, got "
                       f"gate_b {'None' if gate_b is None else 'a tensor'} and up_b "
                       f"{'None' if up_b is None else 'a tensor'}")
    if allow_tf32 is None:
        allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    device_type = x.device.type
    if _autocast_enabled(device_type):
        dt = _autocast_dtype(device_type)
        gate_w, up_w = gate_w.to(dt), up_w.to(dt)
        gate_b, up_b = (None, None) if gate_b is None else (gate_b.to(dt), up_b.to(dt))
    swap = glu_swaps_halves(kind, "first")
    first, second = (up_w, gate_w) if swap else (gate_w, up_w)
    n, k = first.shape
    w = torch.stack((first, second), dim=1).reshape(2 * n, k)
    bias = None
    if gate_b is not None:
        bias = torch.stack((up_b, gate_b) if swap else (gate_b, up_b), dim=1).reshape(2 * n)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if not recompute and needs_grad(x2, w, bias, down_w, down_b):
        from ..compress import gated_mlp  # inside compress_saved_tensors: x packed, w's gradient from it
        y = gated_mlp(x2, w, bias, down_w, down_b, kind, allow_tf32)
        if y is None:
            y = call_first("glu_mlp_train", x2, w, bias, down_w, down_b, kind, allow_tf32)
        return y.reshape(*lead, y.shape[-1])
    h = glu_prepared(x2, w, bias, kind, allow_tf32, recompute)
    return F.linear(h.reshape(*lead, n), down_w, down_b)
