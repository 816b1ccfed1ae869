"""Timing rounds: the length policy asks for a verify call of a size it still needs timed.

The adaptive policy learns the target's verify cost c(k) from the run's own calls; a
size it has not seen yet (a new target's first rounds, see
:meth:`~tandem.runtime.speculative.cost.OnlineCost.wants_size`) is timed by padding
that round's draft to it. Padding is verified like any draft token (a one-hot proposal
in sampled verification), so the output is the same as without it: a timing round only
costs what it verifies past the real draft.
"""

from __future__ import annotations

from dataclasses import replace

from tandem.runtime.speculative.drafters.base import Draft
from tandem.runtime.speculative.policy.base import LengthPolicy


def padded(draft: Draft, size: int, filler: int) -> Draft:
    """``draft`` padded with ``filler`` to ``size`` tokens (one-hot q rows, confidence 0)."""
    pad = size - len(draft.tokens)
    if pad <= 0:
        return draft
    return replace(draft.extended([filler] * pad, 0.0), source=draft.source or "timing")


def for_timing(policy: LengthPolicy, draft: Draft, k: int, context: list[int]) -> tuple[Draft, bool]:
    """The draft to verify this round and whether the round times a call size: ``draft``
    padded to :meth:`~LengthPolicy.timing_length` with its last token (or the context's),
    or as it is when the policy times nothing, or when the reply has no room left for
    that size (``k`` below it): a shorter call would time no size the policy lacks, and
    its padding would be paid for nothing."""
    size = policy.timing_length()
    if size > k:
        size = 0
    return padded(draft, size, (draft.tokens or context)[-1]), size > 0
