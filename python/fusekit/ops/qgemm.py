"""qgemm: y = x w̃ᵀ from 4-bit weights (W4A16), and the weights' packing (from a float weight, or
from 4-bit values quantized elsewhere)."""
from __future__ import annotations

import torch
from torch import Tensor

from .. import _C
from ._registry import _custom_op, _d, _dlpack, _stream


@_custom_op("qgemm")
def qgemm(x: Tensor, packed: Tensor, scale: Tensor, zero: Tensor, n: int, k: int, group: int,
          constant_weights: bool = False) -> Tensor:
    """y [..., n] = x [..., k] · w̃ᵀ, w̃ the 4-bit weight quantize_weights made (docs/qgemm.md); x of
    any layout (a contiguous copy where it is not contiguous). The kernel's own checks
    (fusekit._C) name any argument of the wrong shape, dtype or device: a decode step calls this
    once per linear layer, so it adds no check of its own, and x's leading dimensions reach the
    kernel as rows without a reshape. constant_weights: the caller's promise that the kernel just
    before this call in the stream did not write packed, scale or zero (QgemmOptions in
    docs/qgemm.md: the weight loads may then start before that kernel has finished)."""
    if not x.is_contiguous():
        x = x.contiguous()
    y = x.new_empty(x.shape[:-1] + (n,))
    _C.qgemm(_dlpack(x), _dlpack(packed), _dlpack(scale), _dlpack(zero), n, k, group, _dlpack(y), _stream(x),
             constant_weights)
    return y


@qgemm.register_fake
def _(x, packed, scale, zero, n, k, group, constant_weights=False):
    return x.new_empty((*x.shape[:-1], n))


def quantize_weights(w: Tensor, group: int = 128) -> tuple[Tensor, Tensor, Tensor]:
    """(packed, scale, zero) of w [N, K] (f16 / bf16) in qgemm's layout, on w's device. The
    quantization runs on the host (once, at model load); the results are copied by PyTorch."""
    packed, scale, zero = _C.quantize_weights(w.detach().cpu(), group)
    return tuple(torch.from_dlpack(t).to(w.device) for t in (packed, scale, zero))


def _words_along_last(v: Tensor) -> Tensor:
    """i32 [..., C / 8]: eight 4-bit values of v [..., C] (C % 8 == 0) per word, value c at bits
    4 (c % 8) of word c / 8."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    words = (v.to(torch.int64).reshape(*v.shape[:-1], -1, 8) << shifts).sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def pack_weights(q: Tensor, scale: Tensor, zero: Tensor, group: int,
                 dtype: torch.dtype = torch.float16) -> tuple[Tensor, Tensor, Tensor]:
    """(packed, scale, zero) in qgemm's layout from weights quantized elsewhere, w̃[n, k] =
    scale[n, k / group] · (q[n, k] − zero[n, k / group]): q [N, K] and zero [N, K / group] integers
    in [0, 15], scale [N, K / group] (rounded to `dtype`, f16 or bf16). K % 8 == 0 and group a
    multiple of 8 dividing K. Runs on the host (a one-time step at model load); the results are on
    q's device."""
    for name, t in (("q", q), ("zero", zero)):
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool or t.dim() != 2:
            raise _C.Error(f"fk::pack_weights: argument '{name}': expected an integer matrix, got "
                           f"{t.dtype} {list(t.shape)}")
        if t.numel() and (int(t.min()) < 0 or int(t.max()) > 15):
            raise _C.Error(f"fk::pack_weights: argument '{name}': expected values in [0, 15], got "
                           f"[{int(t.min())}, {int(t.max())}]")
    n, k = q.shape
    if k % 8:
        raise _C.Error(f"fk::pack_weights: argument 'q': expected [N, K] with K % 8 == 0, got {list(q.shape)}")
    if zero.shape[0] != n:
        raise _C.Error(f"fk::pack_weights: argument 'zero': expected [{n}, groups] (N of q), got {list(zero.shape)}")
    groups = zero.shape[1]
    zero8 = torch.nn.functional.pad(zero.detach().cpu().to(torch.int64), (0, -groups % 8))
    dt = {torch.float16: "f16", torch.bfloat16: "bf16"}.get(dtype, str(dtype))
    packed, s, z = _C.from_puzzle_layout(_words_along_last(q.detach().cpu()), scale.detach().cpu().contiguous(),
                                         _words_along_last(zero8), group, dt)
    return tuple(torch.from_dlpack(t).to(q.device) for t in (packed, s, z))


def dequantize_weights(packed: Tensor, scale: Tensor, zero: Tensor, n: int, k: int, group: int) -> Tensor:
    out = scale.new_empty((n, k))
    _C.dequantize_weights(_d(packed), _d(scale), _d(zero), n, k, group, _d(out), _stream(packed))
    return out
