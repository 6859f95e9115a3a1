"""quant: packed activations, 1-bit ReLU masks, the weight gradient from packed bits."""
from __future__ import annotations

import torch
from torch import Tensor

from .. import _C
from ._registry import _custom_op, _autograd, _bwd, _stream, _d, _dtype_name


def _packed_shapes(rows: int, cols: int, bits: int, group: int):
    groups = (cols + group - 1) // group if group > 0 else 0
    words = group * bits // 32 if group > 0 else 0
    return (rows, groups, words), (rows, groups)


@_custom_op("pack")
def pack(x: Tensor, bits: int, group: int, stochastic: bool, seed: int, offset: int,
         stats_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """(words i32 [rows, groups, group*bits/32], scale, min [rows, groups]): x [rows, cols]
    quantized group-wise to `bits` (1, 2, 4, 8) and packed (docs/quant-format.md)."""
    if x.dim() != 2:
        raise _C.Error(f"fk::pack: argument 'x': expected a matrix [rows, cols], got shape {list(x.shape)}")
    wshape, sshape = _packed_shapes(x.shape[0], x.shape[1], bits, group)
    words = x.new_empty(wshape, dtype=torch.int32)
    scale = x.new_empty(sshape, dtype=stats_dtype)
    mn = x.new_empty(sshape, dtype=stats_dtype)
    _C.pack(_d(x), _d(words), _d(scale), _d(mn), bits, group, stochastic, seed, offset, _stream(x))
    return words, scale, mn


@pack.register_fake
def _(x, bits, group, stochastic, seed, offset, stats_dtype):
    wshape, sshape = _packed_shapes(x.shape[0], x.shape[1], bits, group)
    return (x.new_empty(wshape, dtype=torch.int32), x.new_empty(sshape, dtype=stats_dtype),
            x.new_empty(sshape, dtype=stats_dtype))


@_custom_op("unpack")
def unpack(words: Tensor, scale: Tensor, min: Tensor, cols: int, bits: int, group: int,
           dtype: torch.dtype) -> Tensor:
    """x̂ [rows, cols] = q * scale + min, from what pack returned."""
    out = scale.new_empty((words.shape[0], cols), dtype=dtype)
    _C.unpack(_d(words), _d(scale), _d(min), words.shape[0], cols, bits, group, _d(out), _stream(words))
    return out


@unpack.register_fake
def _(words, scale, min, cols, bits, group, dtype):
    return scale.new_empty((words.shape[0], cols), dtype=dtype)


@_custom_op("relu_packed")
def relu_packed(x: Tensor) -> tuple[Tensor, Tensor]:
    """(y, mask): y = relu(x), mask i32 [ceil(numel / 32)] with bit i set where x_i > 0."""
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    mask = x.new_empty(((x.numel() + 31) // 32,), dtype=torch.int32)
    _C.relu_forward_packed(_d(x), _d(y), _d(mask), _stream(x))
    return y, mask


@relu_packed.register_fake
def _(x):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            x.new_empty(((x.numel() + 31) // 32,), dtype=torch.int32))


@_custom_op("relu_packed_backward")
def relu_packed_backward(dy: Tensor, mask: Tensor) -> Tensor:
    dy = dy.contiguous() if not dy.is_contiguous() else dy
    dx = torch.empty_like(dy)
    _C.relu_backward_packed(_d(dy), _d(mask), _d(dx), _stream(dy))
    return dx


@relu_packed_backward.register_fake
def _(dy, mask):
    return torch.empty_like(dy, memory_format=torch.contiguous_format)


def _relu_packed_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1])


def _relu_packed_bwd(ctx, dy, dmask):
    (mask,) = ctx.saved_tensors
    return _bwd(ctx, "relu_packed_backward", dy, mask)


_autograd("relu_packed", _relu_packed_bwd, _relu_packed_setup)


@_custom_op("weight_grad_from_packed")
def weight_grad_from_packed(dy: Tensor, words: Tensor, scale: Tensor, min: Tensor, cols: int,
                            x_dtype: torch.dtype, bits: int, group: int, dw_dtype: torch.dtype) -> Tensor:
    """dW [COUT, CIN] = dyᵀ · unpack(x): dy [K, COUT] bf16 of any layout (a contiguous copy where it is
    not), x packed from [K, CIN]."""
    dy = dy if dy.is_contiguous() else dy.contiguous()
    dw = dy.new_empty((dy.shape[1], cols), dtype=dw_dtype)
    _C.weight_grad_from_packed(_d(dy), _d(words), _d(scale), _d(min), words.shape[0], cols,
                               _dtype_name(x_dtype), bits, group, _d(dw), 0.0, _stream(dy))
    return dw


@weight_grad_from_packed.register_fake
def _(dy, words, scale, min, cols, x_dtype, bits, group, dw_dtype):
    return dy.new_empty((dy.shape[1], cols), dtype=dw_dtype)
