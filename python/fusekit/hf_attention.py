"""fusekit.attention as a Hugging Face transformers attention implementation.

``hf_attention_forward`` has the signature of transformers' attention functions (what
``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`` is called with by LLaMA-style attention
modules): ``(module, query [B, H, Sq, D], key, value [B, Hk, Sk, D], attention_mask, dropout,
scaling, is_causal, **kwargs) -> (attn_output [B, Sq, H, D], None)``. ``register_hf_attention()``
registers it under a name ("fusekit") together with SDPA's mask function (``sdpa_mask``), so that
a model with ``attn_implementation="fusekit"`` gets the masks an SDPA model gets: None where the
batch has no padding and the pattern is plain causal (or a single query), a dense boolean mask
otherwise.

It computes exactly what transformers' ``sdpa_attention_forward`` computes: where the mask is None,
``fusekit.attention`` (grouped-query heads natively, causal top-left when the module is causal and
there is more than one query); in every other case it calls ``sdpa_attention_forward`` itself (see
``fallback_reason``): a dense mask (padding, packed sequences, a sliding window that cuts keys off),
dropout > 0, ``output_attentions``, a position bias, softcap or attention sinks, a dtype other than
f32/bf16/f16 or mixed dtypes, a device fusekit was not built for, head dims outside 1..256 or
differing between q, k and v, batch sizes that differ.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _C
from . import functional as Fk

__all__ = ["hf_attention_forward", "register_hf_attention", "fallback_reason", "NAME"]

NAME = "fusekit"
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CUDA_BUILT = bool(_C.build_info().get("cuda"))
# kwargs whose value changes the result and that the kernel does not take (SDPA adds a bias, raises
# or warns on them): set (not None / not False), the call goes to SDPA.
_UNTAKEN_KWARGS = ("position_bias", "softcap", "s_aux", "sinks", "output_attentions")


def _sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    return sdpa_attention_forward


def _sdpa_mask():
    from transformers.masking_utils import sdpa_mask
    return sdpa_mask


def _mask_is_sdpas(module) -> bool:
    """Whether module's attention implementation builds its masks with SDPA's sdpa_mask (so that a
    None mask means: no padding, plain causal or a single query). A module without a config (not a
    Hugging Face attention module) is taken as SDPA takes it."""
    config = getattr(module, "config", None)
    impl = getattr(config, "_attn_implementation", None) if config is not None else None
    if impl is None or impl == "sdpa":
        return True
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    return ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(impl) is _sdpa_mask()


def fallback_reason(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                    dropout: float = 0.0, **kwargs) -> Optional[str]:
    """None where hf_attention_forward runs fusekit.attention on these arguments, else why it calls
    transformers' SDPA function instead."""
    if attention_mask is not None:
        return "a dense attention_mask (padding, packed sequences, a window or a custom pattern)"
    if dropout:
        return "dropout > 0"
    for name in _UNTAKEN_KWARGS:
        if kwargs.get(name) is not None and kwargs.get(name) is not False:
            return name
    window = kwargs.get("sliding_window")
    if window is not None and key.shape[-2] >= window:
        return "a sliding window shorter than the keys"
    if query.dtype not in _DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        return f"dtypes {query.dtype}, {key.dtype}, {value.dtype} (fusekit: one of f32, bf16, f16)"
    dev = query.device
    if key.device != dev or value.device != dev:
        return "q, k, v on different devices"
    if not (dev.type == "cpu" or (dev.type == "cuda" and _CUDA_BUILT)):
        return f"device {dev} (this fusekit build: cpu{', cuda' if _CUDA_BUILT else ''})"
    if query.dim() != 4 or key.dim() != 4 or value.shape != key.shape:
        return "shapes other than q [B, H, Sq, D], k and v [B, Hk, Sk, D]"
    b, h, _, d = query.shape
    if key.shape[0] != b or key.shape[-1] != d or not 1 <= d <= 256:
        return f"q {tuple(query.shape)}, k {tuple(key.shape)}: batch and head dim (1..256) must agree"
    if key.shape[1] < 1 or h % key.shape[1]:
        return f"{h} query heads not a multiple of {key.shape[1]} key heads"
    return None


def hf_attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                         attention_mask: Optional[Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                         is_causal: Optional[bool] = None, **kwargs) -> tuple[Tensor, None]:
    """transformers' attention-function signature (sdpa_attention_forward's): fusekit.attention
    where fallback_reason is None, transformers' SDPA function otherwise; returns (attn_output
    [B, Sq, H, D] contiguous, None). The model's attention implementation must build SDPA's masks
    (register_hf_attention does that): with another mask function a None mask may be a padding mask
    dropped, and this raises."""
    if fallback_reason(module, query, key, value, attention_mask, dropout, **kwargs) is not None:
        return _sdpa()(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                       is_causal=is_causal, **kwargs)
    if not _mask_is_sdpas(module):
        impl = module.config._attn_implementation
        raise ValueError(f"fusekit.hf_attention_forward: attention implementation {impl!r} does not build its masks "
                         f"with transformers' sdpa_mask, so a missing mask may be padding dropped; register it with "
                         f"fusekit.register_hf_attention({impl!r})")
    q_len, kv_len = query.shape[2], key.shape[2]
    # as sdpa_attention_forward: the call's is_causal, else the module's; causal only with > 1 query
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = q_len > 1 and bool(is_causal)
    if causal and kv_len > q_len:
        # a prefill into an empty static cache: top-left causal never reads keys past q_len (SDPA
        # slices them off too); the same result, on Sq == Sk
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    out = Fk.attention(query, key, value, causal=causal, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def register_hf_attention(name: str = NAME) -> str:
    """Register hf_attention_forward as transformers attention implementation `name`, with SDPA's
    mask function (``AttentionInterface`` and ``AttentionMaskInterface``); then
    ``from_pretrained(..., attn_implementation=name)`` or ``model.set_attn_implementation(name)``
    selects it. Returns name. fusekit.patch(model, attention=True) calls it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, hf_attention_forward)
    AttentionMaskInterface.register(name, _sdpa_mask())
    return name
