#!/usr/bin/env python3
"""The README's chart: each fused kernel's speedup over its unfused baseline, per case, from the
committed `fusekit bench` JSON.

    scripts/speedup-chart.py [--gpu h100] [--fallback h200] [--out docs/speedup-h100.png]

Reads bench/results/<gpu>/<family>.json for every family there (and <fallback>/<family>.json for
a family <gpu> lacks), keeps one record per fused case (impl differs from its baseline; the
`--breakdown` variants and the dlrm training records, which the README states as samples/s, are
left out), and draws log-scale horizontal bars grouped by family. It prints the GPU, commits and
families it drew, for the caption. Needs matplotlib (Agg).
"""
import argparse
import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The families in the README's order; dlrm is a training step, charted nowhere here.
FAMILIES = ["pointwise", "primitives", "quant", "glu", "qgemm", "mlp", "lora", "recsys"]
BREAKDOWN = {"fused_fp32_partials", "lowrank_t_only", "fused_gemm_only", "grad_pass_only", "dx_gemm_only"}


def fused_records(path):
    recs = json.load(open(path))
    out = []
    for r in recs:
        if r["family"] in ("ceiling", "dlrm") or r["impl"] == r.get("baseline") or r["impl"] in BREAKDOWN:
            continue
        if r["impl"].startswith("copy") or not r.get("speedup_vs_baseline"):
            continue
        out.append(r)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", default="h100")
    ap.add_argument("--fallback", default="h200")
    ap.add_argument("--out", default=str(ROOT / "docs" / "speedup-h100.png"))
    args = ap.parse_args()

    rows, sources = [], []  # rows: (family, label, speedup)
    for fam in FAMILIES:
        path = ROOT / "bench" / "results" / args.gpu / f"{fam}.json"
        if not path.exists():
            path = ROOT / "bench" / "results" / args.fallback / f"{fam}.json"
        if not path.exists():
            continue
        recs = fused_records(path)
        if not recs:
            continue
        sources.append((fam, path.relative_to(ROOT), recs[0]["device"], sorted({r["commit"] for r in recs})))
        for r in recs:
            case = r["case"] if "/" in r["case"] else f"{fam}/{r['case']}"
            rows.append((fam, f"{case}  [{r['impl']} vs {r['baseline']}]", r["speedup_vs_baseline"]))

    colors = plt.get_cmap("tab10")
    fam_color = {f: colors(i % 10) for i, (f, *_) in enumerate(sources)}
    height = 0.19 * len(rows) + 1.2
    fig, ax = plt.subplots(figsize=(11, height))
    ys = list(range(len(rows)))[::-1]
    ax.barh(ys, [s for _, _, s in rows], color=[fam_color[f] for f, _, _ in rows], height=0.75)
    ax.set_yticks(ys, [label for _, label, _ in rows], fontsize=6.5)
    ax.set_xscale("log")
    ax.axvline(1.0, color="black", linewidth=0.8)
    speedups = [s for _, _, s in rows]
    ax.set_xlim(min(0.5, min(speedups) / 1.5), max(speedups) * 2.5)
    ax.set_xlabel("speedup: baseline time / fused time (log scale; right of 1: the fused kernel is faster)")
    ax.set_ylim(-0.6, len(rows) - 0.4)
    for y, (_, _, s) in zip(ys, rows):
        ax.text(s * 1.02, y, f"{s:.2f}x", va="center", fontsize=6)
    devices = sorted({d for _, _, d, _ in sources})
    commits = sorted({c for *_, cs in sources for c in cs})
    ax.set_title(f"fusekit bench: fused kernel vs its baseline, median time per case\n"
                 f"{', '.join(devices)}; commits {', '.join(commits)}", fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=fam_color[f]) for f, *_ in sources]
    ax.legend(handles, [f for f, *_ in sources], loc="upper right", fontsize=7)
    ax.grid(axis="x", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    for fam, path, dev, cs in sources:
        print(f"{fam}: {path} ({dev}, commit {', '.join(cs)})")
    print(f"wrote {args.out}: {len(rows)} cases")


if __name__ == "__main__":
    main()
