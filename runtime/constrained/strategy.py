"""Any strategy under a grammar: :func:`constrained` is the one way to ask for it.

``generate(target, prompt, sampler, strategy=constrained(strategy, grammar))`` decodes
with ``strategy`` (plain or speculative, any drafter) on the masked target
(:class:`~tandem.runtime.constrained.target.MaskedTarget`), with its drafts made legal
(:class:`~tandem.runtime.constrained.drafter.GrammarDrafter`), and adds two things a
grammar knows before the model runs:

* **Forced runs.** Where the grammar allows one continuation (the ``", "age": `` between
  two fields of a schema), its tokens are a draft that is right unless the model prefers
  another tokenization of the same text. A *forced round* verifies that draft in one
  target call, exactly as a speculative round verifies any draft (same verification
  code, so greedy output and seeded and sampled distributions are unchanged), and the
  strategy carries on after it. These rounds do not depend on the draft-length policy
  and are not counted as the drafters' drafts: the policy learns from its drafters only.
* **The end.** Once the grammar is complete, end-of-generation is committed without a
  target call.

The inner strategy runs from the committed context until a forced run appears, then is
closed and started again after the forced round: both strategies keep the cache holding
every committed token but the last between commits, so a restart costs no call.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator, Sequence

from tandem.kernels.sampling import Sampler
from tandem.runtime.backends.protocol import Backend, common_prefix_len
from tandem.runtime.constrained.drafter import GrammarDrafter, cut
from tandem.runtime.constrained.grammar import Grammar
from tandem.runtime.constrained.state import GrammarState
from tandem.runtime.constrained.target import MaskedTarget
from tandem.runtime.generate import Commit, DecodeStats, Strategy
from tandem.runtime.speculative.drafters.base import Draft, Drafter
from tandem.runtime.speculative.drafters.chain import ChainDrafter
from tandem.runtime.speculative.factory import SpeculativeStrategy
from tandem.runtime.speculative.loop import draft_sources, speculative, verify_logits, verify_round


def _cache_all_but_last(target: Backend, context: Sequence[int]) -> None:
    """Bring the cache to ``context[:-1]`` (the strategies' state between commits)."""
    reuse = common_prefix_len(target.tokens, context[:-1])
    target.truncate(reuse)
    if len(context) - 1 > reuse:
        target.evaluate(list(context[reuse:-1]))


def forced_round(target: Backend, context: list[int], run: list[int], sampler: Sampler,
                 stats: DecodeStats) -> Commit:
    """Verify the forced ``run`` after ``context`` in one call; commit what holds and the
    token after it. The cache holds ``context[:-1]`` before and the new context but its
    last token after."""
    _cache_all_but_last(target, context)
    draft = Draft(list(run), None, "grammar")
    logits = verify_logits(target, context, draft, sampler)
    verdict = verify_round(logits, cut(draft, len(logits) - 1), context, sampler, target.n_vocab)
    target.truncate(len(context) + verdict.accepted)
    stats.target_calls += 1
    stats.forced_tokens += verdict.accepted
    return Commit([*run[: verdict.accepted], verdict.token], verdict.accepted, logits[: verdict.accepted + 1])


def grammar_drafts(strategy: Strategy, grammar: Grammar, prompt_len: int) -> tuple[Strategy, Drafter | None]:
    """``strategy`` with each of its draft sources cut to legal drafts, and its drafter
    (a plain strategy as it is, and ``None``)."""
    if not isinstance(strategy, SpeculativeStrategy) or strategy.drafter is None or strategy.policy is None:
        return strategy, None
    sources: list[Drafter] = [GrammarDrafter(d, grammar, prompt_len) for d in draft_sources(strategy.drafter)]
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
        inner, drafter = grammar_drafts(strategy, grammar, len(prompt))
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
            run_ahead = committed.forced()[: left - 1] if forced_rounds else []
            if run_ahead and len(context) + len(run_ahead) < target.n_ctx:
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
