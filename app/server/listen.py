"""Running the ASGI app under uvicorn: bind first, time out slow clients, stop cleanly.

The listening socket is bound before anything is announced, so "Serving on ..." is only
printed once the address is really ours (a port in use is one clear error). uvicorn
times out idle keep-alive connections but not a client that sends half a request line
and stalls; :class:`TimedH11Protocol` closes a connection whose request headers do not
arrive within ``header_timeout_s`` (the body is timed by :mod:`.guard`).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from tandem.errors import TandemError


@dataclass(frozen=True)
class ListenConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    header_timeout_s: float = 10.0
    """Longest a connection may wait between requests or spend sending request headers."""
    graceful_s: float = 10.0
    """On SIGTERM, longest wait for in-flight requests before connections are closed."""
    max_connections: int = 512
    """Beyond this many open connections new requests get 503."""


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus a watchdog on connections with no request in progress."""

    header_timeout_s = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._idle_since = self.loop.time()
        self._closing_since: float | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        self._arm()

    def _arm(self) -> None:
        self._watchdog = self.loop.call_later(min(1.0, self.header_timeout_s / 2), self._check)

    def _check(self) -> None:
        now = self.loop.time()
        if self.transport.is_closing():
            # A closing transport first flushes what it buffered, which never ends when
            # the client stopped reading (a stream given up after send_timeout_s): after
            # the header timeout, drop the connection and its buffers.
            if self._closing_since is None:
                self._closing_since = now
            if now - self._closing_since > self.header_timeout_s:
                sock = self.transport.get_extra_info("socket")
                if sock is not None:  # linger 0: reset, so the kernel drops the unsent data too
                    with contextlib.suppress(OSError):
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.transport.abort()
                return
            self._arm()
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self._idle_since = now  # a request is being answered: its body is timed by the guard
        elif now - self._idle_since > self.header_timeout_s:
            with contextlib.suppress(h11.LocalProtocolError):
                self.conn.send(h11.ConnectionClosed())
            self.transport.close()
            return
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        super().connection_lost(exc)


def protocol_with_timeout(header_timeout_s: float) -> type[TimedH11Protocol]:
    return type("TimedH11", (TimedH11Protocol,), {"header_timeout_s": header_timeout_s})


def bind(host: str, port: int) -> socket.socket:
    """A bound socket for ``host:port``, or a :class:`TandemError` saying why not."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise TandemError(f"Cannot listen on {host}:{port}: {exc.strerror or exc}.") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        raise TandemError(f"Cannot listen on {host}:{port}: {exc.strerror or exc}.") from None
    return sock


class GracefulServer(uvicorn.Server):
    """uvicorn's server, calling ``on_shutdown`` hooks as soon as shutdown begins (before
    it waits for open requests), so in-flight generations stop and answer at once."""

    def __init__(self, config: uvicorn.Config, on_shutdown: Sequence[Callable[[], None]] = ()) -> None:
        super().__init__(config)
        self.on_shutdown = list(on_shutdown)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for hook in self.on_shutdown:
            hook()
        await super().shutdown(sockets)

    def run(self, sockets: list[socket.socket] | None = None) -> None:
        """Serve until SIGTERM or Ctrl+C. After its graceful shutdown uvicorn raises the
        signal again under the handler that was there before; for SIGTERM that is the
        default one, which would kill the process before the caller frees the model. A
        handler that only notes the signal lets ``run`` return: the caller's cleanup
        runs and the process exits 0."""
        if threading.current_thread() is not threading.main_thread():
            super().run(sockets)
            return
        previous = signal.signal(signal.SIGTERM, _noted)
        try:
            super().run(sockets)
        finally:
            signal.signal(signal.SIGTERM, previous)


def _noted(signum: int, frame: object) -> None:
    """SIGTERM after uvicorn's shutdown: already handled, nothing left to do."""


def uvicorn_server(app, listen: ListenConfig, on_shutdown: Sequence[Callable[[], None]] = ()) -> GracefulServer:
    config = uvicorn.Config(app, host=listen.host, port=listen.port, log_level="warning", lifespan="on",
                            http=protocol_with_timeout(listen.header_timeout_s), ws="none",
                            timeout_keep_alive=max(1, min(5, int(listen.header_timeout_s))),
                            timeout_graceful_shutdown=int(listen.graceful_s),
                            limit_concurrency=listen.max_connections,
                            h11_max_incomplete_event_size=64 * 1024)
    return GracefulServer(config, on_shutdown)
