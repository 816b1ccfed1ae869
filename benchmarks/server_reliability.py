"""Reliability probes of the server (BENCHMARKS "Reliability"): /health latency while a
huge prompt is tokenized, memory while an oversized body is refused, and half-open
connections closed. Runs the same uvicorn setup as `tandem serve`, in this process, so
the resident memory it reports is the server's.

    python -m benchmarks.server_reliability MODEL.gguf [--prompt-mb 8] [--body-mb 100]
"""

from __future__ import annotations

import argparse
import os
import socket
import threading
import time

import httpx

from tandem.app.server.asgi import ServerConfig, create_app
from tandem.app.server.listen import ListenConfig, uvicorn_server
from tandem.app.server.loaded_models import make_slot
from tandem.runtime.backends.opener import open_backend


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def health_during_big_prompt(url: str, prompt_mb: int) -> str:
    result: dict = {}

    def big() -> None:
        t = time.monotonic()
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "tale " * (prompt_mb * 2**20 // 5 - 20),
                                                      "max_tokens": 1}, timeout=600)
        result["status"], result["s"] = r.status_code, time.monotonic() - t

    th = threading.Thread(target=big)
    th.start()
    worst, n = 0.0, 0
    while th.is_alive():
        t = time.monotonic()
        httpx.get(f"{url}/health", timeout=600)
        worst, n = max(worst, time.monotonic() - t), n + 1
        time.sleep(0.05)
    th.join()
    return (f"{prompt_mb} MB prompt: status {result['status']} after {result['s']:.1f} s; "
            f"/health answered {n} times meanwhile, worst {worst * 1000:.0f} ms")


def oversized_body(port: int, body_mb: int) -> str:
    before = rss_mb()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n"
                 b"Content-Type: application/json\r\n\r\n")
    chunk, sent = b"x" * 65536, 0
    try:
        while sent < body_mb * 2**20:
            sock.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
            sent += len(chunk)
    except OSError:
        pass
    sock.settimeout(10)
    try:
        head = sock.recv(64).split(b"\r\n")[0].decode("latin-1")
    except OSError:
        head = "(connection reset)"
    sock.close()
    return f"{body_mb} MB chunked body: reply {head!r}; server RSS growth {rss_mb() - before:.1f} MB"


def half_open(port: int, n: int, timeout: float) -> str:
    conns = []
    for _ in range(n):
        c = socket.create_connection(("127.0.0.1", port))
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 1")
        conns.append(c)
    start, closed = time.monotonic(), 0
    for c in conns:
        c.settimeout(timeout * 3)
        try:
            closed += c.recv(16) == b""
        except OSError:
            closed += 1
        c.close()
    return f"{n} half-open connections: {closed} closed by the server within {time.monotonic() - start:.1f} s"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--prompt-mb", type=int, default=8)
    p.add_argument("--body-mb", type=int, default=100)
    p.add_argument("--half-open", type=int, default=200)
    args = p.parse_args()
    slot = make_slot(open_backend(args.model, n_ctx=2048), name="m")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    listen = ListenConfig("127.0.0.1", port)
    srv = uvicorn_server(create_app([slot], ServerConfig()), listen)
    threading.Thread(target=srv.run, daemon=True).start()
    while not srv.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    try:
        print(health_during_big_prompt(url, args.prompt_mb), flush=True)
        print(oversized_body(port, args.body_mb), flush=True)
        print(half_open(port, args.half_open, listen.header_timeout_s), flush=True)
    finally:
        srv.should_exit = True
        slot.close()


if __name__ == "__main__":
    main()
