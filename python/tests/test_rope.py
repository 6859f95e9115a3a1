"""Rotary position embedding through PyTorch: torch.ops.fusekit.rope and fusekit.apply_rotary_pos_emb
against Hugging Face LLaMA's apply_rotary_pos_emb written out in torch (the same expression, without
importing transformers) on random shapes (T = 1, odd and grouped-query heads, D = 2 to 128), f32, bf16
and f16 with tables in q's dtype or f32, HF's transposed q, incoming gradients of any layout;
gradients against autograd of the expression; opcheck; autocast; torch.compile(fullgraph=True)."""
import pytest

torch = pytest.importorskip("torch", reason="the operator tests need PyTorch")

import fusekit  # noqa: E402
from fusekit import ops  # noqa: E402
from helpers import TOL, rand  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def rotate_half(x):
    """Hugging Face's rotate_half."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def hf_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """Hugging Face LLaMA's apply_rotary_pos_emb, as written there."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def tables(batch, seq, dim, dtype, device, kind="hf", seed=0):
    """cos, sin [batch, seq, dim]: as LlamaRotaryEmbedding makes them (kind "hf": equal halves, from
    positions with an offset per batch row), or random values with unequal halves ("random")."""
    if kind == "random":
        return rand((batch, seq, dim), dtype, device, seed), rand((batch, seq, dim), dtype, device, seed + 1)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    pos = torch.arange(seq, dtype=torch.float32)[None, :] + 7.0 * torch.arange(batch, dtype=torch.float32)[:, None]
    freqs = pos[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)


def qk(batch, heads, seq, dim, dtype, device, layout, seed, requires_grad=False):
    """[B, H, T, D]: contiguous ("bhtd"), or HF's q_proj(x).view(B, T, H, D).transpose(1, 2) ("bthd")."""
    if layout == "bthd":
        t = rand((batch, seq, heads, dim), dtype, device, seed).transpose(1, 2)
    else:
        t = rand((batch, heads, seq, dim), dtype, device, seed)
    return t.requires_grad_(requires_grad)


def same_layout(a, b):
    """Equal strides on every dimension of size > 1 (a size-1 dimension's stride says nothing)."""
    return a.shape == b.shape and all(a.stride(d) == b.stride(d) for d in range(a.dim()) if a.shape[d] > 1)


def reference(q, k, cos, sin, out_dtype):
    """HF's expression in f32 on the same inputs, rounded once to out_dtype."""
    qe, ke = hf_apply_rotary_pos_emb(q.float(), k.float(), cos.float(), sin.float())
    return qe.to(out_dtype), ke.to(out_dtype)


# (B, Hq, Hk, T, D)
SHAPES = [(1, 1, 1, 1, 2), (2, 3, 3, 1, 64), (2, 5, 1, 7, 128), (3, 4, 2, 33, 64), (1, 7, 7, 17, 6),
          (2, 8, 2, 65, 128), (1, 3, 1, 5, 80)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("f32_tables", [False, True])
@pytest.mark.parametrize("layout", ["bthd", "bhtd"])
def test_forward_and_gradients_match_hf(shape, dtype, f32_tables, layout, device):
    B, Hq, Hk, T, D = shape
    q = qk(B, Hq, T, D, dtype, device, layout, 1, True)
    k = qk(B, Hk, T, D, dtype, device, layout, 2, True)
    cos, sin = tables(B, T, D, torch.float32 if f32_tables else dtype, device, "random" if D == 6 else "hf", 3)
    qo, ko = torch.ops.fusekit.rope(q, k, cos, sin)
    assert qo.dtype == dtype and ko.dtype == dtype
    assert same_layout(qo, q) and same_layout(ko, k)  # laid out as the inputs
    want_q, want_k = reference(q.detach(), k.detach(), cos, sin, dtype)
    torch.testing.assert_close(qo, want_q, **TOL[dtype])
    torch.testing.assert_close(ko, want_k, **TOL[dtype])
    if dtype != torch.float32 and not f32_tables:
        # one rounding: never further from the f32 expression than HF's own expression in the dtype
        exact_q = hf_apply_rotary_pos_emb(q.detach().float(), k.detach().float(), cos.float(), sin.float())[0]
        native_q = hf_apply_rotary_pos_emb(q.detach(), k.detach(), cos, sin)[0]
        assert (qo.float() - exact_q).abs().max() <= (native_q.float() - exact_q).abs().max() + 1e-6
    # gradients from incoming gradients of other layouts (transposed, and a plain one)
    gq = rand((B, T, Hq, D), dtype, device, 4).transpose(1, 2)
    gk = rand((B, Hk, T, D), dtype, device, 5)
    dq, dk = torch.autograd.grad((qo, ko), (q, k), (gq, gk))
    qf, kf = q.detach().float().requires_grad_(), k.detach().float().requires_grad_()
    wq, wk = hf_apply_rotary_pos_emb(qf, kf, cos.float(), sin.float())
    want_dq, want_dk = torch.autograd.grad((wq, wk), (qf, kf), (gq.float(), gk.float()))
    assert dq.dtype == dtype and same_layout(dq, q) and same_layout(dk, k)
    torch.testing.assert_close(dq, want_dq.to(dtype), **TOL[dtype])
    torch.testing.assert_close(dk, want_dk.to(dtype), **TOL[dtype])


def test_hf_layout_round_trips_without_copies(device):
    """HF: q_proj(x).view(B, T, H, D).transpose(1, 2) in, q_embed out: its transpose back is the
    [B, T, H * D] view o_proj's input needs, and the gradient comes back in the projection's layout."""
    B, T, H, D = 2, 9, 4, 16
    x = rand((B, T, H * D), torch.float32, device, 6, True)
    q = x.view(B, T, H, D).transpose(1, 2)
    cos, sin = tables(B, T, D, torch.float32, device)
    qo, _ = fusekit.apply_rotary_pos_emb(q, q, cos, sin)
    assert qo.transpose(1, 2).is_contiguous()
    dq_out = rand((B, H, T, D), torch.float32, device, 7)
    qo.backward(dq_out)
    xf = x.detach().clone().requires_grad_()
    qf = xf.view(B, T, H, D).transpose(1, 2)
    hf_apply_rotary_pos_emb(qf, qf, cos, sin)[0].backward(dq_out)
    torch.testing.assert_close(x.grad, xf.grad, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES)
def test_table_shapes(dtype, device):
    """cos, sin [T, D], [1, T, D] and [B, T, D] through the op; [1, T, D] through the wrapper too."""
    B, H, T, D = 3, 2, 5, 32
    q, k = qk(B, H, T, D, dtype, device, "bhtd", 8), qk(B, 1, T, D, dtype, device, "bthd", 9)
    cos, sin = tables(1, T, D, dtype, device, "random", 10)
    want = reference(q, k, cos, sin, dtype)
    for c, s in ((cos[0], sin[0]), (cos, sin), (cos.expand(B, T, D), sin.expand(B, T, D))):
        for got, w in zip(torch.ops.fusekit.rope(q, k, c, s), want):
            torch.testing.assert_close(got, w, **TOL[dtype])
    for got, w in zip(fusekit.apply_rotary_pos_emb(q, k, cos, sin), want):
        torch.testing.assert_close(got, w, **TOL[dtype])


def test_unsqueeze_dim_2_and_position_ids(device):
    """[B, T, H, D] layouts with unsqueeze_dim=2; position_ids accepted and ignored; an int in
    position_ids' place is transformers 5's unsqueeze_dim passed fifth."""
    B, T, H, D = 2, 6, 3, 8
    q = rand((B, T, H, D), torch.float32, device, 11)
    k = rand((B, T, 1, D), torch.float32, device, 12)
    cos, sin = tables(B, T, D, torch.float32, device, "random", 13)
    want = hf_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
    pos = torch.arange(T, device=device)[None].expand(B, T)
    for got in (fusekit.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2),
                fusekit.apply_rotary_pos_emb(q, k, cos, sin, pos, 2),
                fusekit.apply_rotary_pos_emb(q, k, cos, sin, 2),
                fusekit.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=-2)):
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, **TOL[torch.float32])
        assert got[0].is_contiguous()  # laid out as q
    q4 = rand((B, H, T, D), torch.float32, device, 14)
    got = fusekit.apply_rotary_pos_emb(q4, q4, cos, sin, position_ids=pos)
    torch.testing.assert_close(got[0], hf_apply_rotary_pos_emb(q4, q4, cos, sin)[0], **TOL[torch.float32])


def test_dtypes_follow_hf_outside_autocast(device):
    """HF's q * cos promotes: bf16 q with f32 tables gives f32 (and the same values)."""
    q, k = qk(2, 3, 4, 16, torch.bfloat16, device, "bthd", 15), qk(2, 1, 4, 16, torch.bfloat16, device, "bhtd", 16)
    for table_dtype in (torch.float32, torch.float16):
        cos, sin = tables(2, 4, 16, table_dtype, device)
        want = hf_apply_rotary_pos_emb(q, k, cos, sin)
        got = fusekit.apply_rotary_pos_emb(q, k, cos, sin)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype == torch.float32
            torch.testing.assert_close(g, w, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast(dtype, device):
    """Under autocast: q and k in autocast's dtype, f32 tables kept f32 (HF computes q * cos in f32
    there and hands SDPA an f32 q_embed that its autocast casts: the same values), f32 leaves get
    f32 gradients; a table of another 16-bit dtype follows q."""
    B, H, T, D = 2, 4, 7, 32
    x = rand((B, T, 24), torch.float32, device, 17, True)
    w = rand((H * D, 24), torch.float32, device, 18)
    cos, sin = tables(B, T, D, torch.float32, device)
    with torch.autocast(device, dtype=dtype):
        q = torch.nn.functional.linear(x, w).view(B, T, H, D).transpose(1, 2)
        assert q.dtype == dtype
        qo, ko = fusekit.apply_rotary_pos_emb(q, q, cos, sin)
        hq, _ = hf_apply_rotary_pos_emb(q, q, cos, sin)
        q32 = q.float()
        qo32, _ = torch.ops.fusekit.rope(q32, q32, cos, sin)  # an f32 q is cast, as by a matmul
    assert qo.dtype == dtype and hq.dtype == torch.float32 and qo32.dtype == dtype
    torch.testing.assert_close(qo, hq.to(dtype), rtol=0, atol=0) if device == "cpu" else \
        torch.testing.assert_close(qo, hq.to(dtype), **TOL[dtype])
    torch.testing.assert_close(qo32, qo, rtol=0, atol=0)
    qo.float().sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.float32 and bool(torch.isfinite(x.grad).all())
    other = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
    with torch.autocast(device, dtype=dtype):
        got, _ = torch.ops.fusekit.rope(q.detach(), q.detach(), cos.to(other), sin.to(other))
    assert got.dtype == dtype


def test_incoming_gradients_of_any_layout(device):
    """An expanded gradient (.sum()) and a non-contiguous slice of a larger one."""
    B, H, T, D = 2, 3, 5, 16
    q = qk(B, H, T, D, torch.float32, device, "bthd", 19, True)
    k = qk(B, 1, T, D, torch.float32, device, "bhtd", 20, True)
    cos, sin = tables(B, T, D, torch.float32, device)
    qo, ko = fusekit.apply_rotary_pos_emb(q, k, cos, sin)
    (qo.sum() + ko.sum()).backward()
    qf, kf = q.detach().requires_grad_(), k.detach().requires_grad_()
    wq, wk = hf_apply_rotary_pos_emb(qf, kf, cos, sin)
    (wq.sum() + wk.sum()).backward()
    torch.testing.assert_close(q.grad, qf.grad, **TOL[torch.float32])
    torch.testing.assert_close(k.grad, kf.grad, **TOL[torch.float32])
    big = rand((B, H, T, 2 * D), torch.float32, device, 21)
    gq = big[..., ::2]  # last stride 2: copied
    gk = rand((B, 1, T, D + 3), torch.float32, device, 22)[..., 1:D + 1]  # padded rows: read in place
    qo, ko = fusekit.apply_rotary_pos_emb(q, k, cos, sin)
    dq, dk = torch.autograd.grad((qo, ko), (q, k), (gq, gk))
    wq, wk = hf_apply_rotary_pos_emb(qf, kf, cos, sin)
    wdq, wdk = torch.autograd.grad((wq, wk), (qf, kf), (gq, gk))
    torch.testing.assert_close(dq, wdq, **TOL[torch.float32])
    torch.testing.assert_close(dk, wdk, **TOL[torch.float32])


def test_falls_back_to_the_expression(device):
    """What the kernel cannot take runs as HF's expression: tables that need a gradient, f64, a
    [T, D] table with unsqueeze_dim=1 (HF broadcasts it against the heads)."""
    B, H, T, D = 1, 2, 3, 8
    q, k = qk(B, H, T, D, torch.float32, device, "bhtd", 23, True), qk(B, H, T, D, torch.float32, device, "bhtd", 24)
    cos, sin = tables(B, T, D, torch.float32, device)
    cos.requires_grad_()
    qo, _ = fusekit.apply_rotary_pos_emb(q, k, cos, sin)
    qo.sum().backward()
    assert cos.grad is not None
    q64, c64, s64 = q.detach().double(), cos.detach().double(), sin.double()
    torch.testing.assert_close(fusekit.apply_rotary_pos_emb(q64, q64, c64, s64)[0],
                               hf_apply_rotary_pos_emb(q64, q64, c64, s64)[0])
    q2 = qk(1, T, T, D, torch.float32, device, "bhtd", 25)
    torch.testing.assert_close(fusekit.apply_rotary_pos_emb(q2, q2, cos[0].detach(), sin[0])[0],
                               hf_apply_rotary_pos_emb(q2, q2, cos[0].detach(), sin[0])[0])


def test_bad_input(device):
    q = rand((1, 2, 3, 8), torch.bfloat16, device, 26)
    cos, sin = tables(1, 3, 8, torch.bfloat16, device)
    with pytest.raises(fusekit.Error, match="rope_forward.*'q'.*even"):
        torch.ops.fusekit.rope(q[..., :7], q[..., :7], cos[..., :7], sin[..., :7])
    with pytest.raises(fusekit.Error, match="'cos'"):
        torch.ops.fusekit.rope(q, q, cos.half(), sin.half())
    with pytest.raises(fusekit.Error, match="'k'"):
        torch.ops.fusekit.rope(q, q.float(), cos, sin)
    with pytest.raises(fusekit.Error, match="'cos'.*no gradient"):
        torch.ops.fusekit.rope(q.float().requires_grad_(), q.float(), cos.float().requires_grad_(), sin.float())


def test_opcheck(device):
    q = qk(2, 3, 5, 16, torch.float32, device, "bthd", 27, True)
    k = qk(2, 1, 5, 16, torch.float32, device, "bhtd", 28, True)
    cos, sin = tables(2, 5, 16, torch.float32, device)
    torch.library.opcheck(ops.rope, (q, k, cos, sin))
    torch.library.opcheck(ops.rope, (q.detach().bfloat16(), k.detach().bfloat16(), cos, sin))
    torch.library.opcheck(ops.rope, (q.detach(), k.detach(), cos[0], sin[0]))
    dq = rand((2, 3, 5, 16), torch.float32, device, 29)
    torch.library.opcheck(ops.rope_backward, (dq, k.detach(), cos, sin, [0, 2, 1, 3], []))


def test_compiles_without_graph_breaks(device):
    B, H, T, D = 2, 4, 6, 16
    x = rand((B, T, H * D), torch.float32, device, 30, True)
    cos, sin = tables(B, T, D, torch.float32, device)

    def f(x, cos, sin):
        q = x.view(B, T, H, D).transpose(1, 2)
        k = q[:, :2]
        qo, ko = fusekit.apply_rotary_pos_emb(q, k, cos, sin)
        return qo.transpose(1, 2).reshape(B, T, H * D) * 2 + ko.sum()

    want = f(x, cos, sin)
    (gw,) = torch.autograd.grad(want.square().sum(), x)
    got = torch.compile(f, fullgraph=True)(x, cos, sin)
    (gg,) = torch.autograd.grad(got.square().sum(), x)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    torch.testing.assert_close(gg, gw, **TOL[torch.float32])


# ---- qkv_rope: the attention's projections and rope in one op --------------------------------

def qkv_expression(x, wq, wk, wv, cos, sin, d):
    """Hugging Face LLaMA attention's q, k, v: the projections viewed as [B, H, T, D], rope on q, k."""
    b, t = x.shape[:2]
    q, k, v = (torch.nn.functional.linear(x, w).view(b, t, -1, d).transpose(1, 2) for w in (wq, wk, wv))
    q, k = hf_apply_rotary_pos_emb(q, k, cos, sin)
    return q, k, v


QKV_SHAPES = [  # B, T, C, Hq, Hk, D, batch of the tables
    (1, 1, 8, 1, 1, 2, 1),
    (2, 7, 48, 3, 1, 16, 2),
    (3, 5, 64, 4, 2, 8, 1),
    (2, 33, 96, 6, 6, 16, 2),
]


@pytest.mark.parametrize("shape", QKV_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_qkv_rope_matches_the_expression(shape, dtype, device):
    """Outputs (values and Hugging Face's [B, T, H, D] memory) and the gradients of x, wq, wk, wv
    against autograd of the torch expression, on random incoming gradients."""
    B, T, C, Hq, Hk, D, tb = shape
    x = rand((B, T, C), dtype, device, 40, True)
    wq, wk, wv = (rand((h * D, C), dtype, device, 41 + i, True) for i, h in enumerate((Hq, Hk, Hk)))
    cos, sin = tables(tb, T, D, dtype, device)
    got = fusekit.functional.qkv_rope(x, wq, wk, wv, cos, sin, D)
    leaves = [t.detach().float().requires_grad_() for t in (x, wq, wk, wv)]
    want = qkv_expression(*leaves, cos.float(), sin.float(), D)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}[dtype]  # of the largest |value|

    def close(g, w, name):
        assert float((g.detach().float() - w.detach()).abs().max() / w.detach().abs().max().clamp_min(1.0)) < tol, name

    for name, g, w in zip("qkv", got, want):
        assert g.dtype == dtype and g.shape == w.shape
        assert g.transpose(1, 2).is_contiguous()  # [B, T, H, D] memory, as HF's view + transpose
        close(g, w, name)
    gouts = [rand(w.shape, dtype, device, 50 + i) for i, w in enumerate(want)]
    dgot = torch.autograd.grad(got, (x, wq, wk, wv), gouts)
    dwant = torch.autograd.grad(want, leaves, [g.float() for g in gouts])
    for name, g, w in zip(("x", "wq", "wk", "wv"), dgot, dwant):
        assert g.dtype == dtype, name
        close(g, w, "d" + name)


def test_qkv_rope_gradients_of_any_layout_and_unused_outputs(device):
    """Incoming gradients as SDPA or .sum() hand them (contiguous [B, H, T, D], expanded), and
    outputs that get none (k unused); frozen weights get none."""
    B, T, C, H, D = 2, 5, 32, 2, 8
    x = rand((B, T, C), torch.float32, device, 60, True)
    wq, wk, wv = (rand((H * D, C), torch.float32, device, 61 + i, True) for i in range(3))
    cos, sin = tables(B, T, D, torch.float32, device)
    q, k, v = fusekit.functional.qkv_rope(x, wq, wk, wv, cos, sin, D)
    gq = rand((B, H, T, D), torch.float32, device, 64)  # contiguous, not HF's layout
    dx, dwq, dwk, dwv = torch.autograd.grad((q * gq).sum() + v.sum(), (x, wq, wk, wv))
    leaves = [t.detach().requires_grad_() for t in (x, wq, wk, wv)]
    wq_, wk_, wv_ = qkv_expression(*leaves, cos, sin, D)
    want = torch.autograd.grad((wq_ * gq).sum() + wv_.sum(), leaves, allow_unused=True)
    for g, w in zip((dx, dwq, dwv), (want[0], want[1], want[3])):
        torch.testing.assert_close(g, w, **TOL[torch.float32])
    torch.testing.assert_close(dwk, torch.zeros_like(wk))  # k unused: a zero gradient, as autograd's mm gives
    wq.requires_grad_(False)
    wk.requires_grad_(False)
    wv.requires_grad_(False)
    q, _, _ = fusekit.functional.qkv_rope(x, wq, wk, wv, cos, sin, D)
    (dx2,) = torch.autograd.grad(q.sum(), (x,))
    (w2,) = torch.autograd.grad(qkv_expression(leaves[0], wq, wk, wv, cos, sin, D)[0].sum(), (leaves[0],))
    torch.testing.assert_close(dx2, w2, **TOL[torch.float32])


def test_qkv_rope_autocast_and_fallbacks(device):
    """Under bf16 autocast: f32 x and weights run in bf16, f32 tables stay f32, f32 leaves get f32
    gradients. Outside it, mixed dtypes, 16-bit x with f32 tables (HF promotes to f32) and tables
    that need a gradient run as the expression."""
    B, T, C, H, D = 2, 6, 32, 2, 8
    x = rand((B, T, C), torch.float32, device, 70, True)
    ws = [rand((H * D, C), torch.float32, device, 71 + i, True) for i in range(3)]
    cos, sin = tables(B, T, D, torch.float32, device)
    with torch.autocast(device, dtype=torch.bfloat16):
        got = fusekit.functional.qkv_rope(x, *ws, cos, sin, D)
        want = fusekit.functional.qkv_rope(x.bfloat16(), *(w.bfloat16() for w in ws), cos, sin, D)
    for g, w in zip(got, want):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    sum(t.float().sum() for t in got).backward()
    assert all(t.grad is not None and t.grad.dtype == torch.float32 for t in [x] + ws)
    xb = x.detach().bfloat16()
    q, _, _ = fusekit.functional.qkv_rope(xb, *(w.detach().bfloat16() for w in ws), cos, sin, D)
    assert q.dtype == torch.float32  # bf16 q times f32 cos: HF's expression promotes
    c = cos.clone().requires_grad_()
    q, _, _ = fusekit.functional.qkv_rope(x, *ws, c, sin, D)
    q.sum().backward()
    assert c.grad is not None


def test_qkv_rope_bad_input(device):
    x = rand((2, 3, 16), torch.float32, device, 80)
    w = rand((8, 16), torch.float32, device, 81)
    cos, sin = tables(2, 3, 4, torch.float32, device)
    with pytest.raises(fusekit.Error, match="qkv_rope.*'head_dim'.*even"):
        torch.ops.fusekit.qkv_rope(x, w, w, w, cos, sin, 3)
    with pytest.raises(fusekit.Error, match="qkv_rope.*'wk'"):
        torch.ops.fusekit.qkv_rope(x, w, w[:, :8], w, cos, sin, 4)
    with pytest.raises(fusekit.Error, match="qkv_rope.*'wv'"):
        torch.ops.fusekit.qkv_rope(x, w, w, w[:4], cos, sin, 4)
    with pytest.raises(fusekit.Error, match="qkv_rope.*'x'"):
        torch.ops.fusekit.qkv_rope(x[0], w, w, w, cos, sin, 4)


def test_qkv_rope_opcheck_and_compile(device):
    B, T, C, Hq, Hk, D = 2, 5, 32, 4, 2, 8
    x = rand((B, T, C), torch.float32, device, 90, True)
    wq = rand((Hq * D, C), torch.float32, device, 91, True)
    wk, wv = (rand((Hk * D, C), torch.float32, device, 92 + i, True) for i in range(2))
    cos, sin = tables(1, T, D, torch.float32, device)
    torch.library.opcheck(ops.qkv_rope, (x, wq, wk, wv, cos, sin, D))
    torch.library.opcheck(ops.qkv_rope, (x.detach().bfloat16(), wq.detach().bfloat16(), wk.detach().bfloat16(),
                                         wv.detach().bfloat16(), cos, sin, D))
    q, k, v = ops.qkv_rope(x.detach(), wq.detach(), wk.detach(), wv.detach(), cos, sin, D)
    torch.library.opcheck(ops.qkv_rope_backward, (q, k, v, x.detach(), wq.detach(), wk.detach(), wv.detach(),
                                                  cos, sin, True, True))

    def f(x, wq, wk, wv):
        q, k, v = fusekit.functional.qkv_rope(x, wq, wk, wv, cos, sin, D)
        return torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1),
                                                                v.repeat_interleave(2, 1), is_causal=True)

    want = f(x, wq, wk, wv)
    dwant = torch.autograd.grad(want.square().sum(), (x, wq, wk, wv))
    got = torch.compile(f, fullgraph=True)(x, wq, wk, wv)
    dgot = torch.autograd.grad(got.square().sum(), (x, wq, wk, wv))
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    for g, w in zip(dgot, dwant):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
