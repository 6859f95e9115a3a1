"""Every device buffer a fusekit op uses, scratch included, comes from PyTorch's allocator."""
import pytest

torch = pytest.importorskip("torch")

import fusekit  # noqa: E402
from fusekit import nn as fnn  # noqa: E402

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _ops_with_scratch():
    """Calls whose kernels take scratch of their own: the LoRA backward (fp32 partials of s g B
    and dB), bias_act's backward with a bias (dbias partials), softmax of a long row (split-row
    statistics), the fused MLP backward (dW partials), the 4-bit GEMM at M = 1 (split-K partials)."""
    g = torch.Generator("cuda").manual_seed(3)
    bf = dict(device="cuda", dtype=torch.bfloat16)

    def randn(*shape):
        return torch.randn(*shape, generator=g, **bf)

    x = randn(256, 512).requires_grad_()
    w = randn(384, 512) * 0.05
    a, b = (randn(16, 512) * 0.05).requires_grad_(), (randn(384, 16) * 0.05).requires_grad_()
    fusekit.lora(x, w, a, b, scale=2.0, act="relu").float().square().sum().backward()
    bias = randn(512).requires_grad_()
    fusekit.bias_act(x, bias, act="gelu_tanh").float().sum().backward()
    fusekit.softmax(randn(4, 1 << 20))
    mlp = fnn.FusedMLP.from_sequential(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                                           torch.nn.Linear(64, 16)).to(**bf))
    mlp(randn(4096, 32).requires_grad_()).float().sum().backward()
    lin = torch.nn.Linear(4096, 4096, **bf)
    fnn.W4Linear.from_linear(lin)(randn(1, 4096))
    torch.cuda.synchronize()


@gpu
def test_scratch_comes_from_torch_not_from_fusekit_s_own_cache():
    before = fusekit._C.allocator_stats(0)
    torch.cuda.reset_peak_memory_stats()
    _ops_with_scratch()
    after = fusekit._C.allocator_stats(0)
    assert after["device_allocations"] == before["device_allocations"], (before, after)
    assert after["allocated_bytes"] == 0 and after["cached_bytes"] == before["cached_bytes"], after
    assert torch.cuda.max_memory_allocated() > 0


@gpu
def test_scratch_taken_during_graph_capture_replays():
    """A LoRA training step captured in a CUDA graph: its backward's scratch comes from the
    graph's private pool (fusekit's own cache would call cudaMalloc mid-capture)."""
    torch.manual_seed(5)
    layer = fnn.LoRALinear.from_linear(torch.nn.Linear(256, 128), r=8, alpha=16).to("cuda", torch.bfloat16)
    with torch.no_grad():
        layer.lora_B.normal_(std=0.05)
    params = (layer.lora_A, layer.lora_B)
    static_x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)

    def step(x):
        layer(x).float().square().sum().backward()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up off the capture (cuBLAS handles, autograd)
            step(static_x)
    torch.cuda.current_stream().wait_stream(side)
    for p in params:
        p.grad = None
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step(static_x)
    static_grads = [p.grad for p in params]  # written by every replay
    for seed in range(2):
        x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16,
                        generator=torch.Generator("cuda").manual_seed(seed))
        static_x.copy_(x)
        g.replay()
        for p in params:
            p.grad = None
        step(x)
        for have, p in zip(static_grads, params):
            torch.testing.assert_close(have, p.grad)
