"""A real server on a free loopback port, in a thread, for the HTTP tests: uvicorn set up
exactly as `tandem serve` sets it up (``app.server.listen.uvicorn_server``)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


def wait_healthy(proc, port: int, timeout_s: float) -> None:
    """Wait until the `tandem serve` child ``proc`` answers ``/health`` on ``port``; fail
    with its stderr if it exits first, or after ``timeout_s`` seconds."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        try:
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
            return
        except httpx.TransportError:
            assert time.monotonic() < deadline, "tandem serve did not come up"
            time.sleep(0.1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running(app, *, start_timeout: float = 20.0, header_timeout_s: float = 10.0,
            send_buffer: int | None = None) -> Iterator[str]:
    """Serve ``app`` on 127.0.0.1 until the block ends; yields its base URL once it accepts
    connections (waiting for that condition, up to ``start_timeout`` seconds).

    ``send_buffer``: the kernel send buffer of every accepted connection (they inherit the
    listening socket's), so a client that stops reading stalls the server after a few
    kB instead of megabytes."""
    from tandem.app.server.listen import ListenConfig, bind, uvicorn_server

    port = free_port()
    srv = uvicorn_server(app, ListenConfig("127.0.0.1", port, header_timeout_s=header_timeout_s))
    sockets = None
    if send_buffer is not None:
        sock = bind("127.0.0.1", port)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
        sockets = [sock]
    thread = threading.Thread(target=srv.run, kwargs={"sockets": sockets}, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not srv.started:
        assert time.monotonic() < deadline, "server did not start"
        assert thread.is_alive(), "server thread died"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(timeout=15)


@contextmanager
def serving(path, name: str, *, n_ctx: int = 512, n_seq: int = 1, start_timeout: float = 60.0) -> Iterator[tuple]:
    """A real server holding the GGUF at ``path`` as model ``name`` (one thread, ``n_seq``
    parallel slots, speculative decoding as `tandem serve` has it); yields its URL and
    the slot, and closes both."""
    from tandem.app.server.asgi import ServerConfig, create_app
    from tandem.app.server.loaded_models import make_slot
    from tandem.runtime.backends.llama import LlamaCppBackend
    from tandem.runtime.backends.llama_config import LlamaConfig

    slot = make_slot(LlamaCppBackend(path, LlamaConfig(n_ctx=n_ctx, n_threads=1, n_seq=n_seq)), name=name)
    try:
        with running(create_app([slot], ServerConfig()), start_timeout=start_timeout) as url:
            yield url, slot
    finally:
        slot.close()


def sse_events(lines) -> list:
    """The JSON events (and the final ``[DONE]``) of a server-sent-event stream's lines."""
    out = []
    for line in lines:
        if line.startswith("data:"):
            data = line[5:].strip()
            out.append(data if data == "[DONE]" else json.loads(data))
    return out
