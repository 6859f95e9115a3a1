"""Ops take the layouts PyTorch's own ops take: transposed, sliced, permuted and expanded inputs, and
whatever gradient layout autograd hands a backward (the expanded one `.sum()` gives, a transposed
one from a later `.t()`). Each result is compared with the same op on a contiguous copy."""
import subprocess
import sys

import pytest
import torch

import fusekit
import fusekit.nn
from helpers import TOL, rand


def _layouts(device, dtype):
    """Non-contiguous views of [6, 10] values: transposed, a column slice, permuted from 3-D."""
    base = rand((10, 6), dtype, device, 1)
    wide = rand((6, 13), dtype, device, 2)
    cube = rand((2, 10, 3), dtype, device, 3)
    return {"transposed": base.t(), "column_slice": wide[:, 1:11], "permuted": cube.permute(0, 2, 1)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_takes_any_layout_and_expanded_gradients(dtype, device):
    for name, x in _layouts(device, dtype).items():
        assert not x.is_contiguous(), name
        x = x.detach().requires_grad_()
        y = fusekit.softmax(x)
        torch.testing.assert_close(y.float(), torch.softmax(x.detach().float(), -1), **TOL[dtype], msg=name)
        (g,) = torch.autograd.grad((y * y).sum(), x)  # (y * y).sum(): dy = 2y, as autograd makes it
        xc = x.detach().contiguous().requires_grad_()
        (want,) = torch.autograd.grad((fusekit.softmax(xc) ** 2).sum(), xc)
        torch.testing.assert_close(g, want, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_act_takes_any_layout_and_any_gradient_layout(dtype, device):
    for name, x in _layouts(device, dtype).items():
        r = rand(tuple(x.shape[:-2]) + (x.shape[-1], x.shape[-2]), dtype, device, 5).transpose(-1, -2)  # strided too
        b = rand(x.shape[-1:], dtype, device, 6)
        x, r, b = (t.detach().requires_grad_() for t in (x, r, b))
        y = fusekit.bias_act(x, b, r, act="gelu_tanh", alpha=0.5)
        xc, rc, bc = (t.detach().contiguous().requires_grad_() for t in (x, r, b))
        want = fusekit.bias_act(xc, bc, rc, act="gelu_tanh", alpha=0.5)
        torch.testing.assert_close(y, want, msg=name)
        # .sum() hands the backward an expanded (stride 0) gradient; .t() a transposed one
        for loss, loss_c in ((y.sum(), want.sum()), ((y.transpose(-1, -2) * 3).sum(), (want.transpose(-1, -2) * 3).sum())):
            got = torch.autograd.grad(loss, (x, r, b), retain_graph=True)
            exp = torch.autograd.grad(loss_c, (xc, rc, bc), retain_graph=True)
            for g, e, what in zip(got, exp, "xrb"):
                torch.testing.assert_close(g, e, msg=f"{name} d{what}")


def test_compressed_linear_takes_the_gradient_sum_hands_it(device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).to(device)
    fusekit.nn.compress(model, bits=8)
    x = rand((16, 64), torch.float32, device, 7)
    model(x).sum().backward()  # dy of the last layer: f32 [16, 1] with strides [0, 0]
    for p in model.parameters():
        assert p.grad is not None and bool(torch.isfinite(p.grad).all())
    # the last layer's weight gradient against the uncompressed one: 8 bits of its input
    ref = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).to(device)
    ref.load_state_dict(model.state_dict())
    ref(x).sum().backward()
    last, ref_last = model[2].weight.grad, ref[2].weight.grad
    assert float((last - ref_last).norm() / ref_last.norm()) < 2e-2


def test_import_fusekit_makes_fusekit_nn_available():
    code = "import fusekit; print(fusekit.nn.CompressedLinear.__name__, fusekit.nn.W4Linear.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["CompressedLinear", "W4Linear"]


@pytest.mark.parametrize("optimizer", [None, "sgd", "rowwise_adagrad"])
def test_embedding_bags_take_any_gradient_layout(optimizer, device):
    """The pooled [B, T, D] output's gradient expanded (.sum()) or transposed downstream."""
    kw = dict(optimizer=optimizer, lr=0.1) if optimizer else {}
    indices, offsets = torch.tensor([1, 2, 3, 5], device=device), torch.tensor([0, 2, 3, 4, 4], device=device)
    scale = torch.arange(1.0, 5.0, device=device)
    for loss in (lambda out: out.sum(), lambda out: (out.transpose(0, 1) * scale).sum()):
        torch.manual_seed(0)
        ebc = fusekit.nn.EmbeddingBagCollection([10, 20], 4, **kw).to(device)
        torch.manual_seed(0)
        ref = fusekit.nn.EmbeddingBagCollection([10, 20], 4, **kw).to(device)
        loss(ebc(indices, offsets)).backward()
        out = ref(indices, offsets)
        out.backward(torch.autograd.grad(loss(out), out, retain_graph=True)[0].contiguous())
        for a, b in zip(ebc.parameters(), ref.parameters()):
            torch.testing.assert_close(a, b)
            if a.grad is not None:
                torch.testing.assert_close(a.grad, b.grad)
