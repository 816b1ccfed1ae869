"""The ASGI app: its configuration, middleware, request log, error pages, ``/v1/models``
and ``/health``; the generation routes are in :mod:`.routes`, their streams in
:mod:`.streams`, llama-server's ``/tokenize``, ``/detokenize``, ``/apply-template`` and
``/props`` in :mod:`.llama_utility`. The paths llama-server also answers without ``/v1``
(``/chat/completions``, ``/completions``, ``/models``) and ``/v1/health`` are the same
routes, for clients given the server's address without it.

Every answer is JSON, errors included: a route's :class:`ApiError` becomes an
OpenAI-style error body, and anything unexpected a JSON 500, never a traceback.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tandem.app.server import llama_utility
from tandem.app.server.api_error import ApiError
from tandem.app.server.catalog import PlanCache, store_models
from tandem.app.server.guard import Guard, GuardConfig
from tandem.app.server.loaded_models import ModelSlot
from tandem.app.server.openai import parse_model
from tandem.app.server.request_log import RequestLog, logged_stream, record
from tandem.app.server.routes import Routes
from tandem.app.server.streams import StreamConfig


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
    send_timeout_s: float = 30.0
    """A streamed reply whose client reads nothing for this long is ended and its job
    cancelled (see :mod:`.streams`)."""
    request_log: Path | None = None
    """Append one JSON line per request here (:mod:`.request_log`); ``None``: no log."""
    cache_reuse: int = 0
    """``/infill`` reuses cached runs of at least this many tokens that moved in the
    prompt (llama-server's ``--cache-reuse``; 0: the common prefix only)."""

    def guard(self) -> GuardConfig:
        return GuardConfig(self.max_body_bytes, self.allow_origins, self.api_key, self.body_timeout_s)

    def streams(self) -> StreamConfig:
        return StreamConfig(send_timeout_s=self.send_timeout_s, shutdown_grace_s=self.shutdown_grace_s)


class Server:
    def __init__(self, slots: Sequence[ModelSlot], config: ServerConfig) -> None:
        self.slots = {s.name: s for s in slots}
        self.config = config
        self.routes = Routes(self.slots, config.max_body_bytes, config.streams(), cache_reuse=config.cache_reuse)
        self.request_log = RequestLog(config.request_log) if config.request_log is not None else None
        self.plans = PlanCache()

    async def models(self, request: Request) -> JSONResponse:
        data = [_served(s) for s in self.slots.values()]
        # and the local store's other models (reading their headers: off the event loop)
        data += await asyncio.to_thread(store_models, set(self.slots), self.plans)
        return JSONResponse({"object": "list", "data": data})

    async def model(self, request: Request) -> JSONResponse:
        """``GET /v1/models/{id}`` (the openai SDK's ``models.retrieve``): one model of the
        list, served or in the store."""
        name = request.path_params["model"]
        if name in self.slots:
            return JSONResponse(_served(self.slots[name]))
        stored = await asyncio.to_thread(store_models, set(self.slots), self.plans)
        found = next((m for m in stored if m["id"] == name), None)
        if found is None:
            raise ApiError(404, f"The model '{name}' does not exist; GET /v1/models lists them.", "model_not_found",
                           "model")
        return JSONResponse(found)

    async def props(self, request: Request) -> JSONResponse:
        slot = self.routes.slot(request.query_params.get("model"))
        return JSONResponse(llama_utility.props(slot))

    def utility(self, fn):
        """A route answering ``fn(slot, body)`` for the request's model, computed off the
        event loop (a long text takes a while to tokenize)."""

        async def endpoint(request: Request) -> JSONResponse:
            body = await self.routes.body(request)
            slot = self.routes.slot(parse_model(body))
            request.state.model = slot.name
            return JSONResponse(await asyncio.to_thread(fn, slot, body))

        return endpoint

    async def health(self, request: Request) -> JSONResponse:
        models = {n: {"waiting": s.worker.waiting, "busy": s.worker.busy, "slots": len(s.lanes),
                      "running": s.worker.running, **vars(s.worker.stats),
                      **({"batch": vars(s.batcher.stats)} if s.batcher is not None else {})}
                  for n, s in self.slots.items()}
        streams = self.routes.streams
        return JSONResponse({"status": "ok", "models": models,
                             "streams": {"open": streams.open, "timed_out": streams.timed_out}})


def _served(s: ModelSlot) -> dict:
    return {"id": s.name, "object": "model", "created": s.created, "owned_by": "tandem",
            "meta": {"served": True, "n_ctx": s.target.n_ctx, "n_vocab": s.target.n_vocab,
                     "speculative": s.speculative, "ngram": s.ngram is not None}}


def _api(handler):
    async def endpoint(request: Request):
        started = time.monotonic()
        try:
            response = await handler(request)
        except ApiError as exc:
            response = JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())
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
        *(Route(path, _api(server.models), methods=["GET"]) for path in ("/v1/models", "/models")),
        Route("/v1/models/{model:path}", _api(server.model), methods=["GET"]),
        *(Route(path, _api(server.routes.chat), methods=["POST"])
          for path in ("/v1/chat/completions", "/chat/completions")),
        *(Route(path, _api(server.routes.completions), methods=["POST"]) for path in ("/v1/completions", "/completions")),
        Route("/infill", _api(server.routes.infill), methods=["POST"]),
        Route("/completion", _api(server.routes.completion), methods=["POST"]),
        Route("/tokenize", _api(server.utility(llama_utility.tokenize)), methods=["POST"]),
        Route("/detokenize", _api(server.utility(llama_utility.detokenize)), methods=["POST"]),
        Route("/apply-template", _api(server.utility(llama_utility.apply_template)), methods=["POST"]),
        Route("/props", _api(server.props), methods=["GET"]),
        *(Route(path, _api(server.health), methods=["GET"]) for path in ("/health", "/v1/health")),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error, Exception: _internal_error},
                    middleware=[Middleware(Guard, config=server.config.guard())], lifespan=lifespan)
    app.state.server = server
    return app
