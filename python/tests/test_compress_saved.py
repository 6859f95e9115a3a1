"""fusekit.compress_saved_tensors: what it packs and what it leaves, the round trip within the bound
of its bits (every floating dtype, any layout), one packed copy for a tensor saved twice, unbiased
and reproducible stochastic rounding, gradients of small models under it, and its errors."""
import copy

import pytest

torch = pytest.importorskip("torch", reason="the operator tests need PyTorch")

import fusekit  # noqa: E402
from fusekit.patch import patched_modules  # noqa: E402
from helpers import rand  # noqa: E402


class _Save(torch.autograd.Function):
    """y = x; saves `t` and hands what the backward reads to `seen`."""

    @staticmethod
    def forward(ctx, x, t, seen):
        ctx.save_for_backward(t)
        ctx.seen = seen
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        ctx.seen.append(ctx.saved_tensors[0])
        return g, None, None


def _activation(t):
    """t's values as an activation (the result of a differentiable op), in t's layout."""
    leaf = t.detach().clone().requires_grad_()
    return leaf * 1 if t.is_contiguous() else (leaf.t() * 1).t()


def _round_trip(t, device, **kw):
    """What the backward reads of `t` saved under the hook, and the hook's stats."""
    x = torch.zeros(1, device=device, requires_grad=True)
    seen = []
    with fusekit.compress_saved_tensors(**kw) as c:
        y = _Save.apply(x, t, seen)
    y.sum().backward()
    return seen[0], c.stats


def _groups(t):
    flat = t.detach().float().contiguous().view(-1)
    return flat.view(-1, 256) if flat.numel() % 256 == 0 else flat.view(1, -1)


def _step(t, bits):
    """Each group's quantization step, broadcast to t's memory-order groups of 256."""
    g = _groups(t)
    return ((g.amax(1, keepdim=True) - g.amin(1, keepdim=True)) / (2 ** bits - 1)).expand_as(g).reshape(-1)


def _stats_rounding(t):
    """What bf16 scale and minimum add to a value's error: one bf16 rounding of the minimum and of
    q * scale (at most the group's range)."""
    g = _groups(t)
    lo, hi = g.amin(1, keepdim=True), g.amax(1, keepdim=True)
    return (2 ** -8 * (lo.abs() + (hi - lo))).expand_as(g).reshape(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "odd"])
def test_round_trip_within_the_bound_of_its_bits(dtype, bits, layout, device):
    shape = (37, 29) if layout == "odd" else (64, 512)
    t = rand(shape, dtype, device, 3) * 3
    if layout == "transposed":
        t = t.t()  # [512, 64] with strides (1, 512): packed in memory order, given back with them
    t = _activation(t)
    assert t.grad_fn is not None and (layout != "transposed" or not t.is_contiguous())
    got, stats = _round_trip(t, device, bits=bits, min_bytes=0, rounding="nearest")
    assert got is not t and got.shape == t.shape and got.stride() == t.stride() and got.dtype == t.dtype
    assert stats["tensors"] == 1 and stats["packed_bytes"] < stats["bytes"]
    # memory order: the transposed view's storage is the original [64, 512] tensor's
    mem = (lambda u: u.t()) if layout == "transposed" else (lambda u: u)
    err = (mem(got).float().contiguous().view(-1) - mem(t).float().contiguous().view(-1)).abs()
    step = _step(mem(t), bits)
    rounding = torch.finfo(dtype).eps * mem(t).float().abs().contiguous().view(-1) + _stats_rounding(mem(t))
    assert bool((err <= 0.5 * step + rounding + 1e-6).all()), float((err - 0.5 * step - rounding).max())


def test_compression_ratio_at_4_and_2_bits(device):
    for bits, least in ((4, 3.5), (2, 6.0)):
        _, stats = _round_trip(_activation(rand((256, 1024), torch.bfloat16, device, 4)), device, bits=bits, min_bytes=0)
        assert stats["bytes"] / stats["packed_bytes"] >= least, stats
        assert stats["bytes_by_bits"] == {bits: [stats["bytes"], stats["packed_bytes"]]}


def test_leaves_parameters_small_integer_f64_and_non_differentiable_tensors(device):
    w = torch.nn.Parameter(rand((256, 256), torch.float32, device, 5))
    lse_like = rand((4, 8, 1024), torch.float32, device, 12)  # a statistic saved beside an output: no grad_fn
    for t in (w, w.t(), _activation(w.detach().to(torch.float64)), torch.arange(100000, device=device),
              _activation(rand((4, 4), torch.float32, device, 6)), lse_like):
        got, stats = _round_trip(t, device, bits=4, min_bytes=1024)
        assert got is t or (got.data_ptr() == t.data_ptr() and got.shape == t.shape), type(t)
        assert stats["tensors"] == 0 and stats["passed"] >= 1


def test_autocast_copy_of_a_weight_is_left(device):
    """Under autocast a linear saves its bf16 copy of the f32 weight: a weight, not an activation."""
    lin = torch.nn.Linear(256, 256).to(device)
    x = rand((512, 256), torch.float32, device, 7, True)
    with fusekit.compress_saved_tensors(bits=4, min_bytes=0) as c, torch.autocast(device, torch.bfloat16):
        y = lin(x)
    assert c.stats["tensors"] == 1, c.stats  # x's bf16 copy; the weight's copy passed
    y.float().sum().backward()
    assert lin.weight.grad is not None


def test_a_tensor_saved_twice_is_packed_once(device):
    x = torch.zeros(1, device=device, requires_grad=True)
    t = _activation(rand((64, 256), torch.float32, device, 8))
    seen = []
    with fusekit.compress_saved_tensors(bits=4, min_bytes=0) as c:
        y = _Save.apply(_Save.apply(x, t, seen), t, seen)
    assert c.stats["tensors"] == 1
    y.sum().backward()
    assert len(seen) == 2 and torch.equal(seen[0], seen[1])


def test_views_of_one_region_are_packed_once(device):
    """Three linears reading one [B, S, D] activation each save their own 2-D view of it, and a
    transposed view covers the same memory: one packed copy, each view given back as itself."""
    x = torch.zeros(1, device=device, requires_grad=True)
    t = _activation(rand((4, 64, 256), torch.float32, device, 13))
    views = (t.view(256, 256), t.reshape(256, 256), t.transpose(1, 2), t)
    seen = []
    with fusekit.compress_saved_tensors(bits=8, min_bytes=0, rounding="nearest") as c:
        y = x
        for v in views:
            y = _Save.apply(y, v, seen)
    assert c.stats["tensors"] == 1, c.stats
    y.sum().backward()
    seen.reverse()  # the backward runs the saves in reverse
    base = seen[-1]
    for v, got in zip(views, seen):
        assert got.shape == v.shape and got.stride() == v.stride()
        assert torch.equal(got, base.as_strided(v.shape, v.stride(), 0))
    assert float((base - t.detach()).abs().max()) <= float(_step(t, 8).max()) * 0.5 + 1e-5


def test_a_weight_stacked_from_parameters_is_left(device):
    """fusekit's GLU interleaves gate_proj's and up_proj's weights into one: still a weight."""
    gate, up = (torch.nn.Parameter(rand((128, 64), torch.float32, device, s)) for s in (14, 15))
    w = torch.stack((gate, up), dim=1).reshape(256, 64)
    assert w.grad_fn is not None
    got, stats = _round_trip(w, device, bits=4, min_bytes=0)
    assert got.data_ptr() == w.data_ptr() and stats["tensors"] == 0 and stats["passed"] == 1
    mixed = torch.cat((gate, _activation(rand((128, 64), torch.float32, device, 16))))
    _, stats = _round_trip(mixed, device, bits=4, min_bytes=0)
    assert stats["tensors"] == 1  # an activation concatenated to a weight is an activation


def test_the_fused_heads_saved_gradients_are_left(device):
    """linear_cross_entropy computes its gradients in the forward and saves them: not activations."""
    h = rand((64, 128), torch.float32, device, 17, True)
    w = torch.nn.Parameter(rand((300, 128), torch.float32, device, 18))
    t = torch.randint(0, 300, (64,), device=device)
    with fusekit.compress_saved_tensors(bits=2, min_bytes=0) as c:
        loss = fusekit.functional.linear_cross_entropy(h * 1, w, t)
    loss.backward()
    ref_h, ref_w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    torch.nn.functional.cross_entropy(ref_h @ ref_w.t(), t).backward()
    assert c.stats["by_bits"].get(2, 0) <= 1, c.stats  # at most h's copy, never the gradients
    torch.testing.assert_close(w.grad, ref_w.grad, rtol=1e-3, atol=1e-5)
    torch.testing.assert_close(h.grad, ref_h.grad, rtol=1e-3, atol=1e-5)


def test_stochastic_rounding_is_unbiased_and_reproducible(device):
    base = rand((8, 256), torch.float32, device, 9)
    t = base  # the values; each round trip saves a fresh activation holding them

    def draw(seed):
        return _round_trip(_activation(base), device, bits=2, min_bytes=0, seed=seed)[0]
    draws = torch.stack([draw(s) for s in range(200)])
    step = _step(t, 2).view(t.shape)
    # the mean of 200 draws is within 4 standard errors (a draw's deviation is at most one step)
    assert bool(((draws.mean(0) - t).abs() <= 4 * step / 200 ** 0.5 + 1e-6).all())
    assert torch.equal(draw(11), draw(11))
    assert not torch.equal(draw(11), draw(12))


def test_gradients_at_8_bits_match_uncompressed(device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256),
                                torch.nn.LayerNorm(256), torch.nn.Linear(256, 64)).to(device)
    ref = copy.deepcopy(model)
    x = rand((128, 256), torch.float32, device, 10)
    with fusekit.compress_saved_tensors(bits=8, min_bytes=0) as c:
        loss = model(x).square().mean()
    assert c.stats["tensors"] >= 3, c.stats
    loss.backward()
    ref(x).square().mean().backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        err = float((p.grad - q.grad).norm() / q.grad.norm())
        assert err < 2e-2, (n, err)


def _tiny_llama_config(transformers):
    return transformers.LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                    attn_implementation="sdpa", use_cache=False)


def test_hugging_face_llama_trains_under_the_hook_and_sum_backward(device):
    """An unmodified model: model(x).logits.sum().backward() (an expanded incoming gradient) and
    the loss's gradients near the uncompressed ones at 8 bits."""
    transformers = pytest.importorskip("transformers")
    cfg = _tiny_llama_config(transformers)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(device)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 101, (4, 32), device=device)
    with fusekit.compress_saved_tensors(bits=8, min_bytes=4096) as c:
        model(ids).logits.sum().backward()
    assert c.stats["tensors"] > 0, c.stats
    model.zero_grad()
    with fusekit.compress_saved_tensors(bits=8, min_bytes=4096):
        loss = model(ids, labels=ids).loss
    loss.backward()
    ref(ids, labels=ids).loss.backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        err = float((p.grad - q.grad).norm() / q.grad.norm().clamp_min(1e-12))
        assert err < 5e-2, (n, err)


def test_patched_llama_under_the_hook(device):
    transformers = pytest.importorskip("transformers")
    cfg = _tiny_llama_config(transformers)
    torch.manual_seed(0)
    model = fusekit.patch(transformers.LlamaForCausalLM(cfg).to(device))
    ids = torch.randint(0, 101, (4, 32), device=device)
    with fusekit.compress_saved_tensors(bits=4, min_bytes=4096) as c:
        loss = model(ids, labels=ids).loss
    loss.backward()
    assert c.stats["tensors"] > 0 and torch.isfinite(loss)
    assert all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in model.parameters())


@pytest.mark.parametrize("attention_bits", [8, None])
def test_patched_layers_pack_the_attention_at_its_bits(attention_bits, device):
    """A patched decoder layer packs its attention's saved tensors at attention_bits (8 by default)
    and the rest at bits; the unpatched model packs everything at bits."""
    transformers = pytest.importorskip("transformers")
    cfg = _tiny_llama_config(transformers)
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg).to(device)
    model = fusekit.patch(copy.deepcopy(ref))
    ids = torch.randint(0, 101, (4, 32), device=device)
    for m, patched in ((model, True), (ref, False)):
        with fusekit.compress_saved_tensors(bits=4, min_bytes=4096, attention_bits=attention_bits) as c:
            loss = m(ids, labels=ids).loss
        loss.backward()
        want = {4, 8} if patched and attention_bits == 8 else {4}
        assert set(c.stats["by_bits"]) == want, (patched, c.stats)
    assert fusekit.compress.active() is None


def test_bad_arguments_name_themselves():
    for kw, arg in (({"bits": 3}, "bits"), ({"bits": 4, "group": 100}, "group"), ({"rounding": "up"}, "rounding"),
                    ({"min_bytes": -1}, "min_bytes"), ({"attention_bits": 6}, "attention_bits")):
        with pytest.raises(ValueError, match=f"compress_saved_tensors: argument '{arg}'"):
            fusekit.compress_saved_tensors(**kw)


@pytest.mark.parametrize("autocast", [False, True])
def test_fused_projections_match_the_hook(device, autocast, monkeypatch):
    """A patched decoder layer's q, k, v and o projections and its MLP's gate and up projections
    keep their input packed and take their weight gradient from it (weight_grad_from_packed): the
    same packed values as the hook alone (same seed, same order), so the same loss and gradients up
    to the GEMMs' accumulation order."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=101, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   attn_implementation="sdpa", use_cache=False)  # K a multiple of the group
    torch.manual_seed(0)
    model = fusekit.patch(transformers.LlamaForCausalLM(cfg).to(device))
    assert list(patched_modules(model).values()).count("projection") == 4 * cfg.num_hidden_layers
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 101, (4, 32), device=device)
    if device == "cuda" and not autocast:
        pytest.skip("on a GPU the fused path takes bf16 GEMMs (autocast)")

    def run(m):
        with torch.autocast(device, torch.bfloat16, enabled=autocast):
            with fusekit.compress_saved_tensors(bits=8, min_bytes=0, seed=3) as c:
                loss = m(ids, labels=ids).loss
        loss.backward()
        return loss, c.stats

    fused, mlps = [], []
    with monkeypatch.context() as mp:
        apply, mlp_apply = fusekit.compress._PackedLinear.apply, fusekit.compress._PackedGluMlp.apply
        mp.setattr(fusekit.compress._PackedLinear, "apply", lambda *a: fused.append(1) or apply(*a))
        mp.setattr(fusekit.compress._PackedGluMlp, "apply", lambda *a: mlps.append(1) or mlp_apply(*a))
        loss, stats = run(model)
    assert len(fused) == 4 * cfg.num_hidden_layers  # every projection took the fused path
    assert len(mlps) == cfg.num_hidden_layers  # and every MLP (gate and up's weight gradient)
    with monkeypatch.context() as mp:
        mp.setattr(fusekit.compress, "linear", torch.nn.functional.linear)
        mp.setattr(fusekit.compress, "gated_mlp", lambda *a: None)
        ref_loss, ref_stats = run(ref)
    assert stats["tensors"] == ref_stats["tensors"] and stats["packed_bytes"] == ref_stats["packed_bytes"]
    assert float(loss.detach()) == float(ref_loss.detach())
    tol = 2e-2 if autocast else 1e-5
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        err = float((p.grad - q.grad).norm() / q.grad.norm().clamp_min(1e-12))
        assert err < tol, (n, err)
    fusekit.unpatch(model)
    assert patched_modules(model) == {}


def test_compress_linear_outside_a_block_is_f_linear(device):
    x = rand((64, 256), torch.float32, device, 19, True)
    w = torch.nn.Parameter(rand((32, 256), torch.float32, device, 20))
    torch.testing.assert_close(fusekit.compress.linear(x, w), torch.nn.functional.linear(x, w))


def test_the_allocator_sees_the_saving(device):
    """What the stats say the hook saved is what the CUDA allocator holds less after the forward."""
    if device != "cuda":
        pytest.skip("the CUDA caching allocator's counters")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(1024, 1024), torch.nn.GELU())]).cuda()
    x = torch.randn(8192, 1024, device="cuda", requires_grad=True)

    def held(hook):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with hook as c:
            y = model(x)
        torch.cuda.synchronize()
        kept = torch.cuda.memory_allocated() - before - y.numel() * y.element_size()
        y.sum().backward()
        return kept, getattr(c, "stats", None)

    import contextlib
    plain, _ = held(contextlib.nullcontext())
    packed, stats = held(fusekit.compress_saved_tensors(bits=4))
    saved = stats["bytes"] - stats["packed_bytes"]
    assert stats["tensors"] >= 7 and abs((plain - packed) - saved) <= 0.02 * saved, (plain, packed, stats)
