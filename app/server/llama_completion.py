"""llama-server's native ``/completion``: a prompt in, ``{"content", "stop": true, ...}``
out, streamed as ``{"content", "stop": false}`` events; it takes llama-server's
``grammar`` and ``json_schema`` fields (and ``response_format``) like the OpenAI routes,
and ``n_probs`` (``completion_probabilities``: the target's log-probabilities, as
``logprobs`` on the OpenAI routes).

Only the JSON shapes live here; generation is the OpenAI ``/v1/completions`` job.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from tandem.app.server.jobs import JobUsage
from tandem.app.server.logprobs_api import llama_probabilities
from tandem.app.server.openai import GenRequest
from tandem.app.server.streams import OpenStreams, ReplyStream, StreamConfig, llama_server_stream
from tandem.app.server.worker import Job
from tandem.runtime.autocomplete.infill import LlamaTimings
from tandem.runtime.generate import DoneEvent, GenerationStats, TokenEvent


def stop_type(stats: GenerationStats) -> str:
    """llama-server's ``stop_type``: ``word`` (a stop string), ``eos``, ``limit`` or ``none``."""
    if stats.stop_string:
        return "word"
    return {"length": "limit", "stop": "eos"}.get(stats.finish_reason, "none")


def done_body(done: DoneEvent, req: GenRequest, model: str, cached: int,
              probs: list[dict] | None = None, tokens: list[int] | None = None) -> dict[str, Any]:
    """The whole reply; ``cached``: the prompt tokens found in the cache; ``probs``: its
    ``completion_probabilities`` (``n_probs``); ``tokens``: its ``tokens`` (``return_tokens``)."""
    st = done.stats
    extra: dict[str, Any] = {} if probs is None else {"completion_probabilities": probs}
    if tokens is not None:
        extra["tokens"] = tokens
    timings = LlamaTimings(st.prompt_tokens - cached, st.ttft_s * 1000, st.generated_tokens,
                           (st.total_s - st.ttft_s) * 1000)
    return extra | {"index": 0, "content": done.text, "id_slot": 0, "stop": True, "model": model,
            "tokens_predicted": st.generated_tokens, "tokens_evaluated": st.prompt_tokens, "tokens_cached": cached,
            "stop_type": stop_type(st), "stopping_word": st.stop_string,
            "generation_settings": {"n_predict": req.n_predict, "temperature": req.params.temperature,
                                    "seed": req.params.seed, "stop": req.stop},
            "timings": timings.as_dict(), "tandem": {"stats": st.as_dict()}}


def completion_stream(first: Any, items: AsyncIterator, job: Job, *, req: GenRequest, model: str,
                      config: StreamConfig, streams: OpenStreams,
                      token_bytes: Callable[[int], bytes], used: JobUsage,
                      return_tokens: bool = False) -> ReplyStream:
    """``return_tokens``: each event also carries its token ids (``tokens``), even an event
    whose tokens hold no whole character yet."""

    def chunk(ev: Any) -> dict[str, Any] | None:
        if not isinstance(ev, TokenEvent) or not (ev.text or ev.logprobs or (return_tokens and ev.tokens)):
            return None
        out: dict[str, Any] = {"index": 0, "content": ev.text, "stop": False}
        if return_tokens:
            out["tokens"] = ev.tokens
        if ev.logprobs:
            out["completion_probabilities"] = llama_probabilities(ev.logprobs, token_bytes)
        return out

    def final(ev: Any) -> dict[str, Any] | None:
        if not isinstance(ev, DoneEvent):
            return None
        return done_body(ev, req, model, used.cached_tokens, tokens=[] if return_tokens else None) | {"content": ""}

    return llama_server_stream(
        first, items, job,
        chunk=chunk,
        final=final,
        unfinished=lambda _: {"content": "", "stop": True, "stop_type": "none", "model": model},
        config=config, streams=streams)
