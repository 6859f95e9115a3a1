"""Writes a float weight as a 4-bit GPTQ or AWQ checkpoint stores it, for the import tests: no
download, and the layouts written from their definitions here rather than through fusekit's
decoders (fusekit/w4_formats.py), so that a test of one against the other means something.

Each writer quantizes w [N, K] per (row, group of K) as the tool does (GPTQ's min/max quantizer
with its symmetric option; AWQ's min/max with a zero point), without GPTQ's error feedback or AWQ's
activation-aware scaling: those change which 4-bit values are stored, not how they are stored. It
returns the tensors under the names the checkpoint uses, and `Truth`: the integer values, the
zero points the tool's own dequantization subtracts and the f16 scales, with w̃ = s (q − z)."""
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column 8c + AWQ_ORDER[i]


@dataclass
class Truth:
    q: np.ndarray        # int [N, K], the checkpoint's input order
    zero: np.ndarray     # int [N, G], as the tool's dequantization subtracts it (v1: stored + 1)
    scale: np.ndarray    # f16 [N, G]
    g_idx: np.ndarray    # int [K]: the group of each input

    def weight(self) -> torch.Tensor:
        """w̃ [N, K] f64: s (q − z), exact."""
        s = self.scale.astype(np.float64)[:, self.g_idx]
        return torch.from_numpy(s * (self.q - self.zero[:, self.g_idx]).astype(np.float64))


def _pack_rows(v: np.ndarray) -> np.ndarray:
    """[R, C] values < 16 → [R / 8, C] int32, rows 8r..8r+7 at nibbles 0..7 of row r."""
    u = v.astype(np.uint32)
    out = np.zeros((u.shape[0] // 8, u.shape[1]), dtype=np.uint32)
    for i in range(8):
        out |= u[i::8] << np.uint32(4 * i)
    return out.view(np.int32)


def _pack_cols(v: np.ndarray, order=tuple(range(8))) -> np.ndarray:
    """[R, C] values < 16 → [R, C / 8] int32, nibble i of word c holding column 8c + order[i]."""
    u = v.astype(np.uint32)
    out = np.zeros((u.shape[0], u.shape[1] // 8), dtype=np.uint32)
    for i in range(8):
        out |= u[:, order[i]::8] << np.uint32(4 * i)
    return out.view(np.int32)


def _gptq_params(x: np.ndarray, sym: bool):
    """GPTQ's quantizer on the rows of x [N, cols]: (f16 scale [N], zero [N]) for 4 bits."""
    xmin, xmax = np.minimum(x.min(1), 0), np.maximum(x.max(1), 0)
    if sym:
        xmax = np.maximum(np.abs(xmin), xmax)
        xmin = np.where(xmin < 0, -xmax, xmin)
    both0 = (xmin == 0) & (xmax == 0)
    xmin, xmax = np.where(both0, -1, xmin), np.where(both0, 1, xmax)
    scale = ((xmax - xmin) / 15).astype(np.float16)
    zero = np.full(x.shape[0], 8) if sym else np.round(-xmin / scale.astype(np.float64)).astype(np.int64)
    return scale, zero


def to_gptq(w: torch.Tensor, group: int, act_order: bool = False, sym: bool = True, checkpoint_format: str = "gptq",
            bias: Optional[torch.Tensor] = None, seed: int = 0):
    """(tensors, Truth): w [N, K] as AutoGPTQ saves a 4-bit layer. group -1: one group of K.
    act_order: the inputs are quantized in a random order (GPTQ's order of decreasing Hessian
    diagonal, stood in for), groups taken along that order, and stored back in the original order
    with g_idx naming each input's group. checkpoint_format "gptq" stores zero − 1 (v1), "gptq_v2"
    the zero point itself."""
    w = w.detach().double().numpy()
    n, k = w.shape
    group = k if group == -1 else group
    groups = -(-k // group)
    order = np.random.default_rng(seed).permutation(k) if act_order else np.arange(k)
    g_idx = np.empty(k, dtype=np.int64)
    g_idx[order] = np.arange(k) // group
    q = np.zeros((n, k), dtype=np.int64)
    scale, zero = np.zeros((n, groups), dtype=np.float16), np.zeros((n, groups), dtype=np.int64)
    for g in range(groups):
        cols = order[g * group:(g + 1) * group]
        scale[:, g], zero[:, g] = _gptq_params(w[:, cols], sym)
        s = scale[:, g].astype(np.float64)[:, None]
        q[:, cols] = np.clip(np.round(w[:, cols] / s) + zero[:, g][:, None], 0, 15)
    stored_zero = zero - 1 if checkpoint_format == "gptq" else zero
    assert stored_zero.min() >= 0, "a zero point of 0 wraps in v1; the writer's inputs avoid it"
    tensors = {
        "qweight": torch.from_numpy(_pack_rows(q.T)),                   # [K / 8, N]
        "qzeros": torch.from_numpy(_pack_cols(stored_zero.T)),          # [G, N / 8]
        "scales": torch.from_numpy(scale.T.copy()),                     # [G, N] f16
        "g_idx": torch.from_numpy(g_idx.astype(np.int32)),              # [K]
    }
    if bias is not None:
        tensors["bias"] = bias.detach().to(torch.float16)
    return tensors, Truth(q, zero, scale, g_idx)


def to_awq(w: torch.Tensor, group: int, bias: Optional[torch.Tensor] = None):
    """(tensors, Truth): w [N, K] as AutoAWQ's GEMM version saves a 4-bit layer with zero points
    (min/max per group, not clamped to include 0). group -1: one group of K."""
    w = w.detach().double().numpy()
    n, k = w.shape
    group = k if group == -1 else group
    groups = k // group
    wg = w.reshape(n, groups, group)
    mx, mn = wg.max(2), wg.min(2)
    scale = (np.maximum(mx - mn, 1e-5) / 15).astype(np.float16)
    s = scale.astype(np.float64)
    zero = np.clip(-np.round(mn / s), 0, 15).astype(np.int64)
    q = np.clip(np.round(wg / s[:, :, None]) + zero[:, :, None], 0, 15).astype(np.int64).reshape(n, k)
    tensors = {
        "qweight": torch.from_numpy(_pack_cols(q.T, AWQ_ORDER)),        # [K, N / 8]
        "qzeros": torch.from_numpy(_pack_cols(zero.T, AWQ_ORDER)),      # [G, N / 8]
        "scales": torch.from_numpy(scale.T.copy()),                     # [G, N] f16
    }
    if bias is not None:
        tensors["bias"] = bias.detach().to(torch.float16)
    return tensors, Truth(q, zero, scale, np.arange(k) // group)
