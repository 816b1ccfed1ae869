"""Generation as a generator of events, with strategies written once against `Backend`.

A *strategy* turns (target, prompt, sampler) into a stream of :class:`Commit` s — the
tokens it has decided on, one for plain decoding, several per round for speculative
decoding. :func:`generate` wraps any strategy with what every caller needs: limits,
stop strings and end-of-generation tokens, UTF-8-safe text, timing and stats, and a
KV cache left holding exactly prompt + output.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Generator, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol

import numpy as np

from tandem.errors import EmptyPrompt, PromptError
from tandem.kernels.sampling import Sampler
from tandem.runtime.backends.protocol import Backend, common_prefix_len, prefill
from tandem.runtime.logprobs import TokenLogprob, token_logprobs
from tandem.runtime.streaming_text import Detokenizer, StopMatcher


@dataclass
class Commit:
    """Tokens a strategy has decided on; the first ``drafted`` came from a drafter."""

    tokens: list[int]
    drafted: int = 0
    logits: np.ndarray | None = None
    """The target's logits rows that decided ``tokens`` (row i: token i), for logprobs;
    only read before the strategy runs again, so a backend's buffer may be passed."""


@dataclass
class DecodeStats:
    """Counters a strategy updates while it runs."""

    target_calls: int = 0
    draft_calls: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    rounds: int = 0
    forced_tokens: int = 0
    """Tokens a grammar forced, verified in forced rounds (not counted as drafted)."""
    timing_tokens: int = 0
    """Of ``drafted_tokens``, the padding verified to time a call size (a new target's
    first rounds, :mod:`tandem.runtime.speculative.timing`): no drafter proposed them."""
    extra: dict[str, float] = field(default_factory=dict)


class Strategy(Protocol):
    def __call__(
        self, target: Backend, prompt: list[int], sampler: Sampler, stats: DecodeStats, budget: int | None = None
    ) -> Iterator[Commit]:
        """Commits after ``prompt``. ``budget``: the tokens the caller will take at most
        (``None``: no limit); a strategy that computes ahead need not compute past them."""
        ...


def autoregressive(
    target: Backend, prompt: list[int], sampler: Sampler, stats: DecodeStats, budget: int | None = None
) -> Iterator[Commit]:
    """Plain decoding: one target call per token (never past ``budget``, since the caller
    stops asking)."""
    logits = prefill(target, prompt)
    stats.target_calls += 1
    history = list(prompt)
    n_ctx = target.n_ctx
    while True:
        token = sampler.sample_at(logits, len(history), history)  # seeded: keyed by position
        history.append(token)
        yield Commit([token], logits=logits[None])
        if len(history) > n_ctx:  # the cache holds history[:-1]; one more must fit
            return
        logits = target.evaluate((token,))[0]
        stats.target_calls += 1


@dataclass
class GenerationStats:
    prompt_tokens: int
    generated_tokens: int
    ttft_s: float
    total_s: float
    tokens_per_s: float
    """Decode speed: tokens after the first over the time after the first."""
    target_calls: int
    tokens_per_call: float
    drafted_tokens: int
    accepted_tokens: int
    acceptance_rate: float | None
    finish_reason: str
    memory_bytes: int
    forced_tokens: int = 0
    """Tokens a grammar forced and the target confirmed outside its drafters' drafts."""
    timing_tokens: int = 0
    """Of ``drafted_tokens``, padding verified to time the target's verify calls (a new
    model's first runs), not proposed by any drafter."""
    stop_string: str = ""
    """The stop string that ended the reply (``finish_reason`` "stop"); empty otherwise."""

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class TokenEvent:
    text: str
    tokens: list[int]
    drafted: int = 0
    logprobs: list[TokenLogprob] | None = None
    """With ``generate(logprobs=N)``: one per token, from the target's logits."""


@dataclass
class DoneEvent:
    text: str
    tokens: list[int]
    stats: GenerationStats


Event = TokenEvent | DoneEvent


NO_LIMIT = 1 << 20
"""A token limit that is none: a reply then runs until the model ends it or the context is
full (:func:`generate` caps every limit at the context's room)."""


def check_prompt(target: Backend, prompt: Sequence[int]) -> None:
    if not prompt:
        raise EmptyPrompt("The prompt is empty: give some text to continue.")
    if len(prompt) >= target.n_ctx:
        raise PromptError(
            f"The prompt is {len(prompt)} tokens but the context holds {target.n_ctx}: "
            "shorten it or raise the context size (--ctx)."
        )


def run_strategy(strategy: Strategy, target: Backend, prompt: list[int], sampler: Sampler, stats: DecodeStats,
                 max_tokens: int) -> Generator[Commit, None, None]:
    """The strategy's commits as a generator (nothing runs when no token is wanted), so
    :func:`generate` can always close it: closing ends a strategy that is itself a
    generator at once (its cleanup runs now, not at garbage collection)."""
    if max_tokens:
        yield from strategy(target, prompt, sampler, stats, max_tokens)


def generate(
    target: Backend,
    prompt: Sequence[int],
    sampler: Sampler,
    *,
    strategy: Strategy = autoregressive,
    max_tokens: int = 256,
    stop: Sequence[str] = (),
    stop_at_eog: bool = True,
    cancel: threading.Event | None = None,
    logprobs: int | None = None,
) -> Iterator[Event]:
    """Stream a reply. Yields :class:`TokenEvent` s, then exactly one :class:`DoneEvent`.

    ``logprobs`` (the number of alternatives, 0 for none) adds each token's target
    log-probability to its event (:mod:`tandem.runtime.logprobs`).

    Setting ``cancel`` stops after the current step with ``finish_reason="cancelled"``;
    what was generated so far is still reported and left in the cache.
    """
    check_prompt(target, prompt)
    prompt = list(prompt)
    max_tokens = max(0, min(max_tokens, target.n_ctx - len(prompt)))
    stats = DecodeStats()
    detok = Detokenizer(target.token_bytes)
    stopper = StopMatcher(stop)
    eog = target.special.eog if stop_at_eog else frozenset()
    out_tokens: list[int] = []
    out_text: list[str] = []
    finish = "length"
    start = time.perf_counter()
    first_at: float | None = None
    eog_decided = False  # an end-of-generation token is not output, but a target call decided it
    commits = run_strategy(strategy, target, prompt, sampler, stats, max_tokens)
    try:
        for commit in commits:
            tokens = commit.tokens[: max_tokens - len(out_tokens)]
            hit_eog = next((i for i, t in enumerate(tokens) if t in eog), None)
            if hit_eog is not None:
                tokens = tokens[:hit_eog]
            if first_at is None:
                first_at = time.perf_counter()
            out_tokens.extend(tokens)
            text, hit_stop = stopper.feed(detok.add(tokens))
            if text or tokens:
                out_text.append(text)
                lps = (token_logprobs(commit.logits, tokens, logprobs)
                       if logprobs is not None and commit.logits is not None else None)
                yield TokenEvent(text, tokens, min(commit.drafted, len(tokens)), lps)
            if hit_eog is not None or hit_stop:
                finish = "stop"
                eog_decided = hit_eog is not None
                break
            if len(out_tokens) >= max_tokens:
                break
            if cancel is not None and cancel.is_set():
                finish = "cancelled"
                break
    finally:
        commits.close()
        # Leave the cache holding prompt + output, nothing a strategy evaluated beyond.
        target.truncate(common_prefix_len(target.tokens, prompt + out_tokens))
    if finish != "stop":
        tail = stopper.feed(detok.flush())[0] + stopper.flush()
        if tail:
            out_text.append(tail)
            yield TokenEvent(tail, [], 0)
    end = time.perf_counter()
    first_at = first_at or end
    n = len(out_tokens)
    decode_s = end - first_at
    stats_out = GenerationStats(
        prompt_tokens=len(prompt),
        generated_tokens=n,
        ttft_s=first_at - start,
        total_s=end - start,
        tokens_per_s=(n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0,
        target_calls=stats.target_calls,
        tokens_per_call=(n + int(eog_decided)) / stats.target_calls if stats.target_calls else 0.0,
        drafted_tokens=stats.drafted_tokens,
        accepted_tokens=stats.accepted_tokens,
        acceptance_rate=(stats.accepted_tokens / stats.drafted_tokens) if stats.drafted_tokens else None,
        finish_reason=finish,
        memory_bytes=target.memory().total,
        forced_tokens=stats.forced_tokens,
        timing_tokens=stats.timing_tokens,
        stop_string=stopper.hit,
    )
    yield DoneEvent("".join(out_text), out_tokens, stats_out)
