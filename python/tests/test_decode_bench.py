"""The decode benchmark (python -m fusekit.bench.decode) on a tiny LLaMA: the JSON it writes, the
decode loop against transformers' own, its --check of fusekit_w4 and torch_int4 against their
dequantized weights, torch's int4 packing refused when it does not match, and --host-overhead. On
the CPU the decode step runs eagerly; the CUDA-graph tests run where a GPU is."""
import json

import pytest

torch = pytest.importorskip("torch", reason="the decode benchmark needs PyTorch")
pytest.importorskip("transformers", reason="the decode benchmark builds its model with transformers")

from fusekit.bench import decode, decode_report, torch_int4  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA-graph capture of the step)")
TINY = ["--config", "tiny", "--prompt-len", "8", "--new-tokens", "6", "--group-size", "64"]


def _int4_on_cpu() -> bool:
    try:
        torch_int4.Int4Kernel(torch.device("cpu"), 64)
    except torch_int4.Int4Unavailable:
        return False
    return True


def test_tiny_cpu_run_writes_the_json(tmp_path):
    out = tmp_path / "decode.json"
    doc = decode.main(TINY + ["--device", "cpu", "--graph", "none", "--batches", "1,3", "--out", str(out),
                              "--chart", str(tmp_path / "decode.png")])
    on_disk = json.loads(out.read_text())
    assert on_disk["schema"] == decode.SCHEMA == doc["schema"]
    assert on_disk["config"]["layers"] == 2 and on_disk["settings"]["new_tokens"] == 6
    runs = {r["run"]: r for r in on_disk["runs"]}
    assert runs["fp16"]["status"] == runs["fusekit_w4"]["status"] == "ok"
    assert runs["torch_int4"]["status"] == ("ok" if _int4_on_cpu() else "unavailable")
    rows = {(r["run"], r["batch"]): r for r in on_disk["decode"]}
    for (run, b), r in rows.items():
        assert r["status"] == "ok" and r["tokens_per_s"] > 0 and r["ms_per_token"] > 0 and r["peak_bytes"] is None
        assert len(r["first_tokens"]) == 7 and r["kv_cache_bytes"] > 0
    # 14 linear layers of 2 blocks; 4-bit words plus a scale and zero point per 64 weights (under
    # half of f16's bytes at these tiny shapes, which fusekit's layout pads); the LM head stays f16
    assert runs["fp16"]["linear_layers"] == runs["fusekit_w4"]["linear_layers"] == 14
    assert runs["fusekit_w4"]["linear_bytes"] * 2 < runs["fp16"]["linear_bytes"]
    assert runs["fusekit_w4"]["lm_head_bytes"] == runs["fp16"]["lm_head_bytes"] == 512 * 128 * 2
    assert runs["fp16"]["model_bytes"] > runs["fusekit_w4"]["model_bytes"]
    table = decode_report.table(on_disk)
    assert "| fusekit_w4 | float16 |" in table and "batch 3" in table
    pytest.importorskip("matplotlib")
    assert (tmp_path / "decode.png").stat().st_size > 0


def test_decoder_generates_what_a_dynamic_cache_loop_generates():
    """The static-cache step (positions in tensors it advances itself) against transformers'
    DynamicCache driven one token at a time: the same tokens, logits within f16 rounding."""
    cfg = decode.llama_config("tiny")
    model = decode.build_model(cfg, torch.device("cpu"), torch.float16, 0)
    prompt = torch.randint(0, cfg.vocab_size, (3, 8), generator=torch.Generator().manual_seed(1))
    dec = decode.Decoder(model, 3, 8, 6, "none", keep_logits=True)
    got = dec.generate(prompt, 6, lambda: None)
    with torch.no_grad():
        out = model(input_ids=prompt, use_cache=True)
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        logits = [out.logits[:, -1]]
        for _ in range(6):
            step = model(input_ids=logits[-1].argmax(-1, keepdim=True), **{dec.cache_arg: cache}, use_cache=True)
            logits.append(step.logits[:, -1])
    want = torch.stack(logits, 1).float()
    assert torch.equal(got["tokens"], want.argmax(-1))
    torch.testing.assert_close(got["logits"], want, rtol=0, atol=4e-3)  # a few f16 units at |logit| < 1


def test_decode_step_reads_nothing_back_from_the_device():
    """On meta tensors any read of a value (.item(), bool()) raises: the step a CUDA graph captures
    is device work only."""
    cfg = decode.llama_config("tiny")
    model = decode.build_model(cfg, torch.device("meta"), torch.float16, 0)
    dec = decode.Decoder(model, 2, 8, 4, "none", keep_logits=True)
    dec.pos.fill_(8)
    dec.step()
    dec.step()
    assert dec.out.device.type == "meta"


def test_check_passes_for_every_run_on_the_tiny_model():
    doc = decode.main(TINY + ["--device", "cpu", "--graph", "none", "--batches", "1,4", "--new-tokens", "12",
                              "--check"])
    rows = doc["check"]
    runs = {r["run"] for r in rows}
    assert runs == {"fp16", "fusekit_w4", "torch_int4"}
    for r in rows:
        if r["run"] == "torch_int4" and not _int4_on_cpu():
            assert r["status"] == "unavailable"
            continue
        assert r["status"] == "ok", r
        assert r["tokens"] == r["batch"] * 13 and r["max_logit_diff"] <= r["tol"]
    assert "| fusekit_w4 | 4 | ok |" in decode_report.check_table(doc)


def test_compare_catches_wrong_logits_and_unexplained_divergence():
    logits = torch.tensor([[[3.0, 1.0, 0.0], [0.0, 2.0, 1.99], [1.0, 0.0, 3.0]]])  # [B 1, steps 3, V 3]
    ref = {"tokens": logits.argmax(-1), "logits": logits}
    assert decode.compare(ref, ref, torch.float16)["status"] == "ok"
    near_tie = logits.clone()
    near_tie[0, 1, 2] = 2.01  # step 1 flips between two logits 0.01 apart: a near tie
    got = {"tokens": near_tie.argmax(-1), "logits": near_tie}
    r = decode.compare(got, ref, torch.float16)
    assert r["status"] == "ok" and r["diverged_at"] == [1]
    wrong = logits.clone()
    wrong[0, 0] = torch.tensor([0.0, 3.0, 1.0])  # a different token at step 0, far from a tie
    assert decode.compare({"tokens": wrong.argmax(-1), "logits": wrong}, ref, torch.float16)["status"] == "mismatch"


def test_int4_packing_that_does_not_match_is_refused(monkeypatch):
    if not _int4_on_cpu():
        pytest.skip("this torch has no CPU int4 kernel")
    real = torch_int4.Int4Kernel.pack
    monkeypatch.setattr(torch_int4.Int4Kernel, "pack", lambda self, q: real(self, q.flip(1)))
    with pytest.raises(torch_int4.Int4Unavailable, match="take none of the weight forms.*away from x w̃ᵀ"):
        torch_int4.Int4Kernel(torch.device("cpu"), 64)


def test_host_overhead_reports_every_call():
    doc = decode.main(["--device", "cpu", "--graph", "none", "--host-overhead", "--host-shape", "64,128"])
    h = doc["host_overhead"]
    cases = {(r["case"], r["rows"]) for r in h["rows"]}
    assert ("W4Linear(x)", 1) in cases and ("F.linear(x, w)", 0) in cases and len(cases) == 10
    assert all(r["host_us"] > 0 for r in h["rows"] if "note" not in r)
    assert "| W4Linear(x) | 0 |" in decode_report.host_table(doc)


@cuda
def test_cuda_graph_decoding_matches_eager_for_every_run():
    doc = decode.main(TINY + ["--device", "cuda", "--graph", "capture", "--batches", "1,16", "--new-tokens", "16",
                              "--check"])
    for r in doc["check"]:
        assert r["status"] == "ok", r


@cuda
def test_tiny_cuda_run_and_host_overhead(tmp_path):
    doc = decode.main(TINY + ["--device", "cuda", "--graph", "capture", "--batches", "1,4", "--out",
                              str(tmp_path / "d.json")])
    for r in doc["decode"]:
        assert r["status"] == "ok" and r["peak_bytes"] >= r["kv_cache_bytes"], r
    doc = decode.main(["--device", "cuda", "--host-overhead", "--host-shape", "1024,1024"])
    assert all("device_us" in r for r in doc["host_overhead"]["rows"] if "note" not in r and r["rows"] == 1)
