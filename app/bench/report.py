"""`tandem bench` figures: paired ratios to plain Tandem, medians with spread, a plot.

Every run is paired with the plain-Tandem run of the same workload, prompt and
repetition (they ran back to back), so a ratio compares two runs that saw the same
machine load; medians over prompts and repetitions are reported with their min-max.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path

from tandem.app.bench.peers import PEERS
from tandem.runtime.backends.protocol import Backend
from tandem.runtime.streaming_text import tokens_text


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median and range of ``values``."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _row(name: str, runs: list, plain: dict) -> dict:
    pairs = [(r.result, plain[(r.workload, r.prompt, r.rep)]) for r in runs]
    calls = sum(r.target_calls for r, _ in pairs)
    drafted = sum(r.drafted for r, _ in pairs)
    return {
        "kind": "peer" if name in PEERS else "tandem",
        "tokens_per_s": spread([r.tokens_per_s for r, _ in pairs]),
        "ratio": spread([r.tokens_per_s / p.tokens_per_s if p.tokens_per_s else 0.0 for r, p in pairs]),
        "cpu_ratio": spread([r.cpu_tokens_per_s / p.cpu_tokens_per_s if p.cpu_tokens_per_s else 0.0
                             for r, p in pairs]),
        "tokens_per_call": sum(len(r.tokens) for r, _ in pairs) / calls if calls else None,
        "acceptance": sum(r.accepted for r, _ in pairs) / drafted if drafted else None,
        "identical": all(r.tokens == p.tokens for r, p in pairs),
        "mismatches": sum(r.tokens != p.tokens for r, p in pairs),
        "setup_s": max(r.setup_s for r, _ in pairs),
        "runs": len(pairs),
        "describe": pairs[0][0].describe,
    }


def summarize(runs: list, target: Backend, names: Sequence[str]) -> dict:
    """Per workload and configuration: decode rate, paired ratio to plain (median and
    min-max), tokens per target call, acceptance and greedy identity with plain; the
    best fixed-length configuration and how each adaptive one compares with it; the
    plain outputs of the first repetition (so the prompts can be judged)."""
    plain = {(r.workload, r.prompt, r.rep): r.result for r in runs if r.config == "plain"}
    eog = target.special.eog
    workloads: dict[str, dict] = {}
    for wl in dict.fromkeys(r.workload for r in runs):
        rows = {}
        for name in names:
            mine = [r for r in runs if r.workload == wl and r.config == name]
            if mine:
                rows[name] = _row(name, mine, plain)
        fixed = {k: v["ratio"]["median"] for k, v in rows.items() if "@" in k}
        best = max(fixed, key=fixed.__getitem__) if fixed and max(fixed.values()) > 1.0 else "plain"
        best_ratio = max(1.0, fixed.get(best, 1.0))
        samples = []
        for (w, prompt, rep), res in sorted(plain.items()):
            if w == wl and rep == 0:
                eog_at = next((i for i, t in enumerate(res.tokens) if t in eog), None)
                samples.append({"prompt": prompt, "eog_at": eog_at,
                                "text": tokens_text(target.token_bytes, res.tokens)})
        workloads[wl] = {
            "rows": rows,
            "best_fixed": best,
            "best_fixed_ratio": best_ratio,
            "adaptive_vs_best_fixed": {k: v["ratio"]["median"] / best_ratio for k, v in rows.items()
                                       if v["kind"] == "tandem" and (k == "ngram" or k.startswith("auto"))},
            "plain_samples": samples,
        }
    flat = [{"config": r.config, "workload": r.workload, "prompt": r.prompt, "rep": r.rep,
             "tokens_per_s": r.result.tokens_per_s, "cpu_tokens_per_s": r.result.cpu_tokens_per_s,
             "target_calls": r.result.target_calls, "drafted": r.result.drafted, "accepted": r.result.accepted,
             "setup_s": r.result.setup_s} for r in runs]
    return {"workloads": workloads, "runs": flat}


def _fmt_spread(s: dict, digits: int = 2) -> str:
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def format_report(report: dict) -> str:
    """The per-workload tables as text."""
    lines = []
    for wl, table in report["workloads"].items():
        lines.append(f"\n[{wl}]  {'config':14s} {'tok/s (min-max)':>22s} {'ratio (min-max)':>18s} "
                     f"{'cpu ratio':>9s} {'tok/call':>8s} {'accept':>6s}  same as plain")
        for name, row in table["rows"].items():
            acc = f"{row['acceptance']:.0%}" if row["acceptance"] is not None else "-"
            same = "yes" if row["identical"] else ("NO" if row["kind"] == "tandem" else "no (peer)")
            lines.append(f"  {name:20s} {_fmt_spread(row['tokens_per_s']):>22s} {_fmt_spread(row['ratio']):>18s} "
                         f"{row['cpu_ratio']['median']:8.2f}x {row['tokens_per_call'] or 0:8.2f} {acc:>6s}  {same}")
        adaptive = ", ".join(f"{k} {v:.2f}" for k, v in table["adaptive_vs_best_fixed"].items())
        lines.append(f"  best fixed: {table['best_fixed']} ({table['best_fixed_ratio']:.2f}x); "
                     f"adaptive / best fixed: {adaptive}")
    peers = report.get("config", {}).get("peers")
    if peers:
        lines.append("\n" + peers)
    return "\n".join(lines)


def markdown_table(report: dict) -> str:
    """Workloads x configurations: median ratio to plain Tandem (min-max), as the issue's
    table; a non-identical Tandem configuration is marked."""
    names: list[str] = []
    for table in report["workloads"].values():
        names += [n for n in table["rows"] if n not in names]
    lines = ["| workload | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for wl, table in report["workloads"].items():
        cells = []
        for name in names:
            row = table["rows"].get(name)
            if row is None:
                cells.append("-")
                continue
            if name == "plain":
                cells.append(f"{row['tokens_per_s']['median']:.2f} tok/s")
                continue
            mark = "" if row["identical"] or row["kind"] == "peer" else " (differs!)"
            tpc = f", {row['tokens_per_call']:.2f} t/c" if row["tokens_per_call"] else ""
            cells.append(f"{_fmt_spread(row['ratio'])}{tpc}{mark}")
        lines.append(f"| {wl} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_report(report: dict, path: str | Path) -> None:
    """One panel per workload: each configuration's median ratio to plain Tandem, with
    its min-max over prompts and repetitions; peers in grey, a Tandem configuration
    whose output differs from plain in red."""
    import matplotlib  # local: the [plots] extra (`tandem bench` checks it is there first)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # local: the [plots] extra, needed only to draw

    wls = list(report["workloads"])
    cols = min(2, len(wls))
    rows_n = math.ceil(len(wls) / cols)
    n_cfg = max(len(t["rows"]) for t in report["workloads"].values())
    fig, axes = plt.subplots(rows_n, cols, figsize=(6.5 * cols, 0.38 * n_cfg * rows_n + 1.6 * rows_n), squeeze=False)
    for ax in axes.flat[len(wls):]:
        ax.set_visible(False)
    for ax, wl in zip(axes.flat, wls, strict=False):
        table = report["workloads"][wl]["rows"]
        names = list(table)[::-1]
        y = list(range(len(names)))
        med = [table[n]["ratio"]["median"] for n in names]
        err = [[m - table[n]["ratio"]["min"] for n, m in zip(names, med, strict=True)],
               [table[n]["ratio"]["max"] - m for n, m in zip(names, med, strict=True)]]
        colors = ["tab:gray" if table[n]["kind"] == "peer" else ("tab:blue" if table[n]["identical"] else "tab:red")
                  for n in names]
        ax.barh(y, med, xerr=err, color=colors, capsize=3, height=0.6)
        for yi, n, m in zip(y, names, med, strict=True):
            tpc = table[n]["tokens_per_call"]
            ax.text(max(m, table[n]["ratio"]["max"]) + 0.03, yi, f"{m:.2f}x" + (f"  {tpc:.1f} t/c" if tpc else ""),
                    va="center", fontsize=7)
        ax.set_yticks(y, names, fontsize=8)
        ax.axvline(1.0, color="k", lw=0.8)
        xmax = max(table[n]["ratio"]["max"] for n in names)
        ax.set_xlim(0, xmax * 1.3 + 0.1)
        plain = table["plain"]["tokens_per_s"]["median"] if "plain" in table else 0.0
        ax.set_title(f"{wl} (plain Tandem {plain:.1f} tok/s)", fontsize=10)
        ax.set_xlabel("decode rate / plain Tandem (median, min-max)", fontsize=8)
    cfg = report.get("config", {})
    fig.suptitle(f"{Path(cfg.get('target', '')).name}: {cfg.get('threads')} thread(s), {cfg.get('n_tokens')} tokens, "
                 f"{cfg.get('reps')} rep(s) x {cfg.get('prompts')} prompt(s); grey: llama-cpp-python", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
