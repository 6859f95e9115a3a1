"""The mlp family through PyTorch: opcheck of the fused MLP for inference and for training (the
module against the Sequential it replaces is in test_nn.py)."""
import pytest

torch = pytest.importorskip("torch", reason="the operator tests need PyTorch")

from fusekit import ops  # noqa: E402
from helpers import rand  # noqa: E402


def test_opcheck_mlp(device):
    torch.library.opcheck(ops.fused_mlp, (rand((9, 12), torch.bfloat16, device, 31),
                                          [rand((16, 12), torch.bfloat16, device, 32),
                                           rand((3, 16), torch.bfloat16, device, 33)],
                                          [rand((16,), torch.bfloat16, device, 34),
                                           rand((3,), torch.bfloat16, device, 35)], "relu,identity"))
    torch.library.opcheck(ops.fused_mlp_train, (rand((9, 12), torch.bfloat16, device, 36, True),
                                                [rand((16, 12), torch.bfloat16, device, 37, True),
                                                 rand((3, 16), torch.bfloat16, device, 38, True)],
                                                [rand((16,), torch.bfloat16, device, 39, True),
                                                 rand((3,), torch.bfloat16, device, 40, True)], "relu,sigmoid"))
