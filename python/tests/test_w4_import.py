"""4-bit GPTQ and AWQ checkpoints into fusekit.nn.W4Linear, and fusekit.quantize / load_quantized on a
model: the checkpoints written by quant_formats.py (no download), read back by a plain per-element
dequantization written here, and W4Linear(x) checked against x w̃ᵀ + b on that weight."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the module tests need PyTorch")
from torch import nn  # noqa: E402

import fusekit  # noqa: E402
import fusekit.nn as fnn  # noqa: E402
from quant_formats import to_awq, to_gptq  # noqa: E402

# Where column j of a group of 8 sits in an AWQ word (the inverse of the writer's order).
AWQ_NIBBLE_OF_COLUMN = (0, 4, 1, 5, 2, 6, 3, 7)


def plain_dequant_gptq(t, checkpoint_format="gptq"):
    """w̃ [N, K] f64 from a GPTQ layer's tensors, one element at a time."""
    qweight, qzeros, scales, g_idx = (t[key].tolist() for key in ("qweight", "qzeros", "scales", "g_idx"))
    k, n = 8 * len(qweight), len(qweight[0])
    w = torch.empty(n, k, dtype=torch.float64)
    for c in range(k):
        g = g_idx[c]
        for r in range(n):
            q = (qweight[c // 8][r] >> (4 * (c % 8))) & 0xF
            z = (qzeros[g][r // 8] >> (4 * (r % 8))) & 0xF
            if checkpoint_format == "gptq":
                z += 1
            w[r, c] = scales[g][r] * (q - z)
    return w


def plain_dequant_awq(t):
    """w̃ [N, K] f64 from an AWQ layer's tensors, one element at a time."""
    qweight, qzeros, scales = (t[key].tolist() for key in ("qweight", "qzeros", "scales"))
    k, n = len(qweight), 8 * len(qweight[0])
    group = k // len(scales)
    w = torch.empty(n, k, dtype=torch.float64)
    for c in range(k):
        g = c // group
        for r in range(n):
            shift = 4 * AWQ_NIBBLE_OF_COLUMN[r % 8]
            q = (qweight[c][r // 8] >> shift) & 0xF
            z = (qzeros[g][r // 8] >> shift) & 0xF
            w[r, c] = scales[g][r] * (q - z)
    return w


# (writer, its options, the plain dequantization): GPTQ as AutoGPTQ saves it (v1, symmetric, with
# and without act-order), GPTQModel's v2 (asymmetric, act-order), AWQ's GEMM version.
FORMATS = {
    "gptq": (to_gptq, dict(), dict(checkpoint_format="gptq")),
    "gptq_act_order": (to_gptq, dict(act_order=True), dict(checkpoint_format="gptq")),
    "gptq_asym_act_order": (to_gptq, dict(act_order=True, sym=False), dict(checkpoint_format="gptq")),
    "gptq_v2_asym_act_order": (to_gptq, dict(act_order=True, sym=False, checkpoint_format="gptq_v2"),
                               dict(checkpoint_format="gptq_v2")),
    "awq": (to_awq, dict(), dict()),
}


def write(fmt, w, group, bias=None):
    writer, opts, _ = FORMATS[fmt]
    return writer(w, group, bias=bias, **opts)


def plain_dequant(fmt, t):
    return plain_dequant_awq(t) if fmt == "awq" else plain_dequant_gptq(t, FORMATS[fmt][2]["checkpoint_format"])


def load(fmt, t, **kwargs):
    if fmt == "awq":
        return fnn.W4Linear.from_awq(t["qweight"], t["qzeros"], t["scales"], t.get("bias"), **kwargs)
    return fnn.W4Linear.from_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], t.get("bias"),
                                  **FORMATS[fmt][2], **kwargs)


def weight(n, k, seed):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_writers_store_what_they_claim(fmt):
    """The writer's tensors, read one bit field at a time, give back its own q, z and s."""
    t, truth = write(fmt, weight(24, 96, 1), 32)
    assert torch.equal(plain_dequant(fmt, t), truth.weight())
    if fmt.startswith("gptq"):
        assert t["qweight"].dtype == torch.int32 and t["qweight"].shape == (96 // 8, 24)
        assert t["g_idx"].dtype == torch.int32 and t["g_idx"].shape == (96,)
        assert torch.bincount(t["g_idx"].long()).tolist() == [32, 32, 32]
        monotone = bool((t["g_idx"][1:] >= t["g_idx"][:-1]).all())
        assert monotone == ("act_order" not in fmt)
    else:
        assert t["qweight"].dtype == torch.int32 and t["qweight"].shape == (96, 24 // 8)
    assert t["qzeros"].shape == (3, 24 // 8) and t["scales"].dtype == torch.float16 and t["scales"].shape == (3, 24)


def test_word_layouts_by_hand():
    """Values 0..7 along one word: GPTQ packs along K, lowest bits first; AWQ along N in the order
    0, 2, 4, 6, 1, 3, 5, 7 (so the word reads 0x75316420)."""
    from quant_formats import AWQ_ORDER, _pack_cols, _pack_rows
    v = np.arange(8)
    assert _pack_rows(v[:, None])[0, 0] == 0x76543210
    assert _pack_cols(v[None, :], AWQ_ORDER)[0, 0] == 0x75316420


def _bound(x, w, bias, out_dtype, k):
    """Per element: x rounded to f16 (a no-op from bf16), w̃ rounded to f16 (the CPU spec; the CUDA
    small-M kernel skips it) and y rounded to f16, u16 = 2^-11 each relative to Σ|x||w|; fp32
    accumulation on CUDA, K 2^-24; y rounded to x's dtype and the bias added in it, u_out each."""
    u16, u_out = 2.0 ** -11, torch.finfo(out_dtype).eps / 2
    ax = x.abs() @ w.abs().t()
    return (3 * u16 + k * 2.0 ** -24 + 2 * u_out) * ax + 2 * u_out * bias.abs() + 1e-30


SHAPES = {32: (40, 96), 64: (72, 192), 128: (40, 384), -1: (40, 40)}  # (N, K): N 8·odd, K odd counts of groups


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("group", [32, 64, 128, -1])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_import_matches_dequantize_then_matmul(fmt, group, x_dtype, device):
    n, k = SHAPES[group]
    bias = torch.randn(n, generator=torch.Generator().manual_seed(3))
    t, _ = write(fmt, weight(n, k, 2), group, bias=bias)
    w = plain_dequant(fmt, t)
    w4 = load(fmt, t, device=device)
    assert w4.packed.device.type == device and w4.scale.dtype == torch.float16
    # One group per row leaves act-order nothing to reorder: g_idx is all 0.
    assert (w4.perm is not None) == ("act_order" in fmt and group != -1)
    # The layer holds the checkpoint's weight exactly: s (q − z) is exact in f32, rounded once to f16.
    assert torch.equal(w4.dequantized_weight().cpu(), w.to(torch.float16))
    for shape in [(1, k), (5, k), (2, 3, k), (33, k)]:  # on CUDA: the small-M kernel, then the tiled one
        x = torch.randn(shape, generator=torch.Generator().manual_seed(4)).to(x_dtype)
        y = w4(x.to(device))
        assert y.dtype == x_dtype and y.shape == (*shape[:-1], n)
        want = x.double() @ w.t() + t["bias"].double()
        err = (y.cpu().double() - want).abs()
        bound = _bound(x.double().reshape(-1, k), w, t["bias"].double(), x_dtype, k).reshape(want.shape)
        assert bool((err <= bound).all()), (err / bound).max()


def test_import_in_bf16_rounds_the_scales(device):
    t, truth = to_gptq(weight(40, 96, 5), 32, act_order=True)
    w4 = fnn.W4Linear.from_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], dtype=torch.bfloat16,
                                device=device)
    assert w4.scale.dtype == torch.bfloat16
    s = torch.from_numpy(truth.scale).to(torch.bfloat16).double()[:, truth.g_idx]
    want = (s * torch.from_numpy(truth.q - truth.zero[:, truth.g_idx]).double()).to(torch.bfloat16)
    assert torch.equal(w4.dequantized_weight().cpu(), want)
    # The matmul is against s (q − z) with s rounded to bf16: the CUDA kernel scales Σ x (q − z) in
    # fp32, the CPU spec rounds w̃ to bf16 (2^-9 relative); then y rounded to bf16 (2^-9).
    exact = s * torch.from_numpy(truth.q - truth.zero[:, truth.g_idx]).double()
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(6), dtype=torch.float32).to(torch.bfloat16)
    y = w4(x.to(device)).cpu().double()
    bound = (2 * 2.0 ** -9 + 96 * 2.0 ** -24) * (x.double().abs() @ exact.abs().t()) + 1e-30
    assert bool(((y - x.double() @ exact.t()).abs() <= bound).all())


def _v1_with_zero_16(q0):
    """A v1 layer [8, 32] in one group whose output 3 stores zero point nibble 15 (read as 16); its
    values are all 1 except input 5 of output 3, q0."""
    q = np.ones((32, 8), dtype=np.uint32)
    q[5, 3] = q0
    qweight = np.zeros((4, 8), dtype=np.uint32)
    for i in range(8):
        qweight |= q[i::8] << np.uint32(4 * i)
    qzeros = np.array([[0x7777F777]], dtype=np.uint32)  # nibble 3 = 15; the others 7 (zero point 8)
    return dict(qweight=torch.from_numpy(qweight.view(np.int32)), qzeros=torch.from_numpy(qzeros.view(np.int32)),
                scales=torch.full((1, 8), 0.5, dtype=torch.float16), g_idx=torch.zeros(32, dtype=torch.int32))


def test_gptq_v1_zero_point_16():
    """v1 stores a zero point of 0 as 15, which AutoGPTQ's kernels read as 16: held exactly where the
    group's values are all >= 1, refused by name where one is 0."""
    t = _v1_with_zero_16(q0=2)
    w4 = fnn.W4Linear.from_gptq(**t)
    assert torch.equal(w4.dequantized_weight().double(), plain_dequant_gptq(t))
    assert w4.dequantized_weight()[3, 5] == 0.5 * (2 - 16)
    with pytest.raises(fusekit.Error, match="argument 'qzeros'.*zero point 16 with a value 0 at output 3, input 5"):
        fnn.W4Linear.from_gptq(**_v1_with_zero_16(q0=0))
    # v2 reads the same nibble as 15: no wrap, loaded as stored.
    t2 = _v1_with_zero_16(q0=0)
    w4 = fnn.W4Linear.from_gptq(**t2, checkpoint_format="gptq_v2")
    assert torch.equal(w4.dequantized_weight().double(), plain_dequant_gptq(t2, "gptq_v2"))


def _bad(t, **changes):
    return {**t, **changes}


GPTQ_BAD = [
    (lambda t: _bad(t, qweight=t["qweight"].float()), "'qweight': expected an int32 tensor"),
    (lambda t: _bad(t, qweight=t["qweight"][:, :-8]), "'qzeros': expected \\[groups, N / 8 = 4\\]"),
    (lambda t: _bad(t, qzeros=t["qzeros"][:, :-1]), "'qzeros': expected \\[groups, N / 8 = 5\\]"),
    (lambda t: _bad(t, scales=t["scales"].t()), "'scales': expected shape \\[3, 40\\]"),
    (lambda t: _bad(t, scales=t["scales"].to(torch.int32)), "'scales': expected an f16, bf16 or f32 tensor"),
    (lambda t: _bad(t, g_idx=t["g_idx"][:-8]), "'g_idx': expected \\[K = 96\\]"),
    (lambda t: _bad(t, g_idx=t["g_idx"].float()), "'g_idx': expected an int32 or int64 vector"),
    (lambda t: _bad(t, g_idx=torch.arange(96, dtype=torch.int32) // 40), "'g_idx': expected every group holding"),
    (lambda t: _bad(t, g_idx=t["g_idx"] + 1), "'g_idx': expected group indices in \\[0, 3\\)"),
    (lambda t: _bad(t, scales=t["scales"][:2], qzeros=t["qzeros"][:2]), "'g_idx': expected group indices"),
    (lambda t: _bad(t, bias=torch.zeros(39)), "'bias': expected None or a vector \\[N = 40\\]"),
    (lambda t: _bad(t, bits=8), "'bits': expected 4"),
    (lambda t: _bad(t, checkpoint_format="gptq_v3"), "'checkpoint_format': expected 'gptq'"),
    (lambda t: _bad(t, dtype=torch.float32), "'dtype': expected torch.float16 or torch.bfloat16"),
]


@pytest.mark.parametrize("case", range(len(GPTQ_BAD)))
def test_gptq_bad_inputs_name_the_argument(case):
    t, _ = to_gptq(weight(40, 96, 7), 32, act_order=True)
    change, message = GPTQ_BAD[case]
    with pytest.raises(fusekit.Error, match="fk::W4Linear.from_gptq: argument " + message):
        fnn.W4Linear.from_gptq(**change(t))


AWQ_BAD = [
    (lambda t: _bad(t, qweight=t["qweight"].to(torch.int64)), "'qweight': expected an int32 tensor"),
    (lambda t: _bad(t, qzeros=t["qzeros"][:, :-1]), "'qzeros': expected \\[groups, N / 8 = 5\\]"),
    (lambda t: _bad(t, scales=t["scales"][:, :-8]), "'scales': expected shape \\[3, 40\\]"),
    (lambda t: _bad(t, qweight=t["qweight"][:-8]), "'scales': expected a number of groups that divides K = 88"),
    (lambda t: _bad(t, bits=3), "'bits': expected 4"),
]


@pytest.mark.parametrize("case", range(len(AWQ_BAD)))
def test_awq_bad_inputs_name_the_argument(case):
    t, _ = to_awq(weight(40, 96, 8), 32)
    change, message = AWQ_BAD[case]
    with pytest.raises(fusekit.Error, match="fk::W4Linear.from_awq: argument " + message):
        fnn.W4Linear.from_awq(**change(t))


# A tiny LLaMA: every projection's K a multiple of 32 (64 and 96: two and three groups).
def _llama(device, seed=0):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).to(device).eval()


def _logits(model, device):
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(9)).to(device)
    with torch.no_grad():
        return model(ids).logits.double().cpu()


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("fmt", ["gptq_act_order", "awq"])
def test_load_quantized_llama(fmt, device):
    """A LLaMA checkpoint written in the format (every decoder projection quantized, the rest f16 as
    the tools save it) loaded into a fresh model: its logits against the source model with each
    projection's weight replaced by the checkpoint's w̃ in f32."""
    src = _llama(device)
    sd = {key: v.detach().cpu().to(torch.float16) for key, v in src.state_dict().items()}
    want = _llama(device)
    want.load_state_dict(sd)
    for name, m in src.named_modules():
        if type(m) is nn.Linear and name != "lm_head":
            del sd[name + ".weight"]
            t, truth = write(fmt, m.weight.detach().cpu(), 32)
            sd.update({f"{name}.{key}": v for key, v in t.items()})
            with torch.no_grad():
                want.get_submodule(name).weight.copy_(truth.weight())
    model = fusekit.load_quantized(_llama(device, seed=1), sd, "gptq" if fmt.startswith("gptq") else "awq")
    w4 = [name for name, m in model.named_modules() if isinstance(m, fnn.W4Linear)]
    assert len(w4) == 2 * 7 and type(model.lm_head) is nn.Linear
    # Each projection reads an f16 copy of its input and writes an f16 result (2^-11 each) through two
    # layers: measured 4e-4 normwise on the CPU; held to 8 times f16's unit roundoff.
    assert _rel(_logits(model, device), _logits(want, device)) < 8 * 2.0 ** -11


def test_load_quantized_refuses_what_it_cannot_place():
    src = _llama("cpu")
    sd = {key: v.detach().clone() for key, v in src.state_dict().items()}
    with pytest.raises(fusekit.Error, match="'state_dict': expected '<path>.qweight' entries"):
        fusekit.load_quantized(_llama("cpu"), sd, "gptq")
    name = "model.layers.0.mlp.down_proj"
    del sd[name + ".weight"]
    t, _ = to_gptq(src.get_submodule(name).weight.detach(), 32)
    sd.update({f"{name}.{key}": v for key, v in t.items()})
    with pytest.raises(fusekit.Error, match="'format': expected 'gptq' or 'awq'"):
        fusekit.load_quantized(_llama("cpu"), sd, "exl2")
    with pytest.raises(fusekit.Error, match="unexpected \\['extra'\\]"):
        fusekit.load_quantized(_llama("cpu"), {**sd, "extra": torch.zeros(1)}, "gptq")
    fusekit.load_quantized(_llama("cpu"), {**sd, "extra": torch.zeros(1)}, "gptq", strict=False)
    bad = dict(sd)
    bad[name + ".qweight"] = torch.cat([sd[name + ".qweight"]] * 2)  # twice the rows: what 2-bit K would read as
    bad[name + ".g_idx"] = torch.arange(192, dtype=torch.int32) // 64
    with pytest.raises(fusekit.Error, match="down_proj of a 4-bit checkpoint for an nn.Linear\\(96, 64\\)"):
        fusekit.load_quantized(_llama("cpu"), bad, "gptq")
    with pytest.raises(fusekit.Error, match="model.layers.0.mlp.down_proj: fk::W4Linear.from_gptq: argument 'scales'"):
        fusekit.load_quantized(_llama("cpu"), {**sd, name + ".scales": sd[name + ".scales"].t()}, "gptq")


def test_quantize_llama(device):
    """fusekit.quantize swaps every projection (the LM head stays): logits within f16 rounding of the
    f32 model on the quantized weights (measured 3e-4 normwise on the CPU), and within the 4-bit
    error of the f32 model itself."""
    ref = _llama(device)
    model = fusekit.quantize(_llama(device), group_size=32)
    w4 = {name: m for name, m in model.named_modules() if isinstance(m, fnn.W4Linear)}
    assert len(w4) == 2 * 7 and type(model.lm_head) is nn.Linear
    assert not any(type(m) is nn.Linear for name, m in model.named_modules() if name != "lm_head")
    fake = _llama(device)
    with torch.no_grad():
        for name, m in w4.items():
            fake.get_submodule(name).weight.copy_(m.dequantized_weight().float())
    assert _rel(_logits(model, device), _logits(fake, device)) < 8 * 2.0 ** -11
    # Against the unquantized model, the 4-bit error itself: each layer's weight moves by 8% (normwise,
    # groups of 32 normal values) and the logits by 9.5%; held to twice the largest layer's move.
    moved = max(_rel(m.dequantized_weight().double().cpu(), ref.get_submodule(name).weight.detach().double().cpu())
                for name, m in w4.items())
    assert _rel(_logits(model, device), _logits(ref, device)) < 2 * moved


def test_quantize_options():
    lin = nn.Sequential(nn.Linear(96, 40), nn.ReLU(), nn.Linear(40, 8))
    with pytest.raises(fusekit.Error, match="'bits': expected 4"):
        fusekit.quantize(lin, bits=8)
    with pytest.raises(fusekit.Error, match="'group_size': expected 32, 64, 128 or -1.*got 32 for 2"):
        fusekit.quantize(lin, group_size=32)
    fusekit.quantize(lin, group_size=32, skip=("2",), dtype=torch.bfloat16)
    assert isinstance(lin[0], fnn.W4Linear) and type(lin[2]) is nn.Linear and lin[0].scale.dtype == torch.bfloat16
    whole = fusekit.quantize(nn.Sequential(nn.Linear(40, 8)), group_size=-1)
    assert whole[0].group == 40 and whole[0].scale.dtype == torch.float16
