"""Benchmarks for the memory planner and the device split (BENCHMARKS.md section
"Memory planner and device split").

``python -m benchmarks.memory specmemo``: speculative throughput under the
unconstrained plan vs a budget cut until the planner shrinks the drafter.
``python -m benchmarks.memory split``: sequential vs CPU-thread split with
pre-drafting, same total threads. Both alternate the variants ``--reps`` times in one
process and report medians (the machine is shared and noisy).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

from tandem.kernels.sampling import Sampler
from tandem.kernels.sampling_params import SamplingParams
from tandem.runtime.backends.llama import LlamaCppBackend
from tandem.runtime.backends.llama_config import LlamaConfig
from tandem.runtime.generate import DoneEvent, autoregressive, generate
from tandem.runtime.planning.devices import SAFETY
from tandem.runtime.planning.memprobe import ProbeModel, ProbeSpec, measure
from tandem.runtime.planning.placement import Option
from tandem.runtime.planning.plan import PlanRequest
from tandem.runtime.planning.planner import make_plan
from tandem.runtime.speculative.drafters.model import ModelDrafter
from tandem.runtime.speculative.overlap import WindowedDrafter, split_speculative

STORIES = Path(__file__).resolve().parents[2] / "shared/fixtures/models/stories260K/stories260K.gguf"
PROMPT = "Once upon a time, there was a little girl named Lily. She loved to play outside"


def _tps(target, prompt, strategy, n: int, stats: dict | None = None) -> tuple[float, list[int]]:
    """Tokens/s of one greedy generation and its tokens; ``stats`` (if given) gets the
    run's target calls and draft acceptance (deterministic, unlike the timing)."""
    start = time.perf_counter()
    for ev in generate(target, prompt, Sampler(SamplingParams(temperature=0.0)), strategy=strategy,
                       max_tokens=n, stop_at_eog=False):
        if isinstance(ev, DoneEvent):
            if stats is not None:
                stats.update(target_calls=ev.stats.target_calls, drafted=ev.stats.drafted_tokens,
                             accepted=ev.stats.accepted_tokens)
            return len(ev.tokens) / (time.perf_counter() - start), ev.tokens
    raise RuntimeError("no DoneEvent")


def _twin(params: str) -> Path:
    from tandem.models.twin import ensure_twin

    return ensure_twin(STORIES, params, "q8_0", Path(__file__).resolve().parents[1] / ".bench" / "twins")


def _probe_model(plan, prompt_tokens: int, output_rows: int = 1) -> ProbeModel:
    return ProbeModel(plan.path, plan.n_ctx, plan.n_batch, plan.flash_attn, plan.type_k, plan.type_v, 1,
                      prompt_tokens=prompt_tokens, output_rows=output_rows)


def _measured_extra(alone, plans: dict, k: int) -> dict[str, int]:
    """Resident bytes each plan's drafter adds to the target alone, measured in fresh
    processes (:mod:`tandem.runtime.planning.memprobe`): the target prefills 64 tokens and
    verifies k+1 rows in every run (its share cancels), the drafter fills its context
    (its window, or the full context) so its compute buffer is touched at its worst."""
    target = _probe_model(alone.target, 64, k + 1)
    base = measure(ProbeSpec([target]))["peak_bytes"]
    out = {}
    for name, plan in plans.items():
        d = plan.draft
        if d is None:
            out[name] = 0
            continue
        both = measure(ProbeSpec([target, _probe_model(d, d.n_ctx - k - 2)]))["peak_bytes"]
        out[name] = both - base
    return out


def specmemo(args: argparse.Namespace) -> dict:
    """Unconstrained plan vs the plan under a budget that leaves speculation ``--share``
    of its unconstrained extra memory: memory predicted and measured, tokens/s (median
    of ``--reps`` alternating runs), and whether the output is identical."""
    from tandem.models.quantize import cached_copy
    from tandem.runtime.planning.hardware import resolve_machine

    target_path = _twin(args.params)
    ctx, k = args.ctx, 4

    def plan(budget, draft=STORIES, baseline=None):
        m = resolve_machine(budget=budget, measure_bandwidth=False)
        return make_plan(PlanRequest(target_path, draft, ctx, m, draft_max=k, acceptance=0.95, threads=1,
                                     baseline=baseline))

    full = plan("8GiB")
    alone = plan("8GiB", None, full.baseline)
    spec_full = full.host_total - alone.host_total
    budget = int((alone.host_total + args.share * spec_full) / (1 - SAFETY))
    cut = plan(budget, STORIES, full.baseline)
    if cut.draft is not None and cut.draft.quant:
        cut.draft = replace(cut.draft, path=str(cached_copy(cut.draft.source, cut.draft.quant)))
    spec_cut = cut.host_total - alone.host_total if cut.draft else 0
    measured = _measured_extra(alone, {"unconstrained": full, "budget-cut": cut}, k)
    target = LlamaCppBackend(target_path, full.target.llama_config())
    prompt = target.tokenize(PROMPT, add_bos=True)
    variants = {}
    for name, p in (("unconstrained", full), ("budget-cut", cut)):
        d = LlamaCppBackend(p.draft.path, p.draft.llama_config()) if p.draft else None
        drafter = ModelDrafter(d, owns_backend=True) if d else None
        if drafter is not None and p.draft.window:
            drafter = WindowedDrafter(drafter, p.draft.window)
        variants[name] = drafter
    runs: dict[str, list[float]] = {n: [] for n in variants}
    outputs, calls = {}, {n: {} for n in variants}
    for _ in range(args.reps):
        for name, drafter in variants.items():
            strategy = split_speculative(drafter, k, predraft=False) if drafter else autoregressive
            tps, toks = _tps(target, prompt, strategy, args.tokens, calls[name])
            runs[name].append(tps)
            outputs[name] = toks
    med = {n: statistics.median(v) for n, v in runs.items()}
    d = cut.draft
    return {
        "target": target_path.name, "ctx": ctx, "tokens": args.tokens, "budget_bytes": budget,
        "predicted": {"unconstrained_spec_bytes": spec_full, "cut_spec_bytes": spec_cut,
                      "share": spec_cut / spec_full if spec_full else None},
        "measured": {"unconstrained_spec_bytes": measured["unconstrained"], "cut_spec_bytes": measured["budget-cut"],
                     "share": measured["budget-cut"] / measured["unconstrained"] if measured["unconstrained"] else None},
        "cut_drafter": None if d is None else {"window": d.window, "n_batch": d.n_batch, "type_k": d.type_k,
                                               "quant": d.quant, "draft_max": cut.draft_max},
        "tokens_per_s": med, "throughput_kept": med["budget-cut"] / med["unconstrained"],
        "identical_output": outputs["unconstrained"] == outputs["budget-cut"], "runs": runs,
        "target_calls_and_acceptance": calls,
    }


def split(args: argparse.Namespace) -> dict:
    target_path = _twin(args.params)
    target = LlamaCppBackend(target_path, LlamaConfig(n_ctx=1024, n_threads=1))
    draft = LlamaCppBackend(STORIES, LlamaConfig(n_ctx=1024, n_threads=1))
    prompt = target.tokenize(PROMPT, add_bos=True)
    placements = [Option("plain 1 thread", "cpu", 1, 0, False), Option("sequential 1+1", "cpu", 1, 1, False),
                  Option("split 1+1 (pre-draft)", "cpu", 1, 1, True)]
    if args.two_threads:  # llama.cpp's spinning barrier collapses on an oversubscribed box
        placements += [Option("plain 2 threads", "cpu", 2, 0, False), Option("sequential 2+2", "cpu", 2, 2, False)]
    runs: dict[str, list[float]] = {p.name: [] for p in placements}
    outputs = {}
    for _ in range(args.reps):
        for p in placements:
            target.set_threads(p.target_threads)
            if p.draft_threads:
                draft.set_threads(p.draft_threads)
                strategy = split_speculative(ModelDrafter(draft, owns_backend=False), 4, predraft=p.predraft)
            else:
                strategy = autoregressive
            tps, toks = _tps(target, prompt, strategy, args.tokens)
            runs[p.name].append(tps)
            outputs[p.name] = toks
    same = all(v == outputs["plain 1 thread"] for v in outputs.values())
    return {"target": target_path.name, "tokens_per_s": {n: statistics.median(v) for n, v in runs.items()},
            "identical_output": same, "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("which", choices=["specmemo", "split"])
    ap.add_argument("--params", default="60M", help="cost twin size of stories260K (target)")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--two-threads", action="store_true", help="also time 2-thread placements")
    ap.add_argument("--share", type=float, default=0.35, help="budget: target + this share of spec memory")
    args = ap.parse_args()
    print(json.dumps(specmemo(args) if args.which == "specmemo" else split(args), indent=1))


if __name__ == "__main__":
    main()
