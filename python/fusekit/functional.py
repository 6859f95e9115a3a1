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
    return ops.call_first("bias_act", x, bias, residual, act, alpha, ops.needs_grad(x, bias, residual))


def softmax(x: Tensor) -> Tensor:
    """softmax over the last dimension."""
    return ops.call("softmax", x)


def broadcast_binary(x: Tensor, y: Tensor, op: str = "add") -> Tensor:
    """f(x, y) with NumPy broadcasting: op add, mul or mul_relu (relu(x * y) in one pass)."""
    return ops.call("broadcast_binary", x, y, op)


def outer(x: Tensor, y: Tensor, op: str = "add") -> Tensor:
    """z [N1, N0], z[i, j] = f(x[j], y[i]) for x [N0], y [N1] (the puzzles' outer ops)."""
    return ops.call("broadcast_binary", x.view(1, -1), y.view(-1, 1), op)


def row_sum(x: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    """The sum over the last dimension, accumulated in fp32 in a fixed order; dtype f32 or x's
    (the default)."""
    return ops.call("row_sum", x, x.dtype if dtype is None else dtype)


def conv2d(x: Tensor, w: Tensor, padding: str = "valid") -> Tensor:
    """F.conv2d(x, w) with stride 1 and no bias, NCHW; padding valid, same, or same_end (all the
    padding after: the puzzle's). Forward only."""
    return ops.call("conv2d", x, w, padding)


def batched_matmul(a: Tensor, b: Tensor, *, impl: str = "cublas", out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """torch.bmm(a, b) with fp32 accumulation; impl cublas or cute (fusekit's tensor-core kernel).
    Forward only."""
    return ops.call("batched_matmul", a, b, impl, a.dtype if out_dtype is None else out_dtype)


def convert(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x.to(dtype) between f32, bf16 and f16 (round to nearest even), x contiguous."""
    return ops.call("convert", x, dtype)


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
        allow_tf32: Optional[bool] = None, gate: str = "first", recompute: bool = True) -> Tensor:
    """act(G) · U with [G, U] = x wᵀ + b (torch.chunk order: the gate first, as the GLU-variants
    paper and Hugging Face's gate_proj / up_proj write it), w [2N, K] in PyTorch's layout (prepared
    on each call: fusekit.nn.GLUFeedForward keeps it prepared). kind: swiglu silu(G) U, geglu_tanh
    and geglu_erf gelu(G) U, reglu relu(G) U, sigmoid_tanh sigmoid(G) tanh(U). gate="second" takes
    the gate from the second half instead (geglu's l · gelu(r) of fusekit's C++ kernels).
    allow_tf32 follows torch.backends.cuda.matmul.allow_tf32. recompute (default True, as before):
    the backward recomputes x wᵀ + b; False keeps the [M, 2N] pre-activations from the forward
    instead (one GEMM fewer in the backward, M 2N values of the operand dtype kept)."""
    if allow_tf32 is None:
        allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    if ops.glu_swaps_halves(kind, gate):
        w = torch.cat(w.chunk(2)[::-1])
        bias = None if bias is None else torch.cat(bias.chunk(2)[::-1])
    lead = x.shape[:-1]
    out = ops.glu_prepared(x.reshape(-1, x.shape[-1]), ops.prepare_glu_weight(w),
                           None if bias is None else ops.prepare_glu_weight(bias), kind, allow_tf32, recompute)
    return out.reshape(*lead, out.shape[-1])


# A Hugging Face gated MLP on its own gate/up/down parameters (the keeping path by default).
glu_mlp = ops.glu_mlp


def lora(x: Tensor, w: Tensor, a: Tensor, b: Tensor, bias: Optional[Tensor] = None, *, scale: float = 1.0,
         act: str = "identity") -> Tensor:
    """act(x Wᵀ + bias + scale (x Aᵀ) Bᵀ) with W frozen (PEFT's layout: A [r, K], B [N, r])."""
    if w.requires_grad and torch.is_grad_enabled():
        raise _C.Error("fk::lora_forward: argument 'w': expected a frozen weight (requires_grad=False): "
                         "fusekit's LoRA computes no gradient for W")
    lead = x.shape[:-1]
    y = ops.call_first("lora", x.reshape(-1, x.shape[-1]), w, bias, a, b, act, scale, ops.needs_grad(x, bias, a, b))
    return y.reshape(*lead, y.shape[-1])


def embedding_bags(weights: Tensor, indices: Tensor, offsets: Tensor, table_rows: list, *,
                   pooling: str = "sum") -> Tensor:
    """out [B, T, D]: out[b, t] = the sum (or mean) of the rows of table t in bag t * B + b, the T
    tables stacked in weights [sum(table_rows), D] f32; indices (i64, the row within its table)
    and offsets (i64 [T * B + 1]) table-major CSR, as FBGEMM's TBE takes them. The gradient is a
    dense [sum(table_rows), D] tensor (fusekit.nn.EmbeddingBagCollection fuses an optimizer
    instead). Indices on a GPU are not checked here: check_bags or the module does that."""
    return ops.call_first("embedding_bag", weights, indices, offsets, None, list(table_rows), pooling, "seed",
                          "dense_gradient", 0.0, 0.0, None)


def check_bags(indices: Tensor, offsets: Tensor, table_rows: list, *, op: str = "embedding_bags") -> None:
    """Raises fusekit.Error unless offsets is i64 [T * B + 1], starts at 0, never decreases and
    ends at len(indices), and every index of table t lies in [0, table_rows[t]). On a GPU this
    reads two flags back (two synchronisations); on the CPU the op itself checks."""
    tables = len(table_rows)
    for name, t in (("indices", indices), ("offsets", offsets)):
        if t.dtype != torch.int64 or t.dim() != 1:
            raise _C.Error(f"fk::{op}: argument '{name}': expected a 1-D int64 tensor, got {t.dtype} "
                           f"of shape {list(t.shape)}")
    if offsets.device != indices.device:
        raise _C.Error(f"fk::{op}: argument 'offsets': expected a tensor on {indices.device} (as indices), "
                       f"got {offsets.device}")
    if offsets.numel() < 1 or (offsets.numel() - 1) % tables:
        raise _C.Error(f"fk::{op}: argument 'offsets': expected T * B + 1 values for T = {tables} tables, "
                       f"got {offsets.numel()}")
    nnz = indices.numel()
    if bool(((offsets[0] != 0) | (offsets[-1] != nnz) | (offsets[1:] < offsets[:-1]).any()).item()):
        raise _C.Error(f"fk::{op}: argument 'offsets': expected offsets[0] = 0, non-decreasing, "
                       f"offsets[-1] = len(indices) = {nnz}; got {offsets[0].item()} .. {offsets[-1].item()}"
                       f"{' (decreasing somewhere)' if bool((offsets[1:] < offsets[:-1]).any()) else ''}")
    if nnz == 0:
        return
    batch = (offsets.numel() - 1) // tables
    counts = offsets[::batch].diff() if batch > 0 else offsets.new_zeros(tables)
    rows = torch.tensor(list(table_rows), dtype=torch.int64, device=indices.device)
    limit = torch.repeat_interleave(rows, counts, output_size=nnz)
    bad = (indices < 0) | (indices >= limit)
    if bool(bad.any().item()):
        k = int(bad.nonzero()[0].item())
        t = int(torch.searchsorted(offsets[::batch].cpu(), k, right=True).item()) - 1
        raise _C.Error(f"fk::{op}: argument 'indices': expected rows within their table, got index "
                       f"{int(indices[k].item())} at entry {k}, in table {t} of {table_rows[t]} rows")


def interaction(z: Tensor, kind: str = "dot", self_interaction: bool = False) -> Tensor:
    """r [B, I] from z [B, F, D] f32 (see fusekit.ops.interaction); kind dot, cat or outer."""
    return ops.call("interaction", z, kind, self_interaction)


def sigmoid_bce(logits: Tensor, labels: Tensor) -> Tensor:
    """The mean binary cross-entropy of sigmoid(logits) against labels (f32 [B]), as
    F.binary_cross_entropy_with_logits; one pass computes the loss and its gradient."""
    return ops.call_first("sigmoid_bce", logits, labels)


def dense_optimizer_update_(param: Tensor, grad: Tensor, state: Optional[Tensor] = None, *, lr: float,
                            eps: float = 1e-10) -> None:
    """One step in place over a whole f32 parameter: SGD, or Adagrad when state (the running sum
    of squared gradients, param's shape) is given."""
    ops.call("dense_optimizer_update_", param, grad, state, state is not None, lr, eps)
