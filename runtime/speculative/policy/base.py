"""What the speculative loop asks of a length policy, and the simplest answer: a fixed length."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class LengthPolicy(Protocol):
    """Chooses the draft length each round and learns from the outcome."""

    stop_threshold: float | None

    def next_length(self) -> int: ...

    def length_for(self, source: str, k: int) -> int:
        """Tokens to ask of the drafter named ``source`` in a round of length ``k``."""
        ...

    def trim(self, confidence: Sequence[float] | None, n: int, source: str = "") -> int:
        """How many of the ``n`` drafted tokens to verify (may be all, or none)."""
        ...

    def timing_length(self) -> int:
        """Drafts this round's verify call must hold, padded if fewer were drafted: a
        call size the verify-cost curve still needs timed (0: none)."""
        ...

    def predraft_pays(self, n: int) -> bool:
        """Whether drafting the next round during the verification of ``n`` drafts is
        worth it (PEARL's pre-drafting, "where the acceptance outlook allows")."""
        ...

    def catch_up_pays(self, source: str, backlog: int, remaining: int) -> bool:
        """Whether to ask the drafter named ``source`` this round, when it must first
        evaluate ``backlog`` tokens to catch up (:meth:`~tandem.runtime.speculative.drafters.base.Drafter.backlog`)
        and about ``remaining`` tokens of the reply are left to gain on."""
        ...

    def observe_catch_up(self, source: str, tokens: int, seconds: float) -> None:
        """Learn from a catch-up: ``source`` evaluated ``tokens`` backlog tokens in ``seconds``."""
        ...

    def renew(self, source: str) -> None:
        """Forget what was learnt of ``source``: from now on it drafts other text (a
        prediction: each reply's is another client's word on another reply)."""
        ...

    def observe(
        self, drafted: int, accepted: int, draft_s: float, verify_s: float, round_s: float, source: str = "",
        *, timed: bool = True, evaluated: int | None = None,
    ) -> None:
        """Learn from a round (``evaluated``: tokens the verify call(s) evaluated). ``timed=False``: the times are not representative (the
        first round of a generation also pays the drafter's catch-up on the whole prompt
        and, on a GPU, first-launch costs) and only the acceptance counts."""
        ...


@dataclass
class FixedLength:
    """Always ask for ``k`` tokens (the drafter may return fewer)."""

    k: int
    stop_threshold: float | None = None

    def next_length(self) -> int:
        return self.k

    def length_for(self, source: str, k: int) -> int:
        return k

    def trim(self, confidence: Sequence[float] | None, n: int, source: str = "") -> int:
        return n

    def timing_length(self) -> int:
        return 0

    def predraft_pays(self, n: int) -> bool:
        return True

    def catch_up_pays(self, source: str, backlog: int, remaining: int) -> bool:
        return True

    def observe_catch_up(self, source: str, tokens: int, seconds: float) -> None:
        return None

    def renew(self, source: str) -> None:
        return None

    def observe(
        self, drafted: int, accepted: int, draft_s: float, verify_s: float, round_s: float, source: str = "",
        *, timed: bool = True, evaluated: int | None = None,
    ) -> None:
        return None
