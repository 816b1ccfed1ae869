"""Streamed replies (server-sent events) and every way such a stream ends.

A stream ends with its final event when the job is done; with a last event saying why
when the server shuts down (sse-starlette sets ``shutdown`` and grants a grace period,
and ``cancel_on`` stops the job so it ends at once); silently when the client goes
away (sse-starlette cancels the generator). A client that stops reading but keeps the
connection open is the fourth case: each send waits at most ``send_timeout_s``, then
the stream is given up (:class:`ReplyStream`), so a stalled reader holds neither the
reply job nor its model's worker. Whatever ends a stream, the generator's ``finally``
sets the job's cancel event: a job still running stops at its next step.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import anyio
from sse_starlette.sse import EventSourceResponse, SendTimeoutError
from starlette.types import Receive, Scope, Send

from tandem.app.server.api_error import ApiError
from tandem.app.server.jobs import JobUsage
from tandem.app.server.logprobs_api import shape
from tandem.app.server.openai import Shaper, finish_reason, usage
from tandem.app.server.tool_calls import ToolCallParser
from tandem.app.server.worker import Job
from tandem.errors import TandemError
from tandem.runtime.autocomplete.infill import InfillChunk, InfillDone
from tandem.runtime.generate import DoneEvent, GenerationStats, TokenEvent


@dataclass(frozen=True)
class StreamConfig:
    send_timeout_s: float = 30.0
    """Longest one send may wait for a client that stopped reading; then the stream ends."""
    shutdown_grace_s: float = 5.0
    """On SIGTERM, how long streams get to send their final event after being stopped."""
    ping_s: int = 15


@dataclass
class OpenStreams:
    """Streams being sent now, and how many were given up on a client that stopped
    reading (``/health`` shows both)."""

    open: int = 0
    timed_out: int = 0


class ReplyStream(EventSourceResponse):
    """An SSE response whose sends time out; a timed-out stream has already closed its
    generator (cancelling the job), and ending the response here makes the server close
    the connection instead of logging the timeout as a crash."""

    def __init__(self, events: AsyncIterator[dict], config: StreamConfig, streams: OpenStreams,
                 shutdown: anyio.Event | None = None) -> None:
        super().__init__(events, ping=config.ping_s, send_timeout=config.send_timeout_s, shutdown_event=shutdown,
                         shutdown_grace_period=config.shutdown_grace_s if shutdown is not None else 0)
        self.streams = streams

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.streams.open += 1
        try:
            await super().__call__(scope, receive, send)
        except SendTimeoutError:
            self.streams.timed_out += 1
        finally:
            self.streams.open -= 1


def generation_stream(first: Any, items: AsyncIterator, job: Job, *, shaper: Shaper, token_bytes: Callable,
                      include_usage: bool, used: JobUsage, on_stats: Callable[[GenerationStats], None],
                      config: StreamConfig, streams: OpenStreams, text_start: int = 0,
                      tool_calls: ToolCallParser | None = None) -> ReplyStream:
    """A chat or text completion's chunks, its finish chunk, the usage chunk (when asked
    for) and ``[DONE]``. ``tool_calls``: the request offered tools, so the text is cut
    into content and ``tool_calls`` deltas by this parser."""
    shutdown = anyio.Event()

    async def events() -> AsyncIterator[dict]:
        stopper = asyncio.create_task(cancel_on(shutdown, job))
        try:
            yield {"data": json.dumps(shaper.chunk(0, "" if shaper.chat else None, first=True))}
            offset = text_start
            ended = False
            async for ev in chain(first, items):
                if tool_calls is not None and isinstance(ev, TokenEvent | DoneEvent):
                    deltas = tool_calls.feed(ev.text) if isinstance(ev, TokenEvent) else tool_calls.finish()
                    for d in deltas:
                        yield {"data": json.dumps(shaper.reply_chunk(0, d))}
                if tool_calls is not None and isinstance(ev, TokenEvent):
                    continue
                if isinstance(ev, TokenEvent) and (ev.text or ev.logprobs):
                    chunk = shaper.chunk(0, ev.text)
                    if ev.logprobs is not None:
                        chunk["choices"][0]["logprobs"] = shape(ev.logprobs, token_bytes, chat=shaper.chat,
                                                                offset=offset)
                    offset += len(ev.text)
                    yield {"data": json.dumps(chunk)}
                elif isinstance(ev, DoneEvent):
                    on_stats(ev.stats)
                    if ev.stats.finish_reason == "cancelled":
                        break  # not the reply's end: said below
                    called = tool_calls is not None and tool_calls.calls and ev.stats.finish_reason != "length"
                    reason = "tool_calls" if called else finish_reason(ev.stats.finish_reason)
                    yield {"data": json.dumps(shaper.chunk(0, None, reason))}
                    if include_usage:
                        use = usage(ev.stats.prompt_tokens, ev.stats.generated_tokens, used.cached_tokens, used.prediction)
                        yield {"data": json.dumps(shaper.usage_chunk(use))}
                    ended = True
            if not ended:  # stopped before its end: an error, so the text is not taken for a whole reply
                yield {"data": json.dumps(job.stop_error().body())}
            yield {"data": "[DONE]"}
        except Exception as exc:  # the response has started: the error goes in the stream
            yield {"data": json.dumps(stream_error(exc))}
            yield {"data": "[DONE]"}
        finally:
            job.cancel.set()
            stopper.cancel()

    return ReplyStream(events(), config, streams, shutdown)


def llama_server_stream(first: Any, items: AsyncIterator, job: Job, *, chunk: Callable[[Any], dict | None],
                        final: Callable[[Any], dict | None], unfinished: Callable[[bool], dict],
                        config: StreamConfig, streams: OpenStreams) -> ReplyStream:
    """A llama-server-style stream (``/completion``, ``/infill``): ``chunk(event)`` for each
    piece of text, ``final(event)`` for the event that ends the reply (each ``None`` for
    events it does not map), and, if none ended it (cancelled, or the server shutting down:
    the argument), ``unfinished(shutting_down)`` as the last event."""
    shutdown = anyio.Event()

    async def events() -> AsyncIterator[dict]:
        stopper = asyncio.create_task(cancel_on(shutdown, job))
        try:
            ended = False
            async for ev in chain(first, items):
                if (body := chunk(ev)) is not None:
                    yield {"data": json.dumps(body)}
                elif (body := final(ev)) is not None:
                    yield {"data": json.dumps(body)}
                    ended = True
            if not ended:  # stopped early: still a last event
                yield {"data": json.dumps(unfinished(shutdown.is_set()))}
        except Exception as exc:  # the response has started: the error goes in the stream
            yield {"data": json.dumps(stream_error(exc))}
        finally:
            job.cancel.set()
            stopper.cancel()

    return ReplyStream(events(), config, streams, shutdown)


def infill_stream(first: Any, items: AsyncIterator, job: Job, *, model: str, final_body: Callable[[InfillDone], dict],
                  config: StreamConfig, streams: OpenStreams) -> ReplyStream:
    """llama-server's streamed /infill: ``{"content", "stop": false}`` events, then the
    final body with ``stop: true``."""
    return llama_server_stream(
        first, items, job,
        chunk=lambda ev: {"content": ev.text, "stop": False} if isinstance(ev, InfillChunk) else None,
        final=lambda ev: final_body(ev) | {"content": ""} if isinstance(ev, InfillDone) else None,
        unfinished=lambda shutting_down: {"content": "", "stop": True, "stop_type": "none", "model": model,
                                          "tandem": {"stopped": "server shutting down" if shutting_down
                                                     else "cancelled"}},
        config=config, streams=streams)


def drafts_stream(shaper: Shaper, texts: list[tuple[str, str]], use: dict[str, Any] | None, *,
                  config: StreamConfig, streams: OpenStreams) -> ReplyStream:
    """n > 1, already decoded: each choice's text, each choice's finish, usage, ``[DONE]``."""

    async def events() -> AsyncIterator[dict]:
        for i, (text, _) in enumerate(texts):
            yield {"data": json.dumps(shaper.chunk(i, text, first=True))}
        for i, (_, reason) in enumerate(texts):
            yield {"data": json.dumps(shaper.chunk(i, None, reason))}
        if use is not None:
            yield {"data": json.dumps(shaper.usage_chunk(use))}
        yield {"data": "[DONE]"}

    return ReplyStream(events(), config, streams)


async def cancel_on(event: anyio.Event, job: Job) -> None:
    """Stop ``job`` when the server shuts down, so its stream ends with a last event."""
    await event.wait()
    job.shut_down = True
    job.cancel.set()


def stream_error(exc: Exception) -> dict:
    """The error event of a stream that failed after it started (its status line is sent)."""
    if isinstance(exc, ApiError):
        return exc.body()
    status = 400 if isinstance(exc, TandemError) else 500
    return ApiError(status, str(exc) if status == 400 else f"The model failed ({type(exc).__name__}).",
                    "invalid_request" if status == 400 else "internal_error",
                    type_="invalid_request_error" if status == 400 else "server_error").body()


async def chain(first: Any, items: AsyncIterator) -> AsyncIterator:
    """A job's first item (already awaited by the handler), then the rest."""
    if first is not None:
        yield first
    async for it in items:
        yield it
