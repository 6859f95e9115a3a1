"""The pointwise family through PyTorch: bias_act (forward and gradients against plain PyTorch on odd
shapes in f32, bf16 and f16) and convert; opcheck, bad input, what inference keeps."""
import math

import pytest

torch = pytest.importorskip("torch", reason="the operator tests need PyTorch")
import torch.nn.functional as F  # noqa: E402

import fusekit  # noqa: E402
from fusekit import ops  # noqa: E402
from helpers import TOL, rand  # noqa: E402

SHAPES = [(1, 1), (1, 7), (3, 5), (17, 33), (64, 129), (2, 3, 40)]

TORCH_ACT = {
    "identity": lambda z: z, "relu": F.relu, "sigmoid": torch.sigmoid, "tanh": torch.tanh,
    "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"), "gelu_erf": F.gelu, "silu": F.silu,
}


@pytest.mark.parametrize("act", list(TORCH_ACT))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_bias_act_forward_and_gradients_match_torch(act, dtype, shape, device):
    x = rand(shape, dtype, device, 1, True)
    b = rand(shape[-1:], dtype, device, 2, True)
    r = rand(shape, dtype, device, 3, True)
    y = fusekit.bias_act(x, b, r, act=act, alpha=0.5)
    z = (x.float() + 0.5 * r.float() + b.float())
    want = TORCH_ACT[act](z)
    torch.testing.assert_close(y.float(), want, **TOL[dtype])
    dy = rand(shape, dtype, device, 4)
    gx, gb, gr = torch.autograd.grad(y, (x, b, r), dy)
    wx, wb, wr = torch.autograd.grad(want, (x, b, r), dy.float())
    tol = TOL[dtype] if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2 * math.sqrt(max(1, x.numel() // shape[-1])))
    torch.testing.assert_close(gx.float(), wx.float(), **tol)
    torch.testing.assert_close(gr.float(), wr.float(), **tol)
    torch.testing.assert_close(gb.float(), wb.float(), **tol)


@pytest.mark.parametrize("src,dst", [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                                     (torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16)])
def test_convert_matches_to_with_gradient(src, dst, device):
    x = (rand((5, 31), torch.float32, device, 12) * 100).to(src).requires_grad_()
    y = fusekit.convert(x, dst)
    assert y.dtype == dst
    torch.testing.assert_close(y, x.to(dst), rtol=0, atol=0)
    dy = rand(y.shape, dst, device, 13)
    (g,) = torch.autograd.grad(y, x, dy)
    torch.testing.assert_close(g, dy.to(src), rtol=0, atol=0)


def test_opcheck_pointwise(device):
    x = rand((5, 12), torch.float32, device, 20, True)
    b = rand((12,), torch.float32, device, 21, True)
    torch.library.opcheck(ops.bias_act, (x, b, None, "relu", 1.0, True))
    torch.library.opcheck(ops.bias_act, (x, b, x.detach().clone().requires_grad_(), "silu", 0.5, True))
    torch.library.opcheck(ops.bias_act, (x.detach(), b.detach(), None, "gelu_tanh", 1.0, False))
    y = rand((5, 7), torch.float32, device, 14, True)
    torch.library.opcheck(ops.convert, (y, torch.bfloat16))


def test_bad_input_raises_naming_the_argument(device):
    x = rand((4, 6), torch.float32, device, 30)
    with pytest.raises(fusekit.Error, match="argument 'bias'"):
        fusekit.bias_act(x, rand((5,), torch.float32, device, 31))
    with pytest.raises(fusekit.Error, match="argument 'bias'"):
        fusekit.bias_act(x, rand((6,), torch.float16, device, 31))
    if device == "cuda":
        with pytest.raises(fusekit.Error, match="argument 'bias'"):
            fusekit.bias_act(x, rand((6,), torch.float32, "cpu", 31))


def test_inference_keeps_nothing_for_a_backward(device):
    """Without a gradient recorded, bias_act writes no pre-activation (the device work of the C++
    op asked for y alone); asking for less while recording is an error."""
    x, b = rand((4, 16), torch.float32, device, 50), rand((16,), torch.float32, device, 51)
    y, z = ops.bias_act(x, b, None, "gelu_tanh", 1.0, False)
    assert z.numel() == 0
    torch.testing.assert_close(y, F.gelu(x + b, approximate="tanh"))
    with torch.no_grad():
        assert fusekit.bias_act(x.requires_grad_(), b, act="gelu_tanh").requires_grad is False
    with pytest.raises(fusekit.Error, match="argument 'for_backward'"):
        ops.bias_act(x, b, None, "gelu_tanh", 1.0, False)
