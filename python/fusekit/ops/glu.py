"""glu: out = glu(x wᵀ + b), w [2N, K] in the prepared (row-interleaved) layout."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import _C
from ._registry import _custom_op, _autograd, _autocast, _bwd, _stream, _same_device, _d


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
    out = x.new_empty((x.shape[0], w.shape[0] // 2))
    _C.glu_forward(_d(x), _d(w), _d(bias), _d(out), kind, allow_tf32, _stream(x))
    return out


@glu.register_fake
def _(x, w, bias, kind, allow_tf32):
    return x.new_empty((x.shape[0], w.shape[0] // 2))


@_custom_op("glu_backward")
def glu_backward(dy: Tensor, x: Tensor, w: Tensor, bias: Optional[Tensor], kind: str,
                 allow_tf32: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dw, dbias), dw and dbias prepared; dbias empty without a bias."""
    dy = dy.contiguous() if not dy.is_contiguous() else dy
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
