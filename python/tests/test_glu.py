"""The glu family through PyTorch: every gated activation, forward and gradients against plain
PyTorch math on the chunked projection; opcheck."""
import math

import pytest

torch = pytest.importorskip("torch", reason="the operator tests need PyTorch")
import torch.nn.functional as F  # noqa: E402

import fusekit  # noqa: E402
import fusekit.nn  # noqa: E402
from fusekit import ops  # noqa: E402
from helpers import rand  # noqa: E402


@pytest.mark.parametrize("kind", ["sigmoid_tanh", "swiglu", "geglu_tanh", "geglu_erf", "reglu"])
@pytest.mark.parametrize("mkn", [(1, 8, 4), (37, 24, 20), (64, 64, 48)])
def test_glu_forward_and_gradients_match_torch(kind, mkn, device):
    m, k, n = mkn
    x = rand((m, k), torch.float32, device, 15, True)
    w = (rand((2 * n, k), torch.float32, device, 16) / math.sqrt(k)).requires_grad_()
    b = rand((2 * n,), torch.float32, device, 17, True)
    out = fusekit.glu(x, w, b, kind=kind, allow_tf32=False)
    l, r = (x @ w.t() + b).chunk(2, dim=-1)
    f = {"sigmoid_tanh": lambda l, r: torch.sigmoid(l) * torch.tanh(r), "swiglu": lambda l, r: F.silu(l) * r,
         "geglu_tanh": lambda l, r: F.gelu(l, approximate="tanh") * r, "geglu_erf": lambda l, r: F.gelu(l) * r,
         "reglu": lambda l, r: F.relu(l) * r}[kind]
    want = f(l, r)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    dy = rand((m, n), torch.float32, device, 18)
    got = torch.autograd.grad(out, (x, w, b), dy)
    exp = torch.autograd.grad(want, (x, w, b), dy)
    for g, e in zip(got, exp):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)


def test_opcheck_glu(device):
    x = rand((5, 12), torch.float32, device, 20, True)
    b = rand((12,), torch.float32, device, 21, True)
    w = rand((8, 12), torch.float32, device, 22, True)
    torch.library.opcheck(ops.glu, (x, w, b[:8].detach().clone().requires_grad_(), "swiglu", False))


@pytest.mark.parametrize("kind,act", [("geglu_tanh", lambda z: F.gelu(z, approximate="tanh")), ("swiglu", F.silu)])
def test_gate_second_activates_the_second_half(kind, act, device):
    x, w = rand((9, 16), torch.float32, device, 30), rand((2 * 12, 16), torch.float32, device, 31) / 4
    l, r = (x @ w.t()).chunk(2, dim=-1)
    torch.testing.assert_close(fusekit.glu(x, w, kind=kind, allow_tf32=False, gate="second"), l * act(r),
                               rtol=1e-4, atol=1e-4)
    with pytest.raises(fusekit.Error, match="argument 'gate'"):
        fusekit.glu(x, w, kind=kind, gate="middle")


@pytest.mark.parametrize("kind,act", [("geglu_tanh", lambda z: F.gelu(z, approximate="tanh")),
                                      ("geglu_erf", F.gelu), ("swiglu", F.silu), ("reglu", F.relu)])
def test_hugging_face_mlp_converted_computes_the_same_function(kind, act, device):
    """Gemma's (GeGLU) and LLaMA's (SwiGLU) MLP: down_proj(act(gate_proj(x)) * up_proj(x))."""
    torch.manual_seed(3)
    gate, up, down = (torch.nn.Linear(24, 40, bias=False).to(device), torch.nn.Linear(24, 40, bias=False).to(device),
                      torch.nn.Linear(40, 24, bias=False).to(device))
    x = rand((3, 7, 24), torch.float32, device, 32)
    want = down(act(gate(x)) * up(x))
    ff = fusekit.nn.GLUFeedForward.from_linears(gate, up, down, kind=kind)
    torch.testing.assert_close(ff(x), want, rtol=1e-4, atol=1e-4)  # torch's allow_tf32 default: off
    g2, u2 = ff.to_linears()
    torch.testing.assert_close(g2.weight, gate.weight, rtol=0, atol=0)
    torch.testing.assert_close(u2.weight, up.weight, rtol=0, atol=0)
