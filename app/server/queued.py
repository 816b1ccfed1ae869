"""A request's job in its model's queue, from submission to the end of its answer.

A handler waits for a job's *first* item before answering (:func:`start`), so a prompt
that does not fit still gets a proper 4xx even on a streaming request; a whole reply is
drained to its end (:func:`final`). A client that goes away cancels its job: a watcher
task listens for ``http.disconnect`` while a whole reply is prepared (a stream's end is
seen by :mod:`.streams`, which sets the job's cancel event itself).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request

from tandem.app.server import jobs
from tandem.app.server.api_error import ApiError, cancelled, shutting_down, superseded
from tandem.app.server.loaded_models import ModelSlot
from tandem.app.server.streams import chain
from tandem.app.server.worker import Job, QueueFull
from tandem.errors import EmptyPrompt, PromptError, TandemError
from tandem.runtime.generate import DoneEvent, TokenEvent


async def start(request: Request, slot: ModelSlot, fn, *, kind: str = "chat",
                client: str = "", hint: str = "") -> tuple[Job, AsyncIterator, Any, asyncio.Task]:
    """Queue a job and wait for its first item (so errors still become 4xx). ``client``
    and ``hint``: which lane it goes to (:mod:`.worker`)."""
    if slot.worker.stopping:
        raise shutting_down()
    try:
        job = slot.worker.submit(fn, kind=kind, client=client, hint=hint)
    except QueueFull as exc:
        raise ApiError(503, f"Server busy: {exc}. Retry shortly.", "overloaded", type_="server_error",
                       retry_after_s=1) from None
    watcher = asyncio.create_task(_watch_disconnect(request, job))
    items = job.items()
    try:
        first = await items.__anext__()
    except StopAsyncIteration:
        if slot.worker.stopping:  # skipped in the queue by the shutdown
            watcher.cancel()
            raise shutting_down() from None
        if job.superseded:
            watcher.cancel()
            raise superseded() from None
        first = None
    except EmptyPrompt as exc:
        watcher.cancel()
        raise ApiError(400, str(exc), "invalid_value", "prompt") from None
    except PromptError as exc:
        watcher.cancel()
        raise ApiError(400, str(exc), "context_length_exceeded") from None
    except TandemError as exc:
        watcher.cancel()
        raise ApiError(400, str(exc), "invalid_request") from None
    except Exception as exc:
        job.cancel.set()
        watcher.cancel()
        raise ApiError(500, f"The model failed on this request ({type(exc).__name__}).", "internal_error",
                       type_="server_error") from None
    except BaseException:
        job.cancel.set()
        watcher.cancel()
        raise
    return job, items, first, watcher


def drafts_or_cancelled(first: Any) -> jobs.Drafts:
    if not isinstance(first, jobs.Drafts):
        raise cancelled()
    return first


async def final(first: Any, items: AsyncIterator, watcher: asyncio.Task, job: Job, *, logprobs: list | None = None,
                last: type = DoneEvent) -> Any:
    """Drain a job to its last event, a ``last`` (a whole reply); an error if it was stopped
    before its end (:meth:`~.worker.Job.stop_error`).
    The tokens' logprobs, when asked for, are gathered into ``logprobs``."""
    try:
        done = None
        async for ev in chain(first, items):
            if isinstance(ev, last):
                done = ev
            elif logprobs is not None and isinstance(ev, TokenEvent) and ev.logprobs:
                logprobs.extend(ev.logprobs)
    finally:
        watcher.cancel()
    if done is None or (isinstance(done, DoneEvent) and done.stats.finish_reason == "cancelled"):
        raise job.stop_error()
    return done


async def _watch_disconnect(request: Request, job: Job) -> None:
    """Cancel the job when the client disconnects before its answer is ready."""
    while not job.cancel.is_set():
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancel.set()
            return
