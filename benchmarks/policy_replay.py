"""Replay the adaptive policy on a fixed verify-cost curve: what a policy change gains,
without timing noise.

Each prompt's greedy reply is decoded with model-free drafting (suffix tree and prompt
lookup, a fresh strategy per reply, as ``tandem bench`` runs them), with every call
priced by one fixed c(k) (``OnlineCost(learn=False)``), so the policy's choices are the
same on every run and on any load. A reply's *modeled speedup* is its tokens over what
its target calls cost on that curve, in one-token calls (plain decoding: 1.00; a failed
2-token probe at c(2) = 2.3 costs 1.3 calls). Each variant of the first-probe promise
(``AdaptiveConfig.probe_promise``) runs on the bench's prompts and on held-out ones
(``benchmarks/heldout_prompts.py``): a constant tuned to the bench's 12 prompts shows
its loss there. Greedy output is checked identical across variants.

``--predicted``: the edit prompts only, each sent with its code as the prediction
(OpenAI's Predicted Outputs, as `tandem bench --predicted` sends it): the prediction
drafts first, then the model-free sources, under the same policy.

    .venv/bin/python -m benchmarks.policy_replay MODEL.gguf [--promise 1.10,1.15] [--repack]
        [--curve 1,1.94,2.29,2.94,3.13,3.82,4.67,5.52,6.37] [-n 64] [--threads 2] [--predicted]

``--curve``: c(0..8); default the curve this machine learnt for the target (``tandem
bench`` or any adaptive run saves it). Timed figures remain ``tandem bench``'s.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

from benchmarks.heldout_prompts import HELD_OUT
from tandem.app.bench.workloads import REAL_WORKLOADS
from tandem.kernels.sampling import Sampler
from tandem.kernels.sampling_params import SamplingParams
from tandem.runtime.backends.llama import LlamaCppBackend
from tandem.runtime.backends.llama_config import LlamaConfig
from tandem.runtime.chat import chat_prompt
from tandem.runtime.generate import generate
from tandem.runtime.speculative.cost import CostCurve, OnlineCost
from tandem.runtime.speculative.cost_cache import cached_cost_curve
from tandem.runtime.speculative.drafters.prediction import Prediction
from tandem.runtime.speculative.factory import (
    MEASURED_SOURCES,
    SpeculativeStrategy,
    model_free_drafter,
)
from tandem.runtime.speculative.policy.adaptive import AdaptivePolicy
from tandem.runtime.speculative.policy.adaptive_config import AdaptiveConfig


class RecordingPolicy(AdaptivePolicy):
    """The adaptive policy, keeping each round's (drafted, accepted, tokens evaluated)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.rounds: list[tuple[int, int, int]] = []

    def observe(self, drafted: int, accepted: int, draft_s: float, verify_s: float, round_s: float,
                source: str = "", *, timed: bool = True, evaluated: int | None = None) -> None:
        self.rounds.append((drafted, accepted, drafted + 1 if evaluated is None else evaluated))
        super().observe(drafted, accepted, draft_s, verify_s, round_s, source, timed=timed, evaluated=evaluated)


def replay(target: LlamaCppBackend, prompt: list[int], curve: CostCurve, promise: float,
           n: int, prediction: Prediction | None = None) -> tuple[list[int], float, list[tuple[int, int, int]]]:
    """One reply (drafted from ``prediction`` first, when given): its tokens, its modeled
    speedup and its rounds."""
    cost = OnlineCost(curve, chunk=target.exact_batch, measure_t1=False, learn=False)
    policy = RecordingPolicy(cost, AdaptiveConfig(probe_promise=promise), cheap_drafter=True,
                             measured_sources=MEASURED_SOURCES)
    strategy = SpeculativeStrategy(model_free_drafter(target, memory="request"), policy)
    decoding = strategy if prediction is None else strategy.predicting(prediction, len(prompt))
    try:
        *_, done = generate(target, prompt, Sampler(SamplingParams.greedy_params()), strategy=decoding,
                            max_tokens=n, stop_at_eog=False)  # the last event: the reply and its stats
    finally:
        strategy.close()
    spent = sum(cost(evaluated - 1) for _, _, evaluated in policy.rounds)
    return list(done.tokens), len(done.tokens) / spent, policy.rounds


def prompts(names: tuple[str, ...] = tuple(REAL_WORKLOADS)) -> list[tuple[str, str, str]]:
    """(workload, label, user message): the bench's prompts (b0..) and the held-out ones (h0..)."""
    out = []
    for name in names:
        out += [(name, f"b{i}", text) for i, text in enumerate(REAL_WORKLOADS[name][:3])]
        out += [(name, f"h{i}", text) for i, text in enumerate(HELD_OUT[name])]
    return out


def fenced_code(text: str) -> str | None:
    """The body of the first fenced code block in ``text``: what an editor asking for that
    code back changed would send as the prediction."""
    found = re.search(r"```[^\n]*\n(.*?)```", text, re.S)
    return found.group(1) if found else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--promise", default="1.10", help="comma-separated probe_promise values to compare")
    ap.add_argument("--curve", help="c(0..8), comma-separated (default: this machine's learnt curve)")
    ap.add_argument("--repack", action="store_true", help="repacked weights (verify chunks of 3)")
    ap.add_argument("-n", type=int, default=64, help="tokens per reply")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--predicted", action="store_true", help="edit prompts only, each with its code as the prediction")
    args = ap.parse_args()
    promises = [float(x) for x in args.promise.split(",")]
    target = LlamaCppBackend(args.model, LlamaConfig(n_ctx=1024, n_threads=args.threads, repack=args.repack))
    curve = (CostCurve(tuple(float(x) for x in args.curve.split(",")), 0.0) if args.curve
             else cached_cost_curve(target))
    if curve is None:
        sys.exit("No verify-cost curve is cached for this model here: pass --curve, or run `tandem bench` first.")
    print(f"c(k) = {', '.join(f'{c:.2f}' for c in curve.c)}, verify chunks of {target.exact_batch}, {args.n} tokens")
    speedups: dict[float, dict[str, list[float]]] = {p: {"b": [], "h": []} for p in promises}
    for name, label, text in prompts(("edit",) if args.predicted else tuple(REAL_WORKLOADS)):
        prompt = chat_prompt(target, [{"role": "user", "content": text}])[0]
        code = fenced_code(text) if args.predicted else None
        prediction = Prediction(target.tokenize(code)) if code else None
        outputs, cells = set(), []
        for promise in promises:
            tokens, speedup, rounds = replay(target, prompt, curve, promise, args.n, prediction)
            outputs.add(tuple(tokens))
            speedups[promise][label[0]].append(speedup)
            cells.append(f"{promise:.2f}: {speedup:.3f} [{' '.join(f'{a}/{d}' for d, a, _ in rounds if d)}]")
        if len(outputs) != 1:
            sys.exit(f"{name} {label}: the variants' greedy outputs differ")
        print(f"{name:8s} {label}  " + " | ".join(cells), flush=True)
    print("\npromise  bench prompts: mean (min)   held-out: mean (min)   all: mean")
    for promise, by in speedups.items():
        b, h = by["b"], by["h"]
        print(f"{promise:7.2f}  {statistics.mean(b):.3f} ({min(b):.3f})           "
              f"{statistics.mean(h):.3f} ({min(h):.3f})        {statistics.mean(b + h):.3f}")


if __name__ == "__main__":
    main()
