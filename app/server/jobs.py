"""What runs on a model's worker thread for each kind of request.

Each job is a generator function of the cancel event; everything it yields is passed
to the request's handler on the event loop. Jobs take the chat engine's lock, so the
server never races the TUI (or anything else) for the one KV cache.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass

from tandem.app.server.models import ModelSlot
from tandem.app.server.openai import GenRequest
from tandem.runtime.generate import Event
from tandem.runtime.superposed import SuperposedResult


@dataclass
class Drafts:
    """n drafts from one superposed decode, cut at stop strings."""

    texts: list[tuple[str, str]]
    """(text, finish reason) per draft, best first."""
    prompt_tokens: int
    completion_tokens: int
    result: SuperposedResult


def chat_job(slot: ModelSlot, messages: list[dict[str, str]], req: GenRequest):
    def run(cancel: threading.Event) -> Iterator[Event]:
        yield from slot.engine.stream(messages, req.params, req.max_tokens, req.stop, cancel)

    return run


def completion_job(slot: ModelSlot, ids: list[int], req: GenRequest):
    def run(cancel: threading.Event) -> Iterator[Event]:
        yield from slot.engine.complete(ids, req.params, req.max_tokens, req.stop, cancel)

    return run


def _cut(text: str, stops: list[str]) -> tuple[str, bool]:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


def drafts_job(slot: ModelSlot, req: GenRequest, *, ids: list[int] | None = None,
               messages: list[dict[str, str]] | None = None):
    """n > 1: the n choices are the n superposed drafts (one forward pass per step)."""

    def run(cancel: threading.Event) -> Iterator[Drafts]:
        auto = slot.autocompleter
        with slot.engine.lock:
            stops = list(req.stop)
            prompt = ids
            if messages is not None:
                prompt, template_stops = slot.engine.fit(messages, req.max_tokens)
                stops += template_stops
            assert prompt is not None
            result = auto.decoder.decode(prompt, req.n, req.max_tokens, cancel=cancel)
        texts = []
        for d in result.drafts:
            text, stopped = _cut(d.text, stops)
            texts.append((text, "stop" if (stopped or d.finished) else "length"))
        yield Drafts(texts, len(prompt), sum(len(d.tokens) for d in result.drafts), result)

    return run


def infill_prompt(slot: ModelSlot, prefix: str, suffix: str, extra: list[tuple[str, str]]) -> list[int]:
    """llama.cpp-style infill: extra context chunks (files) go before the prefix."""
    from tandem.runtime.autocomplete import build_fim_prompt

    context = "".join(f"--- {name}\n{text}\n" if name else text for name, text in extra)
    return build_fim_prompt(slot.target, context + prefix, suffix, n_prefix_tokens=max(256, slot.target.n_ctx // 2),
                            n_suffix_tokens=min(256, slot.target.n_ctx // 8))
