"""Combine drafters: the first one with a proposal wins.

Typical order: model-free drafters (suffix, prompt lookup) first, since they cost
nothing and are right when they fire on repetitive text; a model drafter last, for
when they have nothing. Every drafter sees every commit, so a model drafter's cache
catches up with what the model-free ones got accepted (one batched call).
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.kernels.sampling import Sampler
from tandem.runtime.backends.protocol import Backend
from tandem.runtime.speculative.drafters.base import Draft, Drafter


class ChainDrafter:
    def __init__(self, drafters: Sequence[Drafter]) -> None:
        if not drafters:
            raise ValueError("a chain needs at least one drafter")
        self.drafters = list(drafters)
        self.name = "+".join(d.name for d in self.drafters)

    @property
    def calls(self) -> int:
        return sum(d.calls for d in self.drafters)

    @property
    def stop_threshold(self) -> float | None:
        return next((d.stop_threshold for d in self.drafters if d.stop_threshold is not None), None)

    @stop_threshold.setter
    def stop_threshold(self, value: float | None) -> None:
        for d in self.drafters:
            d.stop_threshold = value

    def model_backend(self) -> Backend | None:
        return next((b for d in self.drafters if (b := d.model_backend()) is not None), None)

    def propose(self, context: Sequence[int], max_tokens: int, sampler: Sampler) -> Draft:
        draft = Draft([], None, self.name)
        for d in self.drafters:
            draft = d.propose(context, max_tokens, sampler)
            if draft.tokens:
                return draft
        return draft

    def commit(self, context: Sequence[int], n_accepted: int) -> None:
        for d in self.drafters:
            d.commit(context, n_accepted)

    def backlog(self, context: Sequence[int]) -> int:
        return sum(d.backlog(context) for d in self.drafters)

    def weight_bytes(self) -> int:
        return sum(d.weight_bytes() for d in self.drafters)

    def prime(self, tokens: Sequence[int]) -> None:
        for d in self.drafters:
            d.prime(tokens)

    def close(self) -> None:
        for d in self.drafters:
            d.close()
