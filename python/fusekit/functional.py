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
              return_lse: bool = False, bottom_right: bool = False, window: tuple[int, int] = (-1, -1),
              softcap: float = 0.0, deterministic: bool = False):
    """softmax(scale q kᵀ) v, q [B, H, Sq, D], k, v [B, Hk, Sk, D] (H a multiple of Hk: grouped-
    query heads, as F.scaled_dot_product_attention's enable_gqa), scale defaulting to 1/sqrt(D):
    causal top-left as SDPA's is_causal, or bottom-right (bottom_right=True, FlashAttention's);
    window = (left, right) keys around the diagonal (-1: unbounded); softcap c > 0 caps the scores
    to c tanh(s / c). Differentiable; deterministic=True sums the backward's dq in a fixed order
    (the same bits on every run, at some cost in speed; dk and dv are deterministic either way).
    On an H100/H200 (sm_90) bf16/f16 at head dims 64 and 128 without window or softcap (grouped-
    query heads and either causal alignment included) run the wgmma forward and, unless
    deterministic, the wgmma backward; the rest of the backward in bf16/f16 at head dims 64, 96 and
    128 runs on the mma.sync tensor-core backward (every option, sm_80 and later); everything else
    on simple warp-per-row kernels (correct, not fast). q, k, v (and the incoming gradient) may be
    in any layout whose last dimension is contiguous, as Hugging Face's [B, S, H, D] projections
    seen as [B, H, S, D]: the sm_90 kernels read them in place (the others read contiguous copies),
    and out, dq, dk, dv take q's, k's and v's layouts."""
    left, right = window
    out, lse = ops.call("attention", q, k, v, causal, 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale,
                        bottom_right, left, right, softcap, deterministic)
    return (out, lse) if return_lse else out


def attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                     max_seqlen_k: int, *, causal: bool = False, scale: Optional[float] = None,
                     return_lse: bool = False, bottom_right: bool = False, window: tuple[int, int] = (-1, -1),
                     softcap: float = 0.0, deterministic: bool = False):
    """attention over a batch of sequences packed without padding, as flash_attn_varlen_func takes
    it: q [total_q, H, D], k, v [total_k, Hk, D]; sequence b is rows cu_seqlens_q[b] to
    cu_seqlens_q[b + 1] of q and cu_seqlens_k[b] to cu_seqlens_k[b + 1] of k and v (cu_seqlens
    [B + 1] int32 on q's device, max_seqlen_* at least every length) and sees only its own keys.
    Options as attention's, per sequence: causal is top-left unless bottom_right (FlashAttention's
    causal=True is bottom_right=True; the two agree where a sequence has as many queries as keys).
    deterministic: the backward's dq summed in a fixed order. lse (return_lse) is [H, total_q] f32.
    On a GPU cu_seqlens are trusted as FlashAttention trusts them (checked on the CPU).
    Differentiable; on a GPU it takes the same kernels as attention: on an H100/H200 (sm_90)
    bf16/f16 at D 64/128 without window or softcap run the wgmma forward and (unless deterministic)
    backward, the rest of the backward for bf16/f16 at D 64/96/128 the mma.sync tensor-core
    kernels, everything else (the forward with a window or softcap included) the warp-per-row
    kernels (correct, not fast)."""
    left, right = window
    out, lse = ops.call("attention_varlen", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                        1.0 / math.sqrt(q.shape[-1]) if scale is None else scale, bottom_right, left, right, softcap,
                        deterministic)
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
        allow_tf32: Optional[bool] = None, gate: str = "first", recompute: bool = False) -> Tensor:
    """act(G) · U with [G, U] = x wᵀ + b (torch.chunk order: the gate first, as the GLU-variants
    paper and Hugging Face's gate_proj / up_proj write it), w [2N, K] in PyTorch's layout (prepared
    on each call: fusekit.nn.GLUFeedForward keeps it prepared). kind: swiglu silu(G) U, geglu_tanh
    and geglu_erf gelu(G) U, reglu relu(G) U, sigmoid_tanh sigmoid(G) tanh(U). gate="second" takes
    the gate from the second half instead (geglu's l · gelu(r) of fusekit's C++ kernels).
    allow_tf32 follows torch.backends.cuda.matmul.allow_tf32. recompute=False (the default) keeps
    the [M, 2N] pre-activations from the forward for the backward (M 2N values of the operand
    dtype; on an H100 1.06-1.12x cuBLAS + separate passes, docs/glu.md); True recomputes x wᵀ + b
    in the backward instead (less memory, one more GEMM: 0.80-0.86x)."""
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
    tables stacked in weights [sum(table_rows), D] (f32, bf16 or f16; rows pooled in f32, out
    f32); indices (i64, the row within its table) and offsets (i64 [T * B + 1]) table-major CSR,
    as FBGEMM's TBE takes them. The gradient is a dense [sum(table_rows), D] tensor of the
    weights' dtype (fusekit.nn.EmbeddingBagCollection fuses an optimizer instead). Indices on a
    GPU are not checked here: check_bags or the module does that."""
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


def linear_cross_entropy(h: Tensor, weight: Tensor, targets: Tensor, bias: Optional[Tensor] = None, *,
                         ignore_index: int = -100, label_smoothing: float = 0.0, z_loss: float = 0.0,
                         reduction: str = "mean") -> Tensor:
    """F.cross_entropy(F.linear(h, weight, bias), targets) (+ z_loss · logsumexp², PaLM's z-loss)
    without the [tokens, vocabulary] logits in memory: h [..., H], weight [V, H], targets int64
    [...] (h's leading shape); ignore_index and label_smoothing as F.cross_entropy takes them,
    reduction "mean" or "sum". The gradients are computed by the forward (in the same chunked
    pass), and only for what requires grad: none at all under torch.no_grad() or for frozen inputs.
    Under autocast, h, weight and bias run in autocast's dtype, as F.linear's do."""
    return ops.call_first("linear_cross_entropy", h, weight, bias, targets, ignore_index, float(label_smoothing),
                          float(z_loss), reduction, ops.needs_grad(h), ops.needs_grad(weight, bias))



def rms_norm(x: Tensor, weight: Tensor, eps: Optional[float] = 1e-6, offset: float = 0.0,
             out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """RMSNorm over x's last dimension: x · rstd · (weight + offset), rstd = 1 / sqrt(mean(x²) + eps)
    in f32 (offset 0: LLaMA's, 1: Gemma's (1 + weight)); eps None is torch.finfo(x.dtype).eps, as in
    F.rms_norm. out's dtype is the promotion of x's and weight's, as Hugging Face's LlamaRMSNorm
    gives it (f32 for an f32 weight with bf16 x; F.rms_norm would give bf16); `out_dtype` bf16 or
    f16 for f32 x and weight gives that f32 result rounded once (what autocast would hand the next
    GEMM), in half the bytes."""
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    return ops.call_first("rms_norm", x, weight, float(eps), float(offset), out_dtype)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: Optional[float] = 1e-6,
                 offset: float = 0.0, out_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor]:
    """(rms_norm(x + residual, weight, eps, offset), x + residual) in one read of x and residual:
    the residual add and the norm that follows it in a pre-norm transformer block. The sum is in
    the promotion of x's and residual's dtypes (a bf16 x added to f32 rows as it is read);
    `out_dtype` as in rms_norm."""
    if eps is None:
        eps = torch.finfo(torch.promote_types(x.dtype, residual.dtype)).eps
    out, residual_out, _ = ops.call("add_rms_norm", x, residual, weight, float(eps), float(offset), out_dtype)
    return out, residual_out



def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """(q cos + rotate_half(q) sin, k cos + rotate_half(k) sin) in one pass over q and k (see
    fusekit.ops.rope): q [B, Hq, T, D], k [B, Hk, T, D], cos and sin [T, D], [1, T, D] or [B, T, D]."""
    return ops.call("rope", q, k, cos, sin)


_ROPE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope_fits(q, k, cos, sin, head_axis: int) -> bool:
    """Whether fusekit's rope computes apply_rotary_pos_emb for these arguments: q and k of rank 4
    with heads on head_axis (1 or 2) and the sequence on the other, cos and sin [B or 1, T, D] that
    need no gradient, D even, one dtype for q and k and one for cos and sin (f32, bf16, f16), one
    device."""
    if not all(type(t) in (Tensor, torch.nn.Parameter) for t in (q, k, cos, sin)):
        return False  # a subclass keeps its own rules through the torch expression
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape:
        return False
    seq_axis = 3 - head_axis
    d = q.shape[-1]
    if d % 2 or d == 0 or k.shape[-1] != d or cos.shape[-1] != d:
        return False
    if k.shape[0] != q.shape[0] or cos.shape[0] not in (1, q.shape[0]):
        return False
    if not (q.shape[seq_axis] == k.shape[seq_axis] == cos.shape[1]):
        return False
    if q.dtype != k.dtype or q.dtype not in _ROPE_DTYPES or cos.dtype != sin.dtype or cos.dtype not in _ROPE_DTYPES:
        return False
    if not (q.device == k.device == cos.device == sin.device):
        return False
    return not (torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad))


def apply_rotary_pos_emb(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids=None, unsqueeze_dim: int = 1):
    """Hugging Face's apply_rotary_pos_emb (LLaMA and the models that copy it), with its signature, as
    one fused pass over q and k: q * cos + rotate_half(q) * sin, and the same for k, with cos and
    sin [B, T, D] unsqueezed at unsqueeze_dim (1: q, k [B, H, T, D]; 2: [B, T, H, D]).
    position_ids is ignored, as by Hugging Face (older releases had it in the signature; newer ones
    pass unsqueeze_dim fifth, which is taken as such when it is an int). Grouped-query k, any
    strides; outputs laid out as q and k. Dtype as Hugging Face's (q's and cos's promoted) outside
    autocast; under autocast q's autocast dtype, where Hugging Face gives f32 for f32 tables (the
    values SDPA reads after its autocast cast are the same). Arguments the kernel cannot take
    (cos or sin needing a gradient, other ranks or dtypes, an odd D) run as Hugging Face's torch
    expression."""
    if isinstance(position_ids, int) and not isinstance(position_ids, bool):
        unsqueeze_dim = position_ids
    head_axis = unsqueeze_dim % 4 if isinstance(cos, Tensor) and cos.dim() == 3 and -4 <= unsqueeze_dim <= 3 else 0
    if head_axis in (1, 2) and _rope_fits(q, k, cos, sin, head_axis):
        if not ops._registry._autocast_enabled(q.device.type):
            dtype = torch.promote_types(q.dtype, cos.dtype)
            if dtype != q.dtype:
                q, k = q.to(dtype), k.to(dtype)
            if cos.dtype not in (dtype, torch.float32):
                cos, sin = cos.to(dtype), sin.to(dtype)
        if head_axis == 2:
            q_out, k_out = ops.call("rope", q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            return q_out.transpose(1, 2), k_out.transpose(1, 2)
        return ops.call("rope", q, k, cos, sin)
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _qkv_rope_fits(x: Tensor, wq: Tensor, wk: Tensor, wv: Tensor, cos: Tensor, sin: Tensor, head_dim: int) -> bool:
    """Whether the fused op computes qkv_rope's torch expression for these arguments (see qkv_rope)."""
    tensors = (x, wq, wk, wv, cos, sin)
    if not all(type(t) in (Tensor, torch.nn.Parameter) for t in tensors):
        return False
    if x.dim() != 3 or any(w.dim() != 2 or w.shape[1] != x.shape[2] for w in (wq, wk, wv)):
        return False
    if head_dim <= 0 or head_dim % 2 or any(w.shape[0] % head_dim for w in (wq, wk, wv)) or wv.shape != wk.shape:
        return False
    if cos.dim() != 3 or cos.shape != sin.shape or cos.shape[0] not in (1, x.shape[0]) or \
            tuple(cos.shape[1:]) != (x.shape[1], head_dim):
        return False
    if any(t.dtype not in _ROPE_DTYPES for t in tensors) or cos.dtype != sin.dtype:
        return False
    if not ops._registry._autocast_enabled(x.device.type):
        if any(w.dtype != x.dtype for w in (wq, wk, wv)) or torch.promote_types(x.dtype, cos.dtype) != x.dtype:
            return False
    if any(t.device != x.device for t in tensors):
        return False
    return not (torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad))


def qkv_rope(x: Tensor, wq: Tensor, wk: Tensor, wv: Tensor, cos: Tensor, sin: Tensor,
             head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """Hugging Face LLaMA attention's inputs from its normed hidden states x [B, T, C]:
    q = apply_rotary_pos_emb of x wqᵀ, k the same of x wkᵀ, v = x wvᵀ, each seen as [B, H, T,
    head_dim] (`.view(B, T, -1, head_dim).transpose(1, 2)`), cos and sin [B or 1, T, head_dim].
    One fused op (torch.ops.fusekit.qkv_rope) where it applies: q and k from one GEMM over [wq; wk]
    with rope reading its column blocks; in the backward, rope's gradients written side by side so
    that x's gradient is one GEMM plus v's accumulated into it (no three-way sum). Dtypes as the
    torch expression (autocast's under autocast); other arguments (biases are not taken: add them
    after, or use the projections) run as that expression."""
    if _qkv_rope_fits(x, wq, wk, wv, cos, sin, head_dim):
        return ops.call("qkv_rope", x, wq, wk, wv, cos, sin, head_dim)
    b, t = x.shape[0], x.shape[1]
    q, k, v = (torch.nn.functional.linear(x, w).view(b, t, -1, head_dim).transpose(1, 2) for w in (wq, wk, wv))
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    return q, k, v
