"""`tandem bench --predicted`: code edits with the code sent as the prediction.

An editor that asks for a file back with a change (rename, add type hints, modernise)
knows most of the reply already: the file. OpenAI's Predicted Outputs let it send that
text as ``prediction``; Tandem drafts from it
(:mod:`tandem.runtime.speculative.drafters.prediction`). Each ``edit`` workload prompt
runs, greedy, in these configurations, back to back and rotated:

* ``plain``: plain decoding (the baseline);
* ``auto``: speculation as `tandem serve` runs it (model-free drafting, and the drafter
  model when ``--draft`` names one; adaptive lengths), without the prediction;
* ``auto+prediction``: the same with the prompt's code as the prediction;
* ``prediction@8``: the prediction alone, 8 tokens drafted every round whatever verifying
  them costs: its tokens per target call are what the prediction offers where verifying
  is nearly free (a GPU), and its rate what that costs where it is not;
* ``llama`` / ``llama-lookup``: llama-cpp-python plain and with its prompt lookup, on
  the same file, threads and context (the outside peer; it has no predicted outputs).

Tandem's four must give the same tokens (checked and reported). Each speculative run
starts from a fresh strategy, so no run learns from another; runs alternate as
:mod:`.alternating` sets out.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tandem.app.bench.alternating import plain_runs, rotated_runs, same_as_plain, vs_plain
from tandem.app.bench.peers import LlamaPeer
from tandem.app.bench.workloads import EDIT, EDIT_CODE
from tandem.kernels.sampling import Sampler
from tandem.kernels.sampling_params import SamplingParams
from tandem.runtime.chat import chat_prompt
from tandem.runtime.engine.builder import open_engine
from tandem.runtime.engine.spec import EngineSpec
from tandem.runtime.generate import DoneEvent, Strategy, autoregressive, generate
from tandem.runtime.speculative.drafters.prediction import Prediction, PredictionDrafter
from tandem.runtime.speculative.factory import SpeculativeStrategy
from tandem.runtime.speculative.policy.base import FixedLength

CONFIGS = ("plain", "auto", "auto+prediction", "prediction@8", "llama", "llama-lookup")
FIXED_LENGTH = 8
"""Tokens ``prediction@8`` drafts a round."""
PEERS = ("llama", "llama-lookup")


@dataclass
class PredictedRun:
    config: str
    prompt: int
    rep: int
    tokens: list[int]
    tokens_per_s: float
    """Decode rate: tokens after the first over the seconds after the first."""
    target_calls: int
    accepted: int = 0
    drafted: int = 0


@dataclass
class PredictedConfig:
    target: Path
    draft: Path | None = None
    threads: int = 2
    ctx: int = 2048
    max_tokens: int = 256
    prompts: int = len(EDIT)
    reps: int = 2
    configs: Sequence[str] = CONFIGS
    log: Callable[[str], None] = print


def run_predicted(cfg: PredictedConfig) -> dict:
    """Every configuration on every prompt, alternating (rotated per prompt and
    repetition), and the summary: median rates, ratios to ``plain``, identity."""
    engine = open_engine(EngineSpec(cfg.target, drafter=cfg.draft, draft_mode="auto", threads=cfg.threads,
                                    n_ctx=cfg.ctx, suffix_memory="request"))
    target = engine.target
    peers = {name: LlamaPeer(cfg.target, n_ctx=cfg.ctx, threads=cfg.threads, lookup=name == "llama-lookup")
             for name in PEERS if name in cfg.configs}
    greedy = Sampler(SamplingParams.greedy_params())
    load_start = list(os.getloadavg())
    try:
        work = [(chat_prompt(target, [{"role": "user", "content": text}])[0], code)
                for text, code in list(zip(EDIT, EDIT_CODE, strict=True))[: cfg.prompts]]
        predictions = [Prediction(target.tokenize(code)) for _, code in work]

        def one(name: str, pi: int, rep: int, max_tokens: int) -> PredictedRun:
            ids, _ = work[pi]
            if name in peers:
                r = peers[name].run(ids, max_tokens)
                return PredictedRun(name, pi, rep, r.tokens, r.tokens_per_s, r.target_calls, r.accepted, r.drafted)
            fresh: SpeculativeStrategy | None = None
            strategy: Strategy = autoregressive
            if name == "prediction@8":
                strategy = SpeculativeStrategy(PredictionDrafter(predictions[pi], len(ids)), FixedLength(FIXED_LENGTH))
            elif name != "plain":
                strategy = fresh = engine.fresh_strategy()
                if name == "auto+prediction":
                    strategy = fresh.predicting(predictions[pi], len(ids))
            try:
                done = list(generate(target, ids, greedy, strategy=strategy, max_tokens=max_tokens))[-1]
            finally:
                if fresh is not None:
                    fresh.close()
            assert isinstance(done, DoneEvent)
            s = done.stats
            return PredictedRun(name, pi, rep, done.tokens, s.tokens_per_s, s.target_calls, s.accepted_tokens,
                                s.drafted_tokens)

        runs = rotated_runs(cfg.configs, len(work), cfg.reps, cfg.max_tokens, one, ["plain", *peers], lambda run: cfg.log(
            f"rep {run.rep} p{run.prompt} {run.config:16s} {run.tokens_per_s:7.2f} tok/s  {len(run.tokens):4d} tokens "
            f"calls {run.target_calls:4d} acc {run.accepted}/{run.drafted}"))
    finally:
        for peer in peers.values():
            peer.close()
        engine.close()
    return summarize(runs, cfg, load_start, [p.size for p in predictions])


def summarize(runs: list[PredictedRun], cfg: PredictedConfig, load_start: list[float],
              prediction_tokens: list[int]) -> dict:
    plain = plain_runs(runs)
    rows = {}
    for name in cfg.configs:
        mine = [r for r in runs if r.config == name]
        if not mine:
            continue
        rows[name] = {
            "tokens_per_s": statistics.median(r.tokens_per_s for r in mine),
            "vs_plain": vs_plain(mine, plain),
            "tokens": statistics.median(len(r.tokens) for r in mine),
            "target_calls": statistics.median(r.target_calls for r in mine),
            "accepted": statistics.median(r.accepted for r in mine),
            "drafted": statistics.median(r.drafted for r in mine),
            "identical_to_plain": same_as_plain(mine, plain) if name not in PEERS else None,
        }
    return {"target": str(cfg.target), "draft": str(cfg.draft) if cfg.draft else None, "threads": cfg.threads,
            "prompts": len({r.prompt for r in runs}), "reps": cfg.reps, "max_tokens": cfg.max_tokens,
            "prediction_tokens": prediction_tokens, "load_start": load_start, "load_end": list(os.getloadavg()),
            "configs": rows, "runs": [r.__dict__ for r in runs]}


def markdown_table(report: dict) -> str:
    lines = ["| configuration | decode tok/s (median) | vs plain (median, min-max) | tokens | target calls | "
             "accepted drafts | same tokens as plain |", "|---|---|---|---|---|---|---|"]
    for name, row in report["configs"].items():
        ratio = row["vs_plain"]
        vs = f"{ratio['median']:.2f}x ({ratio['min']:.2f}-{ratio['max']:.2f})" if ratio else "-"
        same = {True: "yes", False: "NO", None: "n/a (repacked weights)"}[row["identical_to_plain"]]
        lines.append(f"| {name} | {row['tokens_per_s']:.2f} | {vs} | {row['tokens']:.0f} | "
                     f"{row['target_calls']:.0f} | {row['accepted']:.0f} | {same} |")
    return "\n".join(lines)
