"""4-bit checkpoints as GPTQ and AWQ store them, decoded into the values fusekit packs.

Each decoder reads one linear layer's tensors (on any device) and returns a ``W4Values``: the 4-bit
values q [N, K], one zero point and one scale per (row, group of K), so that
w̃[n, k] = scale[n, k / group] · (q[n, k] − zero[n, k / group]) is the checkpoint's weight with its
inputs in the order ``perm`` gives (None: the checkpoint's own order). ``fusekit.nn.W4Linear``
packs them once with ``fusekit.ops.pack_weights`` (docs/qgemm.md, "Importing GPTQ and AWQ
checkpoints").

GPTQ (AutoGPTQ, GPTQModel; transformers' ``quant_method: gptq``), 4 bits:
    qweight i32 [K / 8, N]   q[k, n] at bits 4 (k % 8) of qweight[k / 8, n] (packed along K)
    qzeros  i32 [G, N / 8]   the zero point of (g, n) at bits 4 (n % 8) of qzeros[g, n / 8]
    scales  f16 [G, N]
    g_idx   i32 [K]          the group of input k: k / group, or a permutation of it (act-order)
    w[n, k] = scales[g, n] · (q[k, n] − z[g, n]),  g = g_idx[k]
with z the stored value + 1 in ``checkpoint_format="gptq"`` (v1: AutoGPTQ stores zero − 1 and
its kernels add the 1 back, so a zero point of 0 wraps to 15 and reads as 16) and the stored value
itself in ``"gptq_v2"`` (GPTQModel's internal format).

AWQ (AutoAWQ's GEMM version; transformers' ``quant_method: awq``, ``version: gemm``), 4 bits:
    qweight i32 [K, N / 8]   packed along N: nibble i of qweight[k, c] is q[k, 8c + AWQ_ORDER[i]]
    qzeros  i32 [G, N / 8]   the same order
    scales  f16 [G, N]
    w[n, k] = scales[k / group, n] · (q[k, n] − z[k / group, n])
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from . import _C

# The column of each nibble in AWQ's words: nibble i of word c holds column 8c + AWQ_ORDER[i].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
GPTQ_FORMATS = ("gptq", "gptq_v2")


@dataclass
class W4Values:
    q: Tensor                # u8 [N, K]: 4-bit values, inputs in fusekit's order
    zero: Tensor             # u8 [N, G]: zero points, 0..15
    scale: Tensor            # [N, G], the checkpoint's dtype
    group: int               # K / G
    perm: Optional[Tensor]   # i64 [K]: fusekit's input j is the checkpoint's input perm[j]; None: identity


def _fail(op: str, arg: str, expected: str, got: str):
    raise _C.Error(f"fk::{op}: argument '{arg}': expected {expected}, got {got}")


def _describe(t) -> str:
    return f"{t.dtype} {list(t.shape)}" if isinstance(t, Tensor) else type(t).__name__


def _check_int32(op: str, arg: str, t, rank: int) -> None:
    if not isinstance(t, Tensor) or t.dtype != torch.int32 or t.dim() != rank:
        _fail(op, arg, f"an int32 tensor of rank {rank} (4-bit values packed 8 per word)", _describe(t))


def _check_scales(op: str, t, shape: tuple) -> None:
    if not isinstance(t, Tensor) or t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        _fail(op, "scales", "an f16, bf16 or f32 tensor", _describe(t))
    if tuple(t.shape) != shape:
        _fail(op, "scales", f"shape {list(shape)} (groups, N)", str(list(t.shape)))


def _check_bits(op: str, bits: int) -> None:
    if bits != 4:
        _fail(op, "bits", "4 (fusekit's kernel reads 4-bit weights)", str(bits))


def _nibbles(words: Tensor) -> Tensor:
    """u8 [..., C, 8]: the eight 4-bit fields of each int32 word, lowest bits first."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    return ((words.unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8)


def _group_of_k(op: str, k: int, groups: int) -> int:
    if groups < 1 or k % groups:
        _fail(op, "scales", f"a number of groups that divides K = {k} (fusekit's groups are of one size)",
              str(groups))
    return k // groups


def gptq_values(qweight: Tensor, qzeros: Tensor, scales: Tensor, g_idx: Optional[Tensor] = None, *,
                checkpoint_format: str = "gptq", bits: int = 4, op: str = "W4Linear.from_gptq") -> W4Values:
    """The 4-bit values of one GPTQ layer (the module docstring's layout). With act-order (g_idx not
    k / group) the inputs are sorted by group, and perm records the order."""
    _check_bits(op, bits)
    if checkpoint_format not in GPTQ_FORMATS:
        _fail(op, "checkpoint_format", "'gptq' (v1, AutoGPTQ's) or 'gptq_v2'", repr(checkpoint_format))
    _check_int32(op, "qweight", qweight, 2)
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    if n % 8:
        _fail(op, "qweight", "[K / 8, N] with N % 8 == 0", str(list(qweight.shape)))
    _check_int32(op, "qzeros", qzeros, 2)
    groups = qzeros.shape[0]
    if qzeros.shape[1] != n // 8:
        _fail(op, "qzeros", f"[groups, N / 8 = {n // 8}] (4-bit zero points of qweight's N = {n} outputs)",
              str(list(qzeros.shape)))
    _check_scales(op, scales, (groups, n))
    group = _group_of_k(op, k, groups)
    perm = None
    if g_idx is not None:
        if not isinstance(g_idx, Tensor) or g_idx.dtype not in (torch.int32, torch.int64) or g_idx.dim() != 1:
            _fail(op, "g_idx", "an int32 or int64 vector [K]", _describe(g_idx))
        if g_idx.shape[0] != k:
            _fail(op, "g_idx", f"[K = {k}] (8 times qweight's rows; a checkpoint of other than 4 bits?)",
                  str(list(g_idx.shape)))
        g_idx = g_idx.to(torch.int64)
        if int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
            _fail(op, "g_idx", f"group indices in [0, {groups})", f"[{int(g_idx.min())}, {int(g_idx.max())}]")
        counts = torch.bincount(g_idx, minlength=groups)
        if bool((counts != group).any()):
            _fail(op, "g_idx", f"every group holding K / groups = {group} inputs (fusekit's groups are of one size)",
                  f"group sizes {sorted(set(counts.tolist()))}")
        if not torch.equal(g_idx, torch.arange(k, device=g_idx.device) // group):
            perm = torch.argsort(g_idx, stable=True)
    q = _nibbles(qweight).permute(1, 0, 2).reshape(n, k)                 # [N, K], the checkpoint's order
    zero = _nibbles(qzeros).reshape(groups, n).t().to(torch.int16)        # [N, G], stored values
    if checkpoint_format == "gptq":
        zero = zero + 1
    if perm is not None:
        q = q[:, perm]
    if bool((zero == 16).any()):
        q, zero = _shift_zero_16(op, q, zero, group)
    return W4Values(q, zero.to(torch.uint8), scales.t(), group, perm)


def _shift_zero_16(op: str, q: Tensor, zero: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """GPTQ v1 stores a zero point of 0 as 15 (zero − 1 wrapped), which its kernels read as 16. Where
    the group's values are all >= 1, s (q − 16) = s ((q − 1) − 15) fits fusekit's 4-bit zero points
    exactly; where one is 0, it cannot."""
    at16 = (zero == 16).repeat_interleave(group, dim=1)                  # [N, K]
    if bool((at16 & (q == 0)).any()):
        rows, cols = torch.nonzero(at16 & (q == 0), as_tuple=True)
        _fail(op, "qzeros", "zero points fusekit can hold: a stored 15 (v1's zero point 16) only in groups "
              "whose values are all >= 1",
              f"zero point 16 with a value 0 at output {int(rows[0])}, input {int(cols[0])} (fusekit's order)")
    q = torch.where(at16, q - 1, q)
    return q, torch.where(zero == 16, torch.full_like(zero, 15), zero)


def awq_values(qweight: Tensor, qzeros: Tensor, scales: Tensor, *, bits: int = 4,
               op: str = "W4Linear.from_awq") -> W4Values:
    """The 4-bit values of one AWQ (GEMM version) layer (the module docstring's layout)."""
    _check_bits(op, bits)
    _check_int32(op, "qweight", qweight, 2)
    k, n = qweight.shape[0], qweight.shape[1] * 8
    _check_int32(op, "qzeros", qzeros, 2)
    groups = qzeros.shape[0]
    if qzeros.shape[1] != n // 8:
        _fail(op, "qzeros", f"[groups, N / 8 = {n // 8}] (the N of qweight [K, N / 8])", str(list(qzeros.shape)))
    _check_scales(op, scales, (groups, n))
    group = _group_of_k(op, k, groups)
    column = torch.tensor(AWQ_ORDER, device=qweight.device)
    # Nibble i of word c is column 8c + AWQ_ORDER[i]: scatter the nibbles to their columns.
    order = torch.argsort(column)
    q = _nibbles(qweight)[..., order].reshape(k, n).t()
    zero = _nibbles(qzeros)[..., order].reshape(groups, n).t()
    return W4Values(q, zero, scales.t(), group, None)
