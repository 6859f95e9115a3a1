"""The primitives through PyTorch: softmax, attention, broadcast binary ops, row sum, conv2d and
batched matmul against plain torch math on odd shapes, gradients where fusekit has a backward,
opcheck, bad input."""
import pytest

torch = pytest.importorskip("torch", reason="the operator tests need PyTorch")
import torch.nn.functional as F  # noqa: E402

import fusekit  # noqa: E402
from fusekit import ops  # noqa: E402
from helpers import TOL, rand  # noqa: E402

SHAPES = [(1, 1), (1, 7), (3, 5), (17, 33), (64, 129), (2, 3, 40)]


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


BROADCASTS = [((5, 7), (5, 7)), ((5, 7), (1, 7)), ((5, 7), (5, 1)), ((1,), (3, 2, 4)), ((90, 100), (90, 1)),
              ((2, 1, 3), (4, 1))]


@pytest.mark.parametrize("xs,ys", BROADCASTS)
@pytest.mark.parametrize("op", ["add", "mul", "mul_relu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_broadcast_binary_matches_torch_with_gradients(xs, ys, op, dtype, device):
    x, y = rand(xs, dtype, device, 1, True), rand(ys, dtype, device, 2, True)
    ref = {"add": lambda a, b: a + b, "mul": lambda a, b: a * b, "mul_relu": lambda a, b: torch.relu(a * b)}[op]
    z = fusekit.broadcast_binary(x, y, op)
    want = ref(x.float(), y.float())
    torch.testing.assert_close(z.float(), want, **TOL[dtype])
    dz = rand(z.shape, dtype, device, 3)
    got = torch.autograd.grad(z, (x, y), dz)
    exp = torch.autograd.grad(want, (x, y), dz.float())
    for g, e in zip(got, exp):
        torch.testing.assert_close(g.float(), e.float(), **TOL[dtype])


def test_outer_is_the_puzzles_outer_op(device):
    x, y = rand((6,), torch.float32, device, 4), rand((4,), torch.float32, device, 5)
    torch.testing.assert_close(fusekit.outer(x, y, "mul"), y[:, None] * x[None, :])


@pytest.mark.parametrize("shape", [(3, 1), (7, 1000), (2, 3, 33), (1, 70000), (4, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_row_sum_matches_torch_with_gradient(shape, dtype, device):
    x = rand(shape, dtype, device, 6, True)
    out = fusekit.row_sum(x, torch.float32)
    want = x.float().sum(-1)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-3)
    assert fusekit.row_sum(x).dtype == dtype
    dout = rand(out.shape, torch.float32, device, 7)
    (g,) = torch.autograd.grad(out, x, dout)
    torch.testing.assert_close(g.float(), dout.to(dtype).float().unsqueeze(-1).expand(shape))


@pytest.mark.parametrize("n,c,h,w,o,kh,kw", [(4, 1, 8, 8, 1, 4, 4), (2, 3, 9, 7, 5, 3, 2), (1, 2, 5, 5, 3, 5, 5)])
@pytest.mark.parametrize("padding", ["valid", "same", "same_end"])
def test_conv2d_matches_f_conv2d(n, c, h, w, o, kh, kw, padding, device):
    x, k = rand((n, c, h, w), torch.float32, device, 8), rand((o, c, kh, kw), torch.float32, device, 9)
    if padding == "same_end":
        want = F.conv2d(F.pad(x, (0, kw - 1, 0, kh - 1)), k)
    else:
        want = F.conv2d(x, k, padding=padding)
    torch.testing.assert_close(fusekit.conv2d(x, k, padding), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("b,m,k,n", [(3, 5, 7, 9), (1, 1, 1, 1), (2, 64, 0, 16), (4, 33, 65, 17)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_matmul_matches_bmm(b, m, k, n, dtype, device):
    a, bb = rand((b, m, k), dtype, device, 10), rand((b, k, n), dtype, device, 11)
    want = torch.bmm(a.float(), bb.float())
    torch.testing.assert_close(fusekit.batched_matmul(a, bb, out_dtype=torch.float32), want, rtol=1e-4,
                               atol=1e-4 * max(k, 1))
    if dtype != torch.float32 and device == "cuda":
        torch.testing.assert_close(fusekit.batched_matmul(a, bb, impl="cute").float(), want, **TOL[dtype])


def test_opcheck_primitives(device):
    x, y = rand((5, 7), torch.float32, device, 14, True), rand((1, 7), torch.float32, device, 15, True)
    torch.library.opcheck(ops.broadcast_binary, (x, y, "mul_relu"))
    torch.library.opcheck(ops.row_sum, (x, torch.float32))
    torch.library.opcheck(ops.conv2d, (rand((2, 3, 6, 6), torch.float32, device, 16),
                                       rand((4, 3, 3, 3), torch.float32, device, 17), "same"))
    torch.library.opcheck(ops.batched_matmul, (rand((2, 3, 4), torch.float32, device, 18),
                                               rand((2, 4, 5), torch.float32, device, 19), "cublas", torch.float32))
    s = rand((5, 12), torch.float32, device, 20, True)
    torch.library.opcheck(ops.softmax, (s,))
    torch.library.opcheck(ops.attention, (rand((1, 2, 5, 8), torch.float32, device, 23),
                                          rand((1, 2, 6, 8), torch.float32, device, 24),
                                          rand((1, 2, 6, 8), torch.float32, device, 25), False, 0.3))


def test_bad_input_raises_naming_the_argument(device):
    x = rand((4, 6), torch.float32, device, 20)
    with pytest.raises(fusekit.Error, match="argument 'y'"):
        fusekit.broadcast_binary(x, rand((4, 6), torch.float16, device, 21))
    with pytest.raises(fusekit.Error, match="argument 'x'"):
        fusekit.broadcast_binary(x.t(), rand((6, 4), torch.float32, device, 21))  # not contiguous
    with pytest.raises(fusekit.Error, match="argument 'op'"):
        fusekit.broadcast_binary(x, x, "sub")
    with pytest.raises(fusekit.Error, match="argument 'padding'"):
        fusekit.conv2d(rand((1, 1, 4, 4), torch.float32, device, 22), rand((1, 1, 2, 2), torch.float32, device, 23),
                       "full")
    with pytest.raises(fusekit.Error, match="argument 'w'"):
        fusekit.conv2d(rand((1, 2, 4, 4), torch.float32, device, 22), rand((1, 3, 2, 2), torch.float32, device, 23))
    with pytest.raises(fusekit.Error, match="argument 'b'"):
        fusekit.batched_matmul(rand((2, 3, 4), torch.float32, device, 24), rand((2, 5, 6), torch.float32, device, 25))
    with pytest.raises(fusekit.Error, match="argument 'impl'"):
        fusekit.batched_matmul(rand((2, 3, 4), torch.float32, device, 24), rand((2, 4, 6), torch.float32, device, 25),
                               impl="cute")
    with pytest.raises(fusekit.Error, match="argument 'x'"):
        fusekit.row_sum(x.t())
    with pytest.raises(fusekit.Error, match="argument 'x'"):
        fusekit.softmax(x.to(torch.float64))
    if device == "cuda":
        with pytest.raises(fusekit.Error, match="argument 'y'"):
            fusekit.broadcast_binary(x, x.cpu())
