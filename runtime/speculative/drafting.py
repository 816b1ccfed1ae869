"""Where a speculative round's draft comes from, and who hears what was committed.

:class:`SourceDrafting` asks the drafters in order each round (model-free ones first)
for what the length policy allots each, and tells the drafter what each round
committed. :class:`PreDrafting` adds PEARL's pre-drafting on top: while the target
verifies round r's draft ``d1..dk``, a background thread already drafts round r+1
assuming every draft is accepted — it proposes ``b, e1..ek`` after ``context + d``,
where ``b`` is its guess of the target's bonus token. When the target accepts all k
and emits ``b``, round r+1 starts with ``e1..ek`` ready and no drafting time; otherwise
the pre-draft is dropped. The target verifies every draft either way, so the output is
the same with or without it.

The loop (:func:`tandem.runtime.speculative.loop.speculative_round`) calls, per round,
``draft`` (this round's draft), ``draft_ahead`` (just before the verify call) and
``commit`` (after it); ``settled`` says whether the drafter has heard every commit.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from tandem.kernels.sampling import Sampler
from tandem.runtime.speculative.drafters.base import LONG_CATCH_UP, Draft, Drafter
from tandem.runtime.speculative.drafters.chain import ChainDrafter
from tandem.runtime.speculative.policy.base import LengthPolicy


def draft_sources(drafter: Drafter) -> list[Drafter]:
    """The drafters a chain asks in turn (nested chains flattened), or just ``drafter``."""
    if isinstance(drafter, ChainDrafter):
        return [d for inner in drafter.drafters for d in draft_sources(inner)]
    return [drafter]


EXPECTED_REPLY = 256
"""Tokens a reply without a token budget is expected to run (a chat answer). A reply
already longer is expected to run as long again."""


@dataclass(frozen=True)
class Reply:
    """The reply being decoded: what is left of it is what waking a drafter, which must
    first catch up on text it has not seen, can gain on."""

    prompt_len: int
    horizon: int
    """The context length drafts may fill up to (the token budget, or the context size)."""
    budgeted: bool
    """The caller asked for at most a number of tokens (else :data:`EXPECTED_REPLY`)."""

    def remaining(self, context_len: int) -> int:
        """Tokens the reply is expected to run past ``context_len``."""
        left = self.horizon - context_len
        if self.budgeted:
            return left
        produced = context_len - self.prompt_len
        return min(left, max(EXPECTED_REPLY - produced, produced))


def draft_round(sources: Sequence[Drafter], policy: LengthPolicy, context: list[int], k: int,
                sampler: Sampler, remaining: int) -> Draft:
    """This round's draft: ask the sources in order (model-free ones first) for what the
    policy allots each out of ``k`` (its :meth:`~LengthPolicy.next_length`, capped by the
    room left), and take the first draft the policy keeps any of (it may keep a prefix).
    A drafter that must first catch up on a long text it has not seen
    (:data:`~tandem.runtime.speculative.drafters.base.LONG_CATCH_UP`) is asked only where
    the policy says that pays over the ``remaining`` tokens. An empty draft makes a plain round."""
    for source in sources:
        n = policy.length_for(source.name, k)
        if n <= 0:
            continue
        backlog = source.backlog(context)
        if backlog >= LONG_CATCH_UP and not policy.catch_up_pays(source.name, backlog, remaining):
            continue
        draft = source.propose(context, n, sampler)
        if draft.tokens:
            keep = policy.trim(draft.confidence, len(draft.tokens), draft.source or source.name)
            if keep:
                return draft.head(keep)
    return Draft([], None, "")


class SourceDrafting:
    """Each round's draft asked of the drafters in turn (:func:`draft_round`); every
    commit passed on to the drafter at once."""

    settled = True
    """The drafter has heard every round's commit (always, without pre-drafting)."""
    hits = misses = 0
    """Rounds that started with a pre-drafted draft, pre-drafts dropped (none here)."""

    def __init__(self, drafter: Drafter, policy: LengthPolicy, sampler: Sampler, reply: Reply) -> None:
        self.drafter, self.policy, self.sampler, self.reply = drafter, policy, sampler, reply
        self.sources = draft_sources(drafter)

    def draft(self, context: list[int], k: int) -> Draft:
        return draft_round(self.sources, self.policy, context, k, self.sampler, self.reply.remaining(len(context)))

    def draft_ahead(self, context: list[int], draft: Draft, k: int, horizon: int) -> None:
        """Called with the draft about to be verified: nothing to do here."""

    def commit(self, context: list[int], accepted: int, verified: int) -> None:
        """The round committed ``context``'s tail, ``accepted`` of ``verified`` drafts."""
        self.drafter.commit(context, accepted)  # also on k = 0: caches stay in sync

    def close(self) -> None:
        """Nothing runs in the background here."""


def _predraft(drafter: Drafter, assumed: list[int], k: int, sampler: Sampler) -> tuple[list[int], Draft]:
    """Draft a guess of the bonus token plus ``k`` after ``assumed`` (all drafts accepted);
    return (the context that draft presumes, the draft after the guess)."""
    d = drafter.propose(assumed, k + 1, sampler)
    if not d.tokens:
        return assumed, d
    rest = Draft(d.tokens[1:], None if d.q is None else d.q[1:], d.source,
                 None if d.confidence is None else d.confidence[1:])
    return [*assumed, d.tokens[0]], rest


class PreDrafting(SourceDrafting):
    """:class:`SourceDrafting` that drafts the next round in a background thread while
    the target verifies this one, where ``policy.predraft_pays`` says the acceptance
    outlook allows. A round whose pre-draft is still running tells the drafter its
    commit once that draft is done (``owed``): the drafter is not thread-safe.

    ``hits`` / ``misses``: rounds that started with a ready draft, pre-drafts dropped."""

    def __init__(self, drafter: Drafter, policy: LengthPolicy, sampler: Sampler, reply: Reply) -> None:
        super().__init__(drafter, policy, sampler, reply)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-predraft")
        self.pending: Future | None = None
        self.owed: tuple[list[int], int] | None = None
        self.hits = self.misses = 0

    @property
    def settled(self) -> bool:  # type: ignore[override]
        return self.pending is None

    def _settle(self) -> tuple[list[int], Draft]:
        """Wait for the pre-draft, then tell the drafter the commit it was owed."""
        assert self.pending is not None
        presumed = self.pending.result()
        self.pending = None
        if self.owed is not None:
            self.drafter.commit(*self.owed)
            self.owed = None
        return presumed

    def draft(self, context: list[int], k: int) -> Draft:
        if self.pending is not None:
            assumed, ready = self._settle()
            if assumed == context and ready.tokens and k > 0:
                self.hits += 1
                return ready.head(k)
            self.misses += 1
        return super().draft(context, k)

    def draft_ahead(self, context: list[int], draft: Draft, k: int, horizon: int) -> None:
        n = len(draft.tokens)
        room = horizon - len(context) - n - 1  # the next round's k if all n are accepted
        if n and room > 0 and self.policy.predraft_pays(n):
            self.pending = self.pool.submit(_predraft, self.drafter, [*context, *draft.tokens], min(k, room),
                                            self.sampler)

    def commit(self, context: list[int], accepted: int, verified: int) -> None:
        if self.pending is not None and accepted < verified:
            self.pending.result()  # presumed drafts that were rejected: unusable
            self.pending = None
            self.misses += 1
        if self.pending is None:
            self.drafter.commit(context, accepted)
        else:
            self.owed = (list(context), accepted)

    def close(self) -> None:
        if self.pending is not None:
            self.pending.result()
            self.pending = None
        if self.owed is not None:
            self.drafter.commit(*self.owed)
            self.owed = None
        self.pool.shutdown(wait=True)
