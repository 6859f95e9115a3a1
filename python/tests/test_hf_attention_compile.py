"""fusekit's Hugging Face attention under torch.compile: the mask function causal_skip_mask (None
exactly where the mask is provably plain causal, from shapes and Python values), the positions a
model computes itself not taken for packed sequences, so that a compiled patched LLaMA runs
fusekit.attention (attention=True) or SDPA with is_causal (causal_mask_skip=True), with the
unpatched model's logits and gradients; padded or packed batches keep their dense masks."""
import copy

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import fusekit
from fusekit import hf_attention
from fusekit.patch import patched_modules

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")
masking_utils = pytest.importorskip("transformers.masking_utils")

from test_patch import assert_loss_and_grads_close, batch, tiny_llama  # noqa: E402


def op_calls(fn):
    """(fn(), how many times fusekit::attention ran, how many times an SDPA op ran)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = fn()
    names = [e.name for e in prof.events()]
    return out, sum(n == "fusekit::attention" for n in names), sum("scaled_dot_product" in n for n in names)


def compiled(model, backend="aot_eager", fullgraph=True):
    torch._dynamo.reset()
    return torch.compile(model, backend=backend, fullgraph=fullgraph)


def check_training(step_model, model, ref, ids, labels, attention_mask=None, position_ids=None):
    """step_model (compiled model) against ref (eager, unpatched): loss and gradients."""
    extra = {k: v for k, v in (("attention_mask", attention_mask), ("position_ids", position_ids)) if v is not None}
    out, want = step_model(ids, labels=labels, **extra), ref(ids, labels=labels, **extra)
    assert_loss_and_grads_close(out, want, model, ref)


# ---- the mask function --------------------------------------------------------------------------

def plain(**over):
    args = dict(batch_size=2, q_length=5, kv_length=5, q_offset=0, kv_offset=0,
                mask_function=masking_utils.causal_mask_function, attention_mask=None, allow_is_causal_skip=True,
                use_vmap=False, device="cpu", dtype=torch.float32, config=None)
    args.update(over)
    return args


@pytest.mark.parametrize("case", ["plain", "offsets_equal", "window_longer", "no_optional_args"])
def test_causal_skip_mask_none_when_plain_causal(case):
    over = {"offsets_equal": dict(q_offset=3, kv_offset=3), "window_longer": dict(local_size=6)}.get(case, {})
    args = plain(**over)
    if case == "no_optional_args":
        args = dict(batch_size=2, q_length=5, kv_length=5)
    assert hf_attention.causal_skip_mask(**args) is None


@pytest.mark.parametrize("case", ["padding", "padding_all_ones", "q_ne_kv", "offsets_differ", "tensor_offset",
                                  "window_cuts", "sliding_function", "packed_function", "skip_forbidden",
                                  "positional"])
def test_causal_skip_mask_builds_sdpa_mask_otherwise(case):
    """Anything but the plain causal pattern: sdpa_mask's own result, unchanged (a dense mask; an
    all-ones padding mask too, as its values are data)."""
    ones = torch.ones(2, 5, dtype=torch.bool)
    pad = ones.clone()
    pad[0, :2] = False
    packed = masking_utils.packed_sequence_mask_function(torch.tensor([[0, 0, 1, 1, 1]] * 2))
    over = {"padding": dict(attention_mask=pad), "padding_all_ones": dict(attention_mask=ones),
            "q_ne_kv": dict(q_length=2, q_offset=3), "offsets_differ": dict(q_offset=1),
            "tensor_offset": dict(q_offset=torch.tensor(0)), "window_cuts": dict(local_size=5),
            "sliding_function": dict(mask_function=masking_utils.sliding_window_causal_mask_function(3)),
            "packed_function": dict(mask_function=masking_utils.and_masks(masking_utils.causal_mask_function, packed)),
            "skip_forbidden": dict(allow_is_causal_skip=False)}.get(case, {})
    args = plain(**over)
    if case == "positional":
        got = hf_attention.causal_skip_mask(2, 5, 5)
        want = masking_utils.sdpa_mask(2, 5, 5)
    else:
        got = hf_attention.causal_skip_mask(**args)
        want = masking_utils.sdpa_mask(**args)
    if want is None:  # sdpa_mask's own skip (eager, no tracing): the same answer
        assert got is None
    else:
        assert got is not None and torch.equal(got, want)
    if case != "positional":  # the wrapper's own rule never takes these (sdpa_mask's may: it looks at the data)
        assert not hf_attention.is_plain_causal(args)
    if case in ("padding", "q_ne_kv", "skip_forbidden"):
        assert got is not None  # something to mask, or transformers forbids the skip


def test_causal_skip_mask_older_signature(monkeypatch):
    """An sdpa_mask with the older signature (cache_position, a tensor, in place of q_length and
    q_offset) is always called: its query offset is data."""
    calls = []

    def old_sdpa_mask(batch_size, cache_position, kv_length, kv_offset=0,
                      mask_function=masking_utils.causal_mask_function, attention_mask=None, local_size=None,
                      allow_is_causal_skip=True, allow_torch_fix=True, **kwargs):
        calls.append(cache_position)
        return torch.ones(batch_size, 1, cache_position.shape[0], kv_length, dtype=torch.bool)

    monkeypatch.setattr(hf_attention, "_sdpa_mask", lambda: old_sdpa_mask)
    monkeypatch.setattr(hf_attention, "_SDPA_MASK_DEFAULTS", None)
    got = hf_attention.causal_skip_mask(batch_size=2, cache_position=torch.arange(5), kv_length=5,
                                        mask_function=masking_utils.causal_mask_function, attention_mask=None)
    assert got is not None and got.shape == (2, 1, 5, 5) and len(calls) == 1


def test_causal_skip_mask_under_compile():
    """The same answer traced: None for the plain pattern, a mask for padding."""
    def f(x, mask):
        m = hf_attention.causal_skip_mask(batch_size=2, q_length=x.shape[1], kv_length=x.shape[1], q_offset=0,
                                          kv_offset=0, mask_function=masking_utils.causal_mask_function,
                                          attention_mask=mask, allow_is_causal_skip=True, device=x.device)
        return x.sum() if m is None else x.sum() + m.sum()
    torch._dynamo.reset()
    g = torch.compile(f, backend="aot_eager", fullgraph=True)
    x = torch.ones(2, 5)
    assert float(g(x, None)) == 10.0
    assert float(g(x, torch.ones(2, 5, dtype=torch.bool))) == 10.0 + 2 * 15  # a causal 5x5 mask per row


# ---- a compiled patched LLaMA -------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_patched_attention_runs_fusekit(backend):
    """attention=True, torch.compile(fullgraph=True): every layer runs fusekit::attention at run
    time (the second call, compiled: no tracing), SDPA never; loss and gradients are the
    unpatched eager model's."""
    ref = tiny_llama("cpu")
    model = fusekit.patch(copy.deepcopy(ref), attention=True)
    assert patched_modules(model)["model"] == "positions"
    ids, labels = batch("cpu")
    step = compiled(model, backend)
    check_training(step, model, ref, ids, labels)
    model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    _, n_fusekit, n_sdpa = op_calls(lambda: step(ids, labels=labels))
    assert n_fusekit == model.config.num_hidden_layers and n_sdpa == 0


def test_compiled_patched_attention_only(monkeypatch):
    """attention=True with every other patch off: still fusekit's attention in the compiled graph,
    logits equal to the unpatched model's."""
    ref = tiny_llama("cpu")
    model = fusekit.patch(copy.deepcopy(ref), attention=True, rms_norm=False, mlp=False, rope=False,
                          cross_entropy=False, decoder_layer=False)
    ids, labels = batch("cpu")
    step = compiled(model)
    with torch.no_grad():
        step(ids)
        got, n_fusekit, n_sdpa = op_calls(lambda: step(ids))
        torch.testing.assert_close(got.logits, ref(ids).logits, rtol=1e-4, atol=1e-4)
    assert n_fusekit == 2 and n_sdpa == 0
    check_training(step, model, ref, ids, labels)


def test_compiled_padded_batch_keeps_its_mask():
    """A padded batch under compile: the dense mask, transformers' SDPA, the same loss and grads."""
    ref = tiny_llama("cpu")
    model = fusekit.patch(copy.deepcopy(ref), attention=True)
    ids, labels = batch("cpu")
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    step = compiled(model)
    check_training(step, model, ref, ids, labels, attention_mask=mask)
    _, n_fusekit, n_sdpa = op_calls(lambda: step(ids, labels=labels, attention_mask=mask))
    assert n_fusekit == 0 and n_sdpa > 0


def test_compiled_packed_positions_keep_their_mask():
    """Positions given by the caller (two sequences packed in each row): the packed-sequence mask,
    SDPA, the same loss and gradients as the unpatched eager model (which finds the packing)."""
    ref = tiny_llama("cpu")
    model = fusekit.patch(copy.deepcopy(ref), attention=True)
    ids, labels = batch("cpu")
    pos = torch.cat([torch.arange(7), torch.arange(10)])[None].expand(ids.shape[0], -1)
    step = compiled(model)
    check_training(step, model, ref, ids, labels, position_ids=pos)
    _, n_fusekit, n_sdpa = op_calls(lambda: step(ids, labels=labels, position_ids=pos))
    assert n_fusekit == 0 and n_sdpa > 0


def sdpa_graph_calls(model, ids):
    """The scaled_dot_product_attention calls of model's dynamo graph: [(attn_mask, is_causal)]."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    torch._dynamo.reset()
    step = torch.compile(model, backend=backend, fullgraph=True)
    with torch.no_grad():
        out = step(ids)
    calls = [(n.kwargs.get("attn_mask"), n.kwargs.get("is_causal")) for gm in graphs for n in gm.graph.nodes
             if n.op == "call_function" and "scaled_dot_product_attention" in str(n.target)]
    return out, calls


def test_causal_mask_skip_gives_sdpa_is_causal_under_compile():
    """causal_mask_skip=True: the compiled graph calls SDPA with is_causal=True and no mask (the
    unpatched model's graph passes a dense mask); logits equal the unpatched model's."""
    ref = tiny_llama("cpu")
    model = fusekit.patch(copy.deepcopy(ref), causal_mask_skip=True)
    assert model.config._attn_implementation == hf_attention.SDPA_NAME
    ids, _ = batch("cpu")
    got, calls = sdpa_graph_calls(model, ids)
    assert len(calls) == 2 and all(mask is None and causal for mask, causal in calls), calls
    _, ref_calls = sdpa_graph_calls(ref, ids)
    assert len(ref_calls) == 2 and all(mask is not None for mask, _ in ref_calls), ref_calls
    with torch.no_grad():
        torch.testing.assert_close(got.logits, ref(ids).logits, rtol=1e-4, atol=1e-4)
    fusekit.unpatch(model)
    assert model.config._attn_implementation == "sdpa"


def test_unpatch_restores_create_causal_mask():
    from transformers.models.llama import modeling_llama
    original = modeling_llama.create_causal_mask
    a = fusekit.patch(tiny_llama("cpu"))
    assert modeling_llama.create_causal_mask is original  # no attention switch: left alone
    b = fusekit.patch(tiny_llama("cpu"), attention=True)
    fusekit.patch(a, attention=True)  # patched again, with the switch: a holds it too
    assert getattr(modeling_llama.create_causal_mask, "_fusekit", False)
    fusekit.unpatch(b)
    assert getattr(modeling_llama.create_causal_mask, "_fusekit", False)  # a still holds it
    fusekit.unpatch(a)
    assert modeling_llama.create_causal_mask is original
    assert "model" not in patched_modules(a)


OLDER_FORWARD = '''
import torch


def create_causal_mask(**kwargs):
    return None


class OlderModel:
    def forward(self, input_ids=None, position_ids=None, past_key_values=None, cache_position=None,
                inputs_embeds=None):
        if cache_position is None:
            past_seen_tokens = past_key_values.get_seq_length() if past_key_values is not None else 0
            cache_position = torch.arange(
                past_seen_tokens, past_seen_tokens + inputs_embeds.shape[1], device=inputs_embeds.device
            )
        if position_ids is None:
            position_ids = cache_position.unsqueeze(0)
        causal_mask = create_causal_mask(config=self.config, position_ids=position_ids)
'''


def test_computes_own_positions(tmp_path, monkeypatch):
    """transformers 5's LLaMA family computes its positions (arange from the cache's length), as the
    older form (cache_position first) does; a *ForCausalLM (no mask of its own) and a forward that
    takes its positions from elsewhere do not."""
    import importlib
    from transformers.models.llama import modeling_llama
    from transformers.models.mistral import modeling_mistral
    from transformers.models.qwen2 import modeling_qwen2
    for cls in (modeling_llama.LlamaModel, modeling_mistral.MistralModel, modeling_qwen2.Qwen2Model):
        assert hf_attention.computes_own_positions(cls.forward), cls
    assert not hf_attention.computes_own_positions(modeling_llama.LlamaForCausalLM.forward)
    (tmp_path / "older_model.py").write_text(OLDER_FORWARD)
    other = OLDER_FORWARD.replace("past_seen_tokens + inputs_embeds", "7 + inputs_embeds")  # not from the cache
    (tmp_path / "other_model.py").write_text(other)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert hf_attention.computes_own_positions(importlib.import_module("older_model").OlderModel.forward)
    assert not hf_attention.computes_own_positions(importlib.import_module("other_model").OlderModel.forward)
