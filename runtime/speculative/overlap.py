"""Drafter and target on different devices (or CPU-thread groups), working at once.

Dovetail (algorithms.md §2) puts the drafter on one device and the target on another.
Here the two overlap through **pre-drafting** (PEARL's post-verify idea,
:class:`~tandem.runtime.speculative.drafting.PreDrafting`): while the target verifies a
round's draft, a background thread already drafts the next round, assuming every draft
is accepted; the next round uses it when that assumption came true. The target verifies
every draft, so the output is exactly the target's.

llama.cpp's ``llama_decode`` runs without the GIL (ctypes releases it), so the two
threads really run in parallel. On a CPU-only machine the "devices" are thread groups:
``target_threads + draft_threads`` cores. Which placement to use is chosen from measured
costs by :mod:`tandem.runtime.planning.placement`.

:class:`WindowedDrafter` implements the planner's drafter context cap: the drafter
sees BOS plus a window of recent tokens that moves in half-window jumps, so its cache
is rebuilt once per half window instead of the drafter stopping when its context fills.
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.kernels.sampling import Sampler
from tandem.runtime.speculative.drafters.base import Draft, Drafter, WrappingDrafter
from tandem.runtime.speculative.loop import speculative
from tandem.runtime.speculative.policy.base import FixedLength


class WindowedDrafter(WrappingDrafter):
    """Wrap a drafter so it only ever sees ``[BOS] + context[start:]`` (at most ``window``
    tokens); ``start`` advances by half a window when the context outgrows it."""

    def __init__(self, inner: Drafter, window: int, keep_first: int = 1) -> None:
        if window < 8:
            raise ValueError("a draft window needs at least 8 tokens")
        super().__init__(inner)
        self.window, self.keep_first = window, keep_first
        self.name = f"{inner.name}@{window}"
        self._start = keep_first

    def _start_for(self, context: Sequence[int], room: int) -> int:
        """Where the window starts for ``context`` with ``room`` positions to spare: the
        current start, moved on in half-window jumps until the rest fits."""
        start, limit = self._start, self.window - room
        while len(context) - start + self.keep_first > limit:
            start += max(1, self.window // 2)
        return self.keep_first if start > len(context) else start  # past the end: a new, shorter conversation

    def _window(self, context: Sequence[int], start: int) -> list[int]:
        return list(context[: self.keep_first]) + list(context[start:])

    def _view(self, context: Sequence[int], room: int) -> list[int]:
        """The window the drafter sees now, moving it on if ``context`` outgrew it."""
        self._start = self._start_for(context, room)
        return self._window(context, self._start)

    def propose(self, context: Sequence[int], max_tokens: int, sampler: Sampler) -> Draft:
        if len(context) + max_tokens + 1 <= self.window:
            self._start = self.keep_first
        return self.inner.propose(self._view(context, max_tokens + 1), max_tokens, sampler)

    def commit(self, context: Sequence[int], n_accepted: int) -> None:
        self.inner.commit(self._view(context, 1), n_accepted)

    def backlog(self, context: Sequence[int]) -> int:
        """The inner drafter's backlog for the window it would see (asking moves nothing)."""
        return self.inner.backlog(self._window(context, self._start_for(context, 1)))


def split_speculative(drafter: Drafter, k: int, *, predraft: bool = True):
    """The speculative strategy with fixed draft length ``k`` and, when ``predraft``, the
    next round drafted in a background thread during verification (the device split).

    Stats: ``extra['predraft_hits']`` / ``['predraft_misses']`` count rounds that started
    with a ready draft or dropped one.
    """
    return speculative(drafter, FixedLength(k), predraft=predraft)
