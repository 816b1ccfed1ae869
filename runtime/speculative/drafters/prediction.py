"""Drafting from a predicted output: OpenAI's Predicted Outputs (``prediction``).

A client that asks for a file back with a small change, or a document re-emitted with
corrections, already knows most of the reply: the text it sent. It passes that text as
the prediction, and the reply is drafted from it: from its first token at the reply's
start, then on from wherever the reply stands in it. The target verifies every drafted
token as it verifies any draft, so the reply is what it would have been without the
prediction (greedy identical, sampling exact); only its speed changes.

Where the reply stands (:class:`Prediction`, :class:`Place`): while the reply follows
the prediction, one token further each token; where it departs (the edit), nowhere,
until its latest tokens (an n-gram of at least :attr:`Prediction.min_ngram`) are found
again in the prediction — the first such place at or after the furthest one reached
(edits move forward), else the latest before it. The same walk counts the prediction's
tokens that appeared in the reply, for the reply's ``usage``
(:meth:`Prediction.appeared`), so that count depends on the reply alone, never on how
drafting went.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.kernels.sampling import Sampler
from tandem.runtime.speculative.drafters.base import Draft, ModelFreeDrafter

PRIOR_FOLLOWS = (9.0, 1.0)
"""Before the reply has shown how closely it follows its prediction: as if it had followed
it 9 times and departed once (0.9 a token). The client says the reply repeats it."""


@dataclass(frozen=True)
class Place:
    """Where a reply stands in its prediction."""

    at: int | None
    """The prediction's index of the reply's next token; ``None``: the reply has departed
    from the prediction and not met it again."""
    furthest: int
    """The furthest index the reply has reached: where to look first when it departs."""


class Prediction:
    """A prediction's tokens, indexed by their n-grams, and the walk of a reply through them."""

    def __init__(self, tokens: Sequence[int], *, size: int | None = None, min_ngram: int = 2,
                 max_ngram: int = 6) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.tokens = list(tokens)
        self.size = len(self.tokens) if size is None else size
        """The whole prediction's length in tokens, where ``tokens`` is only the part a
        reply can reach."""
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self._ends: dict[tuple[int, ...], list[int]] = {}
        """n-gram -> the indices right after each of its occurrences, ascending."""
        for end in range(1, len(self.tokens) + 1):
            for n in range(min_ngram, min(max_ngram, end) + 1):
                self._ends.setdefault(tuple(self.tokens[end - n:end]), []).append(end)

    def start(self) -> Place:
        return Place(0, 0)

    def step(self, place: Place, recent: Sequence[int]) -> tuple[Place, range]:
        """Where the reply stands after its latest token (``recent[-1]``; ``recent``: its
        last :attr:`max_ngram` tokens or fewer), from ``place`` before it, and the
        prediction's indices that token matched (and, when the reply met the prediction
        again, the n-gram's others): empty where it matched nothing."""
        token = recent[-1]
        at = place.at
        if at is not None and at < len(self.tokens) and self.tokens[at] == token:
            return Place(at + 1, max(place.furthest, at + 1)), range(at, at + 1)
        for n in range(min(self.max_ngram, len(recent)), self.min_ngram - 1, -1):
            ends = self._ends.get(tuple(recent[-n:]))
            if ends:
                i = bisect_left(ends, place.furthest)
                end = ends[i] if i < len(ends) else ends[-1]
                return Place(end, max(place.furthest, end)), range(end - n, end)
        return Place(None, place.furthest), range(0)

    def walk(self, reply: Sequence[int], done: int = 0, *, place: Place | None = None) -> Place:
        """``place`` (the start by default, after ``reply[:done]``) moved on over ``reply[done:]``."""
        place = self.start() if place is None else place
        for i in range(done, len(reply)):
            place, _ = self.step(place, self.recent(reply, i))
        return place

    def recent(self, reply: Sequence[int], i: int) -> Sequence[int]:
        """What :meth:`step` reads of ``reply`` for its token ``i``: up to :attr:`max_ngram` tokens ending there."""
        return reply[max(0, i + 1 - self.max_ngram):i + 1]

    def appeared(self, reply: Sequence[int]) -> int:
        """How many of the prediction's tokens appeared in ``reply`` along its walk:
        OpenAI's ``accepted_prediction_tokens`` (the rest are ``rejected_prediction_tokens``)."""
        place, seen = self.start(), set[int]()
        for i in range(len(reply)):
            place, matched = self.step(place, self.recent(reply, i))
            seen.update(matched)
        return len(seen)

    def draft(self, place: Place, max_tokens: int) -> list[int]:
        """What the prediction says comes next from ``place``."""
        return [] if place.at is None else self.tokens[place.at:place.at + max_tokens]


class PredictionDrafter(ModelFreeDrafter):
    """Drafts one request's reply from its prediction (see the module docstring); asked
    ahead of the strategy's own drafters, which draft wherever the reply has departed.

    Its confidence is measured, not assumed: how often this reply, where it stood in the
    prediction, went on with the prediction's next token (with :data:`PRIOR_FOLLOWS`
    before it shows). An edit that changes a few lines of a file keeps that near 1, and
    drafts run long; a rewrite that renames every identifier brings it down, and drafts
    stay short (judged by a match's length alone, every draft was believed near certain,
    and on such a rewrite long drafts were verified and cut at the next renamed name)."""

    def __init__(self, prediction: Prediction, reply_start: int) -> None:
        self.name = "prediction"
        self.prediction = prediction
        self.reply_start = reply_start
        """The context length where the reply begins (the prompt's)."""
        self._place = prediction.start()
        self._walked = 0
        """Reply tokens committed and walked so far."""
        self._latest: list[int] = []
        """The last :attr:`Prediction.max_ngram` of them: all that walking on reads of them
        (a round copies only its new tokens, never the whole reply)."""
        self.follows, self.departures = PRIOR_FOLLOWS
        """Tokens the reply took from where it stood in the prediction, and tokens where it
        did not (prior included)."""

    def _unwalked(self, context: Sequence[int]) -> tuple[list[int], int]:
        """The reply's latest walked tokens followed by those not walked yet, and where the
        latter begin."""
        return [*self._latest, *context[self.reply_start + self._walked:]], len(self._latest)

    def follow_rate(self) -> float:
        """The chance that the reply, standing in the prediction, goes on with its next token."""
        return self.follows / (self.follows + self.departures)

    def propose(self, context: Sequence[int], max_tokens: int, sampler: Sampler) -> Draft:
        if max_tokens <= 0:
            return Draft([], None, self.name)
        # A context past the committed one (a pre-draft) is walked on a copy of the place.
        place = self.prediction.walk(*self._unwalked(context), place=self._place)
        tokens = self.prediction.draft(place, max_tokens)
        return Draft(tokens, None, self.name, [self.follow_rate()] * len(tokens))

    def commit(self, context: Sequence[int], n_accepted: int) -> None:
        tail, done = self._unwalked(context)
        prediction = self.prediction
        for i in range(done, len(tail)):
            before = self._place
            self._place, matched = prediction.step(before, prediction.recent(tail, i))
            if before.at is not None and before.at < len(prediction.tokens):  # it stood somewhere: did it follow?
                followed = matched == range(before.at, before.at + 1)
                self.follows += followed
                self.departures += not followed
        self._walked += len(tail) - done
        self._latest = tail[-prediction.max_ngram:]

    def close(self) -> None:
        """Nothing held beyond the request."""
