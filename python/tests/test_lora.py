"""The lora family through PyTorch: opcheck, and what inference keeps (the module against PEFT's
math is in test_nn.py)."""
import pytest

torch = pytest.importorskip("torch", reason="the operator tests need PyTorch")
import torch.nn.functional as F  # noqa: E402

import fusekit  # noqa: E402
from fusekit import ops  # noqa: E402
from helpers import rand  # noqa: E402


def test_opcheck_lora(device):
    x = rand((5, 12), torch.float32, device, 20, True)
    w = rand((8, 12), torch.float32, device, 22, True)
    torch.library.opcheck(ops.lora, (x, w.detach(), rand((8,), torch.float32, device, 26, True),
                                     rand((3, 12), torch.float32, device, 27, True),
                                     rand((8, 3), torch.float32, device, 28, True), "gelu_tanh", 0.5, True))


def test_inference_keeps_nothing_for_a_backward(device):
    """Without a gradient recorded, lora writes no t or z (the device work of the C++ op asked for
    y alone); asking for less while recording is an error."""
    x = rand((4, 16), torch.float32, device, 50)
    w, a, bb = (rand((8, 16), torch.float32, device, 52), rand((2, 16), torch.float32, device, 53),
                rand((8, 2), torch.float32, device, 54))
    y, t, z = ops.lora(x, w, None, a, bb, "silu", 0.5, False)
    assert t.numel() == 0 and z.numel() == 0
    torch.testing.assert_close(y, F.silu(x @ w.t() + 0.5 * (x @ a.t()) @ bb.t()), rtol=1e-5, atol=1e-5)
    with pytest.raises(fusekit.Error, match="argument 'for_backward'"):
        ops.lora(x, w, None, a.requires_grad_(), bb, "relu", 0.5, False)
