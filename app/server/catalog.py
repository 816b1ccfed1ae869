"""What ``GET /v1/models`` lists besides the served models: the local store's GGUF files.

Each comes with what a client needs to pick one — architecture, file size, trained
context length — and a memory estimate read from the GGUF header alone: weights plus
an f16 KV cache at a given context. The full memory planner (``tandem plan``) prices
more (compute buffers, the drafter, this machine's budget) but takes seconds per model,
too slow for a listing that clients fetch at start-up.
"""

from __future__ import annotations

from typing import Any

from tandem.models.errors import TandemError
from tandem.models.gguf_file import GGUFInfo, inspect_gguf
from tandem.models.store import ModelEntry, list_models

PLAN_CTX = 4096
"""Context the estimate is priced at (``tandem run``'s default cap), or the trained one if smaller."""


def kv_bytes(info: GGUFInfo, n_ctx: int) -> int | None:
    """f16 K and V for every layer at ``n_ctx`` cells (``None`` if the header lacks a size)."""
    n_layer = info.arch_value("block_count")
    n_embd = info.arch_value("embedding_length")
    n_head = info.arch_value("attention.head_count")
    n_head_kv = info.arch_value("attention.head_count_kv", n_head)
    if not all(isinstance(v, int) and v > 0 for v in (n_layer, n_embd, n_head, n_head_kv)):
        return None
    head_dim = info.arch_value("attention.key_length", n_embd // n_head)
    return 2 * 2 * n_layer * n_ctx * n_head_kv * head_dim


def store_model(entry: ModelEntry) -> dict[str, Any]:
    """One ``/v1/models`` item for a store file that this server does not serve."""
    meta: dict[str, Any] = {"served": False, "source": entry.source.split(":")[0], "architecture": entry.architecture,
                            "size_bytes": entry.size_bytes}
    try:
        info = inspect_gguf(entry.path)
    except TandemError as exc:
        meta["error"] = str(exc)
        return {"id": entry.name, "object": "model", "owned_by": "tandem", "meta": meta}
    trained = info.arch_value("context_length")
    ctx = min(PLAN_CTX, trained) if isinstance(trained, int) and trained > 0 else PLAN_CTX
    kv = kv_bytes(info, ctx)
    meta.update(context_length=trained, memory_plan={
        "n_ctx": ctx, "weights_bytes": info.weights_bytes, "kv_cache_bytes": kv,
        "total_bytes": info.weights_bytes + kv if kv is not None else None})
    return {"id": entry.name, "object": "model", "owned_by": "tandem", "meta": meta}


def store_models(served: set[str]) -> list[dict[str, Any]]:
    """Store models not among ``served`` (their ids), in store order."""
    return [store_model(e) for e in list_models() if e.name not in served]
