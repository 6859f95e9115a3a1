#!/usr/bin/env python3
"""Markdown tables of `fusekit bench` JSON, for the README: one row per fused record.

    scripts/bench-table.py bench/results/h100/glu.json [more.json ...]

Columns: the fused time, the baseline's name and time (the record the speedup is against), the
speedup, GB/s with % of the copy ceiling when the case is memory-bound, TFLOP/s with % of the GEMM
ceiling when it is compute-bound, and gemm_only_us when the record carries it. The ceilings and
the commit come from the same file.
"""
import json
import sys


def fmt(v, spec):
    return "—" if v is None else format(v, spec)


def table(path):
    recs = json.load(open(path))
    ceil = {r["case"]: r for r in recs if r["family"] == "ceiling"}
    by_case = {}
    for r in recs:
        if r["family"] != "ceiling":
            by_case.setdefault(r["case"], []).append(r)
    rows = []
    for case, rs in by_case.items():
        fused = [
            r for r in rs if r["impl"] != r.get("baseline") and not r["impl"].startswith("copy")]
        base = {r["impl"]: r for r in rs}
        for f in fused:
            b = base.get(f.get("baseline"))
            gb = f.get("gbps") or 0
            tf = f.get("tflops") or 0
            mem = f"{gb:.0f} ({f['pct_of_copy']:.1f}%)" if gb and f.get("pct_of_copy") else "—"
            comp = f"{tf:.0f} ({f['pct_of_gemm']:.0f}%)" if tf and f.get("pct_of_gemm") else (f"{tf:.0f}" if tf else "—")
            g = f.get("gemm_only_us")
            rows.append(f"| `{case}` | {f['impl']} | {f['median_us']:.1f} | {f.get('baseline', '—')} | "
                        f"{fmt(b['median_us'] if b else None, '.1f')} | {f['speedup_vs_baseline']:.2f}x | {mem} | "
                        f"{comp} | {fmt(g, '.1f')} |")
    head = ("| case | impl | µs | baseline | baseline µs | speedup | GB/s (% of copy) | TFLOP/s (% of GEMM) | "
            "GEMM alone µs |\n| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    any_rec = next(iter(recs), {})
    cc = ceil.get("copy", {}).get("gbps")
    cg = ceil.get("gemm_bf16", {}).get("tflops")
    cl = ceil.get("launch", {}).get("median_us")
    launch = f", an empty kernel {cl:.1f} µs" if cl else ""
    foot = (f"\nCeilings of the same run: copy {fmt(cc, '.0f')} GB/s, cuBLAS bf16 GEMM 8192³ {fmt(cg, '.0f')} TFLOP/s{launch}; "
            f"{any_rec.get('device', '?')}, commit `{any_rec.get('commit', '?')}`.\n")
    return head + "\n" + "\n".join(rows) + "\n" + foot


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(table(p))
