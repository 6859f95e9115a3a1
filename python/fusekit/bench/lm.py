"""python -m fusekit.bench.lm: train a Hugging Face LLaMA on real text, the same model under each
way a user speeds it up or fits it in memory, in one process on one GPU, on the same data order.

Runs (--runs): eager, compile (torch.compile over the model), liger (Liger-Kernel's RMSNorm,
SwiGLU, rotary and fused linear cross-entropy), liger_compile, checkpoint (every block),
fusekit (fusekit.patch), fusekit_compile, fusekit_attn (fusekit.patch(attention=True): fusekit
attention in place of SDPA as well), fusekit_attn_compile. Precisions (--precision): autocast (f32 parameters,
bf16 autocast) and bf16 (bf16 parameters, no autocast). Every run: AdamW (fused on CUDA), the loss
as Hugging Face computes it (model(input_ids, labels=input_ids).loss), the same initial weights.

Per run and precision, in this order:
1. training (--train-steps at --train-batch, from the first batch of the seeded order; linear
   warm-up then cosine learning rate): the loss curve every --log-every steps, then the
   validation loss over --val-batches held-out batches (the uncompiled module, eval mode);
2. throughput at each of --batches: --warmup steps, then --steps timed steps
   (torch.cuda.synchronize around them): tokens/s and peak torch.cuda.max_memory_allocated()
   (reset per batch); out of memory is a result ("oom"), not a crash;
3. with --find-max-batch: the largest batch that fits (doubling from the largest that fitted,
   then bisection to --max-batch-step, at most --max-batch-limit; --probe-steps steps each) and
   the allocation that failed at the first batch that did not.
--profile N adds, after each batch's timed steps, one step under torch.profiler: its N costliest
kernels (name, calls, GPU time) in the log and the JSON.
--lora adds a LoRA fine-tune (r 16, alpha 32, every projection, the base frozen): fusekit's
LoRALinear against PEFT, eager and compiled, tokens/s and peak memory at --lora-batches.

The data (python stdlib sources, a BPE tokenizer trained on them) are described in lm_data.py.
Writes --out (JSON, rewritten after every measurement, so a run cut short keeps what it measured)
and prints a markdown table; scripts/lm-charts.py draws the charts from the JSON.

    python -m fusekit.bench.lm --config small --out lm.json [--runs eager,compile,...]
        [--precision autocast|bf16|both] [--batches 64,128] [--find-max-batch] [--lora]
    python -m fusekit.bench.lm --config tiny --device cpu --corpus-limit 40 --steps 2 ...  (CI)
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import sys
import time
import traceback

import torch

import fusekit

from . import lm_report
from .bench_base import BenchBase
from .lm_data import Batches, Corpus
from .lm_runs import (DEFAULT_RUNS, DEFAULTS, HOOK_RUNS, LORA_RUNS, RUNS, RunUnavailable, attention_check, is_run,
                      llama_config, param_count, prepare, prepare_lora)

SCHEMA = "fusekit-bench-lm/1"


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def oom_alloc(msg: str) -> str | None:
    """The allocation that failed, from PyTorch's message ("Tried to allocate 1.95 GiB")."""
    m = re.search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", msg)
    return m.group(1) if m else None


def csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def precisions(s: str) -> list[str]:
    return ["autocast", "bf16"] if s == "both" else csv(s)


class Bench(BenchBase):
    def __init__(self, args):
        super().__init__(args)
        self.cfg, self.context = llama_config(args.config, args.vocab)
        self.params = param_count(self.cfg)
        self.hook_stats = None  # the last step's fusekit.compress_saved_tensors stats, in hook runs
        self.corpus = Corpus(args.cache, vocab=self.cfg.vocab_size, limit=args.corpus_limit, log=self.log)
        self.train_data = Batches(self.corpus.train_tokens, self.context, seed=args.seed)
        self.val_data = Batches(self.corpus.val_tokens, self.context, shuffled=False)
        c = self.cfg
        self.doc = {
            "schema": SCHEMA, "command": [os.path.basename(sys.executable), "-m", "fusekit.bench.lm"] + sys.argv[1:],
            "environment": self.environment(),
            "config": {"name": args.config, "params": self.params, "hidden": c.hidden_size,
                       "intermediate": c.intermediate_size, "layers": c.num_hidden_layers,
                       "heads": c.num_attention_heads, "kv_heads": c.num_key_value_heads, "context": self.context,
                       "vocab": c.vocab_size, "attention": "sdpa", "tied_embeddings": False},
            "data": self.corpus.info,
            "settings": {k: v for k, v in vars(args).items() if k not in ("out",)} | {
                "optimizer": "torch.optim.AdamW(betas=(0.9, 0.95), weight_decay=0.1, fused on CUDA)",
                "grad_clip": None, "lr_schedule": "linear warm-up over lr_warmup steps, cosine to 0.1 lr",
                "compile": f"torch.compile(model, dynamic={args.dynamic})" + (
                    ", input batch dimension marked dynamic (one compile for every batch size)"
                    if args.dynamic_batch else ""),
                "lora": "r 16, alpha 32, dropout 0, q/k/v/o/gate/up/down, adapters in the base dtype"},
            "runs": [], "train": [], "throughput": [], "max_batch": [], "lora": [],
        }
        self.log(f"lm: config {args.config}: {self.params / 1e6:.1f}M parameters, context {self.context}, "
                 f"vocabulary {c.vocab_size}; corpus {self.corpus.info['files']} files, "
                 f"{self.corpus.info['train_tokens'] / 1e6:.2f}M training tokens, "
                 f"{self.corpus.info['val_tokens'] / 1e6:.3f}M validation tokens "
                 f"({'cached' if self.corpus.cached else 'built'} in {self.corpus.seconds:.1f} s)")
        self.write()

    def reset_peak(self) -> int | None:
        if not self.cuda:
            return None
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device)

    def peak(self) -> int | None:
        return torch.cuda.max_memory_allocated(self.device) if self.cuda else None

    def amp(self, precision: str):
        if precision == "autocast":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def optimizer(self, model):
        params = [p for p in model.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                                 fused=True if self.cuda else None)

    def step(self, prep, opt, precision: str, x: torch.Tensor) -> torch.Tensor:
        if self.args.dynamic_batch:
            torch._dynamo.maybe_mark_dynamic(x, 0)
        with self.amp(precision), prep.context() as hook:
            loss = prep.step_model(input_ids=x, labels=x).loss
        if hook is not None:
            self.hook_stats = dict(hook.stats)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    def failure(self, e: BaseException) -> dict:
        msg = f"{type(e).__name__}: {e}"
        if is_oom(e):
            return {"status": "oom", "oom_alloc": oom_alloc(msg), "message": msg[:500]}
        traceback.print_exc()
        return {"status": "failed", "message": msg[:1000]}

    # --- phases -------------------------------------------------------------------------------

    def measure(self, prep, opt, precision: str, batch: int, warmup: int, steps: int) -> dict:
        """--warmup then --steps training steps at `batch`: tokens/s over the timed steps, peak
        memory over all of them."""
        self.free()
        row = {"batch": batch, "tokens_per_step": batch * self.context, "status": "ok",
               "resident_bytes": self.reset_peak()}
        self.hook_stats = None
        loss = None
        try:
            t = time.perf_counter()
            # a fusekit-attention run: the second warm-up step (compiled by then) must run the op
            check = 1 if getattr(prep, "fusekit_attention", False) else None
            if check is not None and warmup < 2:
                row["attention_check"] = "skipped: --warmup < 2"
            for i in range(warmup):
                with attention_check(prep.run) if i == check else contextlib.nullcontext() as checked:
                    loss = self.step(prep, opt, precision, self.train_data.get(i, batch, self.device))
                if checked is not None:
                    row["fusekit_attention_calls"] = checked["calls"]
                if i == 0:
                    row["first_loss"] = float(loss)
                    row["first_step_s"] = round(time.perf_counter() - t, 3)
            self.sync()
            t0 = time.perf_counter()
            for i in range(steps):
                loss = self.step(prep, opt, precision, self.train_data.get(warmup + i, batch, self.device))
            self.sync()
            dt = time.perf_counter() - t0
            if steps:
                row |= {"step_s": dt / steps, "tokens_per_s": batch * self.context * steps / dt, "loss": float(loss)}
            if self.hook_stats is not None:  # what the hook packed in the last step
                row["hook"] = self.hook_stats
            if self.args.profile and self.cuda:
                row["profile"] = self.profile(prep, opt, precision, batch, warmup + steps)
        except Exception as e:  # noqa: BLE001  recorded: oom is a result, anything else a failure
            row |= self.failure(e)
        loss = None
        opt.zero_grad(set_to_none=True)
        row["peak_bytes"] = self.peak()
        if row["status"] != "ok":
            row["peak_bytes"] = None
        self.free()
        return row

    def profile(self, prep, opt, precision: str, batch: int, at: int) -> list[dict]:
        """One more step under torch.profiler: the --profile kernels with the most GPU time in it
        (name, calls, total µs), printed and returned; not part of the timed steps."""
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            self.step(prep, opt, precision, self.train_data.get(at, batch, self.device))
            self.sync()
        rows = [{"kernel": e.key[:160], "calls": e.count, "us": round(e.device_time_total, 1)}
                for e in prof.key_averages() if e.device_time_total > 0]
        rows.sort(key=lambda r: -r["us"])
        total = sum(r["us"] for r in rows)
        idle = self.idle(prof)
        self.log(f"lm: profile, batch {batch}: {total / 1e3:.2f} ms of kernels in one step; the GPU idle "
                 f"{idle['idle_us'] / 1e3:.2f} ms between its first and last kernel ({idle['span_us'] / 1e3:.2f} ms)")
        for r in rows[:self.args.profile]:
            self.log(f"  {r['us'] / 1e3:8.3f} ms {100 * r['us'] / total:5.1f}% {r['calls']:5d}x  {r['kernel'][:110]}")
        for g in idle["gaps"]:
            self.log(f"  idle {g['us']:8.1f} us after {g['after'][:60]} before {g['before'][:60]}")
        return [{"total_us": round(total, 1)} | idle] + rows[:self.args.profile]

    @staticmethod
    def idle(prof, top: int = 8) -> dict:
        """The profiled step's GPU timeline: span from its first kernel's start to its last one's
        end, the time in it no kernel (or memset / copy) ran, and the longest such gaps with the
        kernels on either side (under the profiler, whose own launch overhead widens them)."""
        spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                       if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
        if not spans:
            return {"span_us": 0.0, "idle_us": 0.0, "gaps": []}
        gaps, end, after = [], spans[0][1], spans[0][2]
        for start, stop, name in spans[1:]:
            if start > end:
                gaps.append({"us": round(start - end, 1), "after": after[:100], "before": name[:100]})
            if stop > end:
                end, after = stop, name
        gaps.sort(key=lambda g: -g["us"])
        return {"span_us": round(end - spans[0][0], 1), "idle_us": round(sum(g["us"] for g in gaps), 1),
                "gaps": gaps[:top]}

    def train(self, prep, opt, run: str, precision: str) -> dict:
        a, ctx = self.args, self.context
        row = {"run": run, "precision": precision, "batch": a.train_batch, "steps": a.train_steps,
               "tokens": a.train_steps * a.train_batch * ctx, "status": "ok", "curve": []}
        warm, steps = a.lr_warmup, a.train_steps

        def lr(s):
            if s < warm:
                return (s + 1) / warm
            return 0.1 + 0.45 * (1 + math.cos(math.pi * (s - warm) / max(1, steps - warm)))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr)
        self.free()
        self.reset_peak()
        loss, acc, n = None, None, 0
        try:
            t = time.perf_counter()
            for s in range(steps):
                loss = self.step(prep, opt, precision, self.train_data.get(s, a.train_batch, self.device))
                sched.step()
                if s == 0:
                    row["step0_loss"] = float(loss)
                    t1 = time.perf_counter()
                    row["first_step_s"] = round(t1 - t, 3)
                acc = loss.float() if acc is None else acc + loss.float()
                n += 1
                if (s + 1) % a.log_every == 0 or s + 1 == steps:
                    row["curve"].append([s + 1, (s + 1) * a.train_batch * ctx, float(acc) / n])
                    acc, n = None, 0
            self.sync()
            if steps > 1:
                row["tokens_per_s"] = (steps - 1) * a.train_batch * ctx / (time.perf_counter() - t1)
            row["peak_bytes"] = self.peak()
            row |= self.validate(prep.model, precision)
        except Exception as e:  # noqa: BLE001
            row |= self.failure(e)
        loss = acc = None
        opt.zero_grad(set_to_none=True)
        self.free()
        return row

    @torch.no_grad()
    def validate(self, model, precision: str) -> dict:
        b = min(self.args.train_batch, self.val_data.n)
        n = max(1, min(self.args.val_batches, self.val_data.n // b))
        model.eval()
        total = torch.zeros((), device=self.device)
        with self.amp(precision):
            for k in range(n):
                x = self.val_data.get(k, b, self.device)
                total += model(input_ids=x, labels=x).loss.float()
        model.train()
        return {"val_loss": float(total) / n, "val_sequences": n * b}

    def find_max_batch(self, prep, opt, run: str, precision: str, measured: list[dict]) -> dict:
        a = self.args
        step, limit = a.max_batch_step, a.max_batch_limit
        fits = [r["batch"] for r in measured if r["status"] == "ok"]
        lo = max(fits, default=0)
        above = sorted((r for r in measured if r["status"] == "oom" and r["batch"] > lo), key=lambda r: r["batch"])
        hi_row = above[0] if above else None
        peaks = {r["batch"]: r.get("peak_bytes") for r in measured if r["status"] == "ok"}
        out = {"run": run, "precision": precision, "status": "ok", "step": step, "limit": limit, "probes": []}

        def probe(b):
            r = self.measure(prep, opt, precision, b, warmup=a.probe_steps, steps=0)
            out["probes"].append({"batch": b, "status": r["status"], "peak_bytes": r.get("peak_bytes")})
            self.log(f"lm:   {run} {precision} max-batch probe {b}: {r['status']}")
            if r["status"] == "ok":
                peaks[b] = r["peak_bytes"]
            elif r["status"] != "oom":
                raise RuntimeError(r.get("message", "failed"))
            return r
        try:
            while hi_row is None:
                b = min(lo * 2 if lo else step, limit)
                if b <= lo:
                    break
                r = probe(b)
                if r["status"] == "ok":
                    lo = b
                else:
                    hi_row = r
            while hi_row is not None and hi_row["batch"] - lo > step:
                mid = lo + max(step, (hi_row["batch"] - lo) // 2 // step * step)
                if mid >= hi_row["batch"]:
                    break
                r = probe(mid)
                if r["status"] == "ok":
                    lo = mid
                else:
                    hi_row = r
        except RuntimeError as e:
            out |= {"status": "failed", "message": str(e)[:1000]}
        out |= {"max_batch": lo, "peak_bytes": peaks.get(lo), "bounded": hi_row is None and lo >= limit}
        if hi_row is not None:
            out |= {"first_oom_batch": hi_row["batch"], "oom_alloc": hi_row.get("oom_alloc"),
                    "oom_message": hi_row.get("message")}
        return out

    # --- runs ---------------------------------------------------------------------------------

    def release(self, prep) -> None:
        """Undo a run's process-wide patches; the caller drops its references to the model and
        optimizer; compiled graphs and cached blocks go."""
        if prep is not None:
            prep.restore()
        torch._dynamo.reset()
        self.free()

    def run(self, run: str, precision: str) -> None:
        a = self.args
        info = {"run": run, "precision": precision, "status": "ok"}
        self.doc["runs"].append(info)
        prep = opt = None
        try:
            try:
                t = time.perf_counter()
                prep = prepare(run, self.cfg, self.device, precision, a.seed, a.dynamic, a.hook_min_bytes)
                opt = self.optimizer(prep.model)
                info["setup_s"] = round(time.perf_counter() - t, 2)
            except RunUnavailable as e:
                info |= {"status": "unavailable", "message": str(e)}
            except Exception as e:  # noqa: BLE001
                info |= self.failure(e)
            if info["status"] != "ok":
                self.log(f"lm: {run} {precision}: {info['status']}: {info['message']}")
                return
            self.phases(prep, opt, run, precision)
        finally:
            self.write()
            self.release(prep)
            prep = opt = None
            self.free()

    def phases(self, prep, opt, run: str, precision: str) -> None:
        a = self.args
        if a.train_steps > 0:
            row = self.train(prep, opt, run, precision)
            self.doc["train"].append(row)
            self.write()
            self.log(f"lm: {run} {precision} train {a.train_steps} steps: {row['status']}, "
                     f"step-0 loss {row.get('step0_loss', float('nan')):.4f}, val loss "
                     f"{row.get('val_loss', float('nan')):.4f}, first step {row.get('first_step_s')} s")
            if row["status"] == "failed":
                return
        measured = []
        for b in a.batch_list:
            row = {"run": run, "precision": precision} | self.measure(prep, opt, precision, b, a.warmup, a.steps)
            measured.append(row)
            self.doc["throughput"].append(row)
            self.write()
            self.log(f"lm: {run} {precision} batch {b}: {lm_report.cell(row)}")
            if row["status"] == "failed":
                return
        if a.find_max_batch:
            row = self.find_max_batch(prep, opt, run, precision, measured)
            self.doc["max_batch"].append(row)
            self.write()
            self.log(f"lm: {run} {precision} largest batch {row['max_batch']}"
                     f" (first out of memory: {row.get('first_oom_batch')}, {row.get('oom_alloc')})")

    def run_lora(self, run: str, precision: str) -> None:
        a = self.args
        prep = opt = None
        todo = list(a.lora_batch_list)
        try:
            prep = prepare_lora(run, self.cfg, self.device, precision, a.seed, a.dynamic)
            opt = self.optimizer(prep.model)
            trainable = sum(p.numel() for p in prep.model.parameters() if p.requires_grad)
            while todo:
                b = todo[0]
                row = {"run": run, "precision": precision, "trainable_params": trainable} | self.measure(
                    prep, opt, precision, b, a.warmup, a.steps)
                todo.pop(0)
                self.doc["lora"].append(row)
                self.write()
                self.log(f"lm: LoRA {run} {precision} batch {b}: {lm_report.cell(row)}")
        except Exception as e:  # noqa: BLE001  RunUnavailable included
            fail = ({"status": "unavailable", "message": str(e)} if isinstance(e, RunUnavailable)
                    else self.failure(e))
            self.log(f"lm: LoRA {run} {precision}: {fail['status']}: {fail['message']}")
            self.doc["lora"] += [{"run": run, "precision": precision, "batch": b} | fail for b in todo]
        finally:
            self.write()
            self.release(prep)
            prep = opt = None
            self.free()

    def main(self) -> None:
        a = self.args
        for precision in a.precision_list:
            for run in a.run_list:
                self.run(run, precision)
        if a.lora:
            for precision in a.lora_precision_list:
                for run in a.lora_run_list:
                    self.run_lora(run, precision)
        self.write()
        print("\n" + lm_report.table(self.doc) + "\n", flush=True)
        self.log(f"lm: wrote {a.out} ({self.doc['seconds']} s)")


def parse(argv=None):
    ap = argparse.ArgumentParser(prog="python -m fusekit.bench.lm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="small", choices=sorted(DEFAULTS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="lm.json", help="the JSON written (and rewritten after every measurement)")
    ap.add_argument("--cache", default="lm-cache", help="folder for the tokenizer and token streams")
    ap.add_argument("--corpus-limit", default=None, help="first N stdlib files (300) or bytes (2MB); default all")
    ap.add_argument("--vocab", type=int, default=None, help="tokenizer and model vocabulary (default the config's)")
    ap.add_argument("--runs", default=",".join(DEFAULT_RUNS),
                    help=f"comma-separated, of {','.join(RUNS)}; with compressed saved activations: "
                         f"{','.join(HOOK_RUNS)} (any eager run + _hook<bits>)")
    ap.add_argument("--precision", default="both", help="autocast, bf16 or both")
    ap.add_argument("--batches", default=None, help="comma-separated (default: the config's)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--train-steps", type=int, default=200)
    ap.add_argument("--train-batch", type=int, default=None)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--val-batches", type=int, default=16)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--lr-warmup", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dynamic", default="batch", choices=["batch", "auto", "true", "false"],
                    help="batch: one batch-dynamic compile serves every batch size (the default); auto, true, "
                         "false: torch.compile's dynamic=None (batch-dynamic from the second size), True, False "
                         "(a static compile per batch size)")
    ap.add_argument("--hook-min-bytes", type=int, default=1 << 20,
                    help="hook runs: saved tensors of at least this many bytes are packed")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after the timed steps, one step under torch.profiler: its N costliest kernels")
    ap.add_argument("--find-max-batch", action="store_true")
    ap.add_argument("--max-batch-limit", type=int, default=1024)
    ap.add_argument("--max-batch-step", type=int, default=16)
    ap.add_argument("--probe-steps", type=int, default=2)
    ap.add_argument("--lora", action="store_true", help="add the LoRA fine-tune section")
    ap.add_argument("--lora-runs", default=",".join(LORA_RUNS))
    ap.add_argument("--lora-precision", default="bf16", help="autocast, bf16 or both")
    ap.add_argument("--lora-batches", default=None, help="comma-separated (default: the first of --batches)")
    a = ap.parse_args(argv)
    d = DEFAULTS[a.config]
    a.batch_list = [int(b) for b in csv(a.batches or d["batches"])]
    a.train_batch = a.train_batch or d["train_batch"]
    a.lora_batch_list = [int(b) for b in csv(a.lora_batches)] if a.lora_batches else a.batch_list[:1]
    a.run_list, a.lora_run_list = csv(a.runs), csv(a.lora_runs)
    a.precision_list, a.lora_precision_list = precisions(a.precision), precisions(a.lora_precision)
    a.dynamic_batch = a.dynamic == "batch"
    a.dynamic = {"batch": None, "auto": None, "true": True, "false": False}[a.dynamic]
    bad = [x for x in a.run_list if not is_run(x)]
    if bad:
        ap.error(f"--runs: unknown {', '.join(bad)}; expected {', '.join(RUNS)}, or hook<bits> / <run>_hook<bits> "
                 f"(bits 1, 2, 4, 8; an eager run) such as {', '.join(HOOK_RUNS)}")
    for name, got, allowed in (("--lora-runs", a.lora_run_list, LORA_RUNS),
                               ("--precision", a.precision_list + a.lora_precision_list, ["autocast", "bf16"])):
        bad = [x for x in got if x not in allowed]
        if bad:
            ap.error(f"{name}: unknown {', '.join(bad)}; expected {', '.join(allowed)}")
    return a


def main(argv=None) -> dict:
    bench = Bench(parse(argv))
    bench.main()
    return bench.doc


if __name__ == "__main__":
    main()
