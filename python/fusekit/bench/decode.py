"""python -m fusekit.bench.decode: greedy decoding of a Hugging Face LLaMA of LLaMA-2-7B's shapes
(random weights, nothing downloaded), its linear layers in fp16, in fusekit's 4-bit W4Linear and in
torch's own int4 kernel, one run after another in one process on one GPU (issue 41).

Runs (--runs):
- fp16: the model as built, f16 throughout;
- fusekit_w4: fusekit.quantize(model, bits=4, group_size=--group-size): every linear layer but the
  LM head a W4Linear (f16);
- torch_int4: the same layers through aten._weight_int4pack_mm, quantized and packed as gpt-fast
  and torchao's int4 weight-only path do (fusekit/bench/torch_int4.py); that kernel takes bf16
  activations only, so this run's model is bf16.
The model is built on the device in its dtype (13.5 GB of fp16 for 7b never crosses the host),
from the same seed in every run.

Per run and batch (--batches): a prompt of --prompt-len random tokens (the same in every run) is
prefilled eagerly into transformers' StaticCache, then --new-tokens greedy decode steps each add
one token per sequence. --graph capture (the default on CUDA): one decode step captured in a CUDA
graph (torch.cuda.CUDAGraph) over static input buffers that the step itself advances, replayed
per token; compile: the step under torch.compile(mode="reduce-overhead"); none: eager. Time per
token: the decode loop's wall time (synchronized before and after) over its steps; tokens/s:
batch x steps over that time; the prefill is timed apart. Memory: bytes of the parameters and
buffers of the quantized linear layers, of the LM head and of the whole model; the KV cache's
bytes; torch.cuda.max_memory_allocated() over prefill and decode.

--check: each run's decoding against a reference model holding the run's dequantized weights in
nn.Linear layers (fp16's reference is the same model, eager): the logits of every step agree
within a tolerance from the dtype, and the greedy tokens agree up to the first step whose
reference logits have a top-2 gap within twice that tolerance (a near tie the rounding may break
either way). Exit status 1 on a mismatch. --host-overhead: microseconds of host time per eager
call of W4Linear against nn.Linear, F.linear, the registered op and torch's int4 layer, nothing
else (the decode runs are skipped).

Writes --out (JSON, rewritten after every measurement) and prints markdown tables; --chart draws
tokens/s per run and batch (scripts/decode-chart.py redraws it from the JSON).

    python -m fusekit.bench.decode --config 7b --new-tokens 64 --out decode.json --chart decode.png
    python -m fusekit.bench.decode --config tiny --check
    python -m fusekit.bench.decode --host-overhead
"""
from __future__ import annotations

import argparse
import inspect
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F
from torch import nn

import fusekit

from . import decode_report
from .bench_base import BenchBase
from .lm_runs import RunUnavailable
from .torch_int4 import Int4Linear, Int4Unavailable, quantize_model

SCHEMA = "fusekit-bench-decode/1"
RUNS = ["fp16", "fusekit_w4", "torch_int4"]
RUN_DTYPE = {"fp16": torch.float16, "fusekit_w4": torch.float16, "torch_int4": torch.bfloat16}
# LLaMA-2-7B's shapes, and a model of the same form small enough for tests (every quantized
# layer's K a multiple of 128, as torch's int4 kernel asks).
CONFIGS = {
    "7b": {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096},
    "tiny": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 4, "vocab_size": 512, "max_position_embeddings": 1024},
}
WARMUP = 3  # decode steps before a capture (or a compile's recording); the cache holds them too
LINEARS = (nn.Linear, fusekit.nn.W4Linear, Int4Linear)
# Logit tolerance of --check, times the largest reference logit: the run and its reference
# multiply the same weights and differ only in the order of the fp32 sums and where they round
# to f16 / bf16, a few units in the last place per layer; 1/64 (f16) and 1/16 (bf16) hold a
# 2-layer model with room to spare and still catch a wrong weight or position (errors of the
# logits' own size).
CHECK_TOL = {torch.float16: 2.0 ** -6, torch.bfloat16: 2.0 ** -4}


def csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def llama_config(name: str, layers: int | None = None):
    from transformers import LlamaConfig

    c = dict(CONFIGS[name])
    if layers:
        c["num_hidden_layers"] = layers
    cfg = LlamaConfig(**c, rms_norm_eps=1e-5, tie_word_embeddings=False, attn_implementation="sdpa")
    cfg._attn_implementation = "sdpa"
    return cfg


def build_model(cfg, device: torch.device, dtype: torch.dtype, seed: int) -> nn.Module:
    """LlamaForCausalLM(cfg) made on `device` with `dtype` parameters (as torch's default dtype
    while it is built: no f32 copy, nothing through the host), from `seed`."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    for p in model.parameters():  # a version that made some in f32 anyway (buffers such as rotary's stay f32)
        if p.dtype != dtype:
            p.data = p.data.to(dtype)
    return model.eval().requires_grad_(False)


def prepare(run: str, cfg, device, group: int, seed: int, dequantized: dict | None = None) -> nn.Module:
    """The run's model; with `dequantized`, the weight w̃ each quantized layer multiplies by goes
    there under the layer's qualified name."""
    model = build_model(cfg, device, RUN_DTYPE[run], seed)
    if run == "fusekit_w4":
        fusekit.quantize(model, bits=4, group_size=group)
        if dequantized is not None:
            dequantized.update({n: m.dequantized_weight() for n, m in model.named_modules()
                                if isinstance(m, fusekit.nn.W4Linear)})
    elif run == "torch_int4":
        try:
            quantize_model(model, group, dequantized=dequantized)
        except Int4Unavailable as e:
            raise RunUnavailable(f"torch's int4 kernel: {e}") from None
    return model


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def weight_bytes(model: nn.Module) -> dict:
    """Parameters and buffers of the linear layers (the LM head apart) and of the whole model."""
    linear = head = layers = 0
    for name, m in model.named_modules():
        if isinstance(m, LINEARS):
            b = nbytes(m.parameters(recurse=False)) + nbytes(m.buffers(recurse=False))
            if name == "lm_head":
                head += b
            else:
                linear, layers = linear + b, layers + 1
    return {"linear_bytes": linear, "linear_layers": layers, "lm_head_bytes": head,
            "model_bytes": nbytes(model.parameters()) + nbytes(model.buffers())}


def static_cache(cfg, batch: int, length: int, device, dtype):
    """transformers' StaticCache for `batch` sequences of `length` tokens, allocated now (the
    constructor's arguments differ across transformers versions: those it has are passed)."""
    from transformers import StaticCache

    params = inspect.signature(StaticCache.__init__).parameters
    kw = {"config": cfg, "max_cache_len": length}
    batch_arg = next((a for a in ("max_batch_size", "batch_size") if a in params), None)  # 4.x; 5.x sizes lazily
    if batch_arg:
        kw[batch_arg] = batch
    for name, value in (("device", device), ("dtype", dtype)):
        if name in params:
            kw[name] = value
    cache = StaticCache(**kw)
    if hasattr(cache, "early_initialization"):
        heads, head_dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
        try:
            cache.early_initialization(batch_size=batch, num_heads=heads, head_dim=head_dim, dtype=dtype, device=device)
        except TypeError:  # another signature: the prefill allocates it instead
            pass
    return cache


class Decoder:
    """Greedy decoding of `model` for `batch` sequences: an eager prefill into a static KV cache,
    then one step per token on static buffers (the input token and its position) that the step
    advances itself, so that one captured step, replayed, decodes. `graph`: "capture", "compile"
    or "none" (module docstring). With keep_logits, each step's last logits are kept too."""

    def __init__(self, model: nn.Module, batch: int, prompt_len: int, new_tokens: int, graph: str,
                 keep_logits: bool = False):
        cfg = model.config
        emb = model.get_input_embeddings().weight
        device, dtype = emb.device, emb.dtype
        self.model, self.graph, self.prompt_len = model, graph, prompt_len
        length = prompt_len + new_tokens + WARMUP
        self.cache = static_cache(cfg, batch, length, device, dtype)
        self.kv_cache_bytes = (2 * cfg.num_hidden_layers * batch * cfg.num_key_value_heads * length
                               * (cfg.hidden_size // cfg.num_attention_heads) * emb.element_size())
        fwd = inspect.signature(model.forward).parameters
        self.cache_arg = "cache" if "cache" in fwd else "past_key_values"  # renamed in transformers 5
        self.pass_cache_position = "cache_position" in fwd
        self.keep_arg = next((a for a in ("logits_to_keep", "num_logits_to_keep") if a in fwd), None)
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)  # the step's input token per sequence
        self.pos = torch.zeros(1, dtype=torch.long, device=device)  # its position
        self.out = torch.zeros(batch, new_tokens + 1 + WARMUP, dtype=torch.long, device=device)  # prefill's token first
        self.logits = torch.zeros(batch, cfg.vocab_size, device=device) if keep_logits else None
        self.run_step = self.step  # prepare() puts the captured or compiled step here

    def forward(self, tokens, positions):
        """The last position's logits [B, V] of tokens [B, S] at positions [S], the cache updated."""
        kw = {self.cache_arg: self.cache, "use_cache": True,
              "position_ids": positions.unsqueeze(0).expand(tokens.shape[0], -1)}
        if self.pass_cache_position:
            kw["cache_position"] = positions
        if self.keep_arg:
            kw[self.keep_arg] = 1
        return self.model(input_ids=tokens, **kw).logits[:, -1]

    def step(self) -> None:
        """One decode step, device work only (nothing read back): the token after self.tokens."""
        logits = self.forward(self.tokens, self.pos)
        nxt = logits.argmax(-1, keepdim=True)
        if self.logits is not None:
            self.logits.copy_(logits)
        self.out.index_copy_(1, self.pos - (self.prompt_len - 1), nxt)
        self.tokens.copy_(nxt)
        self.pos.add_(1)

    @torch.no_grad()
    def prefill(self, prompt) -> None:
        self.cache.reset()
        logits = self.forward(prompt, torch.arange(prompt.shape[1], device=prompt.device))
        nxt = logits.argmax(-1, keepdim=True)
        if self.logits is not None:
            self.logits.copy_(logits)
        self.out[:, :1] = nxt
        self.tokens.copy_(nxt)
        self.pos.fill_(prompt.shape[1])

    @torch.no_grad()
    def prepare(self, prompt) -> None:
        """Makes run_step: a prefill first (transformers may allocate the cache lazily), then the
        warm-up steps and the capture or compile. The caller's next prefill resets the cache."""
        self.prefill(prompt)
        if self.graph == "capture":
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(WARMUP):
                    self.step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.step()
            self.run_step = graph.replay
        elif self.graph == "compile":
            for t in (self.tokens, self.pos, self.out) + ((self.logits,) if self.logits is not None else ()):
                torch._dynamo.mark_static_address(t)  # mutated by the step: cudagraphs keep their addresses
            compiled = torch.compile(self.step, mode="reduce-overhead")

            def run_step():
                torch.compiler.cudagraph_mark_step_begin()
                compiled()
            for _ in range(WARMUP):
                run_step()
            self.run_step = run_step

    @torch.no_grad()
    def generate(self, prompt, steps: int, sync) -> dict:
        """Prefill, then `steps` decode steps, each timed loop synchronized: the tokens [B, 1 + steps]
        (the prefill's first), seconds of each, and with keep_logits the logits [B, 1 + steps, V]."""
        sync()
        t0 = time.perf_counter()
        self.prefill(prompt)
        sync()
        t1 = time.perf_counter()
        kept = [self.logits.clone()] if self.logits is not None else None
        for _ in range(steps):
            self.run_step()
            if kept is not None:
                kept.append(self.logits.clone())
        sync()
        t2 = time.perf_counter()
        return {"tokens": self.out[:, :steps + 1].clone(), "prefill_s": t1 - t0, "decode_s": t2 - t1,
                "logits": torch.stack(kept, 1) if kept is not None else None}


def compare(run: dict, ref: dict, dtype: torch.dtype) -> dict:
    """--check's verdict on a run's tokens and logits against its reference's (module docstring)."""
    tokens, ref_tokens = run["tokens"].cpu(), ref["tokens"].cpu()
    logits, ref_logits = run["logits"].float().cpu(), ref["logits"].float().cpu()
    scale = ref_logits.abs().max().item()
    tol = CHECK_TOL[dtype] * scale
    top2 = ref_logits.topk(2, dim=-1).values
    gap = top2[..., 0] - top2[..., 1]  # [B, steps]
    worst, diverged, ok = 0.0, [], True
    for b in range(tokens.shape[0]):
        differ = (tokens[b] != ref_tokens[b]).nonzero()
        first = int(differ[0]) if len(differ) else tokens.shape[1]
        upto = min(first + 1, tokens.shape[1])  # the inputs agree through the first differing step
        worst = max(worst, (logits[b, :upto] - ref_logits[b, :upto]).abs().max().item())
        if first < tokens.shape[1]:
            diverged.append(first)
            ok = ok and gap[b, first].item() <= 2 * tol
    ok = ok and worst <= tol
    return {"status": "ok" if ok else "mismatch", "max_logit_diff": worst, "tol": tol, "logit_scale": scale,
            "tokens": tokens.numel(), "tokens_equal": int((tokens == ref_tokens).sum()), "diverged_at": diverged}


class Bench(BenchBase):
    def __init__(self, args):
        super().__init__(args)
        self.cfg = llama_config(args.config, args.layers)
        c = self.cfg
        gen = torch.Generator().manual_seed(args.seed)
        self.prompts = torch.randint(0, c.vocab_size, (max(args.batch_list), args.prompt_len), generator=gen)
        self.doc = {
            "schema": SCHEMA,
            "command": [os.path.basename(sys.executable), "-m", "fusekit.bench.decode"] + sys.argv[1:],
            "environment": self.environment(),
            "config": {"name": args.config, "layers": c.num_hidden_layers, "hidden": c.hidden_size,
                       "intermediate": c.intermediate_size, "heads": c.num_attention_heads,
                       "kv_heads": c.num_key_value_heads, "vocab": c.vocab_size, "attention": "sdpa"},
            "settings": {k: v for k, v in vars(args).items() if k != "out"} | {"warmup_steps": WARMUP},
            "runs": [], "decode": [], "check": [],
        }

    @staticmethod
    def failure(e: BaseException) -> dict:
        msg = f"{type(e).__name__}: {e}"
        if isinstance(e, torch.OutOfMemoryError) or "out of memory" in msg.lower():
            return {"status": "oom", "message": msg[:500]}
        if isinstance(e, RunUnavailable):
            return {"status": "unavailable", "message": str(e)[:1000]}
        traceback.print_exc()
        return {"status": "failed", "message": msg[:1000]}

    def prompt(self, batch: int):
        return self.prompts[:batch].to(self.device)

    def measure(self, model, run: str, batch: int) -> dict:
        a = self.args
        row = {"run": run, "batch": batch, "graph": a.graph, "prompt_len": a.prompt_len, "steps": a.new_tokens,
               "status": "ok"}
        dec = None
        try:
            t = time.perf_counter()
            dec = Decoder(model, batch, a.prompt_len, a.new_tokens, a.graph)
            dec.prepare(self.prompt(batch))
            self.sync()
            row["prepare_s"] = round(time.perf_counter() - t, 3)
            if self.cuda:
                torch.cuda.reset_peak_memory_stats(self.device)
            g = dec.generate(self.prompt(batch), a.new_tokens, self.sync)
            row |= {"prefill_ms": g["prefill_s"] * 1e3, "ms_per_token": g["decode_s"] / a.new_tokens * 1e3,
                    "tokens_per_s": batch * a.new_tokens / g["decode_s"], "kv_cache_bytes": dec.kv_cache_bytes,
                    "peak_bytes": torch.cuda.max_memory_allocated(self.device) if self.cuda else None,
                    "first_tokens": g["tokens"][0, :8].tolist()}
        except Exception as e:  # noqa: BLE001  recorded: oom is a result, anything else a failure
            row |= self.failure(e)
        dec = None
        self.free()
        return row

    def run(self, run: str) -> None:
        info = {"run": run, "dtype": str(RUN_DTYPE[run]).replace("torch.", ""), "status": "ok"}
        self.doc["runs"].append(info)
        model = None
        try:
            t = time.perf_counter()
            model = prepare(run, self.cfg, self.device, self.args.group_size, self.args.seed)
            self.sync()
            info |= {"setup_s": round(time.perf_counter() - t, 2)} | weight_bytes(model)
            self.log(f"decode: {run}: set up in {info['setup_s']} s, linear layers "
                     f"{info['linear_bytes'] / 2**30:.2f} GiB, model {info['model_bytes'] / 2**30:.2f} GiB")
            for b in self.args.batch_list:
                row = self.measure(model, run, b)
                self.doc["decode"].append(row)
                self.write()
                self.log(f"decode: {run} batch {b}: {decode_report.cell(row)}")
        except Exception as e:  # noqa: BLE001
            info |= self.failure(e)
            self.log(f"decode: {run}: {info['status']}: {info['message']}")
        finally:
            self.write()
            model = None
            if self.args.graph == "compile":
                torch._dynamo.reset()
            self.free()

    def check(self, run: str) -> None:
        a, dtype = self.args, RUN_DTYPE[run]
        model = ref = None
        try:
            deq = {}
            model = prepare(run, self.cfg, self.device, a.group_size, a.seed, deq)
            if run == "fp16":
                ref = model
            else:
                ref = build_model(self.cfg, self.device, dtype, a.seed)
                for name, w in deq.items():
                    ref.get_submodule(name).weight.copy_(w)
            for b in a.batch_list:
                dec = Decoder(model, b, a.prompt_len, a.new_tokens, a.graph, keep_logits=True)
                dec.prepare(self.prompt(b))
                got = dec.generate(self.prompt(b), a.new_tokens, self.sync)
                dec = Decoder(ref, b, a.prompt_len, a.new_tokens, "none", keep_logits=True)
                want = dec.generate(self.prompt(b), a.new_tokens, self.sync)
                dec = None
                row = {"run": run, "batch": b, "graph": a.graph} | compare(got, want, dtype)
                self.doc["check"].append(row)
                self.log(f"decode: check {run} batch {b}: {row['status']}, logits within {row['max_logit_diff']:.3g} "
                         f"(tolerance {row['tol']:.3g}), tokens {row['tokens_equal']}/{row['tokens']} equal")
        except Exception as e:  # noqa: BLE001
            self.doc["check"].append({"run": run} | self.failure(e))
            self.log(f"decode: check {run}: {self.doc['check'][-1]['status']}: {self.doc['check'][-1]['message']}")
        finally:
            self.write()
            model = ref = None
            if a.graph == "compile":
                torch._dynamo.reset()
            self.free()

    def main(self) -> None:
        a = self.args
        if a.host_overhead:
            self.doc["host_overhead"] = host_overhead(self.device, *a.host_shape, a.group_size)
            self.write()
            print("\n" + decode_report.host_table(self.doc) + "\n", flush=True)
            return
        for run in a.run_list:
            if a.check:
                self.check(run)
            else:
                self.run(run)
        self.write()
        print("\n" + (decode_report.check_table(self.doc) if a.check else decode_report.table(self.doc)) + "\n",
              flush=True)
        if a.chart and not a.check:
            self.log(f"decode: chart {decode_report.chart(self.doc, a.chart) or 'not drawn (no matplotlib)'}")
        if a.out:
            self.log(f"decode: wrote {a.out} ({self.doc['seconds']} s)")


@torch.no_grad()
def host_overhead(device: torch.device, n: int, k: int, group: int, calls: int = 200, rounds: int = 20) -> dict:
    """Microseconds of host time per eager call (no gradient recorded, as decoding runs): the best
    of `rounds` loops of `calls` back-to-back calls, timed from the first call's start to the last
    call's return without waiting for the device (the launch queue holds them all), for x [rows, 1,
    K] as a decode step hands it over, rows 1 and 0 (0: the call's work without a kernel). On CUDA
    also the device time per call at rows 1 (a CUDA graph of `calls` calls replayed). On the CPU the calls
    are synchronous: the time includes the CPU kernels' own work."""
    from ..overhead import _device_per_call

    cuda = device.type == "cuda"
    torch.manual_seed(0)
    lin = nn.Linear(k, n, bias=False, device=device, dtype=torch.float16)
    w4 = fusekit.nn.W4Linear.from_linear(lin, group)
    try:
        int4 = quantize_model(nn.Sequential(nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)), group,
                              skip=())[0]
    except Int4Unavailable as e:
        int4 = f"unavailable: {e}"
    rows = []
    for m in (1, 0):
        x = torch.randn(m, 1, k, device=device, dtype=torch.float16)
        xb = x.to(torch.bfloat16)
        cases = {"W4Linear(x)": lambda: w4(x), "nn.Linear(x)": lambda: lin(x),
                 "F.linear(x, w)": lambda: F.linear(x, lin.weight),
                 "torch.ops.fusekit.qgemm(x, ...)": lambda: torch.ops.fusekit.qgemm(x, w4.packed, w4.scale, w4.zero,
                                                                                     n, k, group),
                 "torch int4 layer (x bf16)": int4 if isinstance(int4, str) else (lambda: int4(xb))}
        if m == 0 and not isinstance(int4, str) and cuda:
            # aten._weight_int4pack_mm launches an empty grid for 0 rows: CUDA's "invalid argument"
            cases["torch int4 layer (x bf16)"] = "not timed: torch's int4 kernel fails on 0 rows on CUDA"
        for name, fn in cases.items():
            row = {"case": name, "rows": m}
            if isinstance(fn, str):
                rows.append(row | {"note": fn})
                continue
            for _ in range(20):
                fn()
            best = float("inf")
            for _ in range(rounds):
                if cuda:
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                best = min(best, time.perf_counter() - t0)
            row["host_us"] = best / calls * 1e6
            if cuda and m:  # (no rows: no kernel, nothing for a graph to hold)
                torch.cuda.synchronize(device)
                row["device_us"] = _device_per_call(fn, calls) * 1e6
            rows.append(row)
    return {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "n": n, "k": k, "group": group,
            "calls": calls, "rounds": rounds, "rows": rows}


def parse(argv=None):
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(prog="python -m fusekit.bench.decode", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="7b", choices=sorted(CONFIGS))
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the config's)")
    ap.add_argument("--device", default="cuda" if cuda else "cpu")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of {','.join(RUNS)}")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128, help="decode steps timed (one token per sequence each)")
    ap.add_argument("--graph", default="capture" if cuda else "none", choices=["capture", "compile", "none"])
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", action="store_true", help="compare each run with its dequantized reference instead "
                                                        "of timing (use --config tiny)")
    ap.add_argument("--host-overhead", action="store_true", help="time eager calls of one layer instead of decoding")
    ap.add_argument("--host-shape", default=None,
                    help="N,K of --host-overhead's layer (default 4096,4096 on CUDA, 128,128 on the CPU)")
    ap.add_argument("--out", default=None, help="the JSON written (and rewritten after every measurement)")
    ap.add_argument("--chart", default=None, help="a PNG of tokens/s per run and batch (needs matplotlib)")
    a = ap.parse_args(argv)
    a.batch_list = [int(b) for b in csv(a.batches)]
    a.run_list = csv(a.runs)
    bad = [r for r in a.run_list if r not in RUNS]
    if bad:
        ap.error(f"--runs: unknown {', '.join(bad)}; expected {', '.join(RUNS)}")
    if a.graph != "none" and torch.device(a.device).type != "cuda":
        ap.error(f"--graph {a.graph} needs CUDA (device {a.device}); use --graph none")
    shape = a.host_shape or ("4096,4096" if torch.device(a.device).type == "cuda" else "128,128")
    a.host_shape = tuple(int(v) for v in csv(shape))
    return a


def main(argv=None) -> dict:
    bench = Bench(parse(argv))
    bench.main()
    return bench.doc


if __name__ == "__main__":
    sys.exit(1 if any(r["status"] != "ok" for r in main()["check"]) else 0)
