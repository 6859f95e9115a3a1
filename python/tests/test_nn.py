"""fusekit.nn: the drop-in modules against the torch modules they replace."""
import pytest

torch = pytest.importorskip("torch", reason="the module tests need PyTorch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import fusekit  # noqa: E402
import fusekit.nn as fnn  # noqa: E402
from helpers import assert_weight_grad_close  # noqa: E402


def _mlp(device):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1)).to(device)


def _saved_activation_bytes(model, x):
    """Bytes autograd keeps for the backward of model(x): distinct storages, parameters and x
    itself (the caller's) excluded (a ReLU's output and the next Linear's input are one tensor,
    counted once)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()} | {x.untyped_storage().data_ptr()}
    seen = set()
    total = 0

    def pack_hook(t):
        nonlocal total
        st = t.untyped_storage()
        if st.data_ptr() not in params and st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        model(x).sum()
    return total


def test_compress_swaps_layers_shares_parameters_and_keeps_the_forward(device):
    model = _mlp(device)
    x = torch.randn(32, 64, device=device)
    want = model(x)
    weights = [p.data_ptr() for p in model.parameters()]
    fnn.compress(model, bits=2)
    assert isinstance(model[0], fnn.CompressedLinear) and isinstance(model[1], fnn.CompressedReLU)
    assert [p.data_ptr() for p in model.parameters()] == weights
    torch.testing.assert_close(model(x), want)


def test_compressed_model_trains_and_saves_less(device):
    torch.manual_seed(1)
    x = torch.randn(512, 64, device=device)
    y = (x[:, :8].sum(1, keepdim=True) > 0).float()
    plain, small = _mlp(device), fnn.compress(_mlp(device), bits=2)
    full, packed = _saved_activation_bytes(plain, x), _saved_activation_bytes(small, x)
    # 143 KB against 1 MB: Linear inputs at 2 bits (the first, 64 wide, padded to one group of 256,
    # + f32 min/scale per row) and ReLU masks at 1 bit, against f32.
    assert packed * 6 < full, (packed, full)

    def train(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for _ in range(60):
            opt.zero_grad()
            loss = F.binary_cross_entropy_with_logits(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    base, comp = train(plain), train(small)  # the same initial weights (seed 0)
    print("loss first -> last: uncompressed", base[0], "->", base[-1], "; 2 bits", comp[0], "->", comp[-1])
    assert comp[-1] < 0.75 * comp[0], comp
    assert comp[-1] < base[-1] + 0.05, (comp[-1], base[-1])


@pytest.mark.parametrize("bits,group,cin", [(8, 32, 96), (2, 32, 96), (2, 256, 64), (4, 64, 100)])
def test_compressed_linear_gradients_approach_linear(bits, group, cin, device):
    torch.manual_seed(2)
    lin = nn.Linear(cin, 48).to(device)
    comp = fnn.CompressedLinear.from_linear(lin, bits=bits, group=group)
    x = torch.randn(40, cin, device=device, requires_grad=True)
    dy = torch.randn(40, 48, device=device)
    g_ref = torch.autograd.grad(lin(x), (x, lin.weight, lin.bias), dy)
    g = torch.autograd.grad(comp(x), (x, comp.weight, comp.bias), dy)
    torch.testing.assert_close(g[0], g_ref[0])  # dx = dy W: exact
    torch.testing.assert_close(g[2], g_ref[2])
    # dW is the gradient of the quantized input: dyᵀ x̂, x̂ = unpack(pack(x)); on a GPU the kernel
    # reads dy and x̂ rounded to bf16 (fp32 accumulation).
    xq = fusekit.unpack(fusekit.pack(x.detach(), bits=bits, group=group, stats_dtype=torch.float32))
    d = dy
    if device == "cuda":
        xq, d = xq.bfloat16().float(), dy.bfloat16().float()
    assert_weight_grad_close(g[1], d, xq, device)
    rel = (g[1] - g_ref[1]).norm() / g_ref[1].norm()  # and the quantization error itself is bounded
    assert rel < (0.02 if bits == 8 else 0.5), rel


def test_glu_feed_forward_from_llama_projections(device):
    torch.manual_seed(3)
    gate, up, down = nn.Linear(32, 48, bias=False), nn.Linear(32, 48, bias=False), nn.Linear(48, 32, bias=False)
    gate, up, down = gate.to(device), up.to(device), down.to(device)
    ff = fnn.GLUFeedForward.from_linears(gate, up, down)
    x = torch.randn(2, 5, 32, device=device)
    want = down(F.silu(gate(x)) * up(x))
    torch.testing.assert_close(ff(x), want, rtol=1e-4, atol=1e-4)
    g2, u2 = ff.to_linears()
    torch.testing.assert_close(g2.weight, gate.weight)
    torch.testing.assert_close(u2.weight, up.weight)
    ff(x).sum().backward()
    assert ff.w_gate_up.grad is not None and ff.w_gate_up.grad.shape == ff.w_gate_up.shape


def test_compiled_model_of_fusekit_modules_has_no_graph_break(device):
    torch.manual_seed(4)
    model = nn.Sequential(fnn.GLUFeedForward(16, 24), nn.Linear(16, 16), fnn.CompressedReLU()).to(device)
    x = torch.randn(6, 16, device=device)
    eager = model(x)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), eager)


@pytest.mark.parametrize("act", ["identity"])
def test_lora_linear_matches_peft_math_and_trains_only_the_adapter(act, device):
    torch.manual_seed(5)
    base = nn.Linear(24, 40).to(device)
    m = fnn.LoRALinear.from_linear(base, r=4, alpha=8)
    with torch.no_grad():
        m.lora_B.normal_()
    x = torch.randn(3, 7, 24, device=device, requires_grad=True)
    y = m(x)
    want = base(x) + (x @ m.lora_A.t() @ m.lora_B.t()) * 2.0
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, m.lora_A, m.lora_B, base.bias), dy)
    exp = torch.autograd.grad(want, (x, m.lora_A, m.lora_B, base.bias), dy)
    for g, e in zip(got, exp):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
    assert not base.weight.requires_grad


def test_w4_linear_is_within_the_quantization_of_the_weight(device):
    torch.manual_seed(6)
    dtype = torch.float16 if device == "cuda" else torch.float32
    lin = nn.Linear(256, 64).to(device=device, dtype=torch.float16)
    w4 = fnn.W4Linear.from_linear(lin, group_size=128)
    assert w4.packed.device.type == device
    x = torch.randn(5, 256, device=device, dtype=torch.float16)
    wt = w4.dequantized_weight()
    # Every weight within half a step of its 4-bit value; y is x w̃ᵀ + b.
    assert (wt.float() - lin.weight.float()).abs().max() <= lin.weight.float().abs().max() * 2 / 15 / 2 * 1.01
    want = x.float() @ wt.float().t() + lin.bias.float()
    torch.testing.assert_close(w4(x).float(), want, rtol=5e-3, atol=5e-3)
    del dtype


def _w4_through_the_registered_op(w4, x):
    """W4Linear's function spelled out on torch.ops.fusekit.qgemm, the op torch.compile records."""
    lead = x.shape[:-1]
    rows = x if w4.perm is None else x.index_select(-1, w4.perm)
    rows = rows.reshape(-1, w4.in_features).to(w4.scale.dtype)
    y = torch.ops.fusekit.qgemm(rows, w4.packed, w4.scale, w4.zero, w4.out_features, w4.in_features, w4.group)
    y = y.to(x.dtype)
    if w4.bias is not None:
        y = y + w4.bias.to(x.dtype)
    return y.reshape(*lead, w4.out_features)


@pytest.mark.parametrize("bias, perm", [(False, False), (True, True)], ids=["plain", "bias_act_order"])
@pytest.mark.parametrize("shape, x_dtype", [((5, 128), torch.float16), ((3, 1, 128), torch.float16),
                                            ((128,), torch.float16), ((2, 0, 128), torch.float16),
                                            ((4, 128), torch.float32), ((2, 3, 128), torch.bfloat16)], ids=str)
def test_w4_linear_eager_call_is_the_registered_op_s_result(device, shape, x_dtype, bias, perm):
    """The eager call (the op's implementation run directly, [..., K] straight to the kernel, no
    cast or reshape it does not need) gives exactly what the registered op gives, for every rank,
    an empty batch, x of another dtype than the layer's, a bias and an act-order permutation."""
    torch.manual_seed(8)
    lin = nn.Linear(128, 40, bias=bias).to(device=device, dtype=torch.float16)
    w4 = fnn.W4Linear.from_linear(lin, group_size=64)
    if perm:
        w4.perm = torch.randperm(128, device=device)
    x = torch.randn(shape, device=device).to(x_dtype)
    with torch.no_grad():
        assert fusekit.ops._registry._route("qgemm", (x.to(torch.float16), w4.packed, w4.scale, w4.zero, 40, 128, 64)) \
            == fusekit.ops._registry._PLAIN_CALL
        got = w4(x)
    want = _w4_through_the_registered_op(w4, x)
    assert got.shape == want.shape == (*shape[:-1], 40) and got.dtype == x_dtype
    assert torch.equal(got, want)
    xt = torch.randn(128, 6, device=device, dtype=torch.float16).t()  # not contiguous: copied for the kernel
    assert torch.equal(w4(xt), _w4_through_the_registered_op(w4, xt))


def test_w4_linear_compiles_without_graph_breaks(device):
    """torch.compile(fullgraph=True) traces W4Linear to the registered op and matches the eager call."""
    from torch.fx.experimental.proxy_tensor import make_fx
    torch.manual_seed(9)
    w4 = fnn.W4Linear.from_linear(nn.Linear(128, 40).to(device=device, dtype=torch.float16), group_size=64)
    x = torch.randn(3, 1, 128, device=device, dtype=torch.float16)
    with torch.no_grad():
        eager = w4(x)
        torch._dynamo.reset()
        assert torch.equal(torch.compile(w4, fullgraph=True, backend="aot_eager")(x), eager)
        assert torch._dynamo.explain(w4)(x).graph_break_count == 0
        graph = make_fx(w4)(x).graph
    assert "fusekit.qgemm.default" in {str(n.target) for n in graph.nodes if n.op == "call_function"}


def test_w4_linear_promises_constant_weights_only_when_its_buffers_are_unchanged(device, monkeypatch, tmp_path):
    """W4Linear passes qgemm's constant_weights only where no write can have reached its buffers
    since its previous call: not on the first call, after an in-place write (the version counter),
    after .to() or load_state_dict (new tensors), nor after unpickling; the result is the same."""
    import pickle
    torch.manual_seed(10)
    w4 = fnn.W4Linear.from_linear(nn.Linear(128, 40).to(device=device, dtype=torch.float16), group_size=64)
    x = torch.randn(2, 128, device=device, dtype=torch.float16)
    promises = []
    call = fusekit.ops.call
    monkeypatch.setattr(fusekit.ops, "call", lambda name, *a: promises.append(a[-1]) or call(name, *a))
    with torch.no_grad():
        first = w4(x)
        assert torch.equal(w4(x), first)
        w4(x)
        assert promises == [False, True, True]
        w4.scale.mul_(1.0)  # an in-place write: a new version
        w4(x)
        w4(x)
        w4.load_state_dict({k: v.clone() for k, v in w4.state_dict().items()})  # copies in place
        w4(x)
        w4.to(torch.float16)  # no conversion needed: the same tensors
        w4(x)
        assert promises[3:] == [False, True, False, True]
        w4.scale = w4.scale.clone()  # a new tensor, version 0 like the packed words'
        w4(x)
        assert promises[-1] is False
        loaded = pickle.loads(pickle.dumps(w4))
        promises.clear()
        loaded(x)
        loaded(x)
        assert promises == [False, True]
        assert torch.equal(loaded(x), first)
    torch.library.opcheck(torch.ops.fusekit.qgemm, (x, w4.packed, w4.scale, w4.zero, 40, 128, 64, True))


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@gpu
def test_cuda_graph_replay_of_fusekit_modules_matches_eager():
    torch.manual_seed(7)
    model = nn.Sequential(fnn.GLUFeedForward(64, 96), nn.Linear(64, 64), fnn.CompressedReLU()).to("cuda", torch.bfloat16)
    static_x = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(s):
        for _ in range(3):  # warm-up off the capture (allocator, cuBLAS handles)
            fusekit.softmax(model(static_x))
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(g):
        static_y = fusekit.softmax(model(static_x))
    for seed in range(3):
        x = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(seed))
        static_x.copy_(x)
        g.replay()
        with torch.no_grad():
            want = fusekit.softmax(model(x))
        torch.testing.assert_close(static_y, want)


@gpu
def test_compress_lowers_peak_gpu_memory_by_the_saved_activation_bytes():
    torch.manual_seed(8)
    width, batch = 1024, 4096

    def mlp():
        torch.manual_seed(8)
        layers = []
        for _ in range(4):
            layers += [nn.Linear(width, width), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(width, 1)).cuda()

    x = torch.randn(batch, width, device="cuda")

    def measure(model):
        """(bytes held between forward and backward, peak bytes of a training step), above the
        parameters and gradients."""
        model(x).sum().backward()  # warm-up: gradients allocated, cuBLAS workspace
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = model(x).sum()
        held = torch.cuda.memory_allocated() - base
        loss.backward()
        del loss
        torch.cuda.synchronize()
        return held, torch.cuda.max_memory_allocated() - base

    plain, small = mlp(), fnn.compress(mlp(), bits=2)
    full, packed = _saved_activation_bytes(plain, x), _saved_activation_bytes(small, x)
    (h_plain, p_plain), (h_small, p_small) = measure(plain), measure(small)
    print(f"saved for backward {full} -> {packed} bytes; held after forward {h_plain} -> {h_small}; "
          f"peak of a step {p_plain} -> {p_small}")
    # What the allocator holds between forward and backward is what the layers keep (plus the
    # [B, 1] output), in both models; the step's peak falls with it.
    for held, saved in ((h_plain, full), (h_small, packed)):
        assert saved <= held <= saved + (1 << 20), (held, saved)
    assert full > 8 * packed
    assert p_small < p_plain


@pytest.mark.parametrize("widths,acts", [((13, 64, 64, 16), ("relu", "relu", "identity")),
                                         ((32, 128, 1), ("relu", "sigmoid")), ((7, 16, 16, 16, 5), ("relu",) * 4)])
def test_fused_mlp_matches_the_sequential_it_replaces(widths, acts, device):
    torch.manual_seed(9)
    layers = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers += [nn.Linear(a, b), {"relu": nn.ReLU(), "sigmoid": nn.Sigmoid(), "identity": nn.Identity()}[acts[i]]]
    seq = nn.Sequential(*layers).to(device, torch.bfloat16)
    fused = fnn.FusedMLP.from_sequential(seq)
    x = torch.randn(37, widths[0], device=device, dtype=torch.bfloat16, requires_grad=True)
    y = fused(x)
    # The spec rounds each layer's output to bf16 where the per-layer run stores it: so does seq.
    want = seq(x)
    torch.testing.assert_close(y.float(), want.float(), rtol=2e-2, atol=2e-2)
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, fused.linears[0].weight, fused.linears[-1].bias), dy)
    exp = torch.autograd.grad(want, (x, seq[0].weight, seq[-2].bias), dy)  # seq[-2]: the last Linear
    for g, e in zip(got, exp):
        torch.testing.assert_close(g.float(), e.float(), rtol=5e-2, atol=5e-2 * 37 ** 0.5)
    with torch.no_grad():
        torch.testing.assert_close(fused(x).float(), y.float())


def test_fused_mlp_gives_weight_gradients_when_its_input_needs_none(device):
    """The first layer's input rarely requires grad; the weights' gradients are still recorded."""
    torch.manual_seed(10)
    seq = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 4)).to(device, torch.bfloat16)
    fused = fnn.FusedMLP.from_sequential(seq)
    x = torch.randn(9, 12, device=device, dtype=torch.bfloat16)
    y, want = fused(x), seq(x)
    assert y.requires_grad
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, (fused.linears[0].weight, fused.linears[-1].bias), dy)
    exp = torch.autograd.grad(want, (seq[0].weight, seq[-1].bias), dy)
    for g, e in zip(got, exp):
        torch.testing.assert_close(g.float(), e.float(), rtol=5e-2, atol=5e-2 * 9 ** 0.5)


def test_fused_mlp_refuses_what_it_cannot_fuse():
    with pytest.raises(fusekit.Error, match=r"argument 'seq'.*Tanh"):
        fnn.FusedMLP.from_sequential(nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 1)))
