"""torch's own int4 weight-only linear layer, the peer of fusekit's W4Linear in the decode benchmark:
the weights quantized and packed as gpt-fast and torchao's int4 weight-only path do, multiplied by
``aten._weight_int4pack_mm`` (``_weight_int4pack_mm_for_cpu`` on the CPU).

Quantization (gpt-fast's ``get_group_qparams`` and ``group_quantize_tensor_from_qparams``): per
group of ``group`` consecutive inputs of a row, s = (max − min) / 15 and z = min + 8 s, both rounded
to bf16, q = round((w − (z − 8 s)) / s) clamped to [0, 15]; the weight the kernel multiplies by is
w̃ = (q − 8) s + z. ``scales_and_zeros`` is [K / group, N, 2] bf16 (s, z). The packing entry point
and the layout it takes changed across torch versions: uint8 [N, K / 2], two values a byte (even k
in the high nibble), for ``_convert_weight_to_int4pack`` since torch 2.5; int32 [N, K] before, and
for the CPU entry point. ``Int4Kernel`` finds the form this torch takes by trying both on a small
weight and checking the product against the dequantized weight, so that a torch whose packing
differs again gives a clear error instead of wrong numbers.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

INNER_K_TILES = 8  # the packing's tile parameter (gpt-fast's default): K a multiple of 16 x 8


class Int4Unavailable(RuntimeError):
    """This torch or device cannot run the int4 kernel; the message says why."""


def quantize(w: Tensor, group: int) -> tuple[Tensor, Tensor, Tensor]:
    """(q i32 [N, K] in [0, 15], s bf16 [N, K / group], z bf16 [N, K / group]) of w [N, K], as
    gpt-fast quantizes (module docstring), computed in f32 on w's device."""
    n, k = w.shape
    g = w.detach().float().reshape(-1, group)
    lo, hi = g.amin(1, keepdim=True), g.amax(1, keepdim=True)
    s = ((hi - lo).clamp(min=1e-6) / 15).to(torch.bfloat16)
    z = (lo + 8 * s.float()).to(torch.bfloat16)
    q = ((g - (z.float() - 8 * s.float())) / s.float()).round().clamp(0, 15).to(torch.int32)
    return q.reshape(n, k), s.reshape(n, -1), z.reshape(n, -1)


def dequantize(q: Tensor, s: Tensor, z: Tensor, group: int) -> Tensor:
    """w̃ [N, K] in f32: (q − 8) s + z per group."""
    n, k = q.shape
    w = (q.reshape(-1, group).float() - 8) * s.reshape(-1, 1).float() + z.reshape(-1, 1).float()
    return w.reshape(n, k)


def scales_and_zeros(s: Tensor, z: Tensor) -> Tensor:
    """[K / group, N, 2] bf16, the kernel's qScaleAndZeros, from s and z [N, K / group]."""
    return torch.stack((s, z), dim=2).transpose(0, 1).contiguous()


class Int4Kernel:
    """The packing and matmul entry points of this torch on `device`, with the input form the
    packing takes, checked on a small weight."""

    def __init__(self, device: torch.device, group: int):
        aten = torch.ops.aten
        cpu = device.type == "cpu"
        names = (("_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu") if cpu
                 else ("_convert_weight_to_int4pack", "_weight_int4pack_mm"))
        missing = [n for n in names if not hasattr(aten, n)]
        if missing:
            raise Int4Unavailable(f"torch {torch.__version__} has no aten.{', aten.'.join(missing)}")
        self.convert, self.mm = (getattr(aten, n).default for n in names)
        self.group = group
        forms = ("int32",) if cpu else ("uint8", "int32")
        errors = []
        for form in forms:
            self.form = form
            try:
                err = self._probe(device)
            except RuntimeError as e:
                errors.append(f"{form} [N, {'K / 2' if form == 'uint8' else 'K'}]: {str(e).splitlines()[0][:200]}")
                continue
            if err is None:
                return
            errors.append(f"{form}: runs, but {err}")
        raise Int4Unavailable(f"torch {torch.__version__}'s {names[0]} / {names[1]} on {device} take none of the "
                              f"weight forms this script knows: " + "; ".join(errors))

    def pack(self, q: Tensor) -> Tensor:
        """q i32 [N, K] in [0, 15] in the kernel's layout."""
        if self.form == "uint8":
            q = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
        return self.convert(q.contiguous(), INNER_K_TILES)

    def _probe(self, device) -> str | None:
        """None where the kernel's product on a small weight matches x w̃ᵀ, else what went wrong."""
        gen = torch.Generator().manual_seed(0)
        n, k = 64, 2 * max(self.group, 16 * INNER_K_TILES)
        w = (torch.randn(n, k, generator=gen) * 0.02).to(device)
        x = torch.randn(4, k, generator=gen).to(device=device, dtype=torch.bfloat16)
        q, s, z = quantize(w, self.group)
        y = self.mm(x, self.pack(q), self.group, scales_and_zeros(s, z)).float()
        want = x.float() @ dequantize(q, s, z, self.group).t()
        err = (y - want).abs().max().item()
        # Right packing: bf16 rounding of y and of the kernel's partial sums (well under 3%);
        # a wrong nibble order or layout: errors as large as y itself.
        if err <= 0.03 * want.abs().max().item():
            return None
        return f"its product is {err:.3g} away from x w̃ᵀ (|x w̃ᵀ| up to {want.abs().max().item():.3g})"


class Int4Linear(nn.Module):
    """An nn.Linear through torch's int4 kernel: y = x w̃ᵀ + b, x bf16 (the kernel's only dtype) of
    shape [..., K], w̃ as the module docstring says."""

    def __init__(self, kernel: Int4Kernel, packed: Tensor, sz: Tensor, in_features: int, out_features: int,
                 bias: Tensor | None):
        super().__init__()
        self.mm, self.group = kernel.mm, kernel.group
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", sz)
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, kernel: Int4Kernel, dequantized: dict | None = None,
                    name: str = "") -> "Int4Linear":
        """linear quantized and packed; with `dequantized`, w̃ (f32) is also put there under `name`."""
        q, s, z = quantize(linear.weight, kernel.group)
        if dequantized is not None:
            dequantized[name] = dequantize(q, s, z, kernel.group)
        b = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16)
        return cls(kernel, kernel.pack(q), scales_and_zeros(s, z), linear.in_features, linear.out_features, b)

    def forward(self, x: Tensor) -> Tensor:
        y = self.mm(x.reshape(-1, self.in_features), self.packed, self.group, self.scales_and_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group={self.group}"


def quantize_model(model: nn.Module, group: int = 128, skip: tuple[str, ...] = ("lm_head",),
                   dequantized: dict | None = None) -> nn.Module:
    """Every nn.Linear of model (a bf16 model) but those named in `skip` as an Int4Linear, in
    place, as fusekit.quantize swaps W4Linear in. Raises Int4Unavailable where this torch cannot."""
    targets = [(name, m) for name, m in model.named_modules()
               if type(m) is nn.Linear and name not in skip and name.rpartition(".")[2] not in skip]
    if not targets:
        return model
    kernel = Int4Kernel(targets[0][1].weight.device, group)
    for name, m in targets:
        if m.in_features % (16 * INNER_K_TILES) or m.in_features % group or m.out_features % 8:
            raise Int4Unavailable(f"{name}: torch's int4 kernel takes K a multiple of {16 * INNER_K_TILES} and of "
                                  f"the group ({group}) and N a multiple of 8, got [N {m.out_features}, K "
                                  f"{m.in_features}]")
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, Int4Linear.from_linear(m, kernel, dequantized, name))
    return model
