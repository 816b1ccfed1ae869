"""Configurations run back to back on the same prompts, rotated, and each compared with
``plain`` on the same prompt and repetition: the harness `tandem bench --structured` and
`tandem bench --predicted` share.

Each configuration first generates a few tokens once (first touch of its engine's
weights); then, per repetition and prompt, the prompt is read into every engine's cache
untimed (the first timed run of a prompt would otherwise pay its prefill, and the
rotation puts each configuration first an unequal number of times), and every
configuration runs, starting one further along the list each time.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar


class BenchRun(Protocol):
    config: str
    prompt: int
    rep: int
    tokens: list[int]
    tokens_per_s: float


R = TypeVar("R", bound=BenchRun)


def rotated_runs(configs: Sequence[str], n_prompts: int, reps: int, max_tokens: int,
                 one: Callable[[str, int, int, int], R], readers: Sequence[str],
                 log: Callable[[R], None]) -> list[R]:
    """The timed runs: ``one(config, prompt, rep, max_tokens)`` for every configuration on
    every prompt and repetition, rotated; ``readers``: one configuration per engine, run
    for a token to read each prompt into its cache (rep -1: not kept)."""
    for name in configs:  # warm-up: first touch of each engine's weights
        one(name, 0, -1, 8)
    runs: list[R] = []
    for rep in range(reps):
        for pi in range(n_prompts):
            for name in readers:
                one(name, pi, -1, 1)
            shift = (rep * n_prompts + pi) % len(configs)
            for name in [*configs[shift:], *configs[:shift]]:
                run = one(name, pi, rep, max_tokens)
                runs.append(run)
                log(run)
    return runs


def plain_runs(runs: Sequence[BenchRun]) -> dict[tuple[int, int], BenchRun]:
    """The ``plain`` run of each (prompt, repetition)."""
    return {(r.prompt, r.rep): r for r in runs if r.config == "plain"}


def vs_plain(mine: Sequence[BenchRun], plain: dict[tuple[int, int], BenchRun]) -> dict[str, float] | None:
    """Each run's rate over its prompt and repetition's ``plain`` rate: median, min, max."""
    ratios = [r.tokens_per_s / plain[(r.prompt, r.rep)].tokens_per_s for r in mine
              if (r.prompt, r.rep) in plain and plain[(r.prompt, r.rep)].tokens_per_s > 0]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)} if ratios else None


def same_as_plain(mine: Sequence[BenchRun], plain: dict[tuple[int, int], BenchRun]) -> bool:
    """Whether every run gave its prompt and repetition's ``plain`` tokens."""
    return all(r.tokens == plain[(r.prompt, r.rep)].tokens for r in mine if (r.prompt, r.rep) in plain)
