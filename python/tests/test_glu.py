"""The glu family through PyTorch: every gated activation, forward and gradients against plain
PyTorch math on the chunked projection; opcheck."""
import math

import pytest

torch = pytest.importorskip("torch", reason="the operator tests need PyTorch")
import torch.nn.functional as F  # noqa: E402

import fusekit  # noqa: E402
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
         "geglu_tanh": lambda l, r: l * F.gelu(r, approximate="tanh"), "geglu_erf": lambda l, r: l * F.gelu(r),
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
