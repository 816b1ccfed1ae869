"""Parallel slots through the HTTP server (SmolLM2-135M, two KV sequences): concurrent
requests are answered exactly as each is alone, their steps share llama.cpp decodes, and
/health reports the slots."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from live_server import serving

QUESTIONS = ["Name a colour.", "What is 2 + 2?", "Say hello in French.", "Name a planet."]


@pytest.fixture(scope="module")
def two_slot_server(real_models):
    with serving(real_models.smollm2, "smol", n_seq=2) as (url, slot):
        yield url, slot


async def _ask(c: httpx.AsyncClient, i: int, who: str) -> str:
    body = {"messages": [{"role": "user", "content": QUESTIONS[i]}], "max_tokens": 24, "temperature": 0}
    r = await c.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer {who}"})
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


def test_concurrent_requests_equal_their_solo_replies_and_share_decodes(two_slot_server) -> None:
    url, slot = two_slot_server
    assert len(slot.lanes) == 2 and slot.batcher is not None

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=300) as c:
            alone = [await _ask(c, i, f"solo-{i}") for i in range(len(QUESTIONS))]
            merged_before = slot.batcher.stats.merged
            together = await asyncio.gather(*(_ask(c, i, f"busy-{i}") for i in range(len(QUESTIONS))))
            health = (await c.get("/health")).json()
        return alone, list(together), slot.batcher.stats.merged - merged_before, health

    alone, together, merged, health = asyncio.run(main())
    assert together == alone
    assert merged > 0  # the two slots' steps went through shared llama_decode calls
    model = health["models"]["smol"]
    assert model["slots"] == 2 and model["failed"] == 0


def test_a_chats_next_turn_finds_its_previous_turns_cached(two_slot_server) -> None:
    """With several slots, each turn of a conversation goes to the slot that holds the
    turns before it, so only the new turn is read (before: the turns went round the
    slots, and each re-read the whole conversation)."""
    url, _ = two_slot_server
    messages: list[dict] = [{"role": "system", "content": "You are terse."}]
    seen: list[tuple[int, int]] = []
    with httpx.Client(base_url=url, timeout=300, headers={"authorization": "Bearer turns"}) as c:
        for question in QUESTIONS:
            messages.append({"role": "user", "content": question})
            r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 12, "temperature": 0})
            r.raise_for_status()
            body = r.json()
            messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
            seen.append((body["usage"]["prompt_tokens"], body["usage"]["prompt_tokens_details"]["cached_tokens"]))
    for (before, _), (_, cached) in zip(seen, seen[1:], strict=False):
        assert cached >= before, seen


def test_ignore_eos_generates_to_max_tokens(two_slot_server) -> None:
    """llama-server's ``ignore_eos`` (accepted and ignored before): the reply runs past the
    end of the turn to ``max_tokens``; /infill and n > 1 (whose drafts end where the model
    ends them) refuse it."""
    url, _ = two_slot_server
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 40, "temperature": 0}
    with httpx.Client(base_url=url, timeout=300) as c:
        short = c.post("/v1/chat/completions", json=body).json()
        long = c.post("/v1/chat/completions", json={**body, "ignore_eos": True}).json()
        infill = c.post("/infill", json={"input_prefix": "a", "input_suffix": "b", "ignore_eos": True})
        drafts = c.post("/v1/chat/completions", json={**body, "ignore_eos": True, "n": 2})
    assert short["choices"][0]["finish_reason"] == "stop" and short["usage"]["completion_tokens"] < 40
    assert long["choices"][0]["finish_reason"] == "length" and long["usage"]["completion_tokens"] == 40
    assert infill.status_code == 400 and infill.json()["error"]["param"] == "ignore_eos"
    assert drafts.status_code == 400 and drafts.json()["error"]["param"] == "ignore_eos"  # n drafts: not honoured

