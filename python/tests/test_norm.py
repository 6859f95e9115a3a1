"""The norm family through PyTorch: rms_norm and add_rms_norm (forward and gradients) against PyTorch
(the f32 expression, F.rms_norm, Hugging Face's LlamaRMSNorm expression) on odd shapes in f32, bf16
and f16 and with an f32 weight; any input and gradient layout; opcheck; autocast as torch's own
rms_norm; torch.compile(fullgraph=True); fusekit.nn.RMSNorm and its state dict; bad input."""
import math

import pytest

torch = pytest.importorskip("torch", reason="the operator tests need PyTorch")
import torch.nn.functional as F  # noqa: E402

import fusekit  # noqa: E402
from fusekit import ops  # noqa: E402
from helpers import TOL, rand  # noqa: E402

SHAPES = [(1, 1), (1, 7), (3, 33), (2, 1000), (1, 4097), (2, 3, 40), (5, 768)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def reference(x, w, eps, offset, residual=None):
    """out (f32) and s = x + residual (in their promoted dtype, as PyTorch adds them), all in f32 after
    the add: the definition fusekit rounds once."""
    s = x if residual is None else x + residual
    sf = s.float()
    rstd = torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps)
    return sf * rstd * (w.float() + offset), s


def grad_tol(dtype, rows):
    """dx: one rounding of a value of order rstd * |g|; dweight: a sum over rows of such products."""
    if dtype == torch.float32:
        return dict(rtol=1e-4, atol=1e-4 * math.sqrt(rows))
    return dict(rtol=5e-2, atol=5e-2 * math.sqrt(rows))


def weight_dtypes(dtype):
    return [dtype] if dtype == torch.float32 else [dtype, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_forward_and_gradients_match_torch(dtype, shape, offset, device):
    for wdtype in weight_dtypes(dtype):
        x = rand(shape, dtype, device, 1, True)
        w = (rand(shape[-1:], torch.float32, device, 2) * 0.5 + 1 - offset).to(wdtype).requires_grad_()
        y = fusekit.rms_norm(x, w, 1e-6, offset)
        assert y.dtype == torch.promote_types(dtype, wdtype) and y.shape == x.shape
        want, _ = reference(x, w, 1e-6, offset)
        torch.testing.assert_close(y.float(), want, **TOL[y.dtype])
        dy = rand(shape, y.dtype, device, 3)
        gx, gw = torch.autograd.grad(y, (x, w), dy)
        assert gx.dtype == dtype and gw.dtype == wdtype
        wx, ww = torch.autograd.grad(want, (x, w), dy.float())
        rows = x.numel() // shape[-1]
        torch.testing.assert_close(gx.float(), wx.float(), **grad_tol(dtype, 1))
        torch.testing.assert_close(gw.float(), ww.float(), **grad_tol(dtype, rows))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 7), (3, 33), (2, 3, 40), (4, 1000)])
def test_add_rms_norm_forward_and_gradients_match_torch(dtype, shape, device):
    for wdtype in weight_dtypes(dtype):
        x, r = rand(shape, dtype, device, 4, True), rand(shape, dtype, device, 5, True)
        w = (rand(shape[-1:], torch.float32, device, 6) * 0.5 + 1).to(wdtype).requires_grad_()
        y, s = fusekit.add_rms_norm(x, r, w, 1e-5)
        want, want_s = reference(x, w, 1e-5, 0.0, residual=r)
        assert s.dtype == dtype and y.dtype == torch.promote_types(dtype, wdtype)
        torch.testing.assert_close(s, want_s, rtol=0, atol=0)  # the same rounding as PyTorch's add
        torch.testing.assert_close(y.float(), want, **TOL[y.dtype])
        dy, ds = rand(shape, y.dtype, device, 7), rand(shape, dtype, device, 8)
        got = torch.autograd.grad((y, s), (x, r, w), (dy, ds))
        exp = torch.autograd.grad((want, want_s), (x, r, w), (dy.float(), ds))
        rows = x.numel() // shape[-1]
        for g, e, t in zip(got, exp, (grad_tol(dtype, 1), grad_tol(dtype, 1), grad_tol(dtype, rows))):
            torch.testing.assert_close(g.float(), e.float(), **t)
        assert got[0].dtype == dtype and got[2].dtype == wdtype


def test_add_rms_norm_with_only_one_output_used(device):
    x, r = rand((3, 16), torch.float32, device, 9, True), rand((3, 16), torch.float32, device, 10, True)
    w = rand((16,), torch.float32, device, 11, True)
    _, s = fusekit.add_rms_norm(x, r, w)
    gx, gr = torch.autograd.grad(s.sum(), (x, r))  # the norm's output unused: only residual_out's gradient
    torch.testing.assert_close(gx, torch.ones_like(x))
    torch.testing.assert_close(gr, torch.ones_like(r))
    y, _ = fusekit.add_rms_norm(x, r, w)
    gx, gw = torch.autograd.grad(y.sum(), (x, w))
    want, _ = reference(x, w, 1e-6, 0.0, residual=r)
    ex, ew = torch.autograd.grad(want.sum(), (x, w))
    torch.testing.assert_close(gx, ex, **grad_tol(torch.float32, 1))
    torch.testing.assert_close(gw, ew, **grad_tol(torch.float32, 3))


def test_add_rms_norm_promotes_mixed_inputs_as_torch_adds_them(device):
    """An f32 residual stream and a bf16 block output (autocast's usual pair): s in f32, as
    `residual + hidden` gives it; the gradients come back in each input's dtype."""
    x = rand((4, 24), torch.bfloat16, device, 12, True)
    r = rand((4, 24), torch.float32, device, 13, True)
    w = rand((24,), torch.float32, device, 14, True)
    y, s = fusekit.add_rms_norm(x, r, w)
    assert s.dtype == torch.float32 and y.dtype == torch.float32
    want, want_s = reference(x, w, 1e-6, 0.0, residual=r)
    torch.testing.assert_close(s, want_s, rtol=0, atol=0)
    torch.testing.assert_close(y, want, **TOL[torch.float32])
    gx, gr = torch.autograd.grad(y.sum(), (x, r))
    assert gx.dtype == torch.bfloat16 and gr.dtype == torch.float32


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1), (3, 33), (2, 3, 40), (5, 768)])
def test_out_dtype_rounds_the_f32_result_once(half, shape, device):
    """f32 rows and weight with out_dtype bf16/f16 (what autocast casts a GEMM's input to): the
    f32 result rounded once, as rms_norm(...).to(half) gives it; gradients as for f32 out."""
    x, r = rand(shape, torch.float32, device, 50, True), rand(shape, torch.float32, device, 51, True)
    xh = rand(shape, half, device, 52, True)
    w = rand(shape[-1:], torch.float32, device, 53, True)
    y = fusekit.rms_norm(x, w, 1e-6, out_dtype=half)
    assert y.dtype == half
    want = fusekit.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(y, want.to(half), rtol=0, atol=0)
    dy = rand(shape, half, device, 54)
    g = torch.autograd.grad(y, (x, w), dy)
    ew = torch.autograd.grad(want, (x, w), dy.float())
    for a, b in zip(g, ew):
        torch.testing.assert_close(a, b, **grad_tol(torch.float32, x.numel() // shape[-1]))
    # the residual add in front: a 16-bit x added to f32 rows (and the operands either way round)
    for a, b in ((xh, r), (r, xh)):
        y, s = fusekit.add_rms_norm(a, b, w, 1e-6, out_dtype=half)
        assert y.dtype == half and s.dtype == torch.float32
        want, want_s = reference(a, w, 1e-6, 0.0, residual=b)
        torch.testing.assert_close(s, want_s, rtol=0, atol=0)
        torch.testing.assert_close(y, want.to(half), **TOL[half])
        gy, gs = rand(shape, half, device, 55), rand(shape, torch.float32, device, 56)
        got = torch.autograd.grad((y, s), (a, b, w), (gy, gs))
        exp = torch.autograd.grad((want, want_s), (a, b, w), (gy.float(), gs))
        assert [t.dtype for t in got] == [a.dtype, b.dtype, torch.float32]
        for u, v in zip(got, exp):
            torch.testing.assert_close(u.float(), v.float(), **grad_tol(half, x.numel() // shape[-1]))
        # the 16-bit input's gradient is the f32 one rounded once (written by the same pass)
        d16, d32 = (got[0], got[1]) if a is xh else (got[1], got[0])
        torch.testing.assert_close(d16, d32.to(half), rtol=0, atol=0)


def test_out_dtype_refused_where_it_is_not_a_rounding(device):
    xb = rand((2, 8), torch.bfloat16, device, 57)
    with pytest.raises(fusekit.Error, match="rms_norm_forward: argument 'out_dtype'"):
        fusekit.rms_norm(xb, rand((8,), torch.float32, device, 58), out_dtype=torch.bfloat16)  # bf16 rows
    with pytest.raises(fusekit.Error, match="argument 'out_dtype'"):
        fusekit.rms_norm(xb.float(), rand((8,), torch.float32, device, 58), out_dtype=torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_f_rms_norm_and_hugging_face(dtype, device):
    """F.rms_norm and LlamaRMSNorm round x̂ to x's dtype before the weight multiplies it; fusekit
    rounds once, so they agree within two roundings. LlamaRMSNorm's dtype (the promotion: f32 for
    an f32 weight) is fusekit's; F.rms_norm gives x's dtype there."""
    x = rand((6, 256), dtype, device, 15)
    w = rand((256,), dtype, device, 16)
    tol = {k: 2 * v for k, v in TOL[dtype].items()}
    torch.testing.assert_close(fusekit.rms_norm(x, w, 1e-6), F.rms_norm(x, (256,), w, 1e-6), **tol)
    w32 = w.float()
    xf = x.float()
    hf = w32 * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    y = fusekit.rms_norm(x, w32, 1e-6)
    assert y.dtype == hf.dtype
    torch.testing.assert_close(y, hf, **tol)
    # eps None: torch.finfo(x.dtype).eps, as F.rms_norm's default.
    torch.testing.assert_close(fusekit.rms_norm(x, w, None), F.rms_norm(x, (256,), w), **tol)


@pytest.mark.parametrize("layout", ["transposed", "sliced", "expanded"])
def test_any_input_and_gradient_layout(layout, device):
    base = rand((40, 24), torch.float32, device, 17)
    if layout == "transposed":
        x = base.t().contiguous().t()[:, :20]  # rows not contiguous: a copy is made
    elif layout == "sliced":
        x = base[:, 2:22]  # rows of stride 24: read in place
    else:
        x = base[:1, :20].expand(40, 20)
    x = x.detach().requires_grad_()
    r = rand((40, 20), torch.float32, device, 18).t().contiguous().t().requires_grad_()
    w = rand((20,), torch.float32, device, 19, True)
    y, s = fusekit.add_rms_norm(x, r, w)
    want, want_s = reference(x, w, 1e-6, 0.0, residual=r)
    torch.testing.assert_close(y, want, **TOL[torch.float32])
    # Incoming gradients: an expanded one (from .sum()) and a transposed one.
    dy = rand((20, 40), torch.float32, device, 20).t()
    got = torch.autograd.grad((y.sum(), ), (x, r, w), retain_graph=True)
    exp = torch.autograd.grad((want.sum(), ), (x, r, w), retain_graph=True)
    for g, e in zip(got, exp):
        torch.testing.assert_close(g, e, **grad_tol(torch.float32, 40))
    got = torch.autograd.grad((y, s), (x, r, w), (dy, dy))
    exp = torch.autograd.grad((want, want_s), (x, r, w), (dy, dy))
    for g, e in zip(got, exp):
        torch.testing.assert_close(g, e, **grad_tol(torch.float32, 40))
    y = fusekit.rms_norm(x, w)
    (g,) = torch.autograd.grad(y, (x,), dy)
    (e,) = torch.autograd.grad(reference(x, w, 1e-6, 0.0)[0], (x,), dy)
    torch.testing.assert_close(g, e, **grad_tol(torch.float32, 1))


def test_empty_rows(device):
    x = torch.zeros((0, 8), device=device, requires_grad=True)
    w = torch.ones(8, device=device, requires_grad=True)
    y = fusekit.rms_norm(x, w)
    assert y.shape == (0, 8)
    (gw,) = torch.autograd.grad(y.sum(), (w,))
    torch.testing.assert_close(gw, torch.zeros_like(w))


def test_opcheck_norm(device):
    x, r = rand((5, 12), torch.float32, device, 21, True), rand((5, 12), torch.float32, device, 22, True)
    w = rand((12,), torch.float32, device, 23, True)
    torch.library.opcheck(ops.rms_norm, (x, w, 1e-6, 0.0))
    torch.library.opcheck(ops.rms_norm, (x.detach().bfloat16().requires_grad_(), w, 1e-5, 1.0))
    torch.library.opcheck(ops.add_rms_norm, (x, r, w, 1e-6, 0.0))
    xb = rand((2, 3, 16), torch.bfloat16, device, 24, True)
    torch.library.opcheck(ops.add_rms_norm, (xb, rand((2, 3, 16), torch.bfloat16, device, 25, True),
                                             rand((16,), torch.bfloat16, device, 26, True), 1e-6, 1.0))
    _, rstd = ops.rms_norm(x.detach(), w.detach(), 1e-6, 0.0)
    torch.library.opcheck(ops.rms_norm_backward, (x.detach(), None, x.detach(), w.detach(), rstd, 0.0, True))
    torch.library.opcheck(ops.rms_norm_backward, (x.detach(), r.detach(), x.detach(), w.detach(), rstd, 1.0, False))
    torch.library.opcheck(ops.rms_norm, (x, w, 1e-6, 0.0, torch.bfloat16))
    torch.library.opcheck(ops.add_rms_norm, (x.detach().bfloat16().requires_grad_(), r, w, 1e-6, 0.0, torch.float16))
    torch.library.opcheck(ops.rms_norm_backward,
                          (x.detach().bfloat16(), r.detach(), x.detach(), w.detach(), rstd, 0.0, True))
    torch.library.opcheck(ops.rms_norm_backward,
                          (x.detach().bfloat16(), r.detach(), x.detach(), w.detach(), rstd, 0.0, True, torch.bfloat16))
    with pytest.raises(fusekit.Error, match="rms_norm_backward: argument 'low_dtype'"):
        ops.rms_norm_backward(x.detach().bfloat16(), None, x.detach().bfloat16(), w.detach(), rstd, 0.0, True,
                              torch.bfloat16)


def test_autocast_follows_torchs_rms_norm(device):
    """torch's rms_norm is on CUDA autocast's fp32 list from torch 2.12 (inputs cast to f32, f32 out;
    before, on none) and on no CPU list (run as given): fusekit's ops follow the running torch, with
    gradients in the inputs' own dtypes."""
    for xdtype in (torch.float32, torch.bfloat16):
        x = rand((4, 32), xdtype, device, 27, True)
        w = rand((32,), xdtype, device, 28, True)
        with torch.autocast(device, dtype=torch.bfloat16):
            want = torch.rms_norm(x, (32,), w, 1e-6)
            y = fusekit.rms_norm(x, w, 1e-6)
            y2, s = fusekit.add_rms_norm(x, x, w, 1e-6)
        assert y.dtype == want.dtype and y2.dtype == want.dtype
        tol = TOL[torch.bfloat16] if want.dtype == torch.bfloat16 else TOL[torch.float32]
        torch.testing.assert_close(y.float(), want.float(), **{k: 2 * v for k, v in tol.items()})
        gx, gw = torch.autograd.grad(y.float().sum(), (x, w))
        assert gx.dtype == xdtype and gw.dtype == xdtype


def test_compiles_without_graph_breaks(device):
    x, r = rand((3, 5, 64), torch.bfloat16, device, 29, True), rand((3, 5, 64), torch.bfloat16, device, 30, True)
    w = rand((64,), torch.float32, device, 31, True)

    def f(x, r, w):
        y, s = fusekit.add_rms_norm(x, r, w, 1e-6)
        return fusekit.rms_norm(s, w, 1e-6, 1.0) + y

    y = torch.compile(f, fullgraph=True, backend="aot_eager")(x, r, w)
    torch.testing.assert_close(y, f(x, r, w), rtol=0, atol=0)
    got = torch.autograd.grad(y.sum(), (x, r, w))
    exp = torch.autograd.grad(f(x, r, w).sum(), (x, r, w))
    for g, e in zip(got, exp):
        torch.testing.assert_close(g, e, rtol=0, atol=0)

    def g(x, w):
        with torch.autocast(device, dtype=torch.bfloat16):
            return fusekit.rms_norm(x, w)

    xf = rand((4, 64), torch.float32, device, 32, True)
    yc = torch.compile(g, fullgraph=True, backend="aot_eager")(xf, w)
    torch.testing.assert_close(yc, g(xf, w), rtol=0, atol=0)


def test_module_state_dict_and_from_module(device):
    m = fusekit.nn.RMSNorm(48, eps=1e-5, device=device)
    torch.testing.assert_close(m.weight, torch.ones(48, device=device))
    tm = torch.nn.RMSNorm(48, eps=1e-5, device=device)
    with torch.no_grad():
        tm.weight.copy_(rand((48,), torch.float32, device, 33))
    m.load_state_dict(tm.state_dict())
    x = rand((7, 48), torch.float32, device, 34)
    torch.testing.assert_close(m(x), tm(x), **TOL[torch.float32])
    assert list(m.state_dict()) == ["weight"]

    f = fusekit.nn.RMSNorm.from_module(tm)
    assert f.weight is tm.weight and f.eps == 1e-5
    torch.testing.assert_close(f(x), tm(x), **TOL[torch.float32])
    (gw,) = torch.autograd.grad(f(x).sum(), (tm.weight,))  # the shared parameter gets the gradient
    (ew,) = torch.autograd.grad(tm(x).sum(), (tm.weight,))
    torch.testing.assert_close(gw, ew, **grad_tol(torch.float32, 7))

    none_eps = torch.nn.RMSNorm(48, device=device)
    xb = x.bfloat16()
    g = fusekit.nn.RMSNorm.from_module(none_eps)
    assert g.eps is None
    torch.testing.assert_close(g(xb).float(), none_eps.bfloat16()(xb).float(), rtol=4e-2, atol=4e-2)

    gemma = fusekit.nn.RMSNorm(48, offset=1.0, device=device)
    torch.testing.assert_close(gemma.weight, torch.zeros(48, device=device))
    torch.testing.assert_close(gemma(x), fusekit.rms_norm(x, torch.ones(48, device=device)))
    y, s = m(x, x)
    torch.testing.assert_close(s, x + x)

    with pytest.raises(fusekit.Error, match="argument 'm'"):
        fusekit.nn.RMSNorm.from_module(torch.nn.RMSNorm(48, elementwise_affine=False))


def test_from_hugging_face_llama_rms_norm(device):
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    hf = llama.LlamaRMSNorm(64, eps=1e-5).to(device)
    with torch.no_grad():
        hf.weight.copy_(rand((64,), torch.float32, device, 35))
    f = fusekit.nn.RMSNorm.from_module(hf)
    assert f.weight is hf.weight and f.eps == 1e-5
    for dtype in DTYPES:
        x = rand((2, 9, 64), dtype, device, 36)
        want = hf(x)
        y = f(x)
        assert y.dtype == want.dtype  # f32: the f32 weight promotes
        torch.testing.assert_close(y, want, **{k: 2 * v for k, v in TOL[dtype].items()})
    fresh = fusekit.nn.RMSNorm(64, eps=1e-5, device=device)
    fresh.load_state_dict(hf.state_dict())
    hf.load_state_dict(fresh.state_dict())


def test_bad_input_raises_naming_the_argument(device):
    x = rand((4, 6), torch.float32, device, 37)
    with pytest.raises(fusekit.Error, match="argument 'weight'"):
        fusekit.rms_norm(x, rand((5,), torch.float32, device, 38))
    with pytest.raises(fusekit.Error, match="argument 'residual'"):
        fusekit.add_rms_norm(x, rand((4, 5), torch.float32, device, 39), rand((6,), torch.float32, device, 40))
    with pytest.raises(fusekit.Error, match="argument 'eps'"):
        fusekit.rms_norm(x, rand((6,), torch.float32, device, 41), -1.0)
    if device == "cuda":
        with pytest.raises(fusekit.Error, match="argument 'weight'"):
            fusekit.rms_norm(x, rand((6,), torch.float32, "cpu", 42))
