"""fusekit.patch on a tiny Hugging Face LLaMA and on a plain nn.Module: same logits, loss and
gradients as the unpatched model; unpatch restores it; a patched block compiles in one graph."""
import copy
import gc

import pytest
import torch
from torch import nn

import fusekit
from fusekit.patch import patched_modules

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")


def tiny_llama(device, dtype=torch.float32, act="silu", seed=0):
    cfg = transformers.LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=88, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   hidden_act=act, attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).to(device=device, dtype=dtype)
    with torch.no_grad():  # norms away from 1, so that a wrong weight shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def batch(device, b=3, t=17, vocab=101, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, t), generator=g).to(device)
    labels = ids.clone()
    labels[0, :5] = -100  # a padded prompt, as fine-tuning masks it
    return ids, labels


def assert_loss_and_grads_close(out, want, model, ref, rtol=1e-3, atol=1e-5):
    """out.loss against want.loss, then (after both backwards) every gradient of model against ref's
    (to rtol, atol)."""
    torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=1e-5)
    out.loss.backward()
    want.loss.backward()
    g, gw = grads(model), grads(ref)
    assert g.keys() == gw.keys()
    for n in g:
        torch.testing.assert_close(g[n], gw[n], rtol=rtol, atol=atol, msg=n)


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_patched_llama_equals_unpatched(device, act):
    ref = tiny_llama(device, act=act)
    model = copy.deepcopy(ref)
    fusekit.patch_llama(model)
    roles = set(patched_modules(model).values())
    assert roles == {"decoder_layer", "projection", "rms_norm", "mlp", "causal_lm", "attention"}, roles
    ids, labels = batch(device)

    # logits (no labels: the model's own head, with the patched norms, MLPs and rotary)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-4, atol=1e-4)

    # loss and gradients (labels: the fused linear + cross-entropy; logits not materialised)
    out, want = model(ids, labels=labels), ref(ids, labels=labels)
    assert out.logits is None
    assert_loss_and_grads_close(out, want, model, ref)


@pytest.mark.parametrize("decoder_layer", [True, False])
def test_patched_llama_bf16_autocast(device, decoder_layer):
    ref = tiny_llama(device)
    model = fusekit.patch(copy.deepcopy(ref), decoder_layer=decoder_layer)
    assert ("decoder_layer" in set(patched_modules(model).values())) == decoder_layer
    ids, labels = batch(device)
    with torch.autocast(device, torch.bfloat16):
        # the fused layer hands bf16 to the attention and MLP GEMMs, as autocast would cast them
        h = torch.randn(2, 5, 64, device=device)
        pos = torch.arange(5, device=device)[None]
        emb = ref.model.rotary_emb(h, pos)
        got = model.model.layers[0](h, position_embeddings=emb, position_ids=pos)
        want = ref.model.layers[0](h, position_embeddings=emb, position_ids=pos)
        assert got.dtype == want.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
        out, want = model(ids, labels=labels), ref(ids, labels=labels)
    torch.testing.assert_close(out.loss, want.loss, rtol=2e-2, atol=2e-2)
    out.loss.backward()
    want.loss.backward()
    for n, p in model.named_parameters():
        q = dict(ref.named_parameters())[n]
        scale = q.grad.abs().max().clamp_min(1e-6)
        assert float((p.grad - q.grad).abs().max() / scale) < 5e-2, n


def count_norm_calls(monkeypatch):
    """{"rms_norm": n, "add_rms_norm": n}: the fused norms the patched model calls from now on."""
    import fusekit.functional as Fk
    calls = {"rms_norm": 0, "add_rms_norm": 0}
    for name in calls:
        def counted(*args, _f=getattr(Fk, name), _name=name, **kwargs):
            calls[_name] += 1
            return _f(*args, **kwargs)
        monkeypatch.setattr(Fk, name, counted)
    return calls


def test_chained_decoder_stack(device, monkeypatch):
    """The stack chains its layers: every residual add is an add_rms_norm (two a layer), the only
    plain rms_norm is the first layer's input norm; the same loss and gradients as the unpatched
    model; a layer called on its own still returns a tensor."""
    ref = tiny_llama(device)
    model = fusekit.patch(copy.deepcopy(ref))
    assert model.model.__dict__["_fusekit_chain_layers"] == 2
    ids, labels = batch(device)
    calls = count_norm_calls(monkeypatch)
    out, want = model(ids, labels=labels), ref(ids, labels=labels)
    assert calls == {"rms_norm": 1, "add_rms_norm": 4}, calls
    assert_loss_and_grads_close(out, want, model, ref)
    h = torch.randn(2, 5, 64, device=device)
    pos = torch.arange(5, device=device)[None]
    emb = ref.model.rotary_emb(h, pos)
    got = model.model.layers[1](h, position_embeddings=emb, position_ids=pos)
    assert isinstance(got, torch.Tensor)
    torch.testing.assert_close(got, ref.model.layers[1](h, position_embeddings=emb, position_ids=pos))


def count_qkv_calls(monkeypatch):
    import fusekit.functional as Fk
    calls = [0]

    def counted(*args, _f=Fk.qkv_rope, **kwargs):
        calls[0] += 1
        return _f(*args, **kwargs)
    monkeypatch.setattr(Fk, "qkv_rope", counted)
    return calls


def test_attention_inputs_in_one_op(device, monkeypatch):
    """The patched attention takes q, k, v and rope from qkv_rope (one call a layer), with the
    unpatched model's loss and gradients; qkv=False keeps Hugging Face's projections."""
    ref = tiny_llama(device)
    model = fusekit.patch(copy.deepcopy(ref))
    assert [r for r in patched_modules(model).values()].count("attention") == 2
    calls = count_qkv_calls(monkeypatch)
    ids, labels = batch(device)
    out, want = model(ids, labels=labels), ref(ids, labels=labels)
    assert calls[0] == 2
    assert_loss_and_grads_close(out, want, model, ref)
    plain = fusekit.patch(copy.deepcopy(ref), qkv=False)
    assert "attention" not in patched_modules(plain).values()


@pytest.mark.parametrize("case", ["hook", "compress", "cache", "other_forward"])
def test_attention_inputs_step_aside(device, monkeypatch, case):
    """The attention's own forward runs where something else must see the projections: a hook on
    one, fusekit.compress_saved_tensors (which packs their input), a KV cache; a class whose
    forward is not Hugging Face LLaMA's is not patched."""
    ref = tiny_llama(device)
    model = copy.deepcopy(ref)
    if case == "other_forward":
        attn = model.model.layers[0].self_attn
        cls = type(attn)
        attn.__class__ = type("OtherAttention", (cls,), {"forward": lambda self, *a, **k: cls.forward(self, *a, **k)})
    fusekit.patch(model)
    calls = count_qkv_calls(monkeypatch)
    ids, labels = batch(device)
    if case == "other_forward":
        assert "model.layers.0.self_attn" not in patched_modules(model)
        assert patched_modules(model)["model.layers.1.self_attn"] == "attention"
        model(ids, labels=labels)
        assert calls[0] == 1
        return
    if case == "hook":
        seen = []
        model.model.layers[1].self_attn.v_proj.register_forward_hook(lambda m, i, o: seen.append(o.shape))
        out, want = model(ids, labels=labels), ref(ids, labels=labels)
        assert calls[0] == 1 and len(seen) == 1
        assert_loss_and_grads_close(out, want, model, ref)
    elif case == "compress":
        with fusekit.compress_saved_tensors(bits=8, min_bytes=0):
            model(ids, labels=labels)
        assert calls[0] == 0
    else:
        with torch.no_grad():
            model.generate(ids[:, :4], max_new_tokens=2, do_sample=False, use_cache=True, pad_token_id=0)
        assert calls[0] == 0


@pytest.mark.parametrize("case", ["hook", "pre_hook", "hidden_states", "checkpointing", "fewer_layers"])
def test_chain_steps_aside(device, monkeypatch, case):
    """Where something else could see what a layer hands on (a hook on it or on its consumer,
    output_hidden_states, gradient checkpointing) or the stack runs fewer layers than it linked, the
    layers hand on plain tensors there: the unpatched model's loss, gradients and hidden states."""
    ref = tiny_llama(device)
    model = fusekit.patch(copy.deepcopy(ref))
    ids, labels = batch(device)
    seen = []
    kwargs = {}
    if case == "hook":
        model.model.layers[0].register_forward_hook(lambda m, i, o: seen.append(type(o)))
    elif case == "pre_hook":
        model.model.norm.register_forward_pre_hook(lambda m, i: seen.append(type(i[0])))
    elif case == "hidden_states":
        kwargs["output_hidden_states"] = True
    elif case == "checkpointing":
        for m in (model, ref):
            m.gradient_checkpointing_enable()
            m.train()
    else:
        for m in (model, ref):
            m.config.num_hidden_layers = 1
    calls = count_norm_calls(monkeypatch)
    out, want = model(ids, labels=labels, **kwargs), ref(ids, labels=labels, **kwargs)
    assert all(t is torch.Tensor for t in seen) and (case not in ("hook", "pre_hook") or seen)
    if case == "hook":  # only layer 0's add stays apart
        assert calls == {"rms_norm": 2, "add_rms_norm": 3}, calls
    elif case == "pre_hook":  # only the last layer's
        assert calls == {"rms_norm": 2, "add_rms_norm": 3}, calls
    elif case == "fewer_layers":
        assert calls == {"rms_norm": 2, "add_rms_norm": 1}, calls
    if case == "hidden_states":
        with torch.no_grad():
            h, hw = model.model(ids, output_hidden_states=True), ref.model(ids, output_hidden_states=True)
        assert len(h.hidden_states) == len(hw.hidden_states) == 3
        for a, b in zip(h.hidden_states, hw.hidden_states):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert_loss_and_grads_close(out, want, model, ref)


def test_chained_stack_registers_the_ops_with_inductor():
    """Patching a decoder stack registers every fusekit op with Inductor ahead of any compile
    (fusekit.ops._registry.register_inductor_fallbacks)."""
    lowering = pytest.importorskip("torch._inductor.lowering")
    fusekit.patch(tiny_llama("cpu"))
    ops = [getattr(p, o) for p in (getattr(torch.ops.fusekit, n) for n in fusekit.ops._registry._OPS)
           for o in p.overloads()]
    assert ops and all(op in lowering.lowerings for op in ops)


def test_num_items_in_batch_and_logits_to_keep(device):
    ref = tiny_llama(device)
    model = fusekit.patch(copy.deepcopy(ref))
    ids, labels = batch(device)
    n = torch.tensor(40, device=device)
    torch.testing.assert_close(model(ids, labels=labels, num_items_in_batch=n).loss,
                               ref(ids, labels=labels, num_items_in_batch=n).loss, rtol=1e-5, atol=1e-5)
    # asking for logits runs the model's own head
    out = model(ids, logits_to_keep=1)
    assert out.logits.shape[1] == 1
    torch.testing.assert_close(out.logits, ref(ids, logits_to_keep=1).logits, rtol=1e-4, atol=1e-4)


def test_generation_with_a_kv_cache(device):
    """Greedy decoding with a KV cache through the patched layers gives the unpatched model's
    tokens."""
    ref = tiny_llama(device)
    model = fusekit.patch(copy.deepcopy(ref))
    ids, _ = batch(device, b=2, t=6)
    with torch.no_grad():
        got = model.generate(ids, max_new_tokens=4, do_sample=False, use_cache=True, pad_token_id=0)
        want = ref.generate(ids, max_new_tokens=4, do_sample=False, use_cache=True, pad_token_id=0)
    assert torch.equal(got, want)


def test_unpatch_restores(device):
    gc.collect()  # models patched by earlier tests release the rotary function when collected
    ref = tiny_llama(device)
    model = copy.deepcopy(ref)
    classes = {n: type(m) for n, m in model.named_modules()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    import transformers.models.llama.modeling_llama as ml
    rope = ml.apply_rotary_pos_emb
    fusekit.patch(model)
    assert ml.apply_rotary_pos_emb is not rope
    assert model.state_dict().keys() == state.keys()
    fusekit.patch(model)  # twice: nothing more
    fusekit.unpatch(model)
    assert ml.apply_rotary_pos_emb is rope
    assert {n: type(m) for n, m in model.named_modules()} == classes
    assert patched_modules(model) == {}
    assert not any(k.startswith("_fusekit") for m in model.modules() for k in m.__dict__)
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k])


def test_two_models_share_the_rotary_patch(device):
    gc.collect()
    a, b = fusekit.patch(tiny_llama(device)), fusekit.patch(tiny_llama(device))
    import transformers.models.llama.modeling_llama as ml
    fusekit.unpatch(a)
    assert getattr(ml.apply_rotary_pos_emb, "_fusekit", False)  # b still patched
    fusekit.unpatch(b)
    assert not getattr(ml.apply_rotary_pos_emb, "_fusekit", False)


def test_patch_llama_refuses_other_models():
    with pytest.raises(ValueError, match="patch_llama.*model"):
        fusekit.patch_llama(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="fusekit.patch.*model"):
        fusekit.patch("not a model")


class SwiGLU(nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False), \
            nn.Linear(f, d, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class SwiGLUBlock(nn.Module):
    """A plain pre-norm block built from nn.RMSNorm, nn.Linear and nn.SiLU, no transformers."""

    def __init__(self, d, f):
        super().__init__()
        self.norm = nn.RMSNorm(d, eps=1e-5)
        self.mlp = SwiGLU(d, f)

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class FlatBlock(SwiGLU):
    """The MLP's children plus a norm: not an MLP, and left alone (its norm is patched)."""

    def __init__(self, d, f):
        super().__init__(d, f)
        self.norm = nn.RMSNorm(d)

    def forward(self, x):
        return x + super().forward(self.norm(x))


def test_module_with_more_than_an_mlp_is_not_an_mlp():
    assert patched_modules(fusekit.patch(FlatBlock(8, 12))) == {"norm": "rms_norm"}


def test_plain_module(device):
    torch.manual_seed(0)
    ref = SwiGLUBlock(48, 72).to(device)
    with torch.no_grad():
        ref.norm.weight.uniform_(0.5, 1.5)
    model = fusekit.patch(copy.deepcopy(ref))
    assert set(patched_modules(model).values()) == {"rms_norm", "mlp"}
    x = torch.randn(5, 7, 48, device=device)
    y, want = model(x), ref(x)
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)
    y.square().sum().backward()
    want.square().sum().backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-4, msg=n)


def test_patched_block_compiles_fullgraph(device):
    torch.manual_seed(0)
    model = fusekit.patch(SwiGLUBlock(32, 40).to(device))
    x = torch.randn(3, 32, device=device, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    y = compiled(x)
    torch.testing.assert_close(y, model(x), rtol=1e-5, atol=1e-5)
    y.sum().backward()


def test_add_lora_matches_peft(device):
    peft = pytest.importorskip("peft", reason="peft is not installed")
    ref = tiny_llama(device)
    theirs = peft.get_peft_model(copy.deepcopy(ref), peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(fusekit.nn.LLAMA_PROJECTIONS)))
    ours = fusekit.nn.add_lora(copy.deepcopy(ref), r=4, alpha=8)
    fusekit.patch(ours)
    # the same adapters: PEFT's A and B (B nonzero, so that the adapter shows in the output)
    for name, m in ours.named_modules():
        if isinstance(m, fusekit.nn.LoRALinear):
            theirs_m = theirs.get_submodule("base_model.model." + name)
            with torch.no_grad():
                theirs_m.lora_B["default"].weight.normal_(0, 0.1)
                m.lora_A.copy_(theirs_m.lora_A["default"].weight)
                m.lora_B.copy_(theirs_m.lora_B["default"].weight)
    trainable = sorted(n for n, p in ours.named_parameters() if p.requires_grad)
    assert len(trainable) == 2 * 7 * 2 and all("lora_" in n for n in trainable)
    ids, labels = batch(device)
    out, want = ours(ids, labels=labels), theirs(input_ids=ids, labels=labels)
    torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=1e-5)
    out.loss.backward()
    want.loss.backward()
    for name, m in ours.named_modules():
        if isinstance(m, fusekit.nn.LoRALinear):
            theirs_m = theirs.get_submodule("base_model.model." + name)
            torch.testing.assert_close(m.lora_A.grad, theirs_m.lora_A["default"].weight.grad, rtol=1e-3, atol=1e-5)
            torch.testing.assert_close(m.lora_B.grad, theirs_m.lora_B["default"].weight.grad, rtol=1e-3, atol=1e-5)


def test_add_lora_errors():
    with pytest.raises(ValueError, match="add_lora.*'r'"):
        fusekit.nn.add_lora(nn.Linear(2, 2), r=0)
    with pytest.raises(ValueError, match="add_lora.*target_modules"):
        fusekit.nn.add_lora(nn.Sequential(nn.Linear(2, 2)), r=2)


def check_first_layer_compiles_fullgraph(model, device):
    """The patched model's first decoder layer under torch.compile(fullgraph=True) equals it eager;
    then a backward through the compiled output."""
    layer = model.model.layers[0]
    x = torch.randn(2, 9, 64, device=device, requires_grad=True)
    pos = torch.arange(9, device=device)[None]
    cos_sin = model.model.rotary_emb(x, pos)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    y = compiled(x, position_embeddings=cos_sin, position_ids=pos)
    y = y[0] if isinstance(y, tuple) else y
    want = layer(x, position_embeddings=cos_sin, position_ids=pos)
    want = want[0] if isinstance(want, tuple) else want
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    y.sum().backward()


def test_patched_llama_layer_compiles_fullgraph(device):
    check_first_layer_compiles_fullgraph(fusekit.patch(tiny_llama(device)), device)


# ---- fusekit.patch(model, attention=True): fusekit attention as a transformers implementation -----

class AttentionCalls:
    """Counts the calls of hf_attention_forward that ran fusekit.attention and those that went to
    transformers' SDPA function."""

    def __init__(self, monkeypatch):
        from fusekit import hf_attention
        self.fusekit = self.sdpa = 0
        sdpa, attention = hf_attention._sdpa(), hf_attention.Fk.attention

        def counted_sdpa(*args, **kwargs):
            self.sdpa += 1
            return sdpa(*args, **kwargs)

        def counted_attention(*args, **kwargs):
            self.fusekit += 1
            return attention(*args, **kwargs)
        monkeypatch.setattr(hf_attention, "_sdpa", lambda: counted_sdpa)
        monkeypatch.setattr(hf_attention.Fk, "attention", counted_attention)


ONLY_ATTENTION = dict(rms_norm=False, mlp=False, rope=False, cross_entropy=False, decoder_layer=False)


def compare_training(model, ref, ids, labels, attention_mask=None, rtol=1e-3, atol=1e-5):
    with torch.no_grad():
        got, want = model(ids, attention_mask=attention_mask).logits, ref(ids, attention_mask=attention_mask).logits
    if attention_mask is not None:  # padded queries: compare the real tokens
        keep = attention_mask.bool()
        got, want = got[keep], want[keep]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    out, want = model(ids, labels=labels, attention_mask=attention_mask), ref(ids, labels=labels,
                                                                              attention_mask=attention_mask)
    assert_loss_and_grads_close(out, want, model, ref, rtol=rtol, atol=atol)


@pytest.mark.parametrize("others", [True, False], ids=["all_patches", "attention_only"])
def test_patched_attention_equals_sdpa(device, monkeypatch, others):
    """attention=True on a GQA LLaMA (4 query heads, 2 key heads): fusekit.attention runs in every
    layer (no padding: no mask), logits, loss and gradients are SDPA's."""
    calls = AttentionCalls(monkeypatch)
    ref = tiny_llama(device)
    assert ref.config.num_key_value_heads < ref.config.num_attention_heads
    model = fusekit.patch(copy.deepcopy(ref), attention=True, **({} if others else ONLY_ATTENTION))
    assert model.config._attn_implementation == "fusekit" and ref.config._attn_implementation == "sdpa"
    ids, labels = batch(device)
    compare_training(model, ref, ids, labels)
    assert calls.fusekit == 2 * 2 and calls.sdpa == 0  # logits, then loss: 2 layers each
    # an all-ones attention_mask is no padding: still no mask, still fusekit
    compare_training(model, ref, ids, labels, attention_mask=torch.ones_like(ids))
    assert calls.sdpa == 0


def test_patched_attention_padded_batch_falls_back(device, monkeypatch):
    calls = AttentionCalls(monkeypatch)
    ref = tiny_llama(device)
    model = fusekit.patch(copy.deepcopy(ref), attention=True)
    ids, labels = batch(device)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding, as the labels' -100
    compare_training(model, ref, ids, labels, attention_mask=mask)
    assert calls.fusekit == 0 and calls.sdpa == 2 * 2  # logits, then loss: 2 layers each


def test_patched_attention_default_is_off(device):
    model = fusekit.patch(tiny_llama(device))
    assert model.config._attn_implementation == "sdpa"


def test_patched_attention_unpatch_restores(device):
    ref = tiny_llama(device)
    model = fusekit.patch(copy.deepcopy(ref), attention=True)
    fusekit.patch(model, attention=True)  # twice: nothing more
    assert model.config._attn_implementation == "fusekit"
    fusekit.unpatch(model)
    assert model.config._attn_implementation == "sdpa" and model.model.config._attn_implementation == "sdpa"
    assert patched_modules(model) == {} and "_fusekit_attn_previous" not in model.__dict__
    ids, _ = batch(device)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=0, atol=0)


def test_patched_attention_leaves_other_implementations(device):
    ref = tiny_llama(device)
    ref.set_attn_implementation("eager")
    fusekit.patch(ref, attention=True)
    assert ref.config._attn_implementation == "eager"


def test_patched_attention_generation(device, monkeypatch):
    """Greedy decoding with a KV cache (prefill causal, then single queries over the cache)."""
    calls = AttentionCalls(monkeypatch)
    ref = tiny_llama(device)
    model = fusekit.patch(copy.deepcopy(ref), attention=True, **ONLY_ATTENTION)
    ids, _ = batch(device, b=2, t=6)
    with torch.no_grad():
        got = model.generate(ids, max_new_tokens=4, do_sample=False, use_cache=True, pad_token_id=0)
        want = ref.generate(ids, max_new_tokens=4, do_sample=False, use_cache=True, pad_token_id=0)
    assert torch.equal(got, want)
    assert calls.fusekit > 0


def sdpa_args(device, dtype=torch.float32, b=2, h=4, hk=2, s=7, d=16):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, n, s, d, generator=g).to(device=device, dtype=dtype) for n in (h, hk, hk))
    module = nn.Module()
    module.num_key_value_groups, module.is_causal = h // hk, True
    return module, q, k, v


@pytest.mark.parametrize("case", ["plain", "mask", "dropout", "output_attentions", "float64", "head_dim_320",
                                  "window", "position_bias", "batch_1_query"])
def test_hf_attention_forward_falls_back(device, monkeypatch, case):
    """Each case the kernel does not take goes to transformers' SDPA function (the same result);
    the plain causal case runs fusekit and matches it."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    calls = AttentionCalls(monkeypatch)
    dtype = torch.float64 if case == "float64" else torch.float32
    module, q, k, v = sdpa_args(device, dtype, d=320 if case == "head_dim_320" else 16)
    mask, kwargs = None, {}
    if case == "mask":
        mask = torch.ones(2, 1, 7, 7, dtype=torch.bool, device=device).tril()
        mask[0, :, :, :2] = False
        mask[0, :, :2, 0] = True
    elif case == "dropout":
        kwargs["dropout"] = 0.5
    elif case == "output_attentions":
        kwargs["output_attentions"] = True
    elif case == "window":
        kwargs["sliding_window"] = 4
    elif case == "position_bias":
        kwargs["position_bias"] = torch.randn(1, 4, 7, 7, device=device)
    elif case == "batch_1_query":
        q = q[:, :, :1]
    got, weights = fusekit.hf_attention_forward(module, q, k, v, mask, scaling=0.3, **kwargs)
    assert weights is None and got.shape == (2, q.shape[2], 4, q.shape[-1]) and got.is_contiguous()
    taken = case in ("plain", "batch_1_query")
    assert (calls.fusekit, calls.sdpa) == ((1, 0) if taken else (0, 1))
    if case != "dropout":
        want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3, **kwargs)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_hf_attention_forward_refuses_masks_it_cannot_trust(device):
    """Registered without SDPA's mask function, a model's padding masks never reach the attention
    function (transformers passes None): hf_attention_forward raises rather than drop them."""
    from transformers import AttentionInterface
    AttentionInterface.register("fusekit_no_masks", fusekit.hf_attention_forward)
    model = tiny_llama(device)
    model.set_attn_implementation("fusekit_no_masks")
    ids, _ = batch(device)
    with pytest.raises(ValueError, match="register_hf_attention"):
        model(ids)


def test_attn_implementation_by_name(device):
    """A user's own switch: register_hf_attention(), then attn_implementation="fusekit"."""
    fusekit.register_hf_attention()
    ref = tiny_llama(device)
    model = copy.deepcopy(ref)
    model.set_attn_implementation("fusekit")
    ids, _ = batch(device)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-4, atol=1e-4)
        got, want = model(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], rtol=1e-4, atol=1e-4)


def test_patched_attention_layer_compiles_fullgraph(device, monkeypatch):
    calls = AttentionCalls(monkeypatch)
    check_first_layer_compiles_fullgraph(fusekit.patch(tiny_llama(device), attention=True), device)
    assert calls.sdpa == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_patched_attention_bf16_cuda_matches_sdpa():
    """bf16 on a GPU, head dim 64 (the tensor-core forward and backward): loss and gradients close to
    SDPA's (FlashAttention / cuDNN / efficient)."""
    if not fusekit.build_info()["cuda"]:
        pytest.skip("fusekit built without CUDA")
    cfg = transformers.LlamaConfig(vocab_size=101, hidden_size=256, intermediate_size=344, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16)
    model = fusekit.patch(copy.deepcopy(ref), attention=True, **ONLY_ATTENTION)
    ids, labels = batch("cuda", b=4, t=200)
    out, want = model(ids, labels=labels), ref(ids, labels=labels)
    torch.testing.assert_close(out.loss, want.loss, rtol=2e-2, atol=2e-2)
    out.loss.backward()
    want.loss.backward()
    for n, p in model.named_parameters():
        q = dict(ref.named_parameters())[n]
        scale = q.grad.float().abs().max().clamp_min(1e-6)
        assert float((p.grad.float() - q.grad.float()).abs().max() / scale) < 5e-2, n
