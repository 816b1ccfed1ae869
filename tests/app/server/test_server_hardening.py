"""`tandem serve` under hostile and clumsy clients: real uvicorn servers on 127.0.0.1,
real sockets and httpx. Every malformed request is an OpenAI-style JSON 4xx; web pages
and foreign Host names are refused; slow clients are timed out; the event loop stays free."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from live_server import free_port, running, wait_healthy

PROMPT = "Once upon a time"



def _slot(path, max_queue: int = 1):
    from tandem.app.server.loaded_models import make_slot
    from tandem.runtime.backends.llama import LlamaCppBackend
    from tandem.runtime.backends.llama_config import LlamaConfig

    target = LlamaCppBackend(path, LlamaConfig(n_ctx=256, n_threads=1))
    return make_slot(target, name="stories", max_queue=max_queue)


@pytest.fixture(scope="module")
def slot(stories260k):
    s = _slot(stories260k)
    yield s
    s.close()


@pytest.fixture
def own_slot(stories260k):
    """A slot for a test that runs its own app (an app's shutdown closes its slots' workers)."""
    s = _slot(stories260k, max_queue=8)
    yield s
    s.close()


@pytest.fixture(scope="module")
def server(slot):
    from tandem.app.server.asgi import ServerConfig, create_app

    app = create_app([slot], ServerConfig(max_body_bytes=1 << 20, body_timeout_s=2.0))
    with running(app, header_timeout_s=1.5) as url:
        yield url


def _nested(depth: int) -> bytes:
    return b'{"prompt": "x", "extra": ' + b"[" * depth + b"]" * depth + b"}"


MALFORMED = {
    "lone surrogate in prompt": ("/v1/completions", b'{"prompt": "\\ud800 hi", "max_tokens": 2}'),
    "lone surrogate in a key": ("/v1/completions", b'{"prompt": "hi", "\\udfff": 1, "max_tokens": 2}'),
    "lone surrogate in chat content": (
        "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud83d"}], "max_tokens": 2}'),
    "lone surrogate in infill prefix": ("/infill", b'{"input_prefix": "\\ud800", "n_predict": 2}'),
    "lone surrogate in stop": ("/v1/completions", b'{"prompt": "hi", "stop": ["\\ud800"], "max_tokens": 2}'),
    "100000 open brackets": ("/v1/chat/completions", b"[" * 100_000),
    "nesting 100 deep": ("/v1/completions", _nested(100)),
    "5000-digit integer": ("/v1/completions", b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"),
    "5000-digit integer in an ignored field": ("/v1/completions", b'{"prompt": "x", "foo": ' + b"1" * 5000 + b"}"),
    "non-string text part": (
        "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]})
        .encode()),
    "text part that is a list": (
        "/v1/chat/completions",
        json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": ["a"]}]}]}).encode()),
    "NaN temperature": ("/v1/completions", b'{"prompt": "x", "temperature": NaN}'),
    "infinite top_p": ("/v1/completions", b'{"prompt": "x", "top_p": 1e999}'),
    "invalid UTF-8": ("/v1/completions", b'{"prompt": "\xff\xfe"}'),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_request_is_json_4xx(server, name: str) -> None:
    path, payload = MALFORMED[name]
    r = httpx.post(f"{server}{path}", content=payload, headers={"content-type": "application/json"}, timeout=30)
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error"
    assert httpx.get(f"{server}/health", timeout=10).json()["status"] == "ok"


def test_declared_oversized_body_is_413_before_it_is_sent(server) -> None:
    """A Content-Length over the limit is refused without reading any of the body."""
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {100 * 2**20}\r\n\r\n".encode())
        reply = _read_until_closed(sock)
    assert reply.startswith("HTTP/1.1 413"), reply
    assert "request_too_large" in reply


def _read_until_closed(sock: socket.socket) -> str:
    """Everything the server sends until it closes the connection (408/413 close it)."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks).decode("latin-1")


def test_streamed_body_is_cut_at_the_limit() -> None:
    """The guard counts bytes as they arrive: past the limit it answers 413 and reads no further."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from tandem.app.server.api_error import ApiError
    from tandem.app.server.guard import Guard, GuardConfig

    async def echo(request: Request):
        try:
            return JSONResponse({"n": len(await request.body())})
        except ApiError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)

    app = Starlette(routes=[Route("/", echo, methods=["POST"])],
                    middleware=[Middleware(Guard, config=GuardConfig(max_body_bytes=100_000))])
    pulled = 0
    sent: list[dict] = []

    async def receive():
        nonlocal pulled
        pulled += 1
        return {"type": "http.request", "body": b"x" * 10_000, "more_body": pulled < 10_000}  # 100 MB in all

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/", "raw_path": b"/", "query_string": b"",
             "headers": [(b"host", b"127.0.0.1:8080"), (b"transfer-encoding", b"chunked")],
             "http_version": "1.1", "scheme": "http", "server": ("127.0.0.1", 8080), "client": ("127.0.0.1", 1),
             "root_path": "", "asgi": {"version": "3.0"}, "state": {}}
    asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 413
    assert pulled == 11  # 110 kB read of the 100 MB offered
    assert json.loads(sent[1]["body"])["error"]["code"] == "request_too_large"


def test_stalled_body_times_out_with_408(server) -> None:
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        reply = _read_until_closed(sock)  # waits for the server: body_timeout_s is 2 s
    assert reply.startswith("HTTP/1.1 408"), reply
    assert "request_timeout" in reply


def test_half_open_connection_is_closed(server) -> None:
    """Half a request line and then silence: the server hangs up (header timeout 1.5 s)."""
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0")
        assert sock.recv(4096) == b""  # EOF: closed by the server, long before the 30 s socket timeout
    with socket.create_connection((host, int(port)), timeout=30) as sock:  # and a silent one
        assert sock.recv(4096) == b""


def test_tokenizing_a_long_prompt_does_not_block_other_clients(server, slot, monkeypatch) -> None:
    """While one request's prompt is being tokenized, /health still answers."""
    entered, release = threading.Event(), threading.Event()
    real = slot.target.tokenize

    def slow_tokenize(text, **kw):
        if len(text) > 10_000:
            entered.set()
            release.wait(30)
        return real(text, **kw)

    monkeypatch.setattr(slot.target, "tokenize", slow_tokenize)
    result: dict = {}

    def big_request() -> None:
        result["r"] = httpx.post(f"{server}/v1/completions", json={"prompt": "tale " * 5000, "max_tokens": 2},
                                 timeout=60)

    t = threading.Thread(target=big_request)
    t.start()
    try:
        assert entered.wait(30), "the request never reached tokenization"
        r = httpx.get(f"{server}/health", timeout=10)  # old code: blocked until tokenizing finished
        assert r.status_code == 200
    finally:
        release.set()
        t.join(60)
    assert result["r"].status_code == 400  # 5000 tokens: past the 256-token context
    assert result["r"].json()["error"]["code"] == "context_length_exceeded"


def test_queue_limit_gives_json_503(server, slot) -> None:
    """max_queue=1: with the worker busy and one request waiting, the next one is refused."""
    gate = threading.Event()
    started = threading.Event()

    def blocker(cancel, lane):
        started.set()
        gate.wait(30)
        yield from ()

    async def main():
        loop_job = slot.worker.submit(blocker)
        assert await asyncio.to_thread(started.wait, 30)
        async with httpx.AsyncClient(timeout=60) as c:
            waiting = asyncio.create_task(c.post(f"{server}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}))
            while slot.worker.waiting < 1:
                await asyncio.sleep(0.01)
            refused = await c.post(f"{server}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
            gate.set()
            ok = await waiting
        async for _ in loop_job.items():
            pass
        return refused, ok

    try:
        refused, ok = asyncio.run(main())
    finally:
        gate.set()
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "overloaded"
    assert refused.headers["retry-after"] == "1"  # clients retry after it
    assert ok.status_code == 200


def test_serve_honours_max_queue(stories260k) -> None:
    from tandem.app.cli import build_parser
    from tandem.app.commands.serve import open_server

    args = build_parser().parse_args(["serve", "-m", str(stories260k), "--max-queue", "3", "--no-spec",
                                      "--ctx", "128", "--threads", "1"])
    slot, app = open_server(args)
    try:
        assert slot.worker.max_queue == 3
        assert app.state.server.config.max_queue == 3
    finally:
        slot.close()


# -- who may call ----------------------------------------------------------------------

@pytest.mark.parametrize(("headers", "status"), [
    ({"host": "evil.example"}, 403),  # DNS rebinding: a foreign name resolving to 127.0.0.1
    ({"host": "127.0.0.1.evil.example"}, 403),
    ({"origin": "https://evil.example", "content-type": "text/plain"}, 403),  # a page's simple POST
    ({"origin": "null"}, 403),
    ({"origin": "http://localhost:3000"}, 200),
    ({"host": "localhost:8080"}, 200),
    ({"host": "[::1]:8080"}, 200),
])
def test_host_and_origin_checks(server, headers: dict, status: int) -> None:
    r = httpx.post(f"{server}/v1/completions", content=json.dumps({"prompt": PROMPT, "max_tokens": 2}),
                   headers={"content-type": "application/json", **headers}, timeout=30)
    assert r.status_code == status, r.text
    if status == 403:
        assert r.json()["error"]["type"] == "permission_error"
    elif "origin" in headers:
        assert r.headers["access-control-allow-origin"] == headers["origin"]


def test_allowed_origin_and_preflight(own_slot) -> None:
    from tandem.app.server.asgi import ServerConfig, create_app

    app = create_app([own_slot], ServerConfig(allow_origins=("https://app.example",)))
    with running(app) as url:
        pre = httpx.options(f"{url}/v1/chat/completions", headers={
            "origin": "https://app.example", "access-control-request-method": "POST"}, timeout=10)
        assert pre.status_code == 204 and pre.headers["access-control-allow-origin"] == "https://app.example"
        bad = httpx.options(f"{url}/v1/chat/completions", headers={"origin": "https://evil.example"}, timeout=10)
        assert bad.status_code == 403
        r = httpx.get(f"{url}/v1/models", headers={"origin": "https://app.example"}, timeout=10)
        assert r.status_code == 200


def test_api_key(own_slot) -> None:
    from openai import AuthenticationError, OpenAI

    from tandem.app.server.asgi import ServerConfig, create_app

    app = create_app([own_slot], ServerConfig(api_key="s3cret-key"))
    with running(app) as url:
        assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401
        r = httpx.get(f"{url}/v1/models", headers={"authorization": "Bearer wrong-key!"}, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        # with the key, a non-loopback Host is fine (the key is the protection when bound to 0.0.0.0)
        r = httpx.get(f"{url}/v1/models", headers={"authorization": "Bearer s3cret-key", "host": "box.lan:8080"},
                      timeout=10)
        assert r.status_code == 200
        with pytest.raises(AuthenticationError):
            OpenAI(base_url=f"{url}/v1", api_key="nope-nope", max_retries=0, timeout=30).models.list()
        reply = OpenAI(base_url=f"{url}/v1", api_key="s3cret-key", max_retries=0, timeout=30).completions.create(
            model="stories", prompt=PROMPT, max_tokens=3)
        assert reply.choices[0].text


def _tandem(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tandem.app.cli", *argv], capture_output=True, text=True,
                          timeout=timeout)


def test_non_loopback_bind_needs_an_api_key(stories260k) -> None:
    p = _tandem("serve", "-m", str(stories260k), "--host", "0.0.0.0", "--port", str(free_port()))
    assert p.returncode != 0
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tandem: error:") and "--api-key" in lines[0]
    assert "Serving" not in p.stderr


def test_port_in_use_is_one_error_and_no_serving_line(stories260k) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        p = _tandem("serve", "-m", str(stories260k), "--port", str(port), "--no-spec")
    assert p.returncode != 0
    assert "Serving" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tandem: error: Cannot listen"), p.stderr


def test_no_suffix_cache_shared_between_clients(slot) -> None:
    """One client's text never becomes another client's drafts: the server's suffix drafter
    has no process-wide tree, unlike the CLI's."""
    from tandem.runtime.speculative.drafters.suffix import SuffixDrafter
    from tandem.runtime.speculative.factory import model_free_drafter

    def suffix_of(drafter) -> SuffixDrafter:
        found = [d for d in drafter.drafters if isinstance(d, SuffixDrafter)]
        assert len(found) == 1
        return found[0]

    assert suffix_of(slot.strategy.drafter).global_cache is None
    assert suffix_of(model_free_drafter(slot.target)).global_cache is not None  # the CLI default is shared


@contextlib.contextmanager
def _tandem_serve(model) -> Iterator[tuple[int, subprocess.Popen]]:
    """`tandem serve` in a subprocess; on leaving, it must have exited cleanly."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tandem.app.cli", "serve", "-m", str(model),
                             "--port", str(port), "--ctx", "2048", "--threads", "1", "--no-spec"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(proc, port, 60)
        yield port, proc
        # uvicorn re-raises the signal after its graceful shutdown, so the status says "terminated"
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _sigterm_mid_stream(model, path: str, body: dict) -> list:
    """Open a stream, SIGTERM the server after three events, return every event the client got."""
    with _tandem_serve(model) as (port, proc):
        events = []
        with httpx.stream("POST", f"http://127.0.0.1:{port}{path}", timeout=60, json=body) as r:
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                events.append(data if data == "[DONE]" else json.loads(data))
                if len(events) == 3:
                    proc.terminate()
    return events


def test_sigterm_ends_a_stream_with_an_error_event(real_models) -> None:
    """SIGTERM mid-stream: the client gets an error event and [DONE] at once, not a
    finish_reason that would pass the cut text off as the whole reply."""
    events = _sigterm_mid_stream(real_models.smollm2, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Count from 1 to 1000, one number per line."}],
        "max_tokens": 1900, "stream": True, "temperature": 0})
    assert events[-1] == "[DONE]"
    assert events[-2] == {"error": {"message": "The server is shutting down; retry against its next start.",
                                    "type": "server_error", "param": None, "code": "shutting_down"}}
    assert not [e for e in events[:-2] if e["choices"] and e["choices"][0]["finish_reason"]]
    assert sum(1 for e in events[:-1] if "choices" in e and e["choices"][0]["delta"].get("content")) < 1800


def test_sigterm_ends_an_infill_stream_with_a_last_event(real_models) -> None:
    events = _sigterm_mid_stream(real_models.smollm2, "/infill", {
        "input_prefix": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,", "n_predict": 1900, "stream": True,
        "t_max_predict_ms": 600_000})
    assert events[-1]["stop"] is True
    assert len(events) < 1800


def test_sigterm_answers_a_waiting_non_streaming_request(real_models) -> None:
    """A whole-reply request in flight at SIGTERM is answered at once, not cut off after
    the graceful-shutdown timeout, and with a 503: its reply was cut short (a 200 with the
    text so far said finish_reason "stop")."""
    with _tandem_serve(real_models.smollm2) as (port, proc):
        result: dict = {}

        def ask() -> None:
            result["r"] = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120, json={
                "messages": [{"role": "user", "content": "Count from 1 to 1000, one number per line."}],
                "max_tokens": 1900, "temperature": 0})

        t = threading.Thread(target=ask)
        t.start()
        deadline = time.monotonic() + 60

        def generating() -> bool:
            """The reply has tokens: the prompt's decode and two steps after it (a job
            stopped before its first token is answered like a queued one: 503)."""
            models = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()["models"].values()
            return any(m["busy"] and m["batch"]["decodes"] >= 3 for m in models)

        while not generating():
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.05)
        proc.terminate()
        t.join(60)
    r = result["r"]
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "shutting_down"


def test_requests_queued_at_shutdown_get_503(own_slot) -> None:
    """stop_all (the server shutting down) skips queued jobs: their clients get a JSON 503
    saying so, as does any request that still arrives."""
    from tandem.app.server.asgi import ServerConfig, create_app

    gate, started = threading.Event(), threading.Event()

    def blocker(cancel, lane):
        started.set()
        gate.wait(30)
        yield from ()

    with running(create_app([own_slot], ServerConfig())) as url:
        async def main():
            job = own_slot.worker.submit(blocker)
            assert await asyncio.to_thread(started.wait, 30)
            async with httpx.AsyncClient(timeout=60) as c:
                queued = asyncio.create_task(c.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}))
                while own_slot.worker.waiting < 1:
                    await asyncio.sleep(0.01)
                own_slot.worker.stop_all()
                gate.set()
                late = await c.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
                answer = await queued
            async for _ in job.items():
                pass
            return answer, late

        try:
            answer, late = asyncio.run(main())
        finally:
            gate.set()
    for r in (answer, late):
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "shutting_down"
