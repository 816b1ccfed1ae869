"""`tandem bench --gpu`: the comparisons a GPU user needs, in one run.

Every model goes wholly on the GPU when llama.cpp lists one
(:func:`~tandem.runtime.backends.llama_devices.gpu_offload_build`; the memory planner
then gives the target ``n_gpu_layers=-1`` when it fits), else on the CPU, so the same
run works everywhere:

1. **plain**: Tandem's default plain decoding (:func:`open_engine`) against
   llama-cpp-python's own default ``Llama`` on the same file, GPU layers, threads and
   prompt ids: decode and prefill (a ~500-token prompt) rates, alternating, medians,
   min-max, ratio;
2. **cost**: the target's verify-cost curve c(e) for calls of e = 1..16 tokens and the
   drafter's cost per drafted token (:mod:`tandem.app.bench.cost_curve`);
3. **end to end**: `tandem bench` on the edit and extract workloads (plain, model-free
   drafting, the drafter's configurations), ratio to plain and greedy mismatches
   (on a GPU, batched and one-token kernels may part at near ties);
4. **modeled**: acceptance recorded with the real models (:mod:`.acceptance_traces`) priced on
   the curve of section 2;
5. **bigger than the card** (with ``vram``): each placement the planner compares for a
   target that does not fit that GPU budget, timed against plain llama.cpp partial
   offload at the same budget (:mod:`.placements`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tandem.app.bench import acceptance_traces
from tandem.app.bench.cost_curve import measure_costs
from tandem.app.bench.peers import LlamaPeer
from tandem.app.bench.placements import PlacementBenchConfig, bench_placements, format_placements
from tandem.app.bench.report import spread
from tandem.app.bench.runner import BenchConfig, run_bench, run_tandem
from tandem.app.bench.workloads import EDIT, EXTRACT, workload
from tandem.runtime.backends import llama_devices
from tandem.runtime.backends.protocol import prefill
from tandem.runtime.chat import chat_prompt
from tandem.runtime.engine.builder import open_engine
from tandem.runtime.engine.spec import EngineSpec
from tandem.runtime.machine import cpu_cores

GPU_WORKLOADS = ("edit", "extract")
PREFILL_TOKENS = 500
YMAX = 6.0
"""The plot's ratios are clipped here (a run of a few tokens can show absurd rates); the
bars' labels keep the figures."""


@dataclass
class GpuBenchConfig:
    target: Path
    draft: Path | None = None
    acceptance: dict | None = None
    """A recorded acceptance file (:func:`tandem.app.bench.acceptance_traces.load`)."""
    n_tokens: int = 64
    reps: int = 3
    prompts: int = 2
    threads: int | None = None
    ctx: int = 1024
    k_max: int = 16
    """Longest call of the cost curve, in tokens."""
    vram: str | None = None
    """A GPU budget the target does not fit whole: section 5 times the planner's placements."""
    budget: str | None = None
    """Host budget of section 5's plan (default: the planner's share of RAM)."""
    log: Callable[[str], None] = print


def device_name() -> str:
    """The GPU llama.cpp offloads to, or ``CPU``."""

    if not llama_devices.gpu_offload_build():
        return "CPU (llama.cpp lists no GPU)"
    gpus = llama_devices.gpu_devices()
    return ", ".join(f"{d.name} {d.description} ({d.total_bytes / 2**30:.0f} GiB)" for d in gpus) or "GPU"


def long_prompt(target, tokens: int = PREFILL_TOKENS) -> list[int]:
    """About ``tokens`` prompt ids: the edit and extract requests, one chat turn."""
    ids = chat_prompt(target, [{"role": "user", "content": "\n\n".join(EDIT + EXTRACT)}])[0]
    return ids[:tokens]


def plain_vs_peer(cfg: GpuBenchConfig, threads: int) -> dict:
    """Section 1: Tandem's plain default vs llama-cpp-python's default, same GPU layers."""
    engine = open_engine(EngineSpec(cfg.target, draft_mode="off", threads=threads, n_ctx=cfg.ctx,
                                    engine="llama.cpp"))
    peer = None
    try:
        layers = engine.plan.target.n_gpu_layers if engine.plan else 0
        peer = LlamaPeer(cfg.target, n_ctx=engine.target.n_ctx, threads=threads, lookup=False, n_gpu_layers=layers)
        target = engine.target
        prompts = workload(target, "edit", cfg.prompts).prompts
        longp = long_prompt(target)
        decode: dict[str, list[float]] = {"tandem": [], "llama": []}
        fill: dict[str, list[float]] = {"tandem": [], "llama": []}
        same = 0
        for rep in range(cfg.reps + 1):  # the first round warms both up and is not counted
            order = ("tandem", "llama") if rep % 2 else ("llama", "tandem")
            for prompt in prompts:
                outs = {}
                for who in order:
                    res = (run_tandem(engine, prompt, cfg.n_tokens, shared_suffix_cache=False) if who == "tandem"
                           else peer.run(prompt, cfg.n_tokens))
                    outs[who] = res.tokens
                    if rep:
                        decode[who].append(res.tokens_per_s)
                same += rep > 0 and outs["tandem"] == outs["llama"]
            for who in order:
                if who == "tandem":
                    target.truncate(0)
                    start = time.perf_counter()
                    prefill(target, longp)
                else:
                    peer.llm.reset()
                    start = time.perf_counter()
                    peer.llm.eval(longp)
                if rep:
                    fill[who].append(len(longp) / (time.perf_counter() - start))
        ratio = {"decode": spread([t / p for t, p in zip(decode["tandem"], decode["llama"], strict=True)]),
                 "prefill": spread([t / p for t, p in zip(fill["tandem"], fill["llama"], strict=True)])}
        return {"n_gpu_layers": layers, "prompt_tokens": len(longp),
                "decode_tok_s": {k: spread(v) for k, v in decode.items()},
                "prefill_tok_s": {k: spread(v) for k, v in fill.items()},
                "ratio": ratio, "same_output": f"{same}/{len(decode['tandem'])}"}
    finally:
        if peer is not None:
            peer.close()
        engine.close()


def run_gpu_bench(cfg: GpuBenchConfig) -> dict:
    """The four sections; one that fails leaves its error (one line) in its place and the
    others still run, so one run on a lent GPU machine brings back all it can."""
    threads = cfg.threads or cpu_cores()
    out: dict = {"device": device_name(), "target": cfg.target.name,
                 "draft": cfg.draft.name if cfg.draft else None, "n_tokens": cfg.n_tokens, "reps": cfg.reps,
                 "threads": threads}
    cfg.log(f"device: {out['device']}")
    started = time.perf_counter()

    def section(key: str, title: str, fn: Callable[[], dict]) -> None:
        cfg.log(title)
        try:
            out[key] = fn()
        except Exception as exc:  # noqa: BLE001  # reported in its section; the others still run
            out[key] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
            cfg.log(f"{key}: {out[key]['error']}")

    section("plain", "1/4 plain decoding: Tandem vs llama-cpp-python", lambda: plain_vs_peer(cfg, threads))
    layers = out["plain"].get("n_gpu_layers", -1 if not out["device"].startswith("CPU") else 0)
    section("cost", "2/4 the verify-cost curve", lambda: measure_costs(
        cfg.target, drafters=[cfg.draft] if cfg.draft else [], threads=threads, k_max=cfg.k_max - 1,
        reps=cfg.reps, n_ctx=cfg.ctx, n_gpu_layers=layers).as_dict())
    section("end_to_end", "3/4 end to end on edit and extract", lambda: end_to_end(cfg, threads))
    if cfg.acceptance is not None:
        section("modeled", "4/4 modeled speedups from the recorded acceptance", lambda: modeled(cfg, out["cost"]))
    if cfg.vram is not None:
        section("placements", f"5/5 bigger than the card: the placements at {cfg.vram} of GPU memory",
                lambda: bench_placements(PlacementBenchConfig(
                    cfg.target, cfg.draft, cfg.vram, cfg.budget, ctx=cfg.ctx, threads=threads, n_tokens=cfg.n_tokens,
                    prompts=cfg.prompts, reps=cfg.reps, log=cfg.log)))
    out["seconds"] = round(time.perf_counter() - started, 1)
    return out


def end_to_end(cfg: GpuBenchConfig, threads: int) -> dict:
    """Section 3: `tandem bench` on the edit and extract workloads, Tandem only."""
    e2e = run_bench(BenchConfig(target=cfg.target, draft=cfg.draft, n_tokens=cfg.n_tokens, prompts=cfg.prompts,
                                reps=max(1, cfg.reps - 1), workloads=GPU_WORKLOADS, threads=threads, ctx=cfg.ctx,
                                peers=False, log=cfg.log))
    return {wl: {name: {"tokens_per_s": row["tokens_per_s"], "ratio": row["ratio"],
                        "acceptance": row["acceptance"], "tokens_per_call": row["tokens_per_call"],
                        "mismatches": row["mismatches"], "runs": row["runs"]}
                 for name, row in table["rows"].items()}
            for wl, table in e2e["workloads"].items()}


def modeled(cfg: GpuBenchConfig, cost: dict) -> dict:
    """Section 4: the recorded acceptance priced on section 2's curve and drafter cost."""
    if "error" in cost:
        raise RuntimeError("no cost curve was measured (section 2 failed)")
    record = cfg.acceptance or {}
    return {"note": f"modeled: acceptance recorded with the real models ({record.get('target')}, drafters "
                    f"{record.get('drafters')}), priced with this device's c(e) and drafter cost",
            "workloads": acceptance_traces.price(record, cost["curves"]["exact"],
                                                 next(iter(cost["drafter_cost"].values()), None))}


def _s(s: dict, digits: int = 2) -> str:
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def format_gpu(res: dict) -> str:
    lines = [f"{res['target']} on {res['device']}: n_gpu_layers {res['plain'].get('n_gpu_layers', '?')}, "
             f"{res['n_tokens']} tokens, {res['reps']} rep(s), {res['threads']} thread(s), {res['seconds']} s", ""]
    sections = (("plain", "[1] plain decoding", _format_plain), ("cost", "[2] verify cost", _format_cost),
                ("end_to_end", "[3] end to end", _format_e2e), ("modeled", "[4] modeled", _format_modeled),
                ("placements", "[5] placements", lambda r: format_placements(r["placements"])))
    for key, title, fmt in sections:
        if key == "modeled" and key not in res:
            lines += ["[4] modeled speedups: pass --acceptance FILE (recorded with --record-acceptance)"]
        elif key not in res:
            continue
        elif "error" in res[key]:
            lines += [f"{title}: failed: {res[key]['error']}", ""]
        else:
            lines += [*fmt(res), ""]
    return "\n".join(lines).rstrip()


def _format_plain(res: dict) -> list[str]:
    p = res["plain"]
    return ["[1] plain decoding: Tandem's default vs llama-cpp-python's default (median, min-max)",
             f"  decode  tok/s  Tandem {_s(p['decode_tok_s']['tandem'], 1):>22s}  llama-cpp-python "
             f"{_s(p['decode_tok_s']['llama'], 1):>22s}  ratio {_s(p['ratio']['decode'])}",
             f"  prefill tok/s  Tandem {_s(p['prefill_tok_s']['tandem'], 0):>22s}  llama-cpp-python "
             f"{_s(p['prefill_tok_s']['llama'], 0):>22s}  ratio {_s(p['ratio']['prefill'])}"
             f"  ({p['prompt_tokens']}-token prompt)",
             f"  same output: {p['same_output']} runs"]


def _format_cost(res: dict) -> list[str]:
    lines = []
    c = res["cost"]
    curve = c["curves"]["exact"]
    shown = [e for e in (1, 2, 3, 4, 5, 6, 7, 8, 12, 16) if e <= len(curve)]
    lines.append(f"[2] verify cost c(e) = e-token call / 1-token call ({c['context']} tokens cached)")
    lines.append(f"  {'config':6s} {'t1 ms':>7s}  " + " ".join(f"c({e})".rjust(6) for e in shown))
    for name, cv in c["curves"].items():
        lines.append(f"  {name:6s} {c['t1_ms'][name]:7.2f}  " + " ".join(f"{cv[e - 1]:6.2f}" for e in shown))
    for name, cost in c["drafter_cost"].items():
        lines.append(f"  drafter {name}: {cost:.3f} of a target one-token call per drafted token")
    return lines


def _format_e2e(res: dict) -> list[str]:
    lines = ["[3] end to end (measured): tok/s, ratio to plain (median, min-max), greedy mismatches"]
    for wl, rows in res["end_to_end"].items():
        for name, row in rows.items():
            acc = f"{row['acceptance']:.0%}" if row["acceptance"] is not None else "-"
            lines.append(f"  {wl:8s} {name:12s} {_s(row['tokens_per_s'], 1):>22s}  {_s(row['ratio']):>18s}  "
                         f"accept {acc:>4s}  mismatches {row['mismatches']}/{row['runs']}")
    return lines


def _format_modeled(res: dict) -> list[str]:
    lines = [f"[4] modeled speedup over plain ({res['modeled']['note']})"]
    for wl, rows in res["modeled"]["workloads"].items():
        for name, row in rows.items():
            acc = f"{row['acceptance']:.0%}" if row["acceptance"] is not None else "-"
            lines.append(f"  {wl:8s} {name:12s} {row['modeled_speedup']:6.2f}x modeled  accept {acc:>4s}  "
                         f"{row['tokens_per_call']:.2f} tokens/call")
    return lines


def plot_gpu(res: dict, path: str | Path) -> None:
    """Bars of the ratio to plain per workload and configuration: measured end to end
    (blue, min-max) and modeled (orange); plain decoding's ratio to llama-cpp-python in
    the title."""
    import matplotlib  # local: the [plots] extra (checked before the run)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # local: the [plots] extra, needed only to draw

    measured_all = res.get("end_to_end", {}) if "error" not in res.get("end_to_end", {}) else {}
    modeled = res.get("modeled", {}).get("workloads", {})
    wls = list(dict.fromkeys([*measured_all, *modeled]))
    rows = [r for r in res.get("placements", {}).get("rows", []) if r.get("ratio_to_llama")]
    if not wls and not rows:
        return  # sections 3 to 5 failed: their errors are in the text and the JSON
    panels = len(wls) + bool(rows)
    fig, axes = plt.subplots(1, panels, figsize=(6.0 * panels, 4.2), squeeze=False)
    if rows:
        _plot_placements(axes.flat[-1], rows)
    for ax, wl in zip(list(axes.flat)[:len(wls)], wls, strict=True):
        measured = measured_all.get(wl, {})
        names = list(dict.fromkeys([*measured, *modeled.get(wl, {})]))
        x = range(len(names))
        med = [measured[n]["ratio"]["median"] if n in measured else 0.0 for n in names]
        err = [[m - measured[n]["ratio"]["min"] if n in measured else 0.0 for n, m in zip(names, med, strict=True)],
               [measured[n]["ratio"]["max"] - m if n in measured else 0.0 for n, m in zip(names, med, strict=True)]]
        ax.bar([i - 0.2 for i in x], med, 0.4, yerr=err, capsize=3, color="tab:blue", label="measured")
        mod = [modeled.get(wl, {}).get(n, {}).get("modeled_speedup", 0.0) for n in names]
        if any(mod):
            ax.bar([i + 0.2 for i in x], mod, 0.4, color="tab:orange", label="modeled (real acceptance)")
        for i, (m, o) in enumerate(zip(med, mod, strict=True)):
            for dx, v in ((-0.2, m), (0.2, o)):
                if v:
                    ax.text(i + dx, min(v, YMAX) + 0.05, f"{v:.2f}", ha="center", fontsize=7)
        ax.set_ylim(0, min(YMAX, max([*med, *mod, 1.0]) * 1.2 + 0.2))
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(list(x), names, rotation=30, fontsize=8)
        ax.set_ylabel("ratio to plain Tandem")
        ax.set_title(wl, fontsize=10)
        ax.legend(fontsize=7)
    p = res.get("plain", {}).get("ratio")
    fig.suptitle(f"{res['target']} on {res['device']}" + (f": plain Tandem / llama-cpp-python decode "
                 f"{p['decode']['median']:.2f}x, prefill {p['prefill']['median']:.2f}x" if p else ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)



def _plot_placements(ax, rows: list[dict]) -> None:
    """Section 5: each placement's tok/s over plain llama.cpp partial offload at the same
    budget, plain (blue) and speculative (orange); the planner's pick starred."""
    names = [("* " if r["chosen"] else "") + r["name"] for r in rows]
    x = range(len(rows))
    for dx, mode, color in ((-0.2, "plain", "tab:blue"), (0.2, "speculative", "tab:orange")):
        values = [r["ratio_to_llama"].get(mode, 0.0) for r in rows]
        ax.bar([i + dx for i in x], values, 0.4, color=color, label=mode)
        for i, v in enumerate(values):
            if v:
                ax.text(i + dx, min(v, YMAX) + 0.05, f"{v:.2f}", ha="center", fontsize=7)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_ylim(0, min(YMAX, max([1.0, *(v for r in rows for v in r["ratio_to_llama"].values())]) * 1.2 + 0.2))
    ax.set_xticks(list(x), names, rotation=30, fontsize=7, ha="right")
    ax.set_ylabel("ratio to llama.cpp partial offload")
    ax.set_title("bigger than the card (* planner's pick)", fontsize=10)
    ax.legend(fontsize=7)
