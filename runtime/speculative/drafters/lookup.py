"""Prompt lookup (n-gram) drafting: copy what followed the last earlier occurrence of
the context's final n-gram (Saxena 2023; llama.cpp ``lookup``; HF prompt lookup).

Free to run (no model), strong when the output repeats the prompt or itself: editing,
summarising, re-asking, code. The n-gram index is updated incrementally as the
committed sequence grows, so a round costs O(new tokens x n-gram sizes), and cut back
exactly where the next request changes the end of the conversation.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from tandem.kernels.sampling import Sampler
from tandem.runtime.speculative.drafters.base import Draft, ModelFreeDrafter, same_request
from tandem.runtime.speculative.drafters.suffix import match_certainty

NO_ENTRY = -1
"""In the undo log: the n-gram was not in the index before."""
NOT_INDEXED = -2
"""In the undo log: no n-gram of that length ends there (it would start before the sequence)."""


class PromptLookupDrafter(ModelFreeDrafter):
    """Longest n-gram match first (``max_ngram`` down to ``min_ngram``)."""

    def __init__(self, *, max_ngram: int = 6, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.name = "lookup"
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._reset()

    def _reset(self) -> None:
        self._seq: list[int] = []
        self._index: dict[tuple[int, ...], int] = {}
        """n-gram -> position right after its most recent occurrence that has a continuation."""
        self._next_end = 1
        self._undo = array("q")
        """What each index write replaced (:data:`NO_ENTRY`, or the position it held), one
        slot per n-gram size per indexed position: the index is cut back to a shorter
        sequence exactly (:meth:`_cut`), as if it had only ever seen that sequence."""

    def _sync(self, context: Sequence[int]) -> None:
        n = len(self._seq)
        if len(context) < n or list(context[:n]) != self._seq:
            keep = same_request(self._seq, context)
            if keep is None:
                self._reset()
            else:
                self._cut(keep)
        self._seq.extend(context[len(self._seq) :])
        seq, index, undo = self._seq, self._index, self._undo
        # Index n-grams ending at `end` (exclusive) whose continuation seq[end] exists.
        for end in range(self._next_end, len(seq)):
            for n in range(self.min_ngram, self.max_ngram + 1):
                if n > end:
                    undo.append(NOT_INDEXED)
                    continue
                key = tuple(seq[end - n : end])
                undo.append(index.get(key, NO_ENTRY))
                index[key] = end
        self._next_end = max(self._next_end, len(seq))

    def _cut(self, keep: int) -> None:
        """Undo the index writes of every position from ``keep`` on, newest first, and
        drop the sequence after ``keep``."""
        seq, index, undo = self._seq, self._index, self._undo
        sizes = range(self.min_ngram, self.max_ngram + 1)
        first = max(keep, 1)
        for end in range(self._next_end - 1, first - 1, -1):
            slots = undo[(end - 1) * len(sizes) : end * len(sizes)]
            for n, old in zip(sizes, slots, strict=True):
                if old == NOT_INDEXED:
                    continue
                key = tuple(seq[end - n : end])
                if old == NO_ENTRY:
                    del index[key]
                else:
                    index[key] = old
        del undo[(first - 1) * len(sizes) :]
        del seq[keep:]
        self._next_end = first

    def propose(self, context: Sequence[int], max_tokens: int, sampler: Sampler) -> Draft:
        if max_tokens <= 0:
            return Draft([], None, self.name)
        self._sync(context)
        seq = self._seq
        for n in range(min(self.max_ngram, len(seq)), self.min_ngram - 1, -1):
            pos = self._index.get(tuple(seq[-n:]))
            if pos is not None:
                tokens = seq[pos : pos + max_tokens]
                return Draft(tokens, None, self.name, [match_certainty(n)] * len(tokens))
        return Draft([], None, self.name)

    def close(self) -> None:
        self._reset()
