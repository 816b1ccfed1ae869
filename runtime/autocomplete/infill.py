"""One editor completion (llama-server's ``/infill`` semantics) on a model's single KV cache.

What an editor needs beyond :func:`~tandem.runtime.generate.generate`:

* **prompt reuse**: the KV cache keeps the previous request's tokens; only the tokens
  after the longest common prefix are evaluated (``cache_prompt``), and, with
  ``cache_reuse``, cached runs that moved (llama.vim's ring of extra chunks rotates, so
  the prompt changes near its start) are shifted into place instead of recomputed; a
  request with ``n_predict == 0`` only fills the cache (llama.vim's warm-up requests);
* **limits that fit ghost text** (:class:`TextCutter`): ``n_indent`` ends the
  suggestion at the first later line indented less than the cursor line (the block
  ended), ``t_max_predict_ms`` ends it at the first line end after the time is up, and
  stop strings end it where they start;
* **timings split into prompt and prediction**, and why it stopped (``stop_type``:
  ``eos``, ``word``, ``limit``), which llama.vim shows.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from tandem.kernels.sampling import Sampler
from tandem.runtime.backends.protocol import Backend, common_prefix_len
from tandem.runtime.generate import (
    DoneEvent,
    Strategy,
    TokenEvent,
    autoregressive,
    check_prompt,
    generate,
)
from tandem.runtime.streaming_text import StopMatcher


@dataclass(frozen=True)
class InfillLimits:
    n_predict: int = 128
    n_indent: int = 0
    """Stop at a later line indented by fewer columns (0: off)."""
    t_max_predict_ms: float = 0.0
    """After this much generation time, stop at the next line end (0: off)."""
    stop: tuple[str, ...] = ()


class TextCutter:
    """Decides where a streamed suggestion ends. Pure: text and elapsed time in,
    (text to show now, stop type or None) out; :attr:`text` is the whole suggestion."""

    def __init__(self, limits: InfillLimits) -> None:
        self.limits = limits
        self.stopper = StopMatcher(limits.stop)
        self.text = ""
        """The suggestion so far (what a non-streaming reply returns)."""
        self.raw = ""
        """Everything the model wrote, for naming the stop string that was hit."""
        self.stopping_word = ""
        self.shown = 0
        """Characters of :attr:`text` already returned by :meth:`feed`."""

    def _indent_cut(self, whole: str, judged: int) -> int | None:
        """Where the first later line indented less than ``n_indent`` starts, looking at
        lines whose first non-blank character lies at or after ``judged``."""
        n = self.limits.n_indent
        if n <= 0:
            return None
        start = whole.find("\n")  # the first line continues the cursor line: never judged
        while start >= 0:
            line_start = start + 1
            end = whole.find("\n", line_start)
            line = whole[line_start:] if end < 0 else whole[line_start:end]
            body = line.lstrip(" \t")
            indent = len(line) - len(body)
            if body and line_start + indent >= judged and indent < n:
                return line_start
            start = end
        return None

    def feed(self, piece: str, elapsed_ms: float) -> tuple[str, str | None]:
        self.raw += piece
        shown, hit = self.stopper.feed(piece)
        return self._accept(shown, hit, elapsed_ms)

    def _accept(self, shown: str, hit: bool, elapsed_ms: float) -> tuple[str, str | None]:
        before = self.text
        whole = before + shown
        stop = None
        if hit:
            stop = "word"
            self.stopping_word = next((s for s in self.limits.stop if s and self.raw.startswith(s, len(whole))), "")
        cut = self._indent_cut(whole, len(before))
        if cut is not None:
            whole, stop = whole[:cut], "limit"
        t_max = self.limits.t_max_predict_ms
        new = whole[len(before):]
        if stop is None and t_max > 0 and elapsed_ms > t_max and "\n" in new:
            whole, stop = before + new[: new.index("\n") + 1], "limit"
        self.text = whole
        return self._show(len(whole) if stop else self._settled(whole)), stop

    def _settled(self, whole: str) -> int:
        """How much of ``whole`` can be shown: with ``n_indent``, not the indentation of a
        later line whose first character has not come yet (that line may be cut)."""
        nl = whole.rfind("\n")
        if self.limits.n_indent <= 0 or nl < 0 or whole[nl + 1 :].strip(" \t"):
            return len(whole)
        return nl + 1

    def _show(self, upto: int) -> str:
        out = self.text[self.shown : max(upto, self.shown)]
        self.shown = max(upto, self.shown)
        return out

    def flush(self) -> str:
        """The rest, once the generation ended by itself (what the stop matcher or the
        indentation check held back)."""
        held = self.stopper.flush()
        out = self._accept(held, False, 0.0)[0] if held else ""
        return out + self._show(len(self.text))


@dataclass
class LlamaTimings:
    """llama-server's ``timings`` of a reply (``/infill``, ``/completion``): the prompt
    evaluated (``prompt_n`` tokens not found in the cache) up to the first token, then
    the prediction."""

    prompt_n: int
    prompt_ms: float
    predicted_n: int
    predicted_ms: float

    def as_dict(self) -> dict[str, float]:
        """llama-server's ``timings`` object."""
        return {
            "prompt_n": self.prompt_n,
            "prompt_ms": self.prompt_ms,
            "prompt_per_token_ms": self.prompt_ms / self.prompt_n if self.prompt_n else 0.0,
            "prompt_per_second": 1000.0 * self.prompt_n / self.prompt_ms if self.prompt_ms > 0 else 0.0,
            "predicted_n": self.predicted_n,
            "predicted_ms": self.predicted_ms,
            "predicted_per_token_ms": self.predicted_ms / self.predicted_n if self.predicted_n else 0.0,
            "predicted_per_second": 1000.0 * self.predicted_n / self.predicted_ms if self.predicted_ms > 0 else 0.0,
        }


@dataclass
class InfillChunk:
    text: str


@dataclass
class InfillDone:
    content: str
    stop_type: str
    """``eos`` (the model ended it), ``word`` (a stop string), ``limit`` (n_predict,
    n_indent, t_max_predict_ms), ``none`` (cancelled)."""
    tokens_cached: int
    """Prompt tokens whose KV was reused from the previous request."""
    tokens_evaluated: int
    timings: LlamaTimings
    stopping_word: str = ""
    ttft_ms: float = 0.0
    tokens: list[int] = field(default_factory=list)
    target_calls: int = 0
    """Target calls that decided tokens (fewer than the tokens when drafts were accepted)."""
    accepted_drafts: int = 0
    """Tokens that came from a drafter and the target accepted."""


def reusable_spans(cached: Sequence[int], prompt: Sequence[int], min_chunk: int) -> list[tuple[int, int]]:
    """The cached spans (``(start, end)`` in cache positions) that, packed down in order,
    spell the longest prompt prefix this greedy walk finds: the common prefix, then any
    later run of at least ``min_chunk`` cached tokens that continues the prompt where the
    kept spans end. Cached tokens that break the match are skipped one at a time, as
    llama-server's ``--cache-reuse`` does (``min_chunk`` 0: the common prefix only)."""
    head = common_prefix_len(cached, prompt)
    spans = [(0, head)] if head else []
    if min_chunk <= 0:
        return spans
    c = p = head
    while c < len(cached) and p < len(prompt):
        n = 0
        while c + n < len(cached) and p + n < len(prompt) and cached[c + n] == prompt[p + n]:
            n += 1
        if n >= min_chunk:
            spans.append((c, c + n))
            c, p = c + n, p + n
        else:
            c += 1
    return spans


def fill_cache(target: Backend, prompt: Sequence[int], *, reuse: bool = True, keep_last: bool = True,
               min_chunk: int = 0) -> int:
    """Bring the KV cache to ``prompt`` (all but its last token when ``keep_last``),
    evaluating only what is not cached already; returns the reused token count.
    ``min_chunk`` > 0 also reuses later cached runs of that many tokens, moved into place
    (:func:`reusable_spans`, :meth:`Backend.keep_spans`) where the backend can move them."""
    prompt = list(prompt)
    end = len(prompt) - 1 if keep_last else len(prompt)
    cached = 0
    if reuse:
        spans = reusable_spans(target.tokens, prompt, min_chunk)
        cached = common_prefix_len(target.tokens, prompt)
        if len(spans) > 1 and target.keep_spans(spans):
            cached = len(target.tokens)
    cached = min(cached, end)
    target.truncate(cached)
    if end > cached:
        target.evaluate(prompt[cached:end])
    return cached


def run_infill(target: Backend, prompt: Sequence[int], sampler: Sampler, limits: InfillLimits, *,
               strategy: Strategy = autoregressive, cache_prompt: bool = True, cache_reuse: int = 0,
               cancel: threading.Event | None = None) -> Iterator[InfillChunk | InfillDone]:
    """Stream one completion of ``prompt``: :class:`InfillChunk` s, then one :class:`InfillDone`.

    The caller holds the model's lock. The cache is left holding the prompt and what was
    generated (for the next request to reuse). ``cache_reuse`` > 0 also reuses cached runs
    of at least that many tokens found later in the prompt (llama-server's ``--cache-reuse``;
    lossy by float rounding, so off by default).
    """
    prompt = list(prompt)
    check_prompt(target, prompt)
    t0 = time.perf_counter()
    warm_up = limits.n_predict == 0
    cached = fill_cache(target, prompt, reuse=cache_prompt, keep_last=not warm_up, min_chunk=cache_reuse)
    t1 = time.perf_counter()
    prompt_n = len(prompt) - cached
    if warm_up:
        timings = LlamaTimings(prompt_n, (t1 - t0) * 1000, 0, 0.0)
        yield InfillDone("", "limit", cached, len(prompt), timings)
        return
    cutter = TextCutter(limits)
    stop_type, n_tokens, first_ms, calls, accepted = "limit", 0, 0.0, 0, 0
    events = generate(target, prompt, sampler, strategy=strategy, max_tokens=limits.n_predict, cancel=cancel)
    try:
        for ev in events:
            now_ms = (time.perf_counter() - t1) * 1000
            if isinstance(ev, TokenEvent):
                n_tokens += len(ev.tokens)
                calls += bool(ev.tokens)
                accepted += ev.drafted
                if not first_ms and ev.tokens:
                    first_ms = (time.perf_counter() - t0) * 1000
                text, stop = cutter.feed(ev.text, now_ms)
                if text:
                    yield InfillChunk(text)
                if stop is not None:
                    stop_type = stop
                    break
            elif isinstance(ev, DoneEvent):
                reason = ev.stats.finish_reason
                stop_type = {"stop": "eos", "cancelled": "none"}.get(reason, "limit")
                tail = cutter.flush()
                if tail:
                    yield InfillChunk(tail)
    finally:
        events.close()
    t2 = time.perf_counter()
    timings = LlamaTimings(prompt_n, (t1 - t0) * 1000, n_tokens, (t2 - t1) * 1000)
    yield InfillDone(cutter.text, stop_type, cached, len(prompt), timings, cutter.stopping_word,
                     first_ms or (t2 - t0) * 1000, target_calls=calls, accepted_drafts=accepted)
