"""Markdown tables of a language-model benchmark JSON (``python -m fusekit.bench.lm``), and the
merge of several such files. Standard library only: scripts/lm-charts.py loads this file by path
on machines where fusekit is not built."""
from __future__ import annotations

GIB = float(1 << 30)


def merge(docs: list[dict]) -> dict:
    """One document from several runs of the benchmark (split to fit a time limit): the first's
    environment, every measurement; a later (run, precision, batch) replaces an earlier one."""
    out = dict(docs[0])
    for key, ident in (("runs", ("run", "precision")), ("throughput", ("run", "precision", "batch")),
                       ("max_batch", ("run", "precision")),
                       ("train", ("run", "precision")), ("lora", ("run", "precision", "batch"))):
        rows: dict = {}
        for d in docs:
            for r in d.get(key, []):
                rows[tuple(r.get(k) for k in ident)] = r
        out[key] = list(rows.values())
    if len(docs) > 1:
        out["merged_from"] = [d.get("command") for d in docs]
    return out


def rate(x: float) -> str:
    """396k, 4.5k, 850."""
    return f"{x / 1e3:.0f}k" if x >= 1e5 else f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.0f}"


def cell(r: dict | None, ref: dict | None = None) -> str:
    if r is None:
        return "—"
    if r["status"] == "oom":
        return "out of memory"
    if r["status"] != "ok":
        return r["status"]
    mem = f"{r['peak_bytes'] / GIB:.1f} GiB, " if r.get("peak_bytes") is not None else ""
    s = f"{mem}{rate(r['tokens_per_s'])} tok/s"
    if ref is not None and ref is not r and ref.get("status") == "ok":
        s += f" ({r['tokens_per_s'] / ref['tokens_per_s']:.2f}x)"
    return s


def _runs(rows):
    seen = []
    for r in rows:
        if (r["run"], r["precision"]) not in seen:
            seen.append((r["run"], r["precision"]))
    return seen


def table(doc: dict) -> str:
    """Per run and precision: peak memory and tokens/s per batch (with the ratio to eager at the
    same precision and batch), the largest batch that fits, the validation loss."""
    thr, mb, tr = doc.get("throughput", []), doc.get("max_batch", []), doc.get("train", [])
    batches = sorted({r["batch"] for r in thr})
    by = {(r["run"], r["precision"], r["batch"]): r for r in thr}
    mbx = {(r["run"], r["precision"]): r for r in mb}
    trx = {(r["run"], r["precision"]): r for r in tr}
    lines = ["| run | precision | " + " | ".join(f"batch {b}" for b in batches) + " | largest batch | val loss |",
             "| --- | --- | " + " | ".join("---" for _ in batches) + " | --- | --- |"]
    for run, prec in _runs(thr + mb + tr):
        cells = [cell(by.get((run, prec, b)), by.get(("eager", prec, b))) for b in batches]
        m = mbx.get((run, prec))
        if m is None:
            mcell = "—"
        elif m.get("status") != "ok":
            mcell = m.get("status", "—")
        else:
            mcell = f"{m['max_batch']}{'+' if m.get('bounded') else ''}"
            if m.get("oom_alloc"):
                mcell += f" (at {m['first_oom_batch']}: {m['oom_alloc']})"
        t = trx.get((run, prec))
        vcell = f"{t['val_loss']:.4f}" if t and t.get("val_loss") is not None else (t or {}).get("status", "—")
        lines.append(f"| {run} | {prec} | " + " | ".join(cells) + f" | {mcell} | {vcell} |")
    lines.append("\ntokens/s ratios: against eager at the same precision and batch; largest batch: N+ where "
                 "the search stopped at its limit, else the first batch out of memory and the allocation that failed.")
    lora = doc.get("lora", [])
    if lora:
        lb = sorted({r["batch"] for r in lora})
        lby = {(r["run"], r["precision"], r["batch"]): r for r in lora}
        lines += ["", "| LoRA run | precision | " + " | ".join(f"batch {b}" for b in lb) + " |",
                  "| --- | --- | " + " | ".join("---" for _ in lb) + " |"]
        for run, prec in _runs(lora):
            lines.append(f"| {run} | {prec} | " + " | ".join(
                cell(lby.get((run, prec, b)), lby.get(("peft", prec, b))) for b in lb) + " |")
        lines.append("\nLoRA ratios: against PEFT eager at the same precision and batch.")
    unavailable = [r for r in doc.get("runs", []) if r.get("status") != "ok"]
    if unavailable:
        lines.append("")
        lines += [f"- {r['run']} ({r['precision']}): {r['status']}: {r.get('message', '')}" for r in unavailable]
    return "\n".join(lines)
