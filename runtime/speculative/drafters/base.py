"""What every drafter provides to the speculative decoder.

A drafter proposes target-vocabulary tokens and, for model drafters, the proposal
distribution q over the *target* vocabulary at each position (cross-vocabulary
drafters translate first). Model-free drafters propose deterministic tokens (q is
one-hot), which the rejection rule handles exactly. After each round the decoder tells
the drafter what was committed, so it can roll back its own cache and learn.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

import numpy as np

from tandem.kernels.sampling import Sampler
from tandem.runtime.backends.protocol import Backend, common_prefix_len

LONG_CATCH_UP = 16
"""Tokens of backlog (:meth:`Drafter.backlog`) from which a drafter's catch-up is a cost of
its own. A shorter one (a round's bonus token, a few tokens a model-free source drafted)
is part of what drafting costs round after round, and is timed with it; a longer one (the
prompt, or text committed while the drafter slept) is reported apart
(:attr:`Draft.catch_up_s`) and weighed before the drafter is woken. Counted as drafting,
the SmolLM2 cross-vocabulary drafter's re-encoded tail (a few tokens every round) was
missing from its cost, and auto with it fell to 0.88x plain on codegen at 2 threads."""


@dataclass
class Draft:
    tokens: list[int]
    """Proposed target-vocabulary token ids, in order."""
    q: np.ndarray | None = None
    """``(len(tokens), n_vocab_target)`` proposal distributions; ``None`` means one-hot."""
    source: str = ""
    """Which drafter produced it (for stats when drafters are combined)."""
    confidence: list[float] | None = None
    """Optional per-token estimates that each token is accepted (the drafter's own
    probability of it, or a suffix-tree path frequency); adaptive length policies use
    them. Never used for the acceptance decision itself, so any values keep it lossless."""
    catch_up_s: float = 0.0
    """Seconds the drafter spent bringing its own cache up to the context before drafting,
    when that was a backlog of :data:`LONG_CATCH_UP` tokens or more (text committed while
    it was not asked, the prompt): not a cost of drafting, so adaptive policies
    do not charge it per drafted token — a drafter switched off for a while catches up
    in one batched call, and that must not keep it switched off. They price it as a
    whole instead, before waking the drafter (:meth:`Drafter.backlog`)."""
    catch_up_tokens: int = 0
    """The backlog that catch-up evaluated (:meth:`Drafter.backlog` before the proposal):
    what ``catch_up_s`` bought; 0 with it."""

    def __len__(self) -> int:
        return len(self.tokens)

    def caught_up(self, seconds: float, backlog: int) -> Draft:
        """This draft with the catch-up before it reported, if the backlog was long."""
        return replace(self, catch_up_s=seconds, catch_up_tokens=backlog) if backlog >= LONG_CATCH_UP else self

    def head(self, n: int) -> Draft:
        """The first ``n`` tokens, with their q rows and confidences (the catch-up stays)."""
        if n >= len(self.tokens):
            return self
        return replace(self, tokens=self.tokens[:n], q=None if self.q is None else self.q[:n],
                       confidence=None if self.confidence is None else self.confidence[:n])

    def extended(self, tokens: Sequence[int], confidence: float) -> Draft:
        """This draft followed by ``tokens``, proposed for certain (one-hot q rows), each
        believed with ``confidence``: forced tokens under a grammar, a timing round's padding."""
        if not tokens:
            return self
        q = self.q
        if q is not None:
            one_hot = np.zeros((len(tokens), q.shape[1]), dtype=q.dtype)
            one_hot[np.arange(len(tokens)), list(tokens)] = 1.0
            q = np.concatenate([q, one_hot])
        believed = None if self.confidence is None else [*self.confidence, *[confidence] * len(tokens)]
        return replace(self, tokens=[*self.tokens, *tokens], q=q, confidence=believed)


@runtime_checkable
class Drafter(Protocol):
    name: str
    calls: int
    """Forward calls of the drafter's model so far (always 0 for a model-free drafter)."""
    stop_threshold: float | None
    """SpecDec++: stop drafting once the estimated chance of a rejection exceeds it
    (``None``: never). Model-free drafters have no estimate and ignore it."""

    def propose(self, context: Sequence[int], max_tokens: int, sampler: Sampler) -> Draft:
        """Propose up to ``max_tokens`` tokens continuing ``context`` (target-vocab ids).

        ``sampler`` carries the sampling settings, so a model drafter's q is built by
        the same transformations as the target's p (and is one-hot when greedy).
        """
        ...

    def commit(self, context: Sequence[int], n_accepted: int) -> None:
        """The round is over: ``context`` is the full committed target sequence and
        ``n_accepted`` of the proposed tokens were accepted. Roll back and learn here."""
        ...

    def backlog(self, context: Sequence[int]) -> int:
        """Tokens the drafter would evaluate to catch up on ``context`` before drafting,
        beyond the last committed one every drafting round evaluates: 0 for model-free
        drafters and for a model drafter that drafted last round; the whole prompt for one
        that has not run yet. The length policy weighs that catch-up against what drafting
        can still gain in the reply (:meth:`~tandem.runtime.speculative.policy.base.LengthPolicy.catch_up_pays`)."""
        ...

    def weight_bytes(self) -> int:
        """Model weight bytes read per drafted token (0: model-free). Before the drafter
        is timed, its cost per token is priced as this share of the target's weights."""
        ...

    def prime(self, tokens: Sequence[int]) -> None:
        """Text the next request is likely to repeat (an editor's previous suggestion,
        asked for again with the part the user accepted appended): model-free drafters
        draft from it as from the request's own context; model drafters ignore it."""
        ...

    def model_backend(self) -> Backend | None:
        """The drafter model's backend (where it runs, what it holds); ``None`` when it
        drafts without a model."""
        ...

    def close(self) -> None: ...


def same_request(indexed: Sequence[int], context: Sequence[int]) -> int | None:
    """Where ``context`` no longer extends the ``indexed`` sequence a model-free drafter
    holds: the length of their common start when that is at least half of ``indexed``
    (the same conversation with its end changed: a chat's next turn, whose template
    re-renders the end of the last reply, or a pre-draft the target rejected), so only the
    changed end is indexed again; ``None`` for a new request. Indexing costs tens of µs a
    token, so a 30,000-token chat indexed from scratch held each reply back by over a
    second (the suffix trie) and a tenth (prompt lookup)."""
    keep = common_prefix_len(indexed, context)
    return keep if 2 * keep >= len(indexed) else None


class ModelFreeDrafter:
    """What a drafter that drafts from the text alone (prompt lookup, text lookup, the
    suffix tree) has nothing of: no model calls, no confidence to stop on, no cache to
    catch up or roll back, no weights. Subclasses write :meth:`propose` and what they
    keep (``prime``, ``commit`` where they learn, ``close``)."""

    name: str
    calls = 0
    stop_threshold: float | None = None
    """Ignored: a model-free draft has no estimate of its own rejection."""

    def commit(self, context: Sequence[int], n_accepted: int) -> None:
        """Nothing to roll back: the drafter only ever holds committed text."""

    def backlog(self, context: Sequence[int]) -> int:
        return 0  # nothing to catch up on: it drafts from the context itself

    def weight_bytes(self) -> int:
        return 0

    def prime(self, tokens: Sequence[int]) -> None:
        """Not used unless overridden (see :meth:`Drafter.prime`)."""

    def model_backend(self) -> None:
        return None


class WrappingDrafter:
    """A drafter that changes what ``inner`` is asked or what it proposes (a grammar, a
    context window) and passes everything else on to it. Subclasses override the calls
    they change."""

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.name = inner.name

    @property
    def calls(self) -> int:
        return self.inner.calls

    @property
    def stop_threshold(self) -> float | None:
        return self.inner.stop_threshold

    @stop_threshold.setter
    def stop_threshold(self, value: float | None) -> None:
        self.inner.stop_threshold = value

    def propose(self, context: Sequence[int], max_tokens: int, sampler: Sampler) -> Draft:
        return self.inner.propose(context, max_tokens, sampler)

    def commit(self, context: Sequence[int], n_accepted: int) -> None:
        self.inner.commit(context, n_accepted)

    def backlog(self, context: Sequence[int]) -> int:
        return self.inner.backlog(context)

    def weight_bytes(self) -> int:
        return self.inner.weight_bytes()

    def prime(self, tokens: Sequence[int]) -> None:
        self.inner.prime(tokens)

    def model_backend(self) -> Backend | None:
        return self.inner.model_backend()

    def close(self) -> None:
        self.inner.close()
