"""Per-call cost of the PyTorch door: wall time of one eager call of a tiny op minus its kernel's
device time, and the same call replayed in a CUDA graph.

    python -m fusekit.overhead        (on a GPU machine; prints JSON)
"""
from __future__ import annotations

import json
import time

import torch

import fusekit


def _wall_per_call(fn, n: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def _device_per_call(fn, n: int) -> float:
    """Device time of one call: a CUDA graph of n calls replayed (no host work in it)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        torch.cuda.synchronize()
        with torch.cuda.graph(g, stream=s):
            for _ in range(n):
                fn()
    torch.cuda.synchronize()
    start.record()
    g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / n


def main() -> None:
    x = torch.randn(1, 8, device="cuda")
    b = torch.randn(8, device="cuda")
    xg = x.clone().requires_grad_()
    cases = {
        "fusekit.softmax(x[1, 8])": lambda: fusekit.softmax(x),
        "fusekit.bias_act(x[1, 8], b)": lambda: fusekit.bias_act(x, b),
        "torch.ops.fusekit.softmax(x[1, 8])": lambda: torch.ops.fusekit.softmax(x),
        "fusekit.softmax(x[1, 8] requiring grad)": lambda: fusekit.softmax(xg),
        "fusekit.bias_act(x[1, 8] requiring grad, b)": lambda: fusekit.bias_act(xg, b),
        "torch.softmax(x[1, 8])": lambda: torch.softmax(x, -1),
        "torch.softmax(x[1, 8] requiring grad)": lambda: torch.softmax(xg, -1),
        "torch.relu(x + b)": lambda: torch.relu(x + b),
    }
    out = {}
    for name, fn in cases.items():
        for _ in range(200):
            fn()
        wall = min(_wall_per_call(fn, 2000) for _ in range(5))
        dev = _device_per_call(fn, 200)
        out[name] = {"wall_us": wall * 1e6, "graph_replay_us": dev * 1e6, "host_overhead_us": (wall - dev) * 1e6}
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "per_call": out}, indent=1))


if __name__ == "__main__":
    main()
