"""Shared inputs and checks of the Python tests."""
import torch

# Tolerances per dtype, for one rounding of an fp32 result (bf16 8 bits, f16 11 bits of mantissa).
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float16: dict(rtol=2e-3, atol=2e-3)}


def rand(shape, dtype, device, seed=0, requires_grad=False):
    """Standard normal values from a seeded CPU generator (the same on every device), then cast."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(device=device, dtype=dtype).requires_grad_(requires_grad)


def assert_weight_grad_close(dw, dy, xq, device):
    """dw against dyᵀ xq: fp32 accumulation on the CPU; on a GPU x̂ may also be one bf16 unit in the
    last place away from xq (f32 statistics take an FFMA whose result can round to the neighbour,
    docs/quant.md), so each element is held to sum_k |dy| |x̂| 2^-7."""
    want = dy.t() @ xq
    slack = (dy.abs().t() @ xq.abs()) * (2.0 ** -7 if device == "cuda" else 1e-6) + 1e-4
    err = (dw - want).abs()
    assert bool((err <= slack).all()), (err - slack).max()
