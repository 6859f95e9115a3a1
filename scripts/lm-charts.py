#!/usr/bin/env python3
"""Charts and the markdown table of the language-model benchmark (python -m fusekit.bench.lm),
drawn from its JSON where matplotlib is (the GPU machine may lack it).

    scripts/lm-charts.py lm.json [more.json ...] [--out DIR] [--merged FILE]

Several JSON files (one benchmark split over several commands) are merged: later measurements
of the same run, precision and batch replace earlier ones. Writes DIR/lm_loss_curves.png (the
training loss of every run against tokens seen, one panel per precision, the validation loss in
the legend) and DIR/lm_memory_speed.png (tokens/s and peak memory per run at each batch, one
column per precision; LoRA runs in a third row when measured); prints the table.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def load_report():
    """fusekit/bench/lm_report.py by path: importing the fusekit package needs its built library."""
    path = os.path.join(HERE, "..", "python", "fusekit", "bench", "lm_report.py")
    spec = importlib.util.spec_from_file_location("lm_report", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


report = load_report()
GIB = report.GIB


def title(doc: dict) -> str:
    env, cfg = doc.get("environment", {}), doc.get("config", {})
    return (f"{env.get('gpu', env.get('device', '?'))}, LLaMA '{cfg.get('name')}' "
            f"({cfg.get('params', 0) / 1e6:.1f}M parameters, context {cfg.get('context')}), "
            f"torch {env.get('versions', {}).get('torch')}")


def loss_curves(doc: dict, path: str, plt) -> None:
    train = [r for r in doc.get("train", []) if r.get("curve")]
    precs = sorted({r["precision"] for r in train})
    if not precs:
        return
    fig, axes = plt.subplots(1, len(precs), figsize=(7 * len(precs), 4.8), squeeze=False, sharey=True)
    for ax, prec in zip(axes[0], precs):
        for i, r in enumerate(r for r in train if r["precision"] == prec):
            xs = [c[1] / 1e6 for c in r["curve"]]
            ys = [c[2] for c in r["curve"]]
            val = f", val {r['val_loss']:.3f}" if r.get("val_loss") is not None else f", {r['status']}"
            ax.plot(xs, ys, label=f"{r['run']}{val}", lw=1.2, ls=("-", "--", ":", "-.")[i % 4], color=color(r["run"]))
        ax.set_title(f"{prec}: training loss (batch {train[0]['batch']})", fontsize=10)
        ax.set_xlabel("training tokens (millions)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("loss (mean over each logging window)")
    fig.suptitle(title(doc), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# One colour per run in every panel (the order of the benchmark's run lists, LoRA's after).
RUN_ORDER = ["fusekit", "compile", "liger", "liger_compile", "fusekit_compile", "checkpoint", "eager", "peft",
             "peft_compile", "hook8", "hook4", "hook2", "fusekit_hook8", "fusekit_hook4", "fusekit_hook2",
             "checkpoint_hook4"]


def color(run: str):
    """tab20's colours, one per run of RUN_ORDER (16 of them), grey for any other."""
    if run not in RUN_ORDER:
        return "0.5"
    import matplotlib
    return matplotlib.colormaps["tab20"](RUN_ORDER.index(run) % 20)


def bars(ax, rows: list[dict], key: str, scale: float, label: str) -> None:
    """Grouped bars: a group per batch, a bar per run; 'OOM' (or the status) where there is none."""
    runs = sorted(dict.fromkeys(r["run"] for r in rows), key=lambda r: RUN_ORDER.index(r) if r in RUN_ORDER else 99)
    batches = sorted({r["batch"] for r in rows})
    by = {(r["run"], r["batch"]): r for r in rows}
    w = 0.8 / max(1, len(runs))
    for i, run in enumerate(runs):
        for j, b in enumerate(batches):
            r = by.get((run, b))
            x = j + (i - (len(runs) - 1) / 2) * w
            if r is not None and r["status"] == "ok" and r.get(key) is not None:
                ax.bar(x, r[key] / scale, w, color=color(run), label=run if j == 0 else None)
                ax.text(x, r[key] / scale, f"{r[key] / scale:.0f}", ha="center", va="bottom", fontsize=6)
            else:
                ax.bar(x, 0, w, color=color(run), label=run if j == 0 else None)
                ax.text(x, 0, "OOM" if r and r["status"] == "oom" else (r or {}).get("status", "—")[:6],
                        rotation=90, ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    ax.set_ylabel(label)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.3)  # room for the legend above the bars
    ax.grid(axis="y", alpha=0.3)


def memory_speed(doc: dict, path: str, plt) -> None:
    thr, lora = doc.get("throughput", []), doc.get("lora", [])
    precs = sorted({r["precision"] for r in thr})
    lprecs = sorted({r["precision"] for r in lora})
    if not precs and not lprecs:
        return
    cols = max(len(precs), len(lprecs), 1)
    nrows = 2 + (2 if lora else 0)
    fig, axes = plt.subplots(nrows, cols, figsize=(7 * cols, 3.6 * nrows), squeeze=False)
    for c, prec in enumerate(precs):
        rows = [r for r in thr if r["precision"] == prec]
        bars(axes[0][c], rows, "tokens_per_s", 1e3, "tokens/s (thousands)")
        axes[0][c].set_title(f"{prec}: training throughput", fontsize=10)
        bars(axes[1][c], rows, "peak_bytes", GIB, "peak memory (GiB)")
        axes[1][c].set_title(f"{prec}: peak torch.cuda.max_memory_allocated()", fontsize=10)
        axes[0][c].legend(fontsize=7, ncol=4, loc="upper left")
    for c, prec in enumerate(lprecs):
        rows = [r for r in lora if r["precision"] == prec]
        bars(axes[2][c], rows, "tokens_per_s", 1e3, "tokens/s (thousands)")
        axes[2][c].set_title(f"LoRA r 16, {prec}: throughput", fontsize=10)
        bars(axes[3][c], rows, "peak_bytes", GIB, "peak memory (GiB)")
        axes[3][c].set_title(f"LoRA r 16, {prec}: peak memory", fontsize=10)
        axes[2][c].legend(fontsize=7, ncol=4, loc="upper left")
    for row in axes:
        for ax in row:
            if not ax.has_data():
                ax.set_visible(False)
    fig.suptitle(title(doc), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="+")
    ap.add_argument("--out", default=None, help="folder for the PNGs (default: the first JSON's)")
    ap.add_argument("--merged", default=None, help="also write the merged JSON here")
    a = ap.parse_args(argv)
    docs = []
    for p in a.json:
        with open(p) as f:
            docs.append(json.load(f))
    doc = report.merge(docs)
    out = a.out or os.path.dirname(os.path.abspath(a.json[0]))
    os.makedirs(out, exist_ok=True)
    if a.merged:
        with open(a.merged, "w") as f:
            json.dump(doc, f, indent=1)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loss_curves(doc, os.path.join(out, "lm_loss_curves.png"), plt)
    memory_speed(doc, os.path.join(out, "lm_memory_speed.png"), plt)
    print(report.table(doc))
    print(f"\nwrote {out}/lm_loss_curves.png and {out}/lm_memory_speed.png", file=sys.stderr)


if __name__ == "__main__":
    main()
