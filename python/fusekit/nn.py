"""Drop-in modules: each built from the torch module it replaces, computing the same function.

- ``CompressedLinear`` / ``CompressedReLU``: keep their activations for the backward pass packed
  (x at 1, 2, 4 or 8 bits; the ReLU mask at one bit per element); the weight gradient is computed
  from the packed bits. ``compress(model, bits=2)`` swaps a model's ``nn.Linear`` and ``nn.ReLU``
  in place, sharing their parameters.
- ``GLUFeedForward``: a LLaMA-style MLP (``down_proj(act(gate_proj(x)) * up_proj(x))``) whose gate
  and up projections run as one fused GEMM + gated activation (keeping its [M, 2N] pre-activations
  for the backward, or recomputing them with ``recompute=True``).
- ``LoRALinear``, ``W4Linear``, ``FusedMLP``: a LoRA adapter on a frozen linear layer, a 4-bit
  weight for inference (``W4Linear.from_gptq`` / ``from_awq``: one layer of a GPTQ or AWQ
  checkpoint), a narrow MLP as one kernel. ``quantize(model)`` swaps a model's ``nn.Linear`` for
  ``W4Linear``; ``load_quantized(model, state_dict, "gptq" | "awq")`` loads a GPTQ or AWQ
  checkpoint into ``W4Linear`` layers.
- ``EmbeddingBagCollection`` (the optimizer fused into the backward, as FBGEMM's TBE) and
  ``Interaction``: DLRM's sparse side.
- ``RMSNorm``: LLaMA's (and, with offset 1, Gemma's) RMSNorm; ``forward(x, residual)`` fuses the
  residual add in front of it. ``RMSNorm.from_module(m)`` shares m's weight.
"""
from __future__ import annotations

import os
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import torch
from torch import Tensor, nn

from . import _C
from . import functional as Fk
from . import ops
from . import w4_formats


class _PackedLinearFn(torch.autograd.Function):
    """y = x Wᵀ + b keeping x packed; dW from the packed bits, dx = dy W, db = column sums of dy."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Optional[Tensor], bits: int, group: int):
        y = torch.nn.functional.linear(x, weight, bias)
        x2 = x.reshape(-1, x.shape[-1])
        packed = Fk.pack(x2, bits=bits, group=group, stats_dtype=torch.float32)
        ctx.save_for_backward(weight, packed.words, packed.scale, packed.min)
        ctx.meta = (packed.cols, packed.dtype, bits, group, bias is not None, x.shape)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        weight, words, scale, mn = ctx.saved_tensors
        cols, x_dtype, bits, group, has_bias, x_shape = ctx.meta
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = (dy2 @ weight.to(dy2.dtype)).reshape(x_shape) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            # The GPU kernel reads bf16 dy (the spec on the CPU takes any float dtype).
            dyw = dy2.to(torch.bfloat16) if dy2.is_cuda else dy2
            dw = ops.call("weight_grad_from_packed", dyw, words, scale, mn, cols, x_dtype, bits, group, weight.dtype)
        db = dy2.sum(0).to(weight.dtype) if has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None


class CompressedLinear(nn.Linear):
    """nn.Linear whose saved input is packed to `bits` (1, 2, 4, 8) in groups of `group` values.

    The forward is nn.Linear's; the weight gradient is computed from the quantized input (group-wise
    min/max, round to nearest), so it differs from nn.Linear's by that quantization. On a GPU the
    weight gradient reads dy in bf16."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, bits: int = 2,
                 group: int = 256, device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.bits, self.group = bits, group

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int = 2, group: int = 256) -> "CompressedLinear":
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.in_features, m.out_features = linear.in_features, linear.out_features
        m.weight, m.bias = linear.weight, linear.bias  # shared, not copied
        m.bits, m.group = bits, group
        return m

    def forward(self, x: Tensor) -> Tensor:
        if not torch.is_grad_enabled() or not (x.requires_grad or self.weight.requires_grad):
            return torch.nn.functional.linear(x, self.weight, self.bias)
        return _PackedLinearFn.apply(x, self.weight, self.bias, self.bits, self.group)

    def saved_bytes(self, x_shape, x_dtype=torch.float32) -> tuple[int, int]:
        """(bytes kept for the backward of an input of this shape, bytes nn.Linear keeps)."""
        rows = 1
        for s in x_shape[:-1]:
            rows *= s
        groups = -(-self.in_features // self.group)
        packed = rows * groups * (self.group * self.bits // 32) * 4 + 2 * rows * groups * 4
        return packed, rows * self.in_features * torch.empty(0, dtype=x_dtype).element_size()

    def extra_repr(self) -> str:
        return super().extra_repr() + f", bits={self.bits}, group={self.group}"


class CompressedReLU(nn.Module):
    """nn.ReLU keeping one bit per element for its backward (exact gradient)."""

    def __init__(self, inplace: bool = False):
        super().__init__()

    def forward(self, x: Tensor) -> Tensor:
        return ops.call_first("relu_packed", x)


def compress(model: nn.Module, bits: int = 2, group: int = 256) -> nn.Module:
    """Swaps every nn.Linear for a CompressedLinear and every nn.ReLU for a CompressedReLU, in
    place (parameters shared); returns the model."""
    for name, child in list(model.named_children()):
        if type(child) is nn.Linear:
            setattr(model, name, CompressedLinear.from_linear(child, bits, group))
        elif type(child) is nn.ReLU:
            setattr(model, name, CompressedReLU())
        else:
            compress(child, bits, group)
    return model


class GLUFeedForward(nn.Module):
    """down_proj(glu(gate_proj(x), up_proj(x))), the gate and up projections fused with the gated
    activation into one kernel. `w_gate_up` [2N, K] holds the two projections in fusekit's
    prepared (row-interleaved) layout; `to_linears()` gives them back as nn.Linear.

    recompute=False (the default) keeps the [M, 2N] pre-activations from the forward for the
    backward (two GEMMs there; M 2N values of the compute dtype kept per call, 2 M 2N bytes in
    bf16); recompute=True keeps only x and recomputes them in the backward (three GEMMs)."""

    def __init__(self, hidden: int, intermediate: int, kind: str = "swiglu", bias: bool = False, *,
                 device=None, dtype=None, gate: str = "first", recompute: bool = False):
        super().__init__()
        f = dict(device=device, dtype=dtype)
        gate_proj, up_proj = nn.Linear(hidden, intermediate, bias, **f), nn.Linear(hidden, intermediate, bias, **f)
        self.kind, self.gate, self.recompute = kind, gate, recompute
        self._set_gate_up(gate_proj, up_proj)
        self.down_proj = nn.Linear(intermediate, hidden, bias, **f)

    def _set_gate_up(self, gate_proj: nn.Linear, up_proj: nn.Linear) -> None:
        """w_gate_up (and b_gate_up) from the two projections, in the order the kernel activates
        (ops.glu_swaps_halves: geglu's kernel activates the second half)."""
        first, second = (up_proj, gate_proj) if ops.glu_swaps_halves(self.kind, self.gate) else (gate_proj, up_proj)
        with torch.no_grad():
            self.w_gate_up = nn.Parameter(ops.prepare_glu_weight(torch.cat((first.weight, second.weight)).detach()))
            self.b_gate_up = (nn.Parameter(ops.prepare_glu_weight(torch.cat((first.bias, second.bias)).detach()))
                              if gate_proj.bias is not None else None)

    @classmethod
    def from_linears(cls, gate_proj: nn.Linear, up_proj: nn.Linear, down_proj: nn.Linear,
                     kind: str = "swiglu", gate: str = "first", recompute: bool = False) -> "GLUFeedForward":
        """From a Hugging Face MLP's gate_proj, up_proj and down_proj, act(gate_proj(x)) · up_proj(x)
        (LLaMA's SwiGLU, Gemma's GeGLU; weights copied into the prepared layout; down_proj shared).
        gate="second" activates up_proj's half instead. recompute: as the constructor's."""
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.kind, m.gate, m.recompute = kind, gate, recompute
        m._set_gate_up(gate_proj, up_proj)
        m.down_proj = down_proj
        return m

    def to_linears(self) -> tuple[nn.Linear, nn.Linear]:
        """(gate_proj, up_proj) as nn.Linear."""
        w = ops.unprepare_glu_weight(self.w_gate_up.detach())
        n = w.shape[0] // 2
        gate = nn.Linear(w.shape[1], n, self.b_gate_up is not None, device=w.device, dtype=w.dtype)
        up = nn.Linear(w.shape[1], n, self.b_gate_up is not None, device=w.device, dtype=w.dtype)
        swap = ops.glu_swaps_halves(self.kind, self.gate)
        first, second = (up, gate) if swap else (gate, up)
        with torch.no_grad():
            first.weight.copy_(w[:n])
            second.weight.copy_(w[n:])
            if self.b_gate_up is not None:
                b = ops.unprepare_glu_weight(self.b_gate_up.detach())
                first.bias.copy_(b[:n])
                second.bias.copy_(b[n:])
        return gate, up

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        h = ops.glu_prepared(x.reshape(-1, x.shape[-1]), self.w_gate_up, self.b_gate_up, self.kind,
                             torch.backends.cuda.matmul.allow_tf32, self.recompute)
        return self.down_proj(h.reshape(*lead, h.shape[-1]))

    def extra_repr(self) -> str:
        return f"kind={self.kind!r}, gate={self.gate!r}, recompute={self.recompute}"


SwiGLU = GLUFeedForward


class LoRALinear(nn.Module):
    """A frozen nn.Linear plus a trainable low-rank adapter, in PEFT's layout: lora_A [r, in],
    lora_B [out, r], scaling alpha / r; y = base(x) + scaling (x Aᵀ) Bᵀ in one fused GEMM."""

    def __init__(self, base: nn.Linear, r: int, alpha: float):
        super().__init__()
        self.base = base
        base.weight.requires_grad_(False)
        self.r, self.scaling = r, alpha / r
        w = base.weight
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features, device=w.device, dtype=w.dtype))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r, device=w.device, dtype=w.dtype))
        nn.init.kaiming_uniform_(self.lora_A, a=5 ** 0.5)  # PEFT's initialisation: B = 0, so y = base(x)

    @classmethod
    def from_linear(cls, base: nn.Linear, r: int, alpha: float) -> "LoRALinear":
        return cls(base, r, alpha)

    def forward(self, x: Tensor) -> Tensor:
        return Fk.lora(x, self.base.weight, self.lora_A, self.lora_B, self.base.bias, scale=self.scaling)


LLAMA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def add_lora(model: nn.Module, r: int = 16, alpha: float = 32.0,
             target_modules: tuple[str, ...] = LLAMA_PROJECTIONS) -> nn.Module:
    """LoRA fine-tuning through fusekit, as PEFT's get_peft_model(model, LoraConfig(r, lora_alpha,
    target_modules, lora_dropout=0)): every nn.Linear whose attribute name is in `target_modules`
    becomes a LoRALinear on it (fused GEMM + adapter); every other parameter is frozen. In place;
    returns model."""
    if r < 1:
        raise ValueError(f"fusekit.nn.add_lora: argument 'r': expected a rank >= 1, got {r}")
    for p in model.parameters():
        p.requires_grad_(False)
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if name in target_modules and type(child) is nn.Linear]
    if not targets:
        raise ValueError(f"fusekit.nn.add_lora: argument 'target_modules': no nn.Linear named {list(target_modules)}")
    for parent, name, child in targets:
        setattr(parent, name, LoRALinear(child, r, alpha))
    return model



class LinearCrossEntropy(nn.Module):
    """An LM head (nn.Linear, its parameters shared, not copied) and the cross-entropy of its
    logits in one fused op: forward(h [..., H], targets [...]) returns the loss (an f32 scalar)
    without the [tokens, vocabulary] logits in memory. The options as fusekit.linear_cross_entropy
    takes them (ignore_index, label_smoothing, z_loss, reduction). For the logits themselves
    (generation), call the head."""

    def __init__(self, head: nn.Linear, *, ignore_index: int = -100, label_smoothing: float = 0.0,
                 z_loss: float = 0.0, reduction: str = "mean"):
        super().__init__()
        self.head = head
        self.ignore_index, self.label_smoothing, self.z_loss, self.reduction = (ignore_index, label_smoothing,
                                                                                z_loss, reduction)

    def forward(self, h: Tensor, targets: Tensor) -> Tensor:
        return Fk.linear_cross_entropy(h, self.head.weight, targets, self.head.bias, ignore_index=self.ignore_index,
                                       label_smoothing=self.label_smoothing, z_loss=self.z_loss,
                                       reduction=self.reduction)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, label_smoothing={self.label_smoothing}, z_loss={self.z_loss}, "
                f"reduction={self.reduction}")


class W4Linear(nn.Module):
    """An nn.Linear for inference with its weight quantized to 4 bits per value (group-wise scale
    and zero point, docs/qgemm.md); y = x w̃ᵀ + b computed from the 4-bit words. The layer computes
    in its dtype (its scales', f16 or bf16): x of another dtype is cast to it, and y is returned in
    x's dtype. ``perm`` (i64 [K], or None) is the order of the inputs the packed weight expects,
    set by act-order GPTQ checkpoints: x's columns are gathered in that order first, one extra pass
    over x per call."""

    def __init__(self, packed: Tensor, scale: Tensor, zero: Tensor, out_features: int, in_features: int,
                 group: int, bias: Optional[Tensor], perm: Optional[Tensor] = None):
        super().__init__()
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.register_buffer("packed", packed)
        self.register_buffer("scale", scale)
        self.register_buffer("zero", zero)
        self.register_buffer("bias", bias)
        self.register_buffer("perm", perm)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 128, dtype: Optional[torch.dtype] = None) -> "W4Linear":
        """Quantizes linear's weight (round to nearest, docs/qgemm.md). dtype: the layer's, f16 or
        bf16; None is the weight's own (which must then be f16 or bf16)."""
        w = linear.weight.detach()
        packed, scale, zero = ops.quantize_weights(w if dtype is None else w.to(dtype), group_size)
        b = None if linear.bias is None else linear.bias.detach().clone()
        return cls(packed, scale, zero, linear.out_features, linear.in_features, group_size, b)

    @classmethod
    def from_gptq(cls, qweight: Tensor, qzeros: Tensor, scales: Tensor, g_idx: Optional[Tensor] = None,
                  bias: Optional[Tensor] = None, *, checkpoint_format: str = "gptq", bits: int = 4,
                  dtype: torch.dtype = torch.float16, device=None) -> "W4Linear":
        """One layer of a 4-bit GPTQ checkpoint as AutoGPTQ / GPTQModel store it (qweight i32
        [K/8, N], qzeros i32 [G, N/8], scales [G, N], g_idx [K]; fusekit.w4_formats). checkpoint_format
        "gptq" (v1: stored zero points are zero − 1) or "gptq_v2". Act-order (g_idx not k / group) is
        sorted out here: the inputs are reordered once, and ``perm`` gathers x's columns per call.
        dtype f16 keeps the checkpoint's f16 scales exactly; bf16 rounds them. device: qweight's
        by default."""
        values = w4_formats.gptq_values(qweight, qzeros, scales, g_idx, checkpoint_format=checkpoint_format,
                                        bits=bits)
        return cls._from_values(values, bias, dtype, qweight.device if device is None else device,
                                "W4Linear.from_gptq")

    @classmethod
    def from_awq(cls, qweight: Tensor, qzeros: Tensor, scales: Tensor, bias: Optional[Tensor] = None, *,
                 bits: int = 4, dtype: torch.dtype = torch.float16, device=None) -> "W4Linear":
        """One layer of a 4-bit AWQ checkpoint as AutoAWQ's GEMM version stores it (qweight i32
        [K, N/8] and qzeros i32 [G, N/8] packed along N in AWQ's interleaved order, scales [G, N];
        fusekit.w4_formats). dtype and device as from_gptq's."""
        values = w4_formats.awq_values(qweight, qzeros, scales, bits=bits)
        return cls._from_values(values, bias, dtype, qweight.device if device is None else device,
                                "W4Linear.from_awq")

    @classmethod
    def _from_values(cls, v: "w4_formats.W4Values", bias: Optional[Tensor], dtype: torch.dtype, device,
                     op: str) -> "W4Linear":
        n, k = v.q.shape
        if dtype not in (torch.float16, torch.bfloat16):
            raise _C.Error(f"fk::{op}: argument 'dtype': expected torch.float16 or torch.bfloat16, got {dtype}")
        if bias is not None and (not isinstance(bias, Tensor) or tuple(bias.shape) != (n,)):
            got = f"{list(bias.shape)}" if isinstance(bias, Tensor) else type(bias).__name__
            raise _C.Error(f"fk::{op}: argument 'bias': expected None or a vector [N = {n}], got {got}")
        packed, scale, zero = ops.pack_weights(v.q, v.scale, v.zero, v.group, dtype)
        to = dict(device=device)
        b = None if bias is None else bias.detach().to(**to).clone()
        perm = None if v.perm is None else v.perm.to(**to)
        return cls(packed.to(**to), scale.to(**to), zero.to(**to), n, k, v.group, b, perm)

    def dequantized_weight(self) -> Tensor:
        """w̃ [N, K] in the layer's dtype, its inputs in the original order (x w̃ᵀ + b is the forward)."""
        w = ops.dequantize_weights(self.packed, self.scale, self.zero, self.out_features, self.in_features,
                                   self.group)
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out

    def forward(self, x: Tensor) -> Tensor:
        # A decode step calls this once per layer, eagerly, so it does only what the call needs:
        # no reshape (the op takes [..., K]), no cast to a dtype x already has, the buffers read
        # from the module's dict (nn.Module.__getattr__ costs most of a microsecond a buffer).
        buffers = self._buffers
        scale, bias, perm = buffers["scale"], buffers["bias"], buffers["perm"]
        x_dtype = x.dtype
        if perm is not None:
            x = x.index_select(-1, perm)
        if x_dtype != scale.dtype:
            x = x.to(scale.dtype)
        packed, zero = buffers["packed"], buffers["zero"]
        y = ops.call("qgemm", x, packed, scale, zero, self.out_features, self.in_features, self.group,
                     self._weights_unchanged(packed, scale, zero))
        if y.dtype != x_dtype:
            y = y.to(x_dtype)
        if bias is not None:
            y = y + (bias if bias.dtype == x_dtype else bias.to(x_dtype))
        return y

    def _weights_unchanged(self, packed: Tensor, scale: Tensor, zero: Tensor) -> bool:
        """Whether the weight's buffers are the tensors of this layer's previous call (weak
        references: .to() and load_state_dict's assignments make new ones) and no in-place write
        reached them since (their version counters, shared with every view of them): then the
        kernel before this call did not write them, and the call may promise constant weights
        (qgemm's constant_weights). The first call after a load or a change does not. Under
        torch.compile, no promise."""
        if torch.compiler.is_compiling():
            return False
        versions = (packed._version, scale._version, zero._version)
        seen = self.__dict__.get("_w4_seen")
        if seen is not None and seen[0]() is packed and seen[1]() is scale and seen[2]() is zero \
                and seen[3] == versions:
            return True
        self.__dict__["_w4_seen"] = (weakref.ref(packed), weakref.ref(scale), weakref.ref(zero), versions)
        return False

    def __getstate__(self):
        state = super().__getstate__()  # a copy of __dict__
        state.pop("_w4_seen", None)  # weak references do not pickle; a loaded layer starts unseen
        return state

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group={self.group}, "
                f"dtype={self.scale.dtype}, act_order={self.perm is not None}")


def _parent_of(model: nn.Module, qualified: str) -> tuple[nn.Module, str]:
    parent, _, name = qualified.rpartition(".")
    return (model.get_submodule(parent) if parent else model), name


def quantize(model: nn.Module, bits: int = 4, group_size: int = 128, *, dtype: Optional[torch.dtype] = None,
             skip: tuple[str, ...] = ("lm_head",)) -> nn.Module:
    """Swaps every nn.Linear of model for a W4Linear quantizing its weight (W4Linear.from_linear:
    round to nearest, group_size 32, 64, 128, or -1 for one group per row), in place; returns
    model. A Linear whose attribute name or dotted path is in `skip` stays (by default the LM head,
    which GPTQ and AWQ tools leave in 16 bits too). dtype: the layers' (f16 or bf16); None keeps an
    f16 / bf16 weight's dtype and takes f16 for any other."""
    if bits != 4:
        raise _C.Error(f"fk::quantize: argument 'bits': expected 4 (fusekit's kernel reads 4-bit weights), got {bits}")
    targets = [(name, m) for name, m in model.named_modules()
               if type(m) is nn.Linear and name not in skip and name.rpartition(".")[2] not in skip]
    for name, m in targets:
        group = m.in_features if group_size == -1 else group_size
        if group not in (32, 64, 128, m.in_features) or m.in_features % group:
            raise _C.Error(f"fk::quantize: argument 'group_size': expected 32, 64, 128 or -1, dividing every "
                           f"quantized layer's in_features, got {group_size} for {name} (in_features "
                           f"{m.in_features}); pass -1 or name the layer in skip")

    def quantized(m: nn.Linear) -> W4Linear:
        group = m.in_features if group_size == -1 else group_size
        dt = dtype or (m.weight.dtype if m.weight.dtype in (torch.float16, torch.bfloat16) else torch.float16)
        return W4Linear.from_linear(m, group, dt)

    # The quantization runs on the host with the GIL released, one layer per thread: a 7B model's
    # 224 layers take a minute or more on one core.
    with ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1, len(targets)))) as pool:
        for (name, _), w4 in zip(targets, pool.map(quantized, [m for _, m in targets])):
            parent, attr = _parent_of(model, name)
            setattr(parent, attr, w4)
    return model


def load_quantized(model: nn.Module, state_dict: dict, format: str = "gptq", *, checkpoint_format: str = "gptq",
                   dtype: torch.dtype = torch.float16, strict: bool = True) -> nn.Module:
    """Loads a 4-bit GPTQ or AWQ checkpoint's state dict (format "gptq" or "awq"; the tensors as
    W4Linear.from_gptq / from_awq take them) into model, a model of the checkpoint's architecture
    (e.g. transformers' LlamaForCausalLM(config)): every nn.Linear whose `<path>.qweight` is in
    state_dict becomes a W4Linear built from `<path>.qweight`, `.qzeros`, `.scales`, `.g_idx` (GPTQ)
    and `.bias`, on the device of the Linear's weight (the CPU for a meta weight), and every other
    entry is loaded by model.load_state_dict. strict: a key of state_dict left unused, or a tensor of
    model the state dict does not give, is an error (as load_state_dict's strict). In place; returns
    model. checkpoint_format and dtype: as W4Linear.from_gptq's."""
    if format not in ("gptq", "awq"):
        raise _C.Error(f"fk::load_quantized: argument 'format': expected 'gptq' or 'awq', got {format!r}")
    sd = dict(state_dict)
    swapped = []
    for name, m in list(model.named_modules()):
        prefix = name + "." if name else ""
        if type(m) is not nn.Linear or prefix + "qweight" not in sd:
            continue
        t = {key: sd.pop(prefix + key) for key in ("qweight", "qzeros", "scales", "g_idx", "bias")
             if prefix + key in sd}
        device = torch.device("cpu") if m.weight.device.type == "meta" else m.weight.device
        try:
            if format == "gptq":
                w4 = W4Linear.from_gptq(t["qweight"], t.get("qzeros"), t.get("scales"), t.get("g_idx"), t.get("bias"),
                                        checkpoint_format=checkpoint_format, dtype=dtype, device=device)
            else:
                w4 = W4Linear.from_awq(t["qweight"], t.get("qzeros"), t.get("scales"), t.get("bias"), dtype=dtype,
                                       device=device)
        except _C.Error as e:
            raise _C.Error(f"fk::load_quantized: {name}: {e}") from e
        if (w4.out_features, w4.in_features) != (m.out_features, m.in_features):
            raise _C.Error(f"fk::load_quantized: argument 'state_dict': expected {name} of a 4-bit checkpoint for "
                           f"an nn.Linear({m.in_features}, {m.out_features}), got tensors of a ({w4.in_features}, "
                           f"{w4.out_features}) layer (a checkpoint of other than 4 bits, or of another model?)")
        if strict and (m.bias is None) != (w4.bias is None):
            raise _C.Error(f"fk::load_quantized: argument 'state_dict': expected {name}.bias "
                           f"{'absent' if m.bias is None else 'present'}, as in the model, got it "
                           f"{'present' if m.bias is None else 'absent'}")
        parent, attr = _parent_of(model, name)
        setattr(parent, attr, w4)
        swapped.append(prefix)
    if not swapped:
        raise _C.Error("fk::load_quantized: argument 'state_dict': expected '<path>.qweight' entries of the model's "
                       "nn.Linear layers, got none")
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [key for key in missing if not key.startswith(tuple(swapped))]
    if strict and (missing or unexpected):
        raise _C.Error(f"fk::load_quantized: argument 'state_dict': expected the model's other tensors and nothing "
                       f"else, got missing {missing[:8]}, unexpected {unexpected[:8]}")
    return model


class FusedMLP(nn.Module):
    """A narrow MLP (nn.Linear layers with ReLU / sigmoid / identity between) as one kernel:
    every weight in shared memory, the hidden activations in registers (docs/mlp.md). bf16 or f16;
    input and output widths up to 128, every hidden layer one width of 16, 32, 64 or 128.
    Gradients: dW and db are computed in f32 and handed to autograd in the parameters' dtype."""

    _ACTS = {nn.ReLU: "relu", nn.Sigmoid: "sigmoid", nn.Identity: "identity"}

    def __init__(self, linears: list, acts: list):
        super().__init__()
        self.linears = nn.ModuleList(linears)
        self.acts = ",".join(acts)

    @classmethod
    def from_sequential(cls, seq: nn.Sequential) -> "FusedMLP":
        """From nn.Sequential(Linear, act, Linear, act, ..., Linear[, act]) (parameters shared)."""
        linears, acts = [], []
        for m in seq:
            if isinstance(m, nn.Linear):
                if len(acts) < len(linears):
                    acts.append("identity")
                linears.append(m)
            elif type(m) in cls._ACTS and len(acts) < len(linears):
                acts.append(cls._ACTS[type(m)])
            else:
                raise _C.Error("fk::FusedMLP.from_sequential: argument 'seq': expected Linear layers each followed "
                               f"by at most one ReLU, Sigmoid or Identity, got {m!r}")
        if len(acts) < len(linears):
            acts.append("identity")
        return cls(linears, acts)

    def forward(self, x: Tensor) -> Tensor:
        ws = [lin.weight for lin in self.linears]
        bs = [lin.bias for lin in self.linears]
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in ws)):
            y = ops.call("fused_mlp_train", x2, ws, bs, self.acts)[0]
        else:
            y = ops.call("fused_mlp", x2, ws, bs, self.acts)
        return y.reshape(*lead, y.shape[-1])


class EmbeddingBagCollection(nn.Module):
    """T embedding tables of one dim D, looked up as bags in one launch: forward(indices, offsets)
    -> [B, T, D] f32, out[b, t] the sum (or mean) of table t's rows in bag t * B + b. indices and
    offsets are table-major CSR (offsets [T * B + 1]), as FBGEMM's TBE takes them;
    ``collate(per_table)`` builds them from nn.EmbeddingBag-style (indices, offsets) pairs.

    optimizer=None: the weight gets a dense gradient like any parameter (nn.EmbeddingBag with
    sparse=False). optimizer="sgd" / "adagrad" / "rowwise_adagrad": the update is applied in the
    backward to the rows the batch touched, as FBGEMM's TBE does; ``weight.grad`` stays None, so a
    dense optimizer over ``model.parameters()`` leaves the tables alone. ``lr`` may be changed
    between steps. Tables are stacked in ``weight`` [sum(num_embeddings), D] (``table(t)`` is a
    view of one). With validate_indices, GPU input is checked before every lookup (two host
    synchronisations); CPU input always is.

    dtype: the tables' dtype, torch.float32 (default), torch.bfloat16 or torch.float16 (half the
    memory; rows pooled in f32, the output f32). With a fused optimizer, 16-bit tables keep f32
    optimizer state and store each updated value with unbiased stochastic rounding (each step's
    draws from torch's generator), so that updates smaller than a 16-bit step still move the
    tables on average; without one, the dense gradient comes in the tables' dtype."""

    def __init__(self, num_embeddings, embedding_dim: int, *, pooling: str = "sum", optimizer: Optional[str] = None,
                 lr: float = 0.01, eps: float = 1e-8, validate_indices: bool = True, device=None, dtype=None):
        super().__init__()
        if optimizer not in (None, "sgd", "adagrad", "rowwise_adagrad"):
            raise _C.Error("fk::EmbeddingBagCollection: argument 'optimizer': expected None, sgd, adagrad or "
                           f"rowwise_adagrad, got {optimizer}")
        dtype = torch.float32 if dtype is None else dtype
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise _C.Error("fk::EmbeddingBagCollection: argument 'dtype': expected torch.float32, torch.bfloat16 or "
                           f"torch.float16, got {dtype}")
        self.table_rows = [int(n) for n in num_embeddings]
        self.embedding_dim, self.pooling, self.optimizer = embedding_dim, pooling, optimizer
        self.lr, self.eps, self.validate_indices = lr, eps, validate_indices
        total = sum(self.table_rows)
        self.weight = nn.Parameter(torch.empty(total, embedding_dim, device=device, dtype=dtype))
        state = None
        if optimizer == "adagrad":
            state = torch.zeros(total, embedding_dim, device=device)
        elif optimizer == "rowwise_adagrad":
            state = torch.zeros(total, device=device)
        self.register_buffer("optimizer_state", state)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each table uniform in ±sqrt(1 / rows), as the DLRM reference initialises its tables."""
        with torch.no_grad():
            for t, rows in enumerate(self.table_rows):
                self.table(t).uniform_(-(1.0 / rows) ** 0.5, (1.0 / rows) ** 0.5)

    def table(self, t: int) -> Tensor:
        base = sum(self.table_rows[:t])
        return self.weight[base:base + self.table_rows[t]]

    @classmethod
    def from_embedding_bags(cls, bags, **kwargs) -> "EmbeddingBagCollection":
        """From nn.EmbeddingBag modules of one dim and one mode (sum or mean); weights copied. The
        tables keep the bags' dtype where it is bf16 or f16 (f32 otherwise) unless dtype is given."""
        bags = list(bags)
        dims, modes = {b.embedding_dim for b in bags}, {b.mode for b in bags}
        if len(dims) != 1 or len(modes) != 1 or modes - {"sum", "mean"}:
            raise _C.Error("fk::EmbeddingBagCollection.from_embedding_bags: argument 'bags': expected tables of one "
                           f"dim and one mode (sum or mean), got dims {sorted(dims)} and modes {sorted(modes)}")
        w = bags[0].weight
        kwargs.setdefault("dtype", w.dtype if w.dtype in (torch.bfloat16, torch.float16) else torch.float32)
        ebc = cls([b.num_embeddings for b in bags], dims.pop(), pooling=modes.pop(), device=w.device, **kwargs)
        with torch.no_grad():
            for t, b in enumerate(bags):
                ebc.table(t).copy_(b.weight)
        return ebc

    @staticmethod
    def collate(per_table) -> tuple[Tensor, Tensor]:
        """(indices, offsets) for forward from one (indices, offsets) pair per table, each as
        nn.EmbeddingBag takes them (offsets: the B start positions) and the same B for every table."""
        per_table = list(per_table)
        batch = {o.numel() for _, o in per_table}
        if len(batch) != 1:
            raise _C.Error("fk::EmbeddingBagCollection.collate: argument 'per_table': expected the same batch "
                           f"(number of offsets) for every table, got {sorted(batch)}")
        starts, base = [], 0
        for idx, off in per_table:
            starts.append(off + base)
            base += idx.numel()
        first = per_table[0][1]
        offsets = torch.cat(starts + [first.new_full((1,), base)])
        return torch.cat([idx for idx, _ in per_table]), offsets

    def forward(self, indices: Tensor, offsets: Tensor) -> Tensor:
        if self.validate_indices and indices.is_cuda and not torch.compiler.is_compiling():
            Fk.check_bags(indices, offsets, self.table_rows, op="EmbeddingBagCollection")
        update = self.optimizer or "dense_gradient"
        return ops.call_first("embedding_bag", self.weight, indices, offsets, None, self.table_rows, self.pooling,
                              "seed", update, float(self.lr), float(self.eps), self.optimizer_state)

    def extra_repr(self) -> str:
        return (f"tables={len(self.table_rows)}, rows={sum(self.table_rows)}, dim={self.embedding_dim}, "
                f"pooling={self.pooling}, optimizer={self.optimizer}, dtype={self.weight.dtype}")


class Interaction(nn.Module):
    """DLRM's feature interaction: forward(dense [B, D], sparse [B, T, D]) -> [B, I]. kind "dot":
    the dense features, then the dot product of every pair of the F = T + 1 feature vectors (j < i,
    or j <= i with self_interaction), in the DLRM reference's order; "cat": all F D features."""

    def __init__(self, kind: str = "dot", self_interaction: bool = False):
        super().__init__()
        self.kind, self.self_interaction = kind, self_interaction

    def forward(self, dense: Tensor, sparse: Tensor) -> Tensor:
        z = torch.cat((dense.unsqueeze(1), sparse), dim=1)
        return ops.call("interaction", z, self.kind, self.self_interaction)

    def extra_repr(self) -> str:
        return f"kind={self.kind}, self_interaction={self.self_interaction}"


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension, y = x · rstd · (weight + offset) (fusekit.rms_norm), with a
    `weight` [hidden] parameter: the state dict of transformers' LlamaRMSNorm and torch.nn.RMSNorm.
    offset 0 is LLaMA's, 1 Gemma's (the weight then starts at 0). forward(x) gives the norm;
    forward(x, residual) gives (norm(x + residual), x + residual) in one pass (fusekit.add_rms_norm).
    eps None is torch.finfo(x.dtype).eps at each call, as torch.nn.RMSNorm's."""

    def __init__(self, hidden: int, eps: Optional[float] = 1e-6, offset: float = 0.0, device=None, dtype=None):
        super().__init__()
        self.hidden, self.eps, self.offset = hidden, eps, float(offset)
        self.weight = nn.Parameter(torch.full((hidden,), 1.0 - float(offset), device=device, dtype=dtype))

    def forward(self, x: Tensor, residual: Optional[Tensor] = None):
        if residual is None:
            return Fk.rms_norm(x, self.weight, self.eps, self.offset)
        return Fk.add_rms_norm(x, residual, self.weight, self.eps, self.offset)

    @classmethod
    def from_module(cls, m: nn.Module, offset: float = 0.0) -> "RMSNorm":
        """The RMSNorm of module m, sharing its weight parameter: a Hugging Face RMSNorm (eps from
        `variance_epsilon`, or `eps`) or torch.nn.RMSNorm (`eps`, None meaning torch.finfo(x.dtype).eps).
        offset 1 for Gemma's norms, whose weight scales by (1 + weight)."""
        weight = getattr(m, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
            raise _C.Error(f"fk::RMSNorm.from_module: argument 'm': expected a module with a 1-D weight "
                           f"(an RMSNorm over the last dimension), got {type(m).__name__} with weight "
                           f"{None if weight is None else list(weight.shape)}")
        if hasattr(m, "variance_epsilon"):
            eps = m.variance_epsilon
        elif hasattr(m, "eps"):
            eps = m.eps
        else:
            raise _C.Error(f"fk::RMSNorm.from_module: argument 'm': expected a module with `variance_epsilon` "
                           f"or `eps`, got {type(m).__name__}")
        norm = cls.__new__(cls)
        nn.Module.__init__(norm)
        norm.hidden, norm.eps, norm.offset = weight.shape[0], eps, float(offset)
        norm.weight = weight
        return norm

    def extra_repr(self) -> str:
        return f"{self.hidden}, eps={self.eps}, offset={self.offset}"
