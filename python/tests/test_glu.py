"""The glu family through PyTorch: every gated activation, forward and gradients against plain
PyTorch math on the chunked projection; opcheck."""
import math

import pytest

torch = pytest.importorskip("torch", reason="the operator tests need PyTorch")
import torch.nn.functional as F  # noqa: E402

import fusekit  # noqa: E402
import fusekit.nn  # noqa: E402
from fusekit import ops  # noqa: E402
from helpers import rand  # noqa: E402


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
         "geglu_tanh": lambda l, r: F.gelu(l, approximate="tanh") * r, "geglu_erf": lambda l, r: F.gelu(l) * r,
         "reglu": lambda l, r: F.relu(l) * r}[kind]
    want = f(l, r)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    dy = rand((m, n), torch.float32, device, 18)
    got = torch.autograd.grad(out, (x, w, b), dy)
    exp = torch.autograd.grad(want, (x, w, b), dy)
    for g, e in zip(got, exp):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)


def test_opcheck_glu(device):
    x = rand((5, 12), torch.float32, device, 20, True)
    b = rand((12,), torch.float32, device, 21, True)
    w = rand((8, 12), torch.float32, device, 22, True)
    torch.library.opcheck(ops.glu, (x, w, b[:8].detach().clone().requires_grad_(), "swiglu", False))


@pytest.mark.parametrize("kind,act", [("geglu_tanh", lambda z: F.gelu(z, approximate="tanh")), ("swiglu", F.silu)])
def test_gate_second_activates_the_second_half(kind, act, device):
    x, w = rand((9, 16), torch.float32, device, 30), rand((2 * 12, 16), torch.float32, device, 31) / 4
    l, r = (x @ w.t()).chunk(2, dim=-1)
    torch.testing.assert_close(fusekit.glu(x, w, kind=kind, allow_tf32=False, gate="second"), l * act(r),
                               rtol=1e-4, atol=1e-4)
    with pytest.raises(fusekit.Error, match="argument 'gate'"):
        fusekit.glu(x, w, kind=kind, gate="middle")


@pytest.mark.parametrize("kind,act", [("geglu_tanh", lambda z: F.gelu(z, approximate="tanh")),
                                      ("geglu_erf", F.gelu), ("swiglu", F.silu), ("reglu", F.relu)])
def test_hugging_face_mlp_converted_computes_the_same_function(kind, act, device):
    """Gemma's (GeGLU) and LLaMA's (SwiGLU) MLP: down_proj(act(gate_proj(x)) * up_proj(x))."""
    torch.manual_seed(3)
    gate, up, down = (torch.nn.Linear(24, 40, bias=False).to(device), torch.nn.Linear(24, 40, bias=False).to(device),
                      torch.nn.Linear(40, 24, bias=False).to(device))
    x = rand((3, 7, 24), torch.float32, device, 32)
    want = down(act(gate(x)) * up(x))
    ff = fusekit.nn.GLUFeedForward.from_linears(gate, up, down, kind=kind)
    torch.testing.assert_close(ff(x), want, rtol=1e-4, atol=1e-4)  # torch's allow_tf32 default: off
    g2, u2 = ff.to_linears()
    torch.testing.assert_close(g2.weight, gate.weight, rtol=0, atol=0)
    torch.testing.assert_close(u2.weight, up.weight, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# The two training paths: keeping the pre-activations (glu_train) and recomputing them (glu)
# ---------------------------------------------------------------------------------------------

_ACT = {"sigmoid_tanh": lambda l, r: torch.sigmoid(l) * torch.tanh(r), "swiglu": lambda l, r: F.silu(l) * r,
        "geglu_tanh": lambda l, r: F.gelu(l, approximate="tanh") * r, "geglu_erf": lambda l, r: F.gelu(l) * r,
        "reglu": lambda l, r: F.relu(l) * r}


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("kind", ["sigmoid_tanh", "swiglu", "geglu_tanh", "geglu_erf", "reglu"])
@pytest.mark.parametrize("mkn", [(1, 8, 4), (37, 24, 20), (3, 13, 5)])
def test_both_training_paths_match_torch(kind, mkn, recompute, device):
    m, k, n = mkn
    x = rand((m, k), torch.float32, device, 40, True)
    w = (rand((2 * n, k), torch.float32, device, 41) / math.sqrt(k)).requires_grad_()
    b = rand((2 * n,), torch.float32, device, 42, True)
    out = fusekit.glu(x, w, b, kind=kind, allow_tf32=False, recompute=recompute)
    want = _ACT[kind](*(x @ w.t() + b).chunk(2, dim=-1))
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    dy = rand((m, n), torch.float32, device, 43)
    for g, e in zip(torch.autograd.grad(out, (x, w, b), dy), torch.autograd.grad(want, (x, w, b), dy)):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)


def _saved_shapes(fn):
    """The shapes of the tensors autograd saves while fn() runs."""
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return shapes


@pytest.mark.parametrize("recompute", [False, True])
def test_keeping_saves_the_preactivations_and_recomputing_does_not(recompute, device):
    x = rand((6, 16), torch.float32, device, 44, True)
    w = rand((2 * 12, 16), torch.float32, device, 45, True)
    shapes = _saved_shapes(lambda: fusekit.glu(x, w, recompute=recompute))
    assert ((6, 24) in shapes) is not recompute, shapes


def test_no_preactivations_without_a_gradient(device):
    x, w = rand((6, 16), torch.float32, device, 46), rand((24, 16), torch.float32, device, 47)
    with torch.no_grad():
        y = fusekit.glu(x, w, recompute=False)
    torch.testing.assert_close(y, fusekit.glu(x, w), rtol=0, atol=0)


def test_glu_train_returns_the_preactivations_in_the_prepared_order(device):
    x, w = rand((5, 16), torch.float32, device, 48), rand((2 * 3, 16), torch.float32, device, 49)
    b = rand((6,), torch.float32, device, 50)
    out, preact = ops.glu_train(x, ops.prepare_glu_weight(w), ops.prepare_glu_weight(b), "swiglu", False)
    torch.testing.assert_close(preact, ops.prepare_glu_weight((x @ w.t() + b).t()).t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, ops.glu(x, ops.prepare_glu_weight(w), ops.prepare_glu_weight(b), "swiglu", False),
                               rtol=0, atol=0)


def test_opcheck_glu_train_and_its_backward(device):
    x = rand((5, 12), torch.float32, device, 51, True)
    w = rand((8, 12), torch.float32, device, 52, True)
    b = rand((8,), torch.float32, device, 53, True)
    torch.library.opcheck(ops.glu_train, (x, w, b, "swiglu", False))
    torch.library.opcheck(ops.glu_train, (x, w, None, "geglu_erf", False))
    _, preact = ops.glu_train(x.detach(), w.detach(), b.detach(), "swiglu", False)
    dy = rand((5, 4), torch.float32, device, 54)
    torch.library.opcheck(ops.glu_backward_from_preact, (dy, x.detach(), w.detach(), preact, True, "swiglu", False))
    torch.library.opcheck(ops.glu_backward_from_preact, (dy, x.detach(), w.detach(), preact, False, "reglu", False))
    torch.library.opcheck(ops.glu_backward_from_preact,
                          (dy, x.detach(), w.detach(), preact, True, "swiglu", False, True))
    dy_out, down_w = rand((5, 6), torch.float32, device, 55), rand((6, 4), torch.float32, device, 56)
    torch.library.opcheck(ops.glu_backward_from_preact,
                          (dy_out, x.detach(), w.detach(), preact, True, "swiglu", False, True, down_w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["swiglu", "geglu_tanh", "reglu"])
def test_the_backward_through_the_down_projection(kind, dtype, device):
    """down_w given: the op forms dh = dy down_w itself (on Hopper inside the GEMM that forms dC,
    from fp32 accumulators) and equals the op given dh, within one rounding of dh; shapes with and
    without a fused kernel (N % 8), one row to many tiles."""
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    for m, n, k, kd in ((1, 8, 16, 8), (9, 6, 16, 24), (300, 136, 32, 72), (1030, 256, 16, 128)):
        x, w = rand((m, k), dtype, device, 80), rand((2 * n, k), dtype, device, 81)
        dy, down_w = rand((m, kd), dtype, device, 82), rand((kd, n), dtype, device, 83) * 0.3
        _, preact = ops.glu_train(x, w, None, kind, False)
        dh = (dy.float() @ down_w.float()).to(dtype)
        dx1, dw1, _, out1 = ops.glu_backward_from_preact(dh, x, w, preact, False, kind, False, True)
        dx, dw, _, out = ops.glu_backward_from_preact(dy, x, w, preact, False, kind, False, True, down_w.t().t())
        torch.testing.assert_close(out, out1, rtol=0, atol=0)
        scale = dx1.float().abs().max().item() + 1e-6
        torch.testing.assert_close(dx.float() / scale, dx1.float() / scale, **tol)
        scale = dw1.float().abs().max().item() + 1e-6
        torch.testing.assert_close(dw.float() / scale, dw1.float() / scale, **tol)
    with pytest.raises(fusekit.Error, match="glu_backward_from_preact: argument 'down_w'"):
        ops.glu_backward_from_preact(dy, x, w, preact, False, kind, False, True, down_w[:, :-1])


@pytest.mark.parametrize("recompute", [False, True])
def test_any_input_and_gradient_layout(recompute, device):
    base = rand((24, 9), torch.float32, device, 55)
    x = base.t().detach().requires_grad_()  # [9, 24], transposed
    w = rand((2 * 10, 24), torch.float32, device, 56, True)
    xc = x.detach().contiguous().requires_grad_()
    y = fusekit.glu(x, w, kind="swiglu", allow_tf32=False, recompute=recompute)
    want = fusekit.glu(xc, w, kind="swiglu", allow_tf32=False, recompute=recompute)
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    # .sum() hands an expanded gradient, .t() a transposed one
    for loss, loss_c in ((y.sum(), want.sum()), ((y.t() * 3).sum(), (want.t() * 3).sum())):
        got = torch.autograd.grad(loss, (x, w), retain_graph=True)
        exp = torch.autograd.grad(loss_c, (xc, w), retain_graph=True)
        for g, e in zip(got, exp):
            torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_keeping_under_autocast(dtype, device):
    torch.manual_seed(4)
    keep = fusekit.nn.GLUFeedForward(24, 40, bias=True).to(device)
    again = fusekit.nn.GLUFeedForward(24, 40, bias=True, recompute=True).to(device)
    again.load_state_dict(keep.state_dict())
    x = rand((2, 5, 24), torch.float32, device, 57)
    outs = []
    for ff in (keep, again):
        with torch.autocast(device, dtype=dtype):
            y = ff(x)
        assert y.dtype == dtype
        y.float().square().sum().backward()
        outs.append(y)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    for p, q in zip(keep.parameters(), again.parameters()):
        assert p.grad.dtype == torch.float32
        # dC from C rounded to dtype (kept) or in fp32 (recomputed): within a rounding of dtype.
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("recompute", [False, True])
def test_feed_forward_paths_compile_without_graph_breaks(recompute):
    torch.manual_seed(5)
    ff = fusekit.nn.GLUFeedForward(16, 24, recompute=recompute)
    x = rand((3, 4, 16), torch.float32, "cpu", 58, True)
    y = torch.compile(ff, fullgraph=True, backend="aot_eager")(x)
    y.square().sum().backward()
    grads = [p.grad.clone() for p in ff.parameters()] + [x.grad.clone()]
    for p in ff.parameters():
        p.grad = None
    x2 = x.detach().requires_grad_()
    want = ff(x2)
    want.square().sum().backward()
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    for g, e in zip(grads, [p.grad for p in ff.parameters()] + [x2.grad]):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# glu_mlp: a Hugging Face MLP on its own parameters
# ---------------------------------------------------------------------------------------------

def _hf_mlp(x, gate, up, down, act):
    """LlamaMLP.forward (GemmaMLP's with gelu): down_proj(act_fn(gate_proj(x)) * up_proj(x))."""
    return down(act(gate(x)) * up(x))


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kind,act", [("swiglu", F.silu), ("geglu_tanh", lambda z: F.gelu(z, approximate="tanh")),
                                      ("reglu", F.relu)])
def test_glu_mlp_is_the_hugging_face_mlp(kind, act, bias, recompute, device):
    torch.manual_seed(6)
    gate, up, down = (torch.nn.Linear(24, 40, bias=bias).to(device), torch.nn.Linear(24, 40, bias=bias).to(device),
                      torch.nn.Linear(40, 24, bias=bias).to(device))
    state = {k: v.clone() for k, v in {**gate.state_dict(), **up.state_dict()}.items()}
    x = rand((3, 7, 24), torch.float32, device, 59, True)
    want = _hf_mlp(x, gate, up, down, act)
    y = ops.glu_mlp(x, gate.weight, up.weight, down.weight, kind, gate.bias, up.bias, down.bias, recompute=recompute,
                    allow_tf32=False)
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)
    params = [x] + [p for m in (gate, up, down) for p in m.parameters()]
    dy = rand(tuple(y.shape), torch.float32, device, 60)
    for g, e in zip(torch.autograd.grad(y, params, dy), torch.autograd.grad(want, params, dy)):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
    for k, v in {**gate.state_dict(), **up.state_dict()}.items():
        torch.testing.assert_close(v, state[k], rtol=0, atol=0)


@pytest.mark.parametrize("recompute", [False, True])
def test_glu_mlp_keeps_c_but_not_the_activation(recompute, device):
    """Keeping (the default) saves C [M, 2N] and not glu's out [M, N] (recomputed from C for the
    down projection's weight gradient); recomputing saves neither."""
    gate, up, down = (torch.nn.Linear(16, 20, bias=False).to(device), torch.nn.Linear(16, 20, bias=False).to(device),
                      torch.nn.Linear(20, 16, bias=False).to(device))
    x = rand((6, 16), torch.float32, device, 62, True)
    shapes = _saved_shapes(lambda: ops.glu_mlp(x, gate.weight, up.weight, down.weight, recompute=recompute))
    assert ((6, 40) in shapes) is not recompute, shapes
    assert (6, 20) not in shapes or recompute, shapes


@pytest.mark.parametrize("kind", ["swiglu", "geglu_tanh", "sigmoid_tanh"])
def test_glu_activate_recomputes_out_from_the_preactivations(kind, device):
    x, w = rand((7, 16), torch.float32, device, 63), rand((2 * 5, 16), torch.float32, device, 64)
    b = rand((10,), torch.float32, device, 65)
    out, preact = ops.glu_train(x, w, b, kind, False)
    torch.testing.assert_close(ops.glu_activate(preact, kind), out, rtol=1e-6, atol=1e-6)
    with pytest.raises(fusekit.Error, match="glu_activate: argument 'preact'"):
        ops.glu_activate(preact[:, :9].contiguous(), kind)


def test_opcheck_glu_activate_and_glu_mlp_train(device):
    x = rand((5, 12), torch.float32, device, 66, True)
    w, b = rand((8, 12), torch.float32, device, 67, True), rand((8,), torch.float32, device, 68, True)
    dw, db = rand((6, 4), torch.float32, device, 69, True), rand((6,), torch.float32, device, 70, True)
    torch.library.opcheck(ops.glu_mlp_train, (x, w, b, dw, db, "swiglu", False))
    torch.library.opcheck(ops.glu_mlp_train, (x, w, None, dw, None, "reglu", False))
    _, preact = ops.glu_train(x.detach(), w.detach(), b.detach(), "swiglu", False)
    torch.library.opcheck(ops.glu_activate, (preact, "swiglu"))
    torch.library.opcheck(ops.glu_preact_grad, (rand((5, 4), torch.float32, device, 71), preact, "swiglu"))
    torch.library.opcheck(ops.glu_preact_grad, (rand((5, 4), torch.float32, device, 71), preact, "swiglu", True))


@pytest.mark.parametrize("kind", ["swiglu", "geglu_tanh", "reglu"])
def test_glu_preact_grad_is_the_backwards_dc(kind, device):
    """dC multiplied out (dx = dC w, dw = dCᵀ x, db = column sums) is glu_backward_from_preact's."""
    x, w = rand((9, 16), torch.float32, device, 72), rand((2 * 6, 16), torch.float32, device, 73)
    b, dy = rand((12,), torch.float32, device, 74), rand((9, 6), torch.float32, device, 75)
    _, preact = ops.glu_train(x, w, b, kind, False)
    dc, none = ops.glu_preact_grad(dy, preact, kind)
    dx, dw, db, none2 = ops.glu_backward_from_preact(dy, x, w, preact, True, kind, False)
    assert none.shape == none2.shape == (0, 6)
    torch.testing.assert_close(dc @ w, dx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dc.t() @ x, dw, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dc.sum(0), db, rtol=1e-5, atol=1e-5)
    with pytest.raises(fusekit.Error, match="glu_preact_grad: argument 'dy'"):
        ops.glu_preact_grad(dy[:, :5].contiguous(), preact, kind)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["swiglu", "geglu_erf", "reglu"])
def test_the_backwards_out_is_glu_activate(kind, dtype, device):
    """with_out: the activation formed in dC's pass equals glu_activate's, bit for bit (the same
    arithmetic on the same C), and dC is unchanged by asking for it; odd N reaches the kernel's
    one-pair tail."""
    for m, n in ((9, 6), (1, 7), (33, 13)):
        x, w = rand((m, 16), dtype, device, 76), rand((2 * n, 16), dtype, device, 77)
        dy = rand((m, n), dtype, device, 78)
        _, preact = ops.glu_train(x, w, None, kind, False)
        dc, out = ops.glu_preact_grad(dy, preact, kind, True)
        torch.testing.assert_close(out, ops.glu_activate(preact, kind), rtol=0, atol=0)
        torch.testing.assert_close(dc, ops.glu_preact_grad(dy, preact, kind)[0], rtol=0, atol=0)
        dx, dw, _, out2 = ops.glu_backward_from_preact(dy, x, w, preact, False, kind, False, True)
        torch.testing.assert_close(out2, out, rtol=0, atol=0)
        dx1, dw1, _, _ = ops.glu_backward_from_preact(dy, x, w, preact, False, kind, False)
        torch.testing.assert_close(dx, dx1, rtol=0, atol=0)
        torch.testing.assert_close(dw, dw1, rtol=0, atol=0)


def test_glu_mlp_under_autocast_and_compiled():
    torch.manual_seed(7)
    gate, up, down = torch.nn.Linear(16, 24, bias=False), torch.nn.Linear(16, 24, bias=False), torch.nn.Linear(24, 16)
    x = rand((2, 3, 16), torch.float32, "cpu", 61, True)

    def f(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return ops.glu_mlp(x, gate.weight, up.weight, down.weight, "swiglu", down_b=down.bias)

    y = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    for p in (gate.weight, up.weight, down.weight, x):
        assert p.grad is not None and p.grad.dtype == torch.float32
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = _hf_mlp(x, gate, up, down, F.silu)
    torch.testing.assert_close(y, want, rtol=2e-2, atol=2e-2)


def test_glu_mlp_refuses_one_bias_of_two():
    w = torch.zeros(8, 4)
    with pytest.raises(fusekit.Error, match="argument 'up_b'"):
        ops.glu_mlp(torch.zeros(2, 4), w, w, torch.zeros(4, 8), gate_b=torch.zeros(8))


def test_glu_mlp_is_exported():
    assert fusekit.glu_mlp is ops.glu_mlp
