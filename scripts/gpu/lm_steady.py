"""Where an LM bench step's wall time goes, a diagnostic (small config, batch 64; argv[1] a run,
e.g. fusekit_nomask_compile, argv[2] a precision, bf16 unless given). After 5 warm-up steps:
  wall:  10 steps as the bench times them (synchronize around the loop), ms a step;
  nogc:  the same with Python's garbage collector off;
  gpu:   10 steps each preceded by a 150 ms GPU sleep before the forward and another before the
         backward, so that the host has queued each phase before the GPU reaches it; CUDA events
         around each phase give its GPU time with no wait for the host;
  inline: 10 steps with the same events but no sleeps: the phases as the loop runs them.
The difference between inline and gpu is the time the GPU waited for the host. Run it beside
`nvidia-smi --query-gpu=clocks.sm,power.draw,... -lms 100` for the clocks. On the GPU machine, from
the repository root with the Python package built (scripts/gpu/run.sh's py part):
PYTHONPATH=$PWD/python python3 scripts/gpu/lm_steady.py RUN [PRECISION]"""
import contextlib
import gc
import json
import sys
import time

import torch

from fusekit.bench import lm_runs

run = sys.argv[1]
precision = sys.argv[2] if len(sys.argv) > 2 else "bf16"
cfg, ctx = lm_runs.llama_config("small")
gen = torch.Generator().manual_seed(0)
xs = [torch.randint(0, cfg.vocab_size, (64, ctx), generator=gen).pin_memory() for _ in range(4)]
prep = lm_runs.prepare(run, cfg, "cuda", precision, 0, None)
opt = torch.optim.AdamW([p for p in prep.model.parameters() if p.requires_grad], lr=1e-4,
                        betas=(0.9, 0.95), weight_decay=0.1, fused=True)
SLEEP = int(3e8)  # cycles: 150 ms at 2 GHz


def amp():
    return torch.autocast("cuda", dtype=torch.bfloat16) if precision == "autocast" else contextlib.nullcontext()


def step(i, ev=None, sleep=False):
    x = xs[i % len(xs)].to("cuda", non_blocking=True)
    if sleep:
        torch.cuda._sleep(SLEEP)
    if ev:
        ev[0].record()
    with amp(), prep.context():
        loss = prep.step_model(input_ids=x, labels=x).loss
    if ev:
        ev[1].record()
    if sleep:
        torch.cuda._sleep(SLEEP)
    if ev:
        ev[2].record()
    loss.backward()
    if ev:
        ev[3].record()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if ev:
        ev[4].record()


def wall(n=10):
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(n):
        step(i)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3


def phases(sleep, n=10):
    evs = [[torch.cuda.Event(enable_timing=True) for _ in range(5)] for _ in range(n)]
    torch.cuda.synchronize()
    host = []
    for i in range(n):
        t = time.perf_counter()
        step(i, evs[i], sleep)
        host.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    f = sum(e[0].elapsed_time(e[1]) for e in evs) / n
    b = sum(e[2].elapsed_time(e[3]) for e in evs) / n
    o = sum(e[3].elapsed_time(e[4]) for e in evs) / n
    return {"forward_ms": round(f, 2), "backward_ms": round(b, 2), "optimizer_ms": round(o, 2),
            "sum_ms": round(f + b + o, 2), "host_ms": round(sum(host) / n * 1e3, 2)}


for i in range(5):
    step(i)
out = {"run": run, "precision": precision, "wall_ms": round(wall(), 2)}
gc.disable()
out["nogc_ms"] = round(wall(), 2)
gc.enable()
out["gpu"] = phases(True)
out["inline"] = phases(False)
out["wall2_ms"] = round(wall(), 2)
print(json.dumps(out))
