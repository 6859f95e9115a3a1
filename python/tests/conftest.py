import pytest

try:
    import torch
except ImportError:  # test_bindings.py runs without PyTorch; the operator tests skip themselves
    torch = None

DEVICES = ["cpu"] + (["cuda"] if torch is not None and torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param
