"""Acceptance traces recorded with real models, priced on another device's cost curve.

Acceptance does not depend on the device: the same prompt ids, the same greedy target
output and the same drafter give the same drafts and the same accepted prefixes on a CPU
and on a GPU. What the device changes is the price of each round: a target call over
``e`` tokens costs c(e) one-token calls there, and a drafter token costs the drafter's
one-token call over the target's. So ``tandem bench --record-acceptance FILE`` decodes
each bench prompt with every configuration on the real models here and keeps each
round's (drafted, accepted, evaluated, model-drafted), and ``tandem bench --gpu
--acceptance FILE`` prices those rounds with the c(e) and drafter cost measured on the
GPU (random-weight models of the same shapes run there, whose acceptance means nothing):

    modeled speedup = decoded tokens / sum over rounds of (c(e) + drafter cost x model-drafted tokens)

in one-token target calls. Plain decoding is 1.00 by construction (every round: one
token for c(1) = 1). The adaptive configurations keep the draft lengths their policy
chose on the recording machine (it prices rounds with that machine's curve), so their
modeled figure is what those choices would earn on the GPU, not what the policy would
choose there; fixed-length configurations are device-independent.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tandem.app.bench.runner import (
    SAME_ENGINE_MODES,
    BenchConfig,
    engines_in,
    open_configs,
    select,
    select_families,
)
from tandem.app.bench.workloads import workload
from tandem.errors import TandemError
from tandem.kernels.sampling import Sampler
from tandem.kernels.sampling_params import SamplingParams
from tandem.runtime.engine.builder import Engine
from tandem.runtime.engine.spec import EngineSpec
from tandem.runtime.generate import DoneEvent, generate
from tandem.runtime.machine import cpu_cores
from tandem.runtime.speculative.factory import MODEL_FREE_SOURCES

FORMAT = "tandem-acceptance/1"

Round = tuple[int, int, int, int]
"""(drafted, accepted, evaluated, 1 if a drafter model drafted it else 0)."""


def is_model_source(source: str) -> bool:
    return not all(part in MODEL_FREE_SOURCES for part in source.split("+") if part)


def same_engine(name: str) -> dict[str, str]:
    """The strategy change that makes configuration ``name`` of its engine (``plain`` and
    ``ngram`` run on the first drafter's engine: :data:`SAME_ENGINE_MODES`)."""
    return {"mode": SAME_ENGINE_MODES[name]} if name in SAME_ENGINE_MODES else {}


def record_reply(engine: Engine, prompt: list[int], n: int, **changes) -> tuple[list[int], list[Round]]:
    """One greedy reply of ``n`` tokens with a fresh strategy (its options with
    ``changes``), and its rounds.

    The rounds are what the strategy's policy observes (every round of the loop tells it
    what was drafted, accepted and evaluated, timing rounds padded to a call size the
    policy wants timed included); plain decoding has no policy and each of its rounds is
    one evaluated token. The first round of speculative decoding evaluates the last prompt
    token with the first drafts, so plain decoding's first round is the last prompt
    token's own call."""
    strategy = engine.fresh_strategy(suffix_memory="request", **changes)
    rounds: list[Round] = []
    policy = strategy.policy
    try:
        if policy is not None:
            observe = policy.observe

            def recording(drafted: int, accepted: int, *args, **kw) -> None:
                source = kw.get("source", args[3] if len(args) > 3 else "")
                evaluated = kw.get("evaluated")
                rounds.append((drafted, accepted, drafted + 1 if evaluated is None else evaluated,
                               int(drafted > 0 and is_model_source(source))))
                observe(drafted, accepted, *args, **kw)

            policy.observe = recording  # type: ignore[method-assign]  # this strategy's policy only
        done = None
        for event in generate(engine.target, prompt, Sampler(SamplingParams.greedy_params()), strategy=strategy,
                              max_tokens=n, stop_at_eog=False):
            done = event
    finally:
        strategy.close()
    assert isinstance(done, DoneEvent)
    tokens = list(done.tokens)
    if policy is None:
        rounds = [(0, 0, 1, 0)] * len(tokens)  # the first: the last prompt token's call
    return tokens, rounds


def record_acceptance(cfg: BenchConfig) -> dict:
    """Every configuration of ``cfg`` (no peers) on every prompt of its workloads: the
    rounds and whether the output equals plain decoding's.

    Besides the bench's configurations, ``ngram@k`` for each of ``cfg.lengths``:
    model-free drafting at a fixed length k (on the plain engine's target), whose rounds
    do not depend on the recording machine's costs as the adaptive ``ngram``'s do."""
    threads = cfg.threads or cpu_cores()
    spec = EngineSpec(cfg.target, draft_mode="off", draft_max=cfg.draft_max, budget=cfg.budget, threads=threads,
                      n_ctx=cfg.ctx, kv_type=cfg.kv_type, engine="llama.cpp", repack=cfg.repack)
    engines, drafters = open_configs(spec, cfg, cfg.log)
    try:
        fixed_free = {f"ngram@{k}": {"mode": "ngram", "draft_length": k} for k in cfg.lengths}
        names = select(select_families(list(engines) + list(fixed_free), cfg.families), cfg.configs)
        target = engines["plain"].target
        out: dict = {"format": FORMAT, "target": cfg.target.name,
                     "drafters": {d.label: d.path.name for d in drafters}, "n_tokens": cfg.n_tokens,
                     "draft_max": cfg.draft_max, "lengths": list(cfg.lengths), "workloads": {}}
        for wl_name in cfg.workloads:
            wl = workload(target, wl_name, cfg.prompts)
            table: dict[str, dict] = {}
            plain_tokens: list[list[int]] = []
            for name in names:
                replies, mismatches = [], 0
                for pi, prompt in enumerate(wl.prompts):
                    tokens, rounds = (record_reply(engines["plain"], prompt, cfg.n_tokens, **fixed_free[name])
                                      if name in fixed_free else record_reply(engines[name], prompt, cfg.n_tokens,
                                                                              **same_engine(name)))
                    if name == "plain":
                        plain_tokens.append(tokens)
                    mismatches += tokens != plain_tokens[pi]
                    replies.append([list(r) for r in rounds])
                    drafted = sum(r[0] for r in rounds)
                    cfg.log(f"record {wl_name:8s} p{pi} {name:10s} {len(rounds):3d} rounds, "
                            f"accepted {sum(r[1] for r in rounds)}/{drafted}")
                table[name] = {"rounds": replies, "mismatches": mismatches}
            out["workloads"][wl_name] = table
        return out
    finally:
        for engine in reversed(engines_in(engines)):
            engine.close()


def call_cost(curve: Sequence[float], size: int) -> float:
    """c(size): a target call over ``size`` tokens in one-token calls. ``curve[i]`` is
    c(i + 1); past its end, the last two points' slope continues."""
    if size <= len(curve):
        return float(curve[size - 1])
    slope = curve[-1] - curve[-2] if len(curve) > 1 else 1.0
    return float(curve[-1] + slope * (size - len(curve)))


def modeled_speedup(replies: Sequence[Sequence[Sequence[int]]], curve: Sequence[float], drafter_cost: float) -> float:
    """Decoded tokens over what their rounds cost, in one-token target calls (module
    docstring), over all ``replies`` together."""
    tokens = cost = 0.0
    for rounds in replies:
        for drafted, accepted, evaluated, model in rounds:
            tokens += accepted + 1
            cost += call_cost(curve, evaluated) + (drafter_cost * drafted if model else 0.0)
    return tokens / cost if cost else 0.0


def price(record: dict, curve: Sequence[float], drafter_cost: float | None) -> dict[str, dict[str, dict]]:
    """workload -> configuration -> modeled speedup and acceptance of ``record`` on
    ``curve``; configurations with a drafter model are left out without ``drafter_cost``."""
    out: dict[str, dict[str, dict]] = {}
    for wl, table in record["workloads"].items():
        rows = {}
        for name, entry in table.items():
            replies = entry["rounds"]
            uses_model = any(r[3] for rounds in replies for r in rounds)
            if uses_model and drafter_cost is None:
                continue
            drafted = sum(r[0] for rounds in replies for r in rounds)
            rows[name] = {"modeled_speedup": round(modeled_speedup(replies, curve, drafter_cost or 0.0), 3),
                          "acceptance": round(sum(r[1] for rounds in replies for r in rounds) / drafted, 3)
                          if drafted else None,
                          "tokens_per_call": round(sum(r[1] + 1 for rounds in replies for r in rounds)
                                                   / max(1, sum(len(rounds) for rounds in replies)), 3),
                          "mismatches_when_recorded": entry["mismatches"]}
        out[wl] = rows
    return out


def load(path: Path) -> dict:
    """A recorded acceptance file, checked; one readable error otherwise."""
    try:
        record = json.loads(path.read_text())
    except OSError as exc:
        raise TandemError(f"Cannot read the acceptance file {path}: {exc.strerror or exc}.") from None
    except ValueError:
        raise TandemError(f"{path} is not JSON: record one with `tandem bench --record-acceptance FILE`.") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT or not isinstance(record.get("workloads"), dict):
        raise TandemError(f"{path} is not an acceptance record ({FORMAT}): record one with "
                          "`tandem bench --record-acceptance FILE`.")
    return record


def save(record: dict, path: Path) -> None:
    """Compact JSON (one round a list of four small integers)."""
    path.write_text(json.dumps(record, separators=(",", ":")) + "\n")
