"""The quant family through PyTorch: pack / unpack within half a quantization step, the ReLU that
packs its mask and its gradient, the weight gradient from packed activations; opcheck, bad input."""
import math

import pytest

torch = pytest.importorskip("torch", reason="the operator tests need PyTorch")
import torch.nn.functional as F  # noqa: E402

import fusekit  # noqa: E402
from fusekit import ops  # noqa: E402
from helpers import assert_weight_grad_close, rand  # noqa: E402


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("shape", [(1, 32), (5, 300), (33, 256)])
def test_pack_unpack_error_is_within_half_a_step(bits, shape, device):
    x = rand(shape, torch.float32, device, 10)
    p = fusekit.pack(x, bits=bits, group=64, stats_dtype=torch.float32)
    xh = fusekit.unpack(p)
    # Each group's step is (max - min) / (2^bits - 1); nearest rounding is within half of it.
    g = torch.nn.functional.pad(x, (0, (-shape[1]) % 64)).view(shape[0], -1, 64)
    step = (g.amax(-1) - g.amin(-1)) / (2 ** bits - 1)
    err = (xh - x).abs()
    bound = torch.repeat_interleave(step, 64, dim=1)[:, : shape[1]] * 0.5 + 1e-5
    assert bool((err <= bound).all())
    assert p.nbytes() < x.numel() * 4


def test_relu_packed_matches_relu_and_its_gradient(device):
    x = rand((7, 45), torch.float32, device, 11, True)
    y, mask = fusekit.relu_packed(x)
    assert mask.numel() == math.ceil(x.numel() / 32)
    torch.testing.assert_close(y, F.relu(x))
    dy = rand((7, 45), torch.float32, device, 12)
    (g,) = torch.autograd.grad(y, x, dy)
    torch.testing.assert_close(g, dy * (x > 0))


def test_weight_grad_from_packed_matches_the_unpacked_product(device):
    k, cout, cin = 96, 24, 40
    x = rand((k, cin), torch.bfloat16, device, 13)
    dy = rand((k, cout), torch.bfloat16, device, 14)
    p = fusekit.pack(x, bits=8, group=32, stats_dtype=torch.float32)
    dw = fusekit.weight_grad_from_packed(dy, p)
    xq = fusekit.unpack(p, torch.float32)
    if device == "cuda":  # the kernel feeds x̂ to the tensor cores rounded to bf16 (docs/quant.md)
        xq = xq.bfloat16().float()
    assert_weight_grad_close(dw, dy.float(), xq, device)


def test_opcheck_quant(device):
    x = rand((5, 12), torch.float32, device, 20, True)
    torch.library.opcheck(ops.relu_packed, (x,))
    torch.library.opcheck(ops.pack, (x.detach(), 2, 32, False, 0, 0, torch.bfloat16))


def test_bad_input_raises_naming_the_argument(device):
    x = rand((4, 6), torch.float32, device, 30)
    with pytest.raises(fusekit.Error, match="argument 'x'"):
        fusekit.pack(x[None], bits=2)
