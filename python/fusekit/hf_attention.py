"""fusekit.attention as a Hugging Face transformers attention implementation.

``hf_attention_forward`` has the signature of transformers' attention functions (what
``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`` is called with by LLaMA-style attention
modules): ``(module, query [B, H, Sq, D], key, value [B, Hk, Sk, D], attention_mask, dropout,
scaling, is_causal, **kwargs) -> (attn_output [B, Sq, H, D], None)``. ``register_hf_attention()``
registers it under a name ("fusekit") together with ``causal_skip_mask``: SDPA's mask function
(``sdpa_mask``), except that it returns None (no mask) wherever the mask is provably the plain
causal pattern, decided from shapes and Python values only, so the same under ``torch.compile``
(where ``sdpa_mask`` itself builds the dense mask, never reading a tensor's values); a dense
boolean mask otherwise (padding, packed sequences, a window that cuts keys off, a cache offset).

It computes exactly what transformers' ``sdpa_attention_forward`` computes: where the mask is None,
``fusekit.attention`` (grouped-query heads natively, causal top-left when the module is causal and
there is more than one query); in every other case it calls ``sdpa_attention_forward`` itself (see
``fallback_reason``): a dense mask (padding, packed sequences, a sliding window that cuts keys off),
dropout > 0, ``output_attentions``, a position bias, softcap or attention sinks, a dtype other than
f32/bf16/f16 or mixed dtypes, a device fusekit was not built for, head dims outside 1..256 or
differing between q, k and v, batch sizes that differ.
"""
from __future__ import annotations

import inspect
from typing import Optional

import torch
from torch import Tensor

from . import _C
from . import functional as Fk

__all__ = ["hf_attention_forward", "register_hf_attention", "register_sdpa_causal_skip", "causal_skip_mask",
           "fallback_reason", "NAME", "SDPA_NAME"]

NAME = "fusekit"
# transformers' own SDPA attention function, with causal_skip_mask (fusekit.patch(causal_mask_skip=True)).
SDPA_NAME = "fusekit_sdpa"
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


def _sdpa_mask_defaults() -> dict:
    """sdpa_mask's keyword defaults (of this transformers version), computed once: not inside a
    traced call."""
    global _SDPA_MASK_DEFAULTS
    if _SDPA_MASK_DEFAULTS is None:
        params = inspect.signature(_sdpa_mask()).parameters
        _SDPA_MASK_DEFAULTS = {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty}
    return _SDPA_MASK_DEFAULTS


_SDPA_MASK_DEFAULTS = None


def is_plain_causal(arguments: dict) -> bool:
    """Whether sdpa_mask called with `arguments` (bound by name) would build the plain causal mask
    with nothing else to mask: transformers' causal_mask_function itself (no packed sequences, no
    or/and overlay, no sliding window or chunk), the causal skip allowed (transformers forbids it
    for compiled decoding caches), no 2D padding mask, no local window shorter than the keys, as
    many keys as queries and the same offset (Python ints) for both, so that key j is query j's
    token and top-left causal is the pattern. Shapes and Python values only: never a tensor's data.
    The older signature (cache_position, a tensor, in place of q_length and q_offset) is never
    taken: its query offset is data."""
    from transformers.masking_utils import causal_mask_function

    if "q_length" not in arguments or "cache_position" in arguments:
        return False
    if arguments.get("mask_function", causal_mask_function) is not causal_mask_function:
        return False
    if not arguments.get("allow_is_causal_skip", True) or arguments.get("attention_mask") is not None:
        return False
    q_len, kv_len = arguments["q_length"], arguments.get("kv_length")
    q_off, kv_off = arguments.get("q_offset", 0), arguments.get("kv_offset", 0)
    if type(q_off) is not int or type(kv_off) is not int or q_off != kv_off:
        return False
    local = arguments.get("local_size")
    if local is not None and kv_len >= local:
        return False
    return kv_len == q_len


def causal_skip_mask(*args, **kwargs):
    """transformers' sdpa_mask, except None where is_plain_causal (the attention is then told
    causal: fusekit.attention with causal=True, SDPA with is_causal=True); sdpa_mask's result,
    unchanged, for every other call. Takes sdpa_mask's arguments by name, as transformers'
    create_causal_mask passes them (a call with positional arguments goes to sdpa_mask as it is)."""
    if not args and is_plain_causal({**_sdpa_mask_defaults(), **kwargs}):
        return None
    return _sdpa_mask()(*args, **kwargs)


# ---- positions the model computed itself --------------------------------------------------------
# Under tracing transformers cannot look at position_ids' values, so it takes any position_ids as
# possibly packed sequences (find_packed_sequence_indices) and builds a dense mask with a packed-
# sequence mask function, even where the model computed the positions itself (arange: one sequence
# a row). A model patched by fusekit.patch(attention=True / causal_mask_skip=True) records in
# _POSITIONS whether its caller gave position_ids (and cache_position); create_causal_mask, wrapped
# in the model's module, then leaves out positions that the model computed without a cache, which
# transformers itself would have found unpacked (their only use there is that search).

class _Positions:
    def __init__(self):
        self.implicit = False


_POSITIONS = _Positions()
# The forward names whose values, when the caller gives any, are the model's positions.
_POSITION_ARGS = ("position_ids", "cache_position")
# create_causal_mask's arguments that the wrapper knows; a call with any other goes through as it is.
_MASK_ARGS = ("config", "inputs_embeds", "input_embeds", "attention_mask", "cache", "past_key_values", "position_ids",
              "cache_position", "or_mask_function", "and_mask_function", "block_sequence_ids")


def positions_forward(base):
    """A base model's forward that records, for create_causal_mask_wrapper, whether the caller left
    the positions to the model."""
    names = [n for n in list(inspect.signature(base).parameters)[1:]]

    def forward(self, *args, **kwargs):
        given = dict(zip(names, args))
        given.update(kwargs)
        previous = _POSITIONS.implicit
        _POSITIONS.implicit = all(given.get(n) is None for n in _POSITION_ARGS)
        try:
            return base(self, *args, **kwargs)
        finally:
            _POSITIONS.implicit = previous
    return forward


def computes_own_positions(forward) -> bool:
    """Whether a Hugging Face base model's forward builds its mask with create_causal_mask and, when
    not given positions, computes them as arange from the cache's length (0 without a cache):
    transformers 5's LLaMA, Mistral, Qwen2/3."""
    try:
        source = inspect.getsource(inspect.unwrap(forward))
    except (OSError, TypeError):
        return False
    params = inspect.signature(forward).parameters
    code = "".join(line.split("#")[0] for line in source.splitlines()).replace(" ", "")  # no spaces, no comments
    past = ("past_seen_tokens=cache.get_seq_length()ifcacheisnotNoneelse0" in code
            or "past_seen_tokens=past_key_values.get_seq_length()ifpast_key_valuesisnotNoneelse0" in code)
    own = ("position_ids=torch.arange(inputs_embeds.shape[1],device=inputs_embeds.device)+past_seen_tokens" in code
           or ("position_ids=cache_position.unsqueeze(0)" in code
               and "cache_position=torch.arange(past_seen_tokens,past_seen_tokens+inputs_embeds.shape[1]," in code))
    return "position_ids" in params and "create_causal_mask" in code and past and own


_OVERLAY_ARGS = ("or_mask_function", "and_mask_function", "block_sequence_ids")


def create_causal_mask_wrapper(original):
    """The model module's create_causal_mask while a model of it is patched: under tracing, inside a
    forward whose caller gave no positions (positions_forward), with no cache, no 2D mask and no
    overlay, called without position_ids, which then can only be the model's arange (one sequence a
    row: what transformers finds when it may look, eager); every other call as it is."""
    def create_causal_mask(*args, **kwargs):
        if (not args and torch.compiler.is_compiling() and _POSITIONS.implicit and all(k in _MASK_ARGS for k in kwargs)
                and kwargs.get("position_ids") is not None and kwargs.get("attention_mask") is None
                and kwargs.get("cache") is None and kwargs.get("past_key_values") is None
                and all(kwargs.get(n) is None for n in _OVERLAY_ARGS)):
            kwargs = dict(kwargs, position_ids=None)
        return original(*args, **kwargs)
    create_causal_mask.__wrapped__ = original
    create_causal_mask._fusekit = True
    return create_causal_mask


def _mask_is_sdpas(module) -> bool:
    """Whether module's attention implementation builds its masks with SDPA's sdpa_mask (so that a
    None mask means: no padding, plain causal or a single query). A module without a config (not a
    Hugging Face attention module) is taken as SDPA takes it."""
    config = getattr(module, "config", None)
    impl = getattr(config, "_attn_implementation", None) if config is not None else None
    if impl is None or impl == "sdpa":
        return True
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    return ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(impl) in (_sdpa_mask(), causal_skip_mask)


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
    """Register hf_attention_forward as transformers attention implementation `name`, with
    causal_skip_mask (SDPA's masks, None where provably plain causal) as its mask function
    (``AttentionInterface`` and ``AttentionMaskInterface``); then ``from_pretrained(...,
    attn_implementation=name)`` or ``model.set_attn_implementation(name)`` selects it. Returns name.
    fusekit.patch(model, attention=True) calls it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    _sdpa_mask_defaults()  # here, not first inside a traced call
    AttentionInterface.register(name, hf_attention_forward)
    AttentionMaskInterface.register(name, causal_skip_mask)
    return name


def register_sdpa_causal_skip(name: str = SDPA_NAME) -> str:
    """Register transformers' own sdpa_attention_forward as implementation `name` with
    causal_skip_mask: SDPA that gets is_causal (no mask) wherever the mask is provably plain causal,
    under torch.compile too. fusekit.patch(model, causal_mask_skip=True) calls it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    _sdpa_mask_defaults()
    AttentionInterface.register(name, _sdpa())
    AttentionMaskInterface.register(name, causal_skip_mask)
    return name
