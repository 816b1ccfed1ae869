"""Any strategy under a grammar: :func:`constrained` is the one way to ask for it.

``generate(target, prompt, sampler, strategy=constrained(strategy, grammar))`` decodes
with ``strategy`` (plain or speculative, any drafter) on the masked target
(:class:`~tandem.runtime.constrained.target.MaskedTarget`), with its drafts cut to legal
ones (:class:`~tandem.runtime.constrained.grammar_drafter.GrammarDrafter`), and adds what a
grammar knows before the model runs:

* **Forced runs.** Where the grammar forces text (the ``", "age": `` between two fields
  of a schema), llguidance allows only its canonical tokenization, so each of those
  tokens is the only legal one at its step: the masked target gives it probability 1,
  and greedy, seeded and sampled decoding all pick it. A *forced round* commits the run
  without asking the target, and feeds it to the target's cache together with the last
  committed token in one call whose last row gives the token after the run. A run of m
  forced tokens costs one call instead of m + 1; the draft-length policy never sees them.
* **The end.** Once the grammar is complete, end-of-generation is committed without a
  target call.

The inner strategy runs from the committed context until a forced run appears, then is
closed, and started again after the forced round. Both strategies keep the cache holding
every committed token but the last between commits, which is where a forced round
starts and ends, so a restart costs no call.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator, Sequence

import numpy as np

from tandem.kernels.sampling import Sampler
from tandem.runtime.backends.protocol import Backend, common_prefix_len
from tandem.runtime.constrained.grammar import Grammar
from tandem.runtime.constrained.grammar_drafter import GrammarDrafter
from tandem.runtime.constrained.state import GrammarState
from tandem.runtime.constrained.target import MaskedTarget
from tandem.runtime.generate import Commit, DecodeStats, Strategy
from tandem.runtime.speculative.drafters.base import Drafter
from tandem.runtime.speculative.drafters.chain import ChainDrafter
from tandem.runtime.speculative.drafters.text_lookup import TextLookupDrafter
from tandem.runtime.speculative.drafting import draft_sources
from tandem.runtime.speculative.factory import MODEL_FREE_SOURCES, SpeculativeStrategy
from tandem.runtime.speculative.loop import speculative


def _cache_all_but_last(target: Backend, context: Sequence[int]) -> None:
    """Bring the cache to ``context[:-1]`` (the strategies' state between commits)."""
    reuse = common_prefix_len(target.tokens, context[:-1])
    target.truncate(reuse)
    if len(context) - 1 > reuse:
        target.evaluate(list(context[reuse:-1]))


def _one_hot_rows(tokens: Sequence[int], n_vocab: int) -> np.ndarray:
    """Logits rows of a distribution certain of each token (log-probability 0)."""
    rows = np.full((len(tokens), n_vocab), -np.inf, dtype=np.float32)
    rows[np.arange(len(tokens)), list(tokens)] = 0.0
    return rows


def forced_round(target: Backend, context: list[int], run: list[int], sampler: Sampler,
                 stats: DecodeStats) -> Commit:
    """Commit the forced ``run`` after ``context`` and the target's token after it, from
    one evaluation of ``[context[-1], *run]`` (in pieces of at most ``exact_batch``
    tokens, so the cache holds what one-token steps would have computed). The cache
    holds ``context[:-1]`` before and the new context but its last token after."""
    _cache_all_but_last(target, context)
    feed = [context[-1], *run]
    step = target.exact_batch or len(feed)
    for start in range(0, len(feed), step):
        logits = target.evaluate(feed[start:start + step])
        stats.target_calls += 1
    history = [*context, *run] if sampler.params.penalized else ()
    token = sampler.sample_at(logits[-1], len(context) + len(run), history)
    stats.forced_tokens += len(run)
    rows = np.concatenate([_one_hot_rows(run, target.n_vocab), logits[-1:]])
    return Commit([*run, token], 0, rows)


def grammar_drafts(strategy: Strategy, grammar: Grammar, target: Backend, prompt_len: int,
                   ) -> tuple[Strategy, Drafter | None]:
    """``strategy`` with each of its draft sources cut to legal drafts, and its drafter
    (a plain strategy as it is, and ``None``). Where model-free drafting is on, text
    lookup (:class:`~tandem.runtime.speculative.drafters.text_lookup.TextLookupDrafter`)
    is asked first: a schema's values are mostly the prompt's words, quoted, which token
    lookup cannot find (the quote changes their first token)."""
    if not isinstance(strategy, SpeculativeStrategy) or strategy.drafter is None or strategy.policy is None:
        return strategy, None
    inner = draft_sources(strategy.drafter)
    if any(d.name in MODEL_FREE_SOURCES for d in inner):
        inner = [TextLookupDrafter(target), *inner]
    sources: list[Drafter] = [GrammarDrafter(d, grammar, prompt_len) for d in inner]
    drafter: Drafter = sources[0] if len(sources) == 1 else ChainDrafter(sources)
    return speculative(drafter, strategy.policy, predraft=strategy.predraft), drafter


def _through_end(tokens: Sequence[int], eog: Sequence[int]) -> list[int]:
    """``tokens`` up to and including the first end-of-generation token."""
    end = next((i for i, t in enumerate(tokens) if t in eog), len(tokens) - 1)
    return list(tokens[: end + 1])


def constrained(strategy: Strategy, grammar: Grammar, *, forced_rounds: bool = True) -> Strategy:
    """``strategy`` with every committed token legal under ``grammar`` (see the module
    docstring). ``forced_rounds=False`` leaves forced runs to the strategy, token by
    token: plain constrained decoding, the baseline the bench compares against."""

    def run(target: Backend, prompt: list[int], sampler: Sampler, stats: DecodeStats,
            budget: int | None = None) -> Iterator[Commit]:
        masked = MaskedTarget(target, GrammarState(grammar), len(prompt))
        committed = GrammarState(grammar)
        inner, drafter = grammar_drafts(strategy, grammar, masked, len(prompt))
        calls_at_start = drafter.calls if drafter is not None else 0
        context = list(prompt)
        left = target.n_ctx - len(prompt) if budget is None else budget

        def accept(commit: Commit) -> Commit:
            nonlocal left
            committed.consume(_through_end(commit.tokens, grammar.eog))
            context.extend(commit.tokens)
            left -= len(commit.tokens)
            return commit

        while left > 0:
            if committed.done:  # only end-of-generation is legal: no need to ask the target
                eos = target.special.eos
                yield Commit([eos if eos in grammar.eog else grammar.eog[0]])
                return
            run_ahead = committed.forced(min(left, target.n_ctx - len(context)) - 1) if forced_rounds else []
            if run_ahead:
                yield accept(forced_round(masked, context, run_ahead, sampler, stats))
                continue
            commits = inner(masked, context, sampler, stats, left)
            try:
                for commit in commits:
                    if drafter is not None:  # the inner loop counts from its own start only
                        stats.draft_calls = drafter.calls - calls_at_start
                    yield accept(commit)
                    if left <= 0 or committed.done or (forced_rounds and committed.forced()):
                        break
                else:
                    return  # the strategy stopped (context full)
            finally:
                if isinstance(commits, Generator):
                    commits.close()

    return run
