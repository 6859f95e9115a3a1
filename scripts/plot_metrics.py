#!/usr/bin/env python3
"""Training loss and test AUC of `fusekit train --metrics-json` runs, against samples seen.

    scripts/plot_metrics.py METRICS.json [more.json ...] --out PNG

Two panels: the mean training loss of each progress window (the file's `train` records) and the
test AUC of each evaluation (its `evaluations`), both against the training samples seen so far.
Several files overlay, each labelled with its file name. Needs matplotlib (drawn with Agg, no
display). A file that is not a fusekit metrics JSON is an error naming it, with exit status 2.
"""
import argparse
import json
import os
import sys


class NotMetrics(Exception):
    pass


def load(path):
    """The (samples_seen, loss) and (samples_seen, auc) points of one metrics file."""
    try:
        with open(path) as f:
            m = json.load(f)
    except OSError as e:
        raise NotMetrics(f"cannot be read ({e.strerror})")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise NotMetrics(f"not JSON ({e})")
    if not isinstance(m, dict) or not all(k in m for k in ("config", "evaluations", "summary")):
        raise NotMetrics("not a fusekit metrics JSON (no config, evaluations and summary: "
                         "fusekit train --metrics-json writes one)")
    try:
        batch = m["config"]["training"]["mini_batch_size"]
        # samples_seen where a record has it; step x batch (exact when every batch is whole) in
        # files written before it was recorded.
        seen = lambda r: r["samples_seen"] if "samples_seen" in r else r["step"] * batch
        loss = [(seen(r), r["loss"]) for r in m.get("train", [])]
        auc = [(seen(r), r["auc"]) for r in m["evaluations"] if r.get("auc") is not None]
    except (KeyError, TypeError) as e:
        raise NotMetrics(f"not a fusekit metrics JSON (a record lacks {e})")
    return loss, auc


def labels(paths):
    """File names, or the paths as given where two files share a name."""
    names = [os.path.basename(p) for p in paths]
    return [n if names.count(n) == 1 else p for n, p in zip(names, paths)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("metrics", nargs="+", help="fusekit train --metrics-json files")
    ap.add_argument("--out", required=True, help="PNG file to write")
    args = ap.parse_args()
    runs = []
    for path, label in zip(args.metrics, labels(args.metrics)):
        try:
            runs.append((label, *load(path)))
        except NotMetrics as e:
            print(f"plot_metrics: {path}: {e}", file=sys.stderr)
            return 2
    try:
        import matplotlib
    except ImportError:
        print("plot_metrics: needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return 2
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_auc) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, loss, auc in runs:
        if loss:
            ax_loss.plot(*zip(*loss), marker=".", label=label)
        if auc:
            ax_auc.plot(*zip(*auc), marker="o", label=label)
        if not loss:
            print(f"plot_metrics: {label}: no training windows (the run printed no progress lines)",
                  file=sys.stderr)
    ax_loss.set(title="training loss (mean of each progress window)", xlabel="samples seen",
                ylabel="BCE loss")
    ax_auc.set(title="test AUC (each evaluation)", xlabel="samples seen", ylabel="AUC")
    for ax in (ax_loss, ax_auc):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(args.out, dpi=120)
    except OSError as e:
        print(f"plot_metrics: {args.out}: cannot be written ({e.strerror})", file=sys.stderr)
        return 2
    print(f"plot_metrics: {len(runs)} run(s) drawn in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
