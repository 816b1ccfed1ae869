"""A bounded loopback load test on the real Qwen2.5-Coder-0.5B: 16 concurrent clients
(the `openai` package, async) x 3 chat requests each, a few tokens per reply, behind the
same uvicorn setup as `tandem serve`. Every request is answered, in full, with no error;
the latencies are printed (p50/p95) for BENCHMARKS, never asserted."""

from __future__ import annotations

import asyncio
import statistics
import time

import pytest
from live_server import running

CLIENTS, REQUESTS, TOKENS = 16, 3, 4



@pytest.fixture(scope="module")
def qwen_server(real_models):
    from tandem.app.server.asgi import ServerConfig, create_app
    from tandem.app.server.loaded_models import make_slot
    from tandem.runtime.backends.opener import open_backend

    slot = make_slot(open_backend(real_models.qwen_05b, n_ctx=1024), name="qwen", max_queue=CLIENTS * REQUESTS)
    with running(create_app([slot], ServerConfig(max_queue=CLIENTS * REQUESTS)), start_timeout=60) as url:
        yield f"{url}/v1", slot
    slot.close()


def test_sixteen_clients_all_served(qwen_server) -> None:
    from openai import AsyncOpenAI

    url, slot = qwen_server
    before = slot.worker.stats.completed

    async def client(i: int, api: AsyncOpenAI) -> list[float]:
        took = []
        for j in range(REQUESTS):
            start = time.monotonic()
            reply = await api.chat.completions.create(
                model="qwen", max_tokens=TOKENS, temperature=0.7, seed=i * 100 + j,
                messages=[{"role": "user", "content": f"Client {i}, request {j}: name a prime number."}])
            took.append(time.monotonic() - start)
            assert reply.choices[0].message.content is not None
            assert reply.usage.completion_tokens <= TOKENS
        return took

    async def main() -> list[list[float]]:
        async with AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600) as api:
            return await asyncio.gather(*(client(i, api) for i in range(CLIENTS)))

    start = time.monotonic()
    latencies = sorted(t for ts in asyncio.run(main()) for t in ts)
    wall = time.monotonic() - start
    assert len(latencies) == CLIENTS * REQUESTS
    assert slot.worker.stats.completed - before == CLIENTS * REQUESTS
    assert slot.worker.stats.failed == 0
    p95 = latencies[min(len(latencies) - 1, round(0.95 * (len(latencies) - 1)))]
    print(f"\nload: {CLIENTS} clients x {REQUESTS} requests x {TOKENS} tokens on Qwen2.5-Coder-0.5B: "
          f"all {len(latencies)} served, p50 {statistics.median(latencies):.2f} s, p95 {p95:.2f} s, "
          f"wall {wall:.1f} s")
