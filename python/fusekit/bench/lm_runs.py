"""The language-model benchmark's models and runs: a Hugging Face LLaMA built from
``transformers.LlamaConfig`` (SDPA attention, the same seeded initialisation in every run), and
what each run does to it before training: nothing (eager), ``torch.compile``, Liger-Kernel's
``apply_liger_kernel_to_llama``, gradient checkpointing of every block, ``fusekit.patch``,
``fusekit.patch(attention=True)`` (fusekit attention in place of SDPA, the rest as ``fusekit``),
``fusekit.patch(causal_mask_skip=True)`` (``fusekit_nomask``: SDPA told is_causal instead of handed a
dense causal mask under torch.compile, the rest as ``fusekit``; ``nomask``: that alone on the
unmodified model); for LoRA, fusekit's ``LoRALinear`` or PEFT on every projection of a frozen model.

A run that claims fusekit attention (``fusekit_attn*``) is checked: one warm-up step after the
first runs under the profiler, and unless the ``fusekit::attention`` op ran in it, the run is
recorded as failed (``AttentionNotRun``) instead of measured under its name.

A run that cannot be set up (a package missing, ``fusekit.patch`` not in this build, Liger on a
machine without CUDA) raises ``RunUnavailable`` with the reason; the benchmark records it and goes
on with the next run.
"""
from __future__ import annotations

import contextlib
import copy
import importlib.metadata
import inspect
import re
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

CONFIGS = {
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "context": 64, "vocab_size": 512},
    "small": {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12, "num_attention_heads": 12,
              "num_key_value_heads": 12, "context": 1024, "vocab_size": 32000},
    "1b": {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 20, "num_attention_heads": 32,
           "num_key_value_heads": 8, "context": 2048, "vocab_size": 32000},
}
# What each config measures unless told: batches, training batch (about 16k tokens a step).
DEFAULTS = {"tiny": {"batches": "2", "train_batch": 2}, "small": {"batches": "64,128", "train_batch": 16},
            "1b": {"batches": "8,16", "train_batch": 8}}
RUNS = ["eager", "compile", "liger", "liger_compile", "checkpoint", "fusekit", "fusekit_compile", "fusekit_attn",
        "fusekit_attn_compile", "nomask", "nomask_compile", "fusekit_nomask", "fusekit_nomask_compile"]
# The runs of a bare command: fusekit attention and the causal-mask skip only when asked for (--runs).
DEFAULT_RUNS = [r for r in RUNS if not r.startswith(("fusekit_attn", "nomask", "fusekit_nomask"))]
# fusekit.compress_saved_tensors(bits) around the forward of a run: "hook<bits>" (the unmodified
# model), "<run>_hook<bits>" (fusekit_hook4, checkpoint_hook4, ...); eager autograd only.
HOOK_RUNS = ["hook8", "hook4", "hook2", "fusekit_hook8", "fusekit_hook4", "fusekit_hook2", "checkpoint_hook4"]
_HOOK = re.compile(r"(?:(?P<base>[a-z]+)_)?hook(?P<bits>[1248])")
LORA_RUNS = ["fusekit", "fusekit_compile", "peft", "peft_compile"]
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class RunUnavailable(RuntimeError):
    """The run cannot be set up here; the message says why."""


class AttentionNotRun(RuntimeError):
    """A run that claims fusekit attention did not run it (the model fell back to SDPA)."""


@contextlib.contextmanager
def attention_check(run: str):
    """Around one training step of a fusekit-attention run that is already compiled (not its first:
    tracing calls the op on fake tensors): profiles it and raises AttentionNotRun unless the
    fusekit::attention op ran; yields a dict that gets {"calls": how many times it ran}."""
    from torch.profiler import ProfilerActivity, profile

    from fusekit.ops import _registry

    # the op as a compiled graph calls it, and the autograd.Function that runs it in eager mode
    eager = getattr(_registry, "_EAGER", {}).get("attention")
    names = {"fusekit::attention"} | ({eager.__name__} if eager is not None else set())
    result = {}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        yield result
    result["calls"] = sum(e.name in names for e in prof.events())
    if not result["calls"]:
        raise AttentionNotRun(f"{run}: fusekit::attention did not run in a training step (the attention fell back "
                              f"to SDPA: a mask was built, see fusekit.hf_attention); not measured as {run}")


def llama_config(name: str, vocab: int | None = None):
    from transformers import LlamaConfig

    c = dict(CONFIGS[name])
    context = c.pop("context")
    if vocab:
        c["vocab_size"] = vocab
    cfg = LlamaConfig(**c, max_position_embeddings=context, use_cache=False, tie_word_embeddings=False,
                      attn_implementation="sdpa")
    cfg._attn_implementation = "sdpa"
    return cfg, context


def param_count(cfg) -> int:
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in LlamaForCausalLM(cfg).parameters())


def build_model(cfg, device, precision: str, seed: int) -> nn.Module:
    """The LLaMA of `cfg` on `device`, initialised from `seed` (the same weights in every run),
    f32 parameters for "autocast", bf16 for "bf16"."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        # a copy: the model keeps its config, and an attention switch (fusekit.patch(attention=True))
        # changes it; a run after would otherwise start on the switched attention
        model = LlamaForCausalLM(copy.deepcopy(cfg))
    if precision == "bf16":
        model.to(torch.bfloat16)
    return model.train()


def versions() -> dict:
    out = {}
    for pkg in ("torch", "transformers", "tokenizers", "peft", "liger_kernel", "triton", "matplotlib"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out


@dataclass
class Prepared:
    """step_model: what the training step calls (maybe compiled); model: the Hugging Face module
    under it (evaluated eagerly); undo: callbacks that restore anything patched process-wide."""
    model: nn.Module
    step_model: Callable
    undo: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    context: Callable = contextlib.nullcontext  # entered around each training step's forward
    fusekit_attention: bool = False  # the run claims fusekit attention: measure checks that it ran
    run: str = ""

    def restore(self):
        while self.undo:
            self.undo.pop()()


def _apply_liger(prep: Prepared, device) -> None:
    if torch.device(device).type != "cuda":
        raise RunUnavailable("Liger-Kernel's kernels are Triton kernels for CUDA; skipped on " + str(device))
    try:
        from liger_kernel.transformers import apply_liger_kernel_to_llama
    except Exception as e:  # noqa: BLE001  ImportError, or triton failing to initialise
        raise RunUnavailable(f"liger_kernel not importable: {type(e).__name__}: {e}") from None
    from transformers.models.llama import modeling_llama

    # apply_liger_kernel_to_llama also replaces module-level names (the rotary function, the
    # RMSNorm and MLP classes) that every later model in this process would pick up.
    names = ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP")
    saved = {n: getattr(modeling_llama, n) for n in names}
    saved_forward = modeling_llama.LlamaForCausalLM.forward

    def undo():
        for n, v in saved.items():
            setattr(modeling_llama, n, v)
        modeling_llama.LlamaForCausalLM.forward = saved_forward
    prep.undo.append(undo)
    apply_liger_kernel_to_llama(rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True,
                                swiglu=True, model=prep.model)


def _apply_fusekit(prep: Prepared, attention: bool = False, nomask: bool = False, only_mask: bool = False) -> None:
    import fusekit

    patch = getattr(fusekit, "patch", None)
    if patch is None:
        raise RunUnavailable(f"fusekit.patch does not exist in this build ({fusekit.build_info().get('commit')})")
    if attention and not hasattr(fusekit, "hf_attention_forward"):
        raise RunUnavailable(f"fusekit.patch(attention=True) does not exist in this build "
                             f"({fusekit.build_info().get('commit')})")
    if nomask and "causal_mask_skip" not in inspect.signature(patch).parameters:
        raise RunUnavailable(f"fusekit.patch(causal_mask_skip=True) does not exist in this build "
                             f"({fusekit.build_info().get('commit')})")
    options = {"attention": True} if attention else {"causal_mask_skip": True} if nomask else {}
    if only_mask:
        options |= {"rms_norm": False, "mlp": False, "rope": False, "cross_entropy": False, "decoder_layer": False}
    out = patch(prep.model, **options)
    if isinstance(out, nn.Module):
        prep.model = prep.step_model = out
    want = "fusekit" if attention else "fusekit_sdpa" if nomask else None
    impl = prep.model.config._attn_implementation
    if want is not None and impl != want:
        raise RunUnavailable(f"fusekit.patch({', '.join(f'{k}={v}' for k, v in options.items())}) left the model on "
                             f"attention {impl!r}")
    prep.fusekit_attention = attention


def split_hook(run: str) -> tuple[str, int | None]:
    """(the run without its hook, the hook's bits or None): "fusekit_hook4" -> ("fusekit", 4),
    "hook2" -> ("eager", 2), "compile" -> ("compile", None)."""
    m = _HOOK.fullmatch(run)
    if m is None:
        return run, None
    return m.group("base") or "eager", int(m.group("bits"))


def is_run(run: str) -> bool:
    base, bits = split_hook(run)
    return base in RUNS and (bits is None or not base.endswith("compile"))


def prepare(run: str, cfg, device, precision: str, seed: int, compile_dynamic, hook_min_bytes: int = 1 << 20) -> Prepared:
    """A fresh model (its own copy of cfg) with `run` applied (a hook run's hook packs saved tensors of at least
    `hook_min_bytes`)."""
    run, hook_bits = split_hook(run)
    if hook_bits is not None and run.endswith("compile"):
        raise RunUnavailable("fusekit.compress_saved_tensors applies to eager autograd, not to a compiled graph")
    model = build_model(cfg, device, precision, seed)
    prep = Prepared(model=model, step_model=model, run=run)
    if hook_bits is not None:
        import fusekit

        prep.context = lambda: fusekit.compress_saved_tensors(bits=hook_bits, min_bytes=hook_min_bytes)
    try:
        base = run.removesuffix("_compile")
        if base == "liger":
            _apply_liger(prep, device)
        elif base == "checkpoint":
            kwargs = {"use_reentrant": False}
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x's name
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        elif base == "fusekit":
            _apply_fusekit(prep)
        elif base == "fusekit_attn":  # the batch has no padding: every layer runs fusekit.attention
            _apply_fusekit(prep, attention=True)
        elif base in ("nomask", "fusekit_nomask"):  # SDPA with is_causal, no dense causal mask
            _apply_fusekit(prep, nomask=True, only_mask=base == "nomask")
        elif base not in ("eager", "compile"):
            raise ValueError(f"unknown run {run!r}; runs: {', '.join(RUNS)}")
        if run.endswith("compile"):
            prep.step_model = torch.compile(prep.model, dynamic=compile_dynamic)
    except BaseException:
        prep.restore()
        raise
    return prep


def _lora_fusekit(model: nn.Module, r: int, alpha: float) -> None:
    """What a fusekit user runs: fusekit.nn.add_lora (LoRALinear on every projection), then
    fusekit.patch for the rest of the model (norms, rotary, the head's loss)."""
    import fusekit
    import fusekit.nn as fnn

    if not hasattr(fnn, "add_lora") or not hasattr(fusekit, "patch"):
        raise RunUnavailable("fusekit.nn.add_lora / fusekit.patch do not exist in this build")
    fnn.add_lora(model, r, alpha, target_modules=tuple(LORA_TARGETS))
    fusekit.patch(model)


def _lora_peft(model: nn.Module, r: int, alpha: float) -> nn.Module:
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:
        raise RunUnavailable(f"peft not importable: {e}") from None
    lc = LoraConfig(r=r, lora_alpha=alpha, target_modules=LORA_TARGETS, lora_dropout=0.0, bias="none",
                    task_type="CAUSAL_LM")
    # Adapters in the base weights' dtype, as fusekit's LoRALinear holds them (PEFT's default
    # would keep bf16 models' adapters in f32).
    return get_peft_model(model, lc, autocast_adapter_dtype=False)


def prepare_lora(run: str, cfg, device, precision: str, seed: int, compile_dynamic, r: int = 16,
                 alpha: float = 32.0) -> Prepared:
    """A fresh model, every parameter frozen, a rank-r adapter on each projection of every block."""
    model = build_model(cfg, device, precision, seed)
    model.requires_grad_(False)
    torch.manual_seed(seed + 1)  # the adapters' initialisation (B = 0 in both, A random)
    base = run.removesuffix("_compile")
    if base == "fusekit":
        _lora_fusekit(model, r, alpha)
    elif base == "peft":
        model = _lora_peft(model, r, alpha)
    else:
        raise ValueError(f"unknown LoRA run {run!r}; runs: {', '.join(LORA_RUNS)}")
    prep = Prepared(model=model, step_model=model)
    if run.endswith("compile"):
        prep.step_model = torch.compile(model, dynamic=compile_dynamic)
    return prep
