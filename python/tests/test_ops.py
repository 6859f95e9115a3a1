"""torch.ops.fusekit.*: opcheck, numerics against plain PyTorch (forward and gradients), bad input."""
import math

import pytest

torch = pytest.importorskip("torch", reason="the operator tests need PyTorch")
import torch.nn.functional as F  # noqa: E402

import fusekit
from fusekit import ops
from helpers import assert_weight_grad_close

# Tolerances per dtype, for one rounding of an fp32 result (bf16 8 bits, f16 11 bits of mantissa).
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float16: dict(rtol=2e-3, atol=2e-3)}
SHAPES = [(1, 1), (1, 7), (3, 5), (17, 33), (64, 129), (2, 3, 40)]

TORCH_ACT = {
    "identity": lambda z: z, "relu": F.relu, "sigmoid": torch.sigmoid, "tanh": torch.tanh,
    "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"), "gelu_erf": F.gelu, "silu": F.silu,
}


def rand(shape, dtype, device, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(device=device, dtype=dtype).requires_grad_(requires_grad)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES + [(4, 40000)])
def test_softmax_matches_torch(dtype, shape, device):
    x = rand(shape, dtype, device, 5, True) * 4
    x.retain_grad()
    y = fusekit.softmax(x)
    torch.testing.assert_close(y.float(), torch.softmax(x.float(), -1), **TOL[dtype])
    dy = rand(shape, dtype, device, 6)
    (g,) = torch.autograd.grad(y, x, dy)
    (w,) = torch.autograd.grad(torch.softmax(x.float(), -1), x, dy.float())
    torch.testing.assert_close(g.float(), w.float(), **(TOL[dtype] if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2)))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(1, 1, 1, 1, 8), (2, 3, 17, 29, 64), (1, 2, 64, 64, 128)])
def test_attention_matches_sdpa(causal, shape, device):
    b, h, sq, sk, d = shape
    dtype = torch.float32
    q, k, v = (rand((b, h, n, d), dtype, device, s) for s, n in ((7, sq), (8, sk), (9, sk)))
    out = fusekit.attention(q, k, v, causal=causal)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal) if not causal or sq == sk else None
    if want is not None:
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)


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


@pytest.mark.parametrize("kind", ["sigmoid_tanh", "swiglu", "geglu_tanh", "geglu_erf", "reglu"])
@pytest.mark.parametrize("mkn", [(1, 8, 4), (37, 24, 20), (64, 64, 48)])
def test_glu_forward_and_gradients_match_torch(kind, mkn, device):
    m, k, n = mkn
    x = rand((m, k), torch.float32, device, 15, True)
    w = (rand((2 * n, k), torch.float32, device, 16) / math.sqrt(k)).requires_grad_()
    b = rand((2 * n,), torch.float32, device, 17, True)
    out = fusekit.glu(x, w, b, kind=kind, allow_tf32=False)
    l, r = (x @ w.t() + b).chunk(2, dim=-1)
    f = {"sigmoid_tanh": lambda l, r: torch.sigmoid(l) * torch.tanh(r), "swiglu": lambda l, r: F.silu(l) * r,
         "geglu_tanh": lambda l, r: l * F.gelu(r, approximate="tanh"), "geglu_erf": lambda l, r: l * F.gelu(r),
         "reglu": lambda l, r: F.relu(l) * r}[kind]
    want = f(l, r)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    dy = rand((m, n), torch.float32, device, 18)
    got = torch.autograd.grad(out, (x, w, b), dy)
    exp = torch.autograd.grad(want, (x, w, b), dy)
    for g, e in zip(got, exp):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)


def _opcheck_cases(device):
    x = rand((5, 12), torch.float32, device, 20, True)
    b = rand((12,), torch.float32, device, 21, True)
    w = rand((8, 12), torch.float32, device, 22, True)
    return [
        (ops.bias_act, (x, b, None, "relu", 1.0, True)),
        (ops.bias_act, (x, b, x.detach().clone().requires_grad_(), "silu", 0.5, True)),
        (ops.bias_act, (x.detach(), b.detach(), None, "gelu_tanh", 1.0, False)),
        (ops.softmax, (x,)),
        (ops.relu_packed, (x,)),
        (ops.glu, (x, w, b[:8].detach().clone().requires_grad_(), "swiglu", False)),
        (ops.pack, (x.detach(), 2, 32, False, 0, 0, torch.bfloat16)),
        (ops.lora, (x, w.detach(), rand((8,), torch.float32, device, 26, True), rand((3, 12), torch.float32, device, 27,
                    True), rand((8, 3), torch.float32, device, 28, True), "gelu_tanh", 0.5, True)),
        (ops.qgemm, (rand((3, 64), torch.float16, device, 29),
                     *ops.quantize_weights(rand((16, 64), torch.float16, device, 30), 32), 16, 64, 32)),
        (ops.fused_mlp, (rand((9, 12), torch.bfloat16, device, 31), [rand((16, 12), torch.bfloat16, device, 32),
                         rand((3, 16), torch.bfloat16, device, 33)], [rand((16,), torch.bfloat16, device, 34),
                         rand((3,), torch.bfloat16, device, 35)], "relu,identity")),
        (ops.fused_mlp_train, (rand((9, 12), torch.bfloat16, device, 36, True),
                               [rand((16, 12), torch.bfloat16, device, 37, True),
                                rand((3, 16), torch.bfloat16, device, 38, True)],
                               [rand((16,), torch.bfloat16, device, 39, True), rand((3,), torch.bfloat16, device, 40, True)],
                               "relu,sigmoid")),
        (ops.attention, (rand((1, 2, 5, 8), torch.float32, device, 23), rand((1, 2, 6, 8), torch.float32, device, 24),
                         rand((1, 2, 6, 8), torch.float32, device, 25), False, 0.3)),
    ]


def test_opcheck_every_op(device):
    for op, args in _opcheck_cases(device):
        torch.library.opcheck(op, args)


def test_bad_input_raises_naming_the_argument(device):
    x = rand((4, 6), torch.float32, device, 30)
    with pytest.raises(fusekit.Error, match="argument 'bias'"):
        fusekit.bias_act(x, rand((5,), torch.float32, device, 31))
    with pytest.raises(fusekit.Error, match="argument 'bias'"):
        fusekit.bias_act(x, rand((6,), torch.float16, device, 31))
    with pytest.raises(fusekit.Error, match="argument 'x'"):
        fusekit.softmax(x.to(torch.float64))
    with pytest.raises(fusekit.Error, match="argument 'x'"):
        fusekit.softmax(x.t())  # columns not contiguous: an error, not a silent copy
    with pytest.raises(fusekit.Error, match="argument 'x'"):
        fusekit.pack(x[None], bits=2)
    if device == "cuda":
        with pytest.raises(fusekit.Error, match="argument 'bias'"):
            fusekit.bias_act(x, rand((6,), torch.float32, "cpu", 31))


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


def test_inference_keeps_nothing_for_a_backward(device):
    """Without a gradient recorded, bias_act writes no pre-activation and lora no t or z (the
    device work of the C++ op asked for y alone); asking for less while recording is an error."""
    x, b = rand((4, 16), torch.float32, device, 50), rand((16,), torch.float32, device, 51)
    y, z = ops.bias_act(x, b, None, "gelu_tanh", 1.0, False)
    assert z.numel() == 0
    torch.testing.assert_close(y, F.gelu(x + b, approximate="tanh"))
    w, a, bb = (rand((8, 16), torch.float32, device, 52), rand((2, 16), torch.float32, device, 53),
                rand((8, 2), torch.float32, device, 54))
    y, t, z = ops.lora(x, w, None, a, bb, "silu", 0.5, False)
    assert t.numel() == 0 and z.numel() == 0
    torch.testing.assert_close(y, F.silu(x @ w.t() + 0.5 * (x @ a.t()) @ bb.t()), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert fusekit.bias_act(x.requires_grad_(), b, act="gelu_tanh").requires_grad is False
    with pytest.raises(fusekit.Error, match="argument 'for_backward'"):
        ops.bias_act(x, b, None, "gelu_tanh", 1.0, False)
    with pytest.raises(fusekit.Error, match="argument 'for_backward'"):
        ops.lora(x, w, None, a.requires_grad_(), bb, "relu", 0.5, False)
