"""python -m fusekit.bench: each fusekit op through PyTorch against what a PyTorch user runs
instead, in the same process on the same GPU: eager PyTorch, torch.compile, and PyTorch's own
kernels (SDPA for attention, _weight_int4pack_mm for W4A16, nn.EmbeddingBag with torch.optim for
the embedding tables).

Timing: CUDA events around 20 back-to-back calls, the best of 7 such runs, after warm-up; each
call as a user makes it (eager dispatch included). Cases named *_graphed capture the 20 calls in a
CUDA graph and time its replay (the device time, as a decode loop runs small GEMMs). Memory-bound cases also report the fraction
of the copy ceiling (a device-to-device copy measured the same way). Writes JSON in the bench
schema (bench/README or docs/bench.md) and PNG charts.

    python -m fusekit.bench [--out DIR] [--filter SUBSTRING]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time

import torch
import torch.nn.functional as F

import fusekit
import fusekit.nn as fnn
from fusekit import ops


def timeit(fn, calls: int = 20, repeats: int = 7) -> float:
    """Seconds per call: best of `repeats` runs of `calls` back-to-back calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    best = math.inf
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(repeats):
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / calls)
    return best


def timeit_graphed(fn, calls: int = 20, repeats: int = 7) -> float:
    """Seconds per call of `calls` calls captured in one CUDA graph and replayed: the device time,
    without the host's per-call cost (how a decode loop runs a small GEMM)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return timeit(g.replay, calls=1, repeats=repeats) / calls


def compiled(fn):
    return torch.compile(fn, dynamic=False)


def copy_ceiling() -> float:
    """Bytes per second of a device-to-device copy (read + write counted) of 1 GiB."""
    src = torch.empty(1 << 28, device="cuda", dtype=torch.float32)
    dst = torch.empty_like(src)
    t = timeit(lambda: dst.copy_(src), calls=5, repeats=5)
    return 2 * src.numel() * 4 / t


# (B, H, S, D, causal): a long-sequence training shape at D 128, D 64, and the LM bench's small
# model (python -m fusekit.bench.lm --config small at batch 64).
ATTENTION_SHAPES = ((4, 16, 2048, 128, False), (4, 16, 2048, 128, True), (8, 16, 1024, 64, False),
                    (64, 12, 1024, 64, True))


def cases():
    dev, bf16 = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape, dtype=bf16, scale=1.0):
        return (torch.randn(*shape, generator=g, device=dev, dtype=torch.float32) * scale).to(dtype)

    # bias + activation: memory-bound (read x, write y)
    for rows, cols in ((8192, 4096), (4096, 1024)):
        x, b = randn(rows, cols), randn(cols)
        peer = lambda x, b: F.gelu(x + b, approximate="tanh")  # noqa: E731
        yield dict(name=f"bias_gelu/{rows}x{cols}/bf16", bytes=2 * rows * cols * 2 + cols * 2,
                   fusekit=lambda: fusekit.bias_act(x, b, act="gelu_tanh"),
                   peers={"eager": lambda: peer(x, b), "compile": (compiled(peer), (x, b))})
    # softmax: memory-bound
    for rows, cols in ((4096, 4096), (16384, 1024), (512, 32768)):
        x = randn(rows, cols)
        yield dict(name=f"softmax/{rows}x{cols}/bf16", bytes=2 * rows * cols * 2,
                   fusekit=lambda x=x: fusekit.softmax(x),
                   peers={"eager": lambda x=x: torch.softmax(x, -1),
                          "compile": (compiled(lambda x: torch.softmax(x, -1)), (x,))})
    # GLU feed-forward up-projection: out = silu(x Wgᵀ) * (x Wuᵀ)
    for m, k, n in ((4096, 4096, 11008), (512, 4096, 11008)):
        x, wg, wu = randn(m, k), randn(n, k, scale=k ** -0.5), randn(n, k, scale=k ** -0.5)
        wp = ops.prepare_glu_weight(torch.cat((wg, wu)))
        peer = lambda x, wg, wu: F.silu(x @ wg.t()) * (x @ wu.t())  # noqa: E731
        yield dict(name=f"swiglu/M{m}_K{k}_N{n}/bf16", flops=2 * m * k * 2 * n,
                   fusekit=lambda x=x, wp=wp: ops.call("glu", x, wp, None, "swiglu", False),
                   peers={"eager": lambda x=x, wg=wg, wu=wu: peer(x, wg, wu),
                          "compile": (compiled(peer), (x, wg, wu))})
    # attention forward
    for b_, h, s, d, causal in ATTENTION_SHAPES:
        q, k_, v = randn(b_, h, s, d), randn(b_, h, s, d), randn(b_, h, s, d)
        flops = 4 * b_ * h * s * s * d // (2 if causal else 1)
        yield dict(name=f"attention/B{b_}_H{h}_S{s}_D{d}{'_causal' if causal else ''}/bf16", flops=flops,
                   fusekit=lambda q=q, k_=k_, v=v, c=causal: fusekit.attention(q, k_, v, causal=c),
                   peers={"sdpa": lambda q=q, k_=k_, v=v, c=causal: F.scaled_dot_product_attention(q, k_, v, is_causal=c)})
    # W4A16 decode and prefill
    for m, n, k in ((1, 4096, 4096), (16, 4096, 4096), (1, 11008, 4096), (256, 4096, 4096)):
        w = randn(n, k, dtype=torch.float16, scale=0.02)
        lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.float16)
        with torch.no_grad():
            lin.weight.copy_(w)
        w4 = fnn.W4Linear.from_linear(lin, group_size=128)
        x = randn(m, k, dtype=torch.float16)
        peers = {"cublas_fp16": lambda x=x, w=w: x @ w.t()}
        try:  # torch's own int4 kernel (bf16 activations, its packing)
            wb = w.to(bf16)
            wq = torch.randint(0, 16, (n, k), device=dev, dtype=torch.int32)
            packed = torch.ops.aten._convert_weight_to_int4pack(
                (wq[:, ::2] << 4 | wq[:, 1::2]).to(torch.uint8), 8)
            sz = torch.ones(k // 128, n, 2, device=dev, dtype=bf16)
            xb = x.to(bf16)
            torch.ops.aten._weight_int4pack_mm(xb, packed, 128, sz)
            peers["torch_int4pack_mm"] = lambda xb=xb, packed=packed, sz=sz: torch.ops.aten._weight_int4pack_mm(
                xb, packed, 128, sz)
            del wb
        except Exception as e:  # noqa: BLE001  recorded, not hidden
            peers["torch_int4pack_mm"] = f"unavailable: {type(e).__name__}: {e}"[:200]
        yield dict(name=f"w4a16/M{m}_N{n}_K{k}/f16", bytes=n * k // 2 + m * k * 2 + m * n * 2,
                   fusekit=lambda w4=w4, x=x: w4(x), peers=peers)
        if m <= 16:  # decode: also as a decode loop runs it, every call in a CUDA graph
            yield dict(name=f"w4a16_graphed/M{m}_N{n}_K{k}/f16", bytes=n * k // 2 + m * k * 2 + m * n * 2,
                       graphed=True, fusekit=lambda w4=w4, x=x: w4(x), peers=dict(peers))
    # LoRA forward, r = 16 and 64
    for m, k, n, r in ((4096, 4096, 4096, 16), (4096, 4096, 4096, 64), (2048, 4096, 4096, 16)):
        x, w, a, b = randn(m, k), randn(n, k, scale=k ** -0.5), randn(r, k, scale=k ** -0.5), randn(n, r)
        s = 2.0
        peer = lambda x, w, a, b: x @ w.t() + s * ((x @ a.t()) @ b.t())  # noqa: E731
        yield dict(name=f"lora_fwd/M{m}_K{k}_N{n}_r{r}/bf16", flops=2 * m * k * n + 2 * m * r * (k + n),
                   fusekit=lambda x=x, w=w, a=a, b=b: fusekit.lora(x, w, a, b, scale=s),
                   peers={"eager": lambda x=x, w=w, a=a, b=b: peer(x, w, a, b),
                          "compile": (compiled(peer), (x, w, a, b))})


# Criteo Kaggle's 26 categorical cardinalities (fusekit::data::kKaggleCardinalities).
KAGGLE_ROWS = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
               5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]


def training_cases(randn):
    """A forward and backward as a training step runs them (gradients of every trainable input).
    flops: the GEMMs' (LoRA: x Wᵀ and dy W, W frozen; SwiGLU: forward, dx and dW, not the
    backward's recompute of x Wᵀ)."""
    # LoRA: W frozen; dispatch picks the unfused gradient pass where the fused one loses (r > 16).
    for m, k, n, r in ((8192, 4096, 4096, 16), (8192, 4096, 4096, 64), (2048, 4096, 4096, 64)):
        x, w = randn(m, k).requires_grad_(), randn(n, k, scale=k ** -0.5)
        a, b = randn(r, k, scale=k ** -0.5).requires_grad_(), randn(n, r).requires_grad_()
        dy, s = randn(m, n), 2.0

        def peer(x, w, a, b, dy):
            torch.autograd.backward(torch.relu(x @ w.t() + s * ((x @ a.t()) @ b.t())), dy)

        def fk(x=x, w=w, a=a, b=b, dy=dy):
            torch.autograd.backward(fusekit.lora(x, w, a, b, scale=s, act="relu"), dy)
        yield dict(name=f"lora_train/M{m}_K{k}_N{n}_r{r}/bf16", flops=2 * 2 * m * k * n, fusekit=fk,
                   peers={"eager": lambda x=x, w=w, a=a, b=b, dy=dy: peer(x, w, a, b, dy),
                          "compile": (compiled(peer), (x, w, a, b, dy))})
    # attention, forward and backward: dq, dk, dv from autograd (not accumulated into .grad)
    for b_, h, s, d, causal in ATTENTION_SHAPES:
        q, k_, v = (randn(b_, h, s, d).requires_grad_() for _ in range(3))
        dout = randn(b_, h, s, d)

        def step(attn, q=q, k_=k_, v=v, dout=dout, c=causal):
            return torch.autograd.grad(attn(q, k_, v, is_causal=c), (q, k_, v), dout)
        yield dict(name=f"attention_train/B{b_}_H{h}_S{s}_D{d}{'_causal' if causal else ''}/bf16",
                   flops=14 * b_ * h * s * s * d // (2 if causal else 1),
                   fusekit=lambda step=step: step(lambda q, k, v, is_causal: fusekit.attention(q, k, v, causal=is_causal)),
                   peers={"sdpa": lambda step=step: step(F.scaled_dot_product_attention)})
    # SwiGLU up-projection, forward and backward
    for m, k, n in ((4096, 4096, 11008),):
        x = randn(m, k).requires_grad_()
        wg, wu = randn(n, k, scale=k ** -0.5).requires_grad_(), randn(n, k, scale=k ** -0.5).requires_grad_()
        wp = ops.prepare_glu_weight(torch.cat((wg, wu))).detach().requires_grad_()
        dy = randn(m, n)

        def peer(x, wg, wu, dy):
            torch.autograd.backward(F.silu(x @ wg.t()) * (x @ wu.t()), dy)
        yield dict(name=f"swiglu_train/M{m}_K{k}_N{n}/bf16", flops=3 * 2 * m * k * 2 * n,
                   fusekit=lambda x=x, wp=wp, dy=dy: torch.autograd.backward(fusekit.glu(x, wp, kind="swiglu"), dy),
                   peers={"eager": lambda x=x, wg=wg, wu=wu, dy=dy: peer(x, wg, wu, dy),
                          "compile": (compiled(peer), (x, wg, wu, dy))})


def recsys_cases(randn):
    """Embedding bags against nn.EmbeddingBag (one per table, as a PyTorch DLRM holds them), the
    interaction against bmm + gather, the loss against binary_cross_entropy_with_logits."""
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(1)
    for label, rows, dim, batch, bag in (("kaggle26_d16_b32768_onehot", KAGGLE_ROWS, 16, 32768, 1),
                                         ("t8_r1M_d64_b4096_bag20", [1 << 20] * 8, 64, 4096, 20)):
        tables = len(rows)
        ebc = fnn.EmbeddingBagCollection(rows, dim, optimizer="sgd", lr=0.01, validate_indices=False, device=dev)
        nn_bags = [torch.nn.EmbeddingBag(r, dim, mode="sum", sparse=True, device=dev) for r in rows]
        opt = torch.optim.SGD([b.weight for b in nn_bags], lr=0.01)
        per_table = [(torch.randint(0, r, (batch * bag,), device=dev, generator=g),
                      torch.arange(0, batch * bag, bag, device=dev)) for r in rows]
        idx, off = fnn.EmbeddingBagCollection.collate(per_table)
        dy = torch.randn(batch, tables, dim, device=dev, generator=g)
        # rows gathered, indices read, bags written
        bytes_fwd = batch * bag * tables * (dim * 4 + 8) + batch * tables * dim * 4

        def peer_fwd():
            return torch.stack([b(i, o) for b, (i, o) in zip(nn_bags, per_table)], dim=1)

        def no_grad(f):
            def run():
                with torch.no_grad():
                    return f()
            return run

        def peer_step():
            opt.zero_grad(set_to_none=True)
            torch.autograd.backward(peer_fwd(), dy)
            opt.step()

        def fk_step():
            torch.autograd.backward(ebc(idx, off), dy)
        yield dict(name=f"embedding_fwd/{label}", bytes=bytes_fwd, fusekit=no_grad(lambda: ebc(idx, off)),
                   peers={"eager": no_grad(peer_fwd)})
        yield dict(name=f"embedding_train_sgd/{label}", fusekit=fk_step, peers={"eager": peer_step})
    for batch, feats, dim in ((32768, 27, 16), (4096, 27, 128)):
        z = torch.randn(batch, feats, dim, device=dev, generator=g, requires_grad=True)
        li = torch.tensor([i for i in range(feats) for j in range(i)], device=dev)
        lj = torch.tensor([j for i in range(feats) for j in range(i)], device=dev)

        def peer(z, li=li, lj=lj):
            return torch.cat([z[:, 0], torch.bmm(z, z.transpose(1, 2))[:, li, lj]], dim=1)
        dr = torch.randn(batch, dim + feats * (feats - 1) // 2, device=dev, generator=g)
        yield dict(name=f"interaction_dot_train/B{batch}_F{feats}_D{dim}", bytes=3 * z.numel() * 4 + 2 * dr.numel() * 4,
                   fusekit=lambda z=z, dr=dr: torch.autograd.backward(fusekit.interaction(z), dr),
                   peers={"eager": lambda z=z, dr=dr: torch.autograd.backward(peer(z), dr),
                          "compile": (compiled(lambda z, dr: torch.autograd.backward(peer(z), dr)), (z, dr))})
    logits = torch.randn(32768, device=dev, generator=g, requires_grad=True)
    labels = torch.randint(0, 2, (32768,), device=dev, generator=g).float()
    yield dict(name="sigmoid_bce_train/B32768",
               fusekit=lambda: fusekit.sigmoid_bce(logits, labels).backward(),
               peers={"eager": lambda: F.binary_cross_entropy_with_logits(logits, labels).backward(),
                      "compile": (compiled(lambda x, y: F.binary_cross_entropy_with_logits(x, y).backward()),
                                  (logits, labels))})


def all_cases():
    yield from cases()
    g = torch.Generator(device="cuda").manual_seed(2)

    def randn(*shape, dtype=torch.bfloat16, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32) * scale).to(dtype)
    yield from training_cases(randn)
    yield from recsys_cases(randn)
    from .llm_cases import llm_cases
    yield from llm_cases(randn, compiled)


def peak_mib(fn) -> float:
    """MiB a call allocates at its peak above what was allocated before it (after a warm-up call)."""
    fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def run(filter_: str):
    ceiling = copy_ceiling()
    results = []
    for c in all_cases():
        if filter_ and filter_ not in c["name"]:
            continue
        row = {"name": c["name"]}
        time_ = timeit_graphed if c.get("graphed") else timeit
        t = time_(c["fusekit"])
        row["fusekit_us"] = t * 1e6
        if "bytes" in c:
            row["copy_ceiling_fraction"] = c["bytes"] / t / ceiling
        if "flops" in c:
            row["fusekit_tflops"] = c["flops"] / t / 1e12
        if c.get("memory"):
            row["fusekit_peak_MiB"] = peak_mib(c["fusekit"])
        for peer, fn in c["peers"].items():
            if isinstance(fn, str):
                row[f"{peer}_note"] = fn
                continue
            try:
                if isinstance(fn, tuple):
                    f, args = fn
                    tp = time_(lambda f=f, args=args: f(*args))
                else:
                    tp = time_(fn)
                row[f"{peer}_us"] = tp * 1e6
                row[f"speedup_vs_{peer}"] = tp / t
                if c.get("memory"):
                    row[f"{peer}_peak_MiB"] = peak_mib(lambda fn=fn: fn[0](*fn[1]) if isinstance(fn, tuple) else fn())
            except Exception as e:  # noqa: BLE001
                row[f"{peer}_note"] = f"failed: {type(e).__name__}: {e}"[:200]
        print(json.dumps(row), flush=True)
        results.append(row)
    return ceiling, results


def charts(results, out: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["name"] for r in results]
    peers = sorted({k[len("speedup_vs_"):] for r in results for k in r if k.startswith("speedup_vs_")})
    fig, ax = plt.subplots(figsize=(12, 0.35 * len(names) + 1.5))
    h = 0.8 / max(1, len(peers))
    for i, p in enumerate(peers):
        vals = [r.get(f"speedup_vs_{p}", float("nan")) for r in results]
        ax.barh([y + i * h for y in range(len(names))], vals, height=h, label=f"vs {p}")
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_yticks([y + 0.4 - h / 2 for y in range(len(names))], names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("speedup of fusekit through PyTorch (peer time / fusekit time; > 1: fusekit faster)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "python_peers_speedup.png"), dpi=110)
    mem = [r for r in results if "copy_ceiling_fraction" in r]
    if mem:
        fig, ax = plt.subplots(figsize=(10, 0.35 * len(mem) + 1.5))
        ax.barh(range(len(mem)), [r["copy_ceiling_fraction"] for r in mem])
        ax.set_yticks(range(len(mem)), [r["name"] for r in mem], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlim(0, 1.05)
        ax.set_xlabel("fraction of the device-to-device copy ceiling (bytes moved / time / copy bandwidth)")
        fig.tight_layout()
        fig.savefig(os.path.join(out, "python_peers_ceiling.png"), dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--filter", default="")
    args = ap.parse_args()
    t0 = time.time()
    ceiling, results = run(args.filter)
    doc = {"schema": "fusekit-bench-python/1", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "fusekit": fusekit.build_info(), "python": platform.python_version(),
           "copy_ceiling_GBps": ceiling / 1e9, "timing": "CUDA events, best of 7 runs of 20 calls",
           "seconds": time.time() - t0, "results": results}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "python_peers.json"), "w") as f:
        json.dump(doc, f, indent=1)
    charts(results, args.out)


if __name__ == "__main__":
    main()
