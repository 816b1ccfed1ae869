"""What runs on a model's worker threads for each kind of request.

Each job is a generator function of the cancel event and the lane (parallel slot) the
worker gave it; everything it yields is passed to the request's handler on the event
loop. Jobs take the lane's lock, so nothing else races them for its KV cache, and under
it they follow :mod:`.cache_owner`'s rule: a cached prompt prefix is reused only for the
client that left it there.
"""

from __future__ import annotations

import threading
from collections.abc import Generator, Iterator
from dataclasses import dataclass, replace

from tandem.app.server import cache_owner
from tandem.app.server.loaded_models import Lane, ModelSlot
from tandem.app.server.openai import GenRequest, PredictionUse
from tandem.kernels.sampling import Sampler
from tandem.models.chat_template import TemplateInputs
from tandem.runtime.autocomplete import fim
from tandem.runtime.autocomplete.superposed import SuperposedResult
from tandem.runtime.backends.protocol import Backend
from tandem.runtime.chat_fit import FitCancelled
from tandem.runtime.constrained.strategy import constrained
from tandem.runtime.generate import DoneEvent, Event, generate
from tandem.runtime.speculative.drafters.prediction import Prediction
from tandem.runtime.speculative.factory import SpeculativeStrategy


@dataclass
class Drafts:
    """n choices: superposed drafts (greedy requests) or n sampled sequences, cut at stop strings."""

    texts: list[tuple[str, str]]
    """(text, finish reason) per choice (superposed: best first)."""
    prompt_tokens: int
    completion_tokens: int
    result: SuperposedResult | None = None
    """The superposed decode, when the choices came from one."""


@dataclass
class JobUsage:
    """What a generation job reports for the reply's ``usage``, written on the worker
    thread: the prompt tokens whose KV it reused (before its first item), and what the
    reply used of the request's prediction (before its last)."""

    cached_tokens: int = 0
    prediction: PredictionUse | None = None


def chat_job(slot: ModelSlot, messages: list[dict[str, str]], req: GenRequest, client: str = "",
             used: JobUsage | None = None):
    def run(cancel: threading.Event, lane: Lane) -> Generator[Event, None, None]:
        with lane.lock, lane.engaged():
            try:
                ids, stops = slot.engine.fit(messages, req.reply_room, cancel=cancel,
                                             inputs=TemplateInputs(variables=req.template_variables))
            except FitCancelled:  # the client went away (or the server stops): nothing to send
                return
            yield from generate_events(lane, ids, req, [*stops, *req.stop], cancel, client, used)

    return run


def completion_job(slot: ModelSlot, ids: list[int], req: GenRequest, client: str = "",
                   used: JobUsage | None = None):
    def run(cancel: threading.Event, lane: Lane) -> Generator[Event, None, None]:
        with lane.lock, lane.engaged():
            yield from generate_events(lane, ids, req, list(req.stop), cancel, client, used)

    return run


def generate_events(lane: Lane, ids: list[int], req: GenRequest, stops: list[str], cancel: threading.Event,
                    client: str, used: JobUsage | None) -> Iterator[Event]:
    """The engine's generation (same strategy, same sampler) on a cache that holds only
    ``client``'s own text; the caller holds the lane's lock."""
    cached = cache_owner.take(lane, client, ids)
    if used is not None:
        used.cached_tokens = cached
    try:
        prediction = predicted(lane.target, req.prediction, len(ids))
        strategy = lane.strategy
        if prediction is not None and isinstance(strategy, SpeculativeStrategy):
            strategy = strategy.predicting(prediction, len(ids))
        if req.grammar is not None:
            strategy = constrained(strategy, req.grammar)
        for ev in generate(lane.target, ids, Sampler(req.params), strategy=strategy,
                           max_tokens=req.max_tokens, stop=stops, cancel=cancel, logprobs=req.logprobs,
                           stop_at_eog=not req.ignore_eos):
            if isinstance(ev, DoneEvent) and prediction is not None and used is not None:
                appeared = prediction.appeared(ev.tokens)
                used.prediction = PredictionUse(appeared, prediction.size - appeared)
            yield ev
    finally:
        cache_owner.release(lane, client)


def predicted(target: Backend, text: str | None, prompt_len: int) -> Prediction | None:
    """A request's prediction in the target's tokens, as far as the reply can reach (the
    context left after the prompt): what lies beyond can never be drafted, and indexing
    it would only cost memory."""
    if not text:
        return None
    tokens = target.tokenize(text)
    return Prediction(tokens[: max(0, target.n_ctx - prompt_len)], size=len(tokens))


def _cut(text: str, stops: list[str]) -> tuple[str, bool]:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


def drafts_job(slot: ModelSlot, req: GenRequest, *, ids: list[int] | None = None,
               messages: list[dict[str, str]] | None = None, client: str = ""):
    """n > 1. At temperature 0 the n choices are the n superposed drafts (one forward pass
    per step for all of them); at a temperature above 0 they are n sequences sampled with
    the request's settings, the i-th seeded with ``seed + i`` when a seed is given, so
    temperature and seed mean what they mean for n = 1."""

    def run(cancel: threading.Event, lane: Lane) -> Generator[Drafts, None, None]:
        with lane.lock, lane.engaged():
            stops = list(req.stop)
            prompt = ids
            if messages is not None:
                try:
                    prompt, template_stops = slot.engine.fit(messages, req.reply_room, cancel=cancel,
                                                             inputs=TemplateInputs(variables=req.template_variables))
                except FitCancelled:
                    return
                stops += template_stops
            assert prompt is not None
            cache_owner.take(lane, client, prompt)
            try:
                if not req.params.greedy:
                    yield _sampled_drafts(lane, prompt, req, stops, cancel)
                    return
                result = lane.autocompleter.decoder.decode(prompt, req.n, req.max_tokens, cancel=cancel)
            finally:
                cache_owner.release(lane, client)
        texts = []
        for d in result.drafts:
            text, stopped = _cut(d.text, stops)
            texts.append((text, "stop" if (stopped or d.finished) else "length"))
        yield Drafts(texts, len(prompt), sum(len(d.tokens) for d in result.drafts), result)

    return run


def _sampled_drafts(lane: Lane, prompt: list[int], req: GenRequest, stops: list[str],
                    cancel: threading.Event) -> Drafts:
    """n independent samples, one after another (each reuses the prompt's KV)."""
    texts, n_tokens = [], 0
    for i in range(req.n):
        seed = None if req.params.seed is None else req.params.seed + i
        done = None
        for ev in generate(lane.target, prompt, Sampler(replace(req.params, seed=seed)), strategy=lane.strategy,
                           max_tokens=req.max_tokens, stop=stops, cancel=cancel):
            if isinstance(ev, DoneEvent):
                done = ev
        assert done is not None
        texts.append((done.text, "length" if done.stats.finish_reason == "length" else "stop"))
        n_tokens += len(done.tokens)
        if cancel.is_set():
            break
    return Drafts(texts, len(prompt), n_tokens)


def infill_prompt(slot: ModelSlot, prefix: str, suffix: str) -> list[int]:
    """A FIM prompt for /v1/completions with a ``suffix`` (in the model's own FIM format)."""

    target = slot.target
    budget = fim.FimBudget(n_ctx=target.n_ctx, n_batch=min(512, target.n_ctx // 2))
    return fim.infill_prompt(target, fim.InfillText(prefix, suffix), budget).tokens
