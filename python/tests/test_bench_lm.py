"""The language-model benchmark (python -m fusekit.bench.lm) end to end on the CPU: a tiny LLaMA,
a few stdlib files, eager and checkpointed runs for two steps, and the JSON it writes."""
import json

import pytest
import torch

pytest.importorskip("transformers", reason="the LM benchmark builds its model with transformers")
pytest.importorskip("tokenizers", reason="the LM benchmark trains its tokenizer with tokenizers")

from fusekit.bench import lm, lm_report, lm_runs
from fusekit.bench.lm_data import Batches, Corpus, parse_limit


def test_parse_limit():
    assert parse_limit(None) is None
    assert parse_limit("300") == ("files", 300)
    assert parse_limit("2MB") == ("bytes", 2 << 20)
    with pytest.raises(ValueError, match="corpus-limit"):
        parse_limit("lots")


def test_corpus_is_cached_and_batches_are_seeded(tmp_path):
    a = Corpus(str(tmp_path), vocab=300, limit="20", log=lambda m: None)
    b = Corpus(str(tmp_path), vocab=300, limit="20", log=lambda m: None)
    assert not a.cached and b.cached
    assert a.info["val_files"] == 1 and a.info["train_files"] == 19
    assert bool((a.train_tokens == b.train_tokens).all())
    x, y = Batches(a.train_tokens, 16, seed=3), Batches(b.train_tokens, 16, seed=3)
    assert bool((x.get(5, 4, "cpu") == y.get(5, 4, "cpu")).all())
    assert x.indices(0, x.n) != list(range(x.n))  # shuffled
    assert sorted(x.indices(0, x.n)) == list(range(x.n))  # a permutation per pass


def test_tiny_cpu_run_writes_the_json(tmp_path):
    out = tmp_path / "lm.json"
    doc = lm.main(["--config", "tiny", "--device", "cpu", "--corpus-limit", "40", "--cache", str(tmp_path / "cache"),
                   "--out", str(out), "--runs", "eager,checkpoint,liger", "--precision", "both", "--batches", "2",
                   "--warmup", "1", "--steps", "2", "--train-steps", "2", "--log-every", "1", "--val-batches", "1"])
    on_disk = json.loads(out.read_text())
    assert on_disk["schema"] == lm.SCHEMA == doc["schema"]
    env, cfg = on_disk["environment"], on_disk["config"]
    assert env["device"] == "cpu" and env["versions"]["torch"] and "fusekit" in env
    assert cfg["name"] == "tiny" and cfg["params"] > 0 and cfg["context"] == 64
    assert on_disk["data"]["files"] == 40 and on_disk["data"]["train_tokens"] > 0
    runs = {(r["run"], r["precision"]): r for r in on_disk["runs"]}
    assert runs[("liger", "bf16")]["status"] == "unavailable" and "cpu" in runs[("liger", "bf16")]["message"]
    thr = {(r["run"], r["precision"], r["batch"]): r for r in on_disk["throughput"]}
    assert set(thr) == {(run, p, 2) for run in ("eager", "checkpoint") for p in ("autocast", "bf16")}
    for r in thr.values():
        assert r["status"] == "ok" and r["tokens_per_s"] > 0 and r["peak_bytes"] is None
    train = {(r["run"], r["precision"]): r for r in on_disk["train"]}
    assert len(train) == 4
    for (run, p), r in train.items():
        assert r["status"] == "ok" and [c[0] for c in r["curve"]] == [1, 2] and r["val_loss"] > 0
        # checkpointing recomputes the same function: the same losses as eager
        assert r["step0_loss"] == pytest.approx(train[("eager", p)]["step0_loss"], rel=1e-3)
    table = lm_report.table(on_disk)
    assert "| checkpoint | bf16 |" in table and "val loss" in table


def test_tiny_cpu_lora_section(tmp_path):
    pytest.importorskip("peft", reason="the LoRA section compares with PEFT")
    doc = lm.main(["--config", "tiny", "--device", "cpu", "--corpus-limit", "40", "--cache", str(tmp_path / "cache"),
                   "--out", str(tmp_path / "lm.json"), "--runs", "", "--lora", "--lora-runs", "fusekit,peft",
                   "--lora-precision", "bf16", "--lora-batches", "2", "--warmup", "1", "--steps", "1"])
    rows = {r["run"]: r for r in doc["lora"]}
    assert set(rows) == {"fusekit", "peft"} and not doc["throughput"] and not doc["train"]
    for r in rows.values():
        assert r["status"] == "ok" and r["tokens_per_s"] > 0
    # r (in + out) per projection, r 16, 2 blocks: q, o 64 -> 64; k, v 64 -> 32; gate, up 64 -> 128; down 128 -> 64
    per_block = 2 * (64 + 64) + 2 * (64 + 32) + 3 * (64 + 128)
    assert rows["fusekit"]["trainable_params"] == rows["peft"]["trainable_params"] == 2 * 16 * per_block
    # B = 0 in both: the first step's loss is the frozen model's
    assert rows["fusekit"]["first_loss"] == pytest.approx(rows["peft"]["first_loss"], rel=1e-3)


def test_hook_runs_compress_the_saved_activations(tmp_path):
    """hook8 (the unmodified model under fusekit.compress_saved_tensors) and fusekit_hook4: the
    forward is the uncompressed one (the same first loss), the run trains; a hook on a compiled
    run is refused."""
    doc = lm.main(["--config", "tiny", "--device", "cpu", "--corpus-limit", "40", "--cache", str(tmp_path / "cache"),
                   "--out", str(tmp_path / "lm.json"), "--runs", "eager,hook8,fusekit_hook4,checkpoint_hook4", "--precision", "bf16",
                   "--batches", "2", "--warmup", "1", "--steps", "1", "--train-steps", "3", "--log-every", "1",
                   "--val-batches", "1", "--hook-min-bytes", "4096"])
    thr = {r["run"]: r for r in doc["throughput"]}
    assert "hook" not in thr["eager"]
    for run in ("hook8", "fusekit_hook4"):
        h = thr[run]["hook"]
        # fusekit_hook4: 4 bits, the attention at 8 (attention_bits); hook8: 8 bits everywhere
        assert h["tensors"] > 0 and 0 < h["packed_bytes"] < h["bytes"] / (2.2 if run == "fusekit_hook4" else 1.8), h
        assert set(h["by_bits"]) == ({4, 8} if run == "fusekit_hook4" else {8}), h
    # checkpointing keeps only each block's input, which the hook packs (the recomputation in the
    # backward runs outside the hook)
    assert thr["checkpoint_hook4"]["hook"]["tensors"] > 0 and set(thr["checkpoint_hook4"]["hook"]["by_bits"]) == {4}
    train = {r["run"]: r for r in doc["train"]}
    assert set(train) == {"eager", "hook8", "fusekit_hook4", "checkpoint_hook4"}
    for run in ("hook8", "fusekit_hook4", "checkpoint_hook4"):
        assert train[run]["status"] == "ok" and train[run]["val_loss"] > 0
        assert train[run]["step0_loss"] == pytest.approx(train["eager"]["step0_loss"], rel=2e-2)
    assert train["hook8"]["step0_loss"] == train["eager"]["step0_loss"]  # the forward is not compressed
    with pytest.raises(SystemExit):
        lm.parse(["--runs", "compile_hook4"])
    assert lm_runs.split_hook("fusekit_hook2") == ("fusekit", 2) and lm_runs.split_hook("hook8") == ("eager", 8)
    assert lm_runs.split_hook("compile") == ("compile", None)


def test_fusekit_attn_run_uses_fusekit_attention():
    """fusekit_attn: fusekit.patch(attention=True) on the bench's model; the first loss is the
    fusekit run's (SDPA attention) and eager's."""
    import torch

    cfg, _ = lm_runs.llama_config("tiny")
    x = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    losses = {}
    for run in ("eager", "fusekit", "fusekit_attn"):
        prep = lm_runs.prepare(run, cfg, "cpu", "bf16", 0, None)
        want = "fusekit" if run == "fusekit_attn" else "sdpa"
        assert prep.model.config._attn_implementation == want
        with torch.no_grad():
            losses[run] = float(prep.step_model(input_ids=x, labels=x).loss)
        prep.restore()
    assert losses["fusekit_attn"] == pytest.approx(losses["fusekit"], rel=1e-2)
    assert losses["fusekit_attn"] == pytest.approx(losses["eager"], rel=1e-2)
    assert lm_runs.is_run("fusekit_attn") and lm_runs.is_run("fusekit_attn_compile")


def test_fusekit_attn_runs_are_checked(tmp_path, monkeypatch):
    """fusekit_attn and fusekit_attn_compile record how many fusekit::attention calls a warm-up step
    made (compiled: fusekit's attention in the graph, not SDPA); where the attention falls back to
    SDPA, the run is recorded as failed instead of measured under its name. nomask_compile (SDPA
    with is_causal) runs."""
    from fusekit import hf_attention

    common = ["--config", "tiny", "--device", "cpu", "--corpus-limit", "40", "--cache", str(tmp_path / "cache"),
              "--precision", "bf16", "--batches", "2", "--warmup", "2", "--steps", "1", "--train-steps", "0"]
    runs = "fusekit_attn,fusekit_attn_compile,nomask_compile"
    doc = lm.main(common + ["--out", str(tmp_path / "a.json"), "--runs", runs])
    thr = {r["run"]: r for r in doc["throughput"]}
    layers = lm_runs.CONFIGS["tiny"]["num_hidden_layers"]
    for run in ("fusekit_attn", "fusekit_attn_compile"):
        assert thr[run]["status"] == "ok" and thr[run]["fusekit_attention_calls"] == layers, thr[run]
    assert thr["nomask_compile"]["status"] == "ok" and "fusekit_attention_calls" not in thr["nomask_compile"]
    assert thr["fusekit_attn_compile"]["first_loss"] == pytest.approx(thr["fusekit_attn"]["first_loss"], rel=1e-2)

    monkeypatch.setattr(hf_attention, "fallback_reason", lambda *args, **kwargs: "a test's fallback")
    doc = lm.main(common + ["--out", str(tmp_path / "b.json"), "--runs", "fusekit_attn"])
    row = doc["throughput"][0]
    assert row["status"] == "failed" and "AttentionNotRun" in row["message"] and "tokens_per_s" not in row


def test_profile_idle_time_between_kernels():
    """The GPU timeline of a profiled step: overlapping kernels count once, gaps are the time no
    kernel ran, longest first, named by the kernels around them; CPU events are not kernels."""
    from types import SimpleNamespace as N
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def ev(start, end, name, device=cuda):
        return N(time_range=N(start=start, end=end), name=name, device_type=device)
    prof = N(events=lambda: [ev(0, 10, "a"), ev(5, 12, "b"), ev(15, 20, "c"), ev(20, 21, "d"), ev(30, 31, "e"),
                             ev(21, 29, "host", cpu)])
    got = lm.Bench.idle(prof)
    assert got["span_us"] == 31 and got["idle_us"] == 12
    assert got["gaps"] == [{"us": 9, "after": "d", "before": "e"}, {"us": 3, "after": "b", "before": "c"}]
    assert lm.Bench.idle(N(events=lambda: [])) == {"span_us": 0.0, "idle_us": 0.0, "gaps": []}
