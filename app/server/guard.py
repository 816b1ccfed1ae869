"""What every request passes before a route sees it: who may call, and how much they may send.

A server on loopback is still reachable from any web page the user opens: the browser
sends the page's cross-origin requests (``text/plain`` POSTs need no preflight), and
DNS rebinding makes a hostile name resolve to 127.0.0.1 so that even the replies can
be read. So by default only loopback ``Host`` names and loopback ``Origin`` pages are
served; other origins must be listed (``--allow-origin``), and a server bound to a
non-loopback address needs an API key (``--api-key``), sent as ``Authorization:
Bearer KEY``. The body is counted while it is read, so an oversized request is refused
with 413 as soon as it passes the limit instead of after it was buffered, and a client
that stops sending mid-body gets 408 instead of holding its connection forever.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from tandem.app.server.api_error import ApiError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


@dataclass(frozen=True)
class GuardConfig:
    max_body_bytes: int = 8 * 2**20
    allow_origins: tuple[str, ...] = ()
    """Origins (``scheme://host[:port]``, or ``*``) served besides loopback pages."""
    api_key: str | None = None
    """When set, every request needs ``Authorization: Bearer <api_key>``."""
    body_timeout_s: float = 30.0
    """Longest wait for the next piece of a request body."""


def is_loopback(host: str) -> bool:
    """A loopback name or address (``localhost``, ``*.localhost``, 127.0.0.0/8, ``::1``)."""
    h = host.strip("[]").lower().rstrip(".")
    if h in LOOPBACK_HOSTS or h.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def host_name(host_header: str) -> str:
    """The name in a ``Host`` header, without the port (``[::1]:8080`` -> ``::1``)."""
    if host_header.startswith("["):
        return host_header[1:].split("]", 1)[0]
    return host_header.rsplit(":", 1)[0] if host_header.count(":") == 1 else host_header


def origin_allowed(origin: str, allow: tuple[str, ...]) -> bool:
    """Loopback pages (any port) and the configured origins; ``null`` only if listed."""
    if "*" in allow or origin.rstrip("/") in allow:
        return True
    try:
        parts = urlsplit(origin)
        hostname = parts.hostname
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and hostname is not None and is_loopback(hostname)


def check_request(headers: dict[str, str], config: GuardConfig) -> None:
    """Raise :class:`ApiError` unless this caller may use the server (pure: headers in)."""
    origin = headers.get("origin")
    if origin is not None and not origin_allowed(origin, config.allow_origins):
        raise ApiError(403, f"Requests from the web page origin {origin!r} are not allowed; start the server "
                       "with --allow-origin ORIGIN to allow them.", "origin_not_allowed",
                       type_="permission_error")
    if config.api_key is not None:
        auth = headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise ApiError(401, "A valid API key is needed: send 'Authorization: Bearer KEY'.",
                           "invalid_api_key", type_="authentication_error")
        return
    host = headers.get("host")
    if host is None or not is_loopback(host_name(host)):
        raise ApiError(403, f"The Host {host!r} is not a loopback name; this server answers only "
                       "localhost / 127.0.0.1 / [::1] unless it has an --api-key.", "host_not_allowed",
                       type_="permission_error")


class Guard:
    """ASGI middleware applying :func:`check_request`, CORS for allowed origins and a
    streaming body limit."""

    def __init__(self, app: ASGIApp, config: GuardConfig) -> None:
        self.app = app
        self.config = config

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        origin = headers.get("origin")
        try:
            if scope["method"] == "OPTIONS" and origin is not None:
                if not origin_allowed(origin, self.config.allow_origins):
                    check_request(headers, self.config)  # raises the 403
                await _preflight(send, origin)
                return
            check_request(headers, self.config)
            length = headers.get("content-length")
            if length is not None and (not length.isdigit() or int(length) > self.config.max_body_bytes):
                raise _too_large(self.config.max_body_bytes)
        except ApiError as exc:
            await _error(send, exc)
            return
        started = False

        async def send_cors(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if origin is not None:
                    message = {**message, "headers": [*message.get("headers", []), *_cors_headers(origin)]}
            await send(message)

        try:
            await self.app(scope, _bounded(receive, self.config), send_cors)
        except ApiError as exc:  # raised while reading the body outside a route's own handling
            if not started:
                await _error(send_cors, exc)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"The request body is larger than the limit of {limit} bytes.", "request_too_large")


def _bounded(receive: Receive, config: GuardConfig) -> Receive:
    """``receive`` that counts body bytes (413 past the limit) and times out a stalled body (408)."""
    seen = 0
    body_done = False

    async def wrapped() -> Message:
        nonlocal seen, body_done
        if body_done:
            return await receive()
        try:
            message = await asyncio.wait_for(receive(), config.body_timeout_s)
        except TimeoutError:
            raise ApiError(408, f"The request body stalled for {config.body_timeout_s:g} s.",
                           "request_timeout") from None
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > config.max_body_bytes:
                raise _too_large(config.max_body_bytes)
            body_done = not message.get("more_body", False)
        else:
            body_done = True
        return message

    return wrapped


def _cors_headers(origin: str) -> list[tuple[bytes, bytes]]:
    return [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]


async def _preflight(send: Send, origin: str) -> None:
    headers = [*_cors_headers(origin), (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
               (b"access-control-allow-headers", b"authorization, content-type"),
               (b"access-control-max-age", b"600"), (b"content-length", b"0")]
    await send({"type": "http.response.start", "status": 204, "headers": headers})
    await send({"type": "http.response.body", "body": b""})


async def _error(send: Send, exc: ApiError) -> None:
    body = json.dumps(exc.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if exc.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    if exc.status in (408, 413):
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
