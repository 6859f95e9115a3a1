"""fusekit.patch(model): a model's RMSNorms, gated MLPs, rotary embedding and LM-head loss run on
fusekit's fused ops, in place.

Each patched module keeps its object, parameters, buffers and state dict; only its class changes
(to a subclass whose ``forward`` calls fusekit), so ``fusekit.unpatch(model)`` restores it exactly
and optimizers, hooks and checkpoints made before or after keep working. What is patched:

- RMSNorm: ``torch.nn.RMSNorm`` and Hugging Face's LLaMA-style RMSNorms (``weight * x̂`` with x̂
  computed in f32: LLaMA, Mistral, Qwen2/3, Phi-3) -> ``fusekit.rms_norm``.
- decoder layer: Hugging Face's pre-norm decoder layer (transformers 5's LLaMA, Mistral, Qwen2/3)
  -> the first residual add fused into the second norm (``fusekit.add_rms_norm``); under autocast
  with f32 weights, both norms write autocast's dtype, the f32 result rounded once, as the GEMMs
  that read them would have cast it.
- decoder stack: the model that runs those layers in a plain loop and then its final norm
  (``LlamaModel`` and its kin), called by the patched LM head for its loss -> each layer's second
  residual add is fused with the norm that follows it across the layer boundary (the next layer's
  input norm, or the final norm), so that every residual add is a norm's and the backward sums no
  gradients apart. Each layer then hands the next a ``(normed, residual)`` pair instead of its
  output tensor; the layers return plain tensors whenever anything else could see their output
  (called on their own, hooks on them or on what follows, gradient checkpointing, fewer layers run
  than were linked). The stack's class and forward are its own.
- MLP: a module with ``gate_proj``, ``up_proj``, ``down_proj`` (``nn.Linear``) and ``act_fn`` (SiLU,
  GELU, tanh-GELU, ReLU) computing ``down(act(gate(x)) * up(x))`` -> the fused GEMM + gated
  activation, on the module's own gate and up weights.
- rotary: ``apply_rotary_pos_emb`` of the module that defines a patched attention class (a module
  global, as Hugging Face's attention calls it) -> ``fusekit.apply_rotary_pos_emb``, while any
  model of that module is patched.
- attention inputs (with ``qkv``): Hugging Face's LLaMA attention (its forward checked line by
  line; q, k, v projections without bias) -> ``fusekit.functional.qkv_rope``: q and k from one
  GEMM and rope in one pass, and in the backward one GEMM for the input's gradient over q's and k's
  side by side, v's accumulated into it, instead of three and a sum. The attention function, the
  output projection and everything else are the model's. The model's own forward runs with a cache,
  hooks on the projections, or inside ``fusekit.compress_saved_tensors``.
- LM head loss: a ``*ForCausalLM`` with ``lm_head`` and ``model``, when called with ``labels`` ->
  ``fusekit.linear_cross_entropy`` on the last hidden states: the loss, with the logits never
  materialised (``logits`` is None in the output). Without labels, the model's own forward runs.
- attention (only with ``attention=True``): every Hugging Face model (``PreTrainedModel``) in it
  whose attention implementation is "sdpa" switches to "fusekit" (``fusekit.hf_attention_forward``,
  registered with SDPA's masks): ``fusekit.attention`` where the mask is None (no padding, plain
  causal), transformers' SDPA function for everything else. Off by default: on Hopper fusekit's
  attention backward is slower than SDPA's (FlashAttention / cuDNN), so a training step can lose.
"""
from __future__ import annotations

import contextlib
import inspect
import sys
import threading
import weakref
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch import Tensor, nn

from . import compress as _compress
from . import functional as Fk
from . import hf_attention as _hf_attention
from .ops._registry import _autocast_dtype, _autocast_enabled, register_inductor_fallbacks

__all__ = ["patch", "patch_llama", "unpatch", "patched_modules", "hf_attention_forward", "register_hf_attention"]

hf_attention_forward = _hf_attention.hf_attention_forward
register_hf_attention = _hf_attention.register_hf_attention

_ORIGINAL = "_fusekit_original_class"
_LOCK = threading.Lock()

# RMSNorm classes whose forward is Hugging Face LLaMA's: weight * (x / rms(x) in f32).to(x.dtype).
_LLAMA_STYLE_NORMS = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "Phi3RMSNorm",
                      "MixtralRMSNorm", "Olmo2RMSNorm"}

# The gated activation each MLP's act_fn class computes on its gate.
_ACT_KIND = {"SiLU": "swiglu", "SiLUActivation": "swiglu", "ReLU": "reglu", "GELUTanh": "geglu_tanh",
             "PytorchGELUTanh": "geglu_tanh", "NewGELUActivation": "geglu_tanh", "GELUActivation": "geglu_erf"}


def _glu_kind(act: nn.Module) -> Optional[str]:
    if isinstance(act, nn.GELU):
        return "geglu_tanh" if act.approximate == "tanh" else "geglu_erf"
    name = type(act).__name__
    if name == "GELUActivation" and getattr(act, "act", None) is not nn.functional.gelu:
        return None  # the python-formula variant: same function, but leave what we did not check
    return _ACT_KIND.get(name)


# ---- the replacement forwards -------------------------------------------------------------------

def _norm_eps(norm: nn.Module, x: Tensor, dtype: Optional[torch.dtype] = None) -> float:
    """The norm's epsilon; without one, the epsilon of x's dtype (or of dtype, when given)."""
    eps = getattr(norm, "variance_epsilon", None)
    if eps is None:
        eps = getattr(norm, "eps", None)
    return torch.finfo(dtype or x.dtype).eps if eps is None else eps


class _Carry(NamedTuple):
    """What a patched decoder layer of a chained decoder stack hands the next consumer: the
    residual stream (the layer's output, as `residual + mlp(...)` would have given it) and its
    norm by that consumer (`target`: the index of the layer whose input norm it is, or the number
    of layers for the stack's final norm), both from one add_rms_norm. A consumer whose index is
    not `target` normalises `residual` itself."""
    normed: Tensor
    residual: Tensor
    target: int


# The keyword a chained decoder stack passes its layers (through Hugging Face's **kwargs).
_CHAIN = "_fusekit_chain"


def _rms_norm_forward(self, hidden_states: Tensor) -> Tensor:
    if isinstance(hidden_states, _Carry):  # the final norm of a chained decoder stack
        if hidden_states.target == self.__dict__.get("_fusekit_chain_index"):
            return hidden_states.normed
        hidden_states = hidden_states.residual
    return Fk.rms_norm(hidden_states, self.weight, eps=_norm_eps(self, hidden_states))


def _gemm_input_dtype(x: Tensor, *norms: nn.Module, dtype: Optional[torch.dtype] = None) -> Optional[torch.dtype]:
    """Under autocast, with f32 activations (x's dtype, or dtype when given) and norm weights: the
    dtype autocast casts a GEMM's input to (the norm hands its output over in it, rounded once,
    instead of in f32 for the GEMM to cast); else None (the norm's own dtype)."""
    if (dtype or x.dtype) != torch.float32 or any(n.weight.dtype != torch.float32 for n in norms):
        return None
    device = x.device.type
    if not _autocast_enabled(device):
        return None
    dtype = _autocast_dtype(device)
    return dtype if dtype in (torch.bfloat16, torch.float16) else None


def _attention_compression():
    """Inside a fusekit.compress_saved_tensors block: a nested block that packs the attention's
    own saved tensors (q, k, v, its output) at the block's attention_bits; else nothing."""
    if torch.compiler.is_compiling():
        return contextlib.nullcontext()
    hook = _compress.active()
    if hook is None or hook.attention_bits == hook.bits:
        return contextlib.nullcontext()
    return hook.for_attention()


def _decoder_layer_forward(self, hidden_states: Tensor, *args, **kwargs):
    """A pre-norm decoder layer (Hugging Face's LlamaDecoderLayer): x + attn(norm1(x)) -> h, then
    h + mlp(norm2(h)), with the first residual add fused into norm2 and, under autocast, both norms
    writing the GEMMs' input dtype directly. Inside fusekit.compress_saved_tensors, the attention's
    saved tensors are packed at the block's attention_bits. Called by a chained decoder stack
    (_CHAIN), it takes a _Carry and hands one on (see _Carry)."""
    chain = kwargs.pop(_CHAIN, False)
    arguments = dict(zip(self._fusekit_arg_names, args))
    arguments.update(kwargs)
    carry = None
    if isinstance(hidden_states, _Carry):
        carry, hidden_states = hidden_states, hidden_states.residual
    norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
    half = _gemm_input_dtype(hidden_states, norm1, norm2)
    if carry is not None and carry.target == self.__dict__.get("_fusekit_chain_index"):
        h = carry.normed
    else:
        h = Fk.rms_norm(hidden_states, norm1.weight, eps=_norm_eps(norm1, hidden_states), out_dtype=half)
    with _attention_compression():
        attn = self.self_attn(hidden_states=h, **arguments)
    if isinstance(attn, tuple):
        attn = attn[0]
    h, residual = Fk.add_rms_norm(attn, hidden_states, norm2.weight, eps=_norm_eps(norm2, hidden_states),
                                  out_dtype=half)
    mlp = self.mlp(h)
    link = self.__dict__.get("_fusekit_chain_next")
    if not chain or link is None or _hooked(self, link[1]):
        return residual + mlp
    target, _, norms = link
    stream = torch.promote_types(residual.dtype, mlp.dtype)  # the dtype of residual + mlp
    eps = _norm_eps(norms[0], residual, stream)
    # The final norm writes its own dtype, as the patched norm module would; a layer's input norm
    # writes what that layer's forward would have.
    out_dtype = None if len(norms) == 1 else _gemm_input_dtype(residual, *norms, dtype=stream)
    normed, out = Fk.add_rms_norm(mlp, residual, norms[0].weight, eps=eps, out_dtype=out_dtype)
    return _Carry(normed, out, target)


def _hooked(layer: nn.Module, consumer: nn.Module) -> bool:
    """Whether a hook could see what layer hands consumer: forward hooks on layer, forward pre-hooks
    on consumer, or either kind registered for every module."""
    hooks = torch.nn.modules.module
    return bool(layer._forward_hooks or consumer._forward_pre_hooks or hooks._global_forward_hooks
                or hooks._global_forward_pre_hooks)


def _chain_ready(stack: nn.Module) -> bool:
    """Whether stack is a linked decoder stack (_link_decoder_stack) whose forward runs exactly the
    layers it was linked with, none of them checkpointed."""
    n = stack.__dict__.get("_fusekit_chain_layers")
    if n is None or getattr(stack.config, "num_hidden_layers", None) != n or getattr(stack, "gradient_checkpointing",
                                                                                    False):
        return False
    return not any(getattr(layer, "gradient_checkpointing", False) for layer in stack.layers)


# The attention's projections in a patched decoder layer: inside fusekit.compress_saved_tensors
# their inputs stay packed and their weight gradients read the packed copy (compress.linear).
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _forward_lines(cls: type) -> Optional[list[str]]:
    """The source lines of cls.forward (unwrapped), stripped, without blank and comment lines;
    None where the source cannot be read."""
    try:
        source = inspect.getsource(inspect.unwrap(cls.forward))
    except (OSError, TypeError):
        return None
    return [line for line in (raw.strip() for raw in source.splitlines()) if line and not line.startswith("#")]


# Hugging Face's attention forward (transformers 5's LlamaAttention), line by line after its
# signature; {cache} is the cache argument's name, {update} what its update call adds. A class whose
# forward reads otherwise (sliding windows, q/k norms, biases handled apart) keeps it.
_ATTENTION_BODY = (
    "input_shape = hidden_states.shape[:-1]",
    "hidden_shape = (*input_shape, -1, self.head_dim)",
    "query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)",
    "key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)",
    "value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)",
    "cos, sin = position_embeddings",
    "query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)",
    "if {cache} is not None:",
    "key_states, value_states = {cache}.update(key_states, value_states, self.layer_idx{update})",
    "attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(",
    "self.config._attn_implementation, eager_attention_forward",
    ")",
    "attn_output, attn_weights = attention_interface(",
    "self,", "query_states,", "key_states,", "value_states,", "attention_mask,",
    "dropout=0.0 if not self.training else self.attention_dropout,",
    "scaling=self.scaling,", "**kwargs,", ")",
    "attn_output = attn_output.reshape(*input_shape, -1).contiguous()",
    "attn_output = self.o_proj(attn_output)",
    "return attn_output, attn_weights",
)
_ATTENTION_CACHES = ("past_key_values", "cache")


def _is_hf_attention(m: nn.Module) -> bool:
    """A module whose forward is _ATTENTION_BODY, with q_proj, k_proj, v_proj nn.Linear without
    bias, a head_dim, and the module globals that forward reads."""
    if not all(isinstance(getattr(m, p, None), nn.Linear) and getattr(m, p).bias is None
               for p in ("q_proj", "k_proj", "v_proj")):
        return False
    if not isinstance(getattr(m, "head_dim", None), int) or not isinstance(getattr(m, "o_proj", None), nn.Module):
        return False
    module = sys.modules.get(type(m).__module__)
    if not all(hasattr(module, name) for name in ("ALL_ATTENTION_FUNCTIONS", "eager_attention_forward")):
        return False
    body = _forward_lines(type(m))
    if body is None:
        return False
    if _ATTENTION_BODY[0] not in body:
        return False
    body = body[body.index(_ATTENTION_BODY[0]):]
    params = inspect.signature(type(m).forward).parameters
    return any(body == [line.format(cache=cache, update=update) for line in _ATTENTION_BODY]
               for cache in _ATTENTION_CACHES if cache in params for update in ("", ", kwargs=kwargs"))


def _hooked_projection(m: nn.Module) -> bool:
    """Whether a hook would run on one of the attention's q, k, v projections (hooks of its own, or
    registered for every module)."""
    hooks = torch.nn.modules.module
    return any(p._forward_hooks or p._forward_pre_hooks for p in (m.q_proj, m.k_proj, m.v_proj)) or \
        bool(hooks._global_forward_hooks or hooks._global_forward_pre_hooks)


def _attention_forward(self, hidden_states: Tensor, position_embeddings=None, attention_mask=None, *args, **kwargs):
    """Hugging Face's attention forward (_ATTENTION_BODY) with q, k, v and rope from
    fusekit.functional.qkv_rope; the model's own forward where something else must see the
    projections (a cache, hooks on them, fusekit.compress_saved_tensors, which packs their input)."""
    cache = [kwargs.get(name) for name in _ATTENTION_CACHES]
    if (args or any(c is not None for c in cache) or not isinstance(position_embeddings, tuple)
            or _hooked_projection(self) or (not torch.compiler.is_compiling() and _compress.active() is not None)):
        return self._fusekit_base_forward(hidden_states, position_embeddings, attention_mask, *args, **kwargs)
    for name in _ATTENTION_CACHES:
        kwargs.pop(name, None)
    input_shape = hidden_states.shape[:-1]
    cos, sin = position_embeddings
    query_states, key_states, value_states = Fk.qkv_rope(hidden_states, self.q_proj.weight, self.k_proj.weight,
                                                          self.v_proj.weight, cos, sin, self.head_dim)
    module = self._fusekit_module
    attention_interface = module.ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                                       module.eager_attention_forward)
    attn_output, attn_weights = attention_interface(
        self, query_states, key_states, value_states, attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling, **kwargs)
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    return self.o_proj(attn_output), attn_weights


def _projection_forward(self, x: Tensor) -> Tensor:
    return _compress.linear(x, self.weight, self.bias)


def _mlp_forward(self, x: Tensor) -> Tensor:
    g, u, d = self.gate_proj, self.up_proj, self.down_proj
    return Fk.glu_mlp(x, g.weight, u.weight, d.weight, kind=self._fusekit_kind, gate_b=g.bias, up_b=u.bias,
                      down_b=d.bias, recompute=self._fusekit_recompute)


def _causal_lm_loss(self, hidden: Tensor, labels: Tensor, num_items_in_batch=None, ignore_index: int = -100,
                    shift_labels: Optional[Tensor] = None) -> Tensor:
    """Hugging Face's ForCausalLMLoss (labels shifted left by one, the last position ignored; a sum
    divided by num_items_in_batch when given, else the mean over non-ignored tokens) through the
    fused head."""
    if shift_labels is None:
        shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    h = hidden.reshape(-1, hidden.shape[-1])
    t = shift_labels.reshape(-1).to(h.device)
    head = self.lm_head
    if num_items_in_batch is None:
        return Fk.linear_cross_entropy(h, head.weight, t, head.bias, ignore_index=ignore_index)
    loss = Fk.linear_cross_entropy(h, head.weight, t, head.bias, ignore_index=ignore_index, reduction="sum")
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def _causal_lm_forward(self, *args, **kwargs):
    arguments = dict(zip(self._fusekit_arg_names, args))
    arguments.update(kwargs)
    labels = arguments.pop("labels", None)
    keep = arguments.pop("logits_to_keep", arguments.pop("num_logits_to_keep", 0))
    if labels is None or torch.is_tensor(keep) or keep != 0:  # logits asked for: the model's own forward
        return self._fusekit_base_forward(*args, **kwargs)
    arguments.pop("return_dict", None)
    shift_labels = arguments.pop("shift_labels", None)
    if _chain_ready(self.model):  # the stack passes it on to its layers, and only to them
        arguments[_CHAIN] = True
    outputs = self.model(**arguments)
    loss = _causal_lm_loss(self, outputs[0], labels, arguments.get("num_items_in_batch"), shift_labels=shift_labels)
    return self._fusekit_output(loss=loss, logits=None)


def _positional_names(forward: Callable) -> tuple[str, ...]:
    """The names forward(self, ...) binds positional arguments to, in order."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in list(inspect.signature(forward).parameters.values())[1:] if p.kind in kinds)


# ---- class swapping -----------------------------------------------------------------------------

_SUBCLASSES: dict[tuple[type, str], type] = {}


def _subclass(cls: type, role: str, members: dict[str, Any]) -> type:
    key = (cls, role)
    sub = _SUBCLASSES.get(key)
    if sub is None:
        sub = type(f"Fusekit{cls.__name__}", (cls,), {"__module__": cls.__module__, "_fusekit_role": role, **members})
        _SUBCLASSES[key] = sub
    return sub


def _swap(module: nn.Module, role: str, members: dict[str, Any]) -> None:
    cls = type(module)
    module.__class__ = _subclass(cls, role, members)
    object.__setattr__(module, _ORIGINAL, cls)


def _is_patched(module: nn.Module) -> bool:
    return _ORIGINAL in module.__dict__


# Module globals fusekit replaces while a patched model of that module exists: (module, name) ->
# [the original, how many patched models use it]; each such model -> the finalizer that releases
# its uses (run by unpatch, or when the model is collected). The rotary function
# (apply_rotary_pos_emb) and, for the attention switches, create_causal_mask.
_GLOBAL_USERS: dict[tuple[str, str], list] = {}
_GLOBAL_MODELS: "weakref.WeakKeyDictionary[nn.Module, weakref.finalize]" = weakref.WeakKeyDictionary()


def _rope_wrapper(original: Callable) -> Callable:
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        return Fk.apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs)
    apply_rotary_pos_emb.__wrapped__ = original
    apply_rotary_pos_emb._fusekit = True
    return apply_rotary_pos_emb


_GLOBAL_WRAPPERS = {"apply_rotary_pos_emb": _rope_wrapper,
                    "create_causal_mask": _hf_attention.create_causal_mask_wrapper}


def _patch_global(key: tuple[str, str]) -> bool:
    module_name, name = key
    mod = sys.modules.get(module_name)
    fn = getattr(mod, name, None) if mod is not None else None
    if fn is None:
        return False
    with _LOCK:
        users = _GLOBAL_USERS.get(key)
        if users is None:
            users = _GLOBAL_USERS[key] = [fn, 0]
            setattr(mod, name, _GLOBAL_WRAPPERS[name](fn))
        users[1] += 1
    return True


def _unpatch_global(key: tuple[str, str]) -> None:
    with _LOCK:
        users = _GLOBAL_USERS.get(key)
        if users is None:
            return
        users[1] -= 1
        if users[1] == 0:
            setattr(sys.modules[key[0]], key[1], users[0])
            del _GLOBAL_USERS[key]


def _is_rms_norm(m: nn.Module) -> bool:
    if isinstance(m, nn.RMSNorm):
        return m.weight is not None
    return type(m).__name__ in _LLAMA_STYLE_NORMS and isinstance(getattr(m, "weight", None), nn.Parameter)


def _mlp_kind(m: nn.Module) -> Optional[str]:
    """The GLU kind of a gated MLP: exactly the children gate_proj, up_proj, down_proj, act_fn (a
    module holding more, a block with its norm say, computes something else)."""
    if {name for name, _ in m.named_children()} != {"gate_proj", "up_proj", "down_proj", "act_fn"}:
        return None
    parts = [getattr(m, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(p, nn.Linear) and type(p) is nn.Linear for p in parts):
        return None
    act = getattr(m, "act_fn", None)
    return _glu_kind(act) if isinstance(act, nn.Module) else None


def _is_decoder_layer(m: nn.Module) -> bool:
    """A module whose forward is exactly Hugging Face's pre-norm decoder layer of transformers 5
    (LLaMA, Mistral, Qwen2/3): children self_attn, mlp, input_layernorm, post_attention_layernorm
    (RMSNorms fusekit patches), a forward that adds each sublayer's output to its input and returns
    the tensor (the layers of transformers 4 return tuples, and are left alone)."""
    if {name for name, _ in m.named_children()} != {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}:
        return False
    if not (_is_rms_norm(m.input_layernorm) and _is_rms_norm(m.post_attention_layernorm)):
        return False
    if any(type(n).__name__ not in _LLAMA_STYLE_NORMS for n in (m.input_layernorm, m.post_attention_layernorm)):
        return False
    body = _forward_lines(type(m))
    if body is None:
        return False
    return (body.count("hidden_states = residual + hidden_states") == 2 and body[-1] == "return hidden_states"
            and "hidden_states = self.input_layernorm(hidden_states)" in body
            and "hidden_states = self.post_attention_layernorm(hidden_states)" in body
            and "hidden_states = self.mlp(hidden_states)" in body)


def _decoder_stack_layers(m: nn.Module) -> int:
    """The number of layers a decoder stack runs (0 for a module that is not one): a module with
    `layers` (the first config.num_hidden_layers of them patched decoder layers) and `norm` (a
    patched RMSNorm) whose forward runs them in a plain loop (Hugging Face's LlamaModel and its
    kin): each layer's output handed only to the next layer and the last one's only to
    `self.norm`, the forward's keyword arguments passed on to the layers and to nothing else."""
    layers, norm = getattr(m, "layers", None), getattr(m, "norm", None)
    n = getattr(getattr(m, "config", None), "num_hidden_layers", None)
    if not (isinstance(layers, nn.ModuleList) and isinstance(norm, nn.Module) and type(n) is int
            and 0 < n <= len(layers)):
        return 0
    if not (_is_patched(norm) and norm._fusekit_role == "rms_norm"):
        return 0
    if not all(_is_patched(layer) and layer._fusekit_role == "decoder_layer" for layer in layers[:n]):
        return 0
    body = _forward_lines(type(m))
    if body is None:
        return 0
    loop = "for decoder_layer in self.layers[: self.config.num_hidden_layers]:"
    if body.count(loop) != 1:
        return 0
    call = body[body.index(loop) + 1:]
    if not call or call[0] != "hidden_states = decoder_layer(" or ")" not in call:
        return 0
    end = call.index(")")
    if "**kwargs," not in call[1:end] or call[end + 1:end + 2] != ["hidden_states = self.norm(hidden_states)"]:
        return 0
    passed = [line for line in body if "**kwargs" in line and not line.startswith("**kwargs:")]
    return n if passed == ["**kwargs,"] else 0


def _link_decoder_stack(stack: nn.Module, n: int) -> None:
    """Each of the stack's first n layers learns the consumer of its output and that consumer's
    norms (see _Carry). A patched causal LM then chains them when it calls the stack for its loss.
    The stack's class stays (transformers keys what it records, output_hidden_states, by class)."""
    layers, norm = stack.layers, stack.norm
    for i in range(n):
        nxt = layers[i + 1] if i + 1 < n else None
        link = (i + 1, nxt, (nxt.input_layernorm, nxt.post_attention_layernorm)) if nxt is not None \
            else (n, norm, (norm,))
        object.__setattr__(layers[i], "_fusekit_chain_index", i)
        object.__setattr__(layers[i], "_fusekit_chain_next", link)
    object.__setattr__(norm, "_fusekit_chain_index", n)
    object.__setattr__(stack, "_fusekit_chain_layers", n)


# The attributes patch() sets on patched modules besides their class.
_PATCH_ATTRIBUTES = ("_fusekit_kind", "_fusekit_recompute", "_fusekit_chain_index", "_fusekit_chain_next",
                     "_fusekit_chain_layers")


def _is_causal_lm(m: nn.Module) -> bool:
    return (type(m).__name__.endswith("ForCausalLM") and isinstance(getattr(m, "lm_head", None), nn.Linear)
            and isinstance(getattr(m, "model", None), nn.Module)
            and "labels" in inspect.signature(type(m).forward).parameters)


# The attention switch: the attribute of a switched Hugging Face model holding {id(config):
# (config, its attention implementation before)} for every config switch_attention changed.
_ATTN_PREVIOUS = "_fusekit_attn_previous"


def _switch_attention(model: nn.Module, name: str) -> list:
    """Every outermost Hugging Face model in `model` on "sdpa" -> `name` (sub-models included, as
    set_attn_implementation does it); the previous implementations kept for unpatch. Returns the
    Hugging Face models (sub-models included) now on `name`."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return []
    inside: list[str] = []
    switched = []
    for path, m in model.named_modules():
        if not isinstance(m, PreTrainedModel) or any(path.startswith(p) for p in inside):
            continue
        inside.append(path + "." if path else "")
        if _ATTN_PREVIOUS in m.__dict__ or getattr(m.config, "_attn_implementation", None) != "sdpa":
            continue
        previous = {id(s.config): (s.config, s.config._attn_implementation_internal)
                    for s in m.modules() if isinstance(s, PreTrainedModel)}
        m.set_attn_implementation(name)
        if m.config._attn_implementation == name:
            object.__setattr__(m, _ATTN_PREVIOUS, previous)
            switched += [s for s in m.modules() if isinstance(s, PreTrainedModel)
                         and getattr(s.config, "_attn_implementation", None) == name]
    return switched


def _restore_attention(model: nn.Module) -> None:
    for m in model.modules():
        previous = m.__dict__.pop(_ATTN_PREVIOUS, None)
        for config, impl in (previous or {}).values():
            config._attn_implementation_internal = impl


def patch(model: nn.Module, *, rms_norm: bool = True, mlp: bool = True, rope: bool = True,
          cross_entropy: bool = True, decoder_layer: bool = True, recompute_mlp: bool = False,
          attention: bool = False, causal_mask_skip: bool = False, qkv: bool = True) -> nn.Module:
    """Patch `model` in place (see the module's docstring) and return it. `recompute_mlp` makes the
    MLPs recompute their [tokens, 2 x intermediate] pre-activations in the backward instead of
    keeping them (less memory, one more GEMM). `decoder_layer` (with `rms_norm`) fuses each
    decoder layer's first residual add into its second norm, the norms' forwards then called by
    the layer's, not through the norm modules (hooks on those modules do not run), and chains the
    layers of a decoder stack that runs them (each layer's second residual add fused with the next
    norm; see the module's docstring). `attention`
    switches Hugging Face models on "sdpa" to fusekit attention (fusekit.hf_attention_forward:
    fusekit.attention without a mask, SDPA for padding, dropout, attention weights and the other
    cases fusekit.hf_attention.fallback_reason lists); off by default, because on Hopper fusekit's
    attention backward is slower than SDPA's and a training step would lose by it.
    `causal_mask_skip` (without `attention`) switches Hugging Face models on "sdpa" to "fusekit_sdpa":
    transformers' own SDPA function with fusekit's mask function, which passes no mask (SDPA's
    is_causal) wherever the mask is provably plain causal, under torch.compile too, where
    transformers builds a dense causal mask; off by default, because SDPA then runs another kernel
    (flash / cuDNN instead of a masked one): the same function, not the same rounding. Both
    switches also keep the positions a model computed itself from being taken for packed sequences
    under torch.compile (see fusekit.hf_attention). `qkv` (with `rope`) computes a Hugging Face
    LLaMA attention's q, k and v and their rope in one op (fusekit.functional.qkv_rope). Patching a
    patched module does nothing."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"fusekit.patch: argument 'model': expected a torch.nn.Module, got {type(model).__name__}")
    rope_modules, globals_used = set(), set()
    for m in model.modules():
        if _is_patched(m):
            continue
        if decoder_layer and rms_norm and _is_decoder_layer(m):
            base = type(m).forward
            _swap(m, "decoder_layer", {"forward": _decoder_layer_forward,
                                       "_fusekit_arg_names": _positional_names(base)[1:]})
            for name in _PROJECTIONS:
                proj = getattr(m.self_attn, name, None)
                if type(proj) is nn.Linear:
                    _swap(proj, "projection", {"forward": _projection_forward})
        elif rms_norm and _is_rms_norm(m):
            _swap(m, "rms_norm", {"forward": _rms_norm_forward})
        elif mlp and (kind := _mlp_kind(m)) is not None:
            _swap(m, "mlp", {"forward": _mlp_forward})
            object.__setattr__(m, "_fusekit_kind", kind)
            object.__setattr__(m, "_fusekit_recompute", recompute_mlp)
        elif cross_entropy and _is_causal_lm(m):
            from transformers.modeling_outputs import CausalLMOutputWithPast
            base = type(m).forward
            _swap(m, "causal_lm", {"forward": _causal_lm_forward, "_fusekit_base_forward": base,
                                   "_fusekit_arg_names": _positional_names(base),
                                   "_fusekit_output": CausalLMOutputWithPast})
        elif rope and type(m).__name__.endswith("Attention") and hasattr(sys.modules.get(type(m).__module__),
                                                                          "apply_rotary_pos_emb"):
            rope_modules.add(type(m).__module__)
            if qkv and _is_hf_attention(m):
                base = type(m).forward
                _swap(m, "attention", {"forward": _attention_forward,
                                       "_fusekit_base_forward": base,
                                       "_fusekit_module": sys.modules[type(m).__module__]})
    if decoder_layer and rms_norm:  # after the loop: a stack's layers and norm are patched by now
        for m in list(model.modules()):
            if "_fusekit_chain_layers" not in m.__dict__ and (n := _decoder_stack_layers(m)):
                _link_decoder_stack(m, n)
                register_inductor_fallbacks()  # for torch.compile of the chained layers
    if attention or causal_mask_skip:
        switched = _switch_attention(model, _hf_attention.register_hf_attention() if attention
                                     else _hf_attention.register_sdpa_causal_skip())
        for m in switched:
            if not _is_patched(m) and _hf_attention.computes_own_positions(type(m).forward):
                _swap(m, "positions", {"forward": _hf_attention.positions_forward(type(m).forward)})
                globals_used.add((type(m).__module__, "create_causal_mask"))
    globals_used |= {(name, "apply_rotary_pos_emb") for name in rope_modules}
    before = _GLOBAL_MODELS.get(model)
    held = set(before.peek()[2][0]) if before is not None and before.alive else set()
    new = tuple(sorted(k for k in globals_used - held if _patch_global(k)))
    if new:  # a model patched again with more (attention=True after patch(model)) holds both
        if before is not None:
            before.detach()
        _GLOBAL_MODELS[model] = weakref.finalize(model, _release_globals, tuple(sorted(held)) + new)
    return model


def _release_globals(keys: tuple) -> None:
    for key in keys:
        _unpatch_global(key)


def patch_llama(model: nn.Module, **options) -> nn.Module:
    """patch() for a Hugging Face LLaMA-architecture model (LlamaForCausalLM, LlamaModel, ...): the
    same swaps, after checking that the model is one."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in ("llama", "mistral", "qwen2", "qwen3"):
        raise ValueError(f"fusekit.patch_llama: argument 'model': expected a LLaMA-architecture model "
                         f"(config.model_type llama, mistral, qwen2 or qwen3), got {kind!r}")
    return patch(model, **options)


def unpatch(model: nn.Module) -> nn.Module:
    """Restore every module patch() swapped (and the rotary function and attention implementation
    it replaced) and return model."""
    _restore_attention(model)
    for m in model.modules():
        cls = m.__dict__.get(_ORIGINAL)
        if cls is not None:
            m.__class__ = cls
            del m.__dict__[_ORIGINAL]
        for attr in _PATCH_ATTRIBUTES:
            m.__dict__.pop(attr, None)
    release = _GLOBAL_MODELS.pop(model, None)
    if release is not None:
        release()
    return model


def patched_modules(model: nn.Module) -> dict[str, str]:
    """{qualified name: what it runs as} for every patched module, e.g. {"model.norm": "rms_norm"}."""
    return {name: m._fusekit_role for name, m in model.named_modules() if _is_patched(m)}
