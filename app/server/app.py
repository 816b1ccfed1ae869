"""The ASGI app: OpenAI-compatible routes plus llama.cpp-style ``/infill`` and ``/health``.

Requests wait in their model's FIFO queue (:mod:`.worker`). The handler waits for a
job's *first* item before answering, so a prompt that does not fit still gets a proper
4xx even on a streaming request. A client that goes away cancels its job: a watcher
task listens for ``http.disconnect`` (non-streaming), and sse-starlette cancels the
stream's generator (streaming), whose ``finally`` sets the job's cancel event.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tandem.app.server import infill as infill_api
from tandem.app.server import jobs
from tandem.app.server.catalog import PlanCache, store_models
from tandem.app.server.guard import Guard, GuardConfig
from tandem.app.server.logprobs import parse_logprobs, shape
from tandem.app.server.models import ModelSlot
from tandem.app.server.openai import (
    ApiError,
    Shaper,
    finish_reason,
    parse_common,
    parse_json,
    parse_messages,
    parse_prompt,
    usage,
)
from tandem.app.server.request_log import RequestLog, logged_stream, record
from tandem.app.server.worker import Job, QueueFull
from tandem.models.errors import PromptError, TandemError
from tandem.runtime.autocomplete.infill import InfillChunk, InfillDone
from tandem.runtime.generate import DoneEvent, TokenEvent


@dataclass(frozen=True)
class ServerConfig:
    max_body_bytes: int = 8 * 2**20
    max_queue: int = 64
    allow_origins: tuple[str, ...] = ()
    """Web page origins allowed besides loopback ones (see :mod:`.guard`)."""
    api_key: str | None = None
    """Bearer key every request must carry (required for a non-loopback bind)."""
    body_timeout_s: float = 30.0
    shutdown_grace_s: float = 5.0
    """On SIGTERM, how long streams get to send their final event after being stopped."""
    request_log: Path | None = None
    """Append one JSON line per request here (:mod:`.request_log`); ``None``: no log."""

    def guard(self) -> GuardConfig:
        return GuardConfig(self.max_body_bytes, self.allow_origins, self.api_key, self.body_timeout_s)


class Server:
    def __init__(self, slots: Sequence[ModelSlot], config: ServerConfig) -> None:
        self.slots = {s.name: s for s in slots}
        self.config = config
        self.request_log = RequestLog(config.request_log) if config.request_log is not None else None
        self.plans = PlanCache()

    # -- helpers --------------------------------------------------------------------
    def slot(self, name: str | None) -> ModelSlot:
        if name is None or (name not in self.slots and len(self.slots) == 1 and name in ("", "default")):
            if len(self.slots) == 1:
                return next(iter(self.slots.values()))
            raise ApiError(400, "Say which model with 'model'.", "model_required", "model")
        slot = self.slots.get(name)
        if slot is None:
            raise ApiError(404, f"The model '{name}' does not exist; GET /v1/models lists the served models.",
                           "model_not_found", "model")
        return slot

    async def body(self, request: Request) -> dict:
        raw = await request.body()
        if len(raw) < 65536:
            return parse_json(raw, self.config.max_body_bytes)
        # a big body takes milliseconds to parse: not on the loop other clients share
        return await asyncio.to_thread(parse_json, raw, self.config.max_body_bytes)

    def check_fits(self, slot: ModelSlot, ids: list[int]) -> None:
        if len(ids) >= slot.target.n_ctx:
            raise ApiError(400, f"The prompt is {len(ids)} tokens; this model's context holds {slot.target.n_ctx}.",
                           "context_length_exceeded", "prompt")

    async def start(self, request: Request, slot: ModelSlot, fn) -> tuple[Job, AsyncIterator, Any, asyncio.Task]:
        """Queue a job and wait for its first item (so errors still become 4xx)."""
        if slot.worker.stopping:
            raise _shutting_down()
        try:
            job = slot.worker.submit(fn)
        except QueueFull as exc:
            raise ApiError(503, f"Server busy: {exc}. Retry shortly.", "overloaded", type_="server_error") from None
        watcher = asyncio.create_task(_watch_disconnect(request, job))
        items = job.items()
        try:
            first = await items.__anext__()
        except StopAsyncIteration:
            if slot.worker.stopping:  # skipped in the queue by the shutdown
                watcher.cancel()
                raise _shutting_down() from None
            first = None
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

    # -- routes ---------------------------------------------------------------------
    async def models(self, request: Request) -> JSONResponse:
        data = [{"id": s.name, "object": "model", "created": s.created, "owned_by": "tandem",
                 "meta": {"served": True, "n_ctx": s.target.n_ctx, "n_vocab": s.target.n_vocab,
                          "speculative": s.speculative, "ngram": s.ngram is not None}} for s in self.slots.values()]
        # and the local store's other models (reading their headers: off the event loop)
        data += await asyncio.to_thread(store_models, set(self.slots), self.plans)
        return JSONResponse({"object": "list", "data": data})

    async def health(self, request: Request) -> JSONResponse:
        models = {n: {"waiting": s.worker.waiting, "busy": s.worker.busy, **vars(s.worker.stats)}
                  for n, s in self.slots.items()}
        return JSONResponse({"status": "ok", "models": models})

    async def chat(self, request: Request):
        body = await self.body(request)
        req = parse_common(body)
        req.logprobs = _logprobs(body, req, chat=True)
        messages = parse_messages(body)
        slot = self.slot(req.model)
        request.state.model = slot.name
        if req.n > 1:
            return await self.drafts(request, slot, req, Shaper(slot.name, chat=True),
                                     jobs.drafts_job(slot, req, messages=messages))
        return await self.generation(request, slot, req, Shaper(slot.name, chat=True),
                                     jobs.chat_job(slot, messages, req))

    async def completions(self, request: Request):
        body = await self.body(request)
        req = parse_common(body, max_tokens_default=16)
        req.logprobs = _logprobs(body, req, chat=False)
        prompt = parse_prompt(body)
        slot = self.slot(req.model)
        request.state.model = slot.name
        suffix = body.get("suffix")
        if isinstance(suffix, str) and suffix:
            ids = await asyncio.to_thread(jobs.infill_prompt, slot, prompt, suffix)
        else:  # tokenizing a long prompt takes seconds: never on the event loop
            ids = await asyncio.to_thread(slot.target.tokenize, prompt, add_bos=True)
        self.check_fits(slot, ids)
        shaper = Shaper(slot.name, chat=False)
        if req.n > 1:
            return await self.drafts(request, slot, req, shaper, jobs.drafts_job(slot, req, ids=ids))
        return await self.generation(request, slot, req, shaper, jobs.completion_job(slot, ids, req))

    async def infill(self, request: Request):
        """llama-server's /infill (see :mod:`.infill`)."""
        req = infill_api.parse_infill(await self.body(request))
        slot = self.slot(req.gen.model)
        request.state.model = slot.name
        built = await asyncio.to_thread(infill_api.build_prompt, slot, req)
        ids = built.tokens
        self.check_fits(slot, ids)
        fmt = infill_api.fim_format(slot.target)
        if req.gen.n > 1:
            job, items, first, watcher = await self.start(request, slot, jobs.drafts_job(slot, req.gen, ids=ids))
            watcher.cancel()
            d: jobs.Drafts = _drafts_or_cancelled(first)
            return JSONResponse({"content": d.texts[0][0] if d.texts else "", "stop": True, "model": slot.name,
                                 "drafts": [t for t, _ in d.texts], "tokens_evaluated": len(ids),
                                 "tokens_predicted": d.completion_tokens, "fim": fmt is not None})
        job, items, first, watcher = await self.start(request, slot, infill_api.infill_job(
            slot, ids, req, infill_api.client_identity(request.client.host if request.client else None,
                                                       request.headers.get("authorization"))))
        if req.gen.stream:
            watcher.cancel()

            shutdown = anyio.Event()

            async def events():
                stopper = asyncio.create_task(_cancel_on(shutdown, job))
                try:
                    ended = False
                    async for ev in _chain(first, items):
                        if isinstance(ev, InfillChunk):
                            yield {"data": json.dumps({"content": ev.text, "stop": False})}
                        elif isinstance(ev, InfillDone):
                            final = infill_api.done_body(ev, req, slot.name, built, fmt) | {"content": ""}
                            yield {"data": json.dumps(final)}
                            ended = True
                    if not ended:  # stopped early (the server is shutting down): still a last event
                        yield {"data": json.dumps({"content": "", "stop": True, "stop_type": "none", "model": slot.name,
                                                   "tandem": {"stopped": "server shutting down"
                                                              if shutdown.is_set() else "cancelled"}})}
                except Exception as exc:  # the response has started: the error goes in the stream
                    yield {"data": json.dumps(_stream_error(exc))}
                finally:
                    job.cancel.set()
                    stopper.cancel()

            return EventSourceResponse(events(), ping=15, shutdown_event=shutdown,
                                       shutdown_grace_period=self.config.shutdown_grace_s)
        try:
            done = None
            async for ev in _chain(first, items):
                if isinstance(ev, InfillDone):
                    done = ev
        finally:
            watcher.cancel()
        if done is None:
            raise ApiError(499, "Request cancelled.", "cancelled")
        return JSONResponse(infill_api.done_body(done, req, slot.name, built, fmt))

    async def generation(self, request: Request, slot: ModelSlot, req, shaper: Shaper, fn):
        job, items, first, watcher = await self.start(request, slot, fn)
        if req.stream:
            watcher.cancel()

            shutdown = anyio.Event()

            async def events():
                stopper = asyncio.create_task(_cancel_on(shutdown, job))
                try:
                    yield {"data": json.dumps(shaper.chunk(0, "" if shaper.chat else None, first=True))}
                    offset = 0
                    ended = False
                    async for ev in _chain(first, items):
                        if isinstance(ev, TokenEvent) and (ev.text or ev.logprobs):
                            chunk = shaper.chunk(0, ev.text)
                            if ev.logprobs is not None:
                                chunk["choices"][0]["logprobs"] = shape(ev.logprobs, slot.target.token_bytes,
                                                                        chat=shaper.chat, offset=offset)
                            offset += len(ev.text)
                            yield {"data": json.dumps(chunk)}
                        elif isinstance(ev, DoneEvent):
                            request.state.stats = ev.stats
                            yield {"data": json.dumps(shaper.chunk(0, None, finish_reason(ev.stats.finish_reason)))}
                            if req.include_usage:
                                use = usage(ev.stats.prompt_tokens, ev.stats.generated_tokens)
                                yield {"data": json.dumps(shaper.usage_chunk(use))}
                            ended = True
                    if not ended:  # stopped before its end (the server is shutting down): still a final chunk
                        final = shaper.chunk(0, None, "stop")
                        final["tandem"] = {"stopped": "server shutting down" if shutdown.is_set() else "cancelled"}
                        yield {"data": json.dumps(final)}
                    yield {"data": "[DONE]"}
                except Exception as exc:  # the response has started: the error goes in the stream
                    yield {"data": json.dumps(_stream_error(exc))}
                    yield {"data": "[DONE]"}
                finally:
                    job.cancel.set()
                    stopper.cancel()

            return EventSourceResponse(events(), ping=15, shutdown_event=shutdown,
                                       shutdown_grace_period=self.config.shutdown_grace_s)
        lps: list | None = [] if req.logprobs is not None else None
        done = await _final(first, items, watcher, lps)
        st = request.state.stats = done.stats
        body = shaper.full([(done.text, finish_reason(st.finish_reason))],
                           usage(st.prompt_tokens, st.generated_tokens), {"tandem": {"stats": st.as_dict()}})
        if lps is not None:
            body["choices"][0]["logprobs"] = shape(lps, slot.target.token_bytes, chat=shaper.chat)
        return JSONResponse(body)

    async def drafts(self, request: Request, slot: ModelSlot, req, shaper: Shaper, fn):
        job, items, first, watcher = await self.start(request, slot, fn)
        watcher.cancel()
        d = _drafts_or_cancelled(first)
        use = usage(d.prompt_tokens, d.completion_tokens)
        extra = {"tandem": {"sampled": True} if d.result is None else {"superposed": {
            "forward_passes": d.result.forward_passes, "steps": d.result.steps, "elapsed_s": d.result.elapsed_s}}}
        if not req.stream:
            return JSONResponse(shaper.full(d.texts, use, extra))

        async def events():
            for i, (text, _) in enumerate(d.texts):
                yield {"data": json.dumps(shaper.chunk(i, text, first=True))}
            for i, (_, reason) in enumerate(d.texts):
                yield {"data": json.dumps(shaper.chunk(i, None, reason))}
            if req.include_usage:
                yield {"data": json.dumps(shaper.usage_chunk(use))}
            yield {"data": "[DONE]"}

        return EventSourceResponse(events())


def _shutting_down() -> ApiError:
    return ApiError(503, "The server is shutting down; retry against its next start.", "shutting_down",
                    type_="server_error")


async def _cancel_on(event: anyio.Event, job: Job) -> None:
    """Stop ``job`` when the server shuts down, so its stream ends with a final event."""
    await event.wait()
    job.cancel.set()


def _stream_error(exc: Exception) -> dict:
    if isinstance(exc, ApiError):
        return exc.body()
    status = 400 if isinstance(exc, TandemError) else 500
    return ApiError(status, str(exc) if status == 400 else f"The model failed ({type(exc).__name__}).",
                    "invalid_request" if status == 400 else "internal_error",
                    type_="invalid_request_error" if status == 400 else "server_error").body()


def _drafts_or_cancelled(first: Any) -> jobs.Drafts:
    if not isinstance(first, jobs.Drafts):
        raise ApiError(499, "Request cancelled.", "cancelled")
    return first


async def _chain(first: Any, items: AsyncIterator) -> AsyncIterator:
    if first is not None:
        yield first
    async for it in items:
        yield it


async def _final(first, items, watcher, logprobs: list | None = None) -> DoneEvent:
    """Drain a job to its DoneEvent (non-streaming replies); 499 if it was cancelled.
    The tokens' logprobs, when asked for, are gathered into ``logprobs``."""
    try:
        done = None
        async for ev in _chain(first, items):
            if isinstance(ev, DoneEvent):
                done = ev
            elif logprobs is not None and isinstance(ev, TokenEvent) and ev.logprobs:
                logprobs.extend(ev.logprobs)
    finally:
        watcher.cancel()
    if done is None:
        raise ApiError(499, "Request cancelled.", "cancelled")
    return done


async def _watch_disconnect(request: Request, job: Job) -> None:
    """Cancel the job when the client disconnects before its answer is ready."""
    while not job.cancel.is_set():
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancel.set()
            return


def _logprobs(body: dict, req, *, chat: bool) -> int | None:
    wanted = parse_logprobs(body, chat=chat)
    if wanted is not None and req.n > 1:
        raise ApiError(400, "'logprobs' is not available with n > 1.", "invalid_value", "logprobs")
    return wanted


def _api(handler):
    async def endpoint(request: Request):
        started = time.monotonic()
        try:
            response = await handler(request)
        except ApiError as exc:
            response = JSONResponse(exc.body(), status_code=exc.status)
        log = request.app.state.server.request_log
        if log is None:
            return response

        def write() -> None:
            log.write(record(request.url.path, response.status_code, started,
                             model=getattr(request.state, "model", None),
                             stream=isinstance(response, EventSourceResponse),
                             stats=getattr(request.state, "stats", None)))

        if isinstance(response, EventSourceResponse):  # logged when the stream ends
            response.body_iterator = logged_stream(response.body_iterator, write)
        else:
            write()
        return response

    return endpoint


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    status = getattr(exc, "status_code", 500)
    detail = getattr(exc, "detail", "error")
    return JSONResponse(ApiError(status, str(detail), "not_found" if status == 404 else None).body(), status_code=status)


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    """Last resort: an unexpected failure is still an OpenAI-style JSON body, never a traceback."""
    err = ApiError(500, f"Internal error ({type(exc).__name__}).", "internal_error", type_="server_error")
    return JSONResponse(err.body(), status_code=500)


def create_app(slots: Sequence[ModelSlot], config: ServerConfig | None = None) -> Starlette:
    server = Server(slots, config or ServerConfig())

    @asynccontextmanager
    async def lifespan(app: Starlette):
        yield
        server.plans.close()
        for s in server.slots.values():
            s.worker.close()

    routes = [
        Route("/v1/models", _api(server.models), methods=["GET"]),
        Route("/v1/chat/completions", _api(server.chat), methods=["POST"]),
        Route("/v1/completions", _api(server.completions), methods=["POST"]),
        Route("/infill", _api(server.infill), methods=["POST"]),
        Route("/health", _api(server.health), methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error, Exception: _internal_error},
                    middleware=[Middleware(Guard, config=server.config.guard())], lifespan=lifespan)
    app.state.server = server
    return app
