"""`tandem serve`: a real uvicorn server on 127.0.0.1 and a real HTTP client (httpx)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from live_server import free_port, running, sse_events

from tandem.kernels.sampling import Sampler
from tandem.kernels.sampling_params import SamplingParams
from tandem.runtime.generate import DoneEvent, generate

PROMPT = "Once upon a time"



@pytest.fixture(scope="module")
def server(stories260k):
    """One server for the module: stories260K, speculative default, real sockets."""
    from tandem.app.server.asgi import ServerConfig, create_app
    from tandem.app.server.loaded_models import make_slot
    from tandem.runtime.backends.llama import LlamaCppBackend
    from tandem.runtime.backends.llama_config import LlamaConfig

    target = LlamaCppBackend(stories260k, LlamaConfig(n_ctx=256, n_threads=1))
    slot = make_slot(target, name="stories")
    app = create_app([slot], ServerConfig(max_body_bytes=64 * 1024))
    with running(app, start_timeout=20) as url:
        yield url, slot
    target.close()




def _greedy_text(slot, prompt: str, n: int) -> str:
    with slot.engine.lock:
        ids = slot.target.tokenize(prompt, add_bos=True)
        done = list(generate(slot.target, ids, Sampler(SamplingParams.greedy_params()), max_tokens=n))[-1]
    assert isinstance(done, DoneEvent)
    return done.text


def test_models_and_health(server) -> None:
    url, _ = server
    r = httpx.get(f"{url}/v1/models")
    assert r.status_code == 200
    data = r.json()["data"]
    assert [m["id"] for m in data] == ["stories"]
    assert data[0]["meta"]["n_ctx"] == 256
    assert data[0]["meta"]["speculative"].startswith("on")  # speculative decoding is on by default
    assert httpx.get(f"{url}/health").json()["status"] == "ok"


def test_completion_matches_greedy_generation(server) -> None:
    url, slot = server
    r = httpx.post(f"{url}/v1/completions",
                   json={"model": "stories", "prompt": PROMPT, "max_tokens": 20, "temperature": 0}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == _greedy_text(slot, PROMPT, 20)
    assert body["usage"]["completion_tokens"] == 20
    assert body["choices"][0]["finish_reason"] == "length"


def test_chat_streaming_concatenates_to_full_reply(server) -> None:
    url, _ = server
    req = {"model": "stories", "messages": [{"role": "user", "content": "Tell me a story"}],
           "max_tokens": 24, "temperature": 0}
    full = httpx.post(f"{url}/v1/chat/completions", json=req, timeout=30).json()
    text = full["choices"][0]["message"]["content"]
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**req, "stream": True,
                      "stream_options": {"include_usage": True}}, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert streamed == text
    assert chunks[-1]["usage"]["total_tokens"] == full["usage"]["total_tokens"]
    assert any(c["choices"] and c["choices"][0]["finish_reason"] for c in chunks)


def test_n_drafts_are_superposed_and_distinct(server) -> None:
    url, _ = server
    r = httpx.post(f"{url}/v1/completions",
                   json={"prompt": PROMPT, "max_tokens": 12, "n": 3, "temperature": 0}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    texts = [c["text"] for c in body["choices"]]
    assert len(texts) == 3 and len(set(texts)) == 3
    sp = body["tandem"]["superposed"]
    assert sp["forward_passes"] == sp["steps"]  # prefill + one per later step, for all 3 drafts
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "n": 2, "stream": True, "temperature": 0},
            timeout=30) as r:
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    assert {c["choices"][0]["index"] for c in events[:-1]} == {0, 1}


def test_infill_llama_cpp_style(server) -> None:
    url, slot = server
    r = httpx.post(f"{url}/infill", json={"input_prefix": PROMPT, "input_suffix": "", "n_predict": 10}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["fim"] is False  # stories260K has no FIM tokens: a plain continuation
    assert body["content"] == _greedy_text(slot, PROMPT, 10)
    with httpx.stream("POST", f"{url}/infill", json={"input_prefix": PROMPT, "n_predict": 10, "stream": True},
                      timeout=30) as r:
        events = sse_events(r.iter_lines())
    assert "".join(e["content"] for e in events) == body["content"]
    assert events[-1]["stop"] is True


@pytest.mark.parametrize(
    ("path", "payload", "status", "code"),
    [
        ("/v1/chat/completions", b"{not json", 400, "invalid_json"),
        ("/v1/chat/completions", b"[1, 2]", 400, "invalid_json"),
        ("/v1/completions", json.dumps({"model": "nope", "prompt": "x"}).encode(), 404, "model_not_found"),
        ("/v1/chat/completions", json.dumps({"messages": []}).encode(), 400, "invalid_value"),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "user"}]}).encode(), 400, "invalid_value"),
        ("/v1/completions", json.dumps({"prompt": "x", "temperature": "hot"}).encode(), 400, "invalid_value"),
        ("/v1/completions", json.dumps({"prompt": "x", "n": 99}).encode(), 400, "invalid_value"),
        ("/v1/completions", json.dumps({"prompt": "x " * 3000}).encode(), 400, "context_length_exceeded"),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "story " * 3000}],
                                             "stream": True}).encode(), 400, "context_length_exceeded"),
        ("/v1/completions", b"x" * (64 * 1024 + 1), 413, "request_too_large"),
    ],
)
def test_bad_requests_get_json_4xx(server, path: str, payload: bytes, status: int, code: str) -> None:
    url, _ = server
    r = httpx.post(f"{url}{path}", content=payload, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["message"]


def test_unknown_route_is_json_404(server) -> None:
    url, _ = server
    r = httpx.get(f"{url}/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["message"]


def test_disconnect_cancels_generation(server) -> None:
    url, slot = server
    stats = slot.worker.stats
    before = stats.cancelled
    with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 10_000,
                      "stream": True, "temperature": 0.8, "seed": 1}, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                break  # got the first chunk: hang up mid-generation
    deadline = time.monotonic() + 20
    while stats.cancelled == before:
        assert time.monotonic() < deadline, "generation kept running after the client left"
        time.sleep(0.05)
    while slot.worker.busy:
        time.sleep(0.01)
    # the model is free again, and its cache holds a prompt + partial output, not 10k tokens
    assert len(slot.target.tokens) < slot.target.n_ctx
    r = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}, timeout=30)
    assert r.status_code == 200


def test_load_concurrent_streams_fifo_nothing_dropped(server) -> None:
    """8 concurrent clients x 3 streamed requests each on loopback: all complete, no errors."""
    url, slot = server
    completed_before, failed_before = slot.worker.stats.completed, slot.worker.stats.failed

    async def client(i: int, c: httpx.AsyncClient) -> list[str]:
        texts = []
        for j in range(3):
            async with c.stream("POST", f"{url}/v1/completions", json={
                    "prompt": PROMPT, "max_tokens": 8, "stream": True, "seed": i * 10 + j}) as r:
                assert r.status_code == 200
                events = sse_events([line async for line in r.aiter_lines()])
            assert events[-1] == "[DONE]"
            texts.append("".join(e["choices"][0]["text"] or "" for e in events[:-1] if e["choices"]))
        return texts

    async def main() -> list[list[str]]:
        async with httpx.AsyncClient(timeout=60) as c:
            return await asyncio.gather(*(client(i, c) for i in range(8)))

    start = time.monotonic()
    results = asyncio.run(main())
    assert time.monotonic() - start < 60
    assert len(results) == 8 and all(len(r) == 3 and all(t for t in r) for r in results)
    assert slot.worker.stats.completed - completed_before == 24
    assert slot.worker.stats.failed == failed_before


def test_tandem_serve_cli_subprocess(stories260k) -> None:
    """The real command: loopback by default, answers, and stops on SIGTERM."""
    import subprocess
    import sys

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tandem.app.cli", "serve", "-m", str(stories260k),
                             "--port", str(port), "--ctx", "128", "--threads", "1", "--no-spec"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "tandem serve did not come up"
                time.sleep(0.1)
        assert r.json()["data"][0]["meta"]["speculative"] == "off"
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def test_tandem_serve_bad_port_is_one_line_error(stories260k, capsys) -> None:
    from tandem.app.cli import main

    assert main(["serve", "-m", str(stories260k), "--port", "70000"]) != 0
    err = capsys.readouterr().err
    assert "Invalid port" in err and "Traceback" not in err


def test_openai_and_llama_server_penalties_are_honoured(server) -> None:
    """presence_penalty / frequency_penalty (OpenAI) and repeat_penalty / repeat_last_n
    (llama-server) were accepted and ignored: each reply now equals plain decoding with
    the same penalties."""
    url, slot = server
    for body, params in (({"frequency_penalty": 2.0, "presence_penalty": 2.0},
                          {"frequency_penalty": 2.0, "presence_penalty": 2.0}),
                         ({"repeat_penalty": 1.8, "repeat_last_n": 16}, {"repetition_penalty": 1.8, "repeat_last_n": 16})):
        r = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 60, "temperature": 0, **body},
                       timeout=30)
        with slot.engine.lock:
            ids = slot.target.tokenize(PROMPT, add_bos=True)
            done = list(generate(slot.target, ids, Sampler(SamplingParams(temperature=0.0, **params)),
                                 max_tokens=60))[-1]
        assert r.json()["choices"][0]["text"] == done.text
        assert done.text != _greedy_text(slot, PROMPT, 60)  # the penalties changed the reply
    for bad in ({"presence_penalty": 3}, {"modalities": ["text", "audio"]}, {"audio": {"voice": "alloy"}}):
        r = httpx.post(f"{url}/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **bad}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(bad)), r.text


@pytest.mark.parametrize(("field", "asks", "off"), [
    ("echo", True, False), ("best_of", 3, 1), ("mirostat", 2, 0), ("typical_p", 0.9, 1.0), ("tfs_z", 0.95, 1.0),
    ("dry_multiplier", 0.8, 0.0), ("xtc_probability", 0.5, 0.0), ("top_n_sigma", 1.0, -1), ("dynatemp_range", 0.5, 0.0),
    ("functions", [{"name": "get_weather", "parameters": {"type": "object"}}], []), ("function_call", "auto", "none"),
    ("web_search_options", {}, None), ("post_sampling_probs", True, False), ("lora", [{"id": 0, "scale": 1.0}], []),
])
def test_fields_not_implemented_are_refused_unless_they_ask_for_nothing(server, field, asks, off) -> None:
    """Accepted and ignored before: a legacy field or another llama-server sampler with a
    value that changes the reply is a 400 naming it; the value that turns it off is fine."""
    url, _ = server
    body = {"prompt": PROMPT, "max_tokens": 2}
    refused = httpx.post(f"{url}/v1/completions", json={**body, field: asks}, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == field, refused.text
    assert httpx.post(f"{url}/completion", json={**body, field: off}, timeout=30).status_code == 200
