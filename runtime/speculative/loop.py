"""Speculative decoding as a :mod:`tandem.runtime.generate` strategy: the draft-verify loop.

One round: the drafter proposes up to k tokens, the target verifies them in **one**
``evaluate`` over ``[last committed token] + draft`` asking logits for every row, the
acceptance kernel (:mod:`tandem.kernels.acceptance`) keeps a prefix and emits one
token, and both KV caches are rolled back to the committed sequence.

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
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from tandem.kernels.acceptance import Verdict, verify_greedy, verify_sampled
from tandem.kernels.sampling import Sampler
from tandem.models.errors import TandemError
from tandem.runtime.backends.protocol import Backend, common_prefix_len
from tandem.runtime.generate import Commit, DecodeStats
from tandem.runtime.speculative.drafters.base import Draft, Drafter
from tandem.runtime.speculative.drafters.chain import ChainDrafter
from tandem.runtime.speculative.policy import (
    LengthPolicy,
)

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
    if sampler.params.repetition_penalty == 1.0:
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


def draft_sources(drafter: Drafter) -> list[Drafter]:
    """The drafters a chain asks in turn (nested chains flattened), or just ``drafter``."""
    if isinstance(drafter, ChainDrafter):
        return [d for inner in drafter.drafters for d in draft_sources(inner)]
    return [drafter]


def draft_round(sources: Sequence[Drafter], policy: LengthPolicy, context: list[int], k: int,
                sampler: Sampler) -> Draft:
    """This round's draft: ask the sources in order (model-free ones first) for what the
    policy allots each out of ``k`` (its :meth:`~LengthPolicy.next_length`, capped by the
    room left), and take the first draft the policy keeps any of (it may keep a prefix).
    An empty draft makes a plain round."""
    for source in sources:
        n = policy.length_for(source.name, k)
        if n <= 0:
            continue
        draft = source.propose(context, n, sampler)
        if draft.tokens:
            keep = policy.trim(draft.confidence, len(draft.tokens), draft.source or source.name)
            if keep:
                return _cut(draft, keep)
    return Draft([], None, "")


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


def _cut(draft: Draft, n: int) -> Draft:
    """The first ``n`` tokens of a draft, with their q rows and confidences."""
    if len(draft.tokens) <= n:
        return draft
    return Draft(draft.tokens[:n], None if draft.q is None else draft.q[:n], draft.source,
                 None if draft.confidence is None else draft.confidence[:n])


def _padded(draft: Draft, size: int, filler: int) -> Draft:
    """``draft`` padded with ``filler`` to ``size`` tokens, so its verify call has a size
    the policy wants timed. Padding is verified like any draft token (a one-hot proposal
    in sampled verification), so the output is the same as without it."""
    pad = size - len(draft.tokens)
    if pad <= 0:
        return draft
    q = draft.q
    if q is not None:
        one_hot = np.zeros((pad, q.shape[1]), dtype=q.dtype)
        one_hot[:, filler] = 1.0
        q = np.concatenate([q, one_hot])
    confidence = None if draft.confidence is None else [*draft.confidence, *[0.0] * pad]
    return Draft([*draft.tokens, *[filler] * pad], q, draft.source or "timing", confidence, draft.catch_up_s)


def _predraft(drafter: Drafter, assumed: list[int], k: int, sampler: Sampler) -> tuple[list[int], Draft]:
    """Draft a guess of the bonus token plus ``k`` after ``assumed`` (all drafts accepted);
    return (the context that draft presumes, the draft after the guess)."""
    d = drafter.propose(assumed, k + 1, sampler)
    if not d.tokens:
        return assumed, d
    rest = Draft(d.tokens[1:], None if d.q is None else d.q[1:], d.source,
                 None if d.confidence is None else d.confidence[1:])
    return [*assumed, d.tokens[0]], rest


def speculative(drafter: Drafter, policy: LengthPolicy, *, hook: RoundHook | None = None, predraft: bool = False):
    """A strategy drafting with ``drafter``, draft lengths from ``policy``.

    ``predraft`` (PEARL-style): while the target verifies a round, a background thread
    already drafts the next one, assuming every draft is accepted and guessing the bonus
    token; the next round uses it when that guess came true and drops it otherwise. It
    pays when drafter and target run on different devices (drafter on a GPU, target on
    CPU threads), and only where the acceptance outlook allows: each round asks
    ``policy.predraft_pays(n)``. The output is the same either way.
    """

    def strategy(target: Backend, prompt: list[int], sampler: Sampler, stats: DecodeStats,
                 budget: int | None = None) -> Iterator[Commit]:
        context = list(prompt)
        horizon = target.n_ctx if budget is None else min(target.n_ctx, len(prompt) + budget - 1)
        """The context length a round's drafts may fill: a round commits its drafts and one more
        token, and drafts past what the caller takes would be verified for nothing."""
        sources = draft_sources(drafter)
        _prefill_all_but_last(target, context)
        drafter.stop_threshold = policy.stop_threshold
        calls0 = drafter.calls
        extra = stats.extra
        for key in ("draft_s", "verify_s", "round_s", "rounds_speculative", "predraft_hits", "predraft_misses"):
            extra.setdefault(key, 0.0)
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-predraft") if predraft else None
        pending: Future | None = None
        caught_up = False
        owed: tuple[list[int], int] | None = None
        """A round whose ``drafter.commit`` waits until the background draft is done."""
        try:
            while len(context) <= target.n_ctx:
                start = time.perf_counter()
                k = max(0, min(policy.next_length(), horizon - len(context)))
                draft = None
                if pending is not None:
                    assumed, ready = pending.result()
                    pending = None
                    if owed is not None:
                        drafter.commit(*owed)
                        owed = None
                    if assumed == context and ready.tokens and k > 0:
                        draft = _cut(ready, k)
                        extra["predraft_hits"] += 1
                    else:
                        extra["predraft_misses"] += 1
                if draft is None:
                    draft = draft_round(sources, policy, context, k, sampler)
                drafted = len(draft.tokens)  # the drafters' own; padding may follow
                timing = min(policy.timing_length(), k)
                draft = _padded(draft, timing, (draft.tokens or context)[-1])
                source = draft.source or drafter.name
                drafted_at = time.perf_counter()
                n = len(draft.tokens)
                room = horizon - len(context) - n - 1  # the next round's k if all n are accepted
                if pool is not None and n and room > 0 and policy.predraft_pays(n):
                    pending = pool.submit(_predraft, drafter, [*context, *draft.tokens], min(k, room), sampler)
                logits = verify_logits(target, context, draft, sampler)
                verified_at = time.perf_counter()
                verdict = verify_round(logits, _cut(draft, len(logits) - 1), context, sampler, target.n_vocab)
                accepted = draft.tokens[: verdict.accepted]
                target.truncate(len(context) + verdict.accepted)
                context.extend(accepted)
                context.append(verdict.token)
                if pending is not None and verdict.accepted < n:
                    pending.result()  # presumed drafts that were rejected: unusable
                    pending = None
                    extra["predraft_misses"] += 1
                if pending is None:
                    drafter.commit(context, verdict.accepted)  # also on k = 0: caches stay in sync
                else:
                    owed = (list(context), verdict.accepted)
                end = time.perf_counter()
                stats.target_calls += 1
                stats.rounds += 1
                stats.drafted_tokens += n
                stats.accepted_tokens += verdict.accepted
                stats.draft_calls = drafter.calls - calls0
                extra["draft_s"] += drafted_at - start
                extra["verify_s"] += verified_at - drafted_at
                extra["round_s"] += end - start
                if n:
                    extra["rounds_speculative"] += 1
                    extra[f"drafted:{source}"] = extra.get(f"drafted:{source}", 0.0) + n
                    extra[f"accepted:{source}"] = extra.get(f"accepted:{source}", 0.0) + verdict.accepted
                policy.observe(drafted, min(verdict.accepted, drafted), drafted_at - start - draft.catch_up_s,
                               verified_at - drafted_at, end - start - draft.catch_up_s, source,
                               timed=caught_up or drafted == 0 or timing > 0, evaluated=len(logits))
                caught_up = caught_up or drafted > 0  # the first drafting round also paid the catch-up
                if hook is not None and pending is None:
                    hook(target, drafter, context)
                yield Commit([*accepted, verdict.token], verdict.accepted, logits[: verdict.accepted + 1])
        finally:
            if pending is not None:
                pending.result()
            if owed is not None:
                drafter.commit(*owed)
            if pool is not None:
                pool.shutdown(wait=True)

    return strategy
