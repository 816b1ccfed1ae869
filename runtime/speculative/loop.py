"""Speculative decoding as a :mod:`tandem.runtime.generate` strategy: the draft-verify loop.

One round (:func:`speculative_round`): the drafter proposes up to k tokens, the target
verifies them in **one** ``evaluate`` over ``[last committed token] + draft`` asking
logits for every row, the acceptance kernel (:mod:`tandem.kernels.acceptance`) keeps a
prefix and emits one token, and both KV caches are rolled back to the committed
sequence. Around it, and kept out of it: where drafts come from, pre-drafting included
(:mod:`.drafting`), padding a draft so the policy can time a call size (:mod:`.timing`),
and counting the round into the stats and the policy (:mod:`.observer`).

Invariant between rounds: the target cache holds every committed token but the last,
whose logits the next round's verify call produces anyway. That makes plain decoding
(k = 0) the same one-token call as :func:`~tandem.runtime.generate.autoregressive`, and
a round with k drafted tokens one call over k+1 tokens (the c(k) of
:mod:`tandem.runtime.speculative.cost`).

Front ends never call :func:`speculative` directly: the factory
(:func:`tandem.runtime.speculative.factory.build_strategy`) wires drafters and a length
policy into it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from tandem.errors import TandemError
from tandem.kernels.acceptance import Verdict, verify_greedy, verify_sampled
from tandem.kernels.sampling import Sampler
from tandem.runtime.backends.protocol import Backend, common_prefix_len
from tandem.runtime.generate import Commit, DecodeStats
from tandem.runtime.speculative.drafters.base import Draft, Drafter
from tandem.runtime.speculative.drafting import PreDrafting, Reply, SourceDrafting
from tandem.runtime.speculative.observer import Round, RoundObserver, RoundStats
from tandem.runtime.speculative.policy.base import LengthPolicy
from tandem.runtime.speculative.timing import for_timing

RoundHook = Callable[[Backend, Drafter, list[int]], None]
"""Called after every round with (target, drafter, committed context): a test hook."""


def _prefill_all_but_last(target: Backend, prompt: Sequence[int]) -> None:
    """Cache ``prompt[:-1]`` (reusing the cached prefix); the last token goes with round 1."""
    reuse = common_prefix_len(target.tokens, prompt[:-1])
    target.truncate(reuse)
    if len(prompt) - 1 > reuse:
        target.evaluate(list(prompt[reuse:-1]))


def _history(context: list[int], draft: Sequence[int], i: int, sampler: Sampler) -> Sequence[int]:
    """What the sampler sees before position ``i`` (only the penalty reads it)."""
    if not sampler.params.penalized:
        return ()
    return context + list(draft[:i])


def _align_q(q: np.ndarray | None, n_vocab: int) -> np.ndarray | None:
    """Pad a drafter's q to the target vocabulary (extra target ids get q = 0)."""
    if q is None or q.shape[1] == n_vocab:
        return q
    if q.shape[1] > n_vocab:
        if np.any(q[:, n_vocab:] > 0):
            raise TandemError("The drafter proposes token ids the target does not have.")
        return q[:, :n_vocab]
    return np.pad(q, ((0, 0), (0, n_vocab - q.shape[1])))


def verify_round(
    logits: np.ndarray, draft: Draft, context: list[int], sampler: Sampler, n_vocab: int
) -> Verdict:
    """Target logits rows (``len(draft)+1``) + the draft -> accepted count and next token."""
    tokens = draft.tokens
    if sampler.greedy or sampler.keyed:
        # Seeded sampling draws each position's token as plain decoding would (keyed by
        # position) and accepts while the draft agrees: the text repeats whatever drafting does.
        choices: list[int] = []
        for i in range(len(tokens) + 1):  # lazily, up to the first mismatch
            choices.append(sampler.sample_at(logits[i], len(context) + i, _history(context, tokens, i, sampler)))
            if i < len(tokens) and choices[i] != tokens[i]:
                break
        return verify_greedy(tokens, choices)
    p = np.stack([sampler.distribution(logits[i], _history(context, tokens, i, sampler)) for i in range(len(tokens) + 1)])
    return verify_sampled(tokens, p, _align_q(draft.q, n_vocab), sampler.rng)


def verify_logits(target: Backend, context: list[int], draft: Draft, sampler: Sampler) -> np.ndarray:
    """Target logits for ``[context[-1], *draft]``, one row per position, as one call —
    or, when the target computes long batches differently from one-token steps, as calls
    of at most ``target.exact_batch`` tokens, stopping (greedy) at the chunk where the
    target first disagrees with the draft: rows past that point would never be read."""
    feed = [context[-1], *draft.tokens]
    step = target.exact_batch or len(feed)
    rows: list[np.ndarray] = []
    for start in range(0, len(feed), step):
        chunk = feed[start:start + step]
        logits = target.evaluate(chunk, logits_for=range(len(chunk)))
        rows.append(logits)
        if sampler.greedy and start + len(chunk) < len(feed):
            ahead = feed[start + 1:start + len(chunk) + 1]  # the draft tokens these rows predict
            if any(sampler(logits[i], _history(context, draft.tokens, start + i, sampler)) != t
                   for i, t in enumerate(ahead)):
                break
    return rows[0] if len(rows) == 1 else np.concatenate(rows)




def speculative_round(target: Backend, drafting: SourceDrafting, policy: LengthPolicy, context: list[int],
                      horizon: int, sampler: Sampler) -> Round:
    """One round of speculation; ``context`` (the committed tokens) grows by what it commits.

    With drafts x_1..x_k ~ q and the target's p_i = p(. | context, x_<i), x_i is kept
    while u_i < p_i(x_i) / q_i(x_i) (greedy: while x_i = argmax p_i); the first
    rejected position emits a token from norm(max(0, p_i - q_i)) (greedy: argmax p_i),
    and a round that keeps all k emits one from p_{k+1}. So every round commits at least
    one token, and the output is distributed exactly as the target's own."""
    start = time.perf_counter()
    # Draft: k tokens at most, as many as the policy wants and the horizon leaves room for.
    k = max(0, min(policy.next_length(), horizon - len(context)))
    proposal = drafting.draft(context, k)
    draft, timing = for_timing(policy, proposal, k, context)  # maybe padded: a call size to time
    drafted_at = time.perf_counter()
    drafting.draft_ahead(context, draft, k, horizon)  # pre-drafting starts the next round now
    # Verify: p_1..p_{k+1} from one call over [context[-1], x_1..x_k] (chunked at exact_batch).
    logits = verify_logits(target, context, draft, sampler)
    verified_at = time.perf_counter()
    # Accept: the longest prefix the rejection rule keeps, plus the one token it emits.
    verdict = verify_round(logits, draft.head(len(logits) - 1), context, sampler, target.n_vocab)
    # Truncate: the target's cache drops the rejected drafts (it holds all but the last token).
    target.truncate(len(context) + verdict.accepted)
    # Commit: the accepted drafts and the emitted token; the drafter rolls back to them.
    tokens = [*draft.tokens[: verdict.accepted], verdict.token]
    context.extend(tokens)
    drafting.commit(context, verdict.accepted, len(draft.tokens))
    times = (start, drafted_at, verified_at, time.perf_counter())
    return Round(len(proposal.tokens), draft, timing, verdict.accepted, tokens, logits, times)


def speculative(drafter: Drafter, policy: LengthPolicy, *, hook: RoundHook | None = None, predraft: bool = False):
    """A strategy drafting with ``drafter``, draft lengths from ``policy``.

    ``predraft`` (PEARL-style, :class:`~tandem.runtime.speculative.drafting.PreDrafting`):
    while the target verifies a round, a background thread already drafts the next one.
    It pays when drafter and target run on different devices (drafter on a GPU, target
    on CPU threads), and only where the acceptance outlook allows
    (``policy.predraft_pays(n)``). The output is the same either way.
    """

    def strategy(target: Backend, prompt: list[int], sampler: Sampler, stats: DecodeStats,
                 budget: int | None = None) -> Iterator[Commit]:
        context = list(prompt)
        # Drafts past what the caller takes would be verified for nothing: a round commits
        # its drafts and one more token, so drafts may fill the context up to the horizon.
        horizon = target.n_ctx if budget is None else min(target.n_ctx, len(prompt) + budget - 1)
        _prefill_all_but_last(target, context)
        drafter.stop_threshold = policy.stop_threshold
        reply = Reply(len(prompt), horizon, budgeted=budget is not None)
        drafting = (PreDrafting if predraft else SourceDrafting)(drafter, policy, sampler, reply)
        observe: RoundObserver = RoundStats(stats, policy, drafter, drafting)
        try:
            while len(context) <= target.n_ctx:
                done = speculative_round(target, drafting, policy, context, horizon, sampler)
                observe(done)
                if hook is not None and drafting.settled:
                    hook(target, drafter, context)
                yield Commit(done.tokens, done.accepted, done.logits[: done.accepted + 1])
        finally:
            drafting.close()

    return strategy
