"""Drafts under a grammar: cut at the first illegal token, forced runs added for free.

:class:`GrammarDrafter` wraps one draft source. A token the grammar forbids would be
rejected by verification anyway (the masked target gives it probability 0), so verifying
it and everything after it is wasted width: the draft is cut before it (a randomly drawn
token is drawn again among the legal ones instead, see :meth:`GrammarDrafter._legal`). When the legal
draft ends where the grammar forces a run (the ``", "age": `` after a string value), the
run is appended: if the draft is accepted the run is too, for no more than the width of
the verify call. Appended tokens are one-hot proposals, like any model-free draft, so
sampled acceptance stays exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from tandem.kernels.sampling import Sampler
from tandem.runtime.constrained.grammar import Grammar
from tandem.runtime.constrained.state import GrammarState
from tandem.runtime.speculative.drafters.base import Draft, Drafter, WrappingDrafter


class GrammarDrafter(WrappingDrafter):
    """``inner``'s drafts made legal under ``grammar`` for a reply after ``prompt_len``
    tokens of context. It keeps its own grammar state, brought to each context it is
    asked about, so it is right whoever calls it and when."""

    def __init__(self, inner: Drafter, grammar: Grammar, prompt_len: int) -> None:
        super().__init__(inner)
        self.state = GrammarState(grammar)
        self.prompt_len = prompt_len

    def propose(self, context: Sequence[int], max_tokens: int, sampler: Sampler) -> Draft:
        draft = self.inner.propose(context, max_tokens, sampler)
        reply = list(context[self.prompt_len:])
        if self.state.follow(reply) < len(reply) or self.state.done:
            return draft.head(0)
        legal = self._legal(draft, sampler)
        if not legal.tokens or len(legal.tokens) >= max_tokens:
            return legal
        self.state.consume(legal.tokens)
        forced = self.state.forced()[: max_tokens - len(legal.tokens)]
        self.state.rollback(len(legal.tokens))
        return legal.extended(forced, 1.0)

    def _legal(self, draft: Draft, sampler: Sampler) -> Draft:
        """The draft up to its first illegal token.

        Tokens drawn at random from q (sampled verification reads q) take the row of q
        restricted to the legal tokens and renormalised, and an illegal one is drawn
        again from that row, ending the draft: each drafted token is then exactly a
        draw from the row it is verified with. (Cutting where a random draw happened to
        be illegal, and keeping q, would bias the rejection rule's residual.)"""
        if draft.q is None or sampler.greedy or sampler.keyed:
            return draft.head(self.state.legal_prefix(draft.tokens))  # q is not read
        tokens: list[int] = []
        rows: list[np.ndarray] = []
        for i, token in enumerate(draft.tokens):
            allowed = self.state.allowed()
            q = np.asarray(draft.q[i], dtype=np.float64)
            width = min(len(q), len(allowed))
            legal_q = np.zeros_like(q)
            legal_q[:width] = np.where(allowed[:width], q[:width], 0.0)
            mass = legal_q.sum()
            if mass <= 0:  # q cannot draw a legal token here: the draft ends, for any draw
                break
            legal_q /= mass
            drawn_again = legal_q[token] <= 0
            if drawn_again:
                token = sampler.draw(legal_q)
            if not self.state.step(token):  # legal, but nothing may follow it: the draft ends before it
                break
            tokens.append(token)
            rows.append(legal_q)
            if drawn_again:
                break
        self.state.rollback(len(tokens))
        q_rows = np.stack(rows).astype(draft.q.dtype) if rows else None
        confidence = None if draft.confidence is None else [float(r[t]) for r, t in zip(rows, tokens, strict=True)]
        return replace(draft, tokens=tokens, q=q_rows, confidence=confidence)

    def close(self) -> None:
        """The inner drafter belongs to the engine's strategy, which closes it."""
