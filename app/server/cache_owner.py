"""Whose text a model's KV cache holds: a cached prefix is reused only for its owner.

Every generation endpoint brings the one KV cache to its prompt by keeping the longest
prefix the cache already holds (``runtime.backends.protocol.prefill``). How much was kept
shows in the reply (``usage.prompt_tokens_details.cached_tokens``, /infill's
``tokens_cached``) and in the prompt time it saves (``ttft``, ``timings``), so a client
whose prompt met another client's text in the cache could measure how much of it
matches: a timing side channel on other people's prompts and replies. The rule: a prefix
is reused only by the client whose own request left the cache in exactly its present
state; for anybody else the cache is emptied first. All functions run on the model's
worker thread under the engine's lock.
"""

from __future__ import annotations

from tandem.app.server.models import ModelSlot
from tandem.runtime.backends.protocol import common_prefix_len


def client_identity(host: str | None, authorization: str | None) -> str:
    """Who a request comes from, for prefix reuse: peer address plus credentials."""
    return f"{host or ''}\n{authorization or ''}"


def reusable(slot: ModelSlot, client: str) -> bool:
    """The KV cache still holds exactly what ``client``'s own last request left there."""
    owner = slot.kv_owner  # one record for every route that generates
    return owner is not None and owner[0] == client and owner[1] == tuple(slot.target.tokens)


def take(slot: ModelSlot, client: str, prompt: list[int]) -> int:
    """Make the cache ``client``'s to use: emptied unless it is already its own. Returns
    how many of ``prompt``'s tokens the generation will reuse (``prefill`` re-evaluates at
    least the last one)."""
    if not reusable(slot, client):
        slot.target.truncate(0)
    slot.kv_owner = None  # until the request ends, nobody may rely on the cache's state
    return min(common_prefix_len(slot.target.tokens, prompt), max(0, len(prompt) - 1))


def release(slot: ModelSlot, client: str) -> None:
    """The request of ``client`` is over: what the cache holds now is its own text."""
    slot.kv_owner = (client, tuple(slot.target.tokens))
