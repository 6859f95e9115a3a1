"""fusekit.compress_saved_tensors: every large floating-point activation autograd saves for the
backward is kept packed at 1, 2, 4 or 8 bits (fusekit's pack / unpack kernels, group-wise min/max
quantization, docs/quant-format.md) and unpacked when the backward reads it, so that an unmodified
PyTorch model trains in less memory.

    with fusekit.compress_saved_tensors(bits=4):
        loss = model(x).loss
    loss.backward()

What is packed: a floating-point tensor (f32, bf16, f16) of at least `min_bytes`, on a device
fusekit's kernels run on (CPU, CUDA), that autograd saves during the `with` block, that is the
result of a differentiable op (it has a ``grad_fn``: an activation) and that is not a parameter's
copy: not a view or a cast of an ``nn.Parameter`` (autocast's bf16 copy of an f32 weight).
Everything else is kept as autograd would keep it: parameters, integer, small and f64 tensors, and
tensors no gradient flows through, such as the statistics an op saves beside its output (the
attention's log-sum-exp, which a 4-bit rounding would turn into wrong softmax weights) and inputs. A tensor saved twice (by two ops) is packed once; both get the same
packed copy.

The packed copy: the tensor's values in memory order, in groups of `group` consecutive values,
each group quantized to `bits` between its minimum and maximum (bf16 scale and minimum), with
unbiased stochastic rounding ("stochastic", the default) or to the nearest level ("nearest"). Its
size is numel * bits / 8 bytes plus 4 bytes a group: at 4 bits and group 256 a bf16 tensor takes
0.26x its bytes, an f32 one 0.13x. The backward reads x̂ = q * scale + min, rounded once to the
tensor's dtype, with the tensor's shape and strides.

Stochastic rounding draws from Philox with a key per `with` block (`seed`, or a counter of the
blocks entered in this process, from 0) and a subsequence per packed tensor, so that a run
repeats exactly. The hooks apply to eager autograd (the graph torch.compile's AOT autograd
builds saves its own tensors).
"""
from __future__ import annotations

import itertools
import threading
import weakref
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from .ops import quant as _quant
from .ops._registry import _autocast_dtype, _autocast_enabled

__all__ = ["active", "compress_saved_tensors", "gated_mlp", "leave_unpacked", "linear", "mark_activation"]

_BITS = (1, 2, 4, 8)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BLOCKS = itertools.count()  # `with` blocks entered in this process: the default seeds


@dataclass
class _Packed:
    """A saved tensor's memory region in packed form, and what is needed to give the tensor back."""
    words: Tensor
    scale: Tensor
    min: Tensor
    dtype: torch.dtype
    rows: int
    cols: int
    bits: int
    group: int
    users: int = 0  # saved tensors (views) reading this copy whose backward has not unpacked it yet
    unpacked: Optional[Tensor] = None  # the region unpacked, kept until its last user has read it

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.words, self.scale, self.min))


@dataclass
class _Saved:
    """One saved tensor: its region's packed copy (shared by every view of the region) and its
    shape and strides over that region."""
    packed: _Packed
    shape: torch.Size
    stride: tuple


def leave_unpacked(*tensors: Optional[Tensor]) -> None:
    """Marks tensors an op saves that are not activations (the gradients fusekit's fused linear +
    cross-entropy computes in its forward) so that compress_saved_tensors keeps them as they are."""
    if active() is None or torch.compiler.is_compiling():
        return
    for t in tensors:
        if t is not None:
            t._fusekit_unpacked = True


def mark_activation(*tensors: Optional[Tensor]) -> None:
    """Marks tensors an op saves that are activations although autograd has not yet given them a
    grad_fn when they are saved (an op's extra outputs, such as the GLU's pre-activations C), so
    that compress_saved_tensors packs them on every dispatch path."""
    if active() is None or torch.compiler.is_compiling():
        return
    for t in tensors:
        if t is not None:
            t._fusekit_activation = True


# The ops between parameters and a tensor an op saves for them: casts, views, and the
# concatenations that build one weight from several (fusekit's GLU interleaves gate and up).
_WEIGHT_PATH = ("ToCopyBackward", "TBackward", "ViewBackward", "PermuteBackward", "TransposeBackward",
                "ExpandBackward", "UnsafeViewBackward", "ReshapeAliasBackward", "CatBackward", "StackBackward",
                "UnsqueezeBackward", "SqueezeBackward", "CloneBackward", "AliasBackward")


def _is_parameter(t: Tensor) -> bool:
    """t is a parameter (nn.Parameter), a view of one, or computed from parameters alone through
    views, casts and concatenations (autocast's bf16 copy of an f32 weight, its transpose, a weight
    stacked from two): what autograd saves for a weight's use, which is not an activation."""
    if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter):
        return True
    if t.grad_fn is None:
        return False
    todo, seen = [t.grad_fn], 0
    while todo:
        fn = todo.pop()
        seen += 1
        if seen > 32:
            return False
        name = type(fn).__name__
        if name == "AccumulateGrad":
            if not isinstance(getattr(fn, "variable", None), torch.nn.Parameter):
                return False
            continue
        if not name.startswith(_WEIGHT_PATH):
            return False
        nxt = [f for f, _ in fn.next_functions if f is not None]
        if not nxt:
            return False
        todo.extend(nxt)
    return True


def _region(t: Tensor) -> Optional[tuple[int, int]]:
    """(first element, element count) of the storage region t covers when t is dense over it (no
    gaps or overlaps, in any order), else None."""
    n = t.numel()
    if n == 0:
        return None
    span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if size > 1)
    if span != n or any(stride < 0 for stride in t.stride()):
        return None
    if not t.is_contiguous():
        dims = [d for d in range(t.dim()) if t.shape[d] > 1]
        expect = 1
        for d in sorted(dims, key=lambda d: t.stride(d)):
            if t.stride(d) != expect:
                return None
            expect *= t.shape[d]
    return t.storage_offset(), n


class _Block:
    """What the hooks of one `with` block share (a nested block at other bits included): the seed,
    the next Philox subsequence, the table of tensors packed so far, the stats."""

    def __init__(self, seed: int):
        self.seed, self.subsequence, self.seen = seed, 0, {}
        self.stats = {"tensors": 0, "bytes": 0, "packed_bytes": 0, "passed": 0, "by_bits": {},
                      "bytes_by_bits": {}}


_ACTIVE = threading.local()  # .stack: the compress_saved_tensors blocks entered on this thread


def active() -> Optional["compress_saved_tensors"]:
    """The innermost compress_saved_tensors block entered on this thread, or None."""
    stack = getattr(_ACTIVE, "stack", None)
    return stack[-1] if stack else None


class compress_saved_tensors(torch.autograd.graph.saved_tensors_hooks):
    """Keeps the activations autograd saves inside the block packed at `bits` (see the module's
    docstring). `attention_bits` (8; None: `bits`) is what fusekit's patched decoder layers use
    for their attention's saved tensors (q, k, v, its output), where a 4-bit rounding moves the
    softmax more than an MLP's activations move. `stats` after the block: {"tensors", "bytes",
    "packed_bytes", "passed", "by_bits", "bytes_by_bits"}: how many tensors were packed (and how
    many at each bits), their bytes before and after (in all, and at each bits), and how many
    saved tensors were left as they were."""

    def __init__(self, bits: int = 4, group: int = 256, rounding: str = "stochastic", min_bytes: int = 1 << 20,
                 seed: Optional[int] = None, attention_bits: Optional[int] = 8):
        for name, b in (("bits", bits), ("attention_bits", bits if attention_bits is None else attention_bits)):
            if b not in _BITS:
                raise ValueError(f"fusekit.compress_saved_tensors: argument '{name}': expected one of 1, 2, 4, 8, "
                                 f"got {b!r}")
            if not isinstance(group, int) or group <= 0 or group % (32 // b) != 0:
                raise ValueError(f"fusekit.compress_saved_tensors: argument 'group': expected a positive multiple "
                                 f"of {32 // b} (32 / bits), got {group!r}")
        if rounding not in ("stochastic", "nearest"):
            raise ValueError(f"fusekit.compress_saved_tensors: argument 'rounding': expected 'stochastic' or "
                             f"'nearest', got {rounding!r}")
        if not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(f"fusekit.compress_saved_tensors: argument 'min_bytes': expected an int >= 0, "
                             f"got {min_bytes!r}")
        self.bits, self.group, self.rounding, self.min_bytes = bits, group, rounding, min_bytes
        self.attention_bits = bits if attention_bits is None else attention_bits
        self._seed = seed
        self._block: Optional[_Block] = None
        self._outer: Optional[_Block] = None  # set for a nested block (for_attention)
        self._bits_4d: Optional[int] = None  # a nested attention block: the bits of 4-D tensors
        super().__init__(self._pack, _unpack)

    @property
    def seed(self) -> Optional[int]:
        return None if self._block is None else self._block.seed

    @property
    def stats(self) -> dict:
        if self._block is None:
            return {"tensors": 0, "bytes": 0, "packed_bytes": 0, "passed": 0, "by_bits": {}, "bytes_by_bits": {}}
        return self._block.stats

    def for_attention(self) -> "compress_saved_tensors":
        """A block nested in this one, sharing its seed, subsequences, table and stats, for an
        attention module: the attention's own saved tensors, 4-D [batch, heads, tokens, head_dim]
        (q, k, v, its output), at attention_bits; the projections' inputs at bits."""
        inner = compress_saved_tensors(self.bits, self.group, self.rounding, self.min_bytes, attention_bits=None)
        inner._outer, inner._bits_4d = self._block, self.attention_bits
        return inner

    def __enter__(self):
        if self._outer is not None:
            self._block = self._outer
        else:
            self._block = _Block(self._seed if self._seed is not None else next(_BLOCKS))
        stack = getattr(_ACTIVE, "stack", None)
        if stack is None:
            stack = _ACTIVE.stack = []
        stack.append(self)
        super().__enter__()
        return self

    def __exit__(self, *exc):
        _ACTIVE.stack.remove(self)
        if self._outer is None:
            self._block.seen = {}  # the graph holds the packed copies; the block's table goes
        return super().__exit__(*exc)

    def _packable(self, t: Tensor) -> bool:
        return (isinstance(t, Tensor) and (t.grad_fn is not None or getattr(t, "_fusekit_activation", False))
                and t.dtype in _DTYPES
                and t.device.type in ("cpu", "cuda") and t.numel() * t.element_size() >= max(self.min_bytes, 1)
                and not t.is_sparse and type(t) is Tensor and not getattr(t, "_fusekit_unpacked", False)
                and not _is_parameter(t))

    def _pack(self, t: Tensor):
        saved = self._pack_tensor(t) if self._packable(t) else None
        if saved is None:
            self._block.stats["passed"] += 1
            return t
        return saved

    def _pack_tensor(self, t: Tensor, reads: bool = True) -> Optional[_Saved]:
        """t's region packed (or the copy of it packed already), or None where t is not dense.
        reads: the backward will unpack it (False: it reads the packed copy itself)."""
        block = self._block
        region = _region(t)
        if region is None:
            return None
        start, n = region
        base = t if t._base is None else t._base
        key = (t.untyped_storage().data_ptr(), start, n, t.dtype, t._version)
        hit = block.seen.get(key)
        if hit is not None and hit[0]() is base:  # another view of a region packed already
            hit[1].users += int(reads)
            return _Saved(hit[1], t.shape, t.stride())
        bits = self._bits_4d if self._bits_4d is not None and t.dim() == 4 else self.bits
        flat = t.detach().as_strided((n,), (1,), start)  # the region in memory order
        rows, cols = (n // self.group, self.group) if n % self.group == 0 else (1, n)
        words, scale, mn = _quant.pack(flat.view(rows, cols), bits, self.group, self.rounding == "stochastic",
                                       block.seed, block.subsequence, torch.bfloat16)
        block.subsequence += 1
        packed = _Packed(words, scale, mn, t.dtype, rows, cols, bits, self.group, users=int(reads))
        block.stats["tensors"] += 1
        block.stats["by_bits"][bits] = block.stats["by_bits"].get(bits, 0) + 1
        block.stats["bytes"] += n * t.element_size()
        block.stats["packed_bytes"] += packed.nbytes()
        both = block.stats["bytes_by_bits"].setdefault(bits, [0, 0])
        both[0] += n * t.element_size()
        both[1] += packed.nbytes()
        block.seen[key] = (weakref.ref(base), packed)
        return _Saved(packed, t.shape, t.stride())


def _unpack(s):
    """The saved tensor, from its region's packed copy. Views of one region (q, k and v's
    projections read one activation) are unpacked once: the first read keeps the unpacked region
    until the last of them has read it (their backwards run one after another)."""
    if not isinstance(s, _Saved):
        return s
    p = s.packed
    flat = p.unpacked
    if flat is None:
        flat = _quant.unpack(p.words, p.scale, p.min, p.cols, p.bits, p.group, p.dtype)
    p.users -= 1
    p.unpacked = flat if p.users > 0 else None
    return flat.as_strided(s.shape, s.stride, 0)


# ---- the fused path: a linear layer whose weight gradient reads the packed input ---------------

class _PackedLinear(torch.autograd.Function):
    """y = x wᵀ + b computed in `dtype`, x kept packed (x2 [M, K], K a multiple of the group); the
    backward's dW = dyᵀ x̂ comes from weight_grad_from_packed, which reads the packed words (x is
    never unpacked to memory), dx = dy w."""

    @staticmethod
    def forward(ctx, x, weight, bias, saved, dtype):
        with torch.autocast(x.device.type, enabled=False):
            w = weight.to(dtype)
            y = torch.nn.functional.linear(x.to(dtype), w, None if bias is None else bias.to(dtype))
        ctx.saved, ctx.x_shape = saved, x.shape
        ctx.save_for_backward(weight)
        ctx.with_bias, ctx.bias_dtype = bias is not None, None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        (weight,) = ctx.saved_tensors
        p = ctx.saved.packed
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dw = db = None
        need = ctx.needs_input_grad
        if need[0]:
            dx = dy2.mm(weight.to(dy2.dtype)).view(ctx.x_shape)
        if need[1]:
            k = ctx.x_shape[-1]
            m, g = p.rows * p.cols // k, k // p.group
            dw = _quant.weight_grad_from_packed(dy2, p.words.view(m, g, -1), p.scale.view(m, g), p.min.view(m, g), k,
                                                p.dtype, p.bits, p.group, weight.dtype)
        if ctx.with_bias and need[2]:
            db = dy2.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return dx, dw, db, None, None


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """F.linear(x, weight, bias); inside a compress_saved_tensors block, with x an activation of at
    least min_bytes, contiguous, its last size a multiple of the group, and the weight needing a
    gradient: x kept packed (one copy shared with every other save of it) and weight's gradient
    computed from the packed copy by weight_grad_from_packed, never unpacked. Under autocast the
    GEMM runs in autocast's dtype, as F.linear's. The weight's gradient is accumulated in fp32 and
    written in the weight's dtype; the bias's is dy's column sums in fp32."""
    hook = None if torch.compiler.is_compiling() else active()
    if hook is None or not weight.requires_grad or weight.dim() != 2:
        return torch.nn.functional.linear(x, weight, bias)
    device = x.device.type
    dtype = _autocast_dtype(device) if _autocast_enabled(device) else x.dtype
    k = x.shape[-1]
    # the CUDA kernel takes bf16 dy; the CPU spec any floating dtype
    usable = (dtype == torch.bfloat16 or device == "cpu") and dtype in _DTYPES and x.dtype == dtype
    if not (usable and hook._packable(x) and x.is_contiguous() and k % hook.group == 0
            and (bias is None or bias.dim() == 1)):
        return torch.nn.functional.linear(x, weight, bias)
    saved = hook._pack_tensor(x, reads=False)
    if saved is None:
        return torch.nn.functional.linear(x, weight, bias)
    return _PackedLinear.apply(x, weight, bias, saved, dtype)


class _PackedGluMlp(torch.autograd.Function):
    """y = down(glu(x wᵀ + b)) (fusekit's glu_mlp_train) with x and the pre-activations C kept
    packed: the backward unpacks C once for dC and the activation (glu_preact_grad's two outputs,
    the second for down's weight gradient), and takes w's gradient from the packed x
    (weight_grad_from_packed)."""

    @staticmethod
    def forward(ctx, x, w, bias, down_w, down_b, kind, allow_tf32, hook, x_saved):
        y, preact = torch.ops.fusekit.glu_mlp_train(x, w, bias, down_w, down_b, kind, allow_tf32)
        ctx.kind, ctx.with_bias, ctx.x_saved = kind, bias is not None, x_saved
        ctx.c_saved = hook._pack_tensor(preact)  # an op's output: no grad_fn here, packed by hand
        ctx.save_for_backward(w, down_w)
        return y

    @staticmethod
    def backward(ctx, dy):
        w, down_w = ctx.saved_tensors
        preact = _unpack(ctx.c_saved)
        need = ctx.needs_input_grad
        dy = dy.reshape(-1, dy.shape[-1])
        dx = dw = db = d_down_w = None
        d_down_b = dy.sum(0) if need[4] else None
        if not (need[0] or need[1] or need[2]):
            if need[3]:
                d_down_w = dy.t().mm(torch.ops.fusekit.glu_activate(preact, ctx.kind))
        else:
            dc, h = torch.ops.fusekit.glu_preact_grad(dy.mm(down_w), preact, ctx.kind, need[3])
            preact = None
            if need[3]:
                d_down_w = dy.t().mm(h)
            h = None
            if need[0]:
                dx = dc.mm(w)
            if need[1]:
                p, k = ctx.x_saved.packed, w.shape[1]
                m, g = p.rows * p.cols // k, k // p.group
                dw = _quant.weight_grad_from_packed(dc, p.words.view(m, g, -1), p.scale.view(m, g), p.min.view(m, g),
                                                    k, p.dtype, p.bits, p.group, w.dtype)
            if ctx.with_bias and need[2]:
                db = dc.sum(0, dtype=torch.float32).to(dc.dtype)
        return dx, dw, db, d_down_w, d_down_b, None, None, None, None


def gated_mlp(x: Tensor, w: Tensor, bias: Optional[Tensor], down_w: Tensor, down_b: Optional[Tensor], kind: str,
              allow_tf32: bool) -> Optional[Tensor]:
    """Inside a compress_saved_tensors block: glu_mlp_train (x [M, K], w the prepared [2N, K]) with
    x kept packed (one copy shared with every other save of it) and w's gradient computed from it
    by weight_grad_from_packed, C packed at the block's bits. None where it does not apply (outside
    a block, under torch.compile, x small or not contiguous, K not a multiple of the group, a GEMM
    dtype other than bf16 on a GPU): the caller then runs glu_mlp_train as it is."""
    hook = None if torch.compiler.is_compiling() else active()
    if hook is None or not (w.requires_grad or x.requires_grad):
        return None
    dtype = x.dtype
    usable = (dtype == torch.bfloat16 or x.device.type == "cpu") and dtype in _DTYPES and w.dtype == dtype
    if not (usable and hook._packable(x) and x.is_contiguous() and x.shape[1] % hook.group == 0):
        return None
    saved = hook._pack_tensor(x, reads=False)
    if saved is None:
        return None
    if down_w.dtype != dtype:  # under autocast: down's GEMMs in x's dtype, the cast recorded by autograd
        down_w, down_b = down_w.to(dtype), (None if down_b is None else down_b.to(dtype))
    return _PackedGluMlp.apply(x, w, bias, down_w, down_b, kind, allow_tf32, hook, saved)
