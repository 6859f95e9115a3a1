"""The qgemm family through PyTorch: opcheck of the 4-bit GEMM on weights from quantize_weights, and
pack_weights on given 4-bit values (the module against the weight it quantizes is in test_nn.py; the
GPTQ and AWQ imports in test_w4_import.py)."""
import pytest

torch = pytest.importorskip("torch", reason="the operator tests need PyTorch")

import fusekit  # noqa: E402
from fusekit import ops  # noqa: E402
from helpers import rand  # noqa: E402


@pytest.mark.parametrize("shape", [(3, 64), (2, 1, 64), (64,), (0, 64)], ids=str)
def test_opcheck_qgemm(device, shape):
    """x [..., K] of any rank from 1 (as nn.Linear takes it): y [..., N]."""
    torch.library.opcheck(ops.qgemm, (rand(shape, torch.float16, device, 29),
                                      *ops.quantize_weights(rand((16, 64), torch.float16, device, 30), 32), 16, 64, 32))


def test_qgemm_takes_any_layout_of_x_and_names_a_wrong_device(device):
    w = ops.quantize_weights(rand((16, 64), torch.float16, device, 32), 32)
    x = rand((64, 3), torch.float16, device, 33).t()  # rows not contiguous: copied first
    torch.testing.assert_close(ops.qgemm(x, *w, 16, 64, 32), ops.qgemm(x.contiguous(), *w, 16, 64, 32), rtol=0, atol=0)
    if device == "cuda":
        with pytest.raises(fusekit.Error, match="fk::qgemm: argument 'x': expected a tensor on cuda"):
            ops.qgemm(x.cpu(), *w, 16, 64, 32)


def test_pack_weights_holds_the_values_it_is_given(device):
    """4-bit values quantized elsewhere: dequantize_weights gives s (q − z) back, rounded once to the
    dtype; values outside 4 bits and K % 8 != 0 are refused by name."""
    g = torch.Generator().manual_seed(31)
    q, zero = torch.randint(0, 16, (40, 96), generator=g), torch.randint(0, 16, (40, 3), generator=g)
    scale = torch.rand(40, 3, generator=g).to(torch.float16)
    packed, s, z = ops.pack_weights(q.to(device), scale, zero, 32)
    assert packed.device.type == device
    want = scale.double().repeat_interleave(32, 1) * (q - zero.repeat_interleave(32, 1)).double()
    assert torch.equal(ops.dequantize_weights(packed, s, z, 40, 96, 32).cpu(), want.to(torch.float16))
    with pytest.raises(fusekit.Error, match="argument 'q': expected values in \\[0, 15\\], got \\[0, 16\\]"):
        ops.pack_weights(torch.where(q == 15, 16, q), scale, zero, 32)
    with pytest.raises(fusekit.Error, match="argument 'zero': expected an integer matrix"):
        ops.pack_weights(q, scale, zero.float(), 32)
    with pytest.raises(fusekit.Error, match="argument 'q': expected \\[N, K\\] with K % 8 == 0"):
        ops.pack_weights(q[:, :92], scale, zero, 32)
