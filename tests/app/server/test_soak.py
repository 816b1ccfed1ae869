"""The soak test: `tandem serve` on the real SmolLM2-135M with two parallel slots under
mixed traffic for ``TANDEM_SOAK_S`` seconds (default 300; an hour:
``TANDEM_SOAK_S=3600 .venv/bin/python -m pytest tests/app/server/test_soak.py -q -s``).

Traffic, all to 127.0.0.1: chat (whole and streamed, greedy and seeded), completions,
an editor's /infill bursts (each newer request supersedes the older ones of the burst),
streams the client abandons after their first token, and hostile requests. It holds that

* every reply is the reply the same request gets alone on the idle server (token for
  token: greedy, or seeded), computed first; each request carries its own credentials, so
  none reuses another's cached prefix (a prompt split differently would be computed
  differently, see ``runtime/backends/protocol.py::prefill``);
* no 5xx, no traceback in the server's log, no failed job;
* the server's resident memory stays within 5 % of what it was after warm-up (the
  reference pass plus the first fifth of the run);
* an /infill superseded by its burst's newer one is answered 499 ``superseded`` (or in
  full and correct, when it finished first).

The run stops by itself at its deadline; it waits for conditions (the server answering,
replies), never for fixed sleeps.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from live_server import free_port

SOAK_S = float(os.environ.get("TANDEM_SOAK_S", "300"))
RSS_TOLERANCE = 0.05

CHATS = [
    {"messages": [{"role": "user", "content": "Name three rivers in Europe."}], "max_tokens": 24, "temperature": 0},
    {"messages": [{"role": "system", "content": "Answer in one sentence."},
                  {"role": "user", "content": "Why is the sky blue?"}], "max_tokens": 24, "temperature": 0},
    {"messages": [{"role": "user", "content": "Write a Python function that reverses a string."}],
     "max_tokens": 32, "temperature": 0},
    {"messages": [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
                  {"role": "user", "content": "Tell me a fact about cats."}], "max_tokens": 24, "temperature": 0},
    {"messages": [{"role": "user", "content": "Give me a name for a dog."}], "max_tokens": 16,
     "temperature": 0.8, "seed": 7},
    {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 24, "temperature": 0,
     "logit_bias": {"28": -100, "30": 3}, "presence_penalty": 0.5},
    {"messages": [{"role": "user", "content": "Repeat this line: the quick brown fox jumps over the lazy dog"}],
     "max_tokens": 24, "temperature": 0,
     "prediction": {"type": "content", "content": "The quick brown fox jumps over the lazy cat"}},
]
COMPLETIONS = [
    {"prompt": "def add(a, b):\n    return", "max_tokens": 16, "temperature": 0},
    {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0},
    {"prompt": "<|im_start|>user\nName a fruit.<|im_end|>\n<|im_start|>assistant\n", "max_tokens": 12,
     "temperature": 0},
]


def infill_burst(n: int) -> list[dict]:
    """An editor typing: the same file, one more character each keystroke."""
    word = ["total", "count", "value"][n % 3]
    prefix = "def summarise(items):\n    " + word
    return [{"input_prefix": prefix[: len(prefix) - 2 + i], "input_suffix": "\n    return result\n",
             "n_predict": 16, "cache_prompt": False, "temperature": 0} for i in range(3)]


BURSTS = [infill_burst(n) for n in range(3)]

HOSTILE: list[tuple[str, str, bytes]] = [
    ("POST", "/v1/chat/completions", b"{"),
    ("POST", "/v1/chat/completions", b'{"messages": "hello"}'),
    ("POST", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": -3}'),
    ("POST", "/v1/chat/completions", b'{"model": "nope", "messages": [{"role": "user", "content": "x"}]}'),
    ("POST", "/v1/chat/completions", b"\xff\xfe\x00garbage"),
    ("POST", "/v1/completions", json.dumps({"prompt": "word " * 3000, "max_tokens": 4}).encode()),
    ("POST", "/infill", b'{"input_extra": 5}'),
    ("POST", "/infill", b'{"n_indent": "deep"}'),
    ("POST", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"9999999": 1}}'),
    ("POST", "/tokenize", b'{"content": 5}'),
    ("POST", "/detokenize", b'{"tokens": [-1]}'),
    ("POST", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "prediction": {"type": 1}}'),
    ("GET", "/v1/nothing-here", b""),
    ("DELETE", "/v1/models", b""),
]


@dataclass
class Tally:
    replies: int = 0
    checked: int = 0
    superseded: int = 0
    abandoned: int = 0
    hostile: int = 0
    problems: list[str] = field(default_factory=list)
    rss: list[tuple[float, int]] = field(default_factory=list)
    replied: asyncio.Event = field(default_factory=asyncio.Event)

    def reply(self) -> None:
        self.replies += 1
        self.replied.set()


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


_ids = itertools.count()


def own_identity() -> dict[str, str]:
    """Credentials of a client of one request (the server has no key: they only name the
    client, whose cached prefix is then its own)."""
    return {"authorization": f"Bearer soak-{next(_ids)}"}


async def chat_text(c: httpx.AsyncClient, body: dict, *, stream: bool, headers: dict | None = None) -> str:
    headers = headers or own_identity()
    if not stream:
        r = await c.post("/v1/chat/completions", json=body, headers=headers)
        r.raise_for_status()
        return r.json()["choices"][0]["message"]["content"]
    parts = []
    async with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}, headers=headers) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                ev = json.loads(line[5:])
                if ev["choices"]:
                    parts.append(ev["choices"][0]["delta"].get("content") or "")
    return "".join(parts)


async def completion_text(c: httpx.AsyncClient, body: dict) -> str:
    r = await c.post("/v1/completions", json=body, headers=own_identity())
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


async def infill_reply(c: httpx.AsyncClient, body: dict, headers: dict) -> httpx.Response:
    return await c.post("/infill", json=body, headers=headers)


async def references(c: httpx.AsyncClient) -> dict[str, str]:
    """Every request alone, one after another, on the idle server."""
    ref: dict[str, str] = {}
    for i, body in enumerate(CHATS):
        ref[f"chat{i}"] = await chat_text(c, body, stream=False)
    for i, body in enumerate(COMPLETIONS):
        ref[f"completion{i}"] = await completion_text(c, body)
    for b, burst in enumerate(BURSTS):
        for k, body in enumerate(burst):
            r = await infill_reply(c, body, own_identity())
            r.raise_for_status()
            ref[f"infill{b}.{k}"] = r.json()["content"]
    return ref


async def chat_client(c, ref, tally: Tally, deadline: float, stream: bool, offset: int) -> None:
    for n in itertools.count(offset):
        if time.monotonic() > deadline:
            return
        i = n % len(CHATS)
        text = await chat_text(c, CHATS[i], stream=stream)
        tally.reply()
        tally.checked += 1
        if text != ref[f"chat{i}"]:
            tally.problems.append(f"chat{i} (stream={stream}): {text!r} != {ref[f'chat{i}']!r}")


async def completion_client(c, ref, tally: Tally, deadline: float) -> None:
    for n in itertools.count():
        if time.monotonic() > deadline:
            return
        i = n % len(COMPLETIONS)
        text = await completion_text(c, COMPLETIONS[i])
        tally.reply()
        tally.checked += 1
        if text != ref[f"completion{i}"]:
            tally.problems.append(f"completion{i}: {text!r} != {ref[f'completion{i}']!r}")


async def editor(c, ref, tally: Tally, deadline: float) -> None:
    for n in itertools.count():
        if time.monotonic() > deadline:
            return
        b = n % len(BURSTS)
        who = own_identity()  # one editor session: its keystrokes supersede each other
        replies = await asyncio.gather(*(infill_reply(c, body, who) for body in BURSTS[b]))
        completed = 0
        for k, r in enumerate(replies):
            tally.reply()
            if r.status_code == 499 and r.json()["error"]["code"] == "superseded":
                tally.superseded += 1
                continue
            if r.status_code != 200:
                tally.problems.append(f"infill{b}.{k}: {r.status_code} {r.text[:200]}")
                continue
            completed += 1
            tally.checked += 1
            if r.json()["content"] != ref[f"infill{b}.{k}"]:
                tally.problems.append(f"infill{b}.{k}: {r.json()['content']!r} != {ref[f'infill{b}.{k}']!r}")
        if completed == 0:
            tally.problems.append(f"burst {b}: every request superseded")


async def abandoning_client(c, tally: Tally, deadline: float) -> None:
    """Streams a chat reply and hangs up after its first token."""
    body = {**CHATS[2], "max_tokens": 200, "stream": True}
    while time.monotonic() < deadline:
        async with c.stream("POST", "/v1/chat/completions", json=body, headers=own_identity()) as r:
            if r.status_code != 200:
                tally.problems.append(f"abandoned stream got {r.status_code}")
                return
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    break
        tally.abandoned += 1
        tally.replied.set()


async def observer(c, pid: int, tally: Tally, deadline: float) -> None:
    """After each reply the others get: one hostile request, a /health and an RSS sample."""
    for method, path, raw in itertools.cycle(HOSTILE):
        try:
            await asyncio.wait_for(tally.replied.wait(), timeout=max(0.01, deadline - time.monotonic()))
        except TimeoutError:
            return
        tally.replied.clear()
        r = await c.request(method, path, content=raw, headers={"content-type": "application/json"})
        tally.hostile += 1
        if not 400 <= r.status_code < 500:
            tally.problems.append(f"hostile {method} {path} {raw[:40]!r}: {r.status_code}")
        health = await c.get("/health")
        if health.status_code != 200:
            tally.problems.append(f"/health: {health.status_code}")
        tally.rss.append((time.monotonic(), rss_bytes(pid)))


async def soak(url: str, pid: int) -> tuple[Tally, float]:
    tally = Tally()
    # a connection per request: a pooled keep-alive connection the server closes for
    # idleness (5 s) just as the client reuses it is a client-side race, not the server's
    limits = httpx.Limits(max_connections=32, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as c:
        ref = await references(c)
        start = time.monotonic()
        deadline = start + SOAK_S
        await asyncio.gather(
            chat_client(c, ref, tally, deadline, stream=False, offset=0),
            chat_client(c, ref, tally, deadline, stream=True, offset=2),
            completion_client(c, ref, tally, deadline),
            editor(c, ref, tally, deadline),
            abandoning_client(c, tally, deadline),
            observer(c, pid, tally, deadline),
        )
        health = (await c.get("/health")).json()
    if health["models"] and any(m["failed"] for m in health["models"].values()):
        tally.problems.append(f"failed jobs: {health}")
    return tally, start + SOAK_S / 5


@pytest.mark.soak
def test_soak_mixed_traffic_on_parallel_slots(real_models, tmp_path) -> None:
    port = free_port()
    log = tmp_path / "server.log"
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "tandem.app.cli", "serve", "-m", str(real_models.smollm2),
                                 "--port", str(port), "--ctx", "1024", "--threads", "1", "--parallel", "2",
                                 "--request-log", "off"], stdout=subprocess.DEVNULL, stderr=err)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                httpx.get(f"{url}/health", timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "tandem serve did not come up"
                time.sleep(0.1)
        try:
            tally, warm = asyncio.run(soak(url, proc.pid))
        except httpx.TransportError as exc:
            raise AssertionError(f"{exc!r}; server log: {log.read_text()[-3000:]}") from exc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    server_log = log.read_text()
    warm_rss = max(r for t, r in tally.rss if t <= warm)
    later = [r for t, r in tally.rss if t > warm]
    print(f"\nsoak {SOAK_S:.0f} s: {tally.replies} replies ({tally.checked} checked), {tally.superseded} superseded, "
          f"{tally.abandoned} abandoned, {tally.hostile} hostile; RSS after warm-up {warm_rss / 2**20:.1f} MiB, "
          f"later max {max(later) / 2**20:.1f} MiB")
    assert not tally.problems, tally.problems[:10]
    assert "Traceback" not in server_log, server_log[-3000:]
    assert tally.checked > 0 and tally.abandoned > 0 and tally.hostile > 0
    assert later and max(later) <= warm_rss * (1 + RSS_TOLERANCE)
