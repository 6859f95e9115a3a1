#!/usr/bin/env python3
"""The chart and markdown table of the decode benchmark (python -m fusekit.bench.decode), drawn
from its JSON where matplotlib is (the GPU machine may lack it).

    scripts/decode-chart.py decode.json [--out decode.png]

Writes the PNG (tokens/s per run at each batch, the ratio to fp16 above each bar; default: beside
the JSON) and prints the table.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def load_report():
    """fusekit/bench/decode_report.py by path: importing the fusekit package needs its built library."""
    path = os.path.join(HERE, "..", "python", "fusekit", "bench", "decode_report.py")
    spec = importlib.util.spec_from_file_location("decode_report", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json")
    ap.add_argument("--out", default=None, help="the PNG (default: the JSON's path with .png)")
    a = ap.parse_args(argv)
    with open(a.json) as f:
        doc = json.load(f)
    report = load_report()
    print(report.table(doc))
    out = a.out or os.path.splitext(a.json)[0] + ".png"
    drawn = report.chart(doc, out)
    print(f"\nwrote {drawn}" if drawn else "\nno chart: matplotlib is not installed", file=sys.stderr)


if __name__ == "__main__":
    main()
