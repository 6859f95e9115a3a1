"""Under torch.autocast, fusekit's GEMM-shaped ops (glu, lora, fused_mlp, attention) run in
autocast's dtype as torch's matmuls do: f32 inputs and parameters are cast first (the result is the
op on the cast inputs, exactly), gradients reach the f32 leaves in f32, and the modules built on
them follow."""
import copy

import pytest
import torch

import fusekit
import fusekit.nn
from helpers import rand

DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_glu_runs_in_the_autocast_dtype(dtype, device):
    x = rand((33, 24), torch.float32, device, 1, True)
    w = rand((2 * 40, 24), torch.float32, device, 2, True)
    b = rand((2 * 40,), torch.float32, device, 3, True)
    with torch.autocast(device, dtype=dtype):
        y = fusekit.glu(x, w, b, kind="swiglu")
    assert y.dtype == dtype
    want = fusekit.glu(x.detach().to(dtype), w.detach().to(dtype), b.detach().to(dtype), kind="swiglu")
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    y.float().sum().backward()
    for t in (x, w, b):
        assert t.grad is not None and t.grad.dtype == torch.float32 and bool(torch.isfinite(t.grad).all())
    # the same gradient as the op on the cast inputs, cast back
    xc, wc, bc = (t.detach().to(dtype).requires_grad_() for t in (x, w, b))
    fusekit.glu(xc, wc, bc, kind="swiglu").float().sum().backward()
    torch.testing.assert_close(x.grad, xc.grad.float(), rtol=0, atol=0)
    torch.testing.assert_close(w.grad, wc.grad.float(), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lora_runs_in_the_autocast_dtype(dtype, device):
    x = rand((17, 32), torch.float32, device, 4, True)
    w = rand((24, 32), torch.float32, device, 5)
    a = rand((4, 32), torch.float32, device, 6, True)
    b = rand((24, 4), torch.float32, device, 7, True)
    with torch.autocast(device, dtype=dtype):
        y = fusekit.lora(x, w, a, b, scale=0.5)
    assert y.dtype == dtype
    want = fusekit.lora(*(t.detach().to(dtype) for t in (x, w, a, b)), scale=0.5)
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    y.float().sum().backward()
    for t in (x, a, b):
        assert t.grad is not None and t.grad.dtype == torch.float32


def test_modules_follow_autocast(device):
    torch.manual_seed(0)
    ff = fusekit.nn.GLUFeedForward(24, 40).to(device)
    x = rand((2, 5, 24), torch.float32, device, 8)
    with torch.autocast(device, dtype=torch.bfloat16):
        y = ff(x)
    assert y.dtype == torch.bfloat16  # down_proj is torch's linear, also in bf16 under autocast
    y.float().sum().backward()
    assert ff.w_gate_up.grad.dtype == torch.float32
    lin = fusekit.nn.LoRALinear(torch.nn.Linear(24, 16).to(device), r=4, alpha=8)
    with torch.autocast(device, dtype=torch.bfloat16):
        assert lin(x).dtype == torch.bfloat16


def test_without_autocast_nothing_is_cast(device):
    x, w = rand((8, 16), torch.float32, device, 9), rand((2 * 8, 16), torch.float32, device, 10)
    assert fusekit.glu(x, w, kind="swiglu").dtype == torch.float32
    with torch.autocast(device, dtype=torch.bfloat16, enabled=False):
        assert fusekit.glu(x, w, kind="swiglu").dtype == torch.float32


def test_autocast_rule_compiles_without_graph_breaks():
    x, w = rand((16, 24), torch.float32, "cpu", 11, True), rand((48, 24), torch.float32, "cpu", 12, True)

    def f(x, w):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return fusekit.glu(x, w, kind="swiglu")

    y = torch.compile(f, fullgraph=True, backend="aot_eager")(x, w)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, fusekit.glu(x.detach().bfloat16(), w.detach().bfloat16(), kind="swiglu"),
                               rtol=0, atol=0)
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_runs_in_the_autocast_dtype(dtype, device):
    q, k, v = (rand((1, 2, 9, 64), torch.float32, device, s) for s in (13, 14, 15))
    with torch.autocast(device, dtype=dtype):
        out = fusekit.attention(q, k, v, causal=True)
    assert out.dtype == dtype
    torch.testing.assert_close(out, fusekit.attention(q.to(dtype), k.to(dtype), v.to(dtype), causal=True),
                               rtol=0, atol=0)


def test_fused_mlp_runs_in_the_autocast_dtype(device):
    torch.manual_seed(1)
    seq = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).to(device)
    mlp = fusekit.nn.FusedMLP.from_sequential(seq)
    x = rand((33, 20), torch.float32, device, 16, True)
    with torch.autocast(device, dtype=torch.bfloat16):
        y = mlp(x)
    assert y.dtype == torch.bfloat16
    with torch.no_grad():
        in_bf16 = fusekit.nn.FusedMLP.from_sequential(
            torch.nn.Sequential(*(m.to(torch.bfloat16) if isinstance(m, torch.nn.Linear) else m
                                  for m in copy.deepcopy(seq))))
        torch.testing.assert_close(y.detach(), in_bf16(x.detach().bfloat16()), rtol=0, atol=0)
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32
    for p in seq.parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32
