"""The qgemm family through PyTorch: opcheck of the 4-bit GEMM on weights from quantize_weights
(the module against the weight it quantizes is in test_nn.py)."""
import pytest

torch = pytest.importorskip("torch", reason="the operator tests need PyTorch")

from fusekit import ops  # noqa: E402
from helpers import rand  # noqa: E402


def test_opcheck_qgemm(device):
    torch.library.opcheck(ops.qgemm, (rand((3, 64), torch.float16, device, 29),
                                      *ops.quantize_weights(rand((16, 64), torch.float16, device, 30), 32), 16, 64, 32))
