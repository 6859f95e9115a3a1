"""The loss family through PyTorch: fusekit.linear_cross_entropy against F.linear + F.cross_entropy
(+ the z-loss term) with autograd, bf16 / f16 / f32, opcheck, autocast, torch.compile, and on a
GPU the memory it saves against the eager expression."""
import math

import pytest

torch = pytest.importorskip("torch", reason="the operator tests need PyTorch")
import torch.nn.functional as F  # noqa: E402

import fusekit  # noqa: E402
from fusekit import ops  # noqa: E402
from helpers import rand  # noqa: E402

# Normwise relative error of the gradients: one rounding of the logits' gradient to the dtype
# before two f32-accumulated GEMMs (on the CPU, the spec in double: one rounding at the store).
# On a GPU, 16-bit operands give 16-bit logits (rounded once, as F.linear's are): the loss is within
# a few of the dtype's units of roundoff of the exact one.
LOSS_TOL = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.bfloat16: dict(rtol=1e-2, atol=1e-3),
            torch.float16: dict(rtol=2e-3, atol=1e-4)}
GRAD_BOUND = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def eager_loss(h, w, targets, bias=None, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, reduction="mean"):
    """What a PyTorch user writes: the logits in full, F.cross_entropy, PaLM's z-loss over the rows
    that count."""
    logits = F.linear(h, w, bias).reshape(-1, w.shape[0])
    t = targets.reshape(-1)
    loss = F.cross_entropy(logits, t, ignore_index=ignore_index, label_smoothing=label_smoothing,
                           reduction=reduction)
    if z_loss:
        keep = t != ignore_index
        zl = z_loss * (torch.logsumexp(logits.float(), dim=-1)[keep] ** 2).sum()
        loss = loss + (zl / keep.sum() if reduction == "mean" else zl)
    return loss


def make_targets(shape, v, seed, ignore_index=-100, ignored=0.2):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, v, shape, generator=g)
    t[torch.rand(shape, generator=g) < ignored] = ignore_index
    t.view(-1)[0] = 0  # at least one row counts
    return t


def rel(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


def inputs(lead, hd, v, dtype, device, bias, seed=0):
    h = (rand((*lead, hd), torch.float32, device, seed) / math.sqrt(hd)).to(dtype).requires_grad_()
    w = rand((v, hd), torch.float32, device, seed + 1).to(dtype).requires_grad_()
    b = rand((v,), torch.float32, device, seed + 2).to(dtype).requires_grad_() if bias else None
    return h, w, b


CASES = [  # (leading shape, H, V, bias, label_smoothing, z_loss, reduction)
    ((1,), 16, 10, False, 0.0, 0.0, "mean"),
    ((37,), 32, 999, True, 0.0, 0.0, "mean"),
    ((3, 7), 24, 1000, True, 0.1, 1e-3, "sum"),
    ((2, 9), 40, 333, False, 0.25, 1e-2, "mean"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_matches_linear_and_cross_entropy(device, dtype, case):
    lead, hd, v, bias, eps, z, reduction = case
    h, w, b = inputs(lead, hd, v, dtype, device, bias)
    t = make_targets(lead, v, 5).to(device)
    loss = fusekit.linear_cross_entropy(h, w, t, b, label_smoothing=eps, z_loss=z, reduction=reduction)
    assert loss.dtype == torch.float32 and loss.shape == ()
    (loss * 0.5).backward()  # the incoming gradient scales every gradient
    hd_, wd_, bd_ = (x.detach().double().requires_grad_() if x is not None else None for x in (h, w, b))
    want = eager_loss(hd_, wd_, t, bd_, label_smoothing=eps, z_loss=z, reduction=reduction)
    (want * 0.5).backward()
    torch.testing.assert_close(loss.double(), want.detach(), **LOSS_TOL[dtype])
    bound = GRAD_BOUND[dtype]
    assert h.grad.dtype == dtype and h.grad.shape == h.shape
    assert rel(h.grad, hd_.grad) <= bound
    assert rel(w.grad, wd_.grad) <= bound
    if b is not None:
        assert rel(b.grad, bd_.grad) <= bound


def test_any_layout_and_leading_shape(device):
    base = rand((24, 2, 5), torch.float32, device, 3)
    h = base.permute(1, 2, 0).requires_grad_()  # [2, 5, 24], not contiguous
    w = rand((50, 24), torch.float32, device, 4).t().contiguous().t().requires_grad_()  # contiguous
    wt = rand((24, 50), torch.float32, device, 4).t().requires_grad_()                 # [50, 24] transposed
    t = make_targets((2, 5), 50, 6).to(device)
    for weight in (w, wt):
        loss = fusekit.linear_cross_entropy(h, weight, t)
        want = eager_loss(h, weight, t)
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
        gh, gw = torch.autograd.grad(loss, (h, weight))
        eh, ew = torch.autograd.grad(want, (h, weight))
        torch.testing.assert_close(gh, eh, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(gw, ew, rtol=1e-4, atol=1e-6)


def test_frozen_head_and_no_grad_skip_the_work(device):
    h, w, b = inputs((6,), 8, 20, torch.float32, device, True)
    t = make_targets((6,), 20, 7).to(device)
    w.requires_grad_(False)
    b.requires_grad_(False)
    loss = fusekit.linear_cross_entropy(h, w, t, b)
    loss.backward()
    assert w.grad is None and h.grad is not None
    _, dh, dw, db = ops.linear_cross_entropy(h.detach(), w, b, t, -100, 0.0, 0.0, "mean", True, False)
    assert dh.shape == h.shape and dw.numel() == 0 and db.numel() == 0
    with torch.no_grad():
        out = ops.linear_cross_entropy(h, w, b, t, -100, 0.0, 0.0, "mean", False, False)
        assert all(x.numel() == 0 for x in out[1:])
        torch.testing.assert_close(fusekit.linear_cross_entropy(h, w, t, b), out[0])
    with pytest.raises(fusekit.Error, match="need_dw"):  # a gradient asked of what the forward did not compute
        loss, *_ = ops.linear_cross_entropy(h, w.requires_grad_(), b, t, -100, 0.0, 0.0, "mean", True, False)
        loss.backward()


def test_all_ignored_is_what_cross_entropy_gives(device):
    h, w, _ = inputs((4,), 8, 11, torch.float32, device, False)
    t = torch.full((4,), -100, device=device)
    for reduction in ("mean", "sum"):
        got = fusekit.linear_cross_entropy(h, w, t, reduction=reduction)
        want = eager_loss(h, w, t, reduction=reduction)
        torch.testing.assert_close(got, want, equal_nan=True)
    got.backward()
    assert bool((h.grad == 0).all())
    t2 = torch.tensor([1, 7, 7, 3], device=device)  # another ignore_index
    torch.testing.assert_close(fusekit.linear_cross_entropy(h, w, t2, ignore_index=7),
                               eager_loss(h, w, t2, ignore_index=7))


def test_bad_input(device):
    h, w, _ = inputs((3,), 8, 10, torch.float32, device, False)
    with pytest.raises(fusekit.Error, match="argument 'targets'.*10 at row 1"):
        fusekit.linear_cross_entropy(h, w, torch.tensor([1, 10, 2], device=device))
    with pytest.raises(fusekit.Error, match="argument 'targets'"):
        fusekit.linear_cross_entropy(h, w, torch.tensor([1, 2, 2], device=device, dtype=torch.int32))
    with pytest.raises(fusekit.Error, match="argument 'targets'"):
        fusekit.linear_cross_entropy(h, w, torch.tensor([1, 2], device=device))
    with pytest.raises(fusekit.Error, match="argument 'reduction'"):
        fusekit.linear_cross_entropy(h, w, torch.tensor([1, 2, 3], device=device), reduction="none")
    with pytest.raises(fusekit.Error, match="argument 'label_smoothing'"):
        fusekit.linear_cross_entropy(h, w, torch.tensor([1, 2, 3], device=device), label_smoothing=1.5)
    with pytest.raises(fusekit.Error, match="argument 'w'"):
        fusekit.linear_cross_entropy(h, w.double(), torch.tensor([1, 2, 3], device=device))


def test_opcheck(device):
    h, w, b = inputs((5,), 12, 17, torch.float32, device, True)
    t = make_targets((5,), 17, 8).to(device)
    torch.library.opcheck(ops.linear_cross_entropy, (h, w, b, t, -100, 0.1, 1e-3, "mean", True, True))
    h3 = rand((2, 3, 12), torch.float32, device, 9, True)
    torch.library.opcheck(ops.linear_cross_entropy, (h3, w.detach(), None, make_targets((2, 3), 17, 10).to(device), -100, 0.0,
                                                     0.0, "sum", True, False))


def test_autocast_runs_like_linear(device):
    """Under autocast h, w and bias are cast to autocast's dtype (as F.linear's are), targets not;
    the loss is exactly the op's on the cast inputs, the gradients reach the f32 leaves in f32."""
    h, w, b = inputs((9,), 16, 50, torch.float32, device, True)
    t = make_targets((9,), 50, 11).to(device)
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = fusekit.linear_cross_entropy(h, w, t, b)
    loss.backward()
    want, dh, dw, db = ops.linear_cross_entropy(h.detach().bfloat16(), w.detach().bfloat16(), b.detach().bfloat16(),
                                               t, -100, 0.0, 0.0, "mean", True, True)
    torch.testing.assert_close(loss, want, rtol=0, atol=0)
    assert h.grad.dtype == torch.float32 and w.grad.dtype == torch.float32 and b.grad.dtype == torch.float32
    torch.testing.assert_close(h.grad, dh.float(), rtol=0, atol=0)
    torch.testing.assert_close(w.grad, dw.float(), rtol=0, atol=0)
    torch.testing.assert_close(b.grad, db.float(), rtol=0, atol=0)


def test_compiles_without_graph_breaks(device):
    h, w, b = inputs((4, 6), 16, 64, torch.float32, device, True)
    t = make_targets((4, 6), 64, 12).to(device)

    def step(h, w, b, t):
        loss = fusekit.linear_cross_entropy(h, w, t, b, label_smoothing=0.1, z_loss=1e-4)
        return loss * 2.0

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(h, w, b, t)
    gh, gw, gb = torch.autograd.grad(got, (h, w, b))
    want = step(h, w, b, t)
    eh, ew, eb = torch.autograd.grad(want, (h, w, b))
    torch.testing.assert_close(got, want)
    for a, e in ((gh, eh), (gw, ew), (gb, eb)):
        torch.testing.assert_close(a, e)


def test_module_shares_the_heads_parameters(device):
    head = torch.nn.Linear(16, 40, bias=True).to(device)
    crit = fusekit.nn.LinearCrossEntropy(head, label_smoothing=0.05)
    assert crit.head.weight is head.weight and dict(crit.named_parameters()).keys() == {"head.weight", "head.bias"}
    h = rand((3, 5, 16), torch.float32, device, 13, True)
    t = make_targets((3, 5), 40, 14).to(device)
    loss = crit(h, t)
    loss.backward()
    want = F.cross_entropy(head(h.detach()).reshape(-1, 40), t.reshape(-1), label_smoothing=0.05)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
    ew = torch.autograd.grad(F.cross_entropy(head(h.detach()).reshape(-1, 40), t.reshape(-1), label_smoothing=0.05),
                             head.weight)[0]
    torch.testing.assert_close(head.weight.grad, ew, rtol=1e-4, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the memory test needs a GPU")
@pytest.mark.parametrize("mode", ["f32", "bf16_autocast"])
def test_peak_memory_is_a_quarter_of_eager(mode):
    """N = 8192 tokens, V = 32000, H = 1024: the fused loss and its backward take at most 1/4 of the
    memory the eager expression adds on top of its inputs."""
    n, hd, v = 8192, 1024, 32000
    h = (torch.randn(n, hd, device="cuda") / 32).requires_grad_()
    w = torch.randn(v, hd, device="cuda").requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda")

    def increment(fn):
        h.grad = w.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=mode == "bf16_autocast"):
            loss = fn(h, w, t)
        loss.backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before

    increment(lambda h, w, t: fusekit.linear_cross_entropy(h, w, t))  # warm-up (cuBLAS workspaces)
    fused = increment(lambda h, w, t: fusekit.linear_cross_entropy(h, w, t))
    eager = increment(lambda h, w, t: F.cross_entropy(F.linear(h, w), t))
    assert fused <= eager / 4, f"fused {fused / 2**20:.0f} MiB, eager {eager / 2**20:.0f} MiB"
