"""Shared checks of the Python tests."""
import torch


def assert_weight_grad_close(dw, dy, xq, device):
    """dw against dyᵀ xq: fp32 accumulation on the CPU; on a GPU x̂ may also be one bf16 unit in the
    last place away from xq (f32 statistics take an FFMA whose result can round to the neighbour,
    docs/quant.md), so each element is held to sum_k |dy| |x̂| 2^-7."""
    want = dy.t() @ xq
    slack = (dy.abs().t() @ xq.abs()) * (2.0 ** -7 if device == "cuda" else 1e-6) + 1e-4
    err = (dw - want).abs()
    assert bool((err <= slack).all()), (err - slack).max()
