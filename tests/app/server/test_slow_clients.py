"""A client that opens a streamed reply and then stops reading (but keeps the connection
open) is given up after ``send_timeout_s``: its stream ends, its job is cancelled and the
model's worker is free for the next client. Real uvicorn servers on 127.0.0.1, a raw
socket with a tiny receive buffer that never reads."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from live_server import running

SEND_TIMEOUT_S = 1.0
BUFFER = 4096


@contextlib.contextmanager
def stalled_stream(url: str, path: str, body: dict) -> Iterator[socket.socket]:
    """Send a streaming request from a socket with a tiny receive buffer, and read nothing."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BUFFER)  # before connecting: it sets the window
    sock.settimeout(60)
    try:
        sock.connect((host, int(port)))
        payload = json.dumps(body | {"stream": True}).encode()
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        yield sock
    finally:
        sock.close()


def wait_for(url: str, condition: Callable[[dict], bool], timeout: float = 90.0) -> dict:
    """Poll /health (its own connection) until ``condition`` holds; bounded."""
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(f"{url}/health", timeout=10).json()
        if condition(health):
            return health
        assert time.monotonic() < deadline, f"the server never freed the stalled stream: {health}"
        time.sleep(0.05)


def read_rest(sock: socket.socket) -> bytes:
    """Read what the server still sends; it must hang up (EOF), not keep the stream open."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def _app(path, n_ctx: int, request_log: Path | None = None):
    from tandem.app.server.asgi import ServerConfig, create_app
    from tandem.app.server.loaded_models import make_slot
    from tandem.runtime.backends.llama import LlamaCppBackend
    from tandem.runtime.backends.llama_config import LlamaConfig

    target = LlamaCppBackend(path, LlamaConfig(n_ctx=n_ctx, n_threads=1))
    slot = make_slot(target, name="m", speculative=False)
    return slot, create_app([slot], ServerConfig(send_timeout_s=SEND_TIMEOUT_S, request_log=request_log))


FAT = {  # fat chunks (log-probabilities of alternatives), so the buffers fill after a few tokens
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Once upon a time"}], "logprobs": True,
                             "top_logprobs": 20},
    "/v1/completions": {"prompt": "Once upon a time", "logprobs": 5},
    "/infill": {"input_prefix": "Once upon a time", "input_suffix": ""},
}


@pytest.mark.parametrize("path", list(FAT))
def test_stalled_reader_stream_is_ended(stories260k, path: str) -> None:
    """Every streaming route: the stalled stream is ended (``/health`` shows no open stream
    and one timed out) and the server hangs up, without ever sending the end of the reply."""
    slot, app = _app(stories260k, 2048)
    body = {"max_tokens": 2000, "n_predict": 2000, "t_max_predict_ms": 600_000, "temperature": 1.0, "seed": 1}
    body |= FAT[path]
    with running(app, send_buffer=BUFFER) as url, stalled_stream(url, path, body) as sock:
        wait_for(url, lambda h: h["streams"]["open"] == 1)
        health = wait_for(url, lambda h: h["streams"]["open"] == 0 and not h["models"]["m"]["busy"])
        assert health["streams"]["timed_out"] == 1
        rest = read_rest(sock)
        assert rest.startswith(b"HTTP/1.1 200")
        assert b"[DONE]" not in rest and b'"stop": true' not in rest  # cut off, not finished
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Once", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200  # the next client is served
    slot.close()


def server_side_open(server_port: int, client_port: int) -> bool:
    """Whether the server still holds its end of the connection from ``client_port``
    (Linux: an entry in /proc/net/tcp with those ports, in any state but TIME_WAIT)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, remote, state = line.split()[1:4]
        if (int(local.split(":")[1], 16), int(remote.split(":")[1], 16)) == (server_port, client_port):
            return state != "06"
    return False


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads the kernel's socket table (Linux)")
def test_stalled_reader_connection_is_dropped(stories260k) -> None:
    """After its stream is given up, a client that still reads nothing does not keep the
    connection (and the reply buffered for it): it is dropped within the header timeout."""
    slot, app = _app(stories260k, 2048)
    body = {"max_tokens": 2000, "temperature": 1.0, "seed": 1} | FAT["/v1/completions"]
    with running(app, send_buffer=BUFFER, header_timeout_s=1.0) as url, \
            stalled_stream(url, "/v1/completions", body) as sock:
        server_port, client_port = int(url.rsplit(":", 1)[1]), sock.getsockname()[1]
        wait_for(url, lambda h: h["streams"]["timed_out"] == 1)
        deadline = time.monotonic() + 30
        while server_side_open(server_port, client_port):
            assert time.monotonic() < deadline, "the server kept the stalled connection open"
            time.sleep(0.05)
    slot.close()


def test_stalled_reader_cancels_a_long_generation(real_models, tmp_path: Path) -> None:
    """A long reply on a real model: the stalled client's job is cancelled long before its
    1900 tokens, and the worker serves the next request (with the request log on, whose
    wrapper around the stream must pass the end on at once)."""
    log = tmp_path / "requests.jsonl"
    slot, app = _app(real_models.smollm2, 2048, log)
    body = {"messages": [{"role": "user", "content": "Write the numbers from 1 to 500, separated by commas."}],
            "max_tokens": 1900, "temperature": 0, "logprobs": True, "top_logprobs": 20}  # ~20 s to its end
    with running(app, send_buffer=BUFFER) as url, stalled_stream(url, "/v1/chat/completions", body) as sock:
        wait_for(url, lambda h: h["models"]["m"]["busy"])
        health = wait_for(url, lambda h: not h["models"]["m"]["busy"], timeout=300)
        stats = health["models"]["m"]
        assert stats["cancelled"] == 1 and stats["completed"] == 0, health  # stopped, not run to its end
        assert b"[DONE]" not in read_rest(sock)
        r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        assert r.status_code == 200
    slot.close()
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    chats = [x["stream"] for x in lines if x["route"] == "/v1/chat/completions"]
    assert chats == [True, False]  # the stalled stream's line too (written when it was given up)
