"""`tandem bench`: plain vs every speculative configuration, same target, same prompts.

Everything runs in one process. For each repetition, workload and prompt, the
configurations run back to back in a rotated order (so a busy machine's slow spells
spread over all of them), and each speculative run is compared with the plain run of
the same prompt and repetition: speedup ratios, greedy identity, acceptance, tokens per
target call, and the speedup *predicted* from the measured draft lengths/acceptance
and the target's c(k) alone (so measured/predicted shows what drafting cost and
per-round overhead take). Medians over prompts and repetitions are reported.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tandem.kernels.sampling import Sampler, SamplingParams
from tandem.runtime.adaptive import (
    AdaptiveConfig,
    AdaptivePolicy,
    CostCurve,
    FixedLength,
    load_cost_curve,
)
from tandem.runtime.backend import Backend
from tandem.runtime.drafters.base import Drafter
from tandem.runtime.generate import DoneEvent, autoregressive, generate
from tandem.runtime.llama_backend import LlamaConfig, LlamaCppBackend
from tandem.runtime.speculative import MODEL_FREE_SOURCES, open_model_drafter, speculative

STORY_PROMPTS = ("Once upon a time", "The little dog", "Lily and Tom went to the park. They",
                 "One day, a big", "There was a girl named Sue", "The sun was hot and")
WORKLOADS = ("story", "random", "repetitive")


@dataclass
class BenchConfig:
    target: Path
    draft: Path | None = None
    oracle: Path | None = None
    n_tokens: int = 64
    prompts: int = 2
    """Prompts per workload."""
    reps: int = 1
    lengths: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)
    drafters: tuple[str, ...] = ("ngram", "suffix", "lookup", "model", "oracle")
    workloads: tuple[str, ...] = WORKLOADS
    threads: int | None = None
    ctx: int | None = None
    """Context size; None = the model's own (<= 4096)."""
    llama_baseline: bool = True
    log: Callable[[str], None] = print


@dataclass
class Run:
    config: str
    workload: str
    prompt: int
    rep: int
    tokens_per_s: float
    cpu_tokens_per_s: float
    """Tokens per second of this process's CPU time: on a busy machine with one
    llama.cpp thread, a far steadier estimate of the unloaded speed than wall time."""
    tokens: list[int]
    target_calls: int
    drafted: int
    accepted: int
    predicted_time: float | None = None
    """Sum of c(k) over rounds (units of one-token calls), when known."""
    split: dict[str, float] = field(default_factory=dict)


def workload_prompts(target: Backend, workload: str, count: int, n_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, earlier requests). Story openings; random token ids; or re-asking: a
    story prompt that was asked once before in this process (untimed), so the suffix
    drafters' global cache holds that earlier request and its answer, as it would in a
    chat or agent loop that re-asks or regenerates. (The fixture model does not copy
    text from its own context, so in-context repetition would not be repetitive work.)"""
    bos = [target.special.bos] if target.special.bos is not None else []
    if workload == "random":
        rng = np.random.default_rng(7)
        return [bos + [int(t) for t in rng.integers(3, target.n_vocab, 24)] for _ in range(count)], []
    offset = count if workload == "repetitive" else 0  # different openings from "story"
    base = [target.tokenize(STORY_PROMPTS[(i + offset) % len(STORY_PROMPTS)], add_bos=True) for i in range(count)]
    if workload == "story":
        return base, []
    sampler = Sampler(SamplingParams.greedy_params())
    earlier = []
    for ids in base:
        *_, done = generate(target, ids, sampler, max_tokens=n_tokens, stop_at_eog=False)
        earlier.append(ids + done.tokens)
    return base, earlier


class _Histogram:
    """Policy wrapper recording each round's drafted length (for the c(k) prediction)."""

    def __init__(self, policy) -> None:
        self.policy = policy
        self.counts: dict[int, int] = {}

    @property
    def stop_threshold(self):
        return self.policy.stop_threshold

    def next_length(self) -> int:
        return self.policy.next_length()

    @property
    def model_budget(self):
        return getattr(self.policy, "model_budget", None)

    def trim(self, confidence, n: int, source: str = "") -> int:
        return self.policy.trim(confidence, n, source)

    def predraft_pays(self, n: int) -> bool:
        return self.policy.predraft_pays(n)

    def observe(self, drafted, accepted, draft_s, verify_s, round_s, source: str = "", *, timed: bool = True) -> None:
        self.counts[drafted] = self.counts.get(drafted, 0) + 1
        self.policy.observe(drafted, accepted, draft_s, verify_s, round_s, source, timed=timed)


def _rate(n_tokens: int, seconds: float) -> float:
    """Decode rate after the first token, as GenerationStats.tokens_per_s."""
    return (n_tokens - 1) / seconds if n_tokens > 1 and seconds > 0 else 0.0


def run_strategy(target: Backend, prompt: list[int], make: Callable[[list[list[int]]], tuple], n: int,
                 cost: CostCurve, earlier: list[list[int]]) -> dict:
    drafter, policy = make(earlier)
    hist = _Histogram(policy) if policy is not None else None
    strategy = autoregressive if drafter is None else speculative(drafter, hist)
    target.truncate(0)
    cpu_first = None
    for event in generate(target, prompt, Sampler(SamplingParams.greedy_params()), strategy=strategy,
                          max_tokens=n, stop_at_eog=False):
        if cpu_first is None:
            cpu_first = time.process_time()
        done = event
    cpu_s = time.process_time() - (cpu_first or 0.0)
    assert isinstance(done, DoneEvent)
    s = done.stats
    predicted = None if hist is None else sum(c * cost(k) for k, c in hist.counts.items())
    return {"tokens_per_s": s.tokens_per_s, "cpu_tokens_per_s": _rate(len(done.tokens), cpu_s),
            "tokens": done.tokens, "target_calls": s.target_calls,
            "drafted": s.drafted_tokens, "accepted": s.accepted_tokens, "predicted_time": predicted}


def run_llama_lookup(llm, prompt: list[int], n: int, k: int = 10) -> dict:
    """llama-cpp-python's own prompt-lookup speculative decoding (greedy)."""
    llm.reset()
    calls = [0]
    original = llm.eval

    def counting_eval(tokens):
        calls[0] += 1
        return original(tokens)

    llm.eval = counting_eval
    out: list[int] = []
    first = end = time.perf_counter()
    cpu_first = cpu_end = time.process_time()
    try:
        for tok in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
            out.append(int(tok))
            end, cpu_end = time.perf_counter(), time.process_time()
            if len(out) == 1:
                first, cpu_first = end, cpu_end
            if len(out) >= n:
                break
    finally:
        llm.eval = original
    tps = (len(out) - 1) / (end - first) if len(out) > 1 and end > first else 0.0
    return {"tokens_per_s": tps, "cpu_tokens_per_s": _rate(len(out), cpu_end - cpu_first), "tokens": out, "target_calls": calls[0], "drafted": 0, "accepted": 0,
            "predicted_time": None}


def summarize(runs: list[Run], cost: CostCurve) -> dict:
    """Per workload and configuration: medians and the comparisons with plain."""
    plain = {(r.workload, r.prompt, r.rep): r for r in runs if r.config == "plain"}
    out: dict[str, dict[str, dict]] = {}
    for r in runs:
        base = plain[(r.workload, r.prompt, r.rep)]
        row = out.setdefault(r.workload, {}).setdefault(r.config, {"speedups": [], "tps": [], "identical": True,
                                                                     "cpu_speedups": [], "cpu_tps": [],
                                                                     "drafted": 0, "accepted": 0, "calls": 0,
                                                                     "tokens": 0, "pred": []})
        row["speedups"].append(r.tokens_per_s / base.tokens_per_s if base.tokens_per_s else 0.0)
        row["tps"].append(r.tokens_per_s)
        row["cpu_tps"].append(r.cpu_tokens_per_s)
        row["cpu_speedups"].append(r.cpu_tokens_per_s / base.cpu_tokens_per_s if base.cpu_tokens_per_s else 0.0)
        row["identical"] &= r.tokens == base.tokens
        row["drafted"] += r.drafted
        row["accepted"] += r.accepted
        row["calls"] += r.target_calls
        row["tokens"] += len(r.tokens)
        if r.predicted_time:
            row["pred"].append(len(r.tokens) / r.predicted_time)
    table: dict[str, dict[str, dict]] = {}
    for wl, configs in out.items():
        table[wl] = {}
        for name, row in configs.items():
            table[wl][name] = {
                "tokens_per_s": statistics.median(row["tps"]),
                "speedup": statistics.median(row["speedups"]),
                "cpu_tokens_per_s": statistics.median(row["cpu_tps"]),
                "cpu_speedup": statistics.median(row["cpu_speedups"]),
                "acceptance": row["accepted"] / row["drafted"] if row["drafted"] else None,
                "tokens_per_call": row["tokens"] / row["calls"] if row["calls"] else None,
                "identical": row["identical"],
                "predicted_speedup": statistics.median(row["pred"]) if row["pred"] else None,
            }
        fixed = {k: v for k, v in table[wl].items() if "@" in k}
        targets = {}
        for metric in ("speedup", "cpu_speedup"):
            best = max(fixed, key=lambda k: fixed[k][metric]) if fixed else "plain"
            best_speed = max(1.0, fixed[best][metric]) if fixed else 1.0
            targets[metric] = {
                "best_fixed": best if fixed and fixed[best][metric] > 1.0 else "plain",
                "best_fixed_speedup": best_speed,
                "auto_vs_best": {k: v[metric] / best_speed for k, v in table[wl].items() if k.startswith("auto")},
            }
        table[wl]["_targets"] = targets
    return {"cost_curve": list(cost.c), "t1_s": cost.t1_s, "workloads": table}


def strategy_makers(target: Backend, cfg: BenchConfig, cost: CostCurve, opened: list[Backend]) -> dict[str, Callable]:
    """Configuration name -> factory of a fresh (drafter, policy) pair (None, None = plain)."""
    from tandem.runtime.drafters.chain import ChainDrafter
    from tandem.runtime.drafters.lookup import PromptLookupDrafter
    from tandem.runtime.drafters.suffix import GlobalSuffixCache, SuffixDrafter

    def model_drafter(path: Path) -> Callable[[], Drafter]:
        backend = LlamaCppBackend(path, LlamaConfig(n_ctx=target.n_ctx, n_threads=cfg.threads))
        opened.append(backend)
        drafter = open_model_drafter(target, backend, "auto")
        return lambda e: drafter

    # Suffix drafters get no global cache here: repeated runs of the same prompt would
    # otherwise draft from their own earlier outputs and flatter the numbers.
    def suffix(earlier: list[list[int]]) -> SuffixDrafter:
        cache = GlobalSuffixCache()
        for seq in earlier:
            cache.add(seq)
        return SuffixDrafter(global_cache=cache)

    sources: dict[str, Callable[[list[list[int]]], Drafter]] = {
        "ngram": lambda e: ChainDrafter([suffix(e), PromptLookupDrafter()]),
        "suffix": suffix,
        "lookup": lambda e: PromptLookupDrafter(),
    }
    if cfg.draft is not None and "model" in cfg.drafters:
        sources["model"] = model_drafter(cfg.draft)
    if cfg.oracle is not None and "oracle" in cfg.drafters:
        sources["oracle"] = model_drafter(cfg.oracle)
    makers: dict[str, Callable] = {"plain": lambda e: (None, None)}
    for name, source in sources.items():
        if name not in cfg.drafters:
            continue
        for k in cfg.lengths:
            makers[f"{name}@{k}"] = lambda e, s=source, k=k: (s(e), FixedLength(k))
    def adaptive(cheap: bool) -> AdaptivePolicy:
        return AdaptivePolicy(cost, AdaptiveConfig(max_len=max(cfg.lengths)), cheap_drafter=cheap,
                              cheap_sources=frozenset() if cheap else MODEL_FREE_SOURCES)

    makers["auto-ngram"] = lambda e: (sources["ngram"](e), adaptive(True))
    for name in ("model", "oracle"):
        if name in sources:
            makers[f"auto-{name}"] = lambda e, s=sources[name]: (ChainDrafter([sources["ngram"](e), s(e)]),
                                                                  adaptive(False))
    return makers


def run_bench(cfg: BenchConfig) -> dict:
    target = LlamaCppBackend(cfg.target, LlamaConfig(n_ctx=cfg.ctx, n_threads=cfg.threads))
    opened: list[Backend] = [target]
    llm = None
    try:
        cfg.log(f"measuring c(k) of {target.name} (cached per model and machine)...")
        cost = load_cost_curve(target, max(cfg.lengths))
        cfg.log("c(k): " + " ".join(f"{c:.2f}" for c in cost.c) + f"  (one token: {cost.t1_s * 1e3:.1f} ms)")
        makers = strategy_makers(target, cfg, cost, opened)
        if cfg.llama_baseline:
            import llama_cpp
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            llm = llama_cpp.Llama(str(cfg.target), n_ctx=target.n_ctx, n_threads=cfg.threads or None,
                                  n_threads_batch=cfg.threads or None,
                                  draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10), verbose=False)
        work = {wl: workload_prompts(target, wl, cfg.prompts, cfg.n_tokens) for wl in cfg.workloads}
        names = list(makers) + (["llama-lookup"] if llm is not None else [])
        runs: list[Run] = []
        for rep in range(cfg.reps):
            for wl in cfg.workloads:
                prompts, earlier = work[wl]
                for pi, prompt in enumerate(prompts):
                    shift = (rep + pi) % len(names)
                    for name in names[shift:] + names[:shift]:
                        res = (run_llama_lookup(llm, prompt, cfg.n_tokens) if name == "llama-lookup"
                               else run_strategy(target, prompt, makers[name], cfg.n_tokens, cost, earlier))
                        runs.append(Run(name, wl, pi, rep, **res))
                        cfg.log(f"rep {rep} {wl:10s} p{pi} {name:12s} {res['tokens_per_s']:7.2f} tok/s "
                                f"cpu {res['cpu_tokens_per_s']:7.2f} tok/s "
                                f"calls {res['target_calls']:4d} acc {res['accepted']}/{res['drafted']}")
        report = summarize(runs, cost)
        report["config"] = {"target": str(cfg.target), "draft": str(cfg.draft) if cfg.draft else None,
                            "oracle": str(cfg.oracle) if cfg.oracle else None, "n_tokens": cfg.n_tokens,
                            "prompts": cfg.prompts, "reps": cfg.reps, "threads": cfg.threads}
        return report
    finally:
        if llm is not None:
            llm.close()
        for b in opened:
            b.close()


def format_report(report: dict) -> str:
    lines = ["c(k): " + " ".join(f"{c:.2f}" for c in report["cost_curve"])]
    for wl, table in report["workloads"].items():
        lines.append(f"\n[{wl}]  {'config':12s} {'tok/s':>7s} {'speedup':>8s} {'cpu tok/s':>9s} {'cpu spd':>8s} "
                     f"{'pred':>6s} {'accept':>7s} {'tok/call':>8s} identical")
        for name, row in table.items():
            if name.startswith("_"):
                continue
            acc = f"{row['acceptance']:.0%}" if row["acceptance"] is not None else "-"
            pred = f"{row['predicted_speedup']:.2f}" if row["predicted_speedup"] else "-"
            lines.append(f"  {name:20s} {row['tokens_per_s']:7.2f} {row['speedup']:7.2f}x "
                         f"{row['cpu_tokens_per_s']:9.2f} {row['cpu_speedup']:7.2f}x {pred:>6s} {acc:>7s} "
                         f"{row['tokens_per_call'] or 0:8.2f} {'yes' if row['identical'] else 'NO'}")
        for metric, t in table["_targets"].items():
            autos = ", ".join(f"{k} {v:.2f}" for k, v in t["auto_vs_best"].items())
            lines.append(f"  [{metric}] best fixed: {t['best_fixed']} ({t['best_fixed_speedup']:.2f}x); "
                         f"auto / best: {autos}")
    return "\n".join(lines)


def plot_report(report: dict, path: str | Path, configs: Sequence[str] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wls = list(report["workloads"])
    fig, axes = plt.subplots(1, len(wls) + 1, figsize=(5 * (len(wls) + 1), 4.5))
    for ax, wl in zip(axes, wls, strict=False):
        rows = {k: v for k, v in report["workloads"][wl].items() if not k.startswith("_")}
        names = list(configs or rows)
        names = [n for n in names if n in rows]
        y = np.arange(len(names))
        ax.barh(y - 0.2, [rows[n]["speedup"] for n in names], height=0.4, color="tab:blue", label="wall clock")
        ax.barh(y + 0.2, [rows[n]["cpu_speedup"] for n in names], height=0.4, color="tab:green", label="CPU time")
        pred = [rows[n]["predicted_speedup"] or 0 for n in names]
        ax.scatter(pred, y, color="tab:orange", marker="|", s=200, label="predicted from c(k)")
        ax.set_yticks(y, names)
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_title(f"{wl}: speedup vs plain")
        ax.tick_params(axis="y", labelsize=7)
        ax.legend(fontsize=7)
    ax = axes[-1]
    ax.plot(range(len(report["cost_curve"])), report["cost_curve"], marker="o")
    ax.set_xlabel("k drafted tokens")
    ax.set_ylabel("c(k) = time(k+1) / time(1)")
    ax.set_title("verify-cost curve")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
