"""A cached prompt prefix serves only the client that left it in the KV cache.

What a reply reveals of the cache (``usage.prompt_tokens_details.cached_tokens``, and the
prompt time it saves) must never tell one client how much of its prompt matched another
client's text. A client is its peer address plus its ``Authorization`` header; a real
uvicorn server on 127.0.0.1 and httpx clients bound to 127.0.0.1 / 127.0.0.2."""

from __future__ import annotations

import httpx
import pytest
from live_server import running, sse_events

MESSAGES = [{"role": "system", "content": "You tell short stories about animals."},
            {"role": "user", "content": "Once upon a time there was a little dog who"}]
REQUESTS = {
    "/v1/chat/completions": {"messages": MESSAGES, "max_tokens": 4, "temperature": 0},
    "/v1/completions": {"prompt": "Once upon a time there was a little dog who liked to play", "max_tokens": 4,
                        "temperature": 0},
}


@pytest.fixture(scope="module")
def server(stories260k):
    from tandem.app.server.asgi import ServerConfig, create_app
    from tandem.app.server.loaded_models import make_slot
    from tandem.runtime.backends.llama import LlamaCppBackend
    from tandem.runtime.backends.llama_config import LlamaConfig

    slot = make_slot(LlamaCppBackend(stories260k, LlamaConfig(n_ctx=256, n_threads=1)), name="stories")
    with running(create_app([slot], ServerConfig())) as url:
        yield url
    slot.close()


def _usage(url: str, path: str, *, source: str = "127.0.0.1", key: str | None = None, stream: bool = False) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = REQUESTS[path] | ({"stream": True, "stream_options": {"include_usage": True}} if stream else {})
    with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=60) as client:
        r = client.post(f"{url}{path}", json=body, headers=headers)
    assert r.status_code == 200, r.text
    if stream:
        return [e for e in sse_events(r.text.splitlines()) if e != "[DONE]" and e.get("usage")][-1]["usage"]
    return r.json()["usage"]


def _cached(use: dict) -> int:
    return use["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("path", list(REQUESTS))
@pytest.mark.parametrize("other", [{"source": "127.0.0.2"}, {"key": "someone-else"}])
def test_prefix_is_reused_only_by_its_owner(server, path: str, other: dict) -> None:
    _usage(server, path)
    again = _usage(server, path)
    assert 0 < _cached(again) < again["prompt_tokens"]  # the same client reuses its own prefix
    stranger = _usage(server, path, **other)
    assert _cached(stranger) == 0  # the same prompt from someone else: nothing reused, nothing revealed
    assert _cached(_usage(server, path, **other)) > 0  # the stranger now reuses its own
    assert _cached(_usage(server, path)) == 0  # and the first client no longer finds its text


def test_streamed_usage_reports_the_same(server) -> None:
    path = "/v1/chat/completions"
    _usage(server, path, stream=True)
    assert _cached(_usage(server, path, stream=True)) > 0
    assert _cached(_usage(server, path, source="127.0.0.2", stream=True)) == 0


def test_infill_and_chat_share_the_rule(server) -> None:
    """One cache, one owner: a stranger's /v1/completions does not reuse what another
    client's /infill left, whatever the route."""
    def fill() -> None:
        with httpx.Client(timeout=60) as client:
            r = client.post(f"{server}/infill", json={"prompt": REQUESTS["/v1/completions"]["prompt"],
                                                       "n_predict": 0})  # only fills the cache
        assert r.status_code == 200, r.text

    fill()
    assert _cached(_usage(server, "/v1/completions", source="127.0.0.2")) == 0
    fill()
    assert _cached(_usage(server, "/v1/completions")) > 0  # the infill's prefix matches: its owner reuses it
