"""The plain function API over torch.ops.fusekit.* (autograd and torch.compile included)."""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from . import _C, ops


def bias_act(x: Tensor, bias: Optional[Tensor] = None, residual: Optional[Tensor] = None, *,
             act: str = "relu", alpha: float = 1.0) -> Tensor:
    """act(x + alpha * residual + bias) over x's last dimension, in one pass (and one back).
    act: identity, relu, sigmoid, tanh, gelu_tanh, gelu_erf, silu."""
    return ops.call("bias_act", x, bias, residual, act, alpha)[0]


def softmax(x: Tensor) -> Tensor:
    """softmax over the last dimension."""
    return ops.call("softmax", x)


def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, scale: Optional[float] = None,
              return_lse: bool = False):
    """softmax(scale q kᵀ) v, q [B, H, Sq, D], k, v [B, H, Sk, D] (scale defaults to 1/sqrt(D)),
    as F.scaled_dot_product_attention computes it; forward only."""
    out, lse = ops.call("attention", q, k, v, causal, 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    return (out, lse) if return_lse else out


class Packed(NamedTuple):
    """A tensor packed by fusekit.pack: the words and per-group statistics, and how to read them."""
    words: Tensor
    scale: Tensor
    min: Tensor
    cols: int
    dtype: torch.dtype
    bits: int
    group: int

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.words, self.scale, self.min))


def pack(x: Tensor, bits: int = 2, group: int = 256, *, stochastic: bool = False, seed: int = 0,
         offset: int = 0, stats_dtype: torch.dtype = torch.bfloat16) -> Packed:
    """x [rows, cols] quantized group-wise (min/max) to 1, 2, 4 or 8 bits and packed."""
    words, scale, mn = ops.call("pack", x, bits, group, stochastic, seed, offset, stats_dtype)
    return Packed(words, scale, mn, x.shape[1], x.dtype, bits, group)


def unpack(p: Packed, dtype: Optional[torch.dtype] = None) -> Tensor:
    return ops.call("unpack", p.words, p.scale, p.min, p.cols, p.bits, p.group, p.dtype if dtype is None else dtype)


def relu_packed(x: Tensor) -> tuple[Tensor, Tensor]:
    """(relu(x), its 1-bit mask); the backward reads only the mask."""
    return ops.call("relu_packed", x)


def weight_grad_from_packed(dy: Tensor, x: Packed, dw_dtype: torch.dtype = torch.float32) -> Tensor:
    """dW = dyᵀ · unpack(x) from the packed bits: dy [K, COUT] bf16, x packed from [K, CIN]."""
    return ops.call("weight_grad_from_packed", dy, x.words, x.scale, x.min, x.cols, x.dtype, x.bits, x.group, dw_dtype)


def glu(x: Tensor, w: Tensor, bias: Optional[Tensor] = None, *, kind: str = "swiglu",
        allow_tf32: Optional[bool] = None) -> Tensor:
    """glu(L, R) with [L, R] = x wᵀ + b (torch.chunk order), w [2N, K] in PyTorch's layout
    (prepared on each call: fusekit.nn.GLU keeps it prepared). kind: sigmoid_tanh, swiglu,
    geglu_tanh, geglu_erf, reglu. allow_tf32 follows torch.backends.cuda.matmul.allow_tf32."""
    if allow_tf32 is None:
        allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    lead = x.shape[:-1]
    out = ops.call("glu", x.reshape(-1, x.shape[-1]), ops.prepare_glu_weight(w),
                  None if bias is None else ops.prepare_glu_weight(bias), kind, allow_tf32)
    return out.reshape(*lead, out.shape[-1])


def lora(x: Tensor, w: Tensor, a: Tensor, b: Tensor, bias: Optional[Tensor] = None, *, scale: float = 1.0,
         act: str = "identity") -> Tensor:
    """act(x Wᵀ + bias + scale (x Aᵀ) Bᵀ) with W frozen (PEFT's layout: A [r, K], B [N, r])."""
    if w.requires_grad and torch.is_grad_enabled():
        raise _C.Error("fk::lora_forward: argument 'w': expected a frozen weight (requires_grad=False): "
                         "fusekit's LoRA computes no gradient for W")
    lead = x.shape[:-1]
    y = ops.call("lora", x.reshape(-1, x.shape[-1]), w, bias, a, b, act, scale)[0]
    return y.reshape(*lead, y.shape[-1])
