"""Markdown tables and the chart of a decode benchmark JSON (``python -m fusekit.bench.decode``).
Standard library only, matplotlib where it is installed: scripts/decode-chart.py loads this file by
path on machines where fusekit is not built."""
from __future__ import annotations

GIB = float(1 << 30)
RUN_ORDER = ["fp16", "fusekit_w4", "torch_int4"]
BASELINE = "fp16"


def _gib(b) -> str:
    if b is None:
        return "—"
    return f"{b / GIB:.2f} GiB" if b >= GIB / 8 else f"{b / 2**20:.2f} MiB"


def cell(r: dict | None, ref: dict | None = None) -> str:
    """'2,410 tok/s, 0.42 ms/token (3.10x), peak 4.1 GiB', or the status."""
    if r is None:
        return "—"
    if r["status"] == "oom":
        return "out of memory"
    if r["status"] != "ok":
        return r["status"]
    s = f"{r['tokens_per_s']:,.0f} tok/s, {r['ms_per_token']:.2f} ms/token"
    if ref is not None and ref is not r and ref.get("status") == "ok":
        s += f" ({r['tokens_per_s'] / ref['tokens_per_s']:.2f}x)"
    if r.get("peak_bytes") is not None:
        s += f", peak {r['peak_bytes'] / GIB:.1f} GiB"
    return s


def _runs(doc: dict) -> list[str]:
    seen = list(dict.fromkeys(r["run"] for r in doc.get("runs", []) + doc.get("decode", [])))
    return sorted(seen, key=lambda r: RUN_ORDER.index(r) if r in RUN_ORDER else len(RUN_ORDER))


def table(doc: dict) -> str:
    """Per run: its weights' memory and, per batch, tokens/s, time per token (the ratio to fp16 at
    the same batch) and peak memory."""
    dec = doc.get("decode", [])
    batches = sorted({r["batch"] for r in dec})
    by = {(r["run"], r["batch"]): r for r in dec}
    info = {r["run"]: r for r in doc.get("runs", [])}
    lines = ["| run | dtype | linear layers | LM head | model | " + " | ".join(f"batch {b}" for b in batches) + " |",
             "| --- | --- | --- | --- | --- | " + " | ".join("---" for _ in batches) + " |"]
    for run in _runs(doc):
        i = info.get(run, {})
        cells = [cell(by.get((run, b)), by.get((BASELINE, b))) for b in batches]
        sizes = " | ".join(_gib(i.get(k)) for k in ("linear_bytes", "lm_head_bytes", "model_bytes"))
        lines.append(f"| {run} | {i.get('dtype', '—')} | {sizes} | " + " | ".join(cells) + " |")
    s = doc.get("settings", {})
    lines.append(f"\nprompt {s.get('prompt_len')} tokens, {s.get('new_tokens')} greedy decode steps timed, graph "
                 f"{s.get('graph')}; ratios against {BASELINE} at the same batch; peak: "
                 "torch.cuda.max_memory_allocated() over prefill and decode (weights and KV cache included).")
    failed = [r for r in doc.get("runs", []) if r.get("status") != "ok"]
    failed += [r for r in dec if r.get("status") not in ("ok", "oom")]
    if failed:
        lines.append("")
        lines += [f"- {r['run']}{' batch ' + str(r['batch']) if 'batch' in r else ''}: {r['status']}: "
                  f"{r.get('message', '')}" for r in failed]
    return "\n".join(lines)


def check_table(doc: dict) -> str:
    lines = ["| run | batch | verdict | max logit difference (tolerance) | equal tokens | first differing step |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in doc.get("check", []):
        if "max_logit_diff" not in r:
            lines.append(f"| {r['run']} | — | {r['status']}: {r.get('message', '')} | | | |")
            continue
        lines.append(f"| {r['run']} | {r['batch']} | {r['status']} | {r['max_logit_diff']:.3g} ({r['tol']:.3g}) | "
                     f"{r['tokens_equal']}/{r['tokens']} | {', '.join(map(str, r['diverged_at'])) or '—'} |")
    return "\n".join(lines)


def host_table(doc: dict) -> str:
    h = doc.get("host_overhead", {})
    device = any("device_us" in r for r in h.get("rows", []))
    lines = [f"{h.get('device')}: x [rows, 1, {h.get('k')}], weight [{h.get('n')}, {h.get('k')}] (group "
             f"{h.get('group')}); µs per eager call, best of {h.get('rounds')} loops of {h.get('calls')} calls",
             "", "| call | rows | host µs |" + (" device µs (graph replay) |" if device else ""),
             "| --- | --- | --- |" + (" --- |" if device else "")]
    for r in h.get("rows", []):
        if "note" in r:
            lines.append(f"| {r['case']} | {r['rows']} | {r['note']} |" + (" |" if device else ""))
            continue
        dev = f" {r['device_us']:.1f} |" if "device_us" in r else " — |"
        lines.append(f"| {r['case']} | {r['rows']} | {r['host_us']:.1f} |" + (dev if device else ""))
    return "\n".join(lines)


def chart(doc: dict, path: str) -> str | None:
    """Grouped bars of tokens/s, a group per batch, a bar per run (the ratio to fp16 above it);
    the path written, or None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dec = [r for r in doc.get("decode", []) if r.get("status") == "ok"]
    runs = [r for r in _runs(doc) if any(d["run"] == r for d in dec)]
    batches = sorted({r["batch"] for r in dec})
    by = {(r["run"], r["batch"]): r for r in dec}
    fig, ax = plt.subplots(figsize=(2.2 + 2.2 * len(batches), 4.2))
    w = 0.8 / max(1, len(runs))
    for i, run in enumerate(runs):
        for j, b in enumerate(batches):
            r, ref = by.get((run, b)), by.get((BASELINE, b))
            if r is None:
                continue
            x = j + (i - (len(runs) - 1) / 2) * w
            ax.bar(x, r["tokens_per_s"], w, color=f"C{i}", label=run if j == 0 else None)
            ratio = f"\n{r['tokens_per_s'] / ref['tokens_per_s']:.2f}x" if ref is not None and run != BASELINE else ""
            ax.text(x, r["tokens_per_s"], f"{r['tokens_per_s']:,.0f}{ratio}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    ax.set_ylabel("tokens/s (greedy decode)")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.2)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    env, cfg, s = doc.get("environment", {}), doc.get("config", {}), doc.get("settings", {})
    ax.set_title(f"{env.get('gpu', env.get('device', '?'))}: LLaMA {cfg.get('name')} ({cfg.get('layers')} layers), "
                 f"prompt {s.get('prompt_len')}, {s.get('new_tokens')} steps, graph {s.get('graph')}, "
                 f"torch {env.get('versions', {}).get('torch')}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
