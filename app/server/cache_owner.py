"""Whose text a slot's KV cache holds: a cached prefix is reused only for its owner.

Every generation endpoint brings its lane's KV cache (one per parallel slot) to its prompt by keeping the longest
prefix the cache already holds (``runtime.backends.protocol.prefill``). How much was kept
shows in the reply (``usage.prompt_tokens_details.cached_tokens``, /infill's
``tokens_cached``) and in the prompt time it saves (``ttft``, ``timings``), so a client
whose prompt met another client's text in the cache could measure how much of it
matches: a timing side channel on other people's prompts and replies. The rule: a prefix
is reused only by the client whose own request left the cache in exactly its present
state; for anybody else the cache is emptied first. All functions run on the lane's
worker thread under the lane's lock. The worker sends a client back to a lane that holds
its text when one is free (:mod:`.worker`).
"""

from __future__ import annotations

from tandem.app.server.loaded_models import Lane
from tandem.runtime.backends.protocol import reused


def client_identity(host: str | None, authorization: str | None) -> str:
    """Who a request comes from, for prefix reuse: peer address plus credentials."""
    return f"{host or ''}\n{authorization or ''}"


def reusable(lane: Lane, client: str) -> bool:
    """The KV cache still holds exactly what ``client``'s own last request left there."""
    owner = lane.kv_owner  # one record for every route that generates
    return owner is not None and owner[0] == client and owner[1] == tuple(lane.target.tokens)


def take(lane: Lane, client: str, prompt: list[int]) -> int:
    """Make the cache ``client``'s to use: emptied unless it is already its own. Returns
    how many of ``prompt``'s tokens the generation will reuse."""
    if not reusable(lane, client):
        lane.target.truncate(0)
    lane.kv_owner = None  # until the request ends, nobody may rely on the cache's state
    return reused(lane.target, prompt)


def release(lane: Lane, client: str) -> None:
    """The request of ``client`` is over: what the cache holds now is its own text."""
    lane.kv_owner = (client, tuple(lane.target.tokens))
