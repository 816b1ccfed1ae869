"""What a speculative round reports, and the observer that counts it.

The loop (:mod:`tandem.runtime.speculative.loop`) hands every finished round, as a
:class:`Round`, to one observer; :class:`RoundStats` turns it into the generation's
:class:`~tandem.runtime.generate.DecodeStats` (counters, per-source tallies, seconds
spent drafting and verifying) and into what the length policy learns from
(:meth:`~tandem.runtime.speculative.policy.base.LengthPolicy.observe`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from tandem.runtime.generate import DecodeStats
from tandem.runtime.speculative.drafters.base import Draft, Drafter
from tandem.runtime.speculative.policy.base import LengthPolicy


@dataclass
class Round:
    """One round of speculation, as it happened."""

    proposed: int
    """Tokens the drafters proposed (a timing round's padding not counted)."""
    verified: Draft
    """The draft the target verified: the proposal, padded in a timing round."""
    timing: bool
    """The policy asked this round to time a verify-call size (:mod:`.timing`)."""
    accepted: int
    """Drafted tokens the target accepted."""
    tokens: list[int]
    """Committed tokens: the accepted drafts and the target's own next token."""
    logits: np.ndarray
    """The target's logits rows the verify call(s) returned, one per evaluated token."""
    times: tuple[float, float, float, float]
    """``perf_counter`` at the round's start, once drafted, once verified, once committed."""


class RoundObserver(Protocol):
    def __call__(self, r: Round) -> None:
        """Called once per round, after its commit and before its tokens are yielded."""
        ...


class Drafting(Protocol):
    """What :class:`RoundStats` reads of the drafting wrapper (pre-draft tallies)."""

    hits: int
    misses: int


STATS_KEYS = ("draft_s", "verify_s", "round_s", "rounds_speculative", "predraft_hits", "predraft_misses")
"""``DecodeStats.extra`` entries every speculative generation reports (0 when unused)."""


class RoundStats:
    """Counts each round into ``stats`` and teaches ``policy`` its acceptance and costs.

    A round's times exclude the drafter's catch-up (``Draft.catch_up_s``: text it
    did not see being brought into its cache), and the policy is told that the times
    of a drafting round before the first one are not representative: the first
    drafting round also pays the catch-up on the whole prompt and first-launch costs.
    """

    def __init__(self, stats: DecodeStats, policy: LengthPolicy, drafter: Drafter, drafting: Drafting) -> None:
        self.stats, self.policy, self.drafter, self.drafting = stats, policy, drafter, drafting
        self.calls0 = drafter.calls
        self.caught_up = False
        for key in STATS_KEYS:
            stats.extra.setdefault(key, 0.0)

    def __call__(self, r: Round) -> None:
        stats, extra = self.stats, self.stats.extra
        start, drafted_at, verified_at, end = r.times
        n, source = len(r.verified.tokens), r.verified.source or self.drafter.name
        stats.target_calls += 1
        stats.rounds += 1
        stats.drafted_tokens += n
        stats.timing_tokens += n - r.proposed if r.timing else 0
        stats.accepted_tokens += r.accepted
        stats.draft_calls = self.drafter.calls - self.calls0
        extra["draft_s"] += drafted_at - start
        extra["verify_s"] += verified_at - drafted_at
        extra["round_s"] += end - start
        extra["predraft_hits"], extra["predraft_misses"] = float(self.drafting.hits), float(self.drafting.misses)
        if n:
            extra["rounds_speculative"] += 1
            extra[f"drafted:{source}"] = extra.get(f"drafted:{source}", 0.0) + n
            extra[f"accepted:{source}"] = extra.get(f"accepted:{source}", 0.0) + r.accepted
        catch_up = r.verified.catch_up_s
        if r.verified.catch_up_tokens:
            self.policy.observe_catch_up(source, r.verified.catch_up_tokens, catch_up)
        self.policy.observe(r.proposed, min(r.accepted, r.proposed), drafted_at - start - catch_up,
                            verified_at - drafted_at, end - start - catch_up, source,
                            timed=self.caught_up or r.proposed == 0 or r.timing, evaluated=len(r.logits))
        self.caught_up = self.caught_up or r.proposed > 0  # the first drafting round also paid the catch-up
