"""Prompt lookup (n-gram) drafting: copy what followed the last earlier occurrence of
the context's final n-gram (Saxena 2023; llama.cpp ``lookup``; HF prompt lookup).

Free to run (no model), strong when the output repeats the prompt or itself: editing,
summarising, re-asking, code. The n-gram index is updated incrementally as the
committed sequence grows, so a round costs O(new tokens x n-gram sizes).
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.kernels.sampling import Sampler
from tandem.runtime.speculative.drafters.base import Draft, ModelFreeDrafter
from tandem.runtime.speculative.drafters.suffix import match_certainty


class PromptLookupDrafter(ModelFreeDrafter):
    """Longest n-gram match first (``max_ngram`` down to ``min_ngram``)."""

    def __init__(self, *, max_ngram: int = 6, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.name = "lookup"
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._seq: list[int] = []
        self._index: dict[tuple[int, ...], int] = {}
        """n-gram -> position right after its most recent occurrence that has a continuation."""
        self._next_end = 1

    def _sync(self, context: Sequence[int]) -> None:
        n = len(self._seq)
        if len(context) < n or list(context[:n]) != self._seq:
            self._seq, self._index, self._next_end = [], {}, 1
        self._seq.extend(context[len(self._seq) :])
        seq, index = self._seq, self._index
        # Index n-grams ending at `end` (exclusive) whose continuation seq[end] exists.
        for end in range(self._next_end, len(seq)):
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                index[tuple(seq[end - n : end])] = end
        self._next_end = max(self._next_end, len(seq))

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
        self._seq, self._index = [], {}
