"""fusekit.attention: the forward and its backward against F.scaled_dot_product_attention and plain
PyTorch expressions, with every option (grouped-query heads, causal top-left and bottom-right,
sliding windows, softcap), odd shapes, non-contiguous inputs and incoming gradients; opcheck; the
GPU against the CPU on every option."""
import math

import pytest

torch = pytest.importorskip("torch", reason="the operator tests need PyTorch")
F = torch.nn.functional

import fusekit  # noqa: E402
from fusekit import ops  # noqa: E402
from helpers import rand  # noqa: E402


def reference(q, k, v, causal=False, scale=None, bottom_right=False, window=(-1, -1), softcap=0.0):
    """The options written out in PyTorch (f64): the visible keys as a boolean mask, GQA by
    repeating k and v over each group."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = scale * q.double() @ k.double().transpose(-1, -2)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    sq, sk = q.shape[2], k.shape[2]
    i = torch.arange(sq).view(-1, 1)
    j = torch.arange(sk).view(1, -1)
    offset = sk - sq if bottom_right else 0
    left, right = window
    right = 0 if causal else right
    visible = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        visible &= j >= i + offset - left
    if right >= 0:
        visible &= j <= i + offset + right
    s = s.masked_fill(~visible.to(s.device), float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)  # a row that sees no key: 0
    return (p @ v.double()).to(q.dtype)


CASES = [
    dict(shape=(2, 3, 7, 11, 5), hk=3),
    dict(shape=(1, 4, 9, 9, 8), hk=2, causal=True),
    dict(shape=(2, 2, 6, 10, 4), hk=2, causal=True, bottom_right=True),
    dict(shape=(1, 6, 5, 8, 3), hk=1, scale=0.4),
    dict(shape=(1, 2, 12, 12, 4), hk=2, window=(3, 1)),
    dict(shape=(1, 2, 12, 12, 4), hk=1, causal=True, window=(2, -1)),
    dict(shape=(2, 2, 5, 6, 8), hk=2, softcap=1.5, scale=1.0),
    dict(shape=(1, 1, 1, 1, 3), hk=1),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_forward_and_backward_match_pytorch_on_the_cpu(case):
    c = dict(CASES[case])
    b, h, sq, sk, d = c.pop("shape")
    hk = c.pop("hk")
    q = rand((b, h, sq, d), torch.float32, "cpu", 1 + case, True)
    k = rand((b, hk, sk, d), torch.float32, "cpu", 2 + case, True)
    v = rand((b, hk, sk, d), torch.float32, "cpu", 3 + case, True)
    dout = rand((b, h, sq, d), torch.float32, "cpu", 4 + case)
    out = fusekit.attention(q, k, v, **c)
    ref_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref = reference(*ref_in, **c)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    out.backward(dout)
    ref.backward(dout)
    for got, want in zip((q, k, v), ref_in):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-5)


def test_matches_sdpa_with_gqa_and_is_causal():
    q = rand((2, 8, 33, 16), torch.float32, "cpu", 5, True)
    k, v = rand((2, 2, 33, 16), torch.float32, "cpu", 6, True), rand((2, 2, 33, 16), torch.float32, "cpu", 7, True)
    out = fusekit.attention(q, k, v, causal=True)
    ref_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    g = rand(out.shape, torch.float32, "cpu", 8)
    out.backward(g)
    ref.backward(g)
    for got, want in zip((q, k, v), ref_in):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-5)


def test_non_contiguous_inputs_and_gradient():
    """[B, S, H, D] tensors transposed to [B, H, S, D] (what a model hands over), and an expanded
    incoming gradient (what .sum() hands back)."""
    q = rand((2, 9, 4, 8), torch.float32, "cpu", 9).transpose(1, 2).requires_grad_()
    k = rand((2, 9, 4, 8), torch.float32, "cpu", 10).transpose(1, 2).requires_grad_()
    v = rand((2, 9, 4, 8), torch.float32, "cpu", 11).transpose(1, 2).requires_grad_()
    fusekit.attention(q, k, v, causal=True).sum().backward()
    ref_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*ref_in, is_causal=True).sum().backward()
    for got, want in zip((q, k, v), ref_in):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-5)


def test_opcheck_attention_and_its_backward():
    q = rand((1, 4, 5, 8), torch.float32, "cpu", 12, True)
    k, v = rand((1, 2, 6, 8), torch.float32, "cpu", 13, True), rand((1, 2, 6, 8), torch.float32, "cpu", 14, True)
    torch.library.opcheck(ops.attention, (q, k, v, True, 0.3, True, 2, -1, 0.0))
    torch.library.opcheck(ops.attention, (q, k, v, False, 0.5, False, -1, -1, 1.2))
    out, lse = ops.attention(q.detach(), k.detach(), v.detach(), False, 0.5)
    torch.library.opcheck(ops.attention_backward, (rand(out.shape, torch.float32, "cpu", 15), q.detach(), k.detach(),
                                                   v.detach(), out, lse, False, 0.5, False, -1, -1, 0.0))
    torch.library.opcheck(ops.attention, (q, k, v, True, 0.3, False, -1, -1, 0.0, True))
    torch.library.opcheck(ops.attention_backward, (rand(out.shape, torch.float32, "cpu", 15), q.detach(), k.detach(),
                                                   v.detach(), out, lse, False, 0.5, False, -1, -1, 0.0, True))


def test_bad_options_name_themselves():
    q = rand((1, 4, 5, 8), torch.float32, "cpu", 16)
    k = rand((1, 3, 6, 8), torch.float32, "cpu", 17)
    with pytest.raises(fusekit.Error, match="attention_forward: argument 'k'"):
        fusekit.attention(q, k, k)
    with pytest.raises(fusekit.Error, match="attention_forward: argument 'softcap'"):
        fusekit.attention(q, q, q, softcap=-1.0)
    with pytest.raises(fusekit.Error, match="attention_forward: argument 'window_left'"):
        fusekit.attention(q, q, q, window=(-3, 0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_gpu_matches_the_cpu(case):
    """Every option on the GPU (the warp-per-row kernels, or the sm_90 forward for the plain ones)
    against the CPU spec, forward and backward, in f32."""
    c = dict(CASES[case])
    b, h, sq, sk, d = c.pop("shape")
    hk = c.pop("hk")
    cpu = [rand(s, torch.float32, "cpu", 20 + i + case, True)
           for i, s in enumerate(((b, h, sq, d), (b, hk, sk, d), (b, hk, sk, d)))]
    gpu = [t.detach().cuda().requires_grad_() for t in cpu]
    g = rand((b, h, sq, d), torch.float32, "cpu", 30 + case)
    out_c, out_g = fusekit.attention(*cpu, **c), fusekit.attention(*gpu, **c)
    torch.testing.assert_close(out_g.cpu(), out_c, rtol=1e-4, atol=1e-5)
    out_c.backward(g)
    out_g.backward(g.cuda())
    for a, bb in zip(gpu, cpu):
        torch.testing.assert_close(a.grad.cpu(), bb.grad, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_half_precision_matches_pytorch(dtype, device):
    """bf16/f16 inputs (grouped-query, bottom-right causal, odd sizes) against the expression in
    double, within the dtype's rounding of the inputs, out and the gradients."""
    q = rand((1, 4, 13, 8), dtype, device, 40, True)
    k, v = rand((1, 2, 17, 8), dtype, device, 41, True), rand((1, 2, 17, 8), dtype, device, 42, True)
    g = rand((1, 4, 13, 8), dtype, device, 43)
    out = fusekit.attention(q, k, v, causal=True, bottom_right=True)
    assert out.dtype == dtype
    ref_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref = reference(*ref_in, causal=True, bottom_right=True)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=5e-3, atol=5e-3)
    torch.testing.assert_close(out, ref, **tol)
    out.backward(g)
    ref.backward(g)
    for got, want in zip((q, k, v), ref_in):
        assert got.grad.dtype == dtype
        torch.testing.assert_close(got.grad.float(), want.grad.float(), **tol)


def test_compiles_without_graph_breaks_forward_and_backward():
    q = rand((2, 4, 9, 8), torch.float32, "cpu", 44, True)
    k, v = rand((2, 2, 9, 8), torch.float32, "cpu", 45, True), rand((2, 2, 9, 8), torch.float32, "cpu", 46, True)

    def f(q, k, v):
        return fusekit.attention(q, k, v, causal=True, window=(4, -1), softcap=2.0).sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    loss = compiled(q, k, v)
    loss.backward()
    ref_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    f(*ref_in).backward()
    torch.testing.assert_close(loss, f(*ref_in).detach())
    for got, want in zip((q, k, v), ref_in):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-6)


def test_compiled_backward_of_transposed_inputs():
    """q, k, v as Hugging Face's attention makes them ([B, S, H, D] projections transposed to
    [B, H, S, D]) under torch.compile: the gradients the compiled graph reshapes back are laid out
    as the op writes them (in q's, k's and v's layouts), as its fake kernel says."""
    x = rand((2, 9, 64), torch.float32, "cpu", 47, True)

    def f(x):
        q = x.view(2, 9, 4, 16).transpose(1, 2)
        k, v = ((x[..., :32] * c).view(2, 9, 2, 16).transpose(1, 2) for c in (0.5, 2.0))
        return fusekit.attention(q, k, v, causal=True).transpose(1, 2).reshape(2, 9, 64)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    y = compiled(x)
    (g,) = torch.autograd.grad(y.square().sum(), x)
    xr = x.detach().clone().requires_grad_()
    yr = f(xr)
    (gr,) = torch.autograd.grad(yr.square().sum(), xr)
    torch.testing.assert_close(y, yr)
    torch.testing.assert_close(g, gr, rtol=1e-5, atol=1e-6)


def _bshd(shape, dtype, device, seed):
    """A [B, H, S, D] view of [B, S, H, D] memory, as Hugging Face's attention hands q, k, v over."""
    b, h, s_, d = shape
    return rand((b, s_, h, d), dtype, device, seed).transpose(1, 2).requires_grad_()


_DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", _DEVICES)
def test_transposed_views_are_read_in_place_and_outputs_take_their_layout(device):
    """q, k, v as [B, S, H, D] memory seen as [B, H, S, D], and the incoming gradient as the
    model's reshape hands it back: out, dq, dk and dv come in the same layout ([B, S, H, D] memory),
    so the model's transpose back and its projections' backward read them without a copy, and
    equal the contiguous call's."""
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    d = 16 if device == "cpu" else 64
    q, k, v = (_bshd((2, 4 if i == 0 else 2, 130, d), dt, device, 60 + i) for i in range(3))
    out = fusekit.attention(q, k, v, causal=True)
    assert out.transpose(1, 2).is_contiguous()
    g = rand((2, 130, 4, d), dt, device, 63).transpose(1, 2)  # dout in the model's layout
    out.backward(g)
    ref_in = [t.detach().contiguous().requires_grad_() for t in (q, k, v)]
    ref = fusekit.attention(*ref_in, causal=True)
    assert ref.is_contiguous()
    ref.backward(g.contiguous())
    assert torch.equal(out, ref)
    for got, want in zip((q, k, v), ref_in):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-2 if device == "cuda" else 1e-6, atol=1e-3)
    _, lse = ops.attention(q.detach(), k.detach(), v.detach(), True, 1.0 / math.sqrt(d))
    grads = ops.attention_backward(g, q.detach(), k.detach(), v.detach(), out.detach(), lse, True, 1.0 / math.sqrt(d),
                                   False, -1, -1, 0.0)
    for grad, x in zip(grads, (q, k, v)):
        assert grad.stride() == x.stride(), "a gradient in its input's layout"


def test_opcheck_transposed_views():
    """opcheck on the layouts Hugging Face hands over: the fake kernels' strides are the real ones'."""
    q, k, v = (_bshd((1, 4 if i == 0 else 2, 6, 8), torch.float32, "cpu", 70 + i) for i in range(3))
    torch.library.opcheck(ops.attention, (q, k, v, True, 0.3, False, -1, -1, 0.0))
    columns = rand((1, 4, 8, 6), torch.float32, "cpu", 75).transpose(-1, -2).requires_grad_()  # D not innermost
    torch.library.opcheck(ops.attention, (columns, k, v, True, 0.3, False, -1, -1, 0.0))
    out, lse = ops.attention(q.detach(), k.detach(), v.detach(), True, 0.3)
    dout = rand((1, 6, 4, 8), torch.float32, "cpu", 74).transpose(1, 2)
    torch.library.opcheck(ops.attention_backward, (dout, q.detach(), k.detach(), v.detach(), out, lse, True, 0.3, False,
                                                   -1, -1, 0.0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d, hk, causal, bottom_right", [(64, 2, True, False), (96, 4, False, False),
                                                         (128, 1, True, True)])
def test_the_tensor_core_backward_matches_double(dtype, d, hk, causal, bottom_right):
    """bf16/f16 at head dims 64, 96, 128 on a GPU take the tensor-core backward (P and dS rounded
    to the dtype): normwise relative error of each gradient against the expression in double
    within 2e-2 (bf16) or 4e-3 (f16), as the C++ tests hold it; tails of both tiles (200, 150)."""
    q = rand((2, 4, 200, d), dtype, "cuda", 50, True)
    k, v = rand((2, hk, 150, d), dtype, "cuda", 51, True), rand((2, hk, 150, d), dtype, "cuda", 52, True)
    g = rand((2, 4, 200, d), dtype, "cuda", 53)
    out = fusekit.attention(q, k, v, causal=causal, bottom_right=bottom_right)
    out.backward(g)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    reference(*ref_in, causal=causal, bottom_right=bottom_right).backward(g.double())
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    for name, got, want in zip("qkv", (q, k, v), ref_in):
        assert got.grad.dtype == dtype
        err = ((got.grad.double() - want.grad).norm() / want.grad.norm()).item()
        assert err <= tol, f"d{name}: normwise relative error {err:.3g} > {tol}"


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_deterministic_backward_repeats_its_bits(device):
    """deterministic=True: two backward passes of the same inputs give the same bits (on a GPU in
    bf16 at D 64 the tensor-core backward, whose default dq adds by f32 atomics), and the same
    gradients as the default mode up to its rounding."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q = rand((2, 4, 130, 64), dtype, device, 60)
    k, v = rand((2, 2, 100, 64), dtype, device, 61), rand((2, 2, 100, 64), dtype, device, 62)
    g = rand((2, 4, 130, 64), dtype, device, 63)

    def grads(deterministic):
        ins = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        fusekit.attention(*ins, causal=True, deterministic=deterministic).backward(g)
        return [t.grad for t in ins]

    first, second, default = grads(True), grads(True), grads(False)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    for a, b in zip(first, default):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
