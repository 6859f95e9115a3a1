#!/usr/bin/env python3
"""Compares two `fusekit bench` runs of the same cases: each fused record's median time after
against before, and per family the median of those ratios. For checking that a change which should
not move speed did not (run both binaries in one GPU session, on the same card).

    scripts/bench-diff.py BEFORE_DIR_OR_JSON AFTER_DIR_OR_JSON [--tolerance 0.02]

Exits with 1 when a family's median ratio is outside 1 ± tolerance. Baseline records (cuBLAS and
the other unfused paths) are listed too: they did not change, so their spread is the run's noise.
"""
import argparse
import glob
import json
import os
import statistics
import sys


def records(path):
    files = sorted(glob.glob(os.path.join(path, "*.json"))) if os.path.isdir(path) else [path]
    out = {}
    for f in files:
        for r in json.load(open(f)):
            if r["family"] != "ceiling":
                out[(r["family"], r["case"], r["impl"])] = r
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--tolerance", type=float, default=0.02)
    args = ap.parse_args()
    before, after = records(args.before), records(args.after)
    common = sorted(set(before) & set(after))
    missing = sorted(set(before) ^ set(after))
    if not common:
        sys.exit("bench-diff: the two runs share no record")
    fused, base = {}, {}
    for key in common:
        b, a = before[key], after[key]
        ratio = a["median_us"] / b["median_us"]
        is_fused = b["impl"] != b.get("baseline")
        (fused if is_fused else base).setdefault(key[0], []).append((ratio, key[1], key[2]))
    print("| family | fused records | median after / before | range | baselines' median | range |")
    print("| --- | ---: | ---: | --- | ---: | --- |")
    failed = []
    for fam in sorted(set(fused) | set(base)):
        f = sorted(fused.get(fam, []))
        g = sorted(base.get(fam, []))
        fm = statistics.median(r for r, _, _ in f) if f else None
        gm = statistics.median(r for r, _, _ in g) if g else None
        cell = lambda rs, m: ("—", "—") if m is None else (f"{m:.3f}", f"{rs[0][0]:.3f}-{rs[-1][0]:.3f}")
        fc, gc = cell(f, fm), cell(g, gm)
        print(f"| {fam} | {len(f)} | {fc[0]} | {fc[1]} | {gc[0]} | {gc[1]} |")
        if fm is not None and abs(fm - 1) > args.tolerance:
            failed.append(fam)
    for fam, rs in sorted(fused.items()):
        for ratio, case, impl in rs:
            if abs(ratio - 1) > args.tolerance:
                print(f"  {fam} {case} [{impl}]: {ratio:.3f}")
    if missing:
        print(f"bench-diff: {len(missing)} records in only one run: "
              + ", ".join(f"{k[1]} [{k[2]}]" for k in missing[:10]))
    if failed:
        print(f"bench-diff: families outside 1 ± {args.tolerance}: {', '.join(failed)}")
        return 1
    print(f"bench-diff: every family's median within 1 ± {args.tolerance}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
