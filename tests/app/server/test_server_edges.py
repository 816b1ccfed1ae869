"""`tandem serve` as a real process at its edges: broken request bodies leave no
traceback in its log, SIGTERM exits 0 after the server's own cleanup, unsupported
fields get a 400 naming them, and a model llama.cpp cannot load is one line of error."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
from live_server import free_port, wait_healthy

TANDEM = Path(sys.executable).with_name("tandem")


def raw(port: int, head: bytes, body: bytes) -> bytes:
    """Send a request's head and part of a body, then close; what came back, if anything."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head + body)
        s.shutdown(socket.SHUT_WR)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except OSError:
            pass
        return out


def post_head(port: int, extra: str) -> bytes:
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: application/json\r\n{extra}\r\n").encode()


def test_broken_bodies_signals_and_unsupported_fields(real_models) -> None:
    port = free_port()
    proc = subprocess.Popen([str(TANDEM), "serve", "-m", str(real_models.smollm2), "--port", str(port), "--ctx", "1024",
                             "--threads", "1", "--no-spec", "--request-log", "off"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(proc, port, 120)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        # a chunk size that is not hex, a body cut after 5 bytes, a chunk size past any limit
        raw(port, post_head(port, "Transfer-Encoding: chunked\r\n"), b"zz\r\n{}\r\n0\r\n\r\n")
        raw(port, post_head(port, "Content-Length: 100\r\n"), b'{"mes')
        raw(port, post_head(port, "Transfer-Encoding: chunked\r\n"), b"fffffffffffffff\r\n" + b"x" * 300)
        raw(port, post_head(port, "Transfer-Encoding: chunked\r\n"), b"5\r\n{\"mes")
        ok = httpx.post(url, timeout=120, json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        assert ok.status_code == 200  # still serving
        image = httpx.post(url, timeout=30, json={"messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]})
        assert image.status_code == 400
        assert "messages[0].content[1]" in image.json()["error"]["message"]
        assert "image_url" in image.json()["error"]["message"]
        bias = httpx.post(url, timeout=30, json={"messages": [{"role": "user", "content": "Hi"}],
                                                 "logit_bias": {"1000000": 100}})  # past the vocabulary
        assert bias.status_code == 400 and bias.json()["error"]["param"] == "logit_bias"
        empty_bias = httpx.post(url, timeout=120, json={"messages": [{"role": "user", "content": "Hi"}],
                                                        "logit_bias": {}, "max_tokens": 2})
        assert empty_bias.status_code == 200  # nothing asked: nothing to refuse
        history = [{"role": "user", "content": "hi"}] * 400 + [{"role": "user", "content": "word " * 3000}]
        huge = httpx.post(url, timeout=60, json={"messages": history, "max_tokens": 8})
        assert huge.status_code == 400 and huge.json()["error"]["code"] == "context_length_exceeded"
        assert "401 messages" in huge.json()["error"]["message"]  # how big it was
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        log = proc.stderr.read() if proc.stderr else ""
        assert code == 0, log
        assert "Traceback" not in log and "Exception in ASGI" not in log, log
        assert "Stopped: the model is closed." in log  # printed after the slot's close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_model_llama_cpp_cannot_load_is_one_line(real_models, tmp_path, monkeypatch) -> None:
    """A tensor renamed (the GGUF stays well formed): llama.cpp refuses it, and the user
    reads one line with its reason; ``TANDEM_LLAMA_LOG=1`` shows llama.cpp's log."""
    bad = tmp_path / "renamed-tensor.gguf"
    shutil.copyfile(real_models.smollm2, bad)
    with bad.open("r+b") as f:
        head = f.read(4 << 20)
        at = head.find(b"blk.5.attn_q.weight")
        assert at > 0
        f.seek(at)
        f.write(b"blk.5.attn_x.weight")
    argv = [str(TANDEM), "run", "-m", str(bad), "-p", "hi", "-n", "2", "--threads", "1"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "blk.5.attn_q.weight" in lines[0] and "Traceback" not in done.stderr
    monkeypatch.setenv("TANDEM_LLAMA_LOG", "1")
    loud = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert loud.returncode != 0 and len(loud.stderr.strip().splitlines()) > 5
