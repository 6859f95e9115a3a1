"""What every op shares (fusekit.ops._registry): torch.compile without graph breaks, the eager fast
path and the registered op under tracing, and the public fallbacks for each private PyTorch API."""
import pytest

torch = pytest.importorskip("torch", reason="the operator tests need PyTorch")
import torch.nn.functional as F  # noqa: E402

import fusekit  # noqa: E402
from fusekit import ops  # noqa: E402
from fusekit.ops import _registry  # noqa: E402
from helpers import TOL, rand  # noqa: E402


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16, 8) / 4)
        self.b = torch.nn.Parameter(torch.randn(8))

    def forward(self, x):
        h = fusekit.bias_act(x @ self.w, self.b, act="gelu_tanh")
        return fusekit.softmax(h)


def test_torch_compile_fullgraph_matches_eager(device):
    torch.manual_seed(0)
    m = _Block().to(device)
    x = torch.randn(10, 16, device=device)
    eager = m(x)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(compiled, eager)


def test_eager_calls_run_the_implementation_and_traced_calls_the_registered_op(device):
    """In eager mode an op runs its implementation (inside its own autograd.Function when a
    gradient is recorded); under a dispatch mode (make_fx here, as AOT autograd and export trace)
    the registered op is what is recorded, with the gradient and without."""
    from torch.fx.experimental.proxy_tensor import make_fx
    x, b = rand((3, 8), torch.float32, device, 60, True), rand((8,), torch.float32, device, 61)
    assert type(fusekit.softmax(x).grad_fn).__name__ == "softmax_eagerBackward"
    assert type(fusekit.bias_act(x, b, act="gelu_tanh").grad_fn).__name__ == "bias_act_eager_firstBackward"

    def step(x, b):
        y = fusekit.softmax(fusekit.bias_act(x, b, act="gelu_tanh"))
        return y, torch.autograd.grad(y.sum(), x)[0]

    graph = make_fx(step)(x, b).graph
    ops_seen = {str(n.target) for n in graph.nodes if n.op == "call_function"}
    assert {"fusekit.bias_act.default", "fusekit.softmax.default"} <= ops_seen, ops_seen
    assert "fusekit.bias_act_backward.default" in ops_seen, ops_seen
    with torch.no_grad():
        graph = make_fx(lambda x: fusekit.softmax(x))(x.detach()).graph
    assert "fusekit.softmax.default" in {str(n.target) for n in graph.nodes}


@pytest.mark.skipif(not hasattr(torch._C, "OptionalType"), reason="compares with the schema's private types")
def test_tensor_arguments_from_type_hints_are_the_schema_s():
    tensor_types = (torch._C.OptionalType.ofTensor(), torch._C.ListType.ofTensors())
    for name in _registry._OPS:
        schema = getattr(torch.ops.fusekit, name).default._schema
        want = tuple(i for i, a in enumerate(schema.arguments) if any(a.type.isSubtypeOf(t) for t in tensor_types))
        assert _registry._TENSOR_ARGS[name] == want, name
        assert _registry._RETURNS[name] == len(schema.returns), name


@pytest.fixture
def rebind_torch_internals():
    """Puts the private torch functions back in place after a test bound the fallbacks."""
    yield
    _registry._bind_torch_internals()
    ops.use_torch_caching_allocator()


def _softmax_and_bias_act_match_torch(device):
    x, b = rand((5, 12), torch.float32, device, 70, True), rand((12,), torch.float32, device, 71, True)
    y = fusekit.softmax(fusekit.bias_act(x, b, act="gelu_tanh"))
    want = torch.softmax(F.gelu(x + b, approximate="tanh"), -1)
    torch.testing.assert_close(y, want, **TOL[torch.float32])
    dy = rand((5, 12), torch.float32, device, 72)
    for g, w in zip(torch.autograd.grad(y, (x, b), dy), torch.autograd.grad(want, (x, b), dy)):
        torch.testing.assert_close(g, w, **TOL[torch.float32])
    return x


def test_without_the_dispatch_stack_query_every_call_takes_the_registered_op(device, rebind_torch_internals):
    with pytest.MonkeyPatch.context() as m:
        m.delattr(torch._C, "_len_torch_dispatch_stack")
        with pytest.warns(RuntimeWarning, match="_len_torch_dispatch_stack"):
            _registry._bind_torch_internals()
    x = _softmax_and_bias_act_match_torch(device)
    assert _registry._route("softmax", (x,)) == _registry._REGISTERED
    assert type(fusekit.softmax(x).grad_fn).__name__ != "softmax_eagerBackward"
    _registry._bind_torch_internals()
    assert _registry._route("softmax", (x,)) == _registry._WITH_GRAD


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_without_the_raw_stream_query_ops_run_on_the_current_stream(rebind_torch_internals):
    with pytest.MonkeyPatch.context() as m:
        m.delattr(torch._C, "_cuda_getCurrentRawStream")
        _registry._bind_torch_internals()
    _registry._warned_stream = False
    side = torch.cuda.Stream()
    x = rand((64, 4096), torch.float32, "cuda", 73)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), pytest.warns(RuntimeWarning, match="_cuda_getCurrentRawStream"):
        y = fusekit.softmax(x)
        assert _registry._stream(x) == side.cuda_stream
    side.synchronize()
    torch.testing.assert_close(y, torch.softmax(x, -1), **TOL[torch.float32])
    _softmax_and_bias_act_match_torch("cuda")


@pytest.mark.skipif(not torch.cuda.is_available() or not fusekit.build_info()["cuda"],
                    reason="needs fusekit's kernels and a CUDA GPU")
def test_without_the_raw_allocator_scratch_comes_from_the_public_one(rebind_torch_internals):
    with pytest.MonkeyPatch.context() as m:
        m.delattr(torch._C, "_cuda_cudaCachingAllocator_raw_alloc")
        with pytest.warns(RuntimeWarning, match="_cuda_cudaCachingAllocator_raw_alloc"):
            ops.use_torch_caching_allocator()
    before = fusekit._C.allocator_stats(0)
    x = rand((4, 1 << 20), torch.float32, "cuda", 74)  # a long row: softmax takes scratch of its own
    torch.testing.assert_close(fusekit.softmax(x), torch.softmax(x, -1), **TOL[torch.float32])
    after = fusekit._C.allocator_stats(0)  # none of it from fusekit's own cache
    assert after["device_allocations"] == before["device_allocations"] and after["allocated_bytes"] == 0, after
    _softmax_and_bias_act_match_torch("cuda")
