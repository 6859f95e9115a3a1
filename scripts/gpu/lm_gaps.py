"""GPU idle time in steady state of an LM bench run (small config, bf16, batch 64; argv[1], e.g.
fusekit_nomask_compile), a diagnostic: 4 steps, then 3 under torch.profiler (CPU and CUDA), its
trace split by cause: a gap before GPU work whose launch call returned after the previous work
ended is the host's (the GPU waited for the launch), the rest the device's. The profiler's own host
cost inflates the host's share. On the GPU machine, from the repository root with the Python
package built (scripts/gpu/run.sh's py part): PYTHONPATH=$PWD/python python3 scripts/gpu/lm_gaps.py RUN"""
import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from fusekit.bench import lm_runs

cfg, ctx = lm_runs.llama_config("small")
x = torch.randint(0, cfg.vocab_size, (64, ctx), device="cuda")
prep = lm_runs.prepare(sys.argv[1], cfg, "cuda", "bf16", 0, None)
opt = torch.optim.AdamW(prep.model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)


def step():
    loss = prep.step_model(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


for _ in range(4):
    step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
prof.export_chrome_trace(f"/tmp/{sys.argv[1]}.json")
ev = json.load(open(f"/tmp/{sys.argv[1]}.json"))["traceEvents"]
gpu = sorted((e["ts"], e["ts"] + e.get("dur", 0), e.get("args", {}).get("correlation"), e["name"]) for e in ev
             if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
launch = {e["args"]["correlation"]: e["ts"] + e.get("dur", 0) for e in ev
          if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
busy, prev, host, dev, gaps = gpu[0][1], gpu[0][3], 0.0, 0.0, []
for s, t, c, n in gpu[1:]:
    if s > busy:
        g = s - busy
        if launch.get(c, 0) > busy:
            host += g
            gaps.append((g, prev, n))
        else:
            dev += g
    if t > busy:
        busy, prev = t, n
print(f"{sys.argv[1]}: span {(gpu[-1][1] - gpu[0][0]) / 3e3:.2f} ms a step, kernels+copies "
      f"{sum(t - s for s, t, _, _ in gpu) / 3e3:.2f}; idle host-bound {host / 3e3:.2f} ms, device-side {dev / 3e3:.2f} ms")
for g, a, b in sorted(gaps, reverse=True)[:10]:
    print(f"  {g:8.1f} us  after {a[:55]}  before {b[:55]}")
