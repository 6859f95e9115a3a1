"""qgemm: y = x w̃ᵀ from 4-bit weights (W4A16), and the weights' packing."""
from __future__ import annotations

import torch
from torch import Tensor

from .. import _C
from ._registry import _custom_op, _stream, _same_device, _d


@_custom_op("qgemm")
def qgemm(x: Tensor, packed: Tensor, scale: Tensor, zero: Tensor, n: int, k: int, group: int) -> Tensor:
    """y [M, n] = x [M, k] · w̃ᵀ, w̃ the 4-bit weight quantize_weights made (docs/qgemm.md)."""
    _same_device("qgemm", x=x, packed=packed, scale=scale, zero=zero)
    y = x.new_empty((x.shape[0], n))
    _C.qgemm(_d(x), _d(packed), _d(scale), _d(zero), n, k, group, _d(y), _stream(x))
    return y


@qgemm.register_fake
def _(x, packed, scale, zero, n, k, group):
    return x.new_empty((x.shape[0], n))


def quantize_weights(w: Tensor, group: int = 128) -> tuple[Tensor, Tensor, Tensor]:
    """(packed, scale, zero) of w [N, K] (f16 / bf16) in qgemm's layout, on w's device. The
    quantization runs on the host (once, at model load); the results are copied by PyTorch."""
    packed, scale, zero = _C.quantize_weights(w.detach().cpu(), group)
    return tuple(torch.from_dlpack(t).to(w.device) for t in (packed, scale, zero))


def dequantize_weights(packed: Tensor, scale: Tensor, zero: Tensor, n: int, k: int, group: int) -> Tensor:
    out = scale.new_empty((n, k))
    _C.dequantize_weights(_d(packed), _d(scale), _d(zero), n, k, group, _d(out), _stream(packed))
    return out
